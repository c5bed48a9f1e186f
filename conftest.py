"""Test tiers: CPU unit tests, generated kernels in Triton's interpreter (no GPU), GPU tests.

Without a GPU, TRITON_INTERPRET=1 is set for the whole session before anything imports Triton, so
the generated kernels run on CPU tensors. Tests marked `gpu` skip with a reason. Every session gets
an empty kernel and proof cache, so no test passes on what an earlier run left behind (one
empty cache per `.ci/run`, shared by its test processes).
"""
import os
import pathlib
import tempfile

import pytest
import torch

# SCANLANG_TEST_CACHE_DIR: an empty directory the caller made for this run, shared by several test
# processes (.ci/run's three), so a module one of them renders the others read (rendering one large
# module costs seconds of the 2-core CI machine's time); tests of the cache itself use their own.
os.environ["SCANLANG_CACHE_DIR"] = os.environ.get("SCANLANG_TEST_CACHE_DIR") or tempfile.mkdtemp(prefix="scanlang-test-cache-")
# One intra-op thread (unless the caller chose): the tests' tensors are tiny, so extra threads only
# synchronise, and on a shared machine they oversubscribe the cores (the reference gradcheck ran ten
# times slower with torch's default threads beside two other test processes). The examples' and the
# CLI's subprocesses inherit it through the environment.
if "OMP_NUM_THREADS" not in os.environ:
    os.environ["OMP_NUM_THREADS"] = "1"
    torch.set_num_threads(1)
HAS_CUDA = torch.cuda.is_available()
if not HAS_CUDA:
    os.environ.setdefault("TRITON_INTERPRET", "1")


_SLOW_LINES = [line.split() for line in
               (pathlib.Path(__file__).parent / "tests" / "slow_tests.txt").read_text().splitlines()
               if line.strip() and not line.startswith("#")]
SLOW_TESTS = frozenset(words[0] for words in _SLOW_LINES)                          # all but the first case
SLOW_ALL_CASES = frozenset(words[0] for words in _SLOW_LINES if words[1:] == ["all"])  # every case


SLOW_SECONDS = {path: float(seconds) for path, seconds in
                (line.split() for line in (pathlib.Path(__file__).parent / "tests" / "slow_seconds.txt")
                 .read_text().splitlines() if line.strip() and not line.startswith("#"))}


def _file_of(item) -> str:
    return pathlib.Path(str(item.fspath)).relative_to(pathlib.Path(__file__).parent).as_posix()


def shard_files(files, n: int) -> dict:
    """{file: shard}: whole files (a file's tests share their kernels, rendered and interpreted once per
    process, and its module fixtures), the heaviest first onto the least loaded shard, weighed by the
    slow tier's measured seconds (tests/slow_seconds.txt; a file not listed counts 1 s). The same
    files give the same shards in every process."""
    loads, owner = [0.0] * n, {}
    for f in sorted(files, key=lambda f: (-SLOW_SECONDS.get(f, 1.0), f)):
        shard = min(range(n), key=lambda j: (loads[j], j))
        owner[f] = shard
        loads[shard] += SLOW_SECONDS.get(f, 1.0)
    return owner


@pytest.hookimpl(tryfirst=True)   # before `-m` deselects by marker
def pytest_collection_modifyitems(config, items):
    """Tiers and shards. The functions in tests/slow_tests.txt are `slow` except their first
    parametrised case (every case for a line ending in `all`); SCANLANG_TEST_SHARD=i/n keeps the i-th
    of n shards of whole files (see `shard_files`, so `.ci/run` can run the slow tier as several
    processes beside the fast one); without a GPU, `gpu` tests skip."""
    seen = set()
    for item in items:
        name = f"{pathlib.Path(str(item.fspath)).relative_to(pathlib.Path(__file__).parent).as_posix()}::" \
               f"{getattr(item, 'originalname', item.name)}"
        if name in SLOW_TESTS:
            first_case = hasattr(item, "callspec") and name not in seen and name not in SLOW_ALL_CASES
            seen.add(name)
            if not first_case:
                item.add_marker(pytest.mark.slow)
    shard = os.environ.get("SCANLANG_TEST_SHARD")
    if shard:
        i, n = (int(x) for x in shard.split("/"))
        owner = shard_files(sorted({_file_of(it) for it in items}), n)
        keep = [it for it in items if owner[_file_of(it)] == i]
        config.hook.pytest_deselected(items=[it for it in items if it not in keep])
        items[:] = keep
    if HAS_CUDA:
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU; none is present (run on the device machine)")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@pytest.fixture(autouse=True)
def _seed():
    torch.manual_seed(0)


@pytest.fixture
def shown(capsys):
    """shown(target, *argv) -> (description, source): what `scanlang show TARGET ARGV...` printed, split
    at the first blank line; the command must exit 0 and the source must parse."""
    import ast

    from scanlang.cli import main

    def show(target, *argv):
        assert main(["show", target, *argv]) == 0
        text, _, source = capsys.readouterr().out.partition("\n\n")
        ast.parse(source)
        return text, source
    return show


@pytest.fixture
def knobs():
    """knobs(**kw): `scanlang.tuning.override(**kw)` until the test ends (a later call overrides an
    earlier one's knobs); the tests' way to change a tuning knob, never by assigning a module global."""
    import contextlib

    from scanlang import tuning
    with contextlib.ExitStack() as stack:
        yield lambda **kw: stack.enter_context(tuning.override(**kw))


# Every generic scan kernel buffer starts as NaN for the whole session (scanlang.testing.poisoned_outputs),
# so an element a kernel leaves unwritten fails the comparison that reads it.
from scanlang import settings as _settings  # noqa: E402
from scanlang import testing as _testing  # noqa: E402

_settings.POISON_OUTPUTS = True


def pytest_sessionfinish(session, exitstatus):
    """With SCANLANG_TOLERANCE_REPORT=path.json: write what every tolerance row's comparisons measured,
    print the table, and fail the session when a CPU row is more than MARGIN_LIMIT x its measured worst."""
    path = os.environ.get("SCANLANG_TOLERANCE_REPORT")
    if not path:
        return
    _testing.write_report(path)
    print("\n" + _testing.report(), flush=True)
    loose = _testing.margins()
    if loose:
        print("tolerance rows too loose for what their tests measure:\n  " + "\n  ".join(loose), flush=True)
        if session.exitstatus == 0:
            session.exitstatus = 1
