"""The matrix-state benchmark (scanlang/tools/bench_linear.py) on CPU, in Triton's interpreter at a tiny
shape: a correct member is checked and timed; a planted 1% output error fails the run (exit 1) and the
member is not timed."""
from __future__ import annotations

import pytest
import torch

from scanlang.recipes import linear
from scanlang.tools import bench_linear

TINY = ["--device", "cpu", "--B", "1", "--T", "19", "--H", "1", "--K", "16", "--V", "16", "--chunk", "16"]


def test_a_correct_member_is_checked_then_timed(capsys):
    assert bench_linear.main(TINY + ["--members", "simple_gla"]) == 0
    out = capsys.readouterr().out
    assert "simple_gla" in out and "PASS" in out and "fwd+bwd" in out and "FAIL" not in out


def test_a_wrong_output_fails_the_run_and_is_not_timed(capsys, monkeypatch):
    real = linear.simple_gla

    def planted(*args, backend=None, **kw):
        o, s = real(*args, backend=backend, **kw)
        return (o * 1.01 if backend == "triton" else o), s
    monkeypatch.setattr(linear, "simple_gla", planted)
    assert bench_linear.main(TINY + ["--members", "simple_gla"]) == 1
    out = capsys.readouterr().out
    assert "FAIL against float64 (o" in out and "not timed" in out and "fwd+bwd" not in out


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the message without a GPU")
def test_no_gpu_says_so():
    assert bench_linear.main([]) == 2


def test_breakdown_times_every_kernel_of_a_forward_and_backward(capsys):
    """--breakdown: one row per launched kernel (gla's split forward: cumsum, state pass, outputs; then the
    backward's state recomputation, reverse pass and per-chunk kernel), in launch order."""
    assert bench_linear.main(TINY + ["--members", "gla", "--breakdown"]) == 0
    out = capsys.readouterr().out
    rows = [line.split()[0] for line in out.splitlines() if " grid " in line]
    assert rows == ["gla_decay_cumsum", "gla_fwd", "gla_fwd_o", "gla_fwd", "gla_bwd_dh", "gla_bwd"], out
