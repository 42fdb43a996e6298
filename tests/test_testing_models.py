"""The embedded test checkpoints and tokenizer: offline, cached, deterministic, vLLM-compatible."""

import json

import pytest
import torch

from kmesh_blend.testing import BENCH_LLAMA, TEST_MODELS, TINY_LLAMA, build_checkpoint
from kmesh_blend.testing.models import ModelSpec, _hf_config
from kmesh_blend.testing.tokenizer import get_tokenizer_dir

VLLM_CPU_HEAD_DIMS = {32, 64, 80, 96, 112, 128, 160, 192, 224, 256, 512}


@pytest.mark.parametrize("spec", [*TEST_MODELS, BENCH_LLAMA], ids=lambda s: s.name)
def test_checkpoint_config_matches_spec(spec: ModelSpec) -> None:
    path = build_checkpoint(spec)
    config = json.loads((path / "config.json").read_text())
    assert config["model_type"] == spec.model_type
    assert config["num_hidden_layers"] == spec.num_layers
    assert config["num_key_value_heads"] == spec.num_kv_heads
    head_dim = config.get("head_dim") or config["hidden_size"] // config["num_attention_heads"]
    assert head_dim == spec.head_dim and head_dim in VLLM_CPU_HEAD_DIMS
    assert (path / "tokenizer.json").exists()
    assert config["rope_parameters"]["rope_type"] == spec.rope_scaling.get("rope_type", "default")


def test_build_is_cached_and_keyed_on_the_spec() -> None:
    first = build_checkpoint(TINY_LLAMA)
    assert build_checkpoint(TINY_LLAMA) == first
    other = ModelSpec(**{**TINY_LLAMA.__dict__, "seed": 1})
    assert other.key() != TINY_LLAMA.key()


def test_weights_are_seeded(tmp_path: object, monkeypatch: pytest.MonkeyPatch) -> None:
    """Building the same spec in a fresh cache gives the same weights bit for bit."""
    from safetensors.torch import load_file

    first = load_file(str(build_checkpoint(TINY_LLAMA) / "model.safetensors"))
    monkeypatch.setenv("KMESH_CACHE_DIR", str(tmp_path))
    again = load_file(str(build_checkpoint(TINY_LLAMA) / "model.safetensors"))
    assert first.keys() == again.keys()
    assert all(torch.equal(first[name], again[name]) for name in first)


def test_tokenizer_round_trips_text() -> None:
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(get_tokenizer_dir(2048))
    text = "def f(x):\n    return {'ключ': x ** 2}  # ünïcode\n"
    ids = tok(text)["input_ids"]
    assert tok.decode(ids) == text
    assert len(ids) < len(text.encode())  # BPE merges: fewer tokens than bytes
    assert max(ids) < 2048 and tok.bos_token_id is not None


def test_bad_model_type_is_rejected() -> None:
    bad = ModelSpec(**{**TINY_LLAMA.__dict__, "model_type": "gpt2"})
    with pytest.raises(ValueError, match="model_type"):
        _hf_config(bad, None)
