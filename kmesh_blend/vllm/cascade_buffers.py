"""The buffers a set of cascade requests decodes from, per layer: own rows, biases, rotations.

Owned by `kmesh_blend.vllm.cascade_decode` (one `Composition` per set of requests decoding
together, kept step after step while the set stays the same). Each request's own rows (the prompt
rows it does not read from a master, copied out of its paged blocks once, then its generated
rows, appended every step) in one of two layouts: fp32 copies for the plain-torch path, or the
KV dtype in the CPU kernel's tiles (`kmesh_blend.cpu.layout`). Plain torch, no vLLM import.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, NamedTuple

import torch

from kmesh_blend.attention.decode import MASKED, OwnRows
from kmesh_blend.cpu.layout import pair_values, tile_keys
from kmesh_blend.models.rope import RotaryEmbedding
from kmesh_blend.vllm.decode_plan import DecodePlan, MasterUse, SharedMaster
from kmesh_blend.vllm.paged import PagedLayout

if TYPE_CHECKING:
    from kmesh_blend.vllm.seam.cpu_attention import StepBatch

__all__ = ["HEADROOM", "Composition", "Layer", "Sources", "compose", "grown"]

HEADROOM = 32  # own columns for generated rows added at a time (buffers grow by copying)


class Sources(NamedTuple):
    """Where buffers come from: the live masters by key, the paged caches (one per layer) and
    their layout, the model's rotary embedding."""

    masters: dict[str, SharedMaster]
    caches: list[torch.Tensor]
    layout: PagedLayout
    rope: RotaryEmbedding


class Layer(NamedTuple):
    """One layer's buffers of a set of plans decoding together (n requests).

    own: each request's own rows — prompt rows it does not read from a master, then its
    generated rows — torch path: fp32 k_t [n, Hkv, D, C] and v [n, Hkv, C, D]; kernel: the KV
    dtype, k [n, Hkv, C/16, D/2, 16, 2] and v [n, Hkv, C/2, D, 2] (C a multiple of 16).
    ``first_free`` [n] int64: where request r's generated rows start. bias: [n, C + ΣS] fp32
    over own rows then masters.
    """

    own: OwnRows
    first_free: torch.Tensor
    bias: torch.Tensor


class Composition(NamedTuple):
    """A set of requests (``key``: their ids, in batch order) and their buffers per layer."""

    key: tuple[str, ...]
    layers: list[Layer]
    # one level per master and k-th use of it in a request, with −Δ per request [n] int64
    masters: list[tuple[SharedMaster, torch.Tensor]]
    rotations: list[torch.Tensor]  # per master [n, D, D] fp32: q · R rotates q by −Δ (kernel)
    filled: list[int]  # generated rows in the buffers, per request (all layers)
    capacity: int  # own columns C − the widest prompt part: room for generated rows


def compose(
    batch: StepBatch,
    chosen: list[tuple[int, DecodePlan]],
    generated: list[int],
    last: Composition | None,
    src: Sources,
    kv_heads_dim: tuple[int, int],
    tiled: bool,
) -> Composition:
    """The buffers of the plans ``chosen`` (batch row, plan) decoding together, each with
    ``generated`` rows so far: ``last`` while the set is the same and each request has exactly
    one row more (grown when full), else new buffers — each request's own rows copied from
    ``last`` where they are current there (it decoded in the last step), else read from the
    paged cache (and its mirror). ``tiled``: the CPU kernel's layouts
    (`kmesh_blend.cpu.layout`), else fp32 copies for the torch path."""
    key = tuple(plan.req_id for _, plan in chosen)
    if last is not None and last.key == key and last.filled == generated:
        return last if max(generated) < last.capacity else grown(last, HEADROOM)
    n, block_size = len(chosen), src.layout.block_size
    kv_heads, dim = kv_heads_dim
    capacity = max(generated) + HEADROOM
    # requests whose rows `last` holds up to date: their index there
    carried: dict[int, int] = {}
    if last is not None:
        where = {req_id: r for r, req_id in enumerate(last.key)}
        for r, (_, plan) in enumerate(chosen):
            old = where.get(plan.req_id)
            if old is not None and last.filled[old] == generated[r]:
                carried[r] = old
    # One master level per (master, k-th use of it in a request): a prompt that reads one
    # document twice attends to both copies, each at its own offset (one Δ per level).
    readers: dict[tuple[str, int], list[tuple[int, MasterUse, torch.Tensor]]] = {}
    for r, (_, plan) in enumerate(chosen):
        seen: dict[str, int] = {}
        for use, rows in zip(plan.uses, plan.shared, strict=True):
            nth = seen[use.key] = seen.get(use.key, -1) + 1
            readers.setdefault((use.key, nth), []).append((r, use, rows))
    masters = []
    for (master_key, _), group in readers.items():
        master = src.masters[master_key]
        deltas = torch.zeros(n, dtype=torch.int64)
        for r, use, _ in group:
            deltas[r] = use.start - master.first
        masters.append((master, -deltas, group))
    layers: list[Layer] = []
    for layer, cache in enumerate(src.caches):
        prompt = [plan.num_own(layer) for _, plan in chosen]
        width = max(prompt) + capacity
        if tiled:  # whole tiles of 16 keys
            width += -width % 16
        # the torch path computes on fp32 copies, as its masters (`SharedMaster`)
        own_dtype = cache.dtype if tiled else torch.float32
        own = _empty_rows(n, kv_heads, dim, width, own_dtype, tiled)
        parts = [torch.full((n, width), MASKED)]
        for r, (i, plan) in enumerate(chosen):
            n_rows = prompt[r] + generated[r]
            parts[0][r, :n_rows] = 0.0
            if r in carried:
                assert last is not None
                _copy_rows(last.layers[layer].own, carried[r], own, r, n_rows, tiled)
                continue
            # its prompt rows, then its generated rows (in blocks after its prompt: never given
            # back)
            pos = torch.arange(plan.num_tokens, plan.num_tokens + generated[r])
            blocks = batch.block_table[i].to(torch.int64)[pos // block_size]
            slots = blocks * block_size + pos % block_size
            gk, gv = src.layout.read(cache, slots.to(cache.device))
            pk, pv = plan.own_rows(layer, src.layout, cache)
            rk = torch.cat((pk, gk.cpu())).to(own_dtype).permute(1, 2, 0)  # [Hkv, D, n_rows]
            rv = torch.cat((pv, gv.cpu())).to(own_dtype).transpose(0, 1)  # [Hkv, n_rows, D]
            if tiled:
                tiles, pairs = tile_keys(rk), pair_values(rv)
                own.k_t[r, :, : tiles.shape[1]] = tiles
                own.v[r, :, : pairs.shape[1]] = pairs
            else:
                own.k_t[r, :, :, :n_rows] = rk
                own.v[r, :, :n_rows] = rv
        for master, _, group in masters:
            reads = torch.full((n, master.size), MASKED)
            for r, _, rows in group:
                reads[r] = torch.where(rows[layer], 0.0, MASKED)
            parts.append(reads)
        first_free = torch.tensor(prompt, dtype=torch.int64)
        layers.append(Layer(own, first_free, torch.cat(parts, dim=1)))
    rotations = []
    if tiled:  # q · R = the query rotated by −Δ (RoPE is linear in q)
        basis = torch.eye(dim).expand(n, -1, -1).contiguous()
        rotations = [src.rope.apply(basis, back).contiguous() for _, back, _ in masters]
    return Composition(
        key,
        layers,
        [(m, back) for m, back, _ in masters],
        rotations,
        list(generated),
        capacity,
    )


def _empty_rows(n: int, kv_heads: int, dim: int, width: int, dtype: torch.dtype,
                tiled: bool) -> OwnRows:  # fmt: skip
    """Zeroed own rows for n requests of ``width`` columns, in the layout of `Layer.own`."""
    if tiled:
        return OwnRows(torch.zeros(n, kv_heads, width // 16, dim // 2, 16, 2, dtype=dtype),
                       torch.zeros(n, kv_heads, width // 2, dim, 2, dtype=dtype))  # fmt: skip
    return OwnRows(torch.zeros(n, kv_heads, dim, width, dtype=dtype),
                   torch.zeros(n, kv_heads, width, dim, dtype=dtype))  # fmt: skip


def _copy_rows(src: OwnRows, old: int, dst: OwnRows, r: int, n_rows: int, tiled: bool) -> None:
    """Request ``old``'s first ``n_rows`` own rows of ``src`` into request ``r`` of ``dst``
    (whole tiles / pairs: what lies past ``n_rows`` in them is masked)."""
    if tiled:
        tiles, pairs = -(-n_rows // 16), -(-n_rows // 2)
        dst.k_t[r, :, :tiles] = src.k_t[old, :, :tiles]
        dst.v[r, :, :pairs] = src.v[old, :, :pairs]
    else:
        dst.k_t[r, ..., :n_rows] = src.k_t[old, ..., :n_rows]
        dst.v[r, :, :n_rows] = src.v[old, :, :n_rows]


def grown(old: Composition, extra: int) -> Composition:
    """``old`` with ``extra`` (a multiple of 16) more own columns per layer (copied, not gathered
    again)."""
    layers = []
    for buffers in old.layers:
        k_t, v = buffers.own
        if k_t.dim() == 6:  # the kernel's tiles: new tiles and pairs at the end
            width = k_t.shape[2] * 16
            new_k = torch.cat((k_t, k_t.new_zeros(*k_t.shape[:2], extra // 16, *k_t.shape[3:])), 2)
            new_v = torch.cat((v, v.new_zeros(*v.shape[:2], extra // 2, *v.shape[3:])), 2)
        else:
            width = k_t.shape[-1]
            new_k = k_t.new_zeros((*k_t.shape[:-1], width + extra))
            new_v = v.new_zeros((v.shape[0], v.shape[1], width + extra, v.shape[3]))
            new_k[..., :width], new_v[:, :, :width] = k_t, v
        pad = torch.full((k_t.shape[0], extra), MASKED)
        bias = torch.cat((buffers.bias[:, :width], pad, buffers.bias[:, width:]), dim=1)
        layers.append(Layer(OwnRows(new_k, new_v), buffers.first_free, bias))
    return old._replace(layers=layers, capacity=old.capacity + extra)
