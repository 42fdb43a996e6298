"""The committed small *trained* language model used to measure reuse quality.

Random-weight test models say nothing about quality: their next-token distributions are close to
uniform and do not depend on context the way a trained model's do. `quality_model_dir()` points
at a small Llama-architecture model trained by ``scripts/train_quality_model.py`` on the Python
standard library's sources (with the local byte-level BPE tokenizer) and committed with its
training log, so it loads offline on every machine:

    ReferenceModel.load(quality_model_dir(), torch.float32)
    AutoModelForCausalLM.from_pretrained(quality_model_dir())

The corpus split lives here so the training script and the quality harness agree on which files
the model never saw (`held_out_files`).
"""

from __future__ import annotations

import math
from pathlib import Path

from kmesh_blend.testing.tokenizer import corpus_files

__all__ = [
    "CONTEXT_GAIN",
    "CONTEXT_LENGTH",
    "HELD_OUT_EVERY",
    "VOCAB_SIZE",
    "held_out_files",
    "quality_model_dir",
    "training_files",
]

VOCAB_SIZE = 4096  # the local tokenizer's size the model is trained with
CONTEXT_LENGTH = 512  # tokens per training sequence: prompts should stay within it
# The context check the model must pass (training script and tests): a passage read a second time
# in one prompt is at least 8x less perplexing than its first read, nll(repeat) < nll(first) - this.
CONTEXT_GAIN = math.log(8.0)
HELD_OUT_EVERY = 10  # every 10th corpus file (sorted order) is never trained on

_MODEL_DIR = Path(__file__).resolve().parent / "quality_model"


def quality_model_dir() -> Path:
    """The committed checkpoint directory (``config.json``, ``model.safetensors``, tokenizer)."""
    if not (_MODEL_DIR / "config.json").exists():
        raise FileNotFoundError(
            f"{_MODEL_DIR} holds no checkpoint; build it with scripts/train_quality_model.py"
        )
    return _MODEL_DIR


def held_out_files() -> list[Path]:
    """Corpus files the quality model was not trained on (every `HELD_OUT_EVERY`-th, sorted)."""
    return corpus_files()[::HELD_OUT_EVERY]


def training_files() -> list[Path]:
    """The complement of `held_out_files`, in the same fixed order."""
    return [p for i, p in enumerate(corpus_files()) if i % HELD_OUT_EVERY]
