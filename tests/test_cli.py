"""The scanlang command: verify exits 0/1/2, show prints the traced expressions; both also take matrix
states and delta rules (show: the generated kernels that run for them).

One test runs the real command (`python -m scanlang` in a subprocess: the entry point, the exit
status through sys.exit); the others call `scanlang.cli.main` in this process, which returns the
same exit status and prints the same text (a subprocess per case only re-imports torch)."""
import importlib
import subprocess
import sys
import textwrap

import pytest

from scanlang.backends.delta import codegen
from scanlang.backends.linear import decode, kernels, kernels_delta
from scanlang.cli import main
from scanlang.delta_form import delta_form
from scanlang.linear import matrix_state
from scanlang.show import show_matrix_state
from scanlang.testing import jitted


def run(*args, cwd=None):
    return subprocess.run([sys.executable, "-m", "scanlang", *args], capture_output=True, text=True,
                          timeout=300, cwd=cwd)


def test_verify_library_monoid_exits_zero_with_the_proof():
    out = run("verify", "scanlang.library:Affine")
    assert out.returncode == 0, out.stderr
    assert "associative" in out.stdout


def test_verify_broken_monoid_from_a_file_exits_one_with_a_counterexample(tmp_path, capsys):
    path = tmp_path / "cli_test_broken.py"
    path.write_text(textwrap.dedent("""
        import scanlang as sl

        @sl.monoid(fields=("m",), identity=(0,))
        def average(x, y):
            return ((x.m + y.m) / 2,)
    """))
    code = main(["verify", f"{path}:average"])
    out = capsys.readouterr()
    assert code == 1, out.out + out.err
    assert "counterexample" in out.out


def test_verify_bad_target_exits_two(capsys):
    for target, word in (("scanlang.library", "MODULE:NAME"), ("scanlang.library:NoSuchThing", "NoSuchThing"),
                         ("no_such_module_xyz:Affine", "no_such_module_xyz")):
        assert main(["verify", target]) == 2, target
        err = capsys.readouterr().err
        assert err.startswith("scanlang verify: ") and word in err, (target, err)


def test_show_prints_the_traced_expressions(capsys):
    assert main(["show", "scanlang.library:Affine"]) == 0
    assert "b = x_b*y_a + y_b" in capsys.readouterr().out


# ---- matrix states and delta rules -----------------------------------------------------------------

MEMBERS = "scanlang.recipes.linear.members"
DECLARATIONS = '''
import scanlang as sl
from scanlang.delta import DeltaRule

retention = sl.matrix_state("cli_retention", decay="per_head", inputs={"a": "token"},
                            log_decay=lambda t: sl.logsigmoid(t.a))
soft_delta = sl.matrix_state("cli_soft_delta", decay="per_head", correction="delta",
                             inputs={"g": "token", "b": "token"}, beta=lambda t: sl.sigmoid(t.b),
                             log_decay=lambda t: t.g)
product = sl.matrix_state("cli_product", decay="none", correction="householder", steps=2,
                          inputs={"beta": "token"}, beta=lambda t: t.beta)
halved = DeltaRule("cli_halved", step=lambda t: t.s / 2, decay=lambda t: t.a * t.rate, head_params=("rate",))
'''


@pytest.fixture
def declared(tmp_path, monkeypatch):
    """A user module of declarations on sys.path: MODULE:NAME is `cli_declared:NAME`."""
    (tmp_path / "cli_declared.py").write_text(DECLARATIONS)
    monkeypatch.syspath_prepend(str(tmp_path))
    return importlib.import_module("cli_declared")


DELTA_KERNELS = {"delta_prep", "delta_state_output", "delta_wu", "delta_state_fwd", "delta_dU_local",
                 "delta_state_bwd", "delta_bwd_dqk", "delta_bwd_wy", "delta_recurrent"}


def test_show_a_plain_write_member_prints_its_chunk_and_decode_kernels(shown):
    from scanlang.recipes.linear.members import GLA
    text, source = shown(f"{MEMBERS}:GLA")
    assert text.startswith("matrix state gla: decay per_key, correction plain") and "input g: token_key" in text
    assert kernels.render(GLA) in source and decode.render(GLA) in source
    assert {"gla_decay_cumsum", "gla_fwd", "gla_bwd_dh", "gla_bwd", "gla_decode"} <= jitted(source)
    assert "# chunk kernels (backends/linear/kernels.py): with gradients" in source
    assert "# decode: no gradients, every sequence <= decode_max_tokens = 64 tokens" in source
    assert not DELTA_KERNELS & jitted(source)


def test_show_kda_prints_its_per_key_delta_chunk_kernels_and_decode_kernel(shown):
    from scanlang.recipes.linear.members import KDA
    text, source = shown(f"{MEMBERS}:KDA")
    assert "beta(t) = beta" in text and "log_decay(t) = g" in text
    assert kernels_delta.render(KDA) in source and decode.render(KDA) in source
    assert {"kda_prep", "kda_fwd", "kda_bwd_dh", "kda_bwd", "kda_decode"} <= jitted(source)
    assert not DELTA_KERNELS & jitted(source)
    assert "# chunk kernels (backends/linear/kernels_delta.py): with gradients" in source


def test_show_per_key_householder_steps_print_only_their_decode_kernel_and_say_why():
    decl = matrix_state("show_per_key_product", decay="per_key", correction="householder", steps=2,
                           inputs={"g": "token_key", "beta": "token"}, beta=lambda t: t.beta, log_decay=lambda t: t.g)
    source = show_matrix_state(decl)
    assert "no chunk kernels for decay 'per_key' with correction 'householder'" in source
    assert jitted(source.partition("\n\n")[2]) == {"show_per_key_product_decode"}


def test_show_the_kaczmarz_member_prints_the_delta_rule_kernels_it_is_routed_to(shown):
    from scanlang.recipes.linear.members import KACZMARZ
    text, source = shown(f"{MEMBERS}:KACZMARZ")
    assert "beta(t) = eta/(eps + n2)" in text and "constant eps = 1e-06" in text
    rule = delta_form(KACZMARZ, KACZMARZ.constants).rule
    assert rule.name == "kaczmarz" and codegen.kernel_source(rule, 64) in source
    assert jitted(source) >= DELTA_KERNELS and "kaczmarz_decode" not in jitted(source)
    assert "# delta rule kaczmarz (beta = s/(eps + n2), g = a); s = eta, a = g" in source
    assert "# delta_recurrent: no gradients, every sequence <= 16 tokens" in source
    _, at16 = shown(f"{MEMBERS}:KACZMARZ", "--chunk", "16")
    assert codegen.kernel_source(rule, 16) in at16 and at16 != source


def test_show_user_declared_matrix_states(declared, shown):
    text, source = shown("cli_declared:retention")
    assert "log_decay(t) = LogSigmoid(a)\n    d/da = Sigmoid(-a)" in text
    assert kernels.render(declared.retention) in source and decode.render(declared.retention) in source
    assert {"cli_retention_decay_cumsum", "cli_retention_fwd", "cli_retention_decode"} <= jitted(source)
    # a delta structure whose beta is no shipped rule's: a rule of its own, named after the declaration
    _, source = shown("cli_declared:soft_delta", "--chunk", "32")
    rule = delta_form(declared.soft_delta, {}).rule
    assert rule.name == "cli_soft_delta" and codegen.kernel_source(rule, 32) in source
    assert DELTA_KERNELS <= jitted(source)
    text, source = shown("cli_declared:product")
    assert "correction householder, 2 steps" in text and "(T*n rows, with k and v)" in text
    assert "2 Householder steps: a delta rule over the interleaved T*n rows" in source
    assert DELTA_KERNELS <= jitted(source)   # the delta-rule kernels, forward and backward


def test_show_and_verify_a_delta_rule(declared, capsys, shown):
    text, source = shown("cli_declared:halved", "--chunk", "32")
    assert text.startswith("delta rule cli_halved") and "per-head parameters rate" in text
    assert "beta = step(t) = s/2" in text and "d/drate = a" in text
    assert codegen.kernel_source(declared.halved, 32) in source and DELTA_KERNELS <= jitted(source)
    _, default = shown("scanlang.delta:KACZMARZ")
    from scanlang.delta import KACZMARZ
    assert codegen.kernel_source(KACZMARZ, 64) in default
    assert main(["verify", "cli_declared:halved"]) == 0
    out = capsys.readouterr().out
    assert "delta-rule monoid" in out and "associative" in out and "g = decay(t) = a*rate" in out


def test_verify_matrix_states_prints_their_proofs(declared, capsys):
    from scanlang.recipes.linear import members
    for target, decl in ((f"{MEMBERS}:GLA", members.GLA), (f"{MEMBERS}:KDA", members.KDA),
                         (f"{MEMBERS}:KACZMARZ", members.KACZMARZ), ("cli_declared:product", declared.product)):
        assert main(["verify", target]) == 0, target
        out = capsys.readouterr().out
        assert out.startswith(decl.proof + "\n") and "associative" in out and f"matrix state {decl.name}:" in out


@pytest.mark.parametrize("target,argv,flag", [
    (f"{MEMBERS}:GLA", ["--shape", "1,8,4"], "--shape"), (f"{MEMBERS}:GLA", ["--layout", "channels"], "--layout"),
    (f"{MEMBERS}:KDA", ["--all"], "--all"), ("scanlang.delta:GIVEN", ["--layout", "time"], "--layout"),
    (f"{MEMBERS}:GLA", ["--chunk", "32"], "--chunk"), (f"{MEMBERS}:KACZMARZ", ["--chunk", "48"], "--chunk"),
    ("scanlang.delta:GIVEN", ["--chunk", "0"], "--chunk"), ("scanlang.library:Affine", ["--chunk", "64"], "--chunk")])
def test_show_refuses_options_of_other_kinds(capsys, target, argv, flag):
    assert main(["show", target, *argv]) == 2
    captured = capsys.readouterr()
    assert captured.err.startswith(f"scanlang show: {flag}") and "def " not in captured.out


def test_a_name_of_no_accepted_kind_lists_the_kinds(capsys):
    assert main(["show", f"{MEMBERS}:op"]) == 2
    err = capsys.readouterr().err
    assert "a monoid (@sl.monoid), a matrix state (sl.matrix_state) or a delta rule" in err and "function" in err
