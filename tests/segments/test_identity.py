"""Segment identity: position-independent content hash, namespaced."""

from __future__ import annotations

import dataclasses

import pytest

from kmesh_blend.segments.identity import Namespace, make_namespace, segment_id, segment_ids

NS = make_namespace("tiny-llama", "torch.bfloat16", num_layers=4, num_kv_heads=4, head_dim=32)


def test_same_segment_any_offset_any_order() -> None:
    a, b = [5, 6, 7], [8, 9]
    p1 = [1, *a, 2, *b, 3]
    p2 = [4, 4, 4, *b, *a]
    ids1 = segment_ids(NS, p1, [(1, 4), (5, 7)])
    ids2 = segment_ids(NS, p2, [(5, 8), (3, 5)])
    assert ids1 == ids2
    assert ids1[0] != ids1[1]


def test_stable_value() -> None:
    # Pins the byte layout: changing it silently would orphan every stored master.
    sid = segment_id(Namespace("m", "float32", "L=1,Hkv=1,D=32"), [1, 2, 3])
    assert len(sid) == 64 and int(sid, 16) >= 0
    assert sid == segment_id(Namespace("m", "float32", "L=1,Hkv=1,D=32"), (1, 2, 3))
    assert sid == "4d3b014d72ad21569b44ee29cdb56d3c3b723d02a9b3f7cd8f0b3724a2f72edf"


@pytest.mark.parametrize(
    "change",
    [
        {"model": "other"},
        {"dtype": "float16"},
        {"kv_layout": "L=4,Hkv=2,D=32"},
        {"rope": '{"rope_theta":500000}'},
        {"cache_salt": "tenant-b"},
    ],
)
def test_namespace_fields_separate_ids(change: dict[str, str]) -> None:
    other = dataclasses.replace(NS, **change)
    assert segment_id(NS, [1, 2, 3]) != segment_id(other, [1, 2, 3])


def test_salt_and_token_edge_cases() -> None:
    assert NS.with_salt(None) == NS
    assert segment_id(NS.with_salt("t"), [1]) != segment_id(NS, [1])
    assert segment_id(NS, [1, 2]) != segment_id(NS, [2, 1])
    assert segment_id(NS, [0]) != segment_id(NS, [0, 0])  # length is hashed
    with pytest.raises(ValueError):
        segment_id(NS, [])
    with pytest.raises(ValueError):
        segment_id(NS, [2**63])
    with pytest.raises(TypeError):
        segment_id(NS, [1.0])  # type: ignore[list-item]
    with pytest.raises(TypeError):
        Namespace("m", 3, "x")  # type: ignore[arg-type]


def test_tensor_input() -> None:
    import torch

    assert segment_id(NS, torch.tensor([3, 4, 5])) == segment_id(NS, [3, 4, 5])


def test_rope_dict_is_canonical() -> None:
    kw = dict(num_layers=1, num_kv_heads=1, head_dim=32)
    a = make_namespace("m", "float32", rope={"theta": 1e4, "type": "llama3"}, **kw)
    b = make_namespace("m", "float32", rope={"type": "llama3", "theta": 1e4}, **kw)
    assert a == b and a.digest == b.digest
