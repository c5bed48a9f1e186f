"""Every environment knob scanlang reads, in one place.

SCANLANG_DEBUG       "1" prints generated kernel source when it is rendered.
SCANLANG_CACHE_DIR   where generated kernels and proofs are cached (default ~/.cache/scanlang).
SCANLANG_PROOF_SECONDS  sympy's time budget per law (associativity, each identity side; default 20).
TRITON_INTERPRET     "1" lets backend="triton" run on CPU tensors through Triton's interpreter.
SCANLANG_POISON_OUTPUTS  "1" (tests) fills the generic scan kernels' buffers with NaN before a launch
                     (POISON_OUTPUTS below; scanlang.testing.poisoned_outputs() toggles it).
"""
from __future__ import annotations

import math
import os
from pathlib import Path


def _flag(name: str) -> bool:
    return os.environ.get(name, "").strip().lower() in ("1", "true", "yes", "on")


def debug() -> bool:
    return _flag("SCANLANG_DEBUG")


def cache_dir() -> Path:
    default = Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "scanlang"
    return Path(os.environ.get("SCANLANG_CACHE_DIR", default))


def proof_seconds() -> float:
    """SCANLANG_PROOF_SECONDS as a number of seconds (default 20; "inf" for no limit)."""
    raw = os.environ.get("SCANLANG_PROOF_SECONDS", "20")
    try:
        seconds = float(raw)
    except ValueError:
        seconds = math.nan
    if math.isnan(seconds) or seconds < 0:
        raise ValueError(f"SCANLANG_PROOF_SECONDS: expected a nonnegative number of seconds (e.g. 20, or inf "
                         f"for no limit), got {raw!r}")
    return seconds


def triton_interpret() -> bool:
    return _flag("TRITON_INTERPRET")


# Test-only: the generic scan kernels' output, final-state, checkpoint and gradient buffers start as NaN
# (backends/triton/ops.py), so an element a kernel leaves unwritten fails the comparison. A plain module
# attribute, read once per allocation, not an environment lookup: the eager path counts microseconds.
POISON_OUTPUTS = _flag("SCANLANG_POISON_OUTPUTS")
