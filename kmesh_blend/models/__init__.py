"""Layerwise model adapters: the interface the blend drives, and a pure-torch reference."""

from kmesh_blend.models.layerwise import (
    QKV,
    LayerwiseModel,
    ModelShape,
    PrefillResult,
    causal_mask,
    greedy_generate,
    prefill,
)
from kmesh_blend.models.reference import ReferenceModel
from kmesh_blend.models.rope import RopeConfig, RotaryEmbedding

__all__ = [
    "QKV",
    "LayerwiseModel",
    "ModelShape",
    "PrefillResult",
    "ReferenceModel",
    "RopeConfig",
    "RotaryEmbedding",
    "causal_mask",
    "greedy_generate",
    "prefill",
]
