"""The slow-tier list names real tests: a renamed or deleted test must leave tests/slow_tests.txt too
(otherwise its replacement would silently run in the fast tier, or the list would rot)."""
import ast
import pathlib

ROOT = pathlib.Path(__file__).resolve().parent.parent


def test_every_listed_slow_test_exists():
    listed = [line.strip() for line in (ROOT / "tests" / "slow_tests.txt").read_text().splitlines()
              if line.strip() and not line.startswith("#")]
    missing = []
    for entry in listed:
        path, func = entry.split("::")
        tree = ast.parse((ROOT / path).read_text())
        names = {n.name for n in ast.walk(tree) if isinstance(n, ast.FunctionDef)}
        if func not in names:
            missing.append(entry)
    assert listed and not missing, f"tests/slow_tests.txt names tests that do not exist: {missing}"
