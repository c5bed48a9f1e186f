"""The GPU benchmark's steps, run on CPU (Triton's interpreter, a tiny shape, a fake clock): the headline table
comes out of the timing step by itself, the sweep stops at its time budget, and a wrong kernel (a dropped
output element, a wrong gradient under one swept config) fails the run instead of being timed or kept."""
from __future__ import annotations

import os

os.environ.setdefault("TRITON_INTERPRET", "1")  # before anything imports triton-using code

import pytest  # noqa: E402
import torch  # noqa: E402

from scanlang.tools import bench_delta as bench  # noqa: E402
from scanlang import tuning  # noqa: E402
from scanlang.testing import planted_gradient_error, tolerance  # noqa: E402


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
    assert results["timing"]["ours GDN-step"]["o_ratio_vs_f64"] <= tolerance("delta_out", torch.bfloat16)
    assert results["decode"]["ours (recurrent kernel)"]["S_ratio"] <= tolerance("delta_out", torch.bfloat16)
    assert "failures" not in results and results["ours GDN-step (checked slice)"]["dv_ok"]


def test_sweep_stops_at_its_budget(tiny_bench, monkeypatch):
    results, timed = tiny_bench
    before = tuning.current().delta_launch_configs()
    clock = iter(range(0, 1000, 10))                         # each reading 10 s later than the one before
    monkeypatch.setattr(bench.time, "monotonic", lambda: next(clock))
    changed = bench.sweep(torch.device("cpu"), results, budget_s=25)
    assert not changed and len(timed) == 2                   # two configs of "prep" tried, then out of time
    assert "kept as they were: ['wu'," in "\n".join(bench.LOG)
    assert tuning.current().delta_launch_configs() == before == results["sweep_config"]   # nothing global changed


def test_sweep_of_named_kernels_only(tiny_bench, monkeypatch):
    results, timed = tiny_bench
    monkeypatch.setitem(bench.SWEEP_OPTIONS, "bwd_wy", [dict(BV=16, num_warps=4, num_stages=1)])
    bench.sweep(torch.device("cpu"), results, budget_s=1e9, only={"bwd_wy"})
    log = "\n".join(bench.LOG)
    assert len(timed) == 2                                    # its start config and the one other
    assert "bwd_wy: best" in log and "prep: best" not in log



def test_a_dropped_output_element_fails_the_run_and_is_not_timed(tiny_bench, monkeypatch, tmp_path):
    real = bench.ours_fn

    def dropped(*args):   # one output element left unwritten (zero)
        o, S = real(*args)
        mask = torch.ones_like(o)
        mask[0, 3, 0, 5] = 0
        return o * mask, S
    monkeypatch.setattr(bench, "ours_fn", dropped)
    rc = bench.main(["--device", "cpu", "--skip-correctness", "--no-breakdown", "--out", str(tmp_path)])
    log = "\n".join(bench.LOG)
    assert rc == 1 and "ours GDN-step                FAILED its check against float64: not timed" in log
    assert "| ours GDN-step |" not in log and "| ours Kaczmarz |" in log      # the other contender still timed


def test_sweep_never_keeps_a_config_that_fails_its_check(tiny_bench, monkeypatch, knobs):
    """The planted config is the fastest and its gradients are wrong: reported FAILED, not kept."""
    results, timed = tiny_bench
    planted = dict(BV=16, num_warps=4, num_stages=2)
    knobs(delta_configs={"bwd_wy": dict(BV=16, num_warps=4, num_stages=1)})
    monkeypatch.setitem(bench.SWEEP_OPTIONS, "bwd_wy", [planted])
    real = bench.ours_fn

    def wrong_under_planted(*args):
        o, S = real(*args)
        return (planted_gradient_error(o) if tuning.current().delta_config("bwd_wy") == planted else o), S
    monkeypatch.setattr(bench, "ours_fn", wrong_under_planted)
    monkeypatch.setattr(bench, "bench_ms", lambda fn: timed.append(fn()) or (
        0.1 if tuning.current().delta_config("bwd_wy") == planted else 1.0))
    bench.sweep(torch.device("cpu"), results, budget_s=1e9, only={"bwd_wy"})
    log = "\n".join(bench.LOG)
    assert results["sweep_config"]["bwd_wy"] != planted and len(timed) == 1     # only the start config timed
    assert f"bwd_wy {planted}: FAILED its check" in log and results["failures"] == [f"sweep bwd_wy {planted}"]
