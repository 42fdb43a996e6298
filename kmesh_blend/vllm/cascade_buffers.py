"""The buffers cascade requests decode from: own rows in a pool, and the levels of a set.

Owned by `kmesh_blend.vllm.cascade_decode`. Each request's own rows (the prompt rows it does not
read from a master, then its generated rows) live in one slot of an `OwnPool` from its first
cascade step to its last: read out of its paged blocks (and mirror) once, then appended in place
by every step (the CPU kernel writes this step's key/value into the slot itself). A `Composition`
is what a set of requests decoding together adds: their slots, and per group of requests that
read common masters (a family) one level per master use (read masks, the query rotations): a
request never scores a master it does not read. When the set changes (a request joins or leaves,
which under load is most steps) only the composition is built again; the own rows stay where
they are. Two layouts:
fp32 copies for the plain-torch path, or the KV dtype in the CPU kernel's tiles
(`kmesh_blend.cpu.layout`). Plain torch, no vLLM import.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, NamedTuple

import torch

from kmesh_blend.attention.decode import MASKED
from kmesh_blend.cpu import fill_own_op
from kmesh_blend.cpu.layout import pair_values, tile_keys
from kmesh_blend.models.rope import RotaryEmbedding
from kmesh_blend.vllm.decode_plan import DecodePlan, MasterUse, SharedMaster
from kmesh_blend.vllm.paged import PagedLayout

if TYPE_CHECKING:
    from kmesh_blend.vllm.seam.cpu_attention import StepBatch

__all__ = [
    "HEADROOM",
    "Composition",
    "Group",
    "Level",
    "OwnPool",
    "Sources",
    "compose",
    "partition",
]

HEADROOM = 32  # own columns added at least when a slot runs out (the pool grows by copying)
FIRST_SLOTS = 4  # slots of a new pool (doubled when all are taken)


class Sources(NamedTuple):
    """Where buffers come from: the live masters by key, the paged caches (one per layer) and
    their layout, the model's rotary embedding; ``intact``: readers whose blocks went back in
    this step, which still hold their rows until the step ends (the scheduler takes them after)."""

    masters: dict[str, SharedMaster]
    caches: list[torch.Tensor]
    layout: PagedLayout
    rope: RotaryEmbedding
    intact: frozenset[str] = frozenset()


class OwnPool:
    """Every cascade request's own rows, one slot each (P slots of C columns), per layer.

    Torch path: fp32 ``k[l]`` [P, Hkv, D, C] (keys transposed) and ``v[l]`` [P, Hkv, C, D];
    kernel (``tiled``): the KV dtype, ``k[l]`` [P, Hkv, C/16, D/2, 16, 2] and ``v[l]``
    [P, Hkv, C/2, D, 2], C a multiple of 16. ``bias`` [L, P, C] fp32: 0 where a slot's column
    holds a row, MASKED elsewhere (columns past a slot's rows are never read unmasked: stale
    but finite). ``first_free`` [L, P] int64: where the slot's generated rows start (its own
    prompt rows in that layer); ``filled`` [P]: its generated rows held."""

    def __init__(self, num_layers: int, kv_heads_dim: tuple[int, int], dtype: torch.dtype,
                 tiled: bool) -> None:  # fmt: skip
        self.num_layers, (self.kv_heads, self.dim) = num_layers, kv_heads_dim
        self.dtype = dtype if tiled else torch.float32  # the torch path computes in fp32
        self.tiled = tiled
        self.slots: dict[str, int] = {}
        self.filled: list[int] = []
        self.generation = 0  # counts storage replacements (views of older tensors are stale)
        self._clear(0, 0)

    @property
    def size(self) -> int:
        """Slots P."""
        return len(self.filled)

    @property
    def width(self) -> int:
        """Columns C per slot."""
        return int(self.bias.shape[2])

    @property
    def nbytes(self) -> int:
        return sum(t.nbytes for t in (*self.k, *self.v, self.bias))

    def _clear(self, slots: int, width: int) -> None:
        self.generation += 1
        self.k = [self._zeros_k(slots, width) for _ in range(self.num_layers)]
        self.v = [self._zeros_v(slots, width) for _ in range(self.num_layers)]
        self.bias = torch.full((self.num_layers, slots, width), MASKED)
        self.first_free = torch.zeros(self.num_layers, slots, dtype=torch.int64)
        self.filled = [0] * slots

    def _zeros_k(self, slots: int, width: int) -> torch.Tensor:
        heads, dim = self.kv_heads, self.dim
        if self.tiled:
            return torch.zeros(slots, heads, width // 16, dim // 2, 16, 2, dtype=self.dtype)
        return torch.zeros(slots, heads, dim, width, dtype=self.dtype)

    def _zeros_v(self, slots: int, width: int) -> torch.Tensor:
        heads, dim = self.kv_heads, self.dim
        if self.tiled:
            return torch.zeros(slots, heads, width // 2, dim, 2, dtype=self.dtype)
        return torch.zeros(slots, heads, width, dim, dtype=self.dtype)

    def release(self, req_id: str) -> None:
        """Free ``req_id``'s slot (all storage once the pool is empty: nothing held while idle)."""
        slot = self.slots.pop(req_id, None)
        if slot is None:
            return
        if not self.slots:
            self._clear(0, 0)
            return
        self.bias[:, slot] = MASKED
        self.filled[slot] = 0

    def ensure(self, columns: int) -> None:
        """Room for ``columns`` columns in every slot (grown by at least half, copied)."""
        if columns <= self.width:
            return
        width = max(columns + HEADROOM, self.width + self.width // 2)
        width += -width % 16
        self._resize(self.size, width)

    def _resize(self, slots: int, width: int) -> None:
        old_k, old_v, old_bias, old_first = self.k, self.v, self.bias, self.first_free
        old_filled, p, c = self.filled, self.size, self.width
        self._clear(slots, width)
        for layer in range(self.num_layers):
            if self.tiled:
                self.k[layer][:p, :, : c // 16] = old_k[layer]
                self.v[layer][:p, :, : c // 2] = old_v[layer]
            else:
                self.k[layer][:p, ..., :c] = old_k[layer]
                self.v[layer][:p, :, :c] = old_v[layer]
        self.bias[:, :p, :c] = old_bias
        self.first_free[:, :p] = old_first
        self.filled[:p] = old_filled

    def place(self, plan: DecodePlan, block_row: torch.Tensor, generated: int,
              src: Sources) -> int:  # fmt: skip
        """``plan``'s slot, holding its own prompt rows and ``generated`` generated rows: taken
        and filled from the paged cache (and its mirror) the first time, filled again when the
        rows it holds are not current (the request ran steps on vLLM's kernel meanwhile)."""
        slot = self.slots.get(plan.req_id)
        if slot is not None and self.filled[slot] == generated:
            return slot
        if slot is None:
            taken = set(self.slots.values())
            slot = next((s for s in range(self.size) if s not in taken), self.size)
            if slot == self.size:
                self._resize(max(FIRST_SLOTS, 2 * self.size), self.width)
            self.slots[plan.req_id] = slot
        own = [plan.num_own(layer) for layer in range(self.num_layers)]
        self.ensure(max(own) + generated + 1)
        block_size = src.layout.block_size
        pos = torch.arange(plan.num_tokens, plan.num_tokens + generated)
        blocks = block_row.to(torch.int64)[pos // block_size]
        slots = blocks * block_size + pos % block_size  # its generated rows (never given back)
        in_blocks = plan.release is None or plan.req_id in src.intact
        fill = fill_own_op() if self.tiled and in_blocks else None
        one_pass = fill is not None and not src.layout.packed and src.caches[0].device.type == "cpu"
        if fill is not None and one_pass:
            views = [src.layout.views(cache) for cache in src.caches]  # one pass, every layer
            rows = [torch.cat((plan.own_slots[layer], slots)) for layer in range(len(views))]
            fill([k for k, _ in views], [v for _, v in views], rows, self.k, self.v, slot)
        for layer, cache in enumerate([] if one_pass else src.caches):
            # its prompt rows (its blocks, or its mirror once blocks went), then its generated
            gk, gv = src.layout.read(cache, slots.to(cache.device))
            pk, pv = plan.own_rows(layer, src.layout, cache)
            rk = torch.cat((pk, gk.cpu())).to(self.dtype).permute(1, 2, 0)  # [Hkv, D, rows]
            rv = torch.cat((pv, gv.cpu())).to(self.dtype).transpose(0, 1)  # [Hkv, rows, D]
            if self.tiled:  # whole tiles / pairs: what lies past the rows in them is masked
                tiles, pairs = tile_keys(rk), pair_values(rv)
                self.k[layer][slot, :, : tiles.shape[1]] = tiles
                self.v[layer][slot, :, : pairs.shape[1]] = pairs
            else:
                self.k[layer][slot, ..., : rk.shape[-1]] = rk
                self.v[layer][slot, :, : rv.shape[1]] = rv
        rows_held = torch.tensor(own, dtype=torch.int64)[:, None] + generated  # [L, 1]
        self.bias[:, slot] = torch.where(torch.arange(self.width) < rows_held, 0.0, MASKED)
        self.first_free[:, slot] = torch.tensor(own, dtype=torch.int64)
        self.filled[slot] = generated
        return slot


class Level(NamedTuple):
    """One master level of a group of g requests: the master, −Δ per request [g] int64, and per
    layer which of its rows each request reads, ``bias`` [L, g, S] fp32 (0 or MASKED)."""

    master: SharedMaster
    back: torch.Tensor
    bias: torch.Tensor


class Group(NamedTuple):
    """Requests of a set joined by the masters they read (a family), with the levels of those
    masters only: no request scores a master it does not read."""

    rows: torch.Tensor  # [g] int64: the requests' places in the set
    slots: torch.Tensor  # [g] int64: their slots in the pool
    first_free: torch.Tensor  # [L, g] int64: where their generated rows start
    # one level per master and k-th use of it in a request
    levels: list[Level]
    rotations: list[torch.Tensor]  # per level [g, D, D] fp32: q · R rotates q by −Δ (kernel)


class Composition(NamedTuple):
    """A set of requests (``key``: their ids, in batch order) decoding together: their slots,
    and their groups."""

    key: tuple[str, ...]
    slots: list[int]
    groups: list[Group]


def compose(
    batch: StepBatch,
    chosen: list[tuple[int, DecodePlan]],
    generated: list[int],
    last: Composition | None,
    pool: OwnPool,
    src: Sources,
) -> Composition:
    """The composition of the plans ``chosen`` (batch row, plan) decoding together, each with
    ``generated`` rows so far; their slots in ``pool`` placed (`OwnPool.place`) and made room
    for this step's row. ``last`` while the set is the same."""
    slots = [
        pool.place(plan, batch.block_table[i], generated[r], src)
        for r, (i, plan) in enumerate(chosen)
    ]
    pool.ensure(int((pool.first_free[:, slots].max(0).values + torch.tensor(generated)).max()) + 1)
    key = tuple(plan.req_id for _, plan in chosen)
    if last is not None and last.key == key and last.slots == slots:
        return last
    plans = [plan for _, plan in chosen]
    groups = [_group(members, plans, slots, pool, src) for members in partition(plans)]
    return Composition(key, slots, groups)


def partition(plans: list[DecodePlan]) -> list[list[int]]:
    """``plans``' places grouped by the masters they read: two plans that read a common master
    are in one group (ascending, groups in the order of their first plan)."""
    parent = list(range(len(plans)))

    def root(r: int) -> int:
        while parent[r] != r:
            parent[r] = parent[parent[r]]
            r = parent[r]
        return r

    first: dict[str, int] = {}  # master key → the first plan reading it
    for r, plan in enumerate(plans):
        for use in plan.uses:
            if use.key in first:
                parent[root(r)] = root(first[use.key])
            else:
                first[use.key] = r
    groups: dict[int, list[int]] = {}
    for r in range(len(plans)):
        groups.setdefault(root(r), []).append(r)
    return list(groups.values())


def _group(members: list[int], plans: list[DecodePlan], slots: list[int], pool: OwnPool,
           src: Sources) -> Group:  # fmt: skip
    # One master level per (master, k-th use of it in a request): a prompt that reads one
    # document twice attends to both copies, each at its own offset (one Δ per level).
    readers: dict[tuple[str, int], list[tuple[int, MasterUse, int]]] = {}
    for j, r in enumerate(members):
        seen: dict[str, int] = {}
        for u, use in enumerate(plans[r].uses):
            nth = seen[use.key] = seen.get(use.key, -1) + 1
            readers.setdefault((use.key, nth), []).append((j, use, u))
    g, num_layers = len(members), len(src.caches)
    levels, rotations, rope = [], [], src.rope if pool.tiled else None
    for (master_key, _), group in readers.items():
        master = src.masters[master_key]
        deltas = torch.zeros(g, dtype=torch.int64)
        bias = torch.full((num_layers, g, master.size), MASKED)
        # q · R = the query rotated by −Δ (RoPE is linear in q); identity where not read
        rotation = torch.eye(pool.dim).repeat(g, 1, 1) if pool.tiled else None
        for j, use, u in group:
            deltas[j] = use.start - master.first
            mask, turn = plans[members[j]].level_part(u, master.first, rope, pool.dim)
            bias[:, j] = mask
            if rotation is not None and turn is not None:
                rotation[j] = turn
        levels.append(Level(master, -deltas, bias))
        rotations += [] if rotation is None else [rotation]
    index = torch.tensor([slots[r] for r in members], dtype=torch.int64)
    return Group(torch.tensor(members, dtype=torch.int64), index, pool.first_free[:, index],
                 levels, rotations)  # fmt: skip
