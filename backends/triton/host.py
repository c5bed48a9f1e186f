"""Host (CPU) time per call of a generated scan: what a call costs before and between its launches.

    python -m scanlang.backends.triton.host [--calls 200] [--repeat 5] [--profile] [--anchor]

The benchmark's affine mixer (`scanlang bench`, time-contiguous) at a small shape [1, 64, 256], so
the GPU finishes each kernel long before the host launches the next: the time per call, taken
without synchronising inside the loop, is host time (validation, plans, allocation, autograd, the
launches). Forward without grad and forward + backward; each figure is the best of `--repeat`
blocks of `--calls` calls (a shared host's other work only ever adds time). `--anchor` times
accelerated-scan's `scan` the same way (if installed); `--profile` prints cProfile's top functions
of the fwd+bwd.
On a machine without CUDA the kernels run in Triton's interpreter with every launch a no-op (as in
`python -m scanlang.backends.delta.host`) that returns a compiled-kernel stand-in, so repeated calls
take `launcher.py`'s direct relaunch as on a GPU; Triton's C launcher, the driver and the CUDA
allocator are left out.
"""
from __future__ import annotations

import os

import torch

if not torch.cuda.is_available():
    os.environ["TRITON_INTERPRET"] = "1"   # before the generated kernels are imported

import argparse  # noqa: E402
import contextlib  # noqa: E402
import cProfile  # noqa: E402
import inspect  # noqa: E402
import pstats  # noqa: E402
import sys  # noqa: E402
import time  # noqa: E402


def _per_call_us(fn, calls: int, repeat: int = 1) -> float:
    for _ in range(20):
        fn()
    best = float("inf")
    for _ in range(repeat):
        if torch.cuda.is_available():
            torch.cuda.synchronize()
        start = time.perf_counter()
        for _ in range(calls):
            fn()
        best = min(best, (time.perf_counter() - start) / calls * 1e6)
        if torch.cuda.is_available():
            torch.cuda.synchronize()
    return best


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--calls", type=int, default=200)
    parser.add_argument("--repeat", type=int, default=5, help="blocks of --calls; the best is reported")
    parser.add_argument("--profile", action="store_true")
    parser.add_argument("--anchor", action="store_true", help="also time accelerated-scan's scan")
    args = parser.parse_args(argv)
    with _no_launches_without_cuda():
        _report(args)


class _CompiledStandIn:
    """What `kernel[grid](...)` returns on a GPU, for the no-op interpreter launches: a compiled-kernel
    handle whose `run` does nothing, so `launcher.launch` keeps it and relaunches it directly (the
    path a GPU call takes from its second call on) instead of going through `kernel[grid]`."""

    function, packed_metadata = None, None

    def launch_metadata(self, grid, stream, *args):
        return None

    def run(self, *args):
        return None


class _Param:
    """`JITFunction.params`' entries as `launcher._bound_tail` reads them (the interpreter has none)."""

    def __init__(self, param: inspect.Parameter):
        self.name, self.default = param.name, param.default
        self.has_default = param.default is not inspect.Parameter.empty


@contextlib.contextmanager
def _no_launches_without_cuda():
    """Without CUDA, interpreter launches return at once for the duration, handing back a compiled-
    kernel stand-in (restored after)."""
    if torch.cuda.is_available():
        yield
        return
    from triton.runtime.interpreter import InterpretedFunction
    saved = {name: InterpretedFunction.__dict__[name] for name in ("run", "params") if name in InterpretedFunction.__dict__}
    InterpretedFunction.run = lambda self, *a, **k: _CompiledStandIn()
    InterpretedFunction.params = property(
        lambda self: [_Param(p) for p in inspect.signature(self.fn).parameters.values()])
    try:
        yield
    finally:
        for name in ("run", "params"):
            if name in saved:
                setattr(InterpretedFunction, name, saved[name])
            else:
                delattr(InterpretedFunction, name)


def _report(args):
    from scanlang.bench import _mixer
    device = "cuda" if torch.cuda.is_available() else "cpu"
    mix = _mixer("affine", "time")
    a = (torch.rand(1, 64, 256, device=device) * 0.5 + 0.5).requires_grad_()
    b = torch.randn(1, 64, 256, device=device).requires_grad_()
    g = torch.randn(1, 64, 256, device=device)

    def forward():
        with torch.no_grad():
            mix(a=a, b=b)

    def fwd_bwd():
        torch.autograd.grad(mix(a=a, b=b)[0], (a, b), g)
    print(f"host time per call ({device}, launches {'real' if device == 'cuda' else 'no-ops'}), "
          f"best of {args.repeat} x {args.calls} calls:")
    print(f"  scanlang affine mixer fwd      {_per_call_us(forward, args.calls, args.repeat):8.1f} us")
    print(f"  scanlang affine mixer fwd+bwd  {_per_call_us(fwd_bwd, args.calls, args.repeat):8.1f} us")
    if args.anchor:
        try:
            from accelerated_scan.scalar import scan
        except ImportError as exc:
            print(f"  accelerated-scan unavailable: {exc}")
        else:
            def anchor():
                torch.autograd.grad(scan(a, b), (a, b), g)
            print(f"  accelerated-scan fwd+bwd       {_per_call_us(anchor, args.calls, args.repeat):8.1f} us")
    if args.profile:
        print_profile(fwd_bwd, args.calls)


def print_profile(fn, calls: int, top: int = 15) -> None:
    """cProfile's `top` functions by own time over `calls` calls of `fn` (also the delta host tool's)."""
    prof = cProfile.Profile()
    prof.enable()
    for _ in range(calls):
        fn()
    prof.disable()
    pstats.Stats(prof, stream=sys.stdout).sort_stats("tottime").print_stats(top)


if __name__ == "__main__":
    main()
