"""examples/reproduce_claims.py: every scale's configs are valid, and the gpu path check runs."""
import importlib.util
from pathlib import Path

import pytest

from scanlang import tasks
from scanlang.models import SequenceModel

SCRIPT = Path(__file__).resolve().parents[1] / "examples" / "reproduce_claims.py"
SCANLANG_MIXERS = ("kalman", "gdn", "kaczmarz", "mamba")


def _script():
    spec = importlib.util.spec_from_file_location("reproduce_claims", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


# ids not equal to "gpu": conftest skips every test with a "gpu" keyword when no GPU is present
@pytest.mark.parametrize("scale", ["smoke", "cpu", "gpu"], ids=lambda scale: f"{scale}-scale")
def test_every_run_of_every_scale_is_a_valid_config(scale):
    """Each run's task options fit its training and evaluation lengths, and its model builds: a bad
    gpu config would otherwise surface only on the GPU, after the runs before it."""
    plan = _script().experiments(scale)
    assert plan and all(plan.values())
    for experiment, runs in plan.items():
        for run_name, config in runs:
            for length in (config.seq_len, *config.eval_lengths):
                inputs, targets = tasks.generate(config.task, 2, length, 0, **config.task_options)
                assert inputs.shape == (2, length) and (targets != tasks.IGNORE).any(), (experiment, run_name)
            vocab = tasks.vocab_size(config.task, **config.task_options)
            assert int(inputs.max()) < vocab
            if scale == "gpu":   # building a d_model 128 model is cheap; the small scales run in CI anyway
                SequenceModel(vocab, config.d_model, config.layers, config.mixer, config.heads, config.mixer_options)


def test_gpu_runs_share_the_kernel_shapes_of_the_check():
    """The gpu scale's budget counts one kernel compile per mixer: every scanlang-mixer run has the
    d_model and heads that `check_gpu_path` compiles (a new head size would compile again)."""
    for runs in _script().experiments("gpu").values():
        for _, config in runs:
            assert config.device == "cuda"
            if config.mixer in SCANLANG_MIXERS:
                assert (config.d_model, config.heads, config.mixer_options) == (128, 4, {}), config


def test_gpu_path_check_compares_against_float64():
    """The check's arithmetic, on the CPU with the reference backend standing in for the kernels
    (the GPU run uses backend="triton"): one row per mixer, every one within tolerance."""
    rows = _script().check_gpu_path("cpu", d_model=16, length=11, backend="reference")
    assert len(rows) == 2 + 3
    for row, name in zip(rows[2:], ("kalman", "gdn", "kaczmarz")):
        cells = [c.strip() for c in row.strip("|").split("|")]
        assert cells[0] == name and cells[-1] == "yes", row
        assert float(cells[1]) < 1e-5 and 0 < float(cells[4].split()[0]) < 0.1, row


def test_gpu_path_check_records_a_failing_mixer_and_goes_on(monkeypatch):
    script = _script()

    def broken(name, *args):
        if name == "gdn":
            raise RuntimeError("kernel launch failed")
        return f"| {name} | ok |"

    monkeypatch.setattr(script, "_check_mixer", broken)
    rows = script.check_gpu_path("cpu", d_model=16, length=11, backend="reference")
    assert rows[3].startswith("| gdn | **error**: RuntimeError: kernel launch failed") and rows[3].endswith("**NO** |")
    assert rows[2] == "| kalman | ok |" and rows[4] == "| kaczmarz | ok |"
