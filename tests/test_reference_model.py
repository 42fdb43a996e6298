"""The pure-torch reference model against transformers on the same checkpoints.

Tolerances: fp32 — different kernels, same math (observed ≤ 4e-6). bf16 — transformers attends
in bf16 while we attend in fp32, so results differ by a few bf16 ulps at magnitudes ≈ 3
(observed ≤ 0.05; one ulp at 2–4 is 0.0156).
"""

import pytest
import torch

from kmesh_blend.models import LayerwiseModel, ReferenceModel, causal_mask, prefill
from kmesh_blend.testing import TEST_MODELS, ModelSpec, build_checkpoint

TOLERANCE = {torch.float32: 1e-4, torch.bfloat16: 0.125}
DTYPES = [torch.float32, torch.bfloat16]


def _prompt(n: int, vocab: int, seed: int = 1) -> torch.Tensor:
    return torch.randint(3, vocab, (n,), generator=torch.Generator().manual_seed(seed))


@pytest.fixture(scope="module", params=TEST_MODELS, ids=lambda s: s.name)
def spec(request: pytest.FixtureRequest) -> ModelSpec:
    return request.param  # type: ignore[no-any-return]


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_matches_transformers(spec: ModelSpec, dtype: torch.dtype) -> None:
    from transformers import AutoModelForCausalLM

    path = build_checkpoint(spec)
    ids = _prompt(160, spec.vocab_size)
    hf = AutoModelForCausalLM.from_pretrained(path, dtype=dtype)
    with torch.no_grad():
        out = hf(ids[None], use_cache=True)
    ours = prefill(ReferenceModel.load(path, dtype), ids)
    atol = TOLERANCE[dtype]

    torch.testing.assert_close(ours.logits, out.logits[0].float(), rtol=0, atol=atol)
    cache = out.past_key_values
    assert len(ours.keys) == spec.num_layers
    for layer in range(spec.num_layers):
        hf_k = cache.layers[layer].keys[0].transpose(0, 1)  # [Hkv, T, D] -> [T, Hkv, D]
        hf_v = cache.layers[layer].values[0].transpose(0, 1)
        assert ours.keys[layer].dtype == dtype
        torch.testing.assert_close(ours.keys[layer], hf_k, rtol=0, atol=atol)
        torch.testing.assert_close(ours.values[layer], hf_v, rtol=0, atol=atol)
    agree = (ours.logits.argmax(-1) == out.logits[0].argmax(-1)).float().mean()
    assert agree >= (1.0 if dtype == torch.float32 else 0.9)


def test_shapes_and_protocol(spec: ModelSpec) -> None:
    model = ReferenceModel.load(build_checkpoint(spec))
    assert isinstance(model, LayerwiseModel)
    s = model.shape
    assert (s.num_layers, s.num_heads, s.num_kv_heads, s.head_dim) == (
        spec.num_layers,
        spec.num_heads,
        spec.num_kv_heads,
        spec.head_dim,
    )
    ids = _prompt(9, spec.vocab_size)
    h = model.embed(ids)
    assert h.shape == (9, spec.hidden_size)
    q, k, v = model.project_qkv(0, h)
    assert q.shape == (9, spec.num_heads, spec.head_dim)
    assert k.shape == v.shape == (9, spec.num_kv_heads, spec.head_dim)
    result = prefill(model, ids, last_only=True)
    assert result.logits.shape == (1, spec.vocab_size) and result.logits.dtype == torch.float32


def test_explicit_mask_on_a_token_subset_matches_full_prefill() -> None:
    """The layerwise steps compose: the last token computed alone over the stored KV of the others
    gives the full prefill's scores (fp32, tolerance: row-count dependent GEMM rounding)."""
    model = ReferenceModel.load(build_checkpoint(TEST_MODELS[0]))
    ids = _prompt(40, model.shape.vocab_size)
    full = prefill(model, ids)
    positions = torch.arange(40)
    hidden = model.embed(ids[-1:])
    for layer in range(model.shape.num_layers):
        q, k, v = model.project_qkv(layer, hidden)
        q = model.rope.apply(q, positions[-1:])
        k = torch.cat([full.keys[layer][:-1], model.rope.apply(k, positions[-1:])])
        v = torch.cat([full.values[layer][:-1], v])
        attn = model.attend(q, k, v, causal_mask(positions[-1:], positions))
        hidden = model.finish_layer(layer, hidden, attn)
    torch.testing.assert_close(model.logits(hidden)[0], full.logits[-1], rtol=0, atol=1e-4)


def test_query_with_no_visible_key_gets_zeros() -> None:
    model = ReferenceModel.load(build_checkpoint(TEST_MODELS[0]))
    q = torch.randn(2, model.shape.num_heads, model.shape.head_dim)
    k = torch.randn(3, model.shape.num_kv_heads, model.shape.head_dim)
    mask = torch.tensor([[False, False, False], [True, False, False]])
    out = model.attend(q, k, k, mask)
    assert torch.equal(out[0], torch.zeros_like(out[0]))
    assert not torch.isnan(out).any()
    torch.testing.assert_close(
        out[1], k[0].repeat_interleave(model.shape.num_heads // k.shape[1], 0)
    )


def test_rejects_unsupported_architecture(tmp_path: object) -> None:
    with pytest.raises(ValueError, match="model_type"):
        ReferenceModel({"model_type": "gpt2"}, {}, torch.float32)
