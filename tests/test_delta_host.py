"""Host-side machinery of the delta-rule ops (Triton's interpreter on CPU): the eager path that skips the
torch.library dispatcher gives the op path's bits, per-shape plans and chunk tables are cached, launch configs
shrunk to fit shared memory stay with their shape, and the launch count per call."""
from __future__ import annotations

import os

os.environ.setdefault("TRITON_INTERPRET", "1")  # before anything imports triton-using code

import pytest  # noqa: E402
import torch  # noqa: E402
from triton.runtime.errors import OutOfResources  # noqa: E402

from scanlang.backends.delta import ops as delta_ops  # noqa: E402
from scanlang.delta import KACZMARZ, KACZMARZ_MAMBA2  # noqa: E402
from scanlang.recipes.kaczmarz import kaczmarz_delta_rule  # noqa: E402

CPU = torch.device("cpu")


@pytest.fixture(autouse=True)
def fresh_caches(monkeypatch, tmp_path):
    monkeypatch.setenv("SCANLANG_CACHE_DIR", str(tmp_path))
    delta_ops.PLANS.clear()
    delta_ops.TABLES.clear()


def inputs(B, T, H, K, V, seed=0):
    gen = torch.Generator().manual_seed(seed)
    q, k = torch.randn(B, T, H, K, generator=gen), torch.randn(B, T, H, K, generator=gen)
    v = torch.randn(B, T, H, V, generator=gen)
    g, eta = -torch.rand(B, T, H, generator=gen) * 0.3 - 1e-3, torch.rand(B, T, H, generator=gen) * 0.98 + 0.01
    return q, k, v, g, eta, torch.randn(B, H, K, V, generator=gen)


def forward_backward(ins, cu_seqlens=None):
    ts = [t.clone().requires_grad_() for t in ins]
    o, S = kaczmarz_delta_rule(*ts[:5], initial_state=ts[5], output_final_state=True, backend="triton",
                               chunk_size=16, cu_seqlens=cu_seqlens)
    gen = torch.Generator().manual_seed(1)
    grads = torch.autograd.grad((o * torch.randn(o.shape, generator=gen)).sum() + S.square().sum(), ts)
    return [o, S, *grads]


@pytest.mark.parametrize("varlen", [False, True])
def test_eager_path_and_op_path_give_identical_bits(monkeypatch, varlen, knobs):
    ins = inputs(1, 37, 2, 16, 16)
    cu = None
    if varlen:
        cu = torch.tensor([0, 5, 37])
        ins = (*ins[:5], torch.randn(2, 2, 16, 16))
    paths = []
    op = delta_ops.delta_chunk_fwd
    monkeypatch.setattr(delta_ops, "delta_chunk_fwd", lambda *a: paths.append("op") or op(*a))
    eager = forward_backward(ins, cu)
    knobs(delta_eager_fast_path=False)
    through_op = forward_backward(ins, cu)
    assert paths == ["op"]                     # the first run never went through the dispatcher
    for a, b in zip(eager, through_op):
        assert torch.equal(a, b)
    with torch.no_grad():                      # forward only: the body itself, no autograd.Function
        knobs(delta_eager_fast_path=True)
        o1, S1 = kaczmarz_delta_rule(*ins[:5], initial_state=ins[5], output_final_state=True, backend="triton",
                                     chunk_size=16, cu_seqlens=cu)
        knobs(delta_eager_fast_path=False)
        o2, S2 = kaczmarz_delta_rule(*ins[:5], initial_state=ins[5], output_final_state=True, backend="triton",
                                     chunk_size=16, cu_seqlens=cu)
    assert torch.equal(o1, o2) and torch.equal(S1, S2) and paths == ["op", "op"]


def test_tracing_and_compiling_take_the_op_path(monkeypatch):
    from torch._subclasses.fake_tensor import FakeTensorMode
    q = torch.randn(4, 2, 16)
    assert delta_ops._eager(q)
    with FakeTensorMode():
        assert not delta_ops._eager(torch.randn(4, 2, 16))
    monkeypatch.setattr(torch.compiler, "is_compiling", lambda: True)
    assert not delta_ops._eager(q)


def test_mamba2_decay_params_through_the_eager_path_match_the_op_path(monkeypatch, knobs):
    q, k, v, a, eta, h0 = inputs(1, 21, 2, 16, 16, seed=3)
    A_log, dt_bias = torch.tensor([-1.0, 0.5]), torch.tensor([0.0, -2.0])

    def run():
        ts = [t.clone().requires_grad_() for t in (q, k, v, a, eta, h0, A_log, dt_bias)]
        o, S = delta_ops.delta_rule(*ts[:5], KACZMARZ_MAMBA2, scale=0.25, initial_state=ts[5],
                                    output_final_state=True, chunk_size=16, eps=1e-6, decay_params=ts[6:])
        return [o, S, *torch.autograd.grad(o.sum() + S.sum(), ts)]
    eager = run()
    knobs(delta_eager_fast_path=False)
    for x, y in zip(eager, run()):
        assert torch.equal(x, y)


def test_plans_and_chunk_tables_are_built_once_per_shape():
    ins = inputs(2, 20, 2, 16, 16)
    forward_backward(ins)
    plans, tables = dict(delta_ops.PLANS), dict(delta_ops.TABLES)
    assert len(plans) == 1 and len(tables) == 1
    forward_backward(ins)                                      # same shape: the same objects, nothing new
    assert delta_ops.PLANS == plans and all(delta_ops.PLANS[key] is p for key, p in plans.items())
    assert delta_ops.TABLES == tables and all(delta_ops.TABLES[key] is t for key, t in tables.items())
    chunks = next(iter(tables.values())).chunks
    assert delta_ops.chunk_table(2, 20, None, 16, CPU).chunks is chunks
    forward_backward(inputs(2, 21, 2, 16, 16))                 # another length: a new table, the same plan
    assert len(delta_ops.PLANS) == 1 and len(delta_ops.TABLES) == 2
    forward_backward(inputs(2, 20, 2, 16, 32))                 # another V: a new plan
    assert len(delta_ops.PLANS) == 2


def test_changing_a_launch_config_drops_the_plans(monkeypatch, knobs):
    key = delta_ops.program_key(KACZMARZ, 16)
    p = delta_ops.plan(key, 16, 16, torch.float32, CPU)
    assert delta_ops.plan(key, 16, 16, torch.float32, CPU) is p
    knobs(delta_configs={"state_output": dict(BV=16, num_warps=2, num_stages=1)})
    fresh = delta_ops.plan(key, 16, 16, torch.float32, CPU)
    assert fresh is not p and fresh.configs["state_output"] == dict(BV=16, num_warps=2, num_stages=1)


class _SharedMemoryLimited:
    """A stand-in kernel that runs out of shared memory above a value block of 32."""

    def __init__(self):
        self.launched = []

    def __getitem__(self, grid):
        def run(*args, **opts):
            if opts["BV"] > 32:
                raise OutOfResources(opts["BV"] * 4096, 32 * 4096, "shared memory")
            self.launched.append(opts["BV"])
        return run


def test_a_config_shrunk_to_fit_stays_with_its_shape():
    key = delta_ops.program_key(KACZMARZ, 16)
    big = delta_ops.plan(key, 128, 128, torch.float32, CPU)
    other = delta_ops.plan(key, 128, 128, torch.bfloat16, CPU)
    before = dict(delta_ops.CONFIG["state_output"])
    kernel = _SharedMemoryLimited()
    for _ in range(2):
        delta_ops._launch("state_output", kernel, lambda cfg: (1,), (), {}, 128, big.configs, direct=True)
    assert kernel.launched == [32, 32]
    assert big.configs["state_output"]["BV"] == 32                  # remembered for this shape
    assert other.configs["state_output"]["BV"] == before["BV"]       # not for others
    assert delta_ops.CONFIG["state_output"] == before
    with pytest.raises(OutOfResources):                        # nothing smaller left: the error surfaces
        tiny = delta_ops.plan(key, 16, 16, torch.float32, CPU)
        tiny.configs["state_output"] = dict(BV=16, num_warps=4, num_stages=1)
        delta_ops._launch("state_output", _AlwaysTooBig(), lambda cfg: (1,), (), {}, 16, tiny.configs, direct=True)


class _AlwaysTooBig:
    def __getitem__(self, grid):
        def run(*args, **opts):
            raise OutOfResources(1 << 20, 1 << 17, "shared memory")
        return run


def test_launches_per_call(monkeypatch):
    """Decode: one launch; chunked forward: prep, state_output; forward + backward (bf16, whose state_bwd forms the
    local dU itself, with the forward's w and u: tuning.delta_save_wu): six."""
    from triton.runtime.interpreter import InterpretedFunction
    from scanlang.tools import host_profile
    launched = []
    monkeypatch.setattr(InterpretedFunction, "run", lambda self, *a, **k: launched.append(self.fn.__name__))
    counts = {}
    for name, call in host_profile.delta_calls().items():
        launched.clear()
        call()
        counts[name] = list(launched)
    assert counts["decode (T=1, recurrent)"] == ["delta_recurrent"]
    assert counts["chunked fwd"] == ["delta_prep", "delta_state_output"]
    assert counts["chunked fwd+bwd"] == ["delta_prep", "delta_state_output", "delta_state_fwd", "delta_state_bwd",
                                         "delta_bwd_dqk", "delta_bwd_wy"]


@pytest.mark.parametrize("op_path", [False, True])
def test_host_profile_reports_the_three_delta_calls_and_restores_the_op_path(capsys, op_path):
    """`python -m scanlang.tools.host_profile --workload delta`: a positive time for each of its three calls, and
    the interpreter and the tuning (delta_eager_fast_path) as they were afterwards."""
    from triton.runtime.interpreter import InterpretedFunction

    from scanlang import tuning
    from scanlang.tools import host_profile
    run, knobs = InterpretedFunction.run, tuning.current()
    argv = ["--workload", "delta", "--calls", "2", "--repeat", "1"] + (["--op-path"] if op_path else [])
    assert host_profile.main(argv) == 0
    assert InterpretedFunction.run is run and tuning.current() is knobs
    out = capsys.readouterr().out
    assert ("torch.library op path" in out) == op_path
    lines = {name: ln for ln in out.splitlines() for name in host_profile.delta_calls() if ln.strip().startswith(name)}
    assert len(lines) == 3 and all(float(ln.split()[-2]) > 0 for ln in lines.values()), out


@pytest.mark.parametrize("through_op", [False, True])
def test_saved_w_u_give_the_recomputed_bits_without_delta_wu(monkeypatch, through_op, knobs):
    """tuning.delta_save_wu: the backward reads the w, u that delta_prep stored in the forward instead of launching delta_wu,
    which recomputes the same bits (eager path and torch.library op path)."""
    from triton.runtime.interpreter import InterpretedFunction
    knobs(delta_eager_fast_path=not through_op)
    knobs(delta_save_wu=False)
    ins = inputs(1, 37, 2, 16, 16)
    recomputed = forward_backward(ins)
    launched = []
    run = InterpretedFunction.run
    monkeypatch.setattr(InterpretedFunction, "run", lambda self, *a, **k: launched.append(self.fn.__name__) or run(
        self, *a, **k))
    knobs(delta_save_wu=True)
    saved = forward_backward(ins)
    assert "delta_wu" not in launched and "delta_state_fwd" in launched
    for a, b in zip(recomputed, saved):
        assert torch.equal(a, b)


def test_plans_respect_the_measured_shared_memory_limits():
    """The 128-column value blocks of state_output do not fit the 227 KB per block of sm_90 at K=256; state_bwd
    keeps a separate dU_local kernel where the fused one spills (fp32, and K=256), on one stage in fp32 at K=256
    (ptxas, see ops.SHARED_MEMORY_FITS), without DECAY_V; other dtypes and K keep CONFIG (less the host's keys)."""
    separate = dict(LOCAL_DU=False, BV=64, num_warps=8, num_stages=2, DECAY_V=False)
    key = delta_ops.program_key(KACZMARZ, 64)
    cfg = {name: {k: v for k, v in c.items() if k not in delta_ops.HOST_KEYS} for name, c in delta_ops.CONFIG.items()}
    fp32 = delta_ops.plan(key, 256, 96, torch.float32, CPU).configs
    assert fp32["state_output"] == {**cfg["state_output"], "BV": 64, "num_stages": 1}
    assert fp32["state_bwd"] == {**separate, "num_stages": 1}
    bf16 = delta_ops.plan(key, 256, 96, torch.bfloat16, CPU).configs
    assert bf16["state_output"] == {**cfg["state_output"], "BV": 64} and bf16["state_bwd"] == separate
    fp32 = delta_ops.plan(key, 128, 96, torch.float32, CPU).configs
    assert fp32["state_bwd"] == separate
    for dtype, K in ((torch.bfloat16, 128), (torch.float16, 64)):
        cfgs = delta_ops.plan(key, K, 96, dtype, CPU).configs
        assert cfgs["state_output"] == cfg["state_output"] and cfgs["state_bwd"] == cfg["state_bwd"]


def test_op_path_passes_every_kernel_parameter(monkeypatch, knobs):
    """torch.compile's mutation analysis of a wrap_triton launch needs every kernel parameter, the defaulted variant
    flags (SEQ_BOUNDS, DG_SUMS, ...) too: without them it assumes every input mutated, and the compiled backward
    fails (H200, session 5, `test_torch_compile_fullgraph_through_the_registered_op`)."""
    import inspect
    real = delta_ops.wrap_triton
    missing = {}

    def recording(kernel):
        names = list(inspect.signature(kernel.fn).parameters)
        launcher = real(kernel)

        class Grid:
            def __getitem__(self, grid):
                def run(*args, **kwargs):
                    missing[kernel.fn.__name__] = [n for n in names[len(args):] if n not in kwargs]
                    return launcher[grid](*args, **kwargs)
                return run
        return Grid()
    monkeypatch.setattr(delta_ops, "wrap_triton", recording)
    knobs(delta_eager_fast_path=False)
    forward_backward([t.to(torch.bfloat16) if t.dim() == 4 and i < 3 else t for i, t in enumerate(inputs(1, 21, 2, 16, 16))])
    assert {"delta_prep", "delta_state_bwd", "delta_bwd_dqk", "delta_bwd_wy"} <= missing.keys()
    assert not any(missing.values()), missing
