"""Test fixtures shipped with the package: tiny checkpoints, a local tokenizer and a real pretrained
model converted from a local file (no network)."""

from kmesh_blend.testing.models import (
    BENCH_LLAMA,
    TEST_MODELS,
    TINY_LLAMA,
    TINY_LLAMA_ROPE3,
    TINY_QWEN2,
    TINY_QWEN3,
    ModelSpec,
    build_checkpoint,
)
from kmesh_blend.testing.smollm2 import SMOLLM2, smollm2_checkpoint

__all__ = [
    "BENCH_LLAMA",
    "SMOLLM2",
    "TEST_MODELS",
    "TINY_LLAMA",
    "TINY_LLAMA_ROPE3",
    "TINY_QWEN2",
    "TINY_QWEN3",
    "ModelSpec",
    "build_checkpoint",
    "smollm2_checkpoint",
]
