"""`scanlang show MODULE:NAME --shape B,T,H,K,V` for a matrix state: only the modules that the training route
(gradients) and the inference route (none) take at that shape, under header lines naming each route
(scanlang/show.py `show_matrix_state_at`). No kernel runs here: the routes' kernel names are checked against
what `delta_rule` launches with the launches recorded instead of run."""
import importlib

import pytest
import torch

import scanlang as sl
from scanlang.backends.delta import codegen
from scanlang.backends.delta import ops as delta_ops
from scanlang.backends.linear import decode, kernels
from scanlang.cli import main
from scanlang.delta_form import delta_form
from scanlang.recipes.linear.members import GLA, KACZMARZ, KDA
from scanlang.testing import jitted

MEMBERS = "scanlang.recipes.linear.members"
PRODUCT = '''
import scanlang as sl
product = sl.matrix_state("cli_shape_product", decay="per_head", correction="householder", steps=2,
                          inputs={"g": "token", "beta": "token"}, beta=lambda t: t.beta, log_decay=lambda t: t.g)
'''
TRAINING = ("# training (with gradients): forward delta_prep, delta_state_output; backward "
            "delta_state_fwd, delta_dU_local, delta_state_bwd, delta_bwd_dqk, delta_bwd_wy")


@pytest.fixture
def declared(tmp_path, monkeypatch):
    (tmp_path / "cli_shape_declared.py").write_text(PRODUCT)
    monkeypatch.syspath_prepend(str(tmp_path))
    return importlib.import_module("cli_shape_declared")


def header(source: str) -> list[str]:
    return [line for line in source.splitlines() if line.startswith("# ")]


def test_a_delta_structure_at_a_shape_names_its_routes_and_prints_its_module(shown):
    rule = delta_form(KACZMARZ, KACZMARZ.constants).rule
    text, source = shown(f"{MEMBERS}:KACZMARZ", "--shape", "2,12,4,64,48")
    assert text.startswith("matrix state kaczmarz:")
    lines = header(source)
    assert lines[0].startswith("# backend='triton' at [B, T, H, K, V] = [2, 12, 4, 64, 48] (float32 inputs): "
                               "kaczmarz on the delta-rule kernels at chunk 64")
    assert TRAINING in lines
    assert "# inference (no gradients): forward delta_recurrent (every sequence <= 16 rows: the token loop)" in lines
    assert codegen.kernel_source(rule, 64) in source
    _, longer = shown(f"{MEMBERS}:KACZMARZ", "--shape", "1,17,4,64,48", "--chunk", "32")
    assert "# inference (no gradients): forward delta_prep, delta_state_output (the chunk forward)" in header(longer)
    assert "at chunk 32" in header(longer)[0] and codegen.kernel_source(rule, 32) in longer


def test_householder_steps_at_a_shape_count_rows(declared, shown):
    """n = 2: T = 8 tokens are 16 rows (the token loop without gradients), T = 9 are 18 (the chunk forward)."""
    _, at8 = shown("cli_shape_declared:product", "--shape", "1,8,2,16,16")
    assert "8 tokens = 16 rows (T*n) a sequence" in header(at8)[0]
    assert any(line.startswith("# 2 Householder steps: a delta rule over the interleaved T*n rows")
               for line in header(at8))
    fwd, bwd = delta_ops.route_kernels(delta_form(declared.product, {}).rule, 64, 16, 16, 16, True)
    assert f"# training (with gradients): forward {', '.join(fwd)}; backward {', '.join(bwd)}" in header(at8)
    assert "# inference (no gradients): forward delta_recurrent (every sequence <= 16 rows: the token loop)" \
        in header(at8)
    _, at9 = shown("cli_shape_declared:product", "--shape", "1,9,2,16,16")
    assert "# inference (no gradients): forward delta_prep, delta_state_output (the chunk forward)" in header(at9)
    assert {"delta_prep", "delta_recurrent"} <= jitted(at9)


def test_a_plain_write_prints_the_decode_module_only_up_to_decode_max_tokens(shown):
    _, short = shown(f"{MEMBERS}:GLA", "--shape", "1,64,4,32,32")
    assert kernels.render(GLA) in short and decode.render(GLA) in short
    assert any(line.startswith("# inference (no gradients): T = 64 <= decode_max_tokens = 64: the decode kernel")
               for line in header(short))
    _, long = shown(f"{MEMBERS}:GLA", "--shape", "1,65,4,32,32")
    assert kernels.render(GLA) in long and "gla_decode" not in jitted(long)
    assert "# inference (no gradients): T = 65 > decode_max_tokens = 64: the chunk forward" in header(long)
    assert "# training (with gradients): the chunk kernels (backends/linear/kernels.py), forward and backward" \
        in header(long)
    with sl.tuning.override(decode_max_tokens=0):
        _, off = shown(f"{MEMBERS}:GLA", "--shape", "1,1,4,32,32")
    assert "gla_decode" not in jitted(off)


def test_kda_at_a_shape_names_its_chunk_kernels(shown):
    _, short = shown(f"{MEMBERS}:KDA", "--shape", "1,10,4,32,32")
    assert {"kda_decode", "kda_prep", "kda_fwd", "kda_bwd"} <= jitted(short) and decode.render(KDA) in short
    assert "# training (with gradients): the chunk kernels (backends/linear/kernels_delta.py), forward and backward" \
        in header(short)
    _, long = shown(f"{MEMBERS}:KDA", "--shape", "1,100,4,32,32")
    assert "kda_decode" not in jitted(long) and "kda_fwd" in jitted(long)


PER_KEY_PRODUCT = '''
import scanlang as sl
product = sl.matrix_state("cli_per_key_product", decay="per_key", correction="householder", steps=2,
                          inputs={"g": "token_key", "beta": "token"}, beta=lambda t: t.beta, log_decay=lambda t: t.g)
'''


def test_a_structure_without_chunk_kernels_says_so_at_a_shape(shown, tmp_path, monkeypatch):
    (tmp_path / "cli_per_key_product.py").write_text(PER_KEY_PRODUCT)
    monkeypatch.syspath_prepend(str(tmp_path))
    _, long = shown("cli_per_key_product:product", "--shape", "1,100,4,32,32")
    assert jitted(long) == set() and "# no generated module runs at this shape" in header(long)
    assert any(line.startswith("# training (with gradients): none: no chunk kernels") for line in header(long))


def test_head_dims_above_the_delta_kernels_limit_print_no_module(shown):
    _, source = shown(f"{MEMBERS}:KACZMARZ", "--shape", "1,100,4,300,64")
    assert jitted(source) == set()
    assert any("K = 300 is above 256" in line and "backend=None runs the PyTorch reference" in line
               for line in header(source))


@pytest.mark.parametrize("target,argv,flag", [
    (f"{MEMBERS}:KACZMARZ", ["--shape", "1,8,4"], "--shape"),
    (f"{MEMBERS}:GLA", ["--shape", "1,0,4,8,8"], "--shape"),
    (f"{MEMBERS}:GLA", ["--shape", "1,8,4,8,8,8"], "--shape"),
    (f"{MEMBERS}:KDA", ["--shape", "a,b,c,d,e"], "--shape"),
    (f"{MEMBERS}:GLA", ["--shape", "1,8,4,8,8", "--chunk", "32"], "--chunk"),
    (f"{MEMBERS}:GLA", ["--shape", "1,8,4,8,8", "--layout", "time"], "--layout"),
    (f"{MEMBERS}:KACZMARZ", ["--shape", "1,8,4,8,8", "--chunk", "48"], "--chunk"),
    ("scanlang.delta:GIVEN", ["--shape", "1,8,4,8,8"], "--shape")])
def test_bad_shapes_and_options_name_the_flag(capsys, target, argv, flag):
    assert main(["show", target, *argv]) == 2
    captured = capsys.readouterr()
    assert captured.err.startswith(f"scanlang show: {flag}") and "def " not in captured.out
    if flag == "--shape" and "GIVEN" not in target:
        assert "B,T,H,K,V" in captured.err


@pytest.mark.parametrize("T, grad, K", [(5, False, 8), (17, False, 8), (5, True, 8), (5, True, 64)])
def test_the_routes_kernels_are_the_ones_delta_rule_launches(monkeypatch, T, grad, K):
    """delta_rule with its launches recorded instead of run (the outputs are unwritten buffers); fp32 at K = 64
    takes the separate dU_local kernel (ops.SHARED_MEMORY_FITS), at K = 8 not."""
    launched = []
    monkeypatch.setattr(delta_ops, "_launch", lambda name, kernel, *a, **kw: launched.append(kernel.fn.__name__))
    rule = delta_form(KACZMARZ, KACZMARZ.constants).rule
    q, k, v = torch.randn(1, T, 2, K), torch.randn(1, T, 2, K), torch.randn(1, T, 2, 4)
    a, s = torch.zeros(1, T, 2), torch.rand(1, T, 2)
    if grad:
        q.requires_grad_()
    o, S = delta_ops.delta_rule(q, k, v, a, s, rule, scale=1.0, output_final_state=True, chunk_size=16)
    if grad:
        o.sum().backward()
    fwd, bwd = delta_ops.route_kernels(rule, 16, K, 4, T, grad)
    assert launched == fwd + bwd and ("delta_dU_local" in bwd) == (K == 64)
