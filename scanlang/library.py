"""A small library of declared monoids. Each one is proved in tests/test_library.py.

Every combine takes x, the EARLIER element, and y, the LATER one; an inclusive scan over
e_1, ..., e_T returns P_t = e_1 (+) e_2 (+) ... (+) e_t. Each docstring states the law the combine
satisfies and the recurrence the scan computes.
"""
from __future__ import annotations

from .expr import exp, log, maximum, minimum
from .monoid import monoid

INF = float("inf")
# A finite floor for the stabilising maxima of the log-space monoids: with -inf operands (their own
# identity, or a masked token) exp(x - max) would be exp(-inf - (-inf)) = NaN; against a finite floor
# it is exp(-inf) = 0, the right value. Far below any score that matters and finite in float32.
LOG_FLOOR = -1e38


@monoid(fields=("a", "b"), identity=(1, 0), name="Affine")
def Affine(x, y):
    """Affine maps h -> a*h + b under composition, y after x: (y.a*x.a, y.a*x.b + y.b).

    Law: composition of maps is associative; identity (1, 0) is h -> h.
    Recurrence: the scan's b is h_t = a_t h_{t-1} + b_t from h_0 = 0 (a is the running product).

    >>> import torch, scanlang as sl
    >>> out = sl.scan(sl.Affine, (torch.tensor([0.5, 0.5, 0.5]), torch.tensor([1.0, 1.0, 1.0])), dim=0)
    >>> out.b.tolist()                    # h_t = 0.5 h_{t-1} + 1
    [1.0, 1.5, 1.75]
    """
    return y.a * x.a, y.a * x.b + y.b


@monoid(fields=("a", "b", "c", "d"), identity=(1, 0, 0, 1), scale=lambda m: m.a + m.d, name="Mobius")
def Mobius(x, y):
    """2x2 matrices [[a, b], [c, d]] acting as s -> (a s + b)/(c s + d); combine = Y @ X, trace-normalised.

    Law: matrix product is associative and homogeneous of degree 1 in each factor, and the trace is
    homogeneous of degree 1, so dividing by it keeps the law up to scale; identity: the unit matrix.
    Recurrence: the Riccati / continued-fraction map s_t = (a_t s_{t-1} + b_t) / (c_t s_{t-1} + d_t).

    >>> import torch, scanlang as sl
    >>> one, zero = torch.ones(3), torch.zeros(3)
    >>> out = sl.scan(sl.Mobius, (one, one, one, zero), dim=0)   # s -> (s + 1) / s: Fibonacci ratios
    >>> [round(v, 4) for v in (out.a / out.c).tolist()]
    [1.0, 2.0, 1.5]
    """
    return (y.a * x.a + y.b * x.c, y.a * x.b + y.b * x.d,
            y.c * x.a + y.d * x.c, y.c * x.b + y.d * x.d)


@monoid(fields=("a", "b", "c", "d"), identity=(1, 0, 0, 1), name="Matrix2")
def Matrix2(x, y):
    """2x2 matrices [[a, b], [c, d]] under the product Y @ X (the later one on the left), no rescaling.

    Law: the matrix product is associative; identity: the unit matrix.
    Recurrence: the linear 2-state system v_t = M_t v_{t-1}; the scan holds M_t ... M_1.

    >>> import torch, scanlang as sl
    >>> one, zero = torch.ones(3), torch.zeros(3)
    >>> sl.scan(sl.Matrix2, (one, one, zero, one), dim=0).b.tolist()   # shears [[1, 1], [0, 1]]^t
    [1.0, 2.0, 3.0]
    """
    return (y.a * x.a + y.b * x.c, y.a * x.b + y.b * x.d,
            y.c * x.a + y.d * x.c, y.c * x.b + y.d * x.d)


@monoid(fields=("a", "b"), identity=(0, -INF), name="MaxPlus")
def MaxPlus(x, y):
    """Tropical (max, +) affine maps h -> max(a + h, b), y after x: (x.a + y.a, max(y.a + x.b, y.b)).

    Law: + distributes over max, so these maps compose associatively; identity (0, -inf) is h -> h.
    Recurrence: h_t = max(a_t + h_{t-1}, b_t) (running maxima with additive decay, Viterbi-like).

    >>> import torch, scanlang as sl
    >>> sl.scan(sl.MaxPlus, (torch.tensor([-1.0, -1.0, -1.0]), torch.tensor([3.0, 0.0, 5.0])), dim=0).b.tolist()
    [3.0, 2.0, 5.0]
    """
    return x.a + y.a, maximum(y.a + x.b, y.b)


@monoid(fields=("a", "b"), identity=(0, INF), name="MinPlus")
def MinPlus(x, y):
    """Tropical (min, +) affine maps h -> min(a + h, b), y after x: (x.a + y.a, min(y.a + x.b, y.b)).

    Law: + distributes over min; identity (0, inf) is h -> h.
    Recurrence: h_t = min(a_t + h_{t-1}, b_t) (shortest-path / edit-distance style relaxations).

    >>> import torch, scanlang as sl
    >>> sl.scan(sl.MinPlus, (torch.tensor([1.0, 1.0, 1.0]), torch.tensor([3.0, 10.0, 0.0])), dim=0).b.tolist()
    [3.0, 4.0, 0.0]
    """
    return x.a + y.a, minimum(y.a + x.b, y.b)


@monoid(fields=("re", "im"), identity=(1, 0), name="ComplexMul")
def ComplexMul(x, y):
    """Complex numbers re + i*im under multiplication (commutative).

    Law: complex multiplication is associative; identity 1 + 0i.
    Recurrence: the running product z_t = z_{t-1} * w_t (rotations and decays of complex-valued
    diagonal SSMs; combine with Affine-style pairs for h_t = w_t h_{t-1} + u_t).

    >>> import torch, scanlang as sl
    >>> out = sl.scan(sl.ComplexMul, (torch.zeros(4), torch.ones(4)), dim=0)   # powers of i
    >>> (out.re + 0.0).tolist(), (out.im + 0.0).tolist()                       # (+ 0.0: no -0.0)
    ([0.0, -1.0, 0.0, 1.0], [1.0, 0.0, -1.0, 0.0])
    """
    return x.re * y.re - x.im * y.im, x.re * y.im + x.im * y.re


@monoid(fields=("la", "lb"), identity=(0, -INF), name="LogAffine")
def LogAffine(x, y):
    """Affine maps h -> a*h + b with a, b > 0, held in log space (la, lb) = (log a, log b).

    Combine (y after x): la = x.la + y.la, lb = log(exp(y.la + x.lb) + exp(y.lb)), evaluated stably
    around m = max(y.la + x.lb, y.lb).
    Law: the image of Affine under log; identity (0, -inf) is h -> h.
    Recurrence: log h_t = log(a_t h_{t-1} + b_t) from h_0 = 0, without overflow (log-space scans of
    gated RNNs such as minGRU). lb = -inf (b = 0) is exact: the stabiliser m is floored at LOG_FLOOR,
    which changes nothing above it and keeps exp(-inf - m) = 0 (never -inf - (-inf)).

    >>> import torch, scanlang as sl
    >>> out = sl.scan(sl.LogAffine, (torch.full((3,), 0.5).log(), torch.zeros(3)), dim=0)
    >>> [round(v, 4) for v in out.lb.exp().tolist()]   # h_t = 0.5 h_{t-1} + 1, as for Affine
    [1.0, 1.5, 1.75]
    """
    m = maximum(maximum(y.la + x.lb, y.lb), LOG_FLOOR)
    return x.la + y.la, m + log(exp(y.la + x.lb - m) + exp(y.lb - m))


@monoid(fields=("l",), identity=(-INF,), name="LogSumExp")
def LogSumExp(x, y):
    """Log-sum-exp, evaluated stably: max(x, y) + log(exp(x - max) + exp(y - max)).

    Law: the image of Add under log; identity -inf. Recurrence: l_t = log(exp(l_{t-1}) + exp(v_t)),
    the running logsumexp of v_1..v_t. -inf inputs (masked tokens) are exact: the stabiliser is
    floored at LOG_FLOOR (= -1e38; a sum of values all below it underflows to -inf), so two -inf give
    exp(-inf) = 0 terms, never exp(-inf - (-inf)) = NaN.

    >>> import torch, scanlang as sl
    >>> out = sl.scan(sl.LogSumExp, (torch.zeros(3),), dim=0)
    >>> [round(v, 4) for v in out.l.exp().tolist()]    # log(1), log(2), log(3)
    [1.0, 2.0, 3.0]
    """
    m = maximum(maximum(x.l, y.l), LOG_FLOOR)
    return m + log(exp(x.l - m) + exp(y.l - m))


@monoid(fields=("m", "s"), identity=(-INF, 0), name="OnlineSoftmax")
def OnlineSoftmax(x, y):
    """Online softmax normaliser pairs (m, s) meaning s * exp(m): the running max m and sum s of exp(v - m).

    Combine, with f(m) = max(m, LOG_FLOOR): m = max(x.m, y.m),
    s = x.s exp(f(x.m) - f(m)) + y.s exp(f(y.m) - f(m)).
    Law: (m, s) stands for (max, s e^{f(m)}), a pair of the monoids (max, -inf) and (+, 0); both
    groupings give (max, x.s e^{f(x.m)} + y.s e^{f(y.m)} + z.s e^{f(z.m)}). Identity (-inf, 0) is the
    empty sum. Lifting v_t to (v_t, 1), the scan gives m_t = max_{i<=t} v_i and
    s_t = sum_{i<=t} exp(v_i - m_t) (for scores above LOG_FLOOR = -1e38), so log-sum-exp is
    m_t + log(s_t). -inf scores (masked tokens, the identity) are exact: f keeps exp's argument away
    from -inf - (-inf) = NaN, so combine(e, e) = e and leading masked tokens give (-inf, their count).

    >>> import torch, scanlang as sl
    >>> v = torch.tensor([1.0, 3.0, 2.0])
    >>> out = sl.scan(sl.OnlineSoftmax, (v, torch.ones(3)), dim=0)
    >>> out.m.tolist(), [round(s, 4) for s in out.s.tolist()]     # s_3 = e^-2 + 1 + e^-1
    ([1.0, 3.0, 3.0], [1.0, 1.1353, 1.5032])
    """
    m = maximum(x.m, y.m)
    floor = maximum(m, LOG_FLOOR)
    return m, x.s * exp(maximum(x.m, LOG_FLOOR) - floor) + y.s * exp(maximum(y.m, LOG_FLOOR) - floor)


@monoid(fields=("n", "mean", "m2"), identity=(0, 0, 0), name="Welford")
def Welford(x, y):
    """Running count, mean and sum of squared deviations, merged by Chan et al.'s parallel formula.

    Combine: n = x.n + y.n, delta = y.mean - x.mean, mean = x.mean + delta y.n / n,
    m2 = x.m2 + y.m2 + delta^2 x.n y.n / n.
    Law: associative over the reals where the counts are nonzero; identity (0, 0, 0) is the empty set.
    Recurrence: lifting v_t to (1, v_t, 0), the scan gives the mean and (m2 / n) the variance of
    v_1..v_t, stably.

    >>> import torch, scanlang as sl
    >>> v = torch.tensor([1.0, 2.0, 3.0, 4.0])
    >>> out = sl.scan(sl.Welford, (torch.ones(4), v, torch.zeros(4)), dim=0)
    >>> out.mean.tolist(), [round(x, 4) for x in (out.m2 / out.n).tolist()]
    ([1.0, 1.5, 2.0, 2.5], [0.0, 0.25, 0.6667, 1.25])
    """
    n = x.n + y.n
    delta = y.mean - x.mean
    return n, x.mean + delta * y.n / n, x.m2 + y.m2 + delta * delta * x.n * y.n / n


@monoid(fields=("s",), identity=(0,), name="Add")
def Add(x, y):
    """Addition: the scan is the cumulative sum s_t = s_{t-1} + v_t. Law: + is associative, identity 0.

    >>> import torch, scanlang as sl
    >>> sl.scan(sl.Add, (torch.tensor([1.0, 2.0, 3.0]),), dim=0).s.tolist()
    [1.0, 3.0, 6.0]
    """
    return x.s + y.s


@monoid(fields=("m",), identity=(-INF,), name="Max")
def Max(x, y):
    """Maximum: the scan is the running maximum m_t = max(m_{t-1}, v_t). Law: max is associative, identity -inf.

    >>> import torch, scanlang as sl
    >>> sl.scan(sl.Max, (torch.tensor([1.0, 3.0, 2.0]),), dim=0).m.tolist()
    [1.0, 3.0, 3.0]
    """
    return maximum(x.m, y.m)


class MonoidLibrary(tuple):
    """The library's declared monoids, a tuple: each is also `sl.<name>`, and `help(sl.<name>)` shows its law.

    Law: every member is associative with a two-sided identity, proved by sympy (tests/test_library.py).

    >>> import scanlang as sl
    >>> [m.name for m in sl.LIBRARY][:4]
    ['Affine', 'Mobius', 'Matrix2', 'MaxPlus']
    >>> sl.LIBRARY[0] is sl.Affine
    True
    """


LIBRARY = MonoidLibrary((Affine, Mobius, Matrix2, MaxPlus, MinPlus, ComplexMul, LogAffine, LogSumExp, OnlineSoftmax,
                         Welford, Add, Max))

# doctest collects module-level functions and classes, not Monoid objects: their examples (in the
# combine bodies' docstrings, which help() shows) are collected from here
__test__ = {m.name: m.combine_fn for m in LIBRARY}
