"""RoPE: the rotation every re-positioning relies on, checked against transformers' own tables."""

import pytest
import torch

from kmesh_blend.models.rope import RopeConfig, RotaryEmbedding, rotate_half

LLAMA3 = {
    "rope_type": "llama3",
    "rope_theta": 500000.0,
    "factor": 8.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_max_position_embeddings": 256,
}


def _rope(params: dict[str, object], head_dim: int = 32) -> RotaryEmbedding:
    return RotaryEmbedding(RopeConfig.from_hf_config({"rope_parameters": params}, head_dim))


@pytest.mark.parametrize("params", [{"rope_type": "default", "rope_theta": 10000.0}, LLAMA3])
def test_inv_freq_matches_transformers(params: dict[str, object]) -> None:
    from transformers import LlamaConfig
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    config = LlamaConfig(
        head_dim=32, hidden_size=128, num_attention_heads=4, rope_parameters=params
    )
    if params["rope_type"] == "default":
        from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding

        expected, scaling = LlamaRotaryEmbedding.compute_default_rope_parameters(config)
    else:
        expected, scaling = ROPE_INIT_FUNCTIONS["llama3"](config, "cpu")
    assert scaling == 1.0
    torch.testing.assert_close(_rope(params).inv_freq, expected.float(), rtol=0, atol=0)


def test_llama3_scaling_changes_low_frequencies_only() -> None:
    plain = _rope({"rope_type": "default", "rope_theta": 500000.0}).inv_freq
    scaled = _rope(LLAMA3).inv_freq
    assert torch.equal(plain[:2], scaled[:2])  # short wavelengths untouched
    assert torch.allclose(scaled[-1], plain[-1] / 8.0)  # longest wavelength slowed by `factor`


@pytest.mark.parametrize("params", [{"rope_type": "default", "rope_theta": 10000.0}, LLAMA3])
def test_rotations_compose_and_preserve_norm(params: dict[str, object]) -> None:
    rope = _rope(params)
    x = torch.randn(7, 3, 32, dtype=torch.float64).float()
    p1 = torch.tensor([0, 1, 5, 17, 100, 300, 1000])
    p2 = torch.tensor([3, 0, 250, 9, 1, 700, 24])
    twice = rope.apply(rope.apply(x, p1), p2)
    once = rope.apply(x, p1 + p2)
    torch.testing.assert_close(twice, once, rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(once.norm(dim=-1), x.norm(dim=-1), rtol=1e-5, atol=1e-5)
    # Position 0 is the identity.
    assert torch.equal(rope.apply(x, torch.zeros(7, dtype=torch.int64)), x)


def test_rotate_half() -> None:
    x = torch.arange(4.0)
    assert rotate_half(x).tolist() == [-2.0, -3.0, 0.0, 1.0]


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"head_dim": 31}, "even"),
        ({"head_dim": 32, "rope_type": "yarn"}, "rope_type"),
    ],
)
def test_bad_rope_config(kwargs: dict[str, object], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        RopeConfig(**kwargs)  # type: ignore[arg-type]


def test_apply_checks_shapes() -> None:
    rope = _rope({"rope_type": "default"})
    with pytest.raises(ValueError, match="positions"):
        rope.apply(torch.zeros(4, 2, 32), torch.arange(3))
    with pytest.raises(ValueError, match="tokens, heads"):
        rope.apply(torch.zeros(4, 32), torch.arange(4))
