"""Test fixtures shipped with the package: tiny checkpoints and a local tokenizer (no network)."""

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

__all__ = [
    "BENCH_LLAMA",
    "TEST_MODELS",
    "TINY_LLAMA",
    "TINY_LLAMA_ROPE3",
    "TINY_QWEN2",
    "TINY_QWEN3",
    "ModelSpec",
    "build_checkpoint",
]
