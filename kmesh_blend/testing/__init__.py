"""Test fixtures of the repository (not in the wheel): tiny checkpoints, a local tokenizer, a
trained quality model, a real pretrained model converted from a local file (no network), and
helpers that start vLLM engines for tests, examples and benchmarks."""

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
