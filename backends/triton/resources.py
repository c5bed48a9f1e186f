"""Registers, spills, shared memory and SASS mix of the generated scan kernels, compiled offline (no GPU).

    python -m scanlang.backends.triton.resources [--workload kalman|affine|mobius] [--arch 90]
                                                 [--layout time|channels] [--lanes BLOCK_L,WARPS,CHUNK,UNROLL ...]
                                                 [--tile BLOCK_T,BLOCK_L,WARPS,STAGES ...]

Runs one forward and backward of the workload on CPU tensors with Triton's launches captured instead
of executed, compiles every captured kernel for the target as a launch with those arguments would
(Triton's binder specialises them), and reports ptxas -v (registers, spill bytes), Triton's shared
memory, the static SASS instruction mix from nvdisasm (total, barriers, shuffles, local-memory
traffic, the commonest opcodes) and the longest loop per element or lane-step. This is how launch
configs are compared when no GPU is at hand; only timings need one (`scanlang bench`,
`python -m scanlang.recipes.kalman.bench`). The code is the installed Triton's: the H200 runs
Triton 3.6, whose layouts can differ from a newer version's, so install that version to see the
GPU's code. Needs TRITON_INTERPRET unset and Triton's bundled ptxas and nvdisasm.
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
    for the installed Triton version (the H200 runs 3.6: install that version to see its code)."""
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
        from scanlang.recipes.kalman.bench import make_inputs
        ins = [x.requires_grad_() for x in make_inputs(2, 40, 8, 16, "cpu")]
        y, y_var, _ = kalman_filter(*ins, backend="triton", form="fused", validate=False)
        torch.autograd.grad((y, y_var), ins, (torch.randn_like(y), torch.randn_like(y_var)))   # dense, as in training
        return
    from scanlang.bench import _mixer   # the benchmark's mixers, time-contiguous [B, D, T], its T
    mix = _mixer(workload, layout)
    names = ("a", "b") if workload == "affine" else ("a", "b", "c", "d")
    shape = (1, 64, 4096) if layout == "time" else (1, 4096, 256)
    data = {n: (torch.rand(shape) + 0.5).requires_grad_() for n in names}
    y = mix(**data)[0]
    torch.autograd.grad(y, tuple(data.values()), torch.randn_like(y))   # a dense upstream gradient, as in training


def main(argv=None):
    from . import runtime
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--workload", choices=("kalman", "affine", "mobius"), default="kalman")
    parser.add_argument("--arch", type=int, default=90)
    parser.add_argument("--layout", choices=("time", "channels"), default="time", help="the scans' layout")
    parser.add_argument("--lanes", nargs="*", default=None,
                        help="lane-sequential configs BLOCK_L,WARPS,CHUNK,UNROLL (default: the chosen config)")
    parser.add_argument("--tile", nargs="*", default=None,
                        help="tile configs BLOCK_T,BLOCK_L,WARPS,STAGES for both passes, checkpoints every BLOCK_T")
    args = parser.parse_args(argv)
    if args.lanes and args.tile:
        parser.error("--lanes and --tile: give one of them")
    if os.environ.get("TRITON_INTERPRET"):
        raise SystemExit("unset TRITON_INTERPRET: the kernels are compiled for the GPU, not interpreted")
    print(f"{args.workload}: sm_{args.arch}, Triton {triton.__version__}")
    saved = runtime.LANES_MIN
    if args.workload == "kalman":
        runtime.LANES_MIN = 1   # the small capture shape runs the schedule the full-size layer uses
    try:
        for spec in args.lanes or args.tile or [None]:
            runtime.OVERRIDES.clear()
            runtime.FITTED.clear()
            if spec is not None and args.lanes:
                block_l, warps, chunk, unroll = (int(x) for x in spec.split(","))
                runtime.OVERRIDES.update(runtime.lanes_overrides(block_l, warps, chunk, unroll))
            elif spec is not None:
                block_t, block_l, warps, stages = (int(x) for x in spec.split(","))
                cfg = runtime.Config(block_t=block_t, block_l=block_l, num_warps=warps, stages=stages, chunk=block_t)
                runtime.OVERRIDES.update({(contiguous, backward): cfg for contiguous in (False, True)
                                          for backward in (False, True)})
            with captured() as launches:
                run_workload(args.workload, args.layout)
            print(f"config {spec or 'chosen by runtime.choose_config'}:")
            for launch in launches:
                print("  " + report(launch, args.arch), flush=True)
    finally:
        runtime.LANES_MIN = saved
        runtime.OVERRIDES.clear()


if __name__ == "__main__":
    main()
