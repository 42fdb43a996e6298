"""Mirrors in the segment store and index: versioning, checksums, pins, and recompute on failure.

A sibling blended from a stored master keeps its segment KV as a mirror. Every failure (corrupt
or truncated object, master re-published with other bits, master gone) must come back as a
reason, and the request then recomputes: its KV equals a full prefill's, bit for bit.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import NamedTuple

import pytest
import torch

from kmesh_blend.blend import BlendOptions, MasterSource, blend_group, master_tensor
from kmesh_blend.mirror.lifecycle import MirrorStore
from kmesh_blend.mirror.reference import restore_dense_reference
from kmesh_blend.models import ReferenceModel, prefill
from kmesh_blend.segments.cache import SegmentCache
from kmesh_blend.segments.identity import SegmentId, make_namespace, segment_id
from kmesh_blend.segments.master import MasterLayout
from kmesh_blend.segments.store import open_store
from kmesh_blend.testing import TINY_LLAMA, build_checkpoint
from tests.blend.prompts import family


class World(NamedTuple):
    model: ReferenceModel
    cache: SegmentCache
    mirrors: MirrorStore
    master_id: SegmentId
    mirror_id: SegmentId
    request: object  # BlendRequest of the sibling
    keys: torch.Tensor  # [L, S, H, D] the sibling's post-blend segment KV
    values: torch.Tensor


@pytest.fixture(scope="module")
def model() -> ReferenceModel:
    return ReferenceModel.load(build_checkpoint(TINY_LLAMA), torch.bfloat16)


@pytest.fixture(params=["cpu", "disk"])
def world(request: pytest.FixtureRequest, model: ReferenceModel, tmp_path: Path) -> Iterator[World]:
    shape = model.shape
    layout = MasterLayout(shape.num_layers, shape.num_kv_heads, shape.head_dim, "bfloat16")
    url = "cpu" if request.param == "cpu" else f"disk://{tmp_path}"
    store = open_store(url, layout, cpu_bytes=32 << 20)
    cache = SegmentCache(store, retain=False)  # every fetch reads the tier
    try:
        requests, dense = family(model, "middle", 2)
        ns = make_namespace("tiny", torch.bfloat16, num_layers=4, num_kv_heads=4, head_dim=32)
        master_id = segment_id(ns, [7] * dense.segments["A"].positions.numel())
        seg = dense.segments["A"]
        assert cache.publish(master_id, master_tensor(seg), seg.positions, round=0)
        master = cache.fetch(master_id).master
        assert master is not None
        result = blend_group(
            model, requests, MasterSource({"A": master}), BlendOptions(backend="torch")
        )[1]
        use = requests[1].uses[0]
        keys = torch.stack([k[use.start : use.end] for k in result.keys])
        values = torch.stack([v[use.start : use.end] for v in result.values])
        mirrors = MirrorStore(cache)
        pos = torch.arange(use.start, use.end)
        freq = model.rope.inv_freq
        mid = mirrors.put(master_id, master, keys, values, pos, freq, owner="r1", round=0)
        assert mid is not None
        yield World(model, cache, mirrors, master_id, mid, requests[1], keys, values)
    finally:
        store.close()


def _serve(w: World) -> tuple[str, torch.Tensor, torch.Tensor]:
    """The segment KV a continuing sibling would get: from its mirror, else a full recompute."""
    got = w.mirrors.fetch(w.mirror_id)
    if got.reason is None:
        assert got.mirror is not None and got.master is not None
        master, freq = got.master, w.model.rope.inv_freq
        k, v = restore_dense_reference(master.kv, master.positions, got.mirror, freq)
        return "mirror", k, v
    return (got.reason, *_full(w))  # recompute the whole prompt


def _full(w: World) -> tuple[torch.Tensor, torch.Tensor]:
    use = w.request.uses[0]  # type: ignore[attr-defined]
    full = prefill(w.model, w.request.token_ids, last_only=True)  # type: ignore[attr-defined]
    span = slice(use.start, use.end)
    return torch.stack([k[span] for k in full.keys]), torch.stack([v[span] for v in full.values])


def test_intact_mirror_restores_the_sibling(world: World) -> None:
    path, k, v = _serve(world)
    assert path == "mirror"
    assert torch.equal(k, world.keys) and torch.equal(v, world.values)
    # Guard: the two paths are distinguishable (the blend is not a full prefill).
    assert not torch.equal(k, _full(world)[0])


def _rewrite(w: World, blob: bytes) -> None:
    w.mirrors.store.delete_blob(w.mirror_id)
    assert w.mirrors.store.put_blob(w.mirror_id, blob)


@pytest.mark.parametrize("damage", ["flip", "truncate", "empty"])
def test_damaged_mirror_recomputes(world: World, damage: str) -> None:
    blob = world.mirrors.store.get_blob(world.mirror_id)
    assert blob is not None
    if damage == "flip":
        broken = bytearray(blob)
        broken[len(blob) // 2] ^= 0x10
        blob = bytes(broken)
    else:
        blob = blob[: len(blob) - 7] if damage == "truncate" else b"\0"
    _rewrite(world, blob)
    path, k, v = _serve(world)
    assert path.startswith("corrupt mirror")
    assert all(torch.equal(a, b) for a, b in zip((k, v), _full(world), strict=True))
    assert world.mirrors.num_corrupt == 1
    # The damaged mirror is dropped and no longer pins its master.
    assert world.cache.index.get(world.mirror_id) is None
    assert world.mirrors.store.get_blob(world.mirror_id) is None
    assert not world.cache.index.get(world.master_id).pins  # type: ignore[union-attr]


def test_wrong_master_version_recomputes(world: World) -> None:
    """The master is re-published under the same id with other bits (one element changed)."""
    store = world.cache.store
    old = store.get(world.master_id)
    assert old is not None
    other = old.kv.clone()
    other[2, 0, 5, 1, 3] += 1
    assert store.delete(world.master_id)
    assert store.put(world.master_id, other, old.positions)
    path, k, v = _serve(world)
    assert path == "wrong master version"
    assert torch.equal(k, _full(world)[0]) and torch.equal(v, _full(world)[1])


def test_missing_master_recomputes_and_drops_the_mirror(world: World) -> None:
    world.cache.store.delete(world.master_id)
    path, k, _ = _serve(world)
    assert path == "master missing" and torch.equal(k, _full(world)[0])
    assert world.mirrors.store.get_blob(world.mirror_id) is None


def test_mirror_pins_its_master_until_it_retires(world: World) -> None:
    index = world.cache.index
    assert index.evict(world.master_id) is None  # pinned: cannot be evicted
    # Round 2 retires round-0 entries: the mirror goes, and with it the pin on its master.
    retired = {info.segment_id for info in world.mirrors.advance_round(2)}
    assert retired == {world.master_id, world.mirror_id}
    assert world.mirrors.store.get_blob(world.mirror_id) is None
    assert world.cache.store.get(world.master_id) is None


def test_a_younger_mirror_keeps_an_expired_master(world: World) -> None:
    """A mirror published in a later round keeps its master past the master's own rounds."""
    master = world.cache.store.get(world.master_id)
    assert master is not None
    use = world.request.uses[0]  # type: ignore[attr-defined]
    pos = torch.arange(use.start, use.end) + 1
    late = world.mirrors.put(
        world.master_id, master, world.keys, world.values, pos, world.model.rope.inv_freq,
        owner="r2", round=1,
    )  # fmt: skip
    assert late is not None
    retired = {i.segment_id for i in world.mirrors.advance_round(2)}
    assert retired == {world.mirror_id}  # the master stays for the round-1 mirror
    assert world.mirrors.fetch(late).reason is None
    retired = {i.segment_id for i in world.mirrors.advance_round(3)}
    assert retired == {late, world.master_id}
