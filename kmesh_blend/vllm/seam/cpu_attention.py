"""vLLM's CPU attention backend: its kernel, its metadata and its impl class (seam).

Everything kmesh-blend does with vLLM's attention goes through here:

- `kernel_batch` / `run_kernel`: vLLM's CPU attention kernel (``vllm._custom_ops``) with the
  schedule vLLM's own metadata builder would make, so a request gets vLLM's bits;
- `write_kv`: the backend's own paged write (``impl.do_kv_cache_update``);
- `step_batch`: a step's ``CPUAttentionMetadata`` as the cascade decode path reads it;
- `route`: gives each attention layer's ``impl`` a subclass of its own class whose ``forward``
  asks a `Router` first (only this engine's layers change; the backend registry does not);
- `unsupported`: the backend features the cascade path does not serve.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any, NamedTuple, Protocol, cast

import torch

from kmesh_blend.vllm.seam import REPORT

if TYPE_CHECKING:
    from vllm.model_executor.layers.attention.attention import Attention as AttnLayer
    from vllm.v1.attention.backends.cpu_attn import CPUAttentionBackendImpl, CPUAttentionMetadata

__all__ = [
    "AttnLayer",
    "KernelBatch",
    "Router",
    "StepBatch",
    "attn_scale",
    "kernel_available",
    "kernel_batch",
    "route",
    "run_kernel",
    "scratch_batch",
    "step_batch",
    "stock_forward",
    "sub_batch",
    "unsupported",
    "write_kv",
]  # fmt: skip

_BACKEND = "CPUAttentionBackendImpl"
Stock = Callable[[], torch.Tensor]  # vLLM's own forward of this call


class KernelBatch(NamedTuple):
    """vLLM kernel inputs for R causal "requests": [R+1] int32 query starts, [R] int32 sequence
    ends, [R, blocks] int32 block table, and the kernel's schedule (`kernel_batch`)."""

    query_start_loc: torch.Tensor
    seq_lens: torch.Tensor
    block_table: torch.Tensor
    metadata: torch.Tensor


class StepBatch(NamedTuple):
    """One step's plain causal attention batch of R requests: ``key`` identifies the step (the
    same metadata object serves every layer of it), ``num_tokens`` its query rows,
    ``query_start_loc`` [R+1] int32, ``seq_lens`` [R] int32, ``block_table`` [R, B] int32."""

    key: object
    num_tokens: int
    query_start_loc: torch.Tensor
    seq_lens: torch.Tensor
    block_table: torch.Tensor


class Router(Protocol):
    """Where a routed layer's forward goes (`kmesh_blend.vllm.cascade_decode.CascadeDecode`)."""

    def forward(self, index: int, stock: Stock, layer: AttnLayer, query: torch.Tensor,
                key: torch.Tensor, value: torch.Tensor, kv_cache: torch.Tensor, batch: StepBatch,
                output: torch.Tensor) -> torch.Tensor: ...  # fmt: skip

    def unreadable_step(self) -> None:
        """Called before a step the router cannot read runs on vLLM's kernel (may raise)."""


def kernel_available() -> bool:
    try:
        from vllm import _custom_ops  # noqa: F401
    except ImportError:
        return False
    return True


def _impl(layer: AttnLayer) -> CPUAttentionBackendImpl:
    return cast("CPUAttentionBackendImpl", layer.impl)


def attn_scale(layer: AttnLayer) -> float:
    return float(_impl(layer).scale)


def unsupported(layer: AttnLayer) -> str | None:
    """Why the cascade path cannot serve ``layer``'s backend, or None."""
    impl = _impl(layer)
    name = type(impl).__name__.removeprefix("KMeshCascade")
    if name != _BACKEND:
        return f"attention backend {name} (only vLLM's CPU backend is wired)"
    if impl.sliding_window != -1 or impl.alibi_slopes is not None or impl.logits_soft_cap:
        return "sliding window, ALiBi or soft-capping"
    if impl.sinks is not None or impl.is_fp8_kv_cache:
        return "attention sinks or a quantized KV cache"
    return None


def write_kv(layer: AttnLayer, k: torch.Tensor, v: torch.Tensor, cache: torch.Tensor,
             slots: torch.Tensor) -> None:  # fmt: skip
    """The backend's own write of rows k / v [n, Hkv, D] at ``slots`` [n] int64 of ``cache``."""
    _impl(layer).do_kv_cache_update(layer, k, v, cache, slots)


def kernel_batch(layer: AttnLayer, query_start_loc: torch.Tensor, seq_lens: torch.Tensor,
                 block_table: torch.Tensor, dtype: torch.dtype) -> KernelBatch:  # fmt: skip
    """The batch with the kernel's schedule for it (it depends on shapes, not on values), built
    with the settings vLLM's own attention metadata uses."""
    from vllm import _custom_ops as ops
    from vllm import envs

    impl = _impl(layer)
    metadata = ops.cpu_attn_get_scheduler_metadata(
        num_reqs=int(seq_lens.numel()), num_heads=impl.num_heads,
        num_kv_heads=impl.num_kv_heads, head_dim=impl.head_size, seq_lens=seq_lens, dtype=dtype,
        query_start_loc=query_start_loc, causal=True, sliding_window_size=-1,
        isa=cast(Any, layer).isa, enable_kv_split=envs.VLLM_CPU_ATTN_SPLIT_KV,
        dynamic_causal=None, kv_cache_dtype=impl.kv_cache_dtype,
    )  # fmt: skip
    return KernelBatch(query_start_loc, seq_lens, block_table, metadata)


def run_kernel(layer: AttnLayer, cache: torch.Tensor, q: torch.Tensor,
               batch: KernelBatch) -> torch.Tensor:  # fmt: skip
    """vLLM's CPU attention kernel, causal: q [t, H, D] over ``cache`` (one layer's paged KV)
    → [t, H, D] in q's dtype."""
    from vllm import _custom_ops as ops

    impl = _impl(layer)
    blocks, kv_heads, block_size, _ = cache.shape
    key_cache, value_cache = cache.view(blocks, kv_heads, 2 * block_size, -1).chunk(2, dim=2)
    out = torch.empty_like(q)
    ops.cpu_attention_with_kv_cache(
        query=q.contiguous(), key_cache=key_cache, value_cache=value_cache, output=out,
        query_start_loc=batch.query_start_loc, seq_lens=batch.seq_lens, scale=impl.scale,
        causal=True, alibi_slopes=cast("torch.Tensor | None", impl.alibi_slopes),
        sliding_window=impl.sliding_window,
        block_table=batch.block_table, softcap=impl.logits_soft_cap,
        scheduler_metadata=batch.metadata, s_aux=None, dynamic_causal=None,
        k_scale=_scale(layer, "k"), v_scale=_scale(layer, "v"),
        kv_cache_dtype=impl.kv_cache_dtype,
    )  # fmt: skip
    return out


def _scale(layer: AttnLayer, which: str) -> float:
    """The layer's KV quantization scale as a float (a private member vLLM keeps for its CPU
    kernel; 1.0 for an unquantized cache)."""
    return float(getattr(layer, f"_{which}_scale_float"))


def sub_batch(batch: StepBatch, layer: AttnLayer, dtype: torch.dtype, rows: list[int],
              starts: list[int]) -> tuple[torch.Tensor, KernelBatch]:  # fmt: skip
    """Requests ``rows`` of a step (``starts``: its query starts as a list) as a kernel batch of
    their own, with their query rows [t] int64."""
    tokens = torch.cat([torch.arange(starts[i], starts[i + 1]) for i in rows])
    lens = torch.tensor([starts[i + 1] - starts[i] for i in rows], dtype=torch.int32)
    query_start_loc = torch.cat((torch.zeros(1, dtype=torch.int32), lens.cumsum(0).int()))
    index = torch.tensor(rows)
    kernel = kernel_batch(layer, query_start_loc, batch.seq_lens[index].contiguous(),
                          batch.block_table[index].contiguous(), dtype)  # fmt: skip
    return tokens, kernel


def step_batch(meta: object) -> StepBatch | None:
    """``meta`` (a step's attention metadata) as a `StepBatch`; None unless it is vLLM's CPU
    metadata of plain causal attention."""
    if type(meta).__name__ != "CPUAttentionMetadata":
        return None
    cpu = cast("CPUAttentionMetadata", meta)
    if cpu.dynamic_causal is not None or not cpu.causal:
        return None
    return StepBatch(meta, cpu.num_actual_tokens, cpu.query_start_loc, cpu.seq_lens,
                     cpu.block_table)  # fmt: skip


def scratch_batch(
    layer: AttnLayer, query_start_loc: torch.Tensor, seq_lens: torch.Tensor,
    block_table: torch.Tensor, dtype: torch.dtype,
) -> CPUAttentionMetadata:  # fmt: skip
    """vLLM's CPU metadata for a causal scratch batch (the start-up self-checks)."""
    from vllm.v1.attention.backends.cpu_attn import CPUAttentionMetadata

    num = int(query_start_loc[-1])
    lens = query_start_loc[1:] - query_start_loc[:-1]
    return CPUAttentionMetadata(
        num_actual_tokens=num, max_query_len=int(lens.max()), query_start_loc=query_start_loc,
        max_seq_len=int(seq_lens.max()), seq_lens=seq_lens, block_table=block_table,
        slot_mapping=torch.zeros(num, dtype=torch.int64),
        scheduler_metadata=kernel_batch(layer, query_start_loc, seq_lens, block_table,
                                        dtype).metadata,
    )  # fmt: skip


def stock_forward(layer: AttnLayer) -> Callable[..., torch.Tensor]:
    """``fn(query, key, value, kv_cache, meta, output)``: the backend's own forward of
    ``layer`` (also when the layer is routed)."""
    cls: Any = type(layer.impl)
    forward = cls.__mro__[1].forward if getattr(cls, "_kmesh_cascade", False) else cls.forward

    def run(*args: Any) -> torch.Tensor:
        return cast(torch.Tensor, forward(layer.impl, layer, *args))

    return run


_subclasses: dict[type, type] = {}


def route(layers: list[AttnLayer], router: Router) -> None:
    """Route each layer's forward (layer i as index i) through ``router``; a call whose metadata
    is not a plain causal `StepBatch`, or that quantizes its output, stays vLLM's."""
    for index, layer in enumerate(layers):
        impl: Any = layer.impl
        impl._kmesh_route = (router, index)
        impl.__class__ = _routed(type(impl))
    REPORT.note_changed("attention impl", f"{len(layers)} layers' impl class routed to cascade")


def _routed(base: type) -> type:
    if getattr(base, "_kmesh_cascade", False):
        base = base.__mro__[1]
    cls = _subclasses.get(base)
    if cls is not None:
        return cls

    def forward(self: Any, layer: AttnLayer, query: torch.Tensor, key: torch.Tensor,
                value: torch.Tensor, kv_cache: torch.Tensor, attn_metadata: Any,
                output: torch.Tensor, output_scale: Any = None,
                output_block_scale: Any = None) -> torch.Tensor:  # fmt: skip
        def stock() -> torch.Tensor:
            return cast(torch.Tensor, base.forward(  # type: ignore[attr-defined]
                self, layer, query, key, value, kv_cache, attn_metadata, output, output_scale,
                output_block_scale))  # fmt: skip

        target = getattr(self, "_kmesh_route", None)
        batch = step_batch(attn_metadata) if output_scale is None else None
        if target is None:
            return stock()
        if batch is None:
            target[0].unreadable_step()  # raises while vLLM's kernel must not serve
            return stock()
        router, index = target
        return cast(torch.Tensor, router.forward(index, stock, layer, query, key, value,
                                                 kv_cache, batch, output))  # fmt: skip

    cls = type(
        f"KMeshCascade{base.__name__}", (base,), {"forward": forward, "_kmesh_cascade": True}
    )
    _subclasses[base] = cls
    return cls
