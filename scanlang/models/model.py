"""The small pre-norm sequence model of the tasks, with the token mixer chosen by name or given.

    x = embed(tokens)
    N x [ x = x + mixer(RMSNorm(x)) ;  x = x + SwiGLU(RMSNorm(x)) ]
    logits = head(RMSNorm(x))

Mixers by name (`MIXERS`; add one with `register_mixer(name, factory)`, factory(d_model, num_heads,
**mixer_options) -> an nn.Module mapping [B, T, d_model] -> [B, T, d_model]; `mixer_options` are
passed through, e.g. `d_state` for kalman and mamba):

- "kalman": `KalmanLinearAttention` (scanlang.recipes.kalman)
- "kaczmarz": `KaczmarzLinearAttention` (scanlang.recipes.kaczmarz)
- "gdn": Gated DeltaNet, the same layer in mode "gdn" (`delta_rule` with L2-normalised keys)
- "mamba": `MambaMixer`, whose selective scan is an `sl.mixer` declared over `sl.Affine`
- "attention": causal softmax attention with rotary positions (`scaled_dot_product_attention`)
- "gla": `GatedLinearAttention` (scanlang.recipes.linear; fla's parametrisation around `gla`)
- "kda": `KimiDeltaAttention` (scanlang.recipes.linear; around `kda`), heads of d_model / num_heads

The scanlang mixers run the generated Triton kernels on CUDA and the reference backend elsewhere
("gla" and "kda" run the members' chunked PyTorch reference unless `backend=` says otherwise).
`mixer=` also takes an `nn.Module` (deep-copied per layer), a factory `f(d_model) -> nn.Module`,
or an `sl.mixer` with the selective-scan inputs (x, dt, B, C, A -> y), which becomes the scan of a
`MambaMixer` block.

>>> import torch
>>> model = SequenceModel(vocab_size=6, d_model=16, num_layers=2, mixer="attention", num_heads=2)
>>> model(torch.randint(0, 6, (3, 7))).shape
torch.Size([3, 7, 6])
"""
from __future__ import annotations

import copy
import math
from typing import Callable

import torch
import torch.nn.functional as F
from torch import nn

from scanlang.mixer import Mixer
from scanlang.recipes.kaczmarz import KaczmarzLinearAttention
from scanlang.recipes.kalman import KalmanLinearAttention
from scanlang.recipes.linear import GatedLinearAttention, KimiDeltaAttention

from .mamba import MambaMixer


class SwiGLU(nn.Module):
    """W_down (SiLU(W_gate x) * W_up x), hidden width about 8/3 d_model (rounded up to 8)."""

    def __init__(self, d_model: int, hidden: int | None = None):
        super().__init__()
        hidden = hidden or 8 * math.ceil(8 * d_model / 3 / 8)
        self.gate_up = nn.Linear(d_model, 2 * hidden, bias=False)
        self.down = nn.Linear(hidden, d_model, bias=False)

    def forward(self, x):
        gate, up = self.gate_up(x).chunk(2, dim=-1)
        return self.down(F.silu(gate) * up)


class CausalSelfAttention(nn.Module):
    """Multi-head causal softmax attention with rotary position embeddings, through SDPA."""

    def __init__(self, d_model: int, num_heads: int, rope_base: float = 10000.0):
        super().__init__()
        if d_model % num_heads or (d_model // num_heads) % 2:
            raise ValueError(f"num_heads: {num_heads} must divide d_model = {d_model} into heads of even size")
        self.num_heads, self.head_dim = num_heads, d_model // num_heads
        self.qkv = nn.Linear(d_model, 3 * d_model, bias=False)
        self.out = nn.Linear(d_model, d_model, bias=False)
        half = self.head_dim // 2
        self.register_buffer("inv_freq", rope_base ** (-torch.arange(half, dtype=torch.float32) / half),
                             persistent=False)

    def _rotate(self, x):
        t = torch.arange(x.shape[2], device=x.device, dtype=torch.float32)
        angle = t[:, None] * self.inv_freq[None, :]
        cos, sin = angle.cos().to(x.dtype), angle.sin().to(x.dtype)
        x1, x2 = x.chunk(2, dim=-1)
        return torch.cat([x1 * cos - x2 * sin, x1 * sin + x2 * cos], dim=-1)

    def forward(self, x):
        B, T, D = x.shape
        q, k, v = self.qkv(x).view(B, T, 3, self.num_heads, self.head_dim).permute(2, 0, 3, 1, 4)
        y = F.scaled_dot_product_attention(self._rotate(q), self._rotate(k), v, is_causal=True)
        return self.out(y.transpose(1, 2).reshape(B, T, D))


def _kalman(d_model: int, num_heads: int, **options) -> nn.Module:
    return KalmanLinearAttention(d_model, **options)


def _delta(mode: str):
    def factory(d_model: int, num_heads: int, **options) -> nn.Module:
        return KaczmarzLinearAttention(d_model, num_heads, mode=mode, **options)
    return factory


def _gla(d_model: int, num_heads: int, **options) -> nn.Module:
    return GatedLinearAttention(d_model, num_heads, **options)


def _kda(d_model: int, num_heads: int, **options) -> nn.Module:
    if d_model % num_heads and "head_dim" not in options:
        raise ValueError(f"num_heads: {num_heads} must divide d_model = {d_model} (or give head_dim)")
    return KimiDeltaAttention(d_model, num_heads, **{"head_dim": d_model // num_heads, **options})


MIXERS: dict[str, Callable[[int, int], nn.Module]] = {
    "kalman": _kalman,
    "kaczmarz": _delta("kaczmarz"),
    "gdn": _delta("gdn"),
    "gla": _gla,
    "kda": _kda,
    "mamba": lambda d_model, num_heads, **options: MambaMixer(d_model, **options),
    "attention": lambda d_model, num_heads, **options: CausalSelfAttention(d_model, num_heads, **options),
}


def register_mixer(name: str, factory: Callable[[int, int], nn.Module]) -> None:
    """Make `factory(d_model, num_heads)` available as `mixer=name` (and `scanlang train --mixer name`)."""
    if not isinstance(name, str) or not name:
        raise TypeError(f"name: expected a non-empty string, got {name!r}")
    if not callable(factory):
        raise TypeError(f"factory: expected a callable (d_model, num_heads) -> nn.Module, got {factory!r}")
    MIXERS[name] = factory


def build_mixer(mixer, d_model: int, num_heads: int = 4, **options) -> nn.Module:
    """One mixer layer from a name (built with `options`), an nn.Module (copied), a factory
    f(d_model), or an sl.mixer."""
    if isinstance(mixer, str):
        if mixer not in MIXERS:
            raise ValueError(f"mixer: expected one of {tuple(MIXERS)}, got {mixer!r}")
        try:
            return MIXERS[mixer](d_model, num_heads, **options)
        except TypeError as exc:
            raise ValueError(f"mixer_options: {sorted(options)} do not fit mixer {mixer!r}: {exc}") from None
    if isinstance(mixer, nn.Module):
        return copy.deepcopy(mixer)
    if isinstance(mixer, Mixer):
        return MambaMixer(d_model, scan=mixer)
    if callable(mixer):
        layer = mixer(d_model)
        if not isinstance(layer, nn.Module):
            raise TypeError(f"mixer: the factory returned {type(layer).__name__}, expected an nn.Module")
        return layer
    raise TypeError(f"mixer: expected a name, an nn.Module, a factory or an sl.mixer, got {type(mixer).__name__}")


class Block(nn.Module):
    def __init__(self, mixer: nn.Module, d_model: int):
        super().__init__()
        self.mixer_norm, self.mixer = nn.RMSNorm(d_model), mixer
        self.mlp_norm, self.mlp = nn.RMSNorm(d_model), SwiGLU(d_model)

    def forward(self, x):
        x = x + self.mixer(self.mixer_norm(x))
        return x + self.mlp(self.mlp_norm(x))


class SequenceModel(nn.Module):
    """Token ids [B, T] -> logits [B, T, vocab_size] (see the module docstring)."""

    def __init__(self, vocab_size: int, d_model: int = 64, num_layers: int = 2, mixer="kalman", num_heads: int = 4,
                 mixer_options: dict | None = None):
        super().__init__()
        for name, value in (("vocab_size", vocab_size), ("d_model", d_model), ("num_layers", num_layers),
                            ("num_heads", num_heads)):
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{name}: expected a positive int, got {value!r}")
        self.vocab_size, self.d_model, self.num_layers = vocab_size, d_model, num_layers
        self.embed = nn.Embedding(vocab_size, d_model)
        self.blocks = nn.ModuleList(Block(build_mixer(mixer, d_model, num_heads, **(mixer_options or {})), d_model) for _ in range(num_layers))
        self.norm = nn.RMSNorm(d_model)
        self.head = nn.Linear(d_model, vocab_size, bias=False)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        if not isinstance(tokens, torch.Tensor) or tokens.dim() != 2 or tokens.dtype != torch.long:
            got = f"{tuple(tokens.shape)} {tokens.dtype}" if isinstance(tokens, torch.Tensor) else type(tokens).__name__
            raise ValueError(f"tokens: expected an int64 tensor [B, T], got {got}")
        x = self.embed(tokens)
        for block in self.blocks:
            x = block(x)
        return self.head(self.norm(x))
