"""`scanlang train` and `scanlang report` end to end on CPU, reproducibility, and the bad inputs
(each a one-line error with exit status 2 before any training, nothing written)."""
import json
import sys

import pytest
import torch

from scanlang import cli
from scanlang.train import TrainConfig, prepare, train

TINY = ["--d-model", "16", "--heads", "2", "--batch", "4", "--eval-size", "8", "--no-progress", "--threads", "1"]
KEYS = {"task", "mixer", "steps", "test_accuracy", "train_loss", "wall_time_s", "device", "versions", "config",
        "accuracy_by_length", "history", "evals", "layers", "seq_len"}


def _run(argv, capsys):
    status = cli.main(argv)
    captured = capsys.readouterr()
    return status, captured.out, captured.err


def test_train_writes_metrics_and_curves_then_report_compares(tmp_path, capsys):
    runs = []
    for layers, mixer in ((1, "gdn"), (2, "attention")):
        out = tmp_path / f"{mixer}{layers}"
        status, stdout, _ = _run(["train", "state_tracking", "--mixer", mixer, "--group", "S3", "--seq-len", "6",
                                  "--steps", "3", "--layers", str(layers), "--eval-lengths", "9", "--out", str(out)]
                                 + TINY, capsys)
        assert status == 0, stdout
        metrics = json.loads((out / "metrics.json").read_text())
        assert KEYS <= metrics.keys()
        assert metrics["task"] == "state_tracking" and metrics["mixer"] == mixer and metrics["steps"] == 3
        assert metrics["config"]["task_options"] == {"group": "S3"} and metrics["config"]["seq_len"] == 6
        assert set(metrics["accuracy_by_length"]) == {"6", "9"}
        assert 0 <= metrics["test_accuracy"] <= 1 and metrics["test_accuracy"] == metrics["accuracy_by_length"]["6"]
        assert len(metrics["history"]["loss"]) == 3 and metrics["versions"]["torch"] == torch.__version__
        assert (out / "curves.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
        assert sorted(p.name for p in out.iterdir()) == ["curves.png", "metrics.json"]
        runs.append(out)
    status, stdout, _ = _run(["report", *map(str, runs), "--out", str(tmp_path / "cmp")], capsys)
    assert status == 0
    md = (tmp_path / "cmp" / "report.md").read_text()
    assert "accuracy against depth" in md and "gdn1" in md and "attention2" in md and "acc @9" in md
    assert (tmp_path / "cmp" / "report.png").read_bytes()[:4] == b"\x89PNG"


def test_same_seed_gives_the_same_metrics():
    def run(seed):
        config = TrainConfig(task="mqar", mixer="kalman", layers=1, d_model=16, heads=2, seq_len=12, steps=4,
                             batch=4, eval_size=8, seed=seed, progress=False, mixer_options={"d_state": 2},
                             task_options={"num_kv_pairs": 3, "vocab_size": 16}, eval_lengths=(20,))
        return train(config)
    a, b, c = run(0), run(0), run(1)
    for key in ("test_accuracy", "test_loss", "train_loss", "history", "evals", "accuracy_by_length"):
        assert a[key] == b[key], key
    assert a["history"]["loss"] != c["history"]["loss"]


def test_mqar_and_selective_copy_train(tmp_path):
    for task, options in (("mqar", {"num_kv_pairs": 2, "vocab_size": 12}),
                          ("selective_copy", {"num_tokens_to_copy": 3, "vocab_size": 6})):
        metrics = train(TrainConfig(task=task, mixer="mamba", layers=1, d_model=16, heads=2, seq_len=10, steps=2,
                                    batch=4, eval_size=4, progress=False, task_options=options,
                                    mixer_options={"d_state": 4}))
        assert metrics["task"] == task and len(metrics["history"]["loss"]) == 2


@pytest.mark.parametrize("argv, match", [
    (["parity", "--mixer", "gdn"], "task: expected one of"),
    (["state_tracking", "--mixer", "lstm"], "mixer: expected one of"),
    (["state_tracking", "--mixer", "gla", "--group", "Z2", "--d-state", "4"],
     "mixer_options.*do not fit mixer 'gla'"),
    (["state_tracking", "--mixer", "gdn"], "group: state_tracking needs a group"),
    (["state_tracking", "--mixer", "gdn", "--group", "Z2", "--num-kv-pairs", "3"], "options: state_tracking takes"),
    (["state_tracking", "--mixer", "gdn", "--group", "A4"], "group: expected one of"),
    (["mqar", "--mixer", "gdn", "--num-kv-pairs", "8", "--seq-len", "10", "--vocab-size", "64"],
     "seq_len: 10 is too short for num_kv_pairs = 8"),
    (["mqar", "--mixer", "gdn", "--num-kv-pairs", "2", "--seq-len", "12", "--vocab-size", "64",
      "--eval-lengths", "4"], "seq_len: 4 is too short"),
    (["selective_copy", "--mixer", "gdn", "--num-tokens-to-copy", "3", "--seq-len", "5"], "seq_len: 5 is too short"),
    (["state_tracking", "--mixer", "gdn", "--group", "Z2", "--steps", "0"], "steps"),
])
def test_bad_input_is_one_line_exit_2_and_nothing_written(tmp_path, capsys, argv, match):
    out = tmp_path / "run"
    status, stdout, stderr = _run(["train", *argv, "--out", str(out), *TINY], capsys)
    assert status == 2
    assert stderr.count("\n") == 1 and stderr.startswith("scanlang train: ")
    import re
    assert re.search(match, stderr), stderr
    assert not out.exists()


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the error on a machine without a GPU")
def test_cuda_without_a_gpu_is_refused(tmp_path, capsys):
    status, _, stderr = _run(["train", "state_tracking", "--mixer", "gdn", "--group", "Z2", "--device", "cuda",
                              "--out", str(tmp_path / "run"), *TINY], capsys)
    assert status == 2 and "no CUDA GPU" in stderr and not (tmp_path / "run").exists()


def test_an_output_folder_with_files_needs_overwrite(tmp_path, capsys):
    out = tmp_path / "run"
    out.mkdir()
    (out / "notes.txt").write_text("mine")
    argv = ["train", "state_tracking", "--mixer", "attention", "--group", "Z2", "--seq-len", "4", "--steps", "1", "--out", str(out),
            *TINY]
    status, _, stderr = _run(argv, capsys)
    assert status == 2 and "--overwrite" in stderr
    assert sorted(p.name for p in out.iterdir()) == ["notes.txt"]
    status, _, _ = _run(argv + ["--overwrite"], capsys)
    assert status == 0
    assert sorted(p.name for p in out.iterdir()) == ["curves.png", "metrics.json", "notes.txt"]
    assert (out / "notes.txt").read_text() == "mine"


def test_report_refuses_a_folder_without_metrics(tmp_path, capsys):
    status, _, stderr = _run(["report", str(tmp_path), "--out", str(tmp_path / "cmp")], capsys)
    assert status == 2 and "metrics.json" in stderr


def test_missing_extra_names_the_install_command(monkeypatch, capsys):
    monkeypatch.setitem(sys.modules, "tqdm", None)   # `import tqdm` now raises ImportError
    status, _, stderr = _run(["train", "state_tracking", "--mixer", "gdn"], capsys)
    assert status == 2 and "pip install scanlang[train]" in stderr


def test_prepare_trains_nothing_and_checks_the_device():
    prep = prepare(TrainConfig(task="state_tracking", mixer="attention", d_model=16, heads=2, steps=2, batch=2,
                               eval_size=2, seq_len=3, progress=False, task_options={"group": "A5"}))
    assert prep.train_data[0].shape == (4, 3) and prep.out is None
    with pytest.raises(ValueError, match="device"):
        prepare(TrainConfig(task="state_tracking", mixer="attention", device="tpu"))
