"""Context-parallel benchmark: time each op at world sizes 1, 2, 4, ... and check it against world size 1.

    torchrun --nproc-per-node 4 -m scanlang.tools.cp_bench                    # CPU: gloo
    torchrun --nproc-per-node 2 -m scanlang.tools.cp_bench --T 65536 --ops scan,kalman,kaczmarz   # GPUs: NCCL

Every rank builds the same global inputs (a seed); for each world size w in `--sizes` (<= the number
of processes) the first w ranks form a group, split T into equal contiguous shards and run the op
with `cp_group=`; world size 1 is the plain call (`cp_group=None`) on the whole sequence. Before
anything is reported, every rank's outputs and gradients (its shard; the sum over ranks for inputs
every rank passes) are compared with world size 1 by `scanlang.testing`'s tolerance rows; a
mismatch exits non-zero on every rank. Then it prints, per op and world size: the median time per
rank (the slowest rank) of the forward and of forward + backward, the ratio to world size 1, the
summary bytes a rank contributes and the bytes it sends (ring all-gather: (w - 1) x its payload;
the metadata exchange counted separately).

Not imported by the library; it imports the library.
"""
from __future__ import annotations

import argparse
import os
import pickle
import statistics
import sys
import time

import torch
import torch.distributed as dist

import scanlang as sl
from scanlang.testing import ratio, tolerance

OPS = ("scan", "kalman", "kaczmarz", "delta")


def _inputs(op: str, T: int, args, device):
    """(sharded inputs {name: tensor [B, T, ...]}, replicated inputs, run(inputs, cp_group) -> (sharded
    outputs, replicated outputs such as final states), tolerance row)."""
    gen = torch.Generator(device="cpu").manual_seed(0)
    rnd = lambda *shape: torch.randn(*shape, generator=gen).to(device)          # noqa: E731
    uni = lambda *shape: torch.rand(*shape, generator=gen).to(device)           # noqa: E731
    B = args.batch
    if op == "scan":
        D = args.width
        sharded = {"a": uni(B, T, D) * 0.5 + 0.5, "b": rnd(B, T, D)}

        def run(x, cp_group):
            out = sl.scan(sl.Affine, (x["a"], x["b"]), dim=1, cp_group=cp_group)
            return (out.b,), ()
        return sharded, {}, run, "scan_grad"
    if op == "kalman":
        from scanlang.recipes.kalman import kalman_filter
        M, S = args.width, 16
        sharded = {"v": rnd(B, T, M), "prec": uni(B, T, M) + 0.5, "k": rnd(B, T, S), "q": rnd(B, T, S)}
        replicated = {"a_bar": uni(M, S) * 0.5 + 0.5, "p_bar": uni(M, S) * 0.1 + 0.01}

        def run(x, cp_group):
            y, y_var, state = kalman_filter(x["v"], x["prec"], x["k"], x["q"], x["a_bar"], x["p_bar"],
                                            output_final_state=True, validate=False, cp_group=cp_group)
            return (y, y_var), state
        return sharded, replicated, run, "kalman_grad"
    from scanlang.recipes.kaczmarz import delta_rule, kaczmarz_delta_rule
    H, K, V = args.heads, args.head_dim, args.head_dim
    sharded = {"q": rnd(B, T, H, K), "k": rnd(B, T, H, K) / K ** 0.5, "v": rnd(B, T, H, V),
               "g": -uni(B, T, H) * 0.1, "s": uni(B, T, H)}
    replicated = {"h0": rnd(B, H, K, V)}
    fn = kaczmarz_delta_rule if op == "kaczmarz" else delta_rule

    def run(x, cp_group):
        o, S = fn(x["q"], x["k"], x["v"], x["g"], x["s"], initial_state=x["h0"], output_final_state=True,
                  cp_group=cp_group)
        return (o,), (S,)
    return sharded, replicated, run, "delta_grad"


class _Traffic:
    """Counts what this rank hands to the collectives while active (bench-only wrappers)."""

    def __init__(self):
        self.summary = self.sent = self.meta = 0
        self._saved = {}

    def __enter__(self):
        for name in ("all_gather", "all_reduce", "all_gather_object"):
            self._saved[name] = getattr(dist, name)
        world = lambda kw: dist.get_world_size(kw.get("group"))  # noqa: E731

        def all_gather(out, x, *a, **kw):
            self.summary += x.numel() * x.element_size()
            self.sent += (world(kw) - 1) * x.numel() * x.element_size()
            return self._saved["all_gather"](out, x, *a, **kw)

        def all_reduce(x, *a, **kw):
            w = world(kw)
            self.sent += int(2 * (w - 1) / w * x.numel() * x.element_size())
            return self._saved["all_reduce"](x, *a, **kw)

        def all_gather_object(out, obj, *a, **kw):
            self.meta += (world(kw) - 1) * len(pickle.dumps(obj))
            return self._saved["all_gather_object"](out, obj, *a, **kw)
        dist.all_gather, dist.all_reduce, dist.all_gather_object = all_gather, all_reduce, all_gather_object
        return self

    def __exit__(self, *exc):
        for name, fn in self._saved.items():
            setattr(dist, name, fn)


def _sync(device, group):
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    if group is not None:
        dist.barrier(group=group)


def _shard(t, lo, hi):
    return t[:, lo:hi]


def _forward_backward(run, sharded, replicated, lo, hi, group, weights=None):
    """Outputs (sharded, replicated) and, given weights, the gradients of sum(out * weight)."""
    backward = weights is not None
    x = {k: _shard(v, lo, hi).detach().clone().requires_grad_(backward) for k, v in sharded.items()}
    x.update({k: v.detach().clone().requires_grad_(backward) for k, v in replicated.items()})
    outs, finals = run(x, group)
    if not backward:
        return (outs, finals), None
    w_out, w_fin = weights
    loss = sum((o * _shard(w, lo, hi)).sum() for o, w in zip(outs, w_out))
    loss = loss + sum((f * w).sum() for f, w in zip(finals, w_fin))
    names = list(x)
    grads = torch.autograd.grad(loss, [x[n] for n in names], allow_unused=True)
    return (outs, finals), {n: g if g is not None else torch.zeros_like(x[n]) for n, g in zip(names, grads)}


def _median_ms(fn, reps, device, group) -> float:
    fn()                                  # warm-up: compile, caches
    times = []
    for _ in range(reps):
        _sync(device, group)
        t0 = time.perf_counter()
        fn()
        _sync(device, group)
        times.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(times)


def bench_op(op, args, device, rank, groups) -> tuple[list, list]:
    T = args.T
    sharded, replicated, run, row = _inputs(op, T, args, device)
    (outs1, fins1), _ = _forward_backward(run, sharded, replicated, 0, T, None)
    gen = torch.Generator(device="cpu").manual_seed(1)
    weights = ([torch.randn(o.shape, generator=gen).to(device) for o in outs1],
               [torch.randn(f.shape, generator=gen).to(device) for f in fins1])
    (outs1, fins1), grads1 = _forward_backward(run, sharded, replicated, 0, T, None, weights)
    rows, failures, base = [], [], {}
    for w in args.sizes:
        group = groups[w]
        if rank < w:
            lo, hi = rank * T // w, (rank + 1) * T // w
            # a final state is returned on every rank: its weight counts once, on rank 0
            ws = (weights[0], [f if rank == 0 else torch.zeros_like(f) for f in weights[1]])
            traffic = _Traffic()
            if w == 1:
                (outs, fins), grads = (outs1, fins1), grads1
            else:
                with traffic:
                    (outs, fins), grads = _forward_backward(run, sharded, replicated, lo, hi, group, ws)
            checks = [(f"output {i}", o, _shard(r, lo, hi)) for i, (o, r) in enumerate(zip(outs, outs1))]
            checks += [(f"final state {i}", f, r) for i, (f, r) in enumerate(zip(fins, fins1))]
            for name, g in grads.items():
                if name in replicated and group is not None:
                    g = g.clone()
                    dist.all_reduce(g, group=group)
                checks.append((f"grad {name}", g, grads1[name] if name in replicated else _shard(grads1[name], lo, hi)))
            for name, got, want in checks:
                r = ratio(got, want)
                if not r <= tolerance(row, torch.float32):
                    failures.append(f"{op} world {w} rank {rank}: {name}: RMS(err)/RMS(ref) {r:.2e}")
            fwd = _median_ms(lambda: _forward_backward(run, sharded, replicated, lo, hi, group), args.reps, device, group)
            both = _median_ms(lambda: _forward_backward(run, sharded, replicated, lo, hi, group, ws), args.reps,
                              device, group)
            times = torch.tensor([fwd, both], dtype=torch.float64, device=device)
            if group is not None:
                dist.all_reduce(times, op=dist.ReduceOp.MAX, group=group)
            fwd, both = times.tolist()
            if w == 1:
                base = {"fwd": fwd, "both": both}
            if base:   # rank 0, the only rank in every group, prints the table
                rows.append((op, w, T, fwd, both, fwd / base["fwd"], both / base["both"], traffic.summary,
                             traffic.sent, traffic.meta))
        dist.barrier()
    return rows, failures


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--ops", default="scan,kalman,kaczmarz,delta")
    parser.add_argument("--T", type=int, default=4096, help="global sequence length")
    parser.add_argument("--sizes", default=None, help="world sizes, e.g. 1,2,4 (default: powers of two up to "
                                                       "the number of processes)")
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--width", type=int, default=64, help="channels D (scan) / M (kalman)")
    parser.add_argument("--heads", type=int, default=4)
    parser.add_argument("--head-dim", type=int, default=32)
    parser.add_argument("--reps", type=int, default=5)
    args = parser.parse_args(argv)
    if "RANK" not in os.environ:
        print("run under torchrun, e.g. torchrun --nproc-per-node 2 -m scanlang.tools.cp_bench", file=sys.stderr)
        return 2
    cuda = torch.cuda.is_available()
    if cuda:
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
    dist.init_process_group("nccl" if cuda else "gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", torch.cuda.current_device()) if cuda else torch.device("cpu")
    sizes = [1 << i for i in range(world.bit_length()) if 1 << i <= world] if args.sizes is None else \
        [int(s) for s in args.sizes.split(",")]
    if any(s < 1 or s > world for s in sizes) or 1 not in sizes:
        raise SystemExit(f"--sizes: need 1 and sizes <= the {world} processes, got {sizes}")
    args.sizes = sorted(set(sizes))
    groups = {1: None}
    for w in args.sizes[1:]:
        groups[w] = dist.new_group(ranks=list(range(w)))   # every rank takes part in creating it
    ops = [o for o in args.ops.split(",") if o]
    unknown = [o for o in ops if o not in OPS]
    if unknown:
        raise SystemExit(f"--ops: unknown {unknown}; choose from {OPS}")
    all_rows, failures = [], []
    for op in ops:
        rows, fails = bench_op(op, args, device, rank, groups)
        all_rows += rows
        failures += fails
    gathered = [None] * world
    dist.all_gather_object(gathered, failures)
    failures = [f for part in gathered for f in part]
    code = 0
    if rank == 0:
        if failures:
            print("MISMATCH against world size 1:\n  " + "\n  ".join(failures))
            code = 1
        else:
            print(f"device {device.type} ({torch.cuda.get_device_name() if cuda else 'CPU, gloo'}), fp32, "
                  f"batch {args.batch}, median of {args.reps}; all outputs and gradients match world size 1")
            print("| op | world | T | fwd ms/rank | fwd+bwd ms/rank | fwd vs 1 | fwd+bwd vs 1 | gathered B/rank (fwd+bwd) | "
                  "sent B/rank | metadata sent B/rank |")
            print("|---|---|---|---|---|---|---|---|---|---|")
            for r in all_rows:
                print("| {} | {} | {} | {:.2f} | {:.2f} | {:.2f}x | {:.2f}x | {} | {} | {} |".format(*r))
    dist.destroy_process_group()
    return 1 if failures else code


if __name__ == "__main__":
    sys.exit(main())
