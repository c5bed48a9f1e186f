"""The module import graph of scanlang/, backends/ and recipes/ has no cycle.

Built with `ast` from the source files: every import statement counts, at the top of a module or
inside a function body, with relative imports resolved and the package mapping of pyproject.toml
(backends/ installs as scanlang.backends, recipes/ as scanlang.recipes). `from pkg import name`
is an edge to the submodule pkg.name when there is one, else to pkg. Tools (scanlang/tools/ and the
`scanlang` command, scanlang/cli.py and __main__.py) may import anything; nothing else may import a tool.
"""
from __future__ import annotations

import ast
import pathlib

ROOT = pathlib.Path(__file__).resolve().parent.parent
PACKAGES = {"scanlang": "scanlang", "backends": "scanlang.backends", "recipes": "scanlang.recipes"}


def is_tool(module: str) -> bool:
    """The CLI and scanlang/tools/ (benchmarks, offline compile reports, host profilers): they may
    import anything; nothing in the library imports them."""
    return module in ("scanlang.cli", "scanlang.__main__", "scanlang.tools") or module.startswith("scanlang.tools.")


def modules() -> dict[str, tuple[pathlib.Path, bool]]:
    """module name -> (file, is a package's __init__)."""
    found = {}
    for folder, package in PACKAGES.items():
        for path in sorted((ROOT / folder).rglob("*.py")):
            parts = list(path.relative_to(ROOT / folder).with_suffix("").parts)
            init = parts[-1] == "__init__"
            found[".".join([package] + (parts[:-1] if init else parts))] = (path, init)
    return found


def imported(module: str, init: bool, node: ast.AST, known) -> set[str]:
    """The known modules one import statement of `module` names."""
    if isinstance(node, ast.Import):
        names = [alias.name for alias in node.names]
    else:
        if node.level:
            base = module.split(".") if init else module.split(".")[:-1]
            base = base[:len(base) - (node.level - 1)]
            source = ".".join(base + ([node.module] if node.module else []))
        else:
            source = node.module
        names = [f"{source}.{a.name}" if f"{source}.{a.name}" in known else source for a in node.names]
    out = set()
    for name in names:
        while name and name not in known:   # `import a.b.c` of a module a.b with a name c
            name = name.rpartition(".")[0]
        if name and name != module:
            out.add(name)
    return out


def graph() -> dict[str, set[str]]:
    known = modules()
    edges = {}
    for module, (path, init) in known.items():
        tree = ast.parse(path.read_text(), filename=str(path))
        edges[module] = set().union(*[imported(module, init, n, known) for n in ast.walk(tree)
                                      if isinstance(n, (ast.Import, ast.ImportFrom))])
    return edges


def find_cycle(edges: dict[str, set[str]]) -> list[str] | None:
    """One cycle among the non-tool modules as [a, b, ..., a], or None."""
    state: dict[str, int] = {}   # 1 on the current path, 2 done
    path: list[str] = []

    def visit(v):
        state[v] = 1
        path.append(v)
        for w in sorted(edges[v]):
            if is_tool(w):
                continue
            if state.get(w) == 1:
                return path[path.index(w):] + [w]
            if w not in state:
                cycle = visit(w)
                if cycle:
                    return cycle
        path.pop()
        state[v] = 2
        return None

    for v in sorted(edges):
        if not is_tool(v) and v not in state:
            cycle = visit(v)
            if cycle:
                return cycle
    return None


def test_the_graph_sees_the_mapped_packages_and_function_level_imports():
    edges = graph()
    assert "scanlang.backends.triton.ops" in edges and "scanlang.recipes.kalman.filter" in edges
    # a relative import inside backends/ resolves through the package mapping
    assert "scanlang.backends.triton.runtime" in edges["scanlang.backends.delta.ops"]
    # the registry's lazy import is by name (importlib), the one seam: no syntactic edge to a backend
    assert not any(m.startswith("scanlang.backends") for m in edges["scanlang.backend"])
    # an edge from a function body counts like one at the top of the file
    assert find_cycle({"a": {"b"}, "b": {"a"}}) == ["a", "b", "a"]


def test_no_import_cycle():
    cycle = find_cycle(graph())
    assert cycle is None, "import cycle: " + " -> ".join(cycle)


def test_no_backend_imports_a_recipe():
    edges = graph()
    bad = sorted((m, t) for m, targets in edges.items() if m.startswith("scanlang.backends") and not is_tool(m)
                 for t in targets if t.startswith("scanlang.recipes"))
    assert not bad, f"backend modules importing a recipe: {bad}"


def test_nothing_imports_a_tool():
    edges = graph()
    bad = sorted((m, t) for m, targets in edges.items() if not is_tool(m) for t in targets if is_tool(t))
    assert not bad, f"modules importing a tool: {bad}"


def test_the_core_imports_no_recipe():
    """A recipe builds on the core, never the other way round. The core: scanlang/ but its tools and
    scanlang.models (the tasks' sequence models, a floor above the recipes whose layers they stack)."""
    edges = graph()
    above = ("scanlang.backends", "scanlang.recipes", "scanlang.models")
    core = [m for m in edges if not m.startswith(above) and not is_tool(m)]
    bad = sorted((m, t) for m in core for t in edges[m] if t.startswith("scanlang.recipes"))
    assert not bad, f"core modules importing a recipe: {bad}"
