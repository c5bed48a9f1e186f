"""`KaczmarzLinearAttention`: the paper's token mixer (docs/spec/kaczmarz.md, "Layer").

    q, k, v = SiLU(causal_depthwise_conv4(W x)) for W in (W_q, W_k, W_v)
    q = q / ||q||                            (per head; k stays raw for Kaczmarz, normalised for GDN)
    g   = -exp(A_log) * softplus(W_a x + dt_bias)             Mamba2 log-decay, [B, T, H] (on the triton
                                                              backend: the rule's decay hook, in-kernel)
    eta = sigmoid(W_b x + b)                                  relaxation (GDN: the step beta itself)
    o   = kaczmarz_delta_rule(q, k, v, g, eta)                (GDN: delta_rule(q, k/||k||, v, g, eta))
    y   = W_o concat_h(RMSNorm_h(o_h) * SiLU(W_g x)_h)

`state=` / `return_state=` carry the last `conv_size - 1` projected inputs of each convolution and the
[B, H, K, V] matrix state, so running a sequence in pieces (down to one token at a time) equals one
pass over the whole sequence.
"""
from __future__ import annotations

import math
from typing import NamedTuple

import torch
import torch.nn.functional as F
from torch import nn

from scanlang import backend as registry
from scanlang import context_parallel
from scanlang.delta import GIVEN_MAMBA2, KACZMARZ_MAMBA2

from .context_parallel import conv_halos
from .ops import delta_rule, delta_rule_with_decay, kaczmarz_delta_rule, validate

MODES = ("kaczmarz", "gdn")


class KaczmarzState(NamedTuple):
    """What a layer carries between calls: three conv windows [B, conv_size-1, dim] and S [B,H,K,V] fp32.

    Law: layer(x[:, :t]) then layer(x[:, t:], state=...) equals layer(x), split anywhere.

    >>> import torch
    >>> from scanlang.recipes.kaczmarz import KaczmarzLinearAttention
    >>> _, st = KaczmarzLinearAttention(hidden_size=32, num_heads=2)(torch.randn(1, 3, 32), return_state=True)
    >>> st._fields
    ('conv_q', 'conv_k', 'conv_v', 'recurrent')
    """

    conv_q: torch.Tensor
    conv_k: torch.Tensor
    conv_v: torch.Tensor
    recurrent: torch.Tensor


def l2_normalize(x: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    """x / sqrt(||x||^2 + eps) over the last dim, in fp32 (or wider when x is)."""
    x = x.to(torch.promote_types(x.dtype, torch.float32))
    return x * torch.rsqrt((x * x).sum(-1, keepdim=True) + eps)


class KaczmarzLinearAttention(nn.Module):
    """Kaczmarz Linear Attention mixer, [B, T, D] -> [B, T, D]; `mode="gdn"` gives the Gated DeltaNet baseline.

    Law: per head, the delta rule S_t = exp(g_t) (I - beta_t k_t k_t^T) S_{t-1} + beta_t k_t v_t^T,
    o_t = scale S_t^T q_t (`kaczmarz_delta_rule`), so pieces with the returned state equal one run.

    >>> import torch
    >>> layer = KaczmarzLinearAttention(hidden_size=32, num_heads=2)
    >>> x = torch.randn(1, 6, 32)
    >>> y1, st = layer(x[:, :4], return_state=True)
    >>> y2, _ = layer(x[:, 4:], state=st, return_state=True)
    >>> bool(torch.allclose(torch.cat([y1, y2], 1), layer(x), atol=1e-5))
    True
    """

    def __init__(self, hidden_size: int, num_heads: int, mode: str = "kaczmarz", expand_k: float = 0.75,
                 expand_v: float = 1.5, conv_size: int = 4, eps: float = 1e-6, norm_eps: float = 1e-5,
                 backend: str | None = None, chunk_size: int = 64):
        super().__init__()
        if mode not in MODES:
            raise ValueError(f"mode must be one of {MODES}, got {mode!r}")
        key_dim, value_dim = int(hidden_size * expand_k), int(hidden_size * expand_v)
        if num_heads < 1 or key_dim % num_heads or value_dim % num_heads:
            raise ValueError(f"num_heads = {num_heads} must divide the key dim {key_dim} and value dim {value_dim}")
        if conv_size < 1:
            raise ValueError(f"conv_size must be >= 1, got {conv_size}")
        self.hidden_size, self.num_heads, self.mode = hidden_size, num_heads, mode
        self.key_dim, self.value_dim = key_dim, value_dim
        self.head_k_dim, self.head_v_dim = key_dim // num_heads, value_dim // num_heads
        self.conv_size, self.eps, self.norm_eps = conv_size, eps, norm_eps
        self.backend, self.chunk_size = backend, chunk_size

        self.q_proj = nn.Linear(hidden_size, key_dim, bias=False)
        self.k_proj = nn.Linear(hidden_size, key_dim, bias=False)
        self.v_proj = nn.Linear(hidden_size, value_dim, bias=False)
        self.g_proj = nn.Linear(hidden_size, value_dim, bias=False)
        self.a_proj = nn.Linear(hidden_size, num_heads, bias=False)
        self.b_proj = nn.Linear(hidden_size, num_heads, bias=True)
        self.o_proj = nn.Linear(value_dim, hidden_size, bias=False)
        self.q_conv = nn.Parameter(torch.empty(key_dim, conv_size))
        self.k_conv = nn.Parameter(torch.empty(key_dim, conv_size))
        self.v_conv = nn.Parameter(torch.empty(value_dim, conv_size))
        for w in (self.q_conv, self.k_conv, self.v_conv):
            nn.init.kaiming_uniform_(w.unsqueeze(1), a=math.sqrt(5))  # nn.Conv1d's default
        A = torch.empty(num_heads).uniform_(0, 16).clamp_min(1e-4)
        self.A_log = nn.Parameter(torch.log(A))
        dt = torch.exp(torch.empty(num_heads).uniform_(math.log(1e-3), math.log(1e-1))).clamp_min(1e-4)
        self.dt_bias = nn.Parameter(dt + torch.log(-torch.expm1(-dt)))   # softplus(dt_bias) = dt
        self.norm_weight = nn.Parameter(torch.ones(self.head_v_dim))

    def _conv(self, x: torch.Tensor, weight: torch.Tensor, window: torch.Tensor | None):
        """Causal depthwise conv + SiLU over T, continuing from `window` (the previous conv_size-1 inputs)."""
        B, T, D = x.shape
        if window is None:
            window = x.new_zeros(B, self.conv_size - 1, D)
        full = torch.cat([window.to(x.dtype), x], dim=1)                      # [B, W-1+T, D]
        new_window = full[:, full.shape[1] - (self.conv_size - 1):]
        if T == 0:   # no tokens (an empty context-parallel shard): nothing to convolve
            return context_parallel.keep_in_graph(x, window), new_window
        y = F.conv1d(full.transpose(1, 2), weight.to(x.dtype).unsqueeze(1), groups=D)
        return F.silu(y.transpose(1, 2)), new_window

    def empty_state(self, batch: int, x: torch.Tensor) -> KaczmarzState:
        """The state before any token: zero conv windows (in x's dtype) and a zero fp32 matrix state."""
        def window(dim):
            return x.new_zeros(batch, self.conv_size - 1, dim)
        S = torch.zeros(batch, self.num_heads, self.head_k_dim, self.head_v_dim, device=x.device,
                        dtype=torch.promote_types(x.dtype, torch.float32))
        return KaczmarzState(window(self.key_dim), window(self.key_dim), window(self.value_dim), S)

    def _check(self, x, state):
        if not isinstance(x, torch.Tensor) or x.dim() != 3 or x.shape[-1] != self.hidden_size:
            got = tuple(x.shape) if isinstance(x, torch.Tensor) else type(x).__name__
            raise ValueError(f"x must have shape [B, T, {self.hidden_size}], got {got}")
        B, H, K, V = x.shape[0], self.num_heads, self.head_k_dim, self.head_v_dim
        if state is not None and not isinstance(state, KaczmarzState):
            raise TypeError(f"state must be the KaczmarzState a previous call returned, got {type(state).__name__}")
        if state is not None and state.recurrent.shape != (B, H, K, V):
            raise ValueError(f"state.recurrent must have shape [B, H, K, V] = {[B, H, K, V]}, "
                             f"got {list(state.recurrent.shape)}")
        if state is not None:   # fp32 (float64 for float64 inputs), as this layer returns it
            want = torch.promote_types(x.dtype, torch.float32)
            if state.recurrent.dtype not in (torch.float32, want):
                raise TypeError(f"state.recurrent: dtype {state.recurrent.dtype}, but this layer keeps its state in "
                                f"{want}; pass the state it returned (or convert the state with .to({want}))")

    def forward(self, x: torch.Tensor, state: KaczmarzState | None = None, return_state: bool = False,
                cp_group=None):
        """x [B, T, D] -> y (or (y, state) with `return_state`). `cp_group`: context parallelism over T
        (every rank passes its shard and the same `state`; the conv halo and the matrix state are
        exchanged; the returned state is the global one on every rank)."""
        if type(state) is tuple and len(state) == 4:   # a plain (conv_q, conv_k, conv_v, recurrent)
            state = KaczmarzState(*state)
        group = context_parallel.resolve_group(cp_group)
        if group is None:
            self._check(x, state)
        else:
            context_parallel.validated(group, lambda: self._check(x, state))
        B, T, _ = x.shape
        H, K, V = self.num_heads, self.head_k_dim, self.head_v_dim
        if T == 0 and group is None:   # nothing to mix (an empty CP shard still takes part in the exchange)
            y = x.new_zeros(B, 0, self.hidden_size)
            if not return_state:
                return y
            return y, state if state is not None else self.empty_state(B, x)
        windows = (None, None, None) if state is None else (state.conv_q, state.conv_k, state.conv_v)
        projected = (self.q_proj(x), self.k_proj(x), self.v_proj(x))
        if group is not None:
            windows, last_windows = conv_halos(group, self, x, projected, windows, state)
        q, wq = self._conv(projected[0], self.q_conv, windows[0])
        k, wk = self._conv(projected[1], self.k_conv, windows[1])
        v, wv = self._conv(projected[2], self.v_conv, windows[2])
        if group is not None:
            wq, wk, wv = last_windows
        ct = torch.promote_types(x.dtype, torch.float32)   # gates, norms and the scan in fp32 or wider
        # q, k, v enter the scan in the activations' dtype (half inputs use the tensor cores; the scan
        # accumulates in fp32 regardless); normalisation happens in ct first
        q = l2_normalize(q.view(B, T, H, K)).to(x.dtype)
        k = k.view(B, T, H, K)
        if self.mode == "gdn":
            k = l2_normalize(k).to(x.dtype)
        v = v.view(B, T, H, V)
        a = self.a_proj(x).to(ct)
        eta = torch.sigmoid(self.b_proj(x).to(ct))
        h0 = None if state is None else state.recurrent
        backend = self.backend or registry.default(x.device, ct, triton_dtypes=(torch.float32,))
        if backend == "triton" and group is None:
            # the Mamba2 gate runs inside the generated kernels as the rule's decay hook
            validate(q, k, v, a, eta, "eta", None, h0, None, backend, self.chunk_size)
            rule = KACZMARZ_MAMBA2 if self.mode == "kaczmarz" else GIVEN_MAMBA2
            o, S = delta_rule_with_decay(q, k, v, a, eta, rule, (self.A_log, self.dt_bias), K ** -0.5, h0,
                                         return_state, self.chunk_size, self.eps)
        else:
            g = -torch.exp(self.A_log.to(ct)) * F.softplus(a + self.dt_bias.to(ct))
            kwargs = dict(initial_state=h0, output_final_state=return_state, backend=backend,
                          chunk_size=self.chunk_size, cp_group=group)
            if self.mode == "kaczmarz":
                o, S = kaczmarz_delta_rule(q, k, v, g, eta, eps=self.eps, **kwargs)
            else:
                o, S = delta_rule(q, k, v, g, eta, **kwargs)
        o = o * torch.rsqrt(o.pow(2).mean(-1, keepdim=True) + self.norm_eps) * self.norm_weight.to(ct)
        o = o * F.silu(self.g_proj(x).to(ct).view(B, T, H, V))
        y = self.o_proj(o.reshape(B, T, H * V).to(x.dtype))
        if return_state:
            return y, KaczmarzState(wq, wk, wv, S)
        return y
