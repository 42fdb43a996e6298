"""Turns: a blended request's prompt KV kept as mirrors, restored when the request continues.

A request annotated ``"keep": true`` that reused segments has, after its prefill, prompt KV
[L, 2, T, Hkv, D] in vLLM's paged cache: for each segment it used, the master re-positioned
except the rows it recomputed; everywhere else its own private rows. `save_turn` stores that as
one *turn record*: a Master–Mirror diff per segment use (`MirrorStore`: versioned against its
master, checksummed, the master pinned while the mirror lives) plus the private rows dense.
When the same request comes back — its next prompt starts with the whole earlier prompt, the
segments at the same places — the scheduler side reports those T tokens as matched and
`restore_turn` writes them back into the new blocks, bit for bit, instead of blending again;
vLLM computes what follows (the earlier answer and the new turn).

Record layout (one store object, ``put_blob``): an 8-byte little-endian header length, the header
(JSON: ``tokens``, ``uses`` = [[start, end, segment id, mirror id], ...], ``private`` = the
uncovered token positions, ``shape`` = [L, Hkv, D], ``dtype``, ``digest`` = BLAKE2b of the body),
then the body: the private rows [L, 2, n, Hkv, D] as raw bytes. Any mismatch when reading it
back (missing, malformed, digest, shape, a mirror that fails its own checks) is a reason string:
the request recomputes.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import logging
from collections.abc import Mapping, Sequence

import torch

from kmesh_blend.mirror.lifecycle import MirrorStore
from kmesh_blend.mirror.reference import restore_layer_reference
from kmesh_blend.mirror.restore import plan_restore, restore_layer
from kmesh_blend.segments.cache import SegmentCache
from kmesh_blend.segments.identity import Namespace, SegmentId, segment_id
from kmesh_blend.segments.master import Master
from kmesh_blend.vllm.meta import KMeshWorkerMetadata, LoadRequest, SegmentRef
from kmesh_blend.vllm.paged import PagedLayout

__all__ = ["keep_turn", "restore_turn", "save_turn", "turn_id"]

log = logging.getLogger("vllm.kmesh_blend")  # under vLLM's handlers and format

_HEADER_LEN = 8


def turn_id(namespace: Namespace, token_ids: Sequence[int]) -> str:
    """Id of the turn record of a prompt ``token_ids`` [T] (apart from every segment id)."""
    turns = dataclasses.replace(namespace, cache_salt=namespace.cache_salt + "\x00turn")
    return str(segment_id(turns, token_ids))


def save_turn(
    mirrors: MirrorStore,
    record_id: str,
    kv: torch.Tensor,
    uses: Sequence[SegmentRef],
    masters: Mapping[SegmentId, Master],
    inv_freq: torch.Tensor,
) -> int:
    """Store the turn record of a prompt's KV ``kv`` [L, 2, T, Hkv, D]; its bytes, 0 on failure.

    ``masters``: segment id → `Master` of every use (already fetched by the blend).
    """
    T = kv.shape[2]
    covered = torch.zeros(T, dtype=torch.bool)
    entries: list[list[int | str]] = []
    mids: list[str] = []
    for use in uses:
        positions = torch.arange(use.start, use.end, dtype=torch.int64)
        mid = mirrors.put(
            SegmentId(use.segment_id), masters[use.segment_id], kv[:, 0, use.start : use.end],
            kv[:, 1, use.start : use.end], positions, inv_freq, owner=record_id,
        )  # fmt: skip
        if mid is None:
            return 0
        covered[use.start : use.end] = True
        entries.append([use.start, use.end, use.segment_id, str(mid)])
        mids.append(str(mid))
    private = (~covered).nonzero().squeeze(1)
    body = kv[:, :, private].contiguous().view(torch.uint8).numpy().tobytes()
    header = json.dumps(
        {
            "tokens": T,
            "uses": entries,
            "private": private.tolist(),
            "shape": [kv.shape[0], kv.shape[3], kv.shape[4]],
            "dtype": str(kv.dtype).removeprefix("torch."),
            "digest": hashlib.blake2b(body, digest_size=16).hexdigest(),
        }
    ).encode()
    blob = len(header).to_bytes(_HEADER_LEN, "little") + header + body
    ok = mirrors.store.put_blob(SegmentId(record_id), blob)
    return len(blob) + sum(_mirror_bytes(mirrors, m) for m in mids) if ok else 0


def restore_turn(
    mirrors: MirrorStore,
    record_id: str,
    num_tokens: int,
    paged: PagedLayout,
    caches: Sequence[torch.Tensor],
    slots: torch.Tensor,
    inv_freq: torch.Tensor,
) -> str | None:
    """Write a turn record's T = ``num_tokens`` prompt rows at ``slots`` [≥ T] int64 of every
    layer's ``caches``. Returns None, or why it could not (nothing is trusted then: recompute)."""
    blob = mirrors.store.get_blob(SegmentId(record_id))
    if blob is None:
        return "turn record missing"
    try:
        size = int.from_bytes(blob[:_HEADER_LEN], "little")
        header = json.loads(blob[_HEADER_LEN : _HEADER_LEN + size])
        body = blob[_HEADER_LEN + size :]
        L, H, D = (int(x) for x in header["shape"])
        private = torch.tensor(header["private"], dtype=torch.int64)
        dtype = getattr(torch, str(header["dtype"]))
    except (ValueError, KeyError, TypeError, AttributeError) as exc:
        return f"turn record malformed: {type(exc).__name__}"
    if header["tokens"] != num_tokens or len(caches) != L:
        return f"turn record of {header['tokens']} tokens × {L} layers does not fit this request"
    if hashlib.blake2b(body, digest_size=16).hexdigest() != header["digest"]:
        return "turn record checksum mismatch"
    expected = L * 2 * private.numel() * H * D * torch.empty((), dtype=dtype).element_size()
    if len(body) != expected:
        return "turn record truncated"
    rows = torch.frombuffer(bytearray(body), dtype=torch.uint8).view(dtype)
    rows = rows.view(L, 2, private.numel(), H, D)
    slots = slots[:num_tokens]
    plans = []
    for start, end, _, mid in header["uses"]:
        got = mirrors.fetch(SegmentId(mid))
        if got.reason is not None or got.mirror is None or got.master is None:
            return f"segment mirror: {got.reason}"
        try:
            plan = plan_restore(got.master.kv, got.master.positions, got.mirror, inv_freq)
        except ValueError as exc:
            return f"segment mirror: {exc}"
        if got.mirror.num_tokens != end - start:
            return "segment mirror does not fit its span"
        plans.append((plan, got.master.kv, slots[start:end]))
    for layer, cache in enumerate(caches):
        k_view, v_view = paged.views(cache)
        for plan, master_kv, span_slots in plans:
            if paged.packed:  # AMX tiles are no [block, head, offset, dim] view: rows, then write
                k, v = restore_layer_reference(master_kv, plan.master_positions, plan.mirror,
                                               layer, plan.inv_freq.cpu(), plan.row_of)  # fmt: skip
                paged.write(cache, k, v, span_slots)
                continue
            restore_layer(plan, master_kv, layer, k_view, v_view, span_slots, paged.block_size)
        if private.numel():
            paged.write(cache, rows[layer, 0], rows[layer, 1], slots[private])
    return None


def _mirror_bytes(mirrors: MirrorStore, mid: str) -> int:
    info = mirrors.cache.index.get(SegmentId(mid))
    return int(getattr(info, "nbytes", 0) or 0)


def keep_turn(load: LoadRequest, kv: torch.Tensor, mirrors: MirrorStore, cache: SegmentCache,
              inv_freq: torch.Tensor, out: KMeshWorkerMetadata) -> None:  # fmt: skip
    """After the forward: store ``load``'s prompt KV ``kv`` [L, 2, T, Hkv, D] as its turn record
    ``load.keep`` (reported in ``out``; a master gone or a store refusal only logs)."""
    assert load.keep is not None
    masters = {r.segment_id: cache.fetch(r.segment_id).master for r in load.segments}
    found = {sid: m for sid, m in masters.items() if m is not None}
    if len(found) != len(masters):
        log.warning("kmesh: turn of %s not kept: a master is gone", load.req_id)
        return
    size = save_turn(mirrors, load.keep, kv, load.segments, found, inv_freq)
    if size:
        out.turns.append(load.keep)
        out.reports.setdefault(load.req_id, {})["kept_bytes"] = size
    else:
        log.warning("kmesh: turn of %s could not be stored", load.req_id)
