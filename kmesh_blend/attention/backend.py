"""Backend choice for ``cascade_attention(backend="auto")``: self-checked once per device/dtype.

Candidates, in order: FlashInfer (CUDA, fp16/bf16, when importable), Triton (CUDA), torch (always;
the only candidate on the CPU, where Triton runs only in its slow interpreter). Each candidate runs
a small cascade problem (two segments, three siblings, GQA, replaced rows, offset 0 and a segment
at the very end) against the materialized reference; the first that matches is used. One log line
says which backend runs and why the others were skipped — doubtful kernels never serve results.
"""

from __future__ import annotations

import logging
from functools import cache
from typing import Literal

import torch

__all__ = ["chosen_backend", "run_self_check"]

log = logging.getLogger("kmesh_blend.attention")

Concrete = Literal["torch", "triton", "flashinfer"]
_TOLERANCE = {torch.float32: 1e-4, torch.float16: 1e-2, torch.bfloat16: 4e-2}


@cache
def chosen_backend(device: torch.device, dtype: torch.dtype) -> Concrete:
    """The backend ``"auto"`` uses for tensors on ``device`` in ``dtype`` (checked once each)."""
    candidates: list[Concrete] = []
    if device.type == "cuda":
        if dtype in (torch.float16, torch.bfloat16) and _flashinfer_importable():
            candidates.append("flashinfer")
        candidates.append("triton")
    skipped = []
    for name in candidates:
        failure = run_self_check(name, device, dtype)
        if failure is None:
            log.info("kmesh cascade attention: %s backend on %s (%s)", name, device, dtype)
            return name
        skipped.append(f"{name}: {failure}")
    why = "; ".join(skipped) or f"no kernel backend for {device.type}"
    log.info("kmesh cascade attention: torch backend on %s (%s) [%s]", device, dtype, why)
    return "torch"


def run_self_check(
    backend: Concrete, device: torch.device | str, dtype: torch.dtype = torch.float32
) -> str | None:
    """Run ``backend`` on a small cascade problem against the reference; None, or why it failed."""
    from kmesh_blend.attention.cascade import SharedSegment, Sibling, cascade_attention
    from kmesh_blend.attention.reference import materialized_attention, materialized_kv

    device = torch.device(device)
    gen = torch.Generator().manual_seed(0)
    heads, kv_heads, dim, seg_len = 4, 2, 32, 40
    inv_freq = 1.0 / 10000.0 ** (torch.arange(0, dim, 2, dtype=torch.float32) / dim)

    def rand(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=gen).to(dtype).to(device)

    segs = [
        SharedSegment(rand(seg_len, kv_heads, dim), rand(seg_len, kv_heads, dim),
                      torch.arange(p, p + seg_len, device=device))
        for p in (0, 7)
    ]  # fmt: skip
    sibs, layouts = [], [(0, None), (3, 50), (60, 10)]  # offsets of segment 0 and 1
    for o0, o1 in layouts:
        total = 1 + max(o0 + seg_len, (o1 or 0) + seg_len)
        rep = torch.rand(seg_len, generator=gen) < 0.2
        own = torch.ones(total, dtype=torch.bool)
        own[o0 : o0 + seg_len] = rep
        if o1 is not None:
            own[o1 : o1 + seg_len] = False
        kv_pos = own.nonzero().squeeze(1).to(device)
        q_pos = torch.tensor([0, o0 + 5, total - 2, total - 1], device=device)
        sibs.append(
            Sibling(rand(4, heads, dim), q_pos, (o0, o1), (rep.to(device), None),
                    rand(kv_pos.numel(), kv_heads, dim), rand(kv_pos.numel(), kv_heads, dim),
                    kv_pos)
        )  # fmt: skip
    try:
        got = cascade_attention(sibs, segs, dim**-0.5, inv_freq.to(device), backend=backend)
        for sib, out in zip(sibs, got, strict=True):
            k, v, pos = materialized_kv(
                [(s.k, s.v, s.positions) for s in segs], sib.offsets, sib.replaced,
                (sib.k, sib.v, sib.kv_positions), inv_freq.to(device),
            )  # fmt: skip
            want, _ = materialized_attention(sib.q, sib.q_positions, k, v, pos, dim**-0.5)
            err = float((out.float() - want).abs().max())
            if not err <= _TOLERANCE[dtype]:
                return f"differs from the reference by {err:.3g}"
    except Exception as exc:  # any import/launch/compile problem: do not trust the backend
        return f"{type(exc).__name__}: {exc}"
    return None


def _flashinfer_importable() -> bool:
    try:
        import flashinfer  # noqa: F401
    except Exception:
        return False
    return True
