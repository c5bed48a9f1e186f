"""The matrix-state members' host path as `python -m scanlang.tools.host_profile --workload linear` runs it
(interpreter launches as no-ops): which kernels one call launches, and the tool's report."""
import pytest


@pytest.mark.parametrize("member,fwd,bwd", [
    ("linear_attention", ["linear_attention_fwd"], ["linear_attention_fwd", "linear_attention_bwd_dh", "linear_attention_bwd"]),
    ("simple_gla", ["simple_gla_decay_cumsum", "simple_gla_fwd"], ["simple_gla_fwd", "simple_gla_bwd_dh", "simple_gla_bwd"]),
    ("gla", ["gla_decay_cumsum", "gla_fwd", "gla_fwd_o"], ["gla_fwd", "gla_bwd_dh", "gla_bwd"]),
])
def test_launches_per_call(monkeypatch, member, fwd, bwd):
    """A chunked forward launches the forward's kernels once each; a forward + backward adds the backward's,
    which recomputes the chunk states (the state pass again) rather than keeping them."""
    from triton.runtime.interpreter import InterpretedFunction
    from scanlang.tools import host_profile
    launched = []
    monkeypatch.setattr(InterpretedFunction, "run", lambda self, *a, **k: launched.append(self.fn.__name__))
    calls = host_profile.linear_calls(member)
    counts = {}
    for name, call in calls.items():
        launched.clear()
        call()
        counts[name] = list(launched)
    assert counts[f"{member} chunked fwd"] == fwd
    assert counts[f"{member} chunked fwd+bwd"] == fwd + bwd


def test_host_profile_reports_both_linear_calls(capsys):
    """A positive time for each call, the interpreter as it was afterwards; an unknown member is refused by name."""
    from triton.runtime.interpreter import InterpretedFunction
    from scanlang.tools import host_profile
    run = InterpretedFunction.run
    assert host_profile.main(["--workload", "linear", "--calls", "2", "--repeat", "1"]) == 0
    assert InterpretedFunction.run is run
    out = capsys.readouterr().out
    lines = [ln for ln in out.splitlines() if ln.strip().startswith("simple_gla chunked")]
    assert len(lines) == 2 and all(float(ln.split()[-2]) > 0 for ln in lines), out
    with pytest.raises(ValueError, match="--member"):
        host_profile.linear_calls("nope")
