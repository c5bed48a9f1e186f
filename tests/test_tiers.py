"""The slow-tier list names real tests: a renamed or deleted test must leave tests/slow_tests.txt too
(otherwise its replacement would silently run in the fast tier, or the list would rot)."""
import ast
import pathlib

ROOT = pathlib.Path(__file__).resolve().parent.parent


def test_every_listed_slow_test_exists():
    listed = [line.split()[0] for line in (ROOT / "tests" / "slow_tests.txt").read_text().splitlines()
              if line.strip() and not line.startswith("#")]   # "path::function" [all]
    missing = []
    for entry in listed:
        path, func = entry.split("::")
        tree = ast.parse((ROOT / path).read_text())
        names = {n.name for n in ast.walk(tree) if isinstance(n, ast.FunctionDef)}
        if func not in names:
            missing.append(entry)
    assert listed and not missing, f"tests/slow_tests.txt names tests that do not exist: {missing}"


def test_slow_seconds_name_real_files_and_shards_split_whole_files():
    """tests/slow_seconds.txt (the shards' weights) names files that exist; SCANLANG_TEST_SHARD's
    shards put each file in exactly one shard, the same one for the same files."""
    import conftest
    assert conftest.SLOW_SECONDS and all((ROOT / path).is_file() for path in conftest.SLOW_SECONDS), \
        sorted(p for p in conftest.SLOW_SECONDS if not (ROOT / p).is_file())
    files = sorted(p.relative_to(ROOT).as_posix() for p in (ROOT / "tests").glob("test_*.py"))
    owner = conftest.shard_files(files, 2)
    assert sorted(owner) == files and set(owner.values()) == {0, 1}
    assert owner == conftest.shard_files(list(reversed(files)), 2)
    loads = [sum(conftest.SLOW_SECONDS.get(f, 1.0) for f in files if owner[f] == i) for i in (0, 1)]
    assert abs(loads[0] - loads[1]) <= max(conftest.SLOW_SECONDS.values()), loads
