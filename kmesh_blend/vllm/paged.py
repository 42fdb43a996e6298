"""Reading and writing token rows of vLLM's paged KV cache, layout verified against the backend.

A KV cache tensor's in-block layout depends on the attention backend, the dtype and even the CPU
instruction set (vLLM's CPU backend stores fp32 K transposed within a block). Rather than guess,
`PagedLayout.discover` lets the backend's own write op (`seam.cpu_attention.write_kv`) fill a
scratch cache with random rows and keeps the candidate view that reads exactly those rows back.
If none does, the layout is unknown and reuse is disabled (one log line) — never a hand-guessed
write.

Views are ``[block, head, offset, dim]`` (see `kmesh_blend.ops.scatter_paged`), except for
``packed`` layouts, whose rows are not one strided view: vLLM's CPU backend on AMX in bf16 packs
each block in AMX tiles (K: per 16 tokens, dimension pairs of 16 tokens × 2; V: per 16 dimensions,
token pairs of 16 dimensions × 2). Their views are 6-D (see `_amx_views`) and rows are read and
written by index.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from kmesh_blend.ops import gather_paged, scatter_paged
from kmesh_blend.vllm.seam.cpu_attention import write_kv

if TYPE_CHECKING:
    from kmesh_blend.vllm.seam.cpu_attention import AttnLayer

__all__ = ["CPU_LAYOUTS", "PagedLayout", "slot_mapping"]

log = logging.getLogger("vllm.kmesh_blend")  # under vLLM's handlers and format

ViewFn = Callable[[torch.Tensor], tuple[torch.Tensor, torch.Tensor]]
# The layouts of vLLM's CPU backend: its attention kernel and our cascade kernel read them.
CPU_LAYOUTS = ("cpu_k_transposed", "cpu_rows", "cpu_amx_packed")


def slot_mapping(block_ids: list[int], block_size: int, start: int, end: int) -> torch.Tensor:
    """Slots of prompt tokens [start, end) of a request holding ``block_ids``: [n] int64."""
    pos = torch.arange(start, end, dtype=torch.int64)
    blocks = torch.tensor(block_ids, dtype=torch.int64)[pos // block_size]
    return blocks * block_size + pos % block_size


@dataclass(frozen=True)
class PagedLayout:
    """How one layer's cache tensor maps to (K, V) ``[block, head, offset, dim]`` views."""

    name: str
    block_size: int
    views: ViewFn

    @property
    def packed(self) -> bool:
        """AMX tiles: `views` are 6-D, rows go through `_amx_rows`."""
        return self.name == "cpu_amx_packed"

    def write(
        self, cache: torch.Tensor, k: torch.Tensor, v: torch.Tensor, slots: torch.Tensor
    ) -> None:
        """Write rows k / v [n, Hkv, D] at ``slots`` [n] (exact copy, cast to the cache dtype)."""
        kv, vv = self.views(cache)
        if self.packed:
            k_at, v_at = _amx_rows(kv, vv, slots, self.block_size)
            n, heads, dim = k.shape
            kv[k_at] = k.to(cache.dtype).reshape(n, heads, dim // 2, 2)
            vv[v_at] = v.to(cache.dtype).reshape(n, heads, dim // 16, 16)
            return
        scatter_paged(k, kv, slots, self.block_size)
        scatter_paged(v, vv, slots, self.block_size)

    def read(self, cache: torch.Tensor, slots: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Rows at ``slots`` [n] → (k, v) each [n, Hkv, D] in the cache dtype."""
        kv, vv = self.views(cache)
        if self.packed:
            k_at, v_at = _amx_rows(kv, vv, slots, self.block_size)
            n, heads, dim = slots.numel(), kv.shape[1], 2 * kv.shape[3]
            return kv[k_at].reshape(n, heads, dim), vv[v_at].reshape(n, heads, dim)
        return gather_paged(kv, slots, self.block_size), gather_paged(vv, slots, self.block_size)

    def write_layers(
        self, caches: list[torch.Tensor], keys: list[torch.Tensor], values: list[torch.Tensor],
        slots: torch.Tensor, first: int,
    ) -> None:  # fmt: skip
        """Rows ``first..first+n`` of every layer's k / v [T, Hkv, D] at ``slots`` [n]."""
        end = first + slots.numel()
        for cache, k, v in zip(caches, keys, values, strict=True):
            self.write(cache, k[first:end], v[first:end], slots.to(cache.device))

    def read_layers(self, caches: list[torch.Tensor], slots: torch.Tensor) -> torch.Tensor:
        """Every layer's rows at ``slots`` [n]: [L, 2, n, Hkv, D] in the cache dtype."""
        return torch.stack([torch.stack(self.read(cache, slots)) for cache in caches])

    @classmethod
    def discover(
        cls,
        attn_layer: AttnLayer,
        cache: torch.Tensor,
        num_kv_heads: int,
        head_dim: int,
        block_size: int,
    ) -> PagedLayout | None:
        """Find the layout the backend of ``attn_layer`` writes into ``cache``; None if unknown."""
        candidates = _candidates(cache.shape, num_kv_heads, head_dim, block_size)
        probe = cache.new_zeros(_with_two_blocks(cache.shape, block_size))
        gen = torch.Generator().manual_seed(0)
        n = 2 * block_size - 3  # two blocks, the second partial
        k = torch.randn(n, num_kv_heads, head_dim, generator=gen).to(cache.dtype)
        v = torch.randn(n, num_kv_heads, head_dim, generator=gen).to(cache.dtype)
        slots = torch.randperm(2 * block_size, generator=gen)[:n]
        try:
            write_kv(
                attn_layer, k.to(cache.device), v.to(cache.device), probe, slots.to(cache.device)
            )
        except Exception as exc:  # no such op, or it refused a scratch tensor: do not guess
            log.warning("kmesh: probing the KV cache layout failed (%s); reuse disabled", str(exc))
            return None
        for name, views in candidates.items():
            layout = cls(name, block_size, views)
            try:
                got_k, got_v = layout.read(probe, slots.to(cache.device))
            except (RuntimeError, ValueError, IndexError):
                continue
            if torch.equal(got_k.cpu(), k) and torch.equal(got_v.cpu(), v):
                log.info("kmesh: paged KV layout is %s (verified by a round trip)", name)
                return layout
        log.warning("kmesh: unknown paged KV layout %s; reuse disabled", tuple(cache.shape))
        return None


def _with_two_blocks(shape: torch.Size, block_size: int) -> tuple[int, ...]:
    dims = list(shape)
    dims[1 if len(dims) == 5 and dims[0] == 2 else 0] = 2
    return tuple(dims)


def _candidates(shape: torch.Size, heads: int, dim: int, bs: int) -> dict[str, ViewFn]:
    out: dict[str, ViewFn] = {}
    if len(shape) == 4 and tuple(shape[1:]) == (heads, bs, 2 * dim):
        # vLLM CPU: [blocks, Hkv, block_size, 2*D], viewed per block and head as K rows then V rows.
        def cpu_rows(c: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
            base = c.view(c.shape[0], heads, 2 * bs, dim)
            return base[:, :, :bs], base[:, :, bs:]

        def cpu_k_transposed(c: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
            base = c.view(c.shape[0], heads, 2 * bs, dim)
            s = base.stride()
            k = base.as_strided(
                (c.shape[0], heads, bs, dim), (s[0], s[1], 1, bs), base.storage_offset()
            )
            return k, base[:, :, bs:]

        out["cpu_k_transposed"] = cpu_k_transposed
        out["cpu_rows"] = cpu_rows
        if bs % 16 == 0 and dim % 16 == 0:
            out["cpu_amx_packed"] = _amx_views(heads, dim, bs)
    if len(shape) == 5 and shape[0] == 2 and tuple(shape[2:]) == (bs, heads, dim):
        out["cuda_2_nb_bs_h_d"] = lambda c: (c[0].permute(0, 2, 1, 3), c[1].permute(0, 2, 1, 3))
    if len(shape) == 5 and shape[1] == 2 and tuple(shape[2:]) == (bs, heads, dim):
        out["cuda_nb_2_bs_h_d"] = lambda c: (
            c[:, 0].permute(0, 2, 1, 3),
            c[:, 1].permute(0, 2, 1, 3),
        )
    if len(shape) == 5 and shape[1] == 2 and tuple(shape[2:]) == (heads, bs, dim):
        out["cuda_nb_2_h_bs_d"] = lambda c: (c[:, 0], c[:, 1])
    return out


def _amx_views(heads: int, dim: int, bs: int) -> ViewFn:
    """vLLM CPU on AMX, bf16: each block and head holds K then V, each bs × D elements, in tiles.
    K element (t, d) sits at (t // 16)·16D + (d // 2)·32 + (t % 16)·2 + d % 2, V element (t, d)
    at (d // 16)·16·bs + (t // 2)·32 + (d % 16)·2 + t % 2; as views, K [block, head, t // 16,
    d // 2, t % 16, d % 2] and V [block, head, d // 16, t // 2, d % 16, t % 2]."""

    def views(c: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        base = c.view(c.shape[0], heads, 2 * bs, dim)
        s0, s1, at = base.stride(0), base.stride(1), base.storage_offset()
        k = base.as_strided(
            (c.shape[0], heads, bs // 16, dim // 2, 16, 2), (s0, s1, 16 * dim, 32, 2, 1), at
        )
        v = base.as_strided(
            (c.shape[0], heads, dim // 16, bs // 2, 16, 2), (s0, s1, 16 * bs, 32, 2, 1),
            at + bs * dim,
        )  # fmt: skip
        return k, v

    return views


def _amx_rows(kv: torch.Tensor, vv: torch.Tensor, slots: torch.Tensor, bs: int) -> tuple[
    tuple[torch.Tensor | slice, ...], tuple[torch.Tensor | slice, ...]
]:  # fmt: skip
    """Index tuples of `_amx_views`' K and V for the rows at ``slots`` [n] int64: indexing gives
    K [n, Hkv, D/2, 2] and V [n, Hkv, D/16, 16] (the heads and dims in order)."""
    if slots.numel() and (int(slots.min()) < 0 or int(slots.max()) >= kv.shape[0] * bs):
        raise IndexError(f"slots outside the cache's {kv.shape[0] * bs} slots")
    blocks, offsets = slots // bs, slots % bs
    every = slice(None)
    k_at = (blocks, every, offsets // 16, every, offsets % 16, every)
    v_at = (blocks, every, every, offsets // 2, every, offsets % 2)
    return k_at, v_at
