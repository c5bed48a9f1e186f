"""Host (CPU) time per call of the generated kernels' ops: what a call costs before and between its launches.

    python -m scanlang.tools.host_profile [--workload scan|delta|linear] [--calls 200] [--repeat 5] [--profile]
                                          [--anchor] [--op-path] [--member simple_gla]

Each figure is the best of `--repeat` blocks of `--calls` calls, timed without synchronising inside
the loop (a shared host's other work only ever adds time); `--profile` prints cProfile's top functions
of each call.

--workload scan: the benchmark's affine mixer (`scanlang bench`, time-contiguous) at a small shape
[1, 64, 256], so the GPU finishes each kernel long before the host launches the next: the time per
call is host time (validation, plans, allocation, autograd, the launches). Forward without grad and
forward + backward; `--anchor` times accelerated-scan's `scan` the same way (if installed).

--workload delta: the Kaczmarz delta-rule op, three calls: one-token decode (B8 H16 K=V=128, carried
state, no grad: the recurrent kernel), a chunked forward without grad and a chunked forward + backward
(B2 T256 H4 K=V=64; host work does not depend on the sizes): validation, packing, plans and chunk
tables, buffer allocation, autograd and dispatch. `--op-path` routes every chunked call through the
torch.library ops (the tuning's delta_eager_fast_path off).

--workload linear: a matrix-state member (`--member`, default simple_gla) at B1 T512 H2 K=V=64 in bf16,
the shape where session 15 measured the host at 8x the GPU (BENCHMARKS_HISTORY.md): a chunked forward
without grad (the decode kernel off: tuning.decode_max_tokens = 0) and a forward + backward.

On a machine without CUDA the kernels run in Triton's interpreter with every launch a no-op that
returns a compiled-kernel stand-in, so repeated scan calls take `launcher.py`'s direct relaunch as on
a GPU; Triton's C launcher (argument binding and the driver call, per launch), the driver and the CUDA
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
from typing import Callable  # noqa: E402


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
    parser.add_argument("--workload", choices=("scan", "delta", "linear"), default="scan")
    parser.add_argument("--calls", type=int, default=200)
    parser.add_argument("--repeat", type=int, default=5, help="blocks of --calls; the best is reported")
    parser.add_argument("--profile", action="store_true")
    parser.add_argument("--anchor", action="store_true", help="scan: also time accelerated-scan's scan")
    parser.add_argument("--op-path", action="store_true", help="delta: through the torch.library ops")
    parser.add_argument("--member", default="simple_gla", help="linear: the member (scanlang.recipes.linear)")
    args = parser.parse_args(argv)
    with _no_launches_without_cuda():
        if args.workload == "scan":
            _report_scan(args)
        elif args.workload == "linear":
            _report_linear(args)
        else:
            _report_delta(args)
    return 0


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


def _report_scan(args):
    from scanlang.tools.bench_scan import _mixer
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


def _delta_inputs(B, T, H, K, V, requires_grad, device):
    gen = torch.Generator().manual_seed(0)
    q, k = (torch.randn(B, T, H, K, generator=gen).to(torch.bfloat16) for _ in range(2))
    v = torch.randn(B, T, H, V, generator=gen).to(torch.bfloat16)
    g, eta = -torch.rand(B, T, H, generator=gen), torch.rand(B, T, H, generator=gen)
    h0 = torch.randn(B, H, K, V, generator=gen)
    return [t.to(device).requires_grad_(requires_grad) for t in (q, k, v, g, eta, h0)]


def delta_calls(device: str = "cpu") -> dict[str, Callable[[], None]]:
    """name -> a zero-argument function doing one call of the Kaczmarz delta-rule op on `device`."""
    from scanlang.recipes.kaczmarz import kaczmarz_delta_rule

    def op(q, k, v, g, eta, h0):
        return kaczmarz_delta_rule(q, k, v, g, eta, initial_state=h0, output_final_state=True, backend="triton")

    dec = _delta_inputs(8, 1, 16, 128, 128, False, device)
    fwd = _delta_inputs(2, 256, 4, 64, 64, False, device)
    train = _delta_inputs(2, 256, 4, 64, 64, True, device)
    do = torch.randn(2, 256, 4, 64, device=device)

    def decode():
        with torch.no_grad():
            op(*dec)

    def chunked_fwd():
        with torch.no_grad():
            op(*fwd)

    def chunked_fwd_bwd():
        o, S = op(*train)
        torch.autograd.grad((o, S), train, (do, torch.ones_like(S)))

    return {"decode (T=1, recurrent)": decode, "chunked fwd": chunked_fwd, "chunked fwd+bwd": chunked_fwd_bwd}


def _report_delta(args):
    from scanlang import tuning
    with tuning.override(delta_eager_fast_path=not args.op_path and tuning.current().delta_eager_fast_path):
        _report_delta_calls(args)


def _report_delta_calls(args):
    device = "cuda" if torch.cuda.is_available() else "cpu"
    print(f"host time per call ({device}, launches {'real' if device == 'cuda' else 'no-ops'}; torch "
          f"{torch.__version__}, {'torch.library op path' if args.op_path else 'default path'}), "
          f"best of {args.repeat} x {args.calls} calls:")
    for name, fn in delta_calls(device).items():
        print(f"  {name:26s} {_per_call_us(fn, args.calls, args.repeat):8.1f} us", flush=True)
        if args.profile:
            print_profile(fn, args.calls, top=12)


def linear_calls(member: str, device: str = "cpu") -> dict[str, Callable[[], None]]:
    """name -> a zero-argument function doing one call of the matrix-state member `member` on `device`
    (B1 T512 H2 K=V=64, bf16; its per-token gates from bench_linear's inputs)."""
    from scanlang import tuning
    from scanlang.recipes import linear
    from scanlang.tools.bench_linear import EXTRA, MEMBERS
    if member not in MEMBERS:
        raise ValueError(f"--member: expected one of {', '.join(MEMBERS)}, got {member!r}")
    gen = torch.Generator().manual_seed(0)
    B, T, H, K, V = 1, 512, 2, 64, 64
    q, k = (torch.randn(B, T, H, K, generator=gen) * K ** -0.5 for _ in range(2))
    k = torch.nn.functional.normalize(k, dim=-1)
    v = torch.randn(B, T, H, V, generator=gen)
    extra = []
    for name, per_key, rows in EXTRA[member]:
        shape = (B, T * rows, H) + ((K,) if per_key else ())
        extra.append(-torch.rand(shape, generator=gen) * 0.1 if name == "g" else torch.rand(shape, generator=gen))
    ins = [t.to(device, torch.bfloat16) for t in (q, k, v)] + [t.to(device) for t in extra]
    train = [t.clone().requires_grad_() for t in ins]
    fn = getattr(linear, member)
    do = torch.randn(B, T, H, V, device=device, dtype=torch.bfloat16)

    def forward():
        with torch.no_grad(), tuning.override(decode_max_tokens=0):
            fn(*ins, backend="triton")

    def fwd_bwd():
        torch.autograd.grad(fn(*train, backend="triton")[0], train, do)
    return {f"{member} chunked fwd": forward, f"{member} chunked fwd+bwd": fwd_bwd}


def _report_linear(args):
    device = "cuda" if torch.cuda.is_available() else "cpu"
    print(f"host time per call ({device}, launches {'real' if device == 'cuda' else 'no-ops'}; torch "
          f"{torch.__version__}), best of {args.repeat} x {args.calls} calls:")
    for name, fn in linear_calls(args.member, device).items():
        print(f"  {name:30s} {_per_call_us(fn, args.calls, args.repeat):8.1f} us", flush=True)
        if args.profile:
            print_profile(fn, args.calls, top=20)


def print_profile(fn, calls: int, top: int = 15) -> None:
    """cProfile's `top` functions by own time over `calls` calls of `fn`."""
    prof = cProfile.Profile()
    prof.enable()
    for _ in range(calls):
        fn()
    prof.disable()
    pstats.Stats(prof, stream=sys.stdout).sort_stats("tottime").print_stats(top)


if __name__ == "__main__":
    sys.exit(main())
