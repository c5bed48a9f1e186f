"""The Kalman benchmark on CPU (Triton's interpreter, tiny shapes, --device cpu): each implementation is
checked against float64 (scanlang.testing's rows) before it is timed, and a wrong kernel (an output off by
1e-4 relative, gradients off by 1%) is reported FAILED, not timed, and makes the run exit 1."""
from __future__ import annotations

import os

os.environ.setdefault("TRITON_INTERPRET", "1")  # before anything imports triton-using code

import math  # noqa: E402

import pytest  # noqa: E402
import torch  # noqa: E402

from scanlang.tools import bench_kalman as bench  # noqa: E402
from scanlang.testing import planted_gradient_error  # noqa: E402

ARGS = ["--device", "cpu", "--only", "scan-joint", "--quick"]



@pytest.fixture
def tiny(monkeypatch):
    monkeypatch.setattr(bench, "SHAPE", dict(B=1, T=7, M=3, S=2))
    monkeypatch.setattr(bench, "CHECK_SHAPE", dict(B=1, T=9, M=3, S=2))
    monkeypatch.setattr(bench, "_FULL_REFERENCE", {})
    real, plant = bench.kalman_filter, {}

    def planted(*args, **kw):
        y, y_var, state = real(*args, **kw)
        if plant.get("y"):
            y = y * (1 + 1e-4)
        if plant.get("grad"):
            y_var = planted_gradient_error(y_var)
        return y, y_var, state
    monkeypatch.setattr(bench, "kalman_filter", planted)
    return plant


def test_checked_run_exits_0(tiny, capsys):
    assert bench.main(ARGS) == 0
    out = capsys.readouterr().out
    assert "| scan-joint |" in out and "FAILED" not in out


@pytest.mark.parametrize("plant", ["y", "grad"])
def test_a_wrong_kernel_fails_the_run_and_is_not_timed(tiny, capsys, plant):
    tiny[plant] = True
    assert bench.main(ARGS) == 1
    out = capsys.readouterr().out
    assert "| scan-joint | FAILED: " in out and "not timed" in out and "FAILED (checks or errors): scan-joint" in out
    assert ("y," if plant == "y" else "dprec") in out.split("| scan-joint | FAILED: ")[1].splitlines()[0]


def test_worst_keeps_nan():
    assert math.isnan(bench.worst([1e-7, float("nan"), 1e-6])) and bench.worst([1e-7, 2e-7]) == 2e-7
