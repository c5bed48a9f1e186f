"""Small sequence models for the synthetic tasks (`scanlang.tasks`), with any scanlang mixer inside.

`SequenceModel(vocab_size, d_model, num_layers, mixer="kalman")`: embedding, N pre-norm blocks
(RMSNorm -> mixer -> residual, RMSNorm -> SwiGLU -> residual), final norm, head. See `model.py`
for the mixer names and what else `mixer=` accepts.
"""
from .declared import ReferenceMixer, run_reference
from .mamba import MambaMixer, selective_scan
from .model import MIXERS, CausalSelfAttention, SequenceModel, SwiGLU, build_mixer, register_mixer

__all__ = ["SequenceModel", "MIXERS", "register_mixer", "build_mixer", "MambaMixer", "selective_scan",
           "CausalSelfAttention", "SwiGLU", "ReferenceMixer", "run_reference"]
