"""Context parallelism (`cp_group=`) over gloo on CPU: world sizes 2, 3 and 4 against one process.

One spawned group per world size runs every case (process start and imports cost seconds); each
rank holds a contiguous shard of the same global inputs (unequal lengths, an empty shard, shards
shorter than the conv halo, sequences crossing ranks) and the test compares, per rank, its outputs
and the gradients of its shard with the single-process run, and the sum over ranks of the gradients
of inputs every rank passes (initial states, parameters) with the single-process gradient. The
single-process ops are themselves checked against float64 loops in their own test files; here the
contract is "the same result as one process" (docs/context_parallel.md), so the tolerances are the
float64 rows of `scanlang.testing` (float32 rows for the Triton interpreter cases).
"""
from __future__ import annotations

import datetime
import json
import os
import socket
import tempfile
import time
import traceback

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

import scanlang as sl
from scanlang import context_parallel as cp
from scanlang.testing import ratio, tolerance

F64 = torch.float64
SPLITS = {   # shard lengths per world size for T = 9: unequal, one empty, some shorter than a conv halo
    2: (4, 5), 3: (2, 0, 7), 4: (1, 2, 0, 6)}
TINY = {2: (1, 2), 3: (1, 0, 1), 4: (0, 1, 0, 1)}   # T smaller than the world size
GROUP_TIMEOUT_S = 150
WORLD = 4            # one spawned group; world sizes 2 and 3 run on subgroups of its LAST ranks
_GROUP = None        # the process group of the world size being tested (set in each rank)


# ---- harness (runs inside each rank) ------------------------------------------------------------

def _shard(t, lengths, rank, dim=1):
    start = sum(lengths[:rank])
    return t.narrow(dim, start, lengths[rank])


def _compare(name, run, sharded: dict, replicated: dict, lengths, out_kinds, rank, world, what):
    """run(**inputs, cp_group=...) -> tuple of outputs; out_kinds[i] is the sequence dim of output i
    or None for a replicated output (a final state). Returns {quantity: ratio} for this rank."""
    gen = torch.Generator().manual_seed(1234)
    if os.environ.get("SCANLANG_CP_TEST_VERBOSE"):
        print(f"rank {rank}: {name} {lengths}", time.strftime("%X"), flush=True)
    inputs = {**sharded, **replicated}
    leaves = {k: v.detach().clone().requires_grad_(v.is_floating_point()) for k, v in inputs.items()}
    outs = run(**leaves, cp_group=None)
    weights = [torch.randn((world,) + tuple(o.shape) if kind is None else o.shape, generator=gen, dtype=o.dtype)
               for o, kind in zip(outs, out_kinds)]
    loss = 0
    for o, kind, w in zip(outs, out_kinds, weights):
        loss = loss + ((o * w).sum() if kind is not None else sum((o * w[r]).sum() for r in range(world)))
    grads = dict(zip(leaves, torch.autograd.grad(loss, list(leaves.values()), allow_unused=True)))

    local = {k: _shard(v.detach(), lengths, rank).clone().requires_grad_(True) for k, v in sharded.items()}
    local.update({k: v.detach().clone().requires_grad_(v.is_floating_point()) for k, v in replicated.items()})
    louts = run(**local, cp_group=_GROUP)
    lloss = 0
    for o, kind, w in zip(louts, out_kinds, weights):
        lloss = lloss + ((o * _shard(w, lengths, rank, kind)).sum() if kind is not None else (o * w[rank]).sum())
    lgrads = dict(zip(local, torch.autograd.grad(lloss, list(local.values()), allow_unused=True)))

    result = {}
    for i, (o, lo, kind) in enumerate(zip(outs, louts, out_kinds)):
        result[f"{name}: output {i}"] = ratio(lo, o if kind is None else _shard(o, lengths, rank, kind))
    for k in sharded:
        g = grads[k] if grads[k] is not None else torch.zeros_like(inputs[k])
        lg = lgrads[k] if lgrads[k] is not None else torch.zeros_like(local[k])
        result[f"{name}: grad {k}"] = ratio(lg, _shard(g, lengths, rank))
    for k, v in replicated.items():
        if not v.is_floating_point():
            continue
        lg = lgrads[k] if lgrads[k] is not None else torch.zeros_like(v)
        lg = lg.detach().clone()
        dist.all_reduce(lg, group=_GROUP)
        g = grads[k] if grads[k] is not None else torch.zeros_like(v)
        result[f"{name}: grad {k} (sum over ranks)"] = ratio(lg, g)
    return {k: (r, what) for k, r in result.items()}


def _scan_cases(lengths, rank, world):
    T = sum(lengths)
    out = {}
    a = torch.rand(2, T, 3, dtype=F64) * 0.8 + 0.2
    b = torch.randn(2, T, 3, dtype=F64)
    init = {"i0": torch.rand(2, 3, dtype=F64) + 0.5, "i1": torch.randn(2, 3, dtype=F64)}
    for reverse in (False, True):
        for with_init in (False, True):
            def run(a, b, cp_group, i0=None, i1=None, reverse=reverse):
                initial = None if i0 is None else (i0, i1)
                return tuple(sl.scan(sl.Affine, (a, b), dim=1, reverse=reverse, initial=initial,
                                     backend="reference", cp_group=cp_group))
            out.update(_compare(f"scan Affine reverse={reverse} initial={with_init}", run, {"a": a, "b": b},
                                init if with_init else {}, lengths, (1, 1), rank, world, "scan"))
    m = [torch.rand(2, T, 3, dtype=F64) + 0.5 for _ in range(4)]
    m_init = {f"i{j}": torch.rand(2, 3, dtype=F64) + 0.5 for j in range(4)}
    for reverse in (False, True):
        def run(a, b, c, d, cp_group, i0=None, i1=None, i2=None, i3=None, reverse=reverse):
            initial = None if i0 is None else (i0, i1, i2, i3)
            return tuple(sl.scan(sl.Mobius, (a, b, c, d), dim=1, reverse=reverse, initial=initial,
                                 backend="reference", cp_group=cp_group))
        out.update(_compare(f"scan Mobius reverse={reverse}", run, dict(zip("abcd", m)),
                            m_init if reverse else {}, lengths, (1,) * 4, rank, world, "scan"))
    # a user monoid whose gate is a broadcast [D] parameter (same on every rank: its gradient sums)
    x = torch.randn(2, T, 3, dtype=F64)
    for reverse in (False, True):
        def run(x, decay, cp_group, reverse=reverse):
            return tuple(sl.scan(USER, (decay, x), dim=1, reverse=reverse, backend="reference",
                                 cp_group=cp_group))
        out.update(_compare(f"scan user monoid, broadcast parameter, reverse={reverse}", run, {"x": x},
                            {"decay": torch.rand(3, dtype=F64) * 0.8 + 0.1}, lengths, (1, 1), rank, world,
                            "scan"))
    return out


@sl.monoid(fields=("a", "h"), identity=(1, 0), name="cp_test_decayed_sum")
def USER(x, y):   # h -> y.a (x.a h + x.h) + y.h, written by a user; a is a broadcast parameter
    return x.a * y.a, y.a * x.h + y.h


def _delta_cases(lengths, rank, world):
    from scanlang.recipes.kaczmarz import delta_rule, kaczmarz_delta_rule
    T = sum(lengths)
    H, K, V = 2, 3, 4
    out = {}
    starts = sorted({0, 2, 5, min(6, T), T} & set(range(T + 1)))   # a zero-length sequence when T < 6
    for cu in (None, torch.tensor(starts[:2] + starts[1:], dtype=torch.int64)):
        B = 2 if cu is None else 1
        N = B if cu is None else cu.numel() - 1
        sharded = {"q": torch.randn(B, T, H, K, dtype=F64), "k": torch.randn(B, T, H, K, dtype=F64),
                   "v": torch.randn(B, T, H, V, dtype=F64), "g": -torch.rand(B, T, H, dtype=F64) * 0.5,
                   "step": torch.rand(B, T, H, dtype=F64)}
        replicated = {"h0": torch.randn(N, H, K, V, dtype=F64)}
        for op in (delta_rule, kaczmarz_delta_rule):
            def run(q, k, v, g, step, h0, cp_group, op=op, cu=cu):
                return op(q, k, v, g, step, initial_state=h0, output_final_state=True, cu_seqlens=cu,
                          backend="reference", chunk_size=16, cp_group=cp_group)
            out.update(_compare(f"{op.__name__} varlen={cu is not None}", run, sharded, replicated, lengths,
                                (1, None), rank, world, "scan_grad"))
    return out


def _kalman_cases(lengths, rank, world):
    from scanlang.recipes.kalman import kalman_filter
    T, M, S = sum(lengths), 3, 2
    sharded = {"v": torch.randn(2, T, M, dtype=F64), "prec": torch.rand(2, T, M, dtype=F64) + 0.5,
               "k": torch.randn(2, T, S, dtype=F64), "q": torch.randn(2, T, S, dtype=F64)}
    replicated = {"a_bar": torch.rand(M, S, dtype=F64) * 0.5 + 0.5, "p_bar": torch.rand(M, S, dtype=F64) * 0.2 + 0.05,
                  "lam0": torch.rand(2, M, S, dtype=F64) + 0.5, "eta0": torch.randn(2, M, S, dtype=F64)}

    def run(v, prec, k, q, a_bar, p_bar, lam0, eta0, cp_group):
        y, y_var, (lam, eta) = kalman_filter(v, prec, k, q, a_bar, p_bar, initial_state=(lam0, eta0),
                                             output_final_state=True, backend="reference", cp_group=cp_group)
        return y, y_var, lam, eta
    return _compare("kalman_filter", run, sharded, replicated, lengths, (1, 1, None, None), rank, world,
                    "kalman_grad")


def _layer_cases(lengths, rank, world):
    from scanlang.recipes.kaczmarz import KaczmarzLinearAttention, KaczmarzState
    from scanlang.recipes.kalman import KalmanLayerState, KalmanLinearAttention
    T = sum(lengths)
    out = {}
    torch.manual_seed(5)
    kalman = KalmanLinearAttention(d_model=4, d_state=2, d_conv=4).double()
    kacz = KaczmarzLinearAttention(hidden_size=8, num_heads=2, conv_size=4, backend="reference").double()
    for layer, make_state, n_state in ((kalman, KalmanLayerState, 3), (kacz, KaczmarzState, 4)):
        params = dict(layer.named_parameters())
        x = torch.randn(2, T, 8 if layer is kacz else 4, dtype=F64)
        with torch.no_grad():
            _, st = layer(torch.randn(2, 5, x.shape[-1], dtype=F64), return_state=True)
        replicated = {f"state{i}": s.detach() for i, s in enumerate(st)}
        replicated.update({f"param {n}": p.detach() for n, p in params.items()})

        def run(x, cp_group, layer=layer, make_state=make_state, n_state=n_state, **rest):
            weights = {n[len("param "):]: v for n, v in rest.items() if n.startswith("param ")}
            state = make_state(*(rest[f"state{i}"] for i in range(n_state)))
            y, new = torch.func.functional_call(layer, weights, (x,), {"state": state, "return_state": True,
                                                                       "cp_group": cp_group})
            return (y, *new)
        out.update(_compare(f"{type(layer).__name__} (conv halo, state carry)", run, {"x": x}, replicated, lengths,
                            (1,) + (None,) * n_state, rank, world, "scan_grad"))
    return out


def _bad_input_cases(lengths, rank, world):
    """Every rank must raise the same typed error naming the argument (none may hang)."""
    from scanlang.recipes.kaczmarz import delta_rule
    T = sum(lengths)
    n = lengths[rank]
    group = _GROUP
    a, b = torch.rand(1, n, 3, dtype=F64), torch.randn(1, n, 3, dtype=F64)
    cases = {
        "not a group": lambda: sl.scan(sl.Affine, (a, b), dim=1, cp_group="world"),
        "dtype differs": lambda: sl.scan(sl.Affine, (a.float() if rank == 1 else a, b), dim=1, cp_group=group),
        "shape differs": lambda: sl.scan(sl.Affine, (torch.rand(1, n, 3 + (rank == 0)), torch.rand(1, n, 3 + (rank == 0))),
                                         dim=1, cp_group=group),
        "local error on one rank": lambda: sl.scan(sl.Affine, (a, torch.ones(1, n, 3, dtype=torch.int64) if rank == world - 1
                                                             else b), dim=1, cp_group=group),
    }
    q, k = torch.randn(1, n, 2, 3, dtype=F64), torch.randn(1, n, 2, 3, dtype=F64)
    v, g, beta = torch.randn(1, n, 2, 4, dtype=F64), -torch.rand(1, n, 2, dtype=F64), torch.rand(1, n, 2, dtype=F64)
    cases["cu_seqlens differs"] = lambda: delta_rule(q, k, v, g, beta, cu_seqlens=torch.tensor([0, rank % 2 + 1, T]),
                                                     backend="reference", cp_group=group)
    cases["cu_seqlens short of T"] = lambda: delta_rule(q, k, v, g, beta, cu_seqlens=torch.tensor([0, T - 1]),
                                                          backend="reference", cp_group=group)
    cases["v dims on one rank"] = lambda: delta_rule(q, k, v[0] if rank == 0 else v, g, beta, backend="reference",
                                                     cp_group=group)
    result = {}
    for name, fn in cases.items():
        try:
            fn()
            result[name] = ("no error", "")
        except (TypeError, ValueError) as exc:
            result[name] = (type(exc).__name__, str(exc))
    return result


CASE_GROUPS = {"scan": _scan_cases, "delta": _delta_cases, "kalman": _kalman_cases, "layers": _layer_cases}


def _worker(rank, world, port, out_dir, with_interpreter, timeout_s):
    """One rank of the spawned group: every world size's cases (sizes below `world` on the subgroup
    of the last ranks, so group ranks differ from global ranks), results to out_dir/rank<r>.json."""
    global _GROUP
    os.environ.setdefault("TRITON_INTERPRET", "1")
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world,
                            timeout=datetime.timedelta(seconds=timeout_s))
    reports = {}
    try:
        sizes = (world,) if with_interpreter else tuple(sorted(SPLITS))
        for size in sizes:
            members = list(range(world - size, world))
            _GROUP = dist.new_group(ranks=members) if size < world else dist.group.WORLD   # every rank calls
            if rank in members:
                reports[size] = _run_cases(dist.get_rank(_GROUP), size, with_interpreter)
            dist.barrier()
    finally:
        with open(os.path.join(out_dir, f"rank{rank}.json"), "w") as f:
            json.dump(reports, f)
        dist.destroy_process_group()


def _run_cases(rank, world, with_interpreter):
    report = {"ratios": {}, "errors": {}, "bad": {}, "seconds": {}}
    groups = CASE_GROUPS if not with_interpreter else {"interpreter": _interpreter_cases}
    splits = (SPLITS[world],) if with_interpreter or world == 2 else (SPLITS[world], TINY[world])
    for lengths in splits:
        for group_name, cases in groups.items():
            t0 = time.perf_counter()
            torch.manual_seed(0)
            try:
                for k, v in cases(lengths, rank, world).items():
                    report["ratios"][f"{lengths} {k}"] = v
            except Exception:   # recorded; the parent fails the test with the traceback
                report["errors"][f"{lengths} {group_name}"] = traceback.format_exc()
            report["seconds"][f"{lengths} {group_name}"] = time.perf_counter() - t0
    if not with_interpreter:
        report["bad"] = _bad_input_cases(SPLITS[world], rank, world)
        if world == WORLD:
            report["bad"].update(_mesh_cases(rank, world))
    return report


def _interpreter_cases(lengths, rank, world):
    """One tiny case per op on the Triton backend (generated kernels in Triton's interpreter)."""
    from scanlang.recipes.kaczmarz import kaczmarz_delta_rule
    from scanlang.recipes.kalman import kalman_filter
    T = sum(lengths)
    out = {}

    def scan_run(a, b, i1, cp_group):
        return tuple(sl.scan(sl.Affine, (a, b), dim=1, initial=(1.0, i1), backend="triton", cp_group=cp_group))
    out.update(_compare("triton scan Affine", scan_run, {"a": torch.rand(1, T, 2) * 0.8 + 0.2, "b": torch.randn(1, T, 2)},
                        {"i1": torch.randn(1, 2)}, lengths, (1, 1), rank, world, "scan_grad"))
    ema = sl.mixer(sl.Affine, axes="b t d", inputs={"x": "b t d", "decay": "d"},
                   lift=lambda u: (u.decay, (1 - u.decay) * u.x), readout=lambda p, u, q: p.b * u.x, outputs=("h",))
    cu = torch.tensor([0, 3, T])

    def mixer_run(x, decay, i1, cp_group):
        res = ema(x=x, decay=decay, initial=(torch.ones(2, 1, 2), i1), output_final_state=True, cu_seqlens=cu,
                  cp_group=cp_group)
        return res.h, res.final[1]
    out.update(_compare("triton mixer varlen", mixer_run, {"x": torch.randn(1, T, 2)},
                        {"decay": torch.rand(2) * 0.8 + 0.1, "i1": torch.randn(2, 1, 2)}, lengths, (1, None), rank, world,
                        "scan_grad"))

    def delta_run(q, k, v, g, eta, h0, cp_group):
        return kaczmarz_delta_rule(q, k, v, g, eta, initial_state=h0, output_final_state=True, backend="triton",
                                   chunk_size=16, cp_group=cp_group)
    out.update(_compare("triton kaczmarz_delta_rule", delta_run,
                        {"q": torch.randn(1, T, 1, 4), "k": torch.randn(1, T, 1, 4), "v": torch.randn(1, T, 1, 4),
                         "g": -torch.rand(1, T, 1) * 0.5, "eta": torch.rand(1, T, 1)},
                        {"h0": torch.randn(1, 1, 4, 4)}, lengths, (1, None), rank, world, "delta_grad"))

    def kalman_run(v, prec, k, q, a_bar, p_bar, cp_group):
        y, y_var, (lam, eta) = kalman_filter(v, prec, k, q, a_bar, p_bar, output_final_state=True, backend="triton",
                                             form="two_scans", cp_group=cp_group)
        return y, y_var, lam, eta
    out.update(_compare("triton kalman_filter", kalman_run,
                        {"v": torch.randn(1, T, 2), "prec": torch.rand(1, T, 2) + 0.5, "k": torch.randn(1, T, 2),
                         "q": torch.randn(1, T, 2)},
                        {"a_bar": torch.rand(2, 2) * 0.5 + 0.5, "p_bar": torch.rand(2, 2) * 0.2 + 0.05},
                        lengths, (1, 1, None, None), rank, world, "kalman_grad"))
    return {k: (r, w, "float32") for k, (r, w) in out.items()}


def _mesh_cases(rank, world):
    from torch.distributed.device_mesh import init_device_mesh
    result = {}
    a, b = torch.rand(1, 2, 3, dtype=F64), torch.randn(1, 2, 3, dtype=F64)
    mesh = init_device_mesh("cpu", (world,))
    got = sl.scan(sl.Affine, (a, b), dim=1, cp_group=mesh).b
    want = sl.scan(sl.Affine, (a, b), dim=1, cp_group=_GROUP).b
    result["1-D mesh"] = ("equal" if torch.equal(got, want) else "differs", "")
    mesh2 = init_device_mesh("cpu", (2, world // 2))
    try:
        sl.scan(sl.Affine, (a, b), dim=1, cp_group=mesh2)
        result["2-D mesh"] = ("no error", "")
    except (TypeError, ValueError) as exc:
        result["2-D mesh"] = (type(exc).__name__, str(exc))
    return result


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _run_group(world, with_interpreter, timeout_s=GROUP_TIMEOUT_S) -> dict[int, list[dict]]:
    """Spawn `world` ranks on a free local port; {world size: [report per group rank]}."""
    out_dir = tempfile.mkdtemp(prefix=f"scanlang-cp{world}-")
    ctx = mp.start_processes(_worker, args=(world, _free_port(), out_dir, with_interpreter, timeout_s), nprocs=world,
                             join=False, start_method="spawn")
    deadline = time.monotonic() + timeout_s + 60
    try:
        while not ctx.join(timeout=5):
            if time.monotonic() > deadline:
                raise AssertionError(f"world size {world}: the ranks did not finish in time")
    finally:
        for p in ctx.processes:   # only the processes this test started
            if p.is_alive():
                p.terminate()
            p.join(10)
    by_size: dict[int, list] = {}
    for r in range(world):
        with open(os.path.join(out_dir, f"rank{r}.json")) as f:
            for size, report in json.load(f).items():
                by_size.setdefault(int(size), []).append(report)
    return by_size


BAD_EXPECTED = {   # case -> (error type, a word the message must contain)
    "not a group": ("TypeError", "cp_group"), "dtype differs": ("ValueError", "elems['a']"),
    "shape differs": ("ValueError", "elems['a']"), "local error on one rank": ("TypeError", "elems['b']"),
    "cu_seqlens differs": ("ValueError", "cu_seqlens"), "cu_seqlens short of T": ("ValueError", "global length"),
    "v dims on one rank": ("ValueError", "v must have shape"), "1-D mesh": ("equal", ""),
    "2-D mesh": ("ValueError", "cp_group"),
}


def _check_reports(reports):
    errors = {k: v for rep in reports for k, v in rep["errors"].items()}
    assert not errors, "\n".join(f"{k}:\n{v}" for k, v in errors.items())
    checked = 0
    for rank, rep in enumerate(reports):
        for name, entry in rep["ratios"].items():
            r, what = entry[0], entry[1]
            dtype = torch.float32 if len(entry) > 2 else F64
            assert r <= tolerance(what, dtype), f"rank {rank}: {name}: ratio {r:.3e} > {tolerance(what, dtype):.1e}"
            checked += 1
        for name, (kind, message) in rep["bad"].items():
            want_kind, word = BAD_EXPECTED[name]
            assert kind == want_kind and word in message, f"rank {rank}: {name}: got {kind}: {message}"
    messages = {name: {rep["bad"][name][1] for rep in reports} for name in reports[0]["bad"]}
    for name, texts in messages.items():   # the same error on every rank
        assert len(texts) == 1, f"{name}: ranks raised different errors {texts}"
    return checked


@pytest.fixture(scope="module")
def cp_reports():
    return _run_group(WORLD, with_interpreter=False)


@pytest.mark.parametrize("world", sorted(SPLITS))
def test_context_parallel_matches_one_process(cp_reports, world):
    """Reference backend, float64: every op and both layers, forward and every gradient, bad inputs."""
    reports = cp_reports[world]
    assert len(reports) == world
    assert _check_reports(reports) > 100 * world
    assert len(reports[0]["bad"]) == len(BAD_EXPECTED) - (2 if world != WORLD else 0)


@pytest.mark.slow
def test_context_parallel_triton_interpreter():
    """One tiny case per op on the generated kernels (Triton's interpreter), world size 2, float32.

    Slow: each process loads the generated modules into the interpreter (the Kalman summary scan
    generates the 7-field KalmanJoint module), minutes on a 2-core machine."""
    reports = _run_group(2, with_interpreter=True, timeout_s=900)[2]
    assert _check_reports(reports) >= 2 * 20


def test_no_cp_group_is_zero_overhead(monkeypatch):
    """cp_group=None touches no collective and no context-parallel code at all."""
    from scanlang.recipes.kaczmarz import KaczmarzLinearAttention, kaczmarz_delta_rule
    from scanlang.recipes.kalman import KalmanLinearAttention, kalman_filter

    def forbidden(*args, **kwargs):
        raise AssertionError("a collective or context-parallel path ran with cp_group=None")
    for name in ("all_gather", "all_gather_object", "all_reduce", "broadcast", "send", "recv"):
        monkeypatch.setattr(dist, name, forbidden)
    for name in ("agree", "exchange", "make_plan", "halo", "all_reduce_sum"):
        monkeypatch.setattr(cp, name, forbidden)
    a, b = torch.rand(1, 5, 3), torch.randn(1, 5, 3)
    sl.scan(sl.Affine, (a, b), dim=1, backend="reference", cp_group=None).b.sum()
    q, k, v = torch.randn(1, 5, 2, 4), torch.randn(1, 5, 2, 4), torch.randn(1, 5, 2, 4)
    kaczmarz_delta_rule(q, k, v, -torch.rand(1, 5, 2), torch.rand(1, 5, 2), backend="reference", cp_group=None)
    kalman_filter(torch.randn(1, 5, 3), torch.rand(1, 5, 3) + 0.5, torch.randn(1, 5, 2), torch.randn(1, 5, 2),
                  torch.full((3, 2), 0.9), torch.full((3, 2), 0.1), backend="reference", cp_group=None)
    KalmanLinearAttention(d_model=4, d_state=2)(torch.randn(1, 5, 4), cp_group=None)
    KaczmarzLinearAttention(hidden_size=8, num_heads=2, backend="reference")(torch.randn(1, 5, 8), cp_group=None)


def test_plan_segments_and_feeds():
    """The pure-Python plan: pieces, entry/exit pieces and which carries reset or pass through."""
    plan = cp.make_plan((3, 0, 4, 2), rank=2, cu=(0, 2, 2, 5, 9))
    assert plan.local_cu == (0, 2, 4) and plan.piece_seq == (2, 3) and (plan.entry, plan.exit) == (0, 1)
    assert plan.resets == (True, False, False, False) and plan.passes_on == (False, True, False, True)
    rev = cp.make_plan((3, 0, 4, 2), rank=2, reverse=True, cu=(0, 2, 2, 5, 9))
    assert (rev.entry, rev.exit) == (1, 0) and rev.order == [3, 2, 1, 0]
    whole = cp.make_plan((0, 2), rank=0)
    assert whole.local_cu == (0,) and whole.entry == -1


def test_bad_cp_group_type_needs_no_collective():
    with pytest.raises(TypeError, match="cp_group"):
        sl.scan(sl.Affine, (torch.rand(1, 2), torch.rand(1, 2)), dim=1, cp_group=3)
