"""The delta-rule declaration: the (P, R) monoid proof, the token element, and the traced hooks."""
from __future__ import annotations

import math

import pytest
import sympy
import torch

import scanlang as sl
from scanlang import expr as E
from scanlang.delta import GDN_SIGMOID, GIVEN, KACZMARZ, DeltaRule, combine, token_element, verify_delta_monoid
from scanlang.errors import UnsupportedOperationError
from scanlang.recipes.kaczmarz.naive import delta_rule_naive


@pytest.mark.parametrize("K, V", [(2, 2), (3, 2)])
def test_monoid_proof_symbolic(K, V):
    report = verify_delta_monoid(K, V)
    assert "associative" in report and "symbolic proof over the reals" in report


def test_token_elements_composed_reproduce_the_token_loop():
    gen = torch.Generator().manual_seed(0)
    T, K, V = 6, 3, 2
    k = torch.randn(T, K, generator=gen, dtype=torch.float64)
    v = torch.randn(T, V, generator=gen, dtype=torch.float64)
    q = torch.randn(T, K, generator=gen, dtype=torch.float64)
    g = -torch.rand(T, generator=gen, dtype=torch.float64)
    beta = torch.rand(T, generator=gen, dtype=torch.float64)
    S0 = torch.randn(K, V, generator=gen, dtype=torch.float64)
    elems = [token_element(k[t], v[t], g[t], beta[t]) for t in range(T)]
    left = elems[0]
    for e in elems[1:]:
        left = combine(left, e)                      # ((e0 e1) e2) ...
    right = elems[-1]
    for e in reversed(elems[:-1]):
        right = combine(e, right)                    # e0 (e1 (e2 ...))
    for a, b in zip(left, right):
        assert torch.allclose(a, b, atol=1e-12)
    _, S = delta_rule_naive(q[None, :, None], k[None, :, None], v[None, :, None], g[None, :, None],
                            beta[None, :, None], initial_state=S0[None, None], output_final_state=True)
    P, R = left
    assert torch.allclose(P @ S0 + R, S[0, 0], atol=1e-12)


def test_a_broken_combine_is_caught():
    x, y, z = [(sympy.Matrix(2, 2, lambda i, j: E.symbol(f"P{n}{i}{j}")),
                sympy.Matrix(2, 2, lambda i, j: E.symbol(f"R{n}{i}{j}"))) for n in "xyz"]
    wrong = lambda a, b: (b[0] * a[0], a[0] * b[1] + a[1])  # noqa: E731 - applies the earlier P to the later R
    l, r = wrong(wrong(x, y), z), wrong(x, wrong(y, z))
    assert any((a - b).applyfunc(sympy.expand) != sympy.zeros(2, 2) for a, b in zip(l, r))


@pytest.mark.parametrize("rule", [KACZMARZ, GDN_SIGMOID, GIVEN])
def test_hook_derivatives_match_finite_differences(rule):
    names = {E.symbol(n): n for n in ("s", "n2", "eps")}
    f = sympy.lambdify([E.symbol("s"), E.symbol("n2"), E.symbol("eps")], rule.step.expr)
    for var, expr in rule.step.grads.items():
        df = sympy.lambdify([E.symbol("s"), E.symbol("n2"), E.symbol("eps")], expr)
        for s, n2 in ((0.3, 0.7), (-1.2, 2.5), (0.9, 1e-3)):
            h = 1e-6
            args = {"s": s, "n2": n2, "eps": 1e-6}
            up, dn = dict(args), dict(args)
            up[var] += h
            dn[var] -= h
            fd = (f(**up) - f(**dn)) / (2 * h)
            assert math.isclose(df(**args), fd, rel_tol=1e-5, abs_tol=1e-6), (rule.name, var, s, n2)
    lines, outs = E.render([rule.step.expr, *rule.step.grads.values()], names, E.TRITON)
    for src in lines + outs:                         # every printed line is valid Python
        compile(src, "<hook>", "exec")


def test_kaczmarz_step_and_its_gradient_into_the_key():
    assert KACZMARZ.uses_key_norm and not GIVEN.uses_key_norm and not GDN_SIGMOID.uses_key_norm
    s, n2, eps = E.symbol("s"), E.symbol("n2"), E.symbol("eps")
    assert sympy.simplify(KACZMARZ.step.expr - s / (n2 + eps)) == 0
    # d beta/d n2 = -beta / (n2 + eps): the spec's dk += dbeta * (-2 beta / (||k||^2 + eps)) k
    assert sympy.simplify(KACZMARZ.step.grads["n2"] + KACZMARZ.step.expr / (n2 + eps)) == 0
    assert sympy.simplify(KACZMARZ.step.grads["s"] - 1 / (n2 + eps)) == 0


def test_a_new_family_member_in_one_line_and_bad_declarations():
    mamba_like = DeltaRule("scaled", step=lambda t: 2 * t.s, decay=lambda t: -sl.exp(t.a))
    assert str(mamba_like.decay.expr) == "-exp(a)" and str(mamba_like.decay.grads["a"]) == "-exp(a)"
    assert mamba_like.key != KACZMARZ.key
    with pytest.raises(ValueError, match="identifier"):
        DeltaRule("not a name", step=lambda t: t.s)
    with pytest.raises(AttributeError):
        DeltaRule("bad", step=lambda t: t.beta)
    with pytest.raises(UnsupportedOperationError):
        DeltaRule("bad", step=lambda t: t.s ** 2)


def test_the_head_parameter_names_refused_are_the_ones_the_generated_hooks_use():
    """delta.HOOK_NAMES, derived: every name the rendered decay hooks read, bind or take, but the head
    parameters themselves (loaded into locals of their own names) and the printer's _-temporaries."""
    import ast

    from scanlang.backends.delta.codegen import hook_kernels
    from scanlang.backends.triton.kernel.printer import render_kernel
    from scanlang.delta import HOOK_NAMES
    rule = DeltaRule("names_rule", step=lambda t: t.s / (t.n2 + t.eps),
                     decay=lambda t: -sl.exp(t.A) * sl.softplus(t.a + t.bias) + sl.abs(t.a), head_params=("A", "bias"))
    used = set()
    for k in hook_kernels(rule):
        if k.name in ("decay_hook", "store_decay_grads"):
            fn = ast.parse(render_kernel(k)).body[0]
            used |= {n.id for stmt in fn.body for n in ast.walk(stmt) if isinstance(n, ast.Name)}
            used |= {a.arg for a in fn.args.args}
    assert {n for n in used if not n.startswith("_")} - set(rule.head_params) - {"a"} == set(HOOK_NAMES)


@pytest.mark.parametrize("name", ["h", "H", "hp_ptr", "mask", "tl"])
def test_a_head_parameter_that_would_shadow_a_generated_name_is_refused(name):
    with pytest.raises(ValueError, match=rf"head_params: '{name}' would shadow a name of the generated decay hooks"):
        DeltaRule("shadowing", step=lambda t: t.s, decay=lambda t: t.a * getattr(t, name), head_params=(name,))

