"""The repository's layout rules, read from the sources (no imports run):

- the library (scanlang/ except scanlang/tools/ and scanlang/cli.py, backends/, recipes/) never imports
  scanlang.tools: benchmarks, offline compile reports and host profilers are built on the library, not
  part of it (the CLI may import a tool inside the subcommand that runs it);
- no source file under scanlang/, backends/ or recipes/ is longer than LINE_BUDGET lines.
"""
from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
LINE_BUDGET = 800
# source folder -> the package it installs as (pyproject.toml's package-dir)
PACKAGES = {"scanlang": "scanlang", "backends": "scanlang.backends", "recipes": "scanlang.recipes"}
TOOLS = "scanlang.tools"
NOT_LIBRARY = (ROOT / "scanlang" / "tools", ROOT / "scanlang" / "cli.py")


def _sources() -> list[Path]:
    return sorted(p for folder in PACKAGES for p in (ROOT / folder).rglob("*.py") if "__pycache__" not in p.parts)


def _library_sources() -> list[Path]:
    return [p for p in _sources() if not any(p == q or q in p.parents for q in NOT_LIBRARY)]


def _package_of(path: Path) -> str:
    """The dotted package `path` belongs to, as installed (backends/triton/ops.py -> scanlang.backends.triton)."""
    rel = path.relative_to(ROOT)
    return ".".join([PACKAGES[rel.parts[0]], *rel.parts[1:-1]])


def imported_modules(tree: ast.AST, package: str) -> list[tuple[int, str]]:
    """(line, absolute module name) of every import anywhere in `tree` (module level and inside functions),
    relative imports resolved against `package`; `from X import name` also yields X.name (a submodule or
    not), and importlib.import_module / __import__ calls with a literal name yield that name."""
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found.extend((node.lineno, alias.name) for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                parts = package.split(".")
                base = ".".join(parts[:len(parts) - node.level + 1] + ([node.module] if node.module else []))
            else:
                base = node.module
            found.append((node.lineno, base))
            found.extend((node.lineno, f"{base}.{alias.name}") for alias in node.names)
        elif isinstance(node, ast.Call) and node.args and isinstance(node.args[0], ast.Constant):
            func = node.func
            name = func.attr if isinstance(func, ast.Attribute) else getattr(func, "id", None)
            if name in ("import_module", "__import__") and isinstance(node.args[0].value, str):
                found.append((node.lineno, node.args[0].value))
    return found


def _imports_tools(module: str) -> bool:
    return module == TOOLS or module.startswith(TOOLS + ".")


def test_the_rules_read_every_kind_of_import():
    """The checker itself: each way of importing the tools is caught, and near misses are not."""
    code = ("import scanlang.tools.bench_scan\nfrom scanlang.tools import host_profile\n"
            "def f():\n    from ..tools import offline_compile\n    from . import tools\n"
            "    importlib.import_module('scanlang.tools.bench_delta')\n"
            "import scanlang.toolsy\nfrom . import testing\n")
    hits = [(line, m) for line, m in imported_modules(ast.parse(code), "scanlang.models") if _imports_tools(m)]
    assert [line for line, _ in hits] == [1, 2, 2, 4, 4, 6], hits   # `from . import tools` here: scanlang.models.tools
    assert [m for _, m in imported_modules(ast.parse("from . import tools"), "scanlang")] == ["scanlang",
                                                                                               "scanlang.tools"]
    assert _package_of(ROOT / "backends" / "triton" / "ops.py") == "scanlang.backends.triton"
    assert _package_of(ROOT / "scanlang" / "scan.py") == "scanlang"


def test_the_library_never_imports_the_tools():
    sources = _library_sources()
    assert len(sources) > 30 and ROOT / "scanlang" / "scan.py" in sources
    assert not any("tools" in p.relative_to(ROOT).parts for p in sources)
    offenders = [f"{p.relative_to(ROOT)}:{line} imports {module}"
                 for p in sources
                 for line, module in imported_modules(ast.parse(p.read_text(), str(p)), _package_of(p))
                 if _imports_tools(module)]
    assert not offenders, "the library imports scanlang.tools:\n" + "\n".join(offenders)


@pytest.mark.parametrize("folder", sorted(PACKAGES))
def test_no_source_file_is_over_the_line_budget(folder):
    sources = [p for p in _sources() if p.relative_to(ROOT).parts[0] == folder]
    assert sources
    lengths = {p.relative_to(ROOT): len(p.read_text().splitlines()) for p in sources}
    over = {str(p): n for p, n in lengths.items() if n > LINE_BUDGET}
    assert not over, f"files over {LINE_BUDGET} lines (split them): {over}"
