"""Every script in examples/ runs to completion at its small default size (on CPU: interpreter)."""
import os
import subprocess
import sys
from pathlib import Path

import pytest

EXAMPLES = sorted((Path(__file__).resolve().parents[1] / "examples").glob("*.py"))


@pytest.mark.parametrize("script", EXAMPLES, ids=lambda p: p.name)
def test_example_runs(script):
    env = dict(os.environ)
    out = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, env=env, timeout=300)
    assert out.returncode == 0, f"{script.name} failed:\n{out.stdout[-3000:]}\n{out.stderr[-3000:]}"


def test_cli_demo_runs_and_checks_itself():
    out = subprocess.run([sys.executable, "-m", "scanlang", "demo", "--length", "300"],
                         capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stdout + out.stderr
    assert "NotAssociativeError" in out.stdout and "all checks passed" in out.stdout
