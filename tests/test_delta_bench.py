"""The GPU benchmark's steps, run on CPU (Triton's interpreter, a tiny shape, a fake clock): the headline table
comes out of the timing step by itself, and the sweep stops at its time budget."""
from __future__ import annotations

import os

os.environ.setdefault("TRITON_INTERPRET", "1")  # before anything imports triton-using code

import pytest  # noqa: E402
import torch  # noqa: E402

from scanlang.backends.delta import bench  # noqa: E402
from scanlang.backends.delta import ops as delta_ops  # noqa: E402


@pytest.fixture
def tiny_bench(monkeypatch, tmp_path):
    monkeypatch.setenv("SCANLANG_CACHE_DIR", str(tmp_path))
    monkeypatch.setattr(bench, "SHAPE", (1, 20, 1, 16, 16))
    timed = []
    monkeypatch.setattr(bench, "bench_ms", lambda fn: timed.append(fn()) or 1.0)
    monkeypatch.setattr(bench, "graph_ms", lambda fn: 0.5)
    monkeypatch.setattr(bench, "LOG", [])
    return dict(gpu="cpu (interpreter)", torch=torch.__version__, triton="?"), timed


def test_timing_step_prints_the_headline_table_with_checked_outputs(tiny_bench):
    results, timed = tiny_bench
    bench.timings(torch.device("cpu"), results, have_fla=False)
    log = "\n".join(bench.LOG)
    assert log.index("## timing") < log.index("## one-token decode") < log.index("## headline")
    assert "| ours GDN-step |" in log and "| ours Kaczmarz |" in log
    assert "decode ours (recurrent kernel): whole call 1000.0 us, kernels only 500.0 us" in log
    assert len(timed) == 5                                   # 2 x (fwd, fwd+bwd) + decode
    assert results["timing"]["ours GDN-step"]["o_ratio_vs_f64"] < 5e-3
    assert results["decode"]["ours (recurrent kernel)"]["S_ratio"] < 5e-3


def test_sweep_stops_at_its_budget(tiny_bench, monkeypatch):
    results, timed = tiny_bench
    before = {name: dict(cfg) for name, cfg in delta_ops.CONFIG.items()}
    clock = iter(range(0, 1000, 10))                         # each reading 10 s later than the one before
    monkeypatch.setattr(bench.time, "monotonic", lambda: next(clock))
    changed = bench.sweep(torch.device("cpu"), results, budget_s=25)
    assert not changed and len(timed) == 2                   # two configs of "prep" tried, then out of time
    assert "kept as they were: ['wu'," in "\n".join(bench.LOG)
    assert {name: dict(cfg) for name, cfg in delta_ops.CONFIG.items()} == before


def test_sweep_of_named_kernels_only(tiny_bench, monkeypatch):
    results, timed = tiny_bench
    monkeypatch.setitem(delta_ops.CONFIG, "bwd_wy", dict(delta_ops.CONFIG["bwd_wy"]))     # restored afterwards
    monkeypatch.setitem(bench.SWEEP_OPTIONS, "bwd_wy", [dict(BV=16, num_warps=4, num_stages=1)])
    bench.sweep(torch.device("cpu"), results, budget_s=1e9, only={"bwd_wy"})
    log = "\n".join(bench.LOG)
    assert len(timed) == 2                                    # its start config and the one other
    assert "bwd_wy: best" in log and "prep: best" not in log
