"""Tracing combine bodies into sympy, and printing them back as source."""
import math

import pytest
import sympy
import torch

import scanlang as sl
from scanlang import expr as E


def declare(body, fields=("a", "b"), identity=(1, 0), **kw):
    return sl.monoid(fields=fields, identity=identity, **kw)(body)


def test_trace_gives_one_expression_per_field():
    m = sl.Affine
    xa, xb = m.x_symbols
    ya, yb = m.y_symbols
    assert m.exprs == (xa * ya, ya * xb + yb)


def test_constants_are_exact_and_inf_is_oo():
    m = declare(lambda x, y: (sl.maximum(x.a, y.a) + 0.1, x.b * 0.5), identity=(float("-inf"), 1))
    assert m.exprs[1] == m.x_symbols[1] * sympy.Rational(1, 2)
    assert sympy.Rational(0.1) in m.exprs[0].args          # the exact binary value of 0.1
    assert m.identity_exprs[0] == -sympy.oo


@pytest.mark.parametrize("body, op", [
    (lambda x, y: (x.a ** 2, y.b), "**"),
    (lambda x, y: (x.a // y.a, y.b), "//"),
    (lambda x, y: (x.a % y.a, y.b), "%"),
    (lambda x, y: (x.a if x.a > 0 else y.a, y.b), ">"),
    (lambda x, y: (torch.exp(x.a), y.b), "torch.exp"),
    (lambda x, y: (math.exp(x.a), y.b), "float()"),
    (lambda x, y: (max(x.a, y.a), y.b), ">"),
    (lambda x, y: (x.a and y.a, y.b), "bool()"),
    (lambda x, y: (x.a @ y.a, y.b), "@"),
])
def test_unsupported_operations_are_type_errors_naming_the_operation(body, op):
    with pytest.raises(TypeError) as info:
        declare(body)
    assert op in str(info.value) and "supported" in str(info.value)


def test_wrong_number_of_results_and_bad_declarations():
    with pytest.raises(ValueError, match="2 values"):
        declare(lambda x, y: (x.a,))
    with pytest.raises(ValueError, match="identity"):
        declare(lambda x, y: (x.a, y.b), identity=(1,))
    with pytest.raises(TypeError, match="fields"):
        declare(lambda x, y: (x.a, y.b), fields="ab")
    with pytest.raises(ValueError, match="fields"):
        declare(lambda x, y: (x.a, y.b), fields=("a", "a"))
    with pytest.raises(ValueError, match="fields"):
        declare(lambda x, y: (x.a, y.b), fields=("a", "not valid"))
    with pytest.raises(AttributeError, match="no field 'c'"):
        declare(lambda x, y: (x.c, y.b))


def test_traced_combine_equals_direct_body_on_tensors():
    m = declare(lambda x, y: (sl.maximum(x.a, y.a), x.b * sl.exp(x.a - sl.maximum(x.a, y.a))
                              + y.b * sl.exp(y.a - sl.maximum(x.a, y.a)) - sl.abs(y.b) / sl.sqrt(1 + y.a * y.a)
                              + sl.log(1 + sl.minimum(x.b * x.b, 2.0))), identity=(float("-inf"), 0))
    x = tuple(torch.randn(50, dtype=torch.float64) for _ in range(2))
    y = tuple(torch.randn(50, dtype=torch.float64) for _ in range(2))
    for traced, direct in zip(m.combine(x, y), m.combine_direct(x, y)):
        assert torch.allclose(traced, direct, rtol=1e-14, atol=1e-14)


def test_rendered_source_is_deterministic_and_parses():
    import ast
    m = sl.Mobius
    names = {s: f"x{i}" for i, s in enumerate(m.x_symbols)} | {s: f"y{i}" for i, s in enumerate(m.y_symbols)}
    first = E.render(m.exprs, names, E.TRITON)
    second = E.render(m.exprs, names, E.TRITON)
    assert first == second
    lines, outs = first
    ast.parse("\n".join(lines + [f"r{i} = {o}" for i, o in enumerate(outs)]))


def test_dsl_functions_work_on_numbers_and_tensors():
    assert sl.exp(0.0) == 1.0 and sl.maximum(1.0, 2.0) == 2.0 and sl.abs(-3.0) == 3.0
    t = torch.tensor([1.0, -2.0])
    assert torch.equal(sl.minimum(t, 0.0), torch.tensor([0.0, -2.0]))
