"""GPU time of a benchmarked call, apart from the wall time `triton.testing.do_bench` gives.

Wall time includes the host's gaps between launches: when the GPU finishes a kernel before Python has
launched the next, do_bench sees Python. On a busy host that gap moved one unchanged chunk-parallel
forward between 0.124 and 0.202 ms within one run (BENCHMARKS_HISTORY.md, "Session 15"). These read
the device's own timeline (torch.profiler's CUDA events: kernels, memsets, copies) instead.
"""
from __future__ import annotations

import collections

import torch


def _device_events(fn, calls: int):
    from torch.profiler import ProfilerActivity, profile
    fn()   # compiled and warm before the profiled calls
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(calls):
            fn()
        torch.cuda.synchronize()
    gpu = torch.autograd.DeviceType.CUDA   # the device's own events only: a CPU op's total repeats its kernels'
    return [e for e in prof.events() if e.device_type == gpu]


def gpu_ms(fn, calls: int = 20) -> float:
    """Milliseconds of GPU work per call of `fn`: every kernel, memset and copy it launches, summed."""
    return sum(e.device_time_total for e in _device_events(fn, calls)) / 1e3 / calls


def kernel_ms(fn, calls: int = 3) -> list[tuple[str, float, float]]:
    """(name, ms per call, launches per call) of every kernel, memset and copy `fn` launches, in the order
    each first ran."""
    total, count = collections.defaultdict(float), collections.Counter()
    for e in _device_events(fn, calls):
        total[e.name] += e.device_time_total
        count[e.name] += 1
    return [(name, us / 1e3 / calls, count[name] / calls) for name, us in total.items()]
