"""`KalmanLinearAttention`: the paper's block (docs/spec/kalman.md) around `kalman_filter`.

    x [B,T,D] -> in_proj (D -> 2M) -> (z, gate)
    z -> depthwise causal conv1d (kernel d_conv, bias) -> SiLU
    z -> sensor projection -> v [M], log sigma_v^2 [M], k [S], q [S];  k, q L2-normalised over S
    prec  = 1 / (softplus(log sigma_v^2) + 1e-4)
    a_bar = exp(delta a),  a = -exp(a_log),  delta = softplus(delta_raw)           (static [M,S])
    p_bar = p / (2|a|) (1 - exp(-2 |a| delta))        exact Ornstein-Uhlenbeck discretisation
    y = kalman_filter(...).y ;  y = y + D z ;  y = y * SiLU(gate) ;  out = out_proj(y)

Sensor presets: "plain" projects v and log sigma_v^2 at full width M; "mamba" takes v = z (no
projection) and produces log sigma_v^2 through a rank ceil(d_model / 8) bottleneck, the slot
Mamba's dt_proj occupies.

Recurrent use: `layer(x, state=st, return_state=True)` carries the conv window and the filter's
(lam, eta); decoding one token costs O(M S) work, and any split of a sequence into calls gives the
same output as one call.
"""
from __future__ import annotations

import math
from typing import NamedTuple

import torch
import torch.nn.functional as F
from torch import nn

from scanlang import context_parallel

from .context_parallel import conv_halo
from .filter import kalman_filter

SENSORS = ("plain", "mamba")
OBS_VAR_MIN = 1e-4


def _wide(t: torch.Tensor) -> torch.Tensor:
    """Scan arithmetic dtype: half types go to float32; float32 and float64 stay."""
    return t if t.dtype in (torch.float32, torch.float64) else t.float()


class KalmanLayerState(NamedTuple):
    """Everything a call needs from the previous one.

    Law: layer(x[:, :t]) then layer(x[:, t:], state=...) equals layer(x), split anywhere.

    >>> import torch
    >>> from scanlang.recipes.kalman import KalmanLinearAttention
    >>> _, st = KalmanLinearAttention(d_model=8, d_state=4)(torch.randn(1, 3, 8), return_state=True)
    >>> st._fields, tuple(st.lam.shape)
    (('conv', 'lam', 'eta'), (1, 16, 4))
    """

    conv: torch.Tensor   # [B, M, d_conv - 1]: the last inputs of the causal conv
    lam: torch.Tensor    # [B, M, S] precision, float32 (float64 in a float64 layer)
    eta: torch.Tensor    # [B, M, S] information mean, likewise


class KalmanLinearAttention(nn.Module):
    """Kalman linear attention block. `layer(x)` maps [B,T,d_model] -> [B,T,d_model].

    Law: a Mamba-style block whose sequence mixer is `kalman_filter` (its recursion), so running it
    in pieces with the returned state equals one run over the whole sequence.

    >>> import torch
    >>> layer = KalmanLinearAttention(d_model=8, d_state=4)
    >>> x = torch.randn(2, 6, 8)
    >>> y1, st = layer(x[:, :4], return_state=True)
    >>> y2, st = layer(x[:, 4:], state=st, return_state=True)
    >>> torch.allclose(torch.cat([y1, y2], 1), layer(x), atol=1e-5)
    True
    """

    def __init__(self, d_model: int, d_state: int = 16, expand: float = 2, d_conv: int = 4,
                 sensor: str = "plain", dt_min: float = 1e-3, dt_max: float = 1e-1,
                 process_noise: float = 0.01, backend: str | None = None):
        super().__init__()
        for name, value in (("d_model", d_model), ("d_state", d_state), ("d_conv", d_conv)):
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{name}: expected a positive int, got {value!r}")
        if sensor not in SENSORS:
            raise ValueError(f"sensor: expected one of {SENSORS}, got {sensor!r}")
        if not 0 < dt_min <= dt_max:
            raise ValueError(f"dt_min, dt_max: need 0 < dt_min <= dt_max, got {dt_min}, {dt_max}")
        if not process_noise > 0:
            raise ValueError(f"process_noise: must be > 0, got {process_noise}")
        self.d_model, self.d_state, self.d_conv, self.sensor = d_model, d_state, d_conv, sensor
        self.d_inner = channels = int(expand * d_model)
        if channels < 1:
            raise ValueError(f"expand: d_inner = expand * d_model must be >= 1, got {expand} * {d_model}")
        self.backend = backend

        self.in_proj = nn.Linear(d_model, 2 * channels, bias=False)
        self.conv = nn.Conv1d(channels, channels, d_conv, groups=channels, bias=True)
        if sensor == "plain":
            self.var_rank = channels
            self.sensor_proj = nn.Linear(channels, 2 * channels + 2 * d_state, bias=False)
            self.var_expand = None
        else:
            self.var_rank = math.ceil(d_model / 8)
            self.sensor_proj = nn.Linear(channels, self.var_rank + 2 * d_state, bias=False)
            self.var_expand = nn.Linear(self.var_rank, channels, bias=False)
        self.a_log = nn.Parameter(torch.zeros(channels, d_state))                 # a = -1
        self.p_log = nn.Parameter(torch.full((channels, d_state), math.log(process_noise)))
        delta = torch.exp(torch.empty(channels, d_state).uniform_(math.log(dt_min), math.log(dt_max)))
        self.delta_raw = nn.Parameter(delta + torch.log(-torch.expm1(-delta)))     # softplus^-1(delta)
        self.D = nn.Parameter(torch.full((channels,), -1.0))
        self.out_proj = nn.Linear(channels, d_model, bias=False)

    def dynamics(self) -> tuple[torch.Tensor, torch.Tensor]:
        """(a_bar, p_bar), each [M,S]: the OU discretisation of da = a x dt + sqrt(p) dW over delta."""
        rate = torch.exp(_wide(self.a_log))                       # |a|, a = -rate
        delta = F.softplus(_wide(self.delta_raw))
        a_bar = torch.exp(-rate * delta)
        p_bar = torch.exp(_wide(self.p_log)) / (2 * rate) * -torch.expm1(-2 * rate * delta)
        return a_bar, p_bar

    def sensors(self, z: torch.Tensor):
        """z [B,T,M] -> (v, prec) [B,T,M] and unit-norm (k, q) [B,T,S]."""
        out = self.sensor_proj(z)
        S = self.d_state
        if self.var_expand is None:
            v, log_var, k, q = out.split([self.d_inner, self.d_inner, S, S], dim=-1)
        else:
            low, k, q = out.split([self.var_rank, S, S], dim=-1)
            v, log_var = z, self.var_expand(low)
        prec = 1 / (F.softplus(_wide(log_var)) + OBS_VAR_MIN)
        return v, prec, F.normalize(_wide(k), dim=-1), F.normalize(_wide(q), dim=-1)

    def initial_state(self, batch: int, device=None, dtype=None) -> KalmanLayerState:
        """The state before any token: empty conv window (zeros), lam = 1, eta = 0."""
        M, S = self.d_inner, self.d_state
        conv = torch.zeros(batch, M, self.d_conv - 1, device=device, dtype=dtype or self.conv.weight.dtype)
        lam = torch.ones(batch, M, S, device=device, dtype=_wide(self.a_log).dtype)
        return KalmanLayerState(conv, lam, torch.zeros_like(lam))

    def _check(self, x, state):
        if not isinstance(x, torch.Tensor) or x.dim() != 3 or x.shape[-1] != self.d_model:
            got = tuple(x.shape) if isinstance(x, torch.Tensor) else type(x).__name__
            raise ValueError(f"x: expected shape [B,T,d_model] with d_model = {self.d_model}, got {got}")
        if state is not None:
            self._check_state(state, x.shape[0], x)

    def forward(self, x: torch.Tensor, state: KalmanLayerState | None = None, return_state: bool = False,
                cp_group=None):
        """x [B,T,d_model] -> y [B,T,d_model], or (y, state) with `return_state=True`.

        `cp_group`: context parallelism over T (every rank passes its shard and the same `state`; the
        conv halo and the filter state are exchanged; the returned state is the global one)."""
        group = context_parallel.resolve_group(cp_group)
        if group is None:
            self._check(x, state)
        else:
            context_parallel.validated(group, lambda: self._check(x, state))
        batch = x.shape[0]
        if state is None:
            state = self.initial_state(batch, x.device, x.dtype)
        else:
            state = self._check_state(state, batch, x)   # a plain (conv, lam, eta) tuple as the named state
        if x.shape[1] == 0 and group is None:   # nothing to filter (an empty CP shard still exchanges)
            out = x.new_zeros(batch, 0, self.d_model)
            return (out, state) if return_state else out
        z, gate = self.in_proj(x).chunk(2, dim=-1)
        conv_window = state.conv.to(z.dtype)
        if group is not None:
            conv_window, last_window = conv_halo(group, self, x, z, conv_window, state)
        window = torch.cat([conv_window, z.transpose(1, 2)], dim=2)   # [B, M, K-1+T]
        if z.shape[1]:
            z = F.silu(F.conv1d(window, self.conv.weight, self.conv.bias, groups=self.d_inner)).transpose(1, 2)
        else:   # no tokens (an empty context-parallel shard): nothing to convolve
            z = context_parallel.keep_in_graph(z, conv_window)
        v, prec, k, q = self.sensors(z)
        a_bar, p_bar = self.dynamics()
        y, _, filtered = kalman_filter(v, prec, k, q, a_bar, p_bar, initial_state=(state.lam, state.eta),
                                       output_final_state=return_state, backend=self.backend, validate=False,
                                       cp_group=group)
        y = (y + _wide(self.D) * _wide(z)) * F.silu(_wide(gate))
        out = self.out_proj(y.to(x.dtype))
        if not return_state:
            return out
        new_window = window[:, :, window.shape[2] - (self.d_conv - 1):] if group is None else last_window
        return out, KalmanLayerState(new_window, *filtered)

    def _check_state(self, state, batch: int, x: torch.Tensor) -> KalmanLayerState:
        """`state` (a KalmanLayerState, or a plain (conv, lam, eta) tuple) checked, as a KalmanLayerState."""
        if not isinstance(state, tuple) or len(state) != 3:
            raise ValueError("state: expected a KalmanLayerState (conv, lam, eta) returned by this layer")
        conv, lam, eta = state
        shapes = {"state.conv": (conv, (batch, self.d_inner, self.d_conv - 1)),
                  "state.lam": (lam, (batch, self.d_inner, self.d_state)),
                  "state.eta": (eta, (batch, self.d_inner, self.d_state))}
        for name, (t, shape) in shapes.items():
            if not isinstance(t, torch.Tensor) or tuple(t.shape) != shape:
                got = tuple(t.shape) if isinstance(t, torch.Tensor) else type(t).__name__
                raise ValueError(f"{name}: expected shape {shape} for batch {batch}, got {got}")
            if t.device != x.device:
                raise ValueError(f"{name}: on {t.device}, but x is on {x.device}")
        want = _wide(self.a_log).dtype
        for name, t in (("state.lam", lam), ("state.eta", eta)):
            if t.dtype != want:
                raise TypeError(f"{name}: dtype {t.dtype}, but this layer keeps its state in {want}; pass the "
                                f"state it returned (or convert the state with .to({want}))")
        return KalmanLayerState(conv, lam, eta)
