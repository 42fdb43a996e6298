"""A cascade reader's segment blocks back to vLLM's block pool (``kmesh.share_kv_memory``).

Once a request decodes in cascade (`kmesh_blend.vllm.cascade_decode`), the paged rows of the
segments it reused are read by no one: each step reads the family's master (held once, next to
vLLM's KV budget) and the request's own rows. So the blocks that hold only segment rows can go
back to vLLM's pool, and more readers fit one KV budget. Which ones, and what must be kept first:

- a block goes only when every token of it lies inside a reused segment, at or after the first
  token the blend wrote (earlier blocks may be exact prefix-cache hits other requests share),
  and before the prompt's end (generated rows land in the blocks after it);
- the request's own rows inside those blocks (the rows it replaced: recomputed, a leader's, a
  row that did not verify against its master) are copied out first: its **mirror**, held beside
  the master in the KV dtype;
- the decision is made on the worker at the request's first decode step (when its rows are
  verified against the master); the scheduler side gives the blocks back to vLLM's pool
  (`kmesh_blend.vllm.seam.blocks.release_blocks`), its hashes dropped so prefix caching never
  serves them. From then on only the cascade path may serve the request: a step it cannot serve
  raises rather than let vLLM's kernel read a released block.

Plain torch; no vLLM import.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from kmesh_blend.vllm.paged import PagedLayout

if TYPE_CHECKING:
    from kmesh_blend.vllm.decode_plan import DecodePlan as DecodePlanLike

__all__ = ["Mirror", "Release", "Sharing", "releasable_blocks", "take_mirror"]


@dataclass(frozen=True)
class Mirror:
    """A released reader's own prompt rows, per layer l: ``rows[l]`` = (K, V), each [m_l, Hkv, D]
    in the KV cache dtype (the rows that lay in released blocks, copied out before they went);
    ``kept[l]`` [p_l] int64: the slots of its other own prompt rows (in blocks it kept)."""

    rows: list[tuple[torch.Tensor, torch.Tensor]]
    kept: list[torch.Tensor]

    @property
    def nbytes(self) -> int:
        return sum(k.nbytes + v.nbytes for k, v in self.rows)

    def num_rows(self, layer: int) -> int:
        return int(self.kept[layer].numel()) + int(self.rows[layer][0].shape[0])

    def read(self, layer: int, layout: PagedLayout,
             cache: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:  # fmt: skip
        """Layer ``layer``'s own prompt rows: K, V [m_l + p_l, Hkv, D] (order is free: attention
        sums over rows)."""
        k, v = layout.read(cache, self.kept[layer].to(cache.device))
        mk, mv = self.rows[layer]
        return torch.cat((k.cpu(), mk)), torch.cat((v.cpu(), mv))


@dataclass(frozen=True)
class Release:
    """What a reader gives back: ``indices`` into its block list and their ``block_ids``, and
    its mirror."""

    indices: list[int]
    block_ids: list[int]
    mirror: Mirror


def releasable_blocks(ranges: list[tuple[int, int]], first: int, num_tokens: int,
                      block_size: int, num_blocks: int) -> list[int]:  # fmt: skip
    """Indices of the blocks whose every token lies inside one of ``ranges`` (prompt tokens
    [start, end) of reused segments), at or after ``first`` and before ``num_tokens``."""
    covered = torch.zeros(num_tokens, dtype=torch.bool)
    for start, end in ranges:
        covered[max(start, first) : min(end, num_tokens)] = True
    full = num_tokens // block_size
    per_block = covered[: full * block_size].view(full, block_size).all(1) if full else covered[:0]
    return [int(b) for b in torch.nonzero(per_block).flatten() if int(b) < num_blocks]


def take_mirror(own_slots: list[torch.Tensor], released: list[int], block_size: int,
                layout: PagedLayout, caches: list[torch.Tensor]) -> Mirror:  # fmt: skip
    """The mirror of a reader whose blocks ``released`` (block ids) go: per layer, its own prompt
    rows (``own_slots[l]`` [P_l] int64) in those blocks, copied out of ``caches`` now."""
    gone = torch.tensor(released, dtype=torch.int64)
    rows, kept = [], []
    for slots, cache in zip(own_slots, caches, strict=True):
        inside = torch.isin(slots // block_size, gone)
        k, v = layout.read(cache, slots[inside].to(cache.device))
        rows.append((k.cpu().clone(), v.cpu().clone()))
        kept.append(slots[~inside])
    return Mirror(rows, kept)


class Sharing:
    """The worker's releases (one per engine, owned by `CascadeDecode`): ``off`` says why no block
    goes back in this engine (None: they may); the mirrors held at once stay within ``cap``
    bytes (``kmesh.share_kv_host_bytes``)."""

    def __init__(self, off: str | None, cap: int = 1 << 62) -> None:
        self.off, self.cap = off, cap
        self.pinned: dict[str, int] = {}  # released reader → its mirror's bytes
        self.pending: dict[str, list[tuple[int, int]]] = {}  # for the scheduler: (index, id)

    def consider(self, plan: DecodePlanLike, block_size: int, layout: PagedLayout,
                 caches: list[torch.Tensor]) -> tuple[str, int | str]:  # fmt: skip
        """Give back ``plan``'s segment blocks if it may (just armed); → its report field:
        (``mirror_bytes``, bytes) when it did, (``kv_share_off``, why not) when not."""
        if self.off is not None:
            return "kv_share_off", self.off
        indices = _releasable(plan, block_size)
        if not indices:
            return "kv_share_off", "no block of its prompt holds only rows of reused segments"
        ids = [plan.block_ids[i] for i in indices]
        mirror = take_mirror(plan.own_slots, ids, block_size, layout, caches)
        if self.mirror_bytes + mirror.nbytes > self.cap:
            return "kv_share_off", (
                f"kmesh.share_kv_host_bytes={self.cap} reached ({self.mirror_bytes} bytes of "
                f"mirrors held, this one {mirror.nbytes}): its blocks stay"
            )
        plan.release = Release(indices, ids, mirror)
        self.pinned[plan.req_id] = mirror.nbytes
        self.pending[plan.req_id] = list(zip(indices, ids, strict=True))
        return "mirror_bytes", mirror.nbytes

    def releasable(self, plan: DecodePlanLike, block_size: int) -> int:
        """How many of ``plan``'s blocks `consider` would give back (0 where none may go)."""
        return 0 if self.off is not None else len(_releasable(plan, block_size))

    def forget(self, req_id: str) -> None:
        self.pinned.pop(req_id, None)
        self.pending.pop(req_id, None)

    def take(self) -> dict[str, list[tuple[int, int]]]:
        out, self.pending = self.pending, {}
        return out

    @property
    def mirror_bytes(self) -> int:
        return sum(self.pinned.values())


def _releasable(plan: DecodePlanLike, block_size: int) -> list[int]:
    """`releasable_blocks` of ``plan``: its reused segments' prompt tokens."""
    ranges = [(use.start, use.end) for use in plan.uses]
    return releasable_blocks(ranges, plan.first, plan.num_tokens, block_size, len(plan.block_ids))
