"""Registers, spills, shared memory and SASS mix of the generated kernels, compiled offline (no GPU).

    python -m scanlang.tools.offline_compile [--workload kalman|affine|mobius] [--arch 90]
                                             [--layout time|channels] [--lanes BLOCK_L,WARPS,CHUNK,UNROLL ...]
                                             [--tile BLOCK_T,BLOCK_L,WARPS,STAGES ...]
    python -m scanlang.tools.offline_compile --workload delta [--K 128] [--V 128] [--dtype bf16] [--arch 90]
                                             [--rule kaczmarz|given] [--only prep,wu]
    python -m scanlang.tools.offline_compile --workload linear [--member gla|kda] [--K 128] [--V 128] [--dtype bf16]

Runs one forward and backward of the workload on CPU tensors with the launches captured instead of
executed, compiles every captured kernel for the target as a launch with those arguments would, and
reports ptxas -v (registers, spill bytes), Triton's shared memory, the static SASS instruction mix from
nvdisasm and the longest loop. This is how launch configs are compared when no GPU is at hand; only
timings need one (scanlang.tools.bench_scan, bench_kalman, bench_delta). The code is the installed
Triton's, whose layouts can differ from another version's, so install the GPU machine's Triton version
to see its code (BENCHMARKS.md names it). Needs TRITON_INTERPRET unset and Triton's bundled ptxas and
nvdisasm.

Scan workloads (kalman, affine, mobius): Triton's own binder specialises the captured arguments; the
report adds the barriers, shuffles, local-memory traffic, the commonest opcodes, and the longest loop
per element or lane-step. The delta workload: the delta-rule op's launches (`ops._launch`) with their
real argument types, the alignment specialisation a GPU launch gives them, and the launch config the
plan gives them (`tuning.current().delta_launch_configs()` adjusted by `ops.SHARED_MEMORY_FITS`); this
is how the configs that do not fit sm_90's 227 KB of shared memory per block were found. fp32 delta inputs compile slowly
(minutes per kernel at K=256: their dots run on FMA units and spill tens of KB per thread).
"""
from __future__ import annotations

import argparse
import collections
import contextlib
import os
import re
import subprocess
import tempfile
from dataclasses import dataclass

import torch
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from triton.runtime.jit import JITFunction

from scanlang import tuning
from scanlang.backends.delta import ops as delta_ops
from scanlang.delta import GIVEN, KACZMARZ

_TYPES = {torch.bfloat16: "bf16", torch.float16: "fp16", torch.float32: "fp32", torch.float64: "fp64",
          torch.int32: "i32", torch.int64: "i64"}
_OPTIONS = ("num_warps", "num_stages")


@dataclass
class Launch:
    """One captured launch: the kernel, its positional arguments and its keyword constexprs/options."""

    kernel: JITFunction
    args: tuple
    kwargs: dict

    @property
    def options(self) -> dict:
        return {k: v for k, v in self.kwargs.items() if k in _OPTIONS}

    @property
    def constexprs(self) -> dict:
        """Keyword constexprs, plus the kernel's own defaults for those not passed."""
        out = {k: v for k, v in self.kwargs.items() if k not in _OPTIONS}
        for p in self.kernel.params[len(self.args):]:
            if p.name not in out and p.is_constexpr and p.has_default:
                out[p.name] = p.default
        return out


@contextlib.contextmanager
def captured():
    """Within the block, Triton launches are recorded (list of `Launch`) instead of run, and the
    Triton backend accepts CPU tensors without the interpreter."""
    from scanlang.backends import triton as backend
    launches: list[Launch] = []
    saved_run, saved_check = JITFunction.run, backend._check

    def record(self, *args, grid, warmup, **kwargs):
        launches.append(Launch(self, args, kwargs))

    JITFunction.run = record
    backend._check = lambda *a, **k: None
    try:
        yield launches
    finally:
        JITFunction.run, backend._check = saved_run, saved_check


def signature(kernel, args, constexprs) -> dict:
    """Triton's signature for `kernel` called with `args` (tensors by dtype, ints as i32) and constexprs."""
    sig = {}
    for name, arg in zip(kernel.arg_names, list(args) + [None] * len(kernel.arg_names)):
        if name in constexprs:
            sig[name] = "constexpr"
        elif isinstance(arg, torch.Tensor):
            sig[name] = "*" + _TYPES[arg.dtype]
        elif isinstance(arg, bool):
            sig[name] = "i1"
        elif isinstance(arg, int):
            sig[name] = "i32"
        elif isinstance(arg, float):
            sig[name] = "fp32"
        else:
            raise TypeError(f"{kernel.__name__}: no type for argument {name}={arg!r}")
    return sig


def compile_like_launch(launch: Launch, arch: int = 90):
    """The kernel compiled for `arch` as a launch with these arguments compiles it on a GPU: Triton's
    own binder specialises the arguments (integers equal to 1 become constants, multiples of 16 and
    16-byte aligned pointers get divisibility hints), so registers, layouts and SASS are the GPU's,
    for the installed Triton version (install the GPU machine's version to see its code)."""
    from triton.compiler import make_backend
    from triton.runtime.jit import create_function_from_signature
    kernel = launch.kernel
    target = GPUTarget("cuda", arch, 32)
    backend = make_backend(target)
    binder = create_function_from_signature(kernel.signature, kernel.params, backend)
    kwargs = dict(launch.kwargs, debug=False)
    bound, specialization, options = binder(*launch.args, **kwargs)
    options, sig, constexprs, attrs = kernel._pack_args(backend, kwargs, bound, specialization, options)
    return triton.compile(ASTSource(kernel, sig, constexprs, attrs), target=target, options=options.__dict__)


def _tool(*names: str) -> str:
    """The first of `names` bundled with Triton (its newest ptxas is named ptxas-blackwell)."""
    bin_dir = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin")
    return next((os.path.join(bin_dir, n) for n in names if os.path.exists(os.path.join(bin_dir, n))), names[-1])


def ptxas_summary(compiled, arch: int = 90) -> dict:
    """registers and spill bytes from ptxas -v, and Triton's shared memory in bytes."""
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "k.ptx")
        with open(path, "w") as f:
            f.write(compiled.asm["ptx"])
        out = subprocess.run([_tool("ptxas-blackwell", "ptxas"), f"-arch=sm_{arch}a", "-v", path, "-o", os.path.join(tmp, "k.cubin")],
                             capture_output=True, text=True)
    text = out.stdout + out.stderr
    regs = re.search(r"Used (\d+) registers", text)
    spill = re.search(r"(\d+) bytes spill stores, (\d+) bytes spill loads", text)
    if regs is None:
        raise RuntimeError(f"ptxas failed: {text.strip()[-300:]}")
    if text.count("Used ") != 1:
        raise RuntimeError(f"ptxas reported {text.count('Used ')} functions: {text.strip()[-300:]}")
    return dict(registers=int(regs.group(1)), spill_stores=int(spill.group(1)) if spill else None,
                spill_loads=int(spill.group(2)) if spill else None, shared=compiled.metadata.shared)


def _sass(compiled) -> list[str]:
    """The instruction lines of the kernel's SASS (nvdisasm)."""
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "k.cubin")
        with open(path, "wb") as f:
            f.write(compiled.asm["cubin"])
        sass = subprocess.run([_tool("nvdisasm"), "-c", path], capture_output=True, text=True).stdout
    return sass.splitlines()


_OPCODE = re.compile(r"\s*/\*[0-9a-f]+\*/\s+(?:@!?U?P\w+\s+)?([A-Z0-9_]+)")


def sass_mix(compiled) -> collections.Counter:
    """Static count of SASS opcodes (modifiers dropped: IMAD.WIDE counts as IMAD)."""
    ops = collections.Counter()
    for line in _sass(compiled):
        m = _OPCODE.match(line)
        if m:
            ops[m.group(1)] += 1
    return ops


def longest_loop(compiled) -> int:
    """Instructions in the kernel's longest loop (the widest backward branch): the hot loop, apart from
    the prologue and epilogue the whole-kernel count includes. An upper bound: a loop that also holds
    a masked copy of its body for partial blocks (the lane-sequential kernels) counts both."""
    lines = _sass(compiled)
    labels, best = {}, 0
    for i, line in enumerate(lines):
        m = re.match(r"^(\.L_x_\d+):", line)
        if m:
            labels[m.group(1)] = i
        m = re.search(r"BRA `\((\.L_x_\d+)\)", line)
        if m and m.group(1) in labels:
            best = max(best, sum(1 for ln in lines[labels[m.group(1)]:i + 1] if _OPCODE.match(ln)))
    return best


def inner_loops(compiled) -> list[int]:
    """Instructions in each innermost loop (a loop holding no other loop), in SASS order: the hot
    paths. The lane-sequential kernels' full-block loops (the backward's replay and walk through
    scratch), without the masked copy of the chunk's partial block that `longest_loop` counts."""
    lines = _sass(compiled)
    labels, loops = {}, []
    for i, line in enumerate(lines):
        m = re.match(r"^(\.L_x_\d+):", line)
        if m:
            labels[m.group(1)] = i
        m = re.search(r"BRA `\((\.L_x_\d+)\)", line)
        if m and m.group(1) in labels and labels[m.group(1)] < i:
            loops.append((labels[m.group(1)], i))
    inner = [(a, b) for a, b in loops
             if b > a + 1 and not any(a <= c and d <= b and (c, d) != (a, b) for c, d in loops)]
    return [sum(1 for ln in lines[a:b + 1] if _OPCODE.match(ln)) for a, b in inner]


def report(launch: Launch, arch: int = 90) -> str:
    """One line per kernel: registers, spills, shared memory, the SASS mix and the longest loop's length
    per element (tiles) or per lane-step (lane-sequential)."""
    compiled = compile_like_launch(launch, arch)
    res = ptxas_summary(compiled, arch)
    ops = sass_mix(compiled)
    c = launch.constexprs
    if "UNROLL" in c:   # lane-sequential: a loop iteration is UNROLL steps of R lanes per thread
        per, unit = c["UNROLL"] * c.get("R", 1), "lane-step"
    else:               # tiles: a loop iteration is one tile, spread over the program's threads
        per, unit = max(1, c["BLOCK_T"] * c["BLOCK_L"] // (32 * launch.options.get("num_warps", 4))), "element"
    loop = longest_loop(compiled)
    inner = inner_loops(compiled) if "UNROLL" in c else []
    hot = f", inner loops {' + '.join(map(str, inner))} ({sum(inner) / per:.1f} per {unit})" if inner else ""
    common = ", ".join(f"{k} {v}" for k, v in ops.most_common(6))
    return (f"{launch.kernel.__name__:20s} {res['registers']:3d} registers, spills {res['spill_stores']} B stored / "
            f"{res['spill_loads']} B loaded, shared {res['shared']} B; SASS {sum(ops.values())}, longest loop {loop} "
            f"({loop / per:.1f} per {unit}){hot}, BAR {ops['BAR']}, SHFL {ops['SHFL']}, LDL {ops['LDL']}, "
            f"STL {ops['STL']}; {common}")


def run_workload(workload: str, layout: str = "time"):
    """One forward and backward of `workload` on small CPU tensors (the launches are captured); the scans'
    `layout` is time contiguous ([1, 64, 4096]) or channels contiguous ([1, 4096, 256])."""
    if workload == "kalman":
        from scanlang.recipes.kalman import kalman_filter
        from scanlang.tools.bench_kalman import make_inputs
        ins = [x.requires_grad_() for x in make_inputs(2, 40, 8, 16, "cpu")]
        y, y_var, _ = kalman_filter(*ins, backend="triton", form="fused", validate=False)
        torch.autograd.grad((y, y_var), ins, (torch.randn_like(y), torch.randn_like(y_var)))   # dense, as in training
        return
    from scanlang.tools.bench_scan import _mixer   # the benchmark's mixers, time-contiguous [B, D, T], its T
    mix = _mixer(workload, layout)
    names = ("a", "b") if workload == "affine" else ("a", "b", "c", "d")
    shape = (1, 64, 4096) if layout == "time" else (1, 4096, 256)
    data = {n: (torch.rand(shape) + 0.5).requires_grad_() for n in names}
    y = mix(**data)[0]
    torch.autograd.grad(y, tuple(data.values()), torch.randn_like(y))   # a dense upstream gradient, as in training


# the delta-rule kernels (--workload delta)

_MIX = ("BAR", "SHFL", "LDL", "STL", "LDS", "STS", "LDG", "STG", "HGMMA", "HMMA", "FFMA")   # SASS opcodes shown


@contextlib.contextmanager
def _recording():
    """Within the block, the op's kernel launches are recorded as (name, kernel, args, constexprs, config)
    instead of run (captured on CPU tensors, compiled for a GPU: no interpreter emulation of bf16)."""
    launches = []

    def record(name, kernel, grid, args, meta, V_, configs=None, direct=False):
        cfg = dict(configs[name]) if configs is not None else delta_ops._opts(name, V_)
        defaults = {p.name: p.default for p in getattr(kernel, "params", ())   # constexprs left at their defaults
                    if p.is_constexpr and p.has_default and p.name not in meta and p.name not in cfg}
        launches.append((name, kernel, args, dict(meta, **defaults, UPCAST=False), cfg))

    saved, delta_ops._launch = delta_ops._launch, record
    try:
        yield launches
    finally:
        delta_ops._launch = saved


def capture_launches(K: int, V: int, dtype: torch.dtype, T: int = 200, H: int = 16, C: int = 64, rule=KACZMARZ):
    """[(name, kernel, args, constexprs, config)] of one forward and backward of `rule`, nothing executed."""
    with _recording() as launches:
        q, k = torch.randn(1, T, H, K).to(dtype), torch.randn(1, T, H, K).to(dtype)
        v = torch.randn(1, T, H, V).to(dtype)
        ins = [t.requires_grad_() for t in (q, k, v, -torch.rand(1, T, H), torch.rand(1, T, H))]
        o, _ = delta_ops.delta_rule(*ins, rule, scale=K ** -0.5, chunk_size=C, eps=1e-6)
        torch.autograd.grad(o.sum(), ins)
    return launches


def capture_decode(K: int, V: int, dtype: torch.dtype, H: int = 4):
    """The same for one decode step (one token, no gradients: the recurrent kernel)."""
    with _recording() as launches:
        q, k, v = (torch.randn(1, 1, H, d).to(dtype) for d in (K, K, V))
        delta_ops.delta_rule(q, k, v, -torch.rand(1, 1, H), torch.rand(1, 1, H), KACZMARZ, scale=K ** -0.5, eps=1e-6)
    return launches


def frontend_errors(float_type: str = "fp64") -> dict:
    """{kernel name: None or the error} of Triton's front end (source -> TTIR, no ptxas) on every kernel a
    forward and backward (bf16, and fp32 at K=256, whose backward keeps `dU_local`) and a decode step launch,
    with the Python-float arguments (eps, scale) typed `float_type`. torch.compile's inductor types them fp64
    (a plain launch, fp32), and an fp64 scalar widens whatever it touches: a dot's accumulator or a loop-carried
    state then changes type and the kernel fails to compile (the compiled-op GPU test found this)."""
    from triton._C.libtriton import ir
    from triton.compiler import make_backend
    target = GPUTarget("cuda", 90, 32)
    backend = make_backend(target)
    launches = (capture_launches(32, 16, torch.bfloat16, T=40) + capture_launches(256, 16, torch.float32, T=40)
                + capture_decode(32, 16, torch.bfloat16))
    errors = {}
    for name, kernel, args, meta, cfg in launches:
        consts = {k: v for k, v in {**meta, **cfg}.items() if k in kernel.arg_names}
        sig = signature(kernel, args, consts)
        sig.update({n: float_type for n, a in zip(kernel.arg_names, args) if isinstance(a, float) and n not in consts})
        options = backend.parse_options({k: v for k, v in cfg.items() if k in ("num_warps", "num_stages")})
        context = ir.context()
        ir.load_dialects(context)
        backend.load_dialects(context)
        try:
            ASTSource(kernel, sig, consts).make_ir(target, options, backend.get_codegen_implementation(options),
                                                   backend.get_module_map(), context)
            errors.setdefault(name, None)
        except Exception as exc:   # reported by name: the test shows every failing kernel at once
            errors[name] = f"{type(exc).__name__}: {str(exc)[-400:]}"
    return errors


def alignment_attrs(kernel, args, consts) -> dict:
    """What Triton's launcher specialises on a GPU: 16-byte aligned pointers and integers divisible by 16
    (tt.divisibility 16). Without it every load and store compiles unvectorised, with a 64-bit address
    per element, and the register counts are those of a kernel that never runs."""
    attrs = {}
    for i, (name, arg) in enumerate(zip(kernel.arg_names, args)):
        if name in consts or isinstance(arg, bool):
            continue
        if (isinstance(arg, torch.Tensor) and arg.data_ptr() % 16 == 0) or (isinstance(arg, int) and arg % 16 == 0):
            attrs[(i,)] = [["tt.divisibility", 16]]
    return attrs


def delta_report(kernel, args, constexprs, config, arch: int = 90) -> str:
    """ptxas -v summary (registers, spill bytes), Triton's shared memory, the static SASS mix and the longest
    loop's instruction count (the sequential kernels' per-chunk step) for one compiled delta-rule kernel. A
    config's `maxnreg` caps the registers (ptxas spills the rest)."""
    consts = {k: v for k, v in {**constexprs, **config}.items() if k in kernel.arg_names}
    src = ASTSource(fn=kernel, signature=signature(kernel, args, consts), constexprs=consts,
                    attrs=alignment_attrs(kernel, args, consts))
    options = {k: v for k, v in config.items() if k in ("num_warps", "num_stages", "maxnreg")}
    compiled = triton.compile(src, target=GPUTarget("cuda", arch, 32), options=options)
    try:
        res = ptxas_summary(compiled, arch)
    except RuntimeError as exc:   # reported in the kernel's row: the other kernels' rows still come
        return str(exc)
    ops = sass_mix(compiled)
    mix = " ".join(f"{op} {ops[op]}" for op in _MIX)
    return (f"{res['registers']:>3d} registers, spills {res['spill_stores']} B stored / "
            f"{res['spill_loads']} B loaded, shared {res['shared']} B; "
            f"SASS {sum(ops.values())}: {mix}; longest loop {longest_loop(compiled)}")


# the generated matrix-state kernels (--workload linear; backends/linear)

def capture_linear(member: str, K: int, V: int, dtype: torch.dtype, T: int = 200, H: int = 16, C: int = 64):
    """[(name, kernel, args, constexprs, config)] of one forward and backward of a plain-write member
    (linear_attention, simple_gla, gla) or of kda (per-key decay, delta correction), nothing executed
    (backends.linear.ops.recording)."""
    from scanlang.backends.linear import ops as linear_ops
    from scanlang.recipes import linear
    q, k = torch.randn(1, T, H, K).to(dtype), torch.randn(1, T, H, K).to(dtype)
    v = torch.randn(1, T, H, V).to(dtype)
    extra = {"linear_attention": [], "simple_gla": [-torch.rand(1, T, H)], "gla": [-torch.rand(1, T, H, K)],
             "kda": [-torch.rand(1, T, H, K), torch.rand(1, T, H)]}[member]
    ins = [t.requires_grad_() for t in (q, k, v, *extra)]
    with linear_ops.recording() as launches:
        o, _ = getattr(linear, member)(*ins, backend="triton", chunk_size=C)
        torch.autograd.grad(o.sum(), ins)
    out = []
    for name, kernel, _grid, args, meta in launches:   # (the launch settings are CUDA's: ops._for_cuda)
        config = {key: meta.pop(key) for key in list(meta) if key in _OPTIONS}
        out.append((name, kernel, args, dict(meta, UPCAST=False), config))
    return out


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--workload", choices=("kalman", "affine", "mobius", "delta", "linear"), default="kalman")
    parser.add_argument("--member", choices=("linear_attention", "simple_gla", "gla", "kda"), default="gla",
                        help="linear: the member (kda: the per-key delta kernels)")
    parser.add_argument("--arch", type=int, default=90)
    parser.add_argument("--layout", choices=("time", "channels"), default="time", help="the scans' layout")
    parser.add_argument("--lanes", nargs="*", default=None,
                        help="lane-sequential configs BLOCK_L,WARPS,CHUNK,UNROLL (default: the chosen config)")
    parser.add_argument("--tile", nargs="*", default=None,
                        help="tile configs BLOCK_T,BLOCK_L,WARPS,STAGES for both passes, checkpoints every BLOCK_T")
    parser.add_argument("--K", type=int, default=128, help="delta: key size")
    parser.add_argument("--V", type=int, default=128, help="delta: value size")
    parser.add_argument("--dtype", choices=("bf16", "fp16", "fp32"), default="bf16", help="delta: input dtype")
    parser.add_argument("--rule", choices=("kaczmarz", "given"), default="kaczmarz",
                        help="delta: the rule (the Kaczmarz step, or GDN's given beta)")
    parser.add_argument("--only", default="", help="delta: comma-separated kernel names (default: all)")
    args = parser.parse_args(argv)
    if args.lanes and args.tile:
        parser.error("--lanes and --tile: give one of them")
    if os.environ.get("TRITON_INTERPRET"):
        raise SystemExit("unset TRITON_INTERPRET: the kernels are compiled for the GPU, not interpreted")
    if args.workload == "delta":
        _delta_main(args)
    elif args.workload == "linear":
        _linear_main(args)
    else:
        _scan_main(args)


def _delta_main(args):
    only = set(filter(None, args.only.split(",")))
    dtype = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}[args.dtype]
    rule = {"kaczmarz": KACZMARZ, "given": GIVEN}[args.rule]
    print(f"delta-rule kernels of {rule.name}, K={args.K} V={args.V} {args.dtype}, sm_{args.arch}, "
          f"Triton {triton.__version__}")
    knobs = tuning.current()
    configs = list(knobs.delta_launch_configs().values())   # as delta_ops.plan
    host = {key: cfg[key] for cfg in configs for key in delta_ops.HOST_KEYS if key in cfg}
    print(f"  host keys (buffers, not launch options): {host}; SAVE_WU={knobs.delta_save_wu}")
    for name, kernel, kargs, meta, cfg in capture_launches(args.K, args.V, dtype, rule=rule):
        if only and name not in only:
            continue
        print(f"  {name:10s} {str(cfg):52s} {delta_report(kernel, kargs, meta, cfg, args.arch)}", flush=True)


def _linear_main(args):
    dtype = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}[args.dtype]
    print(f"matrix-state kernels of {args.member}, K={args.K} V={args.V} {args.dtype}, sm_{args.arch}, "
          f"Triton {triton.__version__}")
    seen = set()
    for name, kernel, kargs, meta, cfg in capture_linear(args.member, args.K, args.V, dtype):
        key = (name, tuple(sorted(meta.items())))
        if key in seen:   # the forward kernel runs twice (outputs; the backward's state recomputation)
            continue
        seen.add(key)
        flags = ",".join(k for k in ("STORE_O", "STORE_H") if meta.get(k))
        print(f"  {name:28s} {flags:8s} {str(cfg):18s} {delta_report(kernel, kargs, meta, cfg, args.arch)}", flush=True)


def _scan_main(args):
    from scanlang.backends.triton import runtime
    print(f"{args.workload}: sm_{args.arch}, Triton {triton.__version__}")
    # kalman: the small capture shape runs the schedule the full-size layer uses
    lanes_min = dict(lanes_min=1) if args.workload == "kalman" else {}
    for spec in args.lanes or args.tile or [None]:
        forced = {}
        runtime.FITTED.clear()
        if spec is not None and args.lanes:
            block_l, warps, chunk, unroll = (int(x) for x in spec.split(","))
            forced = runtime.lanes_overrides(block_l, warps, chunk, unroll)
        elif spec is not None:
            block_t, block_l, warps, stages = (int(x) for x in spec.split(","))
            cfg = runtime.Config(block_t=block_t, block_l=block_l, num_warps=warps, stages=stages, chunk=block_t)
            forced = {(contiguous, backward): cfg for contiguous in (False, True) for backward in (False, True)}
        with tuning.override(forced=forced, **lanes_min):
            with captured() as launches:
                run_workload(args.workload, args.layout)
            print(f"config {spec or 'chosen by runtime.choose_config'}:")
            for launch in launches:
                print("  " + report(launch, args.arch), flush=True)


if __name__ == "__main__":
    main()
