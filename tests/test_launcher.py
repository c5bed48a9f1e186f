"""backends/triton/launcher.py: a compiled kernel is relaunched directly only for the same plan, config
and pointer alignment, with every parameter in signature order. Triton's kernels are faked here (the
interpreter has no compiled kernels); tests/test_triton_gpu.py runs the real path on the GPU."""
import inspect

import torch

from scanlang.backends.triton import launcher


class _Param:
    def __init__(self, name, default=inspect.Parameter.empty):
        self.name, self.default = name, default

    @property
    def has_default(self):
        return self.default is not inspect.Parameter.empty


class _Compiled:
    function, packed_metadata = "fn", "meta"

    def __init__(self, log):
        self.log = log

    def launch_metadata(self, grid, stream, *args):
        return None

    def run(self, g0, g1, g2, stream, function, packed, launch_metadata, enter, exit_, *values):
        self.log.append(("direct", (g0, g1, g2), values))


class _Kernel:
    """Parameters x_ptr, n, BLOCK (constexpr from meta), FLAG (constexpr with a default)."""

    params = [_Param("x_ptr"), _Param("n"), _Param("BLOCK"), _Param("FLAG", default=True)]

    def __init__(self):
        self.log = []

    def __getitem__(self, grid):
        def run(*args, **meta):
            self.log.append(("jit", grid, args, meta))
            return _Compiled(self.log)
        return run


def test_second_launch_of_a_plan_goes_direct_with_every_parameter_in_order():
    kernel, plan = _Kernel(), object.__new__(type("Plan", (), {}))
    x = torch.zeros(64)
    launcher.launch(plan, "cfg", kernel, (3, 2), [x, 64], {"BLOCK": 32, "num_warps": 4})
    launcher.launch(plan, "cfg", kernel, (3, 2), [x, 64], {"BLOCK": 32, "num_warps": 4})
    assert [entry[0] for entry in kernel.log] == ["jit", "direct"]
    _, grid, values = kernel.log[1]
    assert grid == (3, 2, 1)
    assert values[0] is x and values[1:] == (64, 32, True)


def test_a_new_config_or_a_misaligned_pointer_goes_through_the_jit_again():
    kernel, plan = _Kernel(), object.__new__(type("Plan", (), {}))
    base = torch.zeros(65)
    aligned, shifted = base[:64], base[1:]   # 4-byte offset: data_ptr % 16 != 0
    assert aligned.data_ptr() % 16 == 0 and shifted.data_ptr() % 16 != 0
    launcher.launch(plan, "a", kernel, (1,), [aligned, 64], {"BLOCK": 32})
    launcher.launch(plan, "b", kernel, (1,), [aligned, 64], {"BLOCK": 32})
    launcher.launch(plan, "a", kernel, (1,), [shifted, 64], {"BLOCK": 32})
    launcher.launch(plan, "a", kernel, (1,), [aligned, 64], {"BLOCK": 32})
    assert [entry[0] for entry in kernel.log] == ["jit", "jit", "jit", "direct"]


def test_a_kernel_without_a_compiled_handle_keeps_the_slow_path():
    class Interpreted(_Kernel):
        def __getitem__(self, grid):
            def run(*args, **meta):
                self.log.append(("jit", grid, args, meta))
            return run
    kernel, plan = Interpreted(), object.__new__(type("Plan", (), {}))
    for _ in range(2):
        launcher.launch(plan, "cfg", kernel, (1,), [torch.zeros(4), 4], {"BLOCK": 4})
    assert [entry[0] for entry in kernel.log] == ["jit", "jit"]


def test_a_misaligned_first_launch_is_not_kept():
    kernel, plan = _Kernel(), object.__new__(type("Plan", (), {}))
    base = torch.zeros(65)
    for x in (base[1:], base[1:], base[:64], base[:64]):
        launcher.launch(plan, "cfg", kernel, (1,), [x, 64], {"BLOCK": 32})
    assert [entry[0] for entry in kernel.log] == ["jit", "jit", "jit", "direct"]


def test_direct_launches_pass_launch_hooks_only_when_some_are_set(monkeypatch):
    """Triton's empty hook chains (never None since Triton 3.5) go as None: no launch metadata built;
    a registered hook is passed with its metadata, as `kernel[grid]` would."""
    from triton import knobs
    made = []

    class Compiled(_Compiled):
        def launch_metadata(self, grid, stream, *args):
            made.append(grid)
            return "metadata"

        def run(self, g0, g1, g2, stream, function, packed, launch_metadata, enter, exit_, *values):
            self.log.append(("direct", launch_metadata, enter, exit_))

    class Kernel(_Kernel):
        def __getitem__(self, grid):
            return lambda *args, **meta: Compiled(self.log)
    kernel, plan = Kernel(), object.__new__(type("Plan", (), {}))
    x = torch.zeros(64)
    for _ in range(2):
        launcher.launch(plan, "cfg", kernel, (1,), [x, 64], {"BLOCK": 32})
    assert kernel.log == [("direct", None, None, None)] and not made
    hook = knobs.runtime.launch_enter_hook
    if hasattr(hook, "calls"):   # a hook chain (Triton >= 3.5): register one hook on it
        monkeypatch.setattr(hook, "calls", [lambda metadata: None])
    else:
        monkeypatch.setattr(knobs.runtime, "launch_enter_hook", lambda metadata: None)
    launcher.launch(plan, "cfg", kernel, (1,), [x, 64], {"BLOCK": 32})
    assert kernel.log[-1][:2] == ("direct", "metadata") and kernel.log[-1][2] is not None and made == [(1, 1, 1)]


def test_host_time_tool_reports_both_calls_and_restores_the_interpreter(capsys):
    from triton.runtime.interpreter import InterpretedFunction

    from scanlang.tools import host_profile
    run = InterpretedFunction.run
    host_profile.main(["--calls", "2", "--repeat", "2"])
    assert InterpretedFunction.run is run and not hasattr(InterpretedFunction, "params")
    lines = [ln for ln in capsys.readouterr().out.splitlines() if "affine mixer" in ln]
    assert len(lines) == 2 and all(float(ln.split()[-2]) > 0 for ln in lines)
