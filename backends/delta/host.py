"""Host (CPU) time per call of the delta-rule ops, kernels not run: what a GPU call pays before its launches.

    python -m scanlang.backends.delta.host [--calls 200] [--profile] [--op-path]

Runs on CPU tensors under Triton's interpreter with `InterpretedFunction.run` replaced by a no-op, so
every launch returns at once and what is timed is ours: validation, packing, plans and chunk tables,
buffer allocation, autograd and dispatch. Not included: Triton's own launcher on a GPU (argument
binding and the driver call, per launch) and the device allocator. Three calls, median of `--calls`:
one-token decode (B8 H16 K=V=128, carried state, no grad: the recurrent kernel), a chunked forward
without grad and a chunked forward + backward (B2 T256 H4 K=V=64; host work does not depend on the
sizes). `--op-path` routes every chunked call through the torch.library ops (EAGER_FAST_PATH off);
`--profile` prints cProfile's top functions for each.
"""
from __future__ import annotations

import os

os.environ["TRITON_INTERPRET"] = "1"   # before the generated kernels are imported: interpreter launches

import argparse  # noqa: E402
import statistics  # noqa: E402
import sys  # noqa: E402
import time  # noqa: E402

import torch  # noqa: E402

from scanlang.backends.triton.host import print_profile  # noqa: E402


def _no_launches():
    from triton.runtime.interpreter import InterpretedFunction
    InterpretedFunction.run = lambda self, *args, **kwargs: None


def _inputs(B, T, H, K, V, requires_grad):
    gen = torch.Generator().manual_seed(0)
    q, k = (torch.randn(B, T, H, K, generator=gen).to(torch.bfloat16) for _ in range(2))
    v = torch.randn(B, T, H, V, generator=gen).to(torch.bfloat16)
    g, eta = -torch.rand(B, T, H, generator=gen), torch.rand(B, T, H, generator=gen)
    h0 = torch.randn(B, H, K, V, generator=gen)
    return [t.requires_grad_(requires_grad) for t in (q, k, v, g, eta, h0)]


def calls():
    """name -> a zero-argument function doing one call."""
    from scanlang.recipes.kaczmarz import kaczmarz_delta_rule

    def op(q, k, v, g, eta, h0):
        return kaczmarz_delta_rule(q, k, v, g, eta, initial_state=h0, output_final_state=True, backend="triton")

    dec = _inputs(8, 1, 16, 128, 128, False)
    fwd = _inputs(2, 256, 4, 64, 64, False)
    train = _inputs(2, 256, 4, 64, 64, True)
    do = torch.randn(2, 256, 4, 64)

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


def median_us(fn, n: int) -> float:
    for _ in range(5):      # first calls load the generated module and build plans and tables
        fn()
    times = []
    for _ in range(n):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times) * 1e6


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--calls", type=int, default=200)
    parser.add_argument("--profile", action="store_true")
    parser.add_argument("--op-path", action="store_true")
    args = parser.parse_args(argv)
    _no_launches()
    from scanlang.backends.delta import ops
    if args.op_path:
        ops.EAGER_FAST_PATH = False
    print(f"host time per call, kernels not run (torch {torch.__version__}, "
          f"{'torch.library op path' if args.op_path else 'default path'}; {ops.__file__})")
    for name, fn in calls().items():
        print(f"  {name:26s} {median_us(fn, args.calls):8.1f} us", flush=True)
        if args.profile:
            print_profile(fn, args.calls, top=12)
    return 0


if __name__ == "__main__":
    sys.exit(main())
