"""Masters stored and fetched through LMCache backends: host RAM, disk, lm:// and redis://.

Every tier must return the master byte-identical to what was put (and to the host-RAM path),
positions included, and must refuse a master whose bytes were tampered with.
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

from kmesh_blend.segments.identity import make_namespace, segment_id
from kmesh_blend.segments.lmcache_tiers import make_key
from kmesh_blend.segments.master import MasterLayout, MasterMeta
from kmesh_blend.segments.store import LMCacheMasterStore, open_store

LAYOUT = MasterLayout(num_layers=4, num_kv_heads=2, head_dim=32, dtype="bfloat16")
NS = make_namespace("tiny", "bfloat16", num_layers=4, num_kv_heads=2, head_dim=32)
MiB = 1 << 20

logging.getLogger("LMCache").setLevel(logging.WARNING)


def _master(seed: int, tokens: int) -> tuple[str, torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    kv = torch.randn(4, 2, tokens, 2, 32, generator=g).to(torch.bfloat16)
    positions = torch.arange(100 + seed, 100 + seed + tokens, dtype=torch.int64)
    return segment_id(NS, list(range(seed, seed + tokens))), kv, positions


@pytest.fixture(params=["cpu", "disk", "lm", "redis"])
def store(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[LMCacheMasterStore]:
    kind = request.param
    url = {
        "cpu": "cpu",
        "disk": f"disk://{tmp_path}/kv",
    }.get(kind) or request.getfixturevalue({"lm": "lm_server", "redis": "redis_server"}[kind])
    s = open_store(url, LAYOUT, cpu_bytes=64 * MiB)
    try:
        yield s
    finally:
        s.close()


def test_round_trip_byte_identical(store: LMCacheMasterStore) -> None:
    reference = open_store("cpu", LAYOUT, cpu_bytes=64 * MiB)
    try:
        for seed, tokens in ((1, 1), (2, 37), (3, 300)):
            sid, kv, pos = _master(seed, tokens)
            assert store.put(sid, kv, pos)
            assert reference.put(sid, kv, pos)
            got, ref = store.get(sid), reference.get(sid)
            assert got is not None and ref is not None
            assert got.kv.dtype == torch.bfloat16 and got.kv.shape == (4, 2, tokens, 2, 32)
            assert torch.equal(got.kv.view(torch.int16), kv.view(torch.int16))  # bit-exact
            assert torch.equal(got.kv.view(torch.int16), ref.kv.view(torch.int16))
            assert torch.equal(got.positions, pos) and torch.equal(ref.positions, pos)
            assert got.kv.data_ptr() != kv.data_ptr()  # a copy, not the caller's tensor
    finally:
        reference.close()


def test_missing_and_delete(store: LMCacheMasterStore) -> None:
    sid, kv, pos = _master(7, 16)
    assert store.get(sid) is None
    assert store.put(sid, kv, pos)
    assert store.contains(sid)
    deleted = store.delete(sid)
    if store.tier == "lm":
        assert not deleted  # the LMCache server has no delete: documented limitation
    else:
        assert deleted and store.get(sid) is None


def test_tampered_master_is_refused(store: LMCacheMasterStore) -> None:
    sid, kv, pos = _master(11, 8)
    _, other_kv, _ = _master(12, 8)
    assert store.put(sid, kv, pos)
    # overwrite the KV object of `sid` with different bytes of the same shape
    from kmesh_blend.segments.lmcache_tiers import make_key

    bad = other_kv.clone()
    obj = store._backend.allocate((2, 4, 8, 64), torch.bfloat16)
    obj.tensor.copy_(bad.permute(1, 0, 2, 3, 4).reshape(2, 4, 8, 64))
    key = make_key("kmesh", sid, torch.bfloat16)
    if store.tier in ("cpu", "disk"):
        store._backend.remove(key)
    store._backend.put(key, obj)
    obj.ref_count_down()
    assert store.get(sid) is None
    assert store.num_corrupt == 1


def test_bad_input_is_rejected() -> None:
    store = open_store("cpu", LAYOUT, cpu_bytes=8 * MiB)
    try:
        sid, kv, pos = _master(1, 4)
        with pytest.raises(ValueError, match="dtype"):
            store.put(sid, kv.float(), pos)
        with pytest.raises(ValueError, match="positions"):
            store.put(sid, kv, pos[:2])
        with pytest.raises(ValueError, match="shape"):
            store.put(sid, kv[:, :, :, :1], pos)
    finally:
        store.close()


def test_meta_codec() -> None:
    meta = MasterMeta(3, (4, 2, 3, 2, 32), "bfloat16", "ab" * 16, (5, 6, 9))
    assert MasterMeta.decode(meta.encode()) == meta
    with pytest.raises(ValueError):
        MasterMeta.decode(b"XXXX" + meta.encode()[4:])
    with pytest.raises(ValueError):
        MasterMeta.decode(meta.encode()[:-8])


def _overwrite(store: LMCacheMasterStore, prefix: str, sid: str, obj_bytes: Any) -> None:
    """Replace one stored object of ``sid`` (an attacker with write access to the store)."""
    from kmesh_blend.segments.lmcache_tiers import make_key

    tensor, dtype = obj_bytes
    obj = store._backend.allocate(tuple(tensor.shape), dtype)
    obj.tensor.copy_(tensor)
    key = make_key(prefix, sid, dtype)
    if store.tier in ("cpu", "disk"):
        store._backend.remove(key)
    store._backend.put(key, obj)
    obj.ref_count_down()


def test_altered_positions_and_swapped_documents_are_refused(store: LMCacheMasterStore) -> None:
    sid, kv, pos = _master(21, 8)
    other, other_kv, other_pos = _master(22, 8)
    assert store.put(sid, kv, pos) and store.put(other, other_kv, other_pos)
    # positions altered in the metadata (the KV and its checksum untouched)
    meta = store._backend.get(make_key("kmesh-meta", sid, torch.uint8))
    decoded = MasterMeta.decode(bytes(meta.tensor.reshape(-1).numpy().tobytes()))
    meta.ref_count_down()
    moved = dataclasses.replace(decoded, positions=tuple(p + 1 for p in decoded.positions))
    blob = torch.frombuffer(bytearray(moved.encode()), dtype=torch.uint8)
    _overwrite(store, "kmesh-meta", sid, (blob.view(1, 1, 1, -1), torch.uint8))
    assert store.get(sid) is None and store.num_corrupt == 1
    # another document's consistent master (KV + metadata) placed under this one's keys
    for prefix, dtype in (("kmesh", torch.bfloat16), ("kmesh-meta", torch.uint8)):
        obj = store._backend.get(make_key(prefix, other, dtype))
        tensor = obj.tensor.clone()
        obj.ref_count_down()
        _overwrite(store, prefix, sid, (tensor, dtype))
    assert store.get(sid) is None and store.num_corrupt == 2
    assert store.get(other) is not None  # the original is still good under its own id
