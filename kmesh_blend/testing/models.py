"""Small random-weight checkpoints for tests, examples and benchmarks, built on the fly.

Each `ModelSpec` becomes a Hugging Face checkpoint directory (``save_pretrained``, safetensors,
plus the local tokenizer) by transformers' own model classes and initialisation under a fixed
seed, and cached under `cache_dir()`; vLLM and `ReferenceModel` both load that directory.

Every spec has head_dim ≥ 32 (vLLM's CPU attention rejects smaller heads). The weights use a wider
init than transformers' default (`init_std`) so greedy decoding has clear margins between the top
tokens: random near-uniform logits would make "same greedy tokens" a coin toss between backends.
"""

from __future__ import annotations

import hashlib
import json
import os
import tempfile
from dataclasses import asdict, dataclass, field
from pathlib import Path

from kmesh_blend.testing.tokenizer import cache_dir, get_tokenizer_dir

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

_FORMAT = 1  # bump when the build recipe changes, so old caches are not reused


@dataclass(frozen=True)
class ModelSpec:
    """Architecture of a test checkpoint (fields map onto the transformers config)."""

    name: str
    model_type: str  # "llama" | "qwen2" | "qwen3"
    num_layers: int
    hidden_size: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate_size: int
    vocab_size: int
    max_position: int = 4096
    rope_theta: float = 10000.0
    rope_scaling: dict[str, float | str] = field(default_factory=dict)  # e.g. llama3 parameters
    init_std: float = 0.05
    seed: int = 0

    def key(self) -> str:
        blob = json.dumps({"format": _FORMAT, **asdict(self)}, sort_keys=True)
        return hashlib.sha256(blob.encode()).hexdigest()[:12]


TINY_LLAMA = ModelSpec("tiny-llama", "llama", 4, 128, 4, 4, 32, 256, 2048)
TINY_LLAMA_ROPE3 = ModelSpec(
    "tiny-llama-rope3",
    "llama",
    4,
    128,
    4,
    4,
    32,
    256,
    2048,
    rope_theta=500000.0,
    # Small original context so the scaling changes channels at the positions tests use.
    rope_scaling={
        "rope_type": "llama3",
        "factor": 8.0,
        "low_freq_factor": 1.0,
        "high_freq_factor": 4.0,
        "original_max_position_embeddings": 256,
    },
)
TINY_QWEN2 = ModelSpec("tiny-qwen2", "qwen2", 4, 128, 4, 2, 32, 256, 2048)
TINY_QWEN3 = ModelSpec("tiny-qwen3", "qwen3", 4, 128, 4, 2, 32, 256, 2048)
# Depth of a real model, narrow width: selective recomputation pays per layer.
BENCH_LLAMA = ModelSpec("bench-llama", "llama", 24, 256, 4, 2, 64, 704, 8192, init_std=0.02)

TEST_MODELS = (TINY_LLAMA, TINY_LLAMA_ROPE3, TINY_QWEN2, TINY_QWEN3)


def build_checkpoint(spec: ModelSpec) -> Path:
    """Build (once) and return the checkpoint directory of ``spec``; safe across processes."""
    target = cache_dir() / "models" / f"{spec.name}-{spec.key()}"
    if (target / "config.json").exists():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=target.parent) as tmp:
        _build(spec, Path(tmp))
        try:
            os.rename(tmp, target)
        except OSError:  # built concurrently elsewhere: keep theirs
            if not (target / "config.json").exists():
                raise
        else:
            os.makedirs(tmp)  # recreate the moved path so TemporaryDirectory can remove it
    return target


def _build(spec: ModelSpec, out: Path) -> None:
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(get_tokenizer_dir(spec.vocab_size))
    config = _hf_config(spec, tokenizer)
    torch.manual_seed(spec.seed)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    model.save_pretrained(out)
    tokenizer.save_pretrained(out)


def _hf_config(spec: ModelSpec, tokenizer):  # type: ignore[no-untyped-def]
    from transformers import LlamaConfig, Qwen2Config, Qwen3Config

    classes = {"llama": LlamaConfig, "qwen2": Qwen2Config, "qwen3": Qwen3Config}
    if spec.model_type not in classes:
        raise ValueError(f"model_type={spec.model_type!r}; valid: {sorted(classes)}")
    rope: dict[str, object] = {"rope_type": "default", "rope_theta": spec.rope_theta}
    rope.update(spec.rope_scaling)
    kwargs = dict(
        vocab_size=spec.vocab_size,
        hidden_size=spec.hidden_size,
        intermediate_size=spec.intermediate_size,
        num_hidden_layers=spec.num_layers,
        num_attention_heads=spec.num_heads,
        num_key_value_heads=spec.num_kv_heads,
        max_position_embeddings=spec.max_position,
        initializer_range=spec.init_std,
        rope_parameters=rope,
        tie_word_embeddings=False,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
    )
    if spec.model_type != "qwen2":  # Qwen2 derives head_dim from hidden_size / heads
        kwargs["head_dim"] = spec.head_dim
    elif spec.hidden_size // spec.num_heads != spec.head_dim:
        raise ValueError(f"{spec.name}: qwen2 needs hidden_size / num_heads == head_dim")
    return classes[spec.model_type](**kwargs)
