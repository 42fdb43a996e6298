"""Putting the cascade decode path into this engine's attention layers, after a self-check.

`install` checks `CascadeDecode` against vLLM's own kernel on scratch blocks (two requests
reading one master at different offsets, rows replaced, a third request prefilling beside them)
and, if they agree, routes each attention layer's forward through the cascade path
(`seam.cpu_attention.route`: only this engine's layers change; vLLM's backend registry and files
are untouched). Anything unsupported (not vLLM's CPU backend, sliding window,
ALiBi, soft-capping, attention sinks, quantized KV) leaves the stock forward in place and says why.
The speed guard (``kmesh.speed_guard``, `kmesh_blend.vllm.speed_guard`) is decided here too.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING

import torch

from kmesh_blend.config import KMeshConfig
from kmesh_blend.cpu.level import KernelLevel, choose_level
from kmesh_blend.segments.master import Master
from kmesh_blend.vllm.cascade_attend import EngineKV, Heads, Kernel
from kmesh_blend.vllm.cascade_decode import CascadeDecode, MasterUse, ReqIds
from kmesh_blend.vllm.cascade_probe import probe
from kmesh_blend.vllm.paged import CPU_LAYOUTS, PagedLayout, slot_mapping
from kmesh_blend.vllm.seam import cpu_attention as vllm_attn
from kmesh_blend.vllm.speed_guard import SpeedGuard

if TYPE_CHECKING:
    from kmesh_blend.vllm.seam.cpu_attention import AttnLayer

__all__ = ["install"]

log = logging.getLogger("vllm.kmesh_blend")  # under vLLM's handlers and format


def install(kv: EngineKV, req_ids: ReqIds,
            config: KMeshConfig) -> tuple[CascadeDecode | None, str | None]:  # fmt: skip
    """(the installed path, None), or (None, why it stays off).

    The CPU kernel (`kmesh_blend.cpu`) serves when it is built, fits the dtype and head size,
    and passes the self-check, its shared level read as ``kmesh.cascade_level`` says
    (`kmesh_blend.cpu.level`), else on its vector loops after their own self-check; else the
    plain-torch path, after its own self-check. Then, with ``kmesh.speed_guard`` ``auto``, the
    path is timed against vLLM's kernel (`cascade_probe`) and its `SpeedGuard` decides where it
    serves."""
    problem = _unsupported(kv.layers[0], kv.layout)
    kernel, level = None, KernelLevel(exact=config.cascade_exact)
    if problem is None:
        kernel, why = _kernel_for(kv.caches[0].dtype, kv.heads)
        if kernel is not None:
            level = level._replace(gemm=_level(kv, kernel, config.cascade_level, level.exact))
            why = _self_check(kv, kernel, level)
            if why is not None and level.gemm:
                log.warning("kmesh: the shared level's matrix products stay off: %s", why)
                level = level._replace(gemm=False)
                why = _self_check(kv, kernel, level)
            if why is not None:
                kernel = None
        if kernel is None:
            log.warning("kmesh: cascade decode runs on plain torch ops: %s", why)
            problem = _self_check(kv, None)
    if problem is not None:
        log.warning("kmesh: cascade decode stays off: %s", problem)
        return None, problem
    decode = CascadeDecode(kv, req_ids, kernel)
    decode.level = level
    decode.guard = _guard(kv, kernel, config.speed_guard, level)
    vllm_attn.route(kv.layers, decode)
    log.info(
        "kmesh: cascade decode on for %d attention layers (%s, self-check passed)",
        len(kv.layers),
        "CPU kernel" if kernel is not None else "plain torch",
    )
    log.info("%s", decode.guard.line())
    return decode, None


def _level(kv: EngineKV, kernel: Kernel, setting: str, exact: bool) -> bool:
    """Whether the kernel reads masters by matrix products here (`cpu.level.choose_level`)."""
    try:
        gemm, line = choose_level(setting, kernel, kv.caches[0].dtype, kv.heads, exact)
    except Exception as exc:  # no matrix micro-kernels here: the loops serve
        gemm, line = False, f"shared level on vector loops ({type(exc).__name__}: {exc})"
    log.info("kmesh: %s", line)
    return gemm


def _guard(kv: EngineKV, kernel: Kernel | None, mode: str, level: KernelLevel) -> SpeedGuard:
    if mode == "off":
        return SpeedGuard.decide(mode, None)
    try:
        return SpeedGuard.decide(mode, probe(kv, kernel, level=level))
    except Exception as exc:  # the path passed its self-check: trust the settings, say why
        return SpeedGuard.decide(mode, None, f"{type(exc).__name__}: {exc}")


def _kernel_for(dtype: torch.dtype, heads: Heads) -> tuple[Kernel | None, str | None]:
    """The CPU kernel when it can serve this cache, else (None, why not)."""
    if dtype not in (torch.float32, torch.bfloat16):
        return None, f"the CPU kernel reads float32 or bfloat16, not {dtype}"
    if heads.head_dim not in (32, 64, 128):
        return None, f"the CPU kernel takes head sizes 32, 64 or 128, not {heads.head_dim}"
    if heads.num_heads // heads.num_kv_heads > 64:
        return None, "more than 64 query heads per KV head"
    from kmesh_blend.cpu import cascade_decode_op

    return cascade_decode_op()


def _unsupported(layer: AttnLayer, layout: PagedLayout) -> str | None:
    if layout.name not in CPU_LAYOUTS:
        return f"paged layout {layout.name}"
    return vllm_attn.unsupported(layer)


def _self_check(kv: EngineKV, kernel: Kernel | None,
                level: KernelLevel | None = None) -> str | None:  # fmt: skip
    """Run the cascade path (masters read as ``level`` says) and vLLM's kernel on scratch
    blocks of the first layer (never the live cache); None when they agree."""
    try:
        got, want = _scratch_run(kv, kernel, level or KernelLevel())
    except Exception as exc:  # any failure: keep vLLM's forward
        return f"self-check failed: {type(exc).__name__}: {exc}"
    tol = 1e-4 if kv.caches[0].dtype == torch.float32 else 3e-2
    err = float((got.float() - want.float()).abs().max())
    return None if err <= tol else f"self-check differs from vLLM's kernel by {err:.2e} (> {tol})"


def _scratch_run(kv: EngineKV, kernel: Kernel | None,
                 level: KernelLevel) -> tuple[torch.Tensor, ...]:  # fmt: skip
    layer, cache, layout, rope, heads = kv.layers[0], kv.caches[0], kv.layout, kv.rope, kv.heads
    bs, dtype = layout.block_size, cache.dtype
    num_heads, num_kv_heads, head_dim = heads
    gen = torch.Generator().manual_seed(0)

    def rand(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=gen)

    size, first = bs + 5, 2
    master_k = rope.apply(rand(size, num_kv_heads, head_dim), torch.arange(first, first + size))
    master_v = rand(size, num_kv_heads, head_dim)
    master = Master(
        torch.stack((master_k, master_v))[None].to(dtype), torch.arange(first, first + size)
    )
    # (offset, prompt length, generated) per request; the third prefills 4 tokens meanwhile.
    shapes = [(3, size + 7, 3), (bs + 1, size + bs + 4, 1), (0, 2 * bs - 1, 0)]
    blocks = [[0, 4, 2], [3, 6, 1, 7], [5, 8]]
    scratch = cache.new_zeros((9, *cache.shape[1:]))
    keys, values = [], []  # the K/V rows of each request's tokens in this step
    for r, (offset, prompt, extra) in enumerate(shapes):
        total = prompt + extra
        k = rope.apply(rand(total, num_kv_heads, head_dim), torch.arange(total))
        v = rand(total, num_kv_heads, head_dim)
        if r < 2:
            keep = torch.rand(size, generator=gen) > 0.25
            delta = torch.full((size,), offset - first)
            k[offset : offset + size][keep] = rope.apply(master_k.to(dtype).float(), delta)[keep]
            v[offset : offset + size][keep] = master_v.to(dtype).float()[keep]
        slots = slot_mapping(blocks[r], bs, 0, total)
        vllm_attn.write_kv(layer, k.to(dtype), v.to(dtype), scratch, slots)
        now = 1 if r < 2 else 4
        keys.append(k[total - now :].to(dtype))
        values.append(v[total - now :].to(dtype))
    seq_lens = torch.tensor([p + e for _, p, e in shapes], dtype=torch.int32)
    query_start_loc = torch.tensor([0, 1, 2, 6], dtype=torch.int32)
    table = torch.tensor([b + [0] * (4 - len(b)) for b in blocks], dtype=torch.int32)
    query = rope.apply(rand(6, num_heads, head_dim), torch.tensor([25, 26, 27, 28, 29, 30]))
    query = query.to(dtype)
    meta = vllm_attn.scratch_batch(layer, query_start_loc, seq_lens, table, dtype)
    stock = vllm_attn.stock_forward(layer)
    key, value = torch.cat(keys), torch.cat(values)
    want = stock(query, key, value, scratch, meta, torch.zeros_like(query))
    batch = vllm_attn.step_batch(meta)
    assert batch is not None
    scratch_kv = EngineKV([layer], [scratch], layout, rope, heads)
    decode = CascadeDecode(scratch_kv, lambda n: ["a", "b", "c"][:n], kernel)
    decode.level = level
    for name, (offset, prompt, _), ids in zip("ab", shapes, blocks, strict=False):
        slots = slot_mapping(ids, bs, 0, prompt)
        decode.add(name, ids, slots, [MasterUse("m", offset, offset + size, master)])
    got = decode.forward(0, lambda: want, layer, query, key, value, scratch, batch,
                         torch.zeros_like(query))  # fmt: skip
    if decode.broken is not None or decode.reports.get("a", {}).get("cascade_steps") != 1:
        raise RuntimeError(f"the scratch requests did not decode in cascade: {decode.reports}")
    return got, want
