"""Context parallelism: one long sequence split over ranks, each rank holding a contiguous shard.

    torchrun --nproc-per-node 2 examples/context_parallel.py          # gloo on CPU, NCCL on GPUs
    python examples/context_parallel.py                               # spawns 2 CPU ranks itself

Every op takes `cp_group=` (a ProcessGroup, or a 1-D DeviceMesh): each rank passes its shard of the
time axis and gets its shard of the result, as if one process had run the whole sequence. What the
ranks exchange is one monoid element per rank (the shard's summary), never activations:

    sl.scan(Affine)          2 numbers per lane                   h_t = a_t h_{t-1} + b_t
    kaczmarz_delta_rule      [H, K, K + V] per sequence           S -> A S + R over the shard
    KalmanLinearAttention    7 numbers per (m, s) + d_conv - 1 tokens of conv halo

The script checks every rank's shard (output and gradients) against one process on the whole
sequence and prints the worst relative error.
"""
import os
import socket
import sys

import torch
import torch.distributed as dist

import scanlang as sl
from scanlang.recipes.kaczmarz import kaczmarz_delta_rule
from scanlang.recipes.kalman import KalmanLinearAttention
from scanlang.testing import ratio

T, B, D, H, K, V = 96, 2, 16, 2, 8, 8


def shard_bounds(rank: int, world: int, length: int) -> tuple[int, int]:
    """Contiguous shards in rank order; lengths differ by at most one."""
    base, extra = divmod(length, world)
    start = rank * base + min(rank, extra)
    return start, start + base + (rank < extra)


def main():
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0))) if torch.cuda.is_available() else "cpu"
    group = dist.group.WORLD
    start, end = shard_bounds(rank, world, T)
    torch.manual_seed(0)                                   # the same global inputs on every rank
    worst = {}

    # 1. a plain scan: an exponential moving average with per-channel decay
    a = (torch.rand(B, T, D, device=device) * 0.5 + 0.5)
    b = torch.randn(B, T, D, device=device)
    full = sl.scan(sl.Affine, (a, b), dim=1).b
    mine = sl.scan(sl.Affine, (a[:, start:end], b[:, start:end]), dim=1, cp_group=group).b
    worst["sl.scan Affine"] = ratio(mine, full[:, start:end])

    # 2. the Kaczmarz delta rule with an initial state; the final state is the global one everywhere
    q, k = torch.randn(B, T, H, K, device=device), torch.randn(B, T, H, K, device=device)
    v = torch.randn(B, T, H, V, device=device)
    g, eta = -torch.rand(B, T, H, device=device) * 0.1, torch.rand(B, T, H, device=device)
    h0 = torch.randn(B, H, K, V, device=device)
    o_full, s_full = kaczmarz_delta_rule(q, k, v, g, eta, initial_state=h0, output_final_state=True)
    sl_ = slice(start, end)
    o, s = kaczmarz_delta_rule(q[:, sl_], k[:, sl_], v[:, sl_], g[:, sl_], eta[:, sl_], initial_state=h0,
                               output_final_state=True, cp_group=group)
    worst["kaczmarz_delta_rule output"] = ratio(o, o_full[:, sl_])
    worst["kaczmarz_delta_rule final state"] = ratio(s, s_full)

    # 3. a whole layer, trained with context parallelism: the gradient of each shard of x is that
    #    shard of the one-process gradient; parameter gradients sum over ranks (what DDP all-reduces)
    layer = KalmanLinearAttention(d_model=D, d_state=4).to(device)
    x = torch.randn(B, T, D, device=device)
    xf = x.clone().requires_grad_(True)
    layer(xf).square().sum().backward()
    full_grads = [p.grad.clone() for p in layer.parameters()]
    layer.zero_grad()
    xs = x[:, sl_].clone().requires_grad_(True)
    layer(xs, cp_group=group).square().sum().backward()
    worst["KalmanLinearAttention dx"] = ratio(xs.grad, xf.grad[:, sl_])
    for p, ref in zip(layer.parameters(), full_grads):
        dist.all_reduce(p.grad, group=group)
        worst["KalmanLinearAttention parameter grads"] = max(worst.get("KalmanLinearAttention parameter grads", 0),
                                                             ratio(p.grad, ref))

    errors = [None] * world
    dist.all_gather_object(errors, worst)
    if rank == 0:
        print(f"world size {world}, T = {T} split as {[shard_bounds(r, world, T) for r in range(world)]}")
        for name in worst:
            print(f"  {name:40s} worst RMS(err)/RMS(ref) over ranks: {max(e[name] for e in errors):.1e}")
    bad = [name for name in worst if max(e[name] for e in errors) > 1e-4]
    if bad:
        raise SystemExit(f"mismatch against one process: {bad}")


def _run(rank: int, world: int, port: int):
    backend = "nccl" if torch.cuda.is_available() else "gloo"
    if torch.cuda.is_available():
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", rank)))
    init = "env://" if "RANK" in os.environ else f"tcp://127.0.0.1:{port}"
    dist.init_process_group(backend, init_method=init, rank=rank, world_size=world)
    try:
        main()
    finally:
        dist.destroy_process_group()


if __name__ == "__main__":
    if "RANK" in os.environ:                              # under torchrun
        _run(int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"]), 0)
    else:                                                 # plain `python`: two local CPU ranks
        import torch.multiprocessing as mp
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            free_port = s.getsockname()[1]
        os.environ["CUDA_VISIBLE_DEVICES"] = ""           # a self-spawned demo stays on CPU (gloo)
        mp.spawn(_run, args=(2, free_port), nprocs=2, join=True)
        sys.exit(0)
