"""Registers, spills and shared memory of every generated delta-rule kernel, compiled offline (no GPU).

    python -m scanlang.backends.delta.spills [--K 128] [--V 128] [--dtype bf16] [--arch 90] [--only prep,wu]

Runs the op on CPU tensors with the launches captured instead of executed, compiles each captured
kernel for the target with its real argument types, the alignment specialisation a GPU launch gives them,
and the launch config its plan gives it (`ops.CONFIG` adjusted by `ops.SHARED_MEMORY_FITS`), and asks
ptxas (`-v`) for its resource use, and nvdisasm for the static SASS mix (barriers, shuffles, local-memory
spill traffic, loads/stores, tensor-core and FMA instructions). This is how the
configs that do not fit sm_90's 227 KB of shared memory per block were found; timings need a GPU
(`bench.py`). Needs TRITON_INTERPRET unset and Triton's bundled ptxas. fp32 inputs compile slowly
(minutes per kernel at K=256: their dots run on FMA units and spill tens of KB per thread).
"""
from __future__ import annotations

import argparse
import contextlib
import os
import re
import subprocess
import tempfile

import torch
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

from scanlang.backends.triton.resources import _tool, longest_loop, sass_mix, signature
from scanlang.delta import KACZMARZ

from . import ops

_MIX = ("BAR", "SHFL", "LDL", "STL", "LDS", "STS", "LDG", "STG", "HGMMA", "HMMA", "FFMA")   # SASS opcodes shown


@contextlib.contextmanager
def _recording():
    """Within the block, the op's kernel launches are recorded as (name, kernel, args, constexprs, config)
    instead of run (captured on CPU tensors, compiled for a GPU: no interpreter emulation of bf16)."""
    launches = []

    def record(name, kernel, grid, args, meta, V_, configs=None, direct=False):
        cfg = dict(configs[name]) if configs is not None else ops._opts(name, V_)
        defaults = {p.name: p.default for p in getattr(kernel, "params", ())   # constexprs left at their defaults
                    if p.is_constexpr and p.has_default and p.name not in meta and p.name not in cfg}
        launches.append((name, kernel, args, dict(meta, **defaults, UPCAST=False), cfg))

    saved, ops._launch = ops._launch, record
    try:
        yield launches
    finally:
        ops._launch = saved


def capture_launches(K: int, V: int, dtype: torch.dtype, T: int = 200, H: int = 16, C: int = 64):
    """[(name, kernel, args, constexprs, config)] of one forward and backward, nothing executed."""
    with _recording() as launches:
        q, k = torch.randn(1, T, H, K).to(dtype), torch.randn(1, T, H, K).to(dtype)
        v = torch.randn(1, T, H, V).to(dtype)
        ins = [t.requires_grad_() for t in (q, k, v, -torch.rand(1, T, H), torch.rand(1, T, H))]
        o, _ = ops.delta_rule(*ins, KACZMARZ, scale=K ** -0.5, chunk_size=C, eps=1e-6)
        torch.autograd.grad(o.sum(), ins)
    return launches


def capture_decode(K: int, V: int, dtype: torch.dtype, H: int = 4):
    """The same for one decode step (one token, no gradients: the recurrent kernel)."""
    with _recording() as launches:
        q, k, v = (torch.randn(1, 1, H, d).to(dtype) for d in (K, K, V))
        ops.delta_rule(q, k, v, -torch.rand(1, 1, H), torch.rand(1, 1, H), KACZMARZ, scale=K ** -0.5, eps=1e-6)
    return launches


def frontend_errors(float_type: str = "fp64") -> dict:
    """{kernel name: None or the error} of Triton's front end (source -> TTIR, no ptxas) on every kernel a
    forward and backward (bf16, and fp32 at K=256, whose backward keeps `dU_local`) and a decode step launch,
    with the Python-float arguments (eps, scale) typed `float_type`. torch.compile's inductor types them fp64
    (a plain launch, fp32), and an fp64 scalar widens whatever it touches: a dot's accumulator or a loop-carried
    state then changes type and the kernel fails to compile (H200, session 6: the compiled-op GPU test)."""
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


def resources(kernel, args, constexprs, config, arch: int = 90) -> str:
    """ptxas -v summary (registers, spill bytes), Triton's shared memory, the static SASS mix and the longest
    loop's instruction count (the sequential kernels' per-chunk step) for one compiled kernel. A config's
    `maxnreg` caps the registers (ptxas spills the rest)."""
    consts = {k: v for k, v in {**constexprs, **config}.items() if k in kernel.arg_names}
    src = ASTSource(fn=kernel, signature=signature(kernel, args, consts), constexprs=consts,
                    attrs=alignment_attrs(kernel, args, consts))
    options = {k: v for k, v in config.items() if k in ("num_warps", "num_stages", "maxnreg")}
    compiled = triton.compile(src, target=GPUTarget("cuda", arch, 32), options=options)
    ptxas = _tool("ptxas-blackwell", "ptxas")
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "k.ptx")
        with open(path, "w") as f:
            f.write(compiled.asm["ptx"])
        out = subprocess.run([ptxas, f"-arch=sm_{arch}a", "-v", path, "-o", os.path.join(tmp, "k.cubin")],
                             capture_output=True, text=True)
    text = out.stdout + out.stderr
    if text.count("Used ") != 1:
        return f"ptxas reported {text.count('Used ')} functions: {text.strip()[-300:]}"
    regs = re.search(r"Used (\d+) registers", text)
    spill = re.search(r"(\d+) bytes spill stores, (\d+) bytes spill loads", text)
    if regs is None:
        return f"ptxas failed: {text.strip()[-200:]}"
    ops = sass_mix(compiled)
    mix = " ".join(f"{op} {ops[op]}" for op in _MIX)
    return (f"{regs.group(1):>3s} registers, spills {spill.group(1) if spill else '?'} B stored / "
            f"{spill.group(2) if spill else '?'} B loaded, shared {compiled.metadata.shared} B; "
            f"SASS {sum(ops.values())}: {mix}; longest loop {longest_loop(compiled)}")


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--K", type=int, default=128)
    parser.add_argument("--V", type=int, default=128)
    parser.add_argument("--dtype", choices=("bf16", "fp16", "fp32"), default="bf16")
    parser.add_argument("--arch", type=int, default=90)
    parser.add_argument("--only", default="", help="comma-separated kernel names (default: all)")
    args = parser.parse_args(argv)
    only = set(filter(None, args.only.split(",")))
    dtype = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}[args.dtype]
    print(f"delta-rule kernels, K={args.K} V={args.V} {args.dtype}, sm_{args.arch}, Triton {triton.__version__}")
    host = {key: cfg[key] for cfg in ops.CONFIG.values() for key in ops.HOST_KEYS if key in cfg}
    print(f"  host keys (buffers, not launch options): {host}; SAVE_WU={ops.SAVE_WU}")
    for name, kernel, kargs, meta, cfg in capture_launches(args.K, args.V, dtype):
        if only and name not in only:
            continue
        shown = {k: v for k, v in cfg.items()}
        print(f"  {name:10s} {str(shown):52s} {resources(kernel, kargs, meta, cfg, args.arch)}", flush=True)


if __name__ == "__main__":
    main()
