"""The blend's GEMMs on vLLM's oneDNN GEMM: chosen after a probe, exact within the worker."""

import pytest
import torch
import torch.nn.functional as F

import kmesh_blend.vllm.linear as linear_module
from kmesh_blend.blend import BlendOptions, blend_group
from kmesh_blend.models import ReferenceModel, prefill
from kmesh_blend.models.reference import torch_linear
from kmesh_blend.testing import TINY_QWEN2, build_checkpoint
from tests.blend.prompts import family


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_onednn_is_picked_and_close_to_f_linear(dtype: torch.dtype) -> None:
    factory = linear_module.pick_linear(dtype)
    assert factory is linear_module._onednn_factory  # this vLLM build has the oneDNN GEMM
    gen = torch.Generator().manual_seed(1)
    w = (torch.randn(300, 256, generator=gen) * 0.05).to(dtype)
    b = torch.randn(300, generator=gen).to(dtype)
    x = torch.randn(404, 256, generator=gen).to(dtype)
    got, want = factory(w, b)(x), F.linear(x, w, b)
    err = float((got.float() - want.float()).abs().max())
    print(f"{dtype}: max |onednn − F.linear| = {err:.3g}")
    assert err <= (1e-4 if dtype == torch.float32 else 2e-2) * float(want.abs().max())


def test_a_failed_probe_keeps_f_linear(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(linear_module, "_probe", lambda factory, dtype: "forced mismatch")
    assert linear_module.pick_linear(torch.bfloat16) is torch_linear


def test_blend_stays_exact_on_onednn() -> None:
    """Ratio 1.0 equals a full prefill bit for bit when both run on the oneDNN GEMMs (Qwen2:
    the q/k/v biases go through the fused bias path too)."""
    path = build_checkpoint(TINY_QWEN2)
    model = ReferenceModel.load(path, torch.bfloat16, linear_module.pick_linear(torch.bfloat16))
    requests, source = family(model, "middle", 2)
    results = blend_group(model, requests, source, BlendOptions(recompute_ratio=1.0))
    for req, res in zip(requests, results, strict=True):
        full = prefill(model, req.token_ids, last_only=True)
        assert torch.equal(res.logits, full.logits)
        assert all(torch.equal(a, b) for a, b in zip(res.keys, full.keys, strict=True))
