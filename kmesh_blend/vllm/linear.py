"""The blend's GEMMs on vLLM's own CPU GEMM (oneDNN with a prepared weight), when it checks out.

vLLM runs its CPU linear layers through ``vllm._custom_ops.onednn_mm`` with a handler built once
per weight; on the bench model that is ≈25% faster than ``F.linear`` for the blend's shapes, and
it is what stock vLLM's own forward uses. `pick_linear` returns a `LinearFactory` over it after a
start-up probe against ``F.linear`` (fp32 within 1e-4, bf16/fp16 within 2e-2 of the output's
scale); any error or mismatch logs one line and keeps ``F.linear``. Prefill and blend inside the
worker use the same factory, so the blend's exactness guarantees are unchanged.
"""

from __future__ import annotations

import logging
from collections.abc import Callable

import torch
import torch.nn.functional as F

from kmesh_blend.models.reference import LinearFactory, torch_linear

__all__ = ["pick_linear"]

log = logging.getLogger("vllm.kmesh_blend")


def pick_linear(dtype: torch.dtype) -> LinearFactory:
    """vLLM's oneDNN GEMM as a `LinearFactory` for ``dtype`` if its probe passes, else
    `torch_linear` (the reason is logged once)."""
    try:
        from vllm import _custom_ops as ops

        if not getattr(ops, "_supports_onednn", False):
            raise RuntimeError("this vLLM build has no oneDNN GEMM")
        reason = _probe(_onednn_factory, dtype)
    except Exception as exc:  # any failure keeps F.linear
        reason = f"{type(exc).__name__}: {exc}"
    if reason is not None:
        log.info("kmesh: blend GEMMs use torch F.linear (%s)", reason)
        return torch_linear
    log.info("kmesh: blend GEMMs use vLLM's oneDNN GEMM (probe passed)")
    return _onednn_factory


def _onednn_factory(
    weight: torch.Tensor, bias: torch.Tensor | None
) -> Callable[[torch.Tensor], torch.Tensor]:
    from vllm import _custom_ops as ops

    handler = ops.create_onednn_mm(weight.t(), 32)  # prepares its own copy of the weight
    return lambda x: ops.onednn_mm(handler, x.contiguous(), bias)


def _probe(factory: LinearFactory, dtype: torch.dtype) -> str | None:
    """Compare ``factory`` with ``F.linear`` on a small seeded input; None when it agrees."""
    gen = torch.Generator().manual_seed(0)
    weight = (torch.randn(96, 64, generator=gen) * 0.1).to(dtype)
    bias = torch.randn(96, generator=gen).to(dtype)
    x = torch.randn(37, 64, generator=gen).to(dtype)
    for b in (None, bias):
        got = factory(weight, b)(x)
        want = F.linear(x, weight, b)
        if got.shape != want.shape or got.dtype != want.dtype:
            return f"probe gave {tuple(got.shape)} {got.dtype}, want {tuple(want.shape)} {dtype}"
        tol = (1e-4 if dtype == torch.float32 else 2e-2) * float(want.abs().max())
        err = float((got.float() - want.float()).abs().max())
        if not err <= tol:
            return f"probe differs from F.linear by {err:.3g} (tolerance {tol:.3g})"
    return None
