"""The blend reads masters through the segment store: the same bits from every tier.

Masters of two segments are published through `SegmentCache` into a real LMCache store (host
RAM, disk, the `lm://` server process, Redis), fetched back, and a group of four follow-ups is
blended from them; KV and logits must equal the blend from the in-memory masters bit for bit.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from kmesh_blend.blend import BlendOptions, MasterSource, blend_group, master_tensor
from kmesh_blend.models import ReferenceModel
from kmesh_blend.segments.cache import SegmentCache
from kmesh_blend.segments.identity import make_namespace, segment_id
from kmesh_blend.segments.master import MasterLayout
from kmesh_blend.segments.store import open_store
from kmesh_blend.testing import TINY_QWEN2, build_checkpoint
from tests.blend.prompts import family


@pytest.mark.parametrize("kind", ["cpu", "disk", "lm", "redis"])
def test_blend_from_each_tier_is_bit_identical(
    kind: str, tmp_path: Path, request: pytest.FixtureRequest
) -> None:
    model = ReferenceModel.load(build_checkpoint(TINY_QWEN2), torch.bfloat16)
    requests, dense = family(model, "reordered", 4)
    url = {"cpu": "cpu", "disk": f"disk://{tmp_path}"}.get(kind) or request.getfixturevalue(
        f"{kind}_server"
    )
    shape = model.shape
    layout = MasterLayout(shape.num_layers, shape.num_kv_heads, shape.head_dim, "bfloat16")
    ns = make_namespace("tiny-qwen2", torch.bfloat16, num_layers=4, num_kv_heads=2, head_dim=32)
    store = open_store(url, layout, cpu_bytes=64 << 20)
    cache = SegmentCache(store, retain=False)
    try:
        ids = {}
        for name, kv in dense.segments.items():
            ids[name] = segment_id(ns, [ord(name)] * kv.positions.numel())
            assert cache.publish(ids[name], master_tensor(kv), kv.positions, family="f")
        fetched = {name: cache.fetch(sid, family="f") for name, sid in ids.items()}
        assert all(f.master is not None and f.source == "read" for f in fetched.values())
        source = MasterSource({name: f.master for name, f in fetched.items()})
        opts = BlendOptions(backend="torch")
        want = blend_group(model, requests, dense, opts)
        got = blend_group(model, requests, source, opts)
    finally:
        store.close()
    for a, b in zip(want, got, strict=True):
        assert torch.equal(a.logits, b.logits)
        assert all(torch.equal(x, y) for x, y in zip(a.keys, b.keys, strict=True))
        assert all(torch.equal(x, y) for x, y in zip(a.values, b.values, strict=True))
