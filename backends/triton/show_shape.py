"""`scanlang show MODULE:NAME --shape B,T,D --layout time|channels`: the kernels that would run.

For a [B, T, D] scan (time contiguous: the tensors are [B, D, T] scanned along the last dim;
channels contiguous: [B, T, D] scanned along dim 1), `runtime.choose_config` picks the forward's and
the backward's configs; this prints them and the source those configs run. The chunk-parallel
schedule has a module of its own (kernel/chunked.py), printed whole: the kernels of both passes, with
comments pointing at the monoid's declaration. The tile and lane-sequential schedules still share
one module holding every variant (rendering only the variants a config runs is the next step), so
for them the whole module is printed, as without --shape.
"""
from __future__ import annotations

from . import chunked_launch, runtime
from .kernel import chunked

LAYOUTS = ("time", "channels")


def parse_shape(text: str) -> tuple[int, int, int]:
    """`B,T,D` as three positive integers; a ValueError naming --shape otherwise."""
    parts = str(text).split(",")
    try:
        shape = tuple(int(p) for p in parts)
    except ValueError:
        shape = ()
    if len(shape) != 3 or min(shape) < 1:
        raise ValueError(f"--shape: expected B,T,D (three positive integers, e.g. 1,1048576,16), got {text!r}")
    return shape


def check_layout(layout: str) -> str:
    if layout not in LAYOUTS:
        raise ValueError(f"--layout: expected one of {', '.join(LAYOUTS)}, got {layout!r}")
    return layout


def configs(prog, shape: tuple[int, int, int], layout: str) -> tuple[runtime.Config, runtime.Config]:
    """(forward, backward) configs `choose_config` picks for a training call of this shape and layout."""
    B, T, D = shape
    pick = dict(time_contiguous=layout == "time", state=1, sequential=prog.ir.sequential_only, checkpoint=True,
                chunkable=chunked.supports(prog.ir))
    return (runtime.choose_config(T, B * D, backward=False, **pick),
            runtime.choose_config(T, B * D, backward=True, **pick))


def show(prog, shape, layout: str = "time") -> str:
    """The configs and the generated source they run, for the program `prog` at `shape` and `layout`."""
    shape = parse_shape(",".join(map(str, shape)) if isinstance(shape, (tuple, list)) else shape)
    layout = check_layout(layout)
    fwd, bwd = configs(prog, shape, layout)
    B, T, D = shape
    head = [f"# [B, T, D] = [{B}, {T}, {D}], {layout} contiguous: {B * D} lanes of {T} steps",
            f"# forward config:  {fwd}", f"# backward config: {bwd}"]
    if fwd.schedule == bwd.schedule == "chunked":
        head.append("# schedule: chunk-parallel (backends/triton/kernel/chunked.py): chunk_* forward, chunk_bwd_* backward")
        return "\n".join(head) + "\n\n" + chunked_launch.source(prog)
    kernels = {"tile": "scan_forward / scan_backward", "lanes": "scan_forward_lanes / scan_backward_lanes"}
    head.append(f"# schedule: {fwd.schedule} ({kernels.get(fwd.schedule, fwd.schedule)}); the module below holds "
                "every variant (rendering only those a config runs is not done yet)")
    return "\n".join(head) + "\n\n" + prog.source
