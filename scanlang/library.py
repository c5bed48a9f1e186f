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
    """
    return y.a * x.a, y.a * x.b + y.b


@monoid(fields=("a", "b", "c", "d"), identity=(1, 0, 0, 1), scale=lambda m: m.a + m.d, name="Mobius")
def Mobius(x, y):
    """2x2 matrices [[a, b], [c, d]] acting as s -> (a s + b)/(c s + d); combine = Y @ X, trace-normalised.

    Law: matrix product is associative and homogeneous of degree 1 in each factor, and the trace is
    homogeneous of degree 1, so dividing by it keeps the law up to scale; identity: the unit matrix.
    Recurrence: the Riccati / continued-fraction map s_t = (a_t s_{t-1} + b_t) / (c_t s_{t-1} + d_t).
    """
    return (y.a * x.a + y.b * x.c, y.a * x.b + y.b * x.d,
            y.c * x.a + y.d * x.c, y.c * x.b + y.d * x.d)


@monoid(fields=("a", "b", "c", "d"), identity=(1, 0, 0, 1), name="Matrix2")
def Matrix2(x, y):
    """2x2 matrices [[a, b], [c, d]] under the product Y @ X (the later one on the left), no rescaling.

    Law: the matrix product is associative; identity: the unit matrix.
    Recurrence: the linear 2-state system v_t = M_t v_{t-1}; the scan holds M_t ... M_1.
    """
    return (y.a * x.a + y.b * x.c, y.a * x.b + y.b * x.d,
            y.c * x.a + y.d * x.c, y.c * x.b + y.d * x.d)


@monoid(fields=("a", "b"), identity=(0, -INF), name="MaxPlus")
def MaxPlus(x, y):
    """Tropical (max, +) affine maps h -> max(a + h, b), y after x: (x.a + y.a, max(y.a + x.b, y.b)).

    Law: + distributes over max, so these maps compose associatively; identity (0, -inf) is h -> h.
    Recurrence: h_t = max(a_t + h_{t-1}, b_t) (running maxima with additive decay, Viterbi-like).
    """
    return x.a + y.a, maximum(y.a + x.b, y.b)


@monoid(fields=("a", "b"), identity=(0, INF), name="MinPlus")
def MinPlus(x, y):
    """Tropical (min, +) affine maps h -> min(a + h, b), y after x: (x.a + y.a, min(y.a + x.b, y.b)).

    Law: + distributes over min; identity (0, inf) is h -> h.
    Recurrence: h_t = min(a_t + h_{t-1}, b_t) (shortest-path / edit-distance style relaxations).
    """
    return x.a + y.a, minimum(y.a + x.b, y.b)


@monoid(fields=("re", "im"), identity=(1, 0), name="ComplexMul")
def ComplexMul(x, y):
    """Complex numbers re + i*im under multiplication (commutative).

    Law: complex multiplication is associative; identity 1 + 0i.
    Recurrence: the running product z_t = z_{t-1} * w_t (rotations and decays of complex-valued
    diagonal SSMs; combine with Affine-style pairs for h_t = w_t h_{t-1} + u_t).
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
    """
    n = x.n + y.n
    delta = y.mean - x.mean
    return n, x.mean + delta * y.n / n, x.m2 + y.m2 + delta * delta * x.n * y.n / n


@monoid(fields=("s",), identity=(0,), name="Add")
def Add(x, y):
    """Addition: the scan is the cumulative sum s_t = s_{t-1} + v_t. Law: + is associative, identity 0."""
    return x.s + y.s


@monoid(fields=("m",), identity=(-INF,), name="Max")
def Max(x, y):
    """Maximum: the scan is the running maximum m_t = max(m_{t-1}, v_t). Law: max is associative, identity -inf."""
    return maximum(x.m, y.m)


LIBRARY = (Affine, Mobius, Matrix2, MaxPlus, MinPlus, ComplexMul, LogAffine, LogSumExp, OnlineSoftmax, Welford,
           Add, Max)
