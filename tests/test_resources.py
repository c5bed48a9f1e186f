"""The offline resource report (`python -m scanlang.tools.offline_compile`): compiles the captured
kernels for sm_90 with Triton's bundled ptxas/nvdisasm, no GPU. Runs in a subprocess because the
test session interprets kernels (TRITON_INTERPRET=1), and the report needs them compiled."""
import os
import re
import subprocess
import sys


def _report(*args: str, kernel: str = r"scan_\w+") -> dict:
    """Kernel name -> its report line from the resource tool run with `args` (compiled, not interpreted)."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    out = subprocess.run([sys.executable, "-m", "scanlang.tools.offline_compile", *args], capture_output=True,
                         text=True, env=env, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    return {m.group(1): m.group(0) for m in re.finditer(rf"({kernel})\s.*?(\d+) registers.*", out.stdout)}


def test_lanes_kernels_compile_for_sm90_without_spills_or_barriers():
    rows = _report("--workload", "affine", "--lanes", "64,2,8,8")
    assert set(rows) == {"scan_forward_lanes", "scan_backward_lanes"}, rows
    for row in rows.values():
        assert "spills 0 B stored" in row and "BAR 0," in row, row


def test_channels_training_kernels_compile_for_sm90_without_spills():
    """The channels-contiguous training default (32 x 32 forward, run-based 256 x 16 backward on 4 warps): the
    backward sits at 240 of 255 registers under Triton 3.6; a change that makes it spill shows here."""
    rows = _report("--workload", "affine", "--layout", "channels")
    assert set(rows) == {"scan_forward", "scan_backward"}, rows
    for row in rows.values():
        assert "spills 0 B stored" in row, row


def test_delta_kernels_report_through_the_same_ptxas_and_sass_summary():
    """`--workload delta`: the captured delta-rule launches compile for sm_90 with their plan's configs; each
    row has ptxas's registers and spills and the SASS mix (one small kernel, --only, to keep the test short)."""
    rows = _report("--workload", "delta", "--K", "32", "--V", "16", "--only", "prep", kernel=r"prep")
    assert set(rows) == {"prep"}, rows
    row = rows["prep"]
    assert re.search(r"\d+ registers, spills \d+ B stored / \d+ B loaded, shared \d+ B; SASS \d+: BAR \d+", row), row
