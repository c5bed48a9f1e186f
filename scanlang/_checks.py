"""Input checks shared by the front ends (mixers, the delta-rule ops): one rule, one message.

`check_cu_seqlens` validates packed variable-length offsets before any kernel sees them: a kernel
trusts them as memory bounds, so offsets that end before T leave outputs unwritten, offsets past T
read and write out of bounds, and decreasing ones give negative lengths.
"""
from __future__ import annotations

import numbers

import torch


def check_cu_seqlens(cu_seqlens, total: int, device=None, arg: str = "cu_seqlens") -> tuple[int, ...] | None:
    """Check `cu_seqlens` ([N + 1] int32/int64 offsets: 0 = cu[0] <= cu[1] <= ... <= cu[N] = total)
    and return the offsets as Python ints.

    `device`: where the other inputs are (None: not checked). Reading the values costs one device to
    host copy (a synchronisation on a GPU); while torch.compile traces, only the type, shape and
    device are checked and None is returned.

    >>> check_cu_seqlens(torch.tensor([0, 2, 5]), total=5)
    (0, 2, 5)
    """
    if not isinstance(cu_seqlens, torch.Tensor):
        raise TypeError(f"{arg}: expected a 1-d int32/int64 tensor [N + 1] of sequence offsets, "
                        f"got {type(cu_seqlens).__name__}")
    if cu_seqlens.dtype not in (torch.int32, torch.int64):
        raise TypeError(f"{arg}: expected int32 or int64 offsets, got {cu_seqlens.dtype}")
    if cu_seqlens.dim() != 1 or cu_seqlens.numel() < 2:
        raise ValueError(f"{arg}: expected a 1-d tensor [N + 1] (N >= 1 sequences) of offsets, got shape "
                         f"{tuple(cu_seqlens.shape)}")
    if device is not None and cu_seqlens.device != torch.device(device):
        raise ValueError(f"{arg}: on {cu_seqlens.device}, but the inputs are on {device}")
    if torch.compiler.is_compiling():
        return None
    cu = [int(c) for c in cu_seqlens.tolist()]
    if cu[0] != 0 or cu[-1] != total or any(b < a for a, b in zip(cu, cu[1:])):
        shown = cu if len(cu) <= 12 else cu[:6] + ["..."] + cu[-5:]
        raise ValueError(f"{arg}: offsets must not decrease, from 0 to the packed length T = {total} "
                         f"(length N + 1 >= 2); got {shown}")
    return tuple(cu)


def check_scale(scale) -> None:
    """scale: a real number, or None (the ops' default K**-0.5)."""
    if scale is not None and (isinstance(scale, bool) or not isinstance(scale, numbers.Real)):
        raise TypeError(f"scale must be a real number or None (default K**-0.5), got {scale!r}")


def packed_offsets(cu_seqlens, B: int, T: int, device) -> tuple[int, ...] | None:
    """None without `cu_seqlens`; else its checked offsets (`check_cu_seqlens`) of sequences packed along
    T, which needs B == 1. Read on the host even while torch.compile traces: the kernels' chunk table
    is built from them.

    >>> packed_offsets(torch.tensor([0, 2, 5]), 1, 5, "cpu")
    (0, 2, 5)
    """
    if cu_seqlens is None:
        return None
    if B != 1:
        raise ValueError(f"cu_seqlens packs sequences along T and needs B == 1, got B = {B}")
    offsets = check_cu_seqlens(cu_seqlens, T, device)
    return offsets if offsets is not None else tuple(int(x) for x in cu_seqlens.tolist())


def check_log_decay(g: torch.Tensor) -> None:
    """g must be a log-decay, g <= 0 (-inf: a hard reset); g > 0 grows the state exponentially, and
    NaN is no decay at all. Checked on CPU tensors only: on a GPU the check would cost a host
    synchronisation per call (outside the domain the kernels give inf or NaN, not an error)."""
    if g.device.type == "cpu" and not torch.compiler.is_compiling() and not bool((g <= 0).all()):
        bad = g[~(g <= 0)]
        raise ValueError(f"g: log-decays must be <= 0 (-inf is a hard reset); got {bad.numel()} values outside, "
                         f"e.g. {float(bad[0])}")
