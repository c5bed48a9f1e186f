"""The replay test: the generator's output is structurally what tests/replay/record.json recorded.

Restructuring the generator must not change what it generates (comments and formatting aside:
`ast.dump` drops both). A change meant to alter the kernels updates the record in its own commit
(`python -m tests.replay.sources --record`) with its reason in the message. The default tier replays
one program of each kind; the slow tier replays all of them.
"""
import json

import pytest

from tests.replay.sources import RECORD, digest, programs, sources

FAST = ("scan_Affine", "scan_Mobius", "chunked_Affine", "kalman_joint_mixer", "delta_kaczmarz_c64")


@pytest.fixture(scope="module")
def record():
    return json.loads(RECORD.read_text())


def test_record_names_every_source(record):
    assert sorted(programs()) == sorted(record)


@pytest.mark.parametrize("name", FAST)
def test_replay_fast(record, name):
    assert digest(sources([name])[name]) == record[name], f"{name}: the generated source changed structurally"


@pytest.mark.slow
def test_replay_all(record):
    generated = sources()
    changed = [n for n in sorted(record) if digest(generated[n]) != record[n]]
    assert not changed, f"generated sources changed structurally: {changed}"
