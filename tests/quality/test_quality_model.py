"""The committed trained quality model: loads offline, matches transformers, uses its context.

Tolerance (fp32 vs transformers): same math, different kernels; observed ≤ 1e-5, asserted 1e-4
as in tests/test_reference_model.py.
"""

import json
import math

import pytest
import torch
import torch.nn.functional as F

from kmesh_blend.models import ReferenceModel, prefill
from kmesh_blend.testing.quality import (
    CONTEXT_GAIN,
    CONTEXT_LENGTH,
    VOCAB_SIZE,
    held_out_files,
    quality_model_dir,
    training_files,
)

VLLM_CPU_HEAD_DIMS = {32, 64, 80, 96, 112, 128, 160, 192, 224, 256, 512}


@pytest.fixture(scope="module")
def model() -> ReferenceModel:
    return ReferenceModel.load(quality_model_dir(), torch.float32)


@pytest.fixture(scope="module")
def held_out_ids() -> torch.Tensor:
    """Token ids [N] of a held-out stdlib file, tokenized by the model's own tokenizer."""
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(str(quality_model_dir() / "tokenizer.json"))
    for path in held_out_files():
        ids = tok.encode(path.read_text(encoding="utf-8", errors="replace")).ids
        if len(ids) >= 600:
            return torch.tensor(ids, dtype=torch.int64)
    raise AssertionError("no held-out file of 600 tokens")


def test_checkpoint_is_small_and_vllm_compatible() -> None:
    path = quality_model_dir()
    config = json.loads((path / "config.json").read_text())
    assert config["model_type"] == "llama" and config["vocab_size"] == VOCAB_SIZE
    assert config["head_dim"] in VLLM_CPU_HEAD_DIMS
    assert config["max_position_embeddings"] == CONTEXT_LENGTH
    assert (path / "model.safetensors").stat().st_size <= 25 * 2**20
    assert (path / "tokenizer.json").exists() and (path / "train_log.txt").exists()


def test_held_out_split_is_disjoint() -> None:
    held, train = held_out_files(), training_files()
    assert held and train and not set(held) & set(train)


def test_matches_transformers_fp32(model: ReferenceModel, held_out_ids: torch.Tensor) -> None:
    from transformers import AutoModelForCausalLM

    ids = held_out_ids[:160]
    hf = AutoModelForCausalLM.from_pretrained(quality_model_dir(), dtype=torch.float32)
    with torch.no_grad():
        expected = hf(ids[None]).logits[0].float()
    ours = prefill(model, ids).logits
    torch.testing.assert_close(ours, expected, rtol=0, atol=1e-4)
    assert torch.equal(ours.argmax(-1), expected.argmax(-1))


def test_it_is_trained(model: ReferenceModel, held_out_ids: torch.Tensor) -> None:
    """Held-out code is far more predictable than uniform (ln 4096 ≈ 8.3 nats)."""
    ids = held_out_ids[:256]
    nll = F.cross_entropy(prefill(model, ids).logits[:-1], ids[1:])
    assert float(nll) < 0.7 * math.log(VOCAB_SIZE)


def test_it_reads_its_context(model: ReferenceModel, held_out_ids: torch.Tensor) -> None:
    """A held-out passage read a second time in the same prompt is at least 8x less perplexing
    than its first read: the model copies from its context, the behaviour that stale reused KV
    can break (the training log's check, on other passages)."""
    n = 192
    for start in (0, 300):
        passage = held_out_ids[start : start + n]
        seq = torch.cat([passage, passage])
        nll = F.cross_entropy(prefill(model, seq).logits[:-1], seq[1:], reduction="none")
        first, second = float(nll[: n - 1].mean()), float(nll[n:].mean())
        print(f"passage at {start}: first read {first:.3f}, repeat {second:.3f} nats/token")
        assert second < first - CONTEXT_GAIN, (start, first, second)
