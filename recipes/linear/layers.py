"""Token-mixer layers around the matrix-state members: `GatedLinearAttention` (`gla`) and
`KimiDeltaAttention` (`kda`), parametrised as flash-linear-attention's layers of the same names.

    q, k, v = act(short_conv(W x)) for W in (W_q, W_k, W_v)     act: SiLU after the optional causal
                                                                depthwise conv (KDA: SiLU also without it)
    GLA:  g = logsigmoid(W_g2 W_g1 x + b) / gate_logit_normalizer          [B, T, H, K] log-decay
          o = gla(q, k, v, g)
          y = W_o concat_h(RMSNorm_h(o_h) * SiLU(W_r x)_h)                 (output gate optional)
    KDA:  q, k L2-normalised per head
          g = -exp(A_log_h) * softplus(W_f2 W_f1 x + dt_bias)              [B, T, H, K] log-decay
          beta = sigmoid(W_b x)  (x 2 with allow_neg_eigval)
          o = kda(q, k, v, g, beta)
          y = W_o concat_h(RMSNorm_h(o_h) * sigmoid(W_r2 W_r1 x + b_r)_h)

`state=` / `return_state=` carry the last `conv_size - 1` projected inputs of each convolution (None
without the short convolution) and the [N, H, K, V] matrix state, so running a sequence in pieces (down
to one token at a time) equals one pass. `cu_seqlens` packs N sequences along T (B = 1): the
convolution and the recurrence restart at every sequence start, and the state holds one row per
sequence. Context parallelism (`cp_group`) is not offered: the members take no `cp_group` yet.
"""
from __future__ import annotations

import math
from typing import NamedTuple

import torch
import torch.nn.functional as F
from torch import nn

from scanlang._checks import check_cu_seqlens

from .members import gla, kda


class LinearLayerState(NamedTuple):
    """What a matrix-state layer carries between calls: three conv windows [N, conv_size-1, dim] (None
    without the short convolution) and the matrix state S [N, H, K, V] fp32 (float64 in a float64 layer).

    Law: layer(x[:, :t]) then layer(x[:, t:], state=...) equals layer(x), split anywhere.

    >>> import torch
    >>> from scanlang.recipes.linear import GatedLinearAttention
    >>> _, st = GatedLinearAttention(hidden_size=16, num_heads=2)(torch.randn(1, 3, 16), return_state=True)
    >>> st._fields, st.conv_q, tuple(st.recurrent.shape)
    (('conv_q', 'conv_k', 'conv_v', 'recurrent'), None, (1, 2, 4, 8))
    """

    conv_q: torch.Tensor | None
    conv_k: torch.Tensor | None
    conv_v: torch.Tensor | None
    recurrent: torch.Tensor


def _positive_int(name: str, value) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"{name}: expected a positive int, got {value!r}")
    return value


def _dim(name: str, value: float) -> int:
    """A width from an expansion ratio, which must come out a whole number."""
    if not math.isclose(value, round(value), rel_tol=0, abs_tol=1e-6) or round(value) < 1:
        raise ValueError(f"{name}: {value} is not a positive whole number of channels")
    return int(round(value))


def _l2_normalize(x: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    return x * torch.rsqrt((x * x).sum(-1, keepdim=True) + eps)


class _MatrixStateLayer(nn.Module):
    """Shared parts: q/k/v projections, optional short convolutions, state checks, the output norm."""

    silu_without_conv = False   # KDA applies SiLU to q, k, v also when there is no convolution

    def _build(self, hidden_size, num_heads, head_k_dim, head_v_dim, use_short_conv, conv_size, conv_bias,
               norm_eps, backend, chunk_size):
        self.hidden_size, self.num_heads = hidden_size, num_heads
        self.head_k_dim, self.head_v_dim = head_k_dim, head_v_dim
        self.key_dim, self.value_dim = num_heads * head_k_dim, num_heads * head_v_dim
        self.use_short_conv, self.conv_size = bool(use_short_conv), _positive_int("conv_size", conv_size)
        if not norm_eps > 0:
            raise ValueError(f"norm_eps: must be > 0, got {norm_eps}")
        if backend not in (None, "auto", "reference", "triton"):
            raise ValueError(f"backend: expected None, 'auto', 'reference' or 'triton', got {backend!r}")
        self.norm_eps, self.backend, self.chunk_size = norm_eps, backend, _positive_int("chunk_size", chunk_size)
        self.q_proj = nn.Linear(hidden_size, self.key_dim, bias=False)
        self.k_proj = nn.Linear(hidden_size, self.key_dim, bias=False)
        self.v_proj = nn.Linear(hidden_size, self.value_dim, bias=False)
        if self.use_short_conv:
            dims = (self.key_dim, self.key_dim, self.value_dim)
            self.q_conv, self.k_conv, self.v_conv = (nn.Parameter(torch.empty(d, conv_size)) for d in dims)
            for w in (self.q_conv, self.k_conv, self.v_conv):
                nn.init.kaiming_uniform_(w.unsqueeze(1), a=math.sqrt(5))   # nn.Conv1d's default
            bias = [nn.Parameter(torch.empty(d).uniform_(-conv_size ** -0.5, conv_size ** -0.5)) if conv_bias
                    else None for d in dims]
            self.q_conv_bias, self.k_conv_bias, self.v_conv_bias = bias
        self.norm_weight = nn.Parameter(torch.ones(head_v_dim))
        self.o_proj = nn.Linear(self.value_dim, hidden_size, bias=False)

    # ---- state -----------------------------------------------------------------------------------
    def empty_state(self, batch: int, x: torch.Tensor) -> LinearLayerState:
        """The state before any token for `batch` sequences: zero conv windows (x's dtype), zero S."""
        ct = torch.promote_types(x.dtype, torch.float32)
        S = torch.zeros(batch, self.num_heads, self.head_k_dim, self.head_v_dim, device=x.device, dtype=ct)
        if not self.use_short_conv:
            return LinearLayerState(None, None, None, S)
        w = self.conv_size - 1
        return LinearLayerState(*(x.new_zeros(batch, w, d) for d in (self.key_dim, self.key_dim, self.value_dim)), S)

    def _check(self, x, state, cu_seqlens):
        """Validated (offsets or None, number of sequences N, state as a LinearLayerState or None)."""
        if not isinstance(x, torch.Tensor) or x.dim() != 3 or x.shape[-1] != self.hidden_size:
            got = tuple(x.shape) if isinstance(x, torch.Tensor) else type(x).__name__
            raise ValueError(f"x: expected shape [B, T, {self.hidden_size}] (hidden_size = {self.hidden_size}), "
                             f"got {got}")
        if not x.is_floating_point():
            raise TypeError(f"x: expected a floating-point tensor, got {x.dtype}")
        offsets, N = None, x.shape[0]
        if cu_seqlens is not None:
            if x.shape[0] != 1:
                raise ValueError(f"cu_seqlens: packs sequences along T and needs B == 1, got B = {x.shape[0]}")
            offsets = check_cu_seqlens(cu_seqlens, x.shape[1], x.device)
            if offsets is None:   # while torch.compile traces: the values are read here anyway
                offsets = tuple(int(c) for c in cu_seqlens.tolist())
            N = len(offsets) - 1
        if state is None:
            return offsets, N, None
        if type(state) is tuple and len(state) == 4:   # a plain (conv_q, conv_k, conv_v, recurrent)
            state = LinearLayerState(*state)
        if not isinstance(state, LinearLayerState):
            raise TypeError(f"state: expected the LinearLayerState a previous call returned, "
                            f"got {type(state).__name__}")
        want = (N, self.num_heads, self.head_k_dim, self.head_v_dim)
        S = state.recurrent
        if not isinstance(S, torch.Tensor) or tuple(S.shape) != want:
            got = tuple(S.shape) if isinstance(S, torch.Tensor) else type(S).__name__
            raise ValueError(f"state.recurrent: expected shape [N, H, K, V] = {list(want)}, got {got}")
        ct = torch.promote_types(x.dtype, torch.float32)
        if S.dtype not in (torch.float32, ct):
            raise TypeError(f"state.recurrent: dtype {S.dtype}, but this layer keeps its state in {ct}; pass the "
                            f"state it returned (or convert it with .to({ct}))")
        names = ("state.conv_q", "state.conv_k", "state.conv_v")
        for name, t, d in zip(names, state[:3], (self.key_dim, self.key_dim, self.value_dim)):
            if not self.use_short_conv:
                if t is not None:
                    raise ValueError(f"{name}: this layer has no short convolution (use_short_conv=False), "
                                     f"expected None, got {type(t).__name__}")
                continue
            shape = (N, self.conv_size - 1, d)
            if not isinstance(t, torch.Tensor) or tuple(t.shape) != shape:
                got = tuple(t.shape) if isinstance(t, torch.Tensor) else type(t).__name__
                raise ValueError(f"{name}: expected shape [N, conv_size - 1, dim] = {list(shape)}, got {got}")
        for name, t in zip(names + ("state.recurrent",), state):
            if t is not None and t.device != x.device:
                raise ValueError(f"{name}: on {t.device}, but x is on {x.device}")
        return offsets, N, state

    # ---- pieces ----------------------------------------------------------------------------------
    def _conv(self, x, weight, bias, window, offsets):
        """Causal depthwise conv over T continuing from `window` [N, conv_size-1, D]; restarts per sequence."""
        if offsets is None:
            return self._conv_run(x, weight, bias, window)
        outs, windows = [], []
        for i, (a, b) in enumerate(zip(offsets, offsets[1:])):
            y, w = self._conv_run(x[:, a:b], weight, bias, window[i:i + 1])
            outs.append(y)
            windows.append(w)
        return torch.cat(outs, 1), torch.cat(windows, 0)

    def _conv_run(self, x, weight, bias, window):
        B, T, D = x.shape
        full = torch.cat([window.to(x.dtype), x], dim=1)   # [B, conv_size-1+T, D]
        new_window = full[:, full.shape[1] - (self.conv_size - 1):]
        if T == 0:
            return x, new_window
        y = F.conv1d(full.transpose(1, 2), weight.to(x.dtype).unsqueeze(1),
                     None if bias is None else bias.to(x.dtype), groups=D)
        return y.transpose(1, 2), new_window

    def _qkv(self, x, state, offsets, N):
        """(q, k, v) [B, T, H, K|V] in the compute dtype, and the new conv windows (or Nones)."""
        B, T, _ = x.shape
        projected = (self.q_proj(x), self.k_proj(x), self.v_proj(x))
        windows = (None, None, None)
        if self.use_short_conv:
            if state is None:
                state = self.empty_state(N, x)
            convs = ((self.q_conv, self.q_conv_bias), (self.k_conv, self.k_conv_bias), (self.v_conv, self.v_conv_bias))
            pairs = [self._conv(p, w, b, win, offsets) for p, (w, b), win in zip(projected, convs, state[:3])]
            projected = tuple(F.silu(y) for y, _ in pairs)
            windows = tuple(win for _, win in pairs)
        elif self.silu_without_conv:
            projected = tuple(F.silu(p) for p in projected)
        ct = torch.promote_types(x.dtype, torch.float32)
        q, k, v = (p.to(ct) for p in projected)
        H, K, V = self.num_heads, self.head_k_dim, self.head_v_dim
        return q.view(B, T, H, K), k.view(B, T, H, K), v.view(B, T, H, V), windows

    def forward(self, x: torch.Tensor, state: LinearLayerState | None = None, return_state: bool = False,
                cu_seqlens: torch.Tensor | None = None):
        """x [B, T, hidden_size] -> y [B, T, hidden_size], or (y, state) with `return_state=True`.

        `state`: the LinearLayerState a previous call returned (None: start from zeros). `cu_seqlens`
        [N + 1]: N sequences packed along T (B = 1); the state then holds one row per sequence."""
        offsets, N, state = self._check(x, state, cu_seqlens)
        B, T, _ = x.shape
        if T == 0:
            y = x.new_zeros(B, 0, self.hidden_size)
            return (y, state if state is not None else self.empty_state(N, x)) if return_state else y
        q, k, v, windows = self._qkv(x, state, offsets, N)
        h0 = None if state is None else state.recurrent
        if torch.is_autocast_enabled(x.device.type):   # the recurrence stays in fp32 under bf16 autocast
            with torch.autocast(x.device.type, enabled=False):
                o, S = self._recurrence(x, q, k, v, h0, return_state, cu_seqlens)
        else:
            o, S = self._recurrence(x, q, k, v, h0, return_state, cu_seqlens)
        ct = o.dtype
        o = o * torch.rsqrt(o.pow(2).mean(-1, keepdim=True) + self.norm_eps) * self.norm_weight.to(ct)
        gate = self._output_gate(x)
        if gate is not None:
            o = o * gate.to(ct).view(B, T, self.num_heads, self.head_v_dim)
        y = self.o_proj(o.reshape(B, T, self.value_dim).to(x.dtype))
        return (y, LinearLayerState(*windows, S)) if return_state else y

    def extra_repr(self) -> str:
        return (f"hidden_size={self.hidden_size}, num_heads={self.num_heads}, head_k_dim={self.head_k_dim}, "
                f"head_v_dim={self.head_v_dim}, use_short_conv={self.use_short_conv}, backend={self.backend!r}")


class GatedLinearAttention(_MatrixStateLayer):
    """Gated linear attention (Yang et al. 2023), [B, T, D] -> [B, T, D]: fla's GatedLinearAttention
    parametrisation around `gla` (module docstring for the whole block).

    Law: per head, S_t = diag(exp(g_t)) S_{t-1} + k_t v_t^T, o_t = K^-1/2 S_t^T q_t with the per-key
    log-decay g_t = logsigmoid(W_g2 W_g1 x_t + b) / gate_logit_normalizer; the output is
    W_o concat_h(RMSNorm(o_h) * SiLU(W_r x)_h). Pieces with the returned state equal one run.

    Widths: key_dim = hidden_size * expand_k, value_dim = hidden_size * expand_v, split over num_heads
    (head K and V may differ). `clamp_min` bounds g from below; `use_output_gate=False` drops SiLU(W_r x).

    >>> import torch
    >>> layer = GatedLinearAttention(hidden_size=16, num_heads=2, use_short_conv=True)
    >>> x = torch.randn(1, 6, 16)
    >>> y1, st = layer(x[:, :4], return_state=True)
    >>> y2, _ = layer(x[:, 4:], state=st, return_state=True)
    >>> bool(torch.allclose(torch.cat([y1, y2], 1), layer(x), atol=1e-5))
    True
    """

    def __init__(self, hidden_size: int, num_heads: int = 4, expand_k: float = 0.5, expand_v: float = 1.0,
                 use_short_conv: bool = False, conv_size: int = 4, conv_bias: bool = False,
                 use_output_gate: bool = True, norm_eps: float = 1e-5, gate_logit_normalizer: float = 16,
                 gate_low_rank_dim: int = 16, clamp_min: float | None = None, backend: str | None = None,
                 chunk_size: int = 32):
        super().__init__()
        _positive_int("hidden_size", hidden_size)
        _positive_int("num_heads", num_heads)
        key_dim, value_dim = _dim("expand_k", hidden_size * expand_k), _dim("expand_v", hidden_size * expand_v)
        if key_dim % num_heads or value_dim % num_heads:
            raise ValueError(f"num_heads: {num_heads} must divide the key dim {key_dim} and the value dim {value_dim}")
        if not gate_logit_normalizer > 0:
            raise ValueError(f"gate_logit_normalizer: must be > 0, got {gate_logit_normalizer}")
        if clamp_min is not None and not clamp_min < 0:
            raise ValueError(f"clamp_min: a log-decay bound must be < 0 (or None), got {clamp_min}")
        self._build(hidden_size, num_heads, key_dim // num_heads, value_dim // num_heads, use_short_conv,
                    conv_size, conv_bias, norm_eps, backend, chunk_size)
        self.gate_logit_normalizer, self.clamp_min = float(gate_logit_normalizer), clamp_min
        rank = _positive_int("gate_low_rank_dim", gate_low_rank_dim)
        self.gk_proj = nn.Sequential(nn.Linear(hidden_size, rank, bias=False), nn.Linear(rank, key_dim, bias=True))
        self.g_proj = nn.Linear(hidden_size, value_dim, bias=False) if use_output_gate else None

    def log_decay(self, x: torch.Tensor) -> torch.Tensor:
        """g [B, T, H, K] = logsigmoid(gk_proj(x)) / gate_logit_normalizer (clamped at clamp_min), <= 0."""
        ct = torch.promote_types(x.dtype, torch.float32)
        g = F.logsigmoid(self.gk_proj(x).to(ct)) / self.gate_logit_normalizer
        if self.clamp_min is not None:
            g = g.clamp_min(self.clamp_min)
        return g.view(*x.shape[:2], self.num_heads, self.head_k_dim)

    def _recurrence(self, x, q, k, v, h0, return_state, cu_seqlens):
        return gla(q, k, v, self.log_decay(x), initial_state=h0, output_final_state=return_state,
                   cu_seqlens=cu_seqlens, backend=self.backend, chunk_size=self.chunk_size)

    def _output_gate(self, x):
        return None if self.g_proj is None else F.silu(self.g_proj(x))


class KimiDeltaAttention(_MatrixStateLayer):
    """Kimi delta attention (Kimi Linear, 2025), [B, T, D] -> [B, T, D]: fla's KimiDeltaAttention
    parametrisation around `kda` (module docstring for the whole block).

    Law: per head, S_t = (I - beta_t k_t k_t^T) diag(exp(g_t)) S_{t-1} + beta_t k_t v_t^T,
    o_t = K^-1/2 S_t^T q_t, with unit q_t, k_t, g_t = -exp(A_log_h) softplus(W_f2 W_f1 x_t + dt_bias)
    and beta_t = sigmoid(W_b x_t); the output is W_o concat_h(RMSNorm(o_h) * sigmoid(W_r2 W_r1 x + b)_h).
    Pieces with the returned state equal one run.

    Widths: head K = head_dim, head V = head_dim * expand_v, num_heads heads.

    >>> import torch
    >>> layer = KimiDeltaAttention(hidden_size=16, num_heads=2, head_dim=4)
    >>> x = torch.randn(1, 6, 16)
    >>> y1, st = layer(x[:, :4], return_state=True)
    >>> y2, _ = layer(x[:, 4:], state=st, return_state=True)
    >>> bool(torch.allclose(torch.cat([y1, y2], 1), layer(x), atol=1e-5))
    True
    """

    silu_without_conv = True

    def __init__(self, hidden_size: int, num_heads: int = 16, head_dim: int = 128, expand_v: float = 1.0,
                 use_short_conv: bool = True, conv_size: int = 4, conv_bias: bool = False,
                 allow_neg_eigval: bool = False, norm_eps: float = 1e-5, backend: str | None = None,
                 chunk_size: int = 32):
        super().__init__()
        _positive_int("hidden_size", hidden_size)
        _positive_int("num_heads", num_heads)
        _positive_int("head_dim", head_dim)
        head_v_dim = _dim("expand_v", head_dim * expand_v)
        self._build(hidden_size, num_heads, head_dim, head_v_dim, use_short_conv, conv_size, conv_bias, norm_eps,
                    backend, chunk_size)
        self.allow_neg_eigval = bool(allow_neg_eigval)
        self.f_proj = nn.Sequential(nn.Linear(hidden_size, head_v_dim, bias=False),
                                    nn.Linear(head_v_dim, self.key_dim, bias=False))
        self.b_proj = nn.Linear(hidden_size, num_heads, bias=False)
        self.A_log = nn.Parameter(torch.empty(num_heads).uniform_(1, 16).log())
        dt = torch.exp(torch.empty(self.key_dim).uniform_(math.log(1e-3), math.log(1e-1))).clamp_min(1e-4)
        self.dt_bias = nn.Parameter(dt + torch.log(-torch.expm1(-dt)))   # softplus(dt_bias) = dt
        self.g_proj = nn.Sequential(nn.Linear(hidden_size, head_v_dim, bias=False),
                                    nn.Linear(head_v_dim, self.value_dim, bias=True))

    def log_decay(self, x: torch.Tensor) -> torch.Tensor:
        """g [B, T, H, K] = -exp(A_log)_h * softplus(f_proj(x) + dt_bias), < 0."""
        ct = torch.promote_types(x.dtype, torch.float32)
        pre = (self.f_proj(x).to(ct) + self.dt_bias.to(ct)).view(*x.shape[:2], self.num_heads, self.head_k_dim)
        return -torch.exp(self.A_log.to(ct))[:, None] * F.softplus(pre)

    def beta(self, x: torch.Tensor) -> torch.Tensor:
        """beta [B, T, H] = sigmoid(b_proj(x)), doubled with allow_neg_eigval (eigenvalues in (-1, 1))."""
        beta = torch.sigmoid(self.b_proj(x).to(torch.promote_types(x.dtype, torch.float32)))
        return 2 * beta if self.allow_neg_eigval else beta

    def _recurrence(self, x, q, k, v, h0, return_state, cu_seqlens):
        return kda(_l2_normalize(q), _l2_normalize(k), v, self.log_decay(x), self.beta(x), initial_state=h0,
                   output_final_state=return_state, cu_seqlens=cu_seqlens, backend=self.backend,
                   chunk_size=self.chunk_size)

    def _output_gate(self, x):
        return torch.sigmoid(self.g_proj(x))
