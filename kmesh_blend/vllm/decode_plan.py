"""What one blended request's decode can read from shared masters: verified per layer, per row.

After a request's blended prefill, row j of a segment it reused holds, in layer l, either the
master's row re-positioned (K rotated on by Δ = offset − master start, V unchanged) or a row of
its own (recomputed, from a group leader, from vLLM's prefix cache, or vLLM's own tail tokens).
Which one is not taken from the blend's bookkeeping: `arm` reads the request's paged rows back
and compares them with the master — V bit for bit, K within a rounding tolerance of the master
key rotated by Δ. Only rows that pass read the master in cascade; every other prompt row is in the
request's unique level. A doubtful row therefore costs bandwidth, never correctness.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from kmesh_blend.attention.decode import MASKED
from kmesh_blend.cpu import verify_rows_op
from kmesh_blend.cpu.layout import gemm_chunks, pair_value_rows, tile_key_rows
from kmesh_blend.models.rope import RotaryEmbedding, rotate
from kmesh_blend.segments.master import Master
from kmesh_blend.vllm.kv_release import Release
from kmesh_blend.vllm.paged import PagedLayout, slot_mapping

__all__ = ["DecodePlan", "MasterUse", "SharedMaster"]


@dataclass(frozen=True)
class MasterUse:
    """A stored segment the request reused: prompt rows [start, end) from ``master`` (``kv``
    [L, 2, S, Hkv, D] with K rotated at ``positions`` [S] int64), keyed by ``key``."""

    key: str
    start: int
    end: int
    master: Master


@dataclass
class SharedMaster:
    """A master in the layout the decode reads; ``first`` its first stored position; ``users``
    how many live plans read it (freed at 0).

    Plain (the torch path): k_t [L, Hkv, D, S] and v [L, Hkv, S, D], fp32 whatever the KV dtype
    (converting once beats converting every step). Tiled (the CPU kernel,
    `kmesh_blend.cpu.layout`): k_t [L, Hkv, ceil(S/16), D/2, 16, 2] and v [L, Hkv, ceil(S/2), D,
    2] in the KV dtype itself (the kernel multiplies in fp32; half the bytes in bf16); in chunks
    for the kernel's matrix products (``gemm``, bf16): k_t [L, Hkv, C, D, W] and v [L, Hkv, C,
    W, D] (`kmesh_blend.cpu.layout.gemm_chunks`); ``size`` is S."""

    k_t: torch.Tensor
    v: torch.Tensor
    first: int
    size: int
    users: int = 0

    @classmethod
    def of(cls, master: Master, dtype: torch.dtype, tiled: bool = False,
           gemm: bool = False) -> SharedMaster:  # fmt: skip
        kv = master.kv
        # Through the cache dtype first: the values the paged copies hold.
        k, v = kv[:, 0].to(dtype), kv[:, 1].to(dtype)  # [L, S, Hkv, D]
        first, size = int(master.positions[0]), int(kv.shape[2])
        if tiled and gemm:
            return cls(*gemm_chunks(k, v), first, size)
        if tiled:
            return cls(tile_key_rows(k), pair_value_rows(v), first, size)
        k_t, v = k.permute(0, 2, 3, 1), v.permute(0, 2, 1, 3)
        return cls(k_t.float().contiguous(), v.float().contiguous(), first, size)


@dataclass
class DecodePlan:
    """One request's cascade decode: its prompt blocks, the slots [T] int64 of its T prompt
    tokens, the masters it reads, and (once armed) per use the [L, S] bool rows read from the
    master, and per layer the slots [P_l] int64 of its other prompt rows."""

    req_id: str
    block_ids: list[int]
    slots: torch.Tensor
    uses: list[MasterUse]
    first: int = 0  # the first prompt token the blend wrote (earlier ones: vLLM's prefix cache)
    prompt_len: int | None = None  # its prompt tokens (None: as many as ``slots``)
    max_tokens: int | None = None  # the most tokens it generates (None: unknown)
    armed: bool = False
    steps: int = 0
    shared_rows: int = 0  # prompt rows read from masters, averaged over layers
    shared: list[torch.Tensor] = field(default_factory=list)
    own_slots: list[torch.Tensor] = field(default_factory=list)
    release: Release | None = None  # its segment blocks went back to vLLM's pool: cascade only
    releasable: int = 0  # blocks sharing could give back (set when armed, sharing on)
    # per use (its index in ``uses``), once composed: `level_part`
    level_parts: dict[int, tuple[torch.Tensor, torch.Tensor | None]] = field(default_factory=dict)

    def __post_init__(self) -> None:
        self.blocks = torch.tensor(self.block_ids, dtype=torch.int64)
        self.num_tokens = int(self.slots.numel()) if self.prompt_len is None else self.prompt_len

    def complete(self, block_row: torch.Tensor, block_size: int) -> None:
        """Take the blocks of the prompt's rest from a batch's block-table row [max_blocks] (it
        `holds` this plan's): a prompt vLLM prefilled in chunks after the blend got their blocks
        in later steps; at its first decode step every prompt token has one."""
        if self.slots.numel() >= self.num_tokens:
            return
        ids = block_row[: -(-self.num_tokens // block_size)].to(torch.int64)
        self.block_ids, self.blocks = ids.tolist(), ids
        self.slots = slot_mapping(self.block_ids, block_size, 0, self.num_tokens)

    def steps_left(self, seq_len: int) -> int | None:
        """Decode steps left, this one included, at a step over ``seq_len`` tokens (its prompt
        and what it generated so far): at most ``max_tokens`` less those (None: unknown)."""
        return None if self.max_tokens is None else self.max_tokens - (seq_len - self.num_tokens)

    def holds(self, block_row: torch.Tensor) -> bool:
        """Whether a batch's block-table row [max_blocks] starts with this request's blocks."""
        n = self.blocks.numel()
        return block_row.numel() >= n and torch.equal(block_row[:n].to(torch.int64), self.blocks)

    @property
    def pinned(self) -> bool:
        """Whether only the cascade path may serve it (some of its blocks were given back)."""
        return self.release is not None

    def num_own(self, layer: int) -> int:
        """Its own prompt rows in layer ``layer`` (armed)."""
        if self.release is not None:
            return self.release.mirror.num_rows(layer)
        return int(self.own_slots[layer].numel())

    def own_rows(self, layer: int, layout: PagedLayout,
                 cache: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:  # fmt: skip
        """Its own prompt rows of layer ``layer``: K, V [num_own, Hkv, D] in the cache dtype, read
        from its blocks (and its mirror, once blocks went: a released block is never read)."""
        if self.release is not None:
            return self.release.mirror.read(layer, layout, cache)
        k, v = layout.read(cache, self.own_slots[layer].to(cache.device))
        return k.cpu(), v.cpu()

    def level_part(self, u: int, first: int, rope: RotaryEmbedding | None,
                   dim: int) -> tuple[torch.Tensor, torch.Tensor | None]:  # fmt: skip
        """Its part of the level of use ``u`` (armed; the master held from position ``first``):
        the bias of the rows it reads [L, S] fp32 (0 or MASKED) and, with ``rope``, its query
        rotation by −Δ [D, D] fp32 (``dim`` = D); built once (a set is composed again whenever
        a request joins or leaves)."""
        if (part := self.level_parts.get(u)) is None:
            back = torch.tensor([first - self.uses[u].start])
            turn = None if rope is None else rope.apply(torch.eye(dim)[None], back)[0]
            part = self.level_parts[u] = (torch.where(self.shared[u], 0.0, MASKED), turn)
        return part

    def arm(
        self, layout: PagedLayout, caches: list[torch.Tensor], rope: RotaryEmbedding
    ) -> str | None:
        """Verify the paged rows against the masters; None when armed, else why not."""
        num_layers = len(caches)
        reads = torch.zeros(num_layers, self.num_tokens, dtype=torch.bool)
        verify = verify_rows_op()  # the same test in one pass, where the CPU kernels built
        self.shared, self.level_parts = [], {}
        for use in self.uses:
            kv = use.master.kv
            size = use.end - use.start
            if kv.shape[0] != num_layers or kv.shape[2] != size:
                return f"master {use.key[:16]} has shape {tuple(kv.shape)}"
            slots = self.slots[use.start : use.end]
            # one shift for the whole use: one rotation table, broadcast over its rows
            delta = torch.tensor([use.start - int(use.master.positions[0])])
            rotation = rope.tables(delta, torch.float32)
            rows = torch.zeros(num_layers, size, dtype=torch.bool)
            for layer, cache in enumerate(caches):
                if verify is not None and _one_pass(layout, cache, kv):
                    k_view, v_view = layout.views(cache)
                    rows[layer] = verify(
                        k_view, v_view, slots, kv[layer, 0].contiguous(), kv[layer, 1].contiguous(),
                        rotation.cos[0], rotation.signed_sin[0], *_tolerance(cache.dtype),
                    )  # fmt: skip
                    continue
                k, v = layout.read(cache, slots.to(cache.device))
                k, v = k.cpu(), v.cpu()
                want = rotate(kv[layer, 0].float(), rotation)
                rows[layer] = _same_bits(v, kv[layer, 1].to(v.dtype)) & _close(k, want)
            rows &= ~reads[:, use.start : use.end]  # overlapping uses: the first one reads
            reads[:, use.start : use.end] |= rows
            self.shared.append(rows)
        if not bool(reads.any()):
            return "no prompt row equals its master (every reused row was replaced)"
        self.own_slots = [self.slots[~reads[layer]] for layer in range(num_layers)]
        self.shared_rows = round(int(reads.sum()) / num_layers)
        self.armed = True
        return None


def _one_pass(layout: PagedLayout, cache: torch.Tensor, kv: torch.Tensor) -> bool:
    """Whether `verify_rows.cpp` reads this cache and master: CPU, unpacked, fp32 / bf16."""
    kinds = (torch.float32, torch.bfloat16)
    return not layout.packed and cache.device.type == "cpu" and {cache.dtype, kv.dtype} <= {*kinds}


def _same_bits(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """Rows of ``a`` and ``b`` [n, Hkv, D] (one dtype) equal bit for bit: [n] bool. Compared as
    the widest integers a row divides into (a fraction of the element-wise compare's cost)."""
    n = a.shape[0]
    width = a.shape[1] * a.shape[2] * a.element_size()
    as_int = next(t for t in (torch.int64, torch.int32, torch.int16, torch.int8)
                  if width % t.itemsize == 0)  # fmt: skip
    a, b = a.contiguous().view(n, -1).view(as_int), b.contiguous().view(n, -1).view(as_int)
    return (a == b).all(1)


def _close(k: torch.Tensor, want: torch.Tensor) -> torch.Tensor:
    """Rows of paged keys ``k`` [n, Hkv, D] (cache dtype) within one rounding of ``want`` (fp32,
    the master key rotated here): [n] bool. Most equal ``want`` rounded to the cache dtype bit
    for bit (then they are within it); only the others are measured."""
    close = _same_bits(k, want.to(k.dtype))
    if bool(close.all()):
        return close
    rest = (~close).nonzero().squeeze(1)
    kr, wr = k[rest].float(), want[rest]
    atol, rtol = _tolerance(k.dtype)
    close[rest] = ((kr - wr).abs() <= atol + rtol * wr.abs()).flatten(1).all(1)
    return close


def _tolerance(dtype: torch.dtype) -> tuple[float, float]:
    """(atol, rtol) between a paged key and the master key rotated here: one rounding of the
    rotation in the cache dtype."""
    if dtype == torch.float32:
        return 1e-5, 1e-5
    return 1e-2, 1.6e-2
