"""`scanlang bench` on CPU (Triton's interpreter, a tiny shape, --device cpu): every configuration is checked
against float64 before it is timed or chosen, and a wrong kernel makes the run exit 1. The wrong kernels are
planted around the real mixer: an output element off under one swept forward config (made the fastest),
and gradients off by 1% with a correct forward."""
from __future__ import annotations

import os

os.environ.setdefault("TRITON_INTERPRET", "1")  # before anything imports triton-using code

import pytest  # noqa: E402
import torch  # noqa: E402

from scanlang.tools import bench_scan as bench  # noqa: E402
from scanlang import tuning  # noqa: E402
from scanlang.backends.triton import runtime  # noqa: E402
from scanlang.testing import planted_gradient_error  # noqa: E402

ARGS = ["--device", "cpu", "--B", "1", "--D", "3", "--T", "9", "--no-anchors", "--no-lanes", "--only", "affine:time"]
GOOD = runtime.Config(16, 1, 1)
PLANTED = runtime.Config(8, 1, 1)



@pytest.fixture
def planted(monkeypatch):
    """bench._mixer wrapped: `plant["fwd"]` set -> under the PLANTED forward config one output element is
    off by 1e-3 relative; `plant["bwd"]` -> the gradients are 1% off. Times: PLANTED is the fastest."""
    monkeypatch.setattr(bench, "DEVICE", "cpu")
    real_mixer, plant = bench._mixer, {"fwd": False, "bwd": False}

    def wrap(mix):
        def wrapped(**data):
            y = mix(**data)[0]
            if plant["fwd"] and _planted_forced():
                bump = torch.zeros_like(y)
                bump.view(-1)[4] = 1e-3 * y.detach().view(-1)[4]
                y = y + bump
            if plant["bwd"]:
                y = planted_gradient_error(y)
            return (y,)
        return wrapped
    monkeypatch.setattr(bench, "_mixer", lambda kind, layout: wrap(real_mixer(kind, layout)))
    monkeypatch.setattr(bench, "_sweep_configs", lambda layout: [GOOD, PLANTED])
    def fake_clock(fn, graph=False):
        fn()
        return 0.001 if _planted_forced() else 1.0
    monkeypatch.setattr(bench, "_bench", fake_clock)
    yield plant
    assert tuning.current() is tuning.DEFAULT   # every config the run forced was unforced when it left


def _planted_forced() -> bool:
    return PLANTED in dict(tuning.current().forced).values()


def test_sweep_skips_a_wrong_config_and_the_run_exits_1(planted, capsys):
    planted["fwd"] = True
    rc = bench.main(ARGS + ["--sweep"])
    out = capsys.readouterr().out
    assert rc == 1
    assert f"FAILED: affine time fwd config {PLANTED}" in out
    chosen = [line for line in out.splitlines() if line.startswith("scanlang affine fwd (2 in, 1 out)")]
    assert len(chosen) == 1 and str(PLANTED) not in chosen[0], chosen   # the fastest (planted) was not chosen
    assert "scanlang affine fwd+bwd" in out                               # the passing configs were still timed


def test_wrong_gradients_fail_the_run(planted, capsys):
    planted["bwd"] = True
    rc = bench.main(ARGS)
    out = capsys.readouterr().out
    assert rc == 1 and "FAILED: affine time fwd config default" in out
    assert "scanlang affine fwd (2 in, 1 out)" not in out                 # nothing timed for a wrong kernel


def test_a_correct_run_exits_0(planted, capsys):
    assert bench.main(ARGS) == 0
    out = capsys.readouterr().out
    assert "FAIL" not in out and "sl.scan(Affine) fwd (2 in, 2 out)" in out
