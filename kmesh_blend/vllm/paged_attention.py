"""Attention of a blend's computed tokens through vLLM's own CPU attention kernel.

Our fused-SDPA attention is exact but, inside vLLM's process, several times slower than vLLM's
CPU kernel. This module runs the blend's attention on that kernel instead: each layer's KV (fresh
rows where computed, re-positioned stored rows elsewhere) is written into the request's own paged
blocks, and the computed tokens, grouped into runs of consecutive positions, attend as causal
"requests" whose sequence ends at each run's last token (a run [a, b) sees keys 0..b−1, bottom-
right causal: exactly the causal mask of those queries).

It is used only after a start-up self-check against the reference attention passes; otherwise the
blend keeps the reference path (one log line). The kernel itself is reached through the seam
(`kmesh_blend.vllm.seam.cpu_attention`).
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import TYPE_CHECKING

import torch

from kmesh_blend.vllm.paged import CPU_LAYOUTS, PagedLayout, slot_mapping
from kmesh_blend.vllm.seam import cpu_attention as vllm_attn

if TYPE_CHECKING:
    from kmesh_blend.vllm.seam.cpu_attention import AttnLayer

__all__ = ["PagedAttention"]

log = logging.getLogger("vllm.kmesh_blend")  # under vLLM's handlers and format

Hook = Callable[[int, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]
Reference = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]


class PagedAttention:
    def __init__(self, layers: list[AttnLayer], caches: list[torch.Tensor], layout: PagedLayout,
                 num_heads: int, num_kv_heads: int, head_dim: int) -> None:  # fmt: skip
        self.layers, self.caches, self.layout = layers, caches, layout
        self.num_heads, self.num_kv_heads, self.head_dim = num_heads, num_kv_heads, head_dim
        self.block_size = layout.block_size

    @classmethod
    def create(cls, layers: list[AttnLayer], caches: list[torch.Tensor], layout: PagedLayout,
               num_heads: int, num_kv_heads: int, head_dim: int,
               reference: Reference) -> PagedAttention | None:  # fmt: skip
        """A checked instance, or None when vLLM's CPU kernel is unavailable or disagrees with
        ``reference`` (a `LayerwiseModel`'s ``attend``) on a scratch input."""
        if layout.name not in CPU_LAYOUTS:
            return None
        if not vllm_attn.kernel_available():
            return None
        self = cls(layers, caches, layout, num_heads, num_kv_heads, head_dim)
        problem = self._self_check(reference)
        if problem is not None:
            log.warning("kmesh: vLLM attention kernel not used for blends: %s", problem)
            return None
        log.info("kmesh: blend attention runs on vLLM's CPU attention kernel (self-check passed)")
        from kmesh_blend.cpu import cascade_decode_op

        cascade_decode_op()  # loads kmesh's CPU ops (the blend re-positions keys with one)
        return self

    def hook(
        self, block_ids: list[int], slots: torch.Tensor, caches: list[torch.Tensor] | None = None,
        first: int = 0,
    ) -> Hook:  # fmt: skip
        """Attention callback for one request holding ``block_ids`` (``slots`` [T] int64: its T
        prompt tokens' slots). Rows before ``first`` are already in the cache (vLLM's exact
        prefix): never written."""
        caches = caches if caches is not None else self.caches
        slots = slots[first:]
        table = torch.tensor(block_ids, dtype=torch.int32)

        runs: list[
            tuple[torch.Tensor, vllm_attn.KernelBatch]
        ] = []  # for the last q_positions tensor

        def attend(layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                   q_positions: torch.Tensor) -> torch.Tensor:  # fmt: skip
            cache = caches[layer]
            attn = self.layers[layer]
            # The backend's own vectorized write (the layout read-back was verified against it).
            vllm_attn.write_kv(attn, k[first:], v[first:], cache, slots)
            # The blend passes the same positions tensor layer after layer until its computed
            # set changes: the runs and the kernel's schedule are built once for it.
            if not runs or runs[0][0] is not q_positions:
                runs[:] = [(q_positions, self._runs(layer, table, q, q_positions))]
            return vllm_attn.run_kernel(self.layers[layer], cache, q, runs[0][1])

        return attend

    # --- helpers --------------------------------------------------------------------------------

    def _runs(self, layer: int, table: torch.Tensor, q: torch.Tensor,
              q_positions: torch.Tensor) -> vllm_attn.KernelBatch:  # fmt: skip
        """Runs of consecutive positions become causal "requests" ending at the run's last
        token (a full run gives vLLM's bits)."""
        breaks = torch.nonzero(q_positions[1:] != q_positions[:-1] + 1).squeeze(1) + 1
        starts = torch.cat([torch.zeros(1, dtype=torch.int64), breaks])
        ends = torch.cat([breaks, torch.tensor([q_positions.numel()])])
        query_start_loc = torch.cat([starts, ends[-1:]]).to(torch.int32)
        seq_lens = (q_positions[ends - 1] + 1).to(torch.int32)
        block_table = table[None, :].expand(int(starts.numel()), -1).contiguous()
        return vllm_attn.kernel_batch(
            self.layers[layer], query_start_loc, seq_lens, block_table, q.dtype
        )

    def _self_check(self, reference: Reference) -> str | None:
        """Compare with the reference attention on scratch blocks (not the live cache)."""
        from kmesh_blend.models.layerwise import causal_mask

        try:
            n = 2 * self.block_size - 5
            scratch = [self.caches[0].new_zeros((3, *self.caches[0].shape[1:]))]
            gen = torch.Generator().manual_seed(0)
            dtype = self.caches[0].dtype
            k = torch.randn(n, self.num_kv_heads, self.head_dim, generator=gen).to(dtype)
            v = torch.randn(n, self.num_kv_heads, self.head_dim, generator=gen).to(dtype)
            pos = torch.tensor(sorted(set(range(0, 9)) | set(range(20, n, 7)) | {n - 1}))
            q = torch.randn(pos.numel(), self.num_heads, self.head_dim, generator=gen).to(dtype)
            slots = slot_mapping([2, 0], self.block_size, 0, n)
            got = self.hook([2, 0], slots, scratch)(0, q, k, v, pos)
            want = reference(q, k, v, causal_mask(pos, torch.arange(n)))
        except Exception as exc:  # any failure means: keep the reference path
            return f"{type(exc).__name__}: {exc}"
        tol = 1e-4 if dtype == torch.float32 else 3e-2
        err = float((got.float() - want.float()).abs().max())
        return None if err <= tol else f"differs from the reference by {err:.2e} (tolerance {tol})"
