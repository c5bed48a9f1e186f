"""Docs where users look: help() of every public object states its law and shows a runnable example.

Public objects: every name in scanlang.__all__ and the recipes' __all__. pytest's --doctest-modules
runs the examples under scanlang/; the recipes live outside it (recipes/), so their examples run here.
"""
import doctest
import inspect
import pydoc
import re
import sys

import pytest

import scanlang as sl
import scanlang.recipes.kaczmarz as kaczmarz
import scanlang.recipes.kalman as kalman
import scanlang.recipes.linear as linear

PUBLIC = ([(f"scanlang.{n}", getattr(sl, n)) for n in sl.__all__]
          + [(f"{m.__name__}.{n}", getattr(m, n)) for m in (kalman, kaczmarz) for n in m.__all__]
          + [(f"{linear.__name__}.{n}", getattr(linear, n)) for n in linear.__all__ if callable(getattr(linear, n))])
LAW = re.compile(r"\bLaw\b[^\n]*:")


def doc_of(obj) -> str:
    """The text help(obj) leads with: the object's own docstring (a declared monoid's is per object)."""
    return inspect.getdoc(obj) or ""


@pytest.mark.parametrize("name, obj", PUBLIC, ids=[n for n, _ in PUBLIC])
def test_public_docstring_states_a_law_and_an_example(name, obj):
    doc = doc_of(obj)
    assert LAW.search(doc), f"{name}: no 'Law:' line in its docstring:\n{doc}"
    assert ">>>" in doc, f"{name}: no example (>>>) in its docstring:\n{doc}"


@pytest.mark.parametrize("monoid", sl.LIBRARY + (kalman.KalmanJoint,), ids=lambda m: m.name)
def test_help_of_a_library_monoid_shows_its_own_law(monoid):
    """pydoc (what help() prints) shows this monoid's combine docstring and traced expressions,
    not the generic Monoid class text."""
    text = pydoc.render_doc(monoid)
    own = inspect.getdoc(monoid.combine_fn)
    assert own.splitlines()[0] in text
    assert ">>>" in text
    for field, expr in zip(monoid.fields, monoid.exprs):
        assert f"{field} = {expr}" in text
    assert "A declared monoid: fields" not in text   # the class docstring is not what it shows


def test_help_of_an_undocumented_user_monoid_shows_its_traced_law():
    @sl.monoid(fields=("s",), identity=(0,))
    def plus(x, y):
        return x.s + y.s
    text = pydoc.render_doc(plus)
    assert "Law: combine(combine(x, y), z) == combine(x, combine(y, z))" in text
    assert "s = x_s + y_s" in text


RECIPES = [(n, o) for n, o in PUBLIC if n.startswith("scanlang.recipes.")]


@pytest.mark.parametrize("name, obj", RECIPES, ids=[n for n, _ in RECIPES])
def test_recipe_examples_run(name, obj):
    """The recipes' doctests, run with their module's globals as --doctest-modules would."""
    source = obj.combine_fn if isinstance(obj, sl.Monoid) else obj
    globs = dict(vars(sys.modules[source.__module__]))
    test = doctest.DocTestParser().get_doctest(inspect.getdoc(source), globs, name, None, 0)
    runner = doctest.DocTestRunner(optionflags=doctest.ELLIPSIS)
    runner.run(test, out=lambda text: print(text, end=""))
    assert test.examples and runner.failures == 0, f"{name}: {runner.failures} of {runner.tries} examples failed"
