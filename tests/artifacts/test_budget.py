"""Budgets are never exceeded, whatever the sequence of gets, copies and releases (hypothesis),
and the disk tier round-trips every payload type."""

from __future__ import annotations

import contextlib
from pathlib import Path

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kmesh_blend.artifacts import ArtifactStore, BudgetError, ChildView, DiskTier
from kmesh_blend.artifacts.objects import digest

RAM, DISK = 64 << 10, 96 << 10
NUM_KEYS, NUM_FAMILIES = 12, 4

ops = st.lists(
    st.tuples(
        st.sampled_from(["get", "get_family", "view", "write", "close_view", "close_family"]),
        st.integers(0, NUM_KEYS - 1),
        st.integers(0, NUM_FAMILIES - 1),
    ),
    max_size=60,
)


def _size(key: int) -> int:
    return 1000 + 3000 * key  # 1 KB .. 34 KB: a few fill the 64 KiB budget


def _files_bytes(root: Path) -> int:
    return sum(p.stat().st_size for p in root.iterdir() if p.is_file())


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(ops)
def test_budgets_never_exceeded(sequence: list[tuple[str, int, int]]) -> None:
    store = ArtifactStore(RAM, DISK)
    families = [f"f{i}" for i in range(NUM_FAMILIES)]
    for f in families:
        store.open_family(f)
    for k in range(NUM_KEYS):
        scope = families[k % NUM_FAMILIES] if k % 3 == 0 else None
        store.declare(f"k{k}", lambda k=k: np.full(_size(k), k, np.uint8), family=scope)
    views: list[ChildView] = []
    for op, k, f in sequence:
        key, fam = f"k{k}", families[f]
        if not store.is_declared(key) or not store.is_open(fam):
            continue  # released with its family, or the family is over
        if op == "get":
            payload = store.get(key).artifact.payload
            assert isinstance(payload, np.ndarray) and payload.size == _size(k)
        elif op == "get_family":
            store.get(key, family=fam)
        elif op == "view":
            views.append(store.view(key, family=fam, child=f"c{len(views)}"))
        elif op == "write" and views and not views[-1].closed:
            with contextlib.suppress(BudgetError):  # refused if it cannot fit, never squeezed in
                views[-1].write()
        elif op == "close_view" and views and not views[0].closed:
            views.pop(0).close()
        elif op == "close_family":
            store.close_family(fam)
        assert store.ram_used_bytes <= RAM
        assert store.pinned_bytes <= store.pin_limit
        assert _files_bytes(store.disk.root) == store.disk_used_bytes <= DISK
    for fam in families:
        if store.is_open(fam):
            store.close_family(fam)
    assert store.pinned_bytes == 0
    # every family closed: only unscoped artifacts remain, none pinned, no copies
    retained = store.ram.keys()
    assert all(not store.ram.is_held(key) for key in retained)
    store.close()


def test_budget_guard_can_fail() -> None:
    # Guard for the test above: children's copies are held, so a second one that does not fit
    # next to the first is refused with a clear error (pins and cached objects give way first).
    store = ArtifactStore(1000, 0)
    store.open_family("f")
    store.declare("a", lambda: np.zeros(600, np.uint8), family="f")
    first, second = (store.view("a", family="f", child=c) for c in ("c0", "c1"))
    first.write()
    with pytest.raises(BudgetError, match=r"child 'c1'.*needs 600 bytes"):
        second.write()
    assert store.ram_used_bytes <= 1000
    store.close()


@pytest.mark.parametrize(
    "payload",
    [
        b"tool response",
        np.arange(12, dtype=np.float32).reshape(3, 4),
        (np.arange(5, dtype=np.int64), np.linspace(0, 1, 5, dtype=np.float32)),
    ],
    ids=["bytes", "array", "tuple"],
)
def test_disk_tier_round_trip(payload: object, tmp_path: Path) -> None:
    from kmesh_blend.artifacts.objects import freeze

    tier = DiskTier(1 << 20, tmp_path)
    frozen = freeze(payload)
    assert tier.put("k", frozen)
    back = tier.get("k")
    assert back is not None and digest(back) == digest(frozen)
    assert tier.remove("k") > 0 and tier.get("k") is None
    assert list(tmp_path.iterdir()) == []


def test_disk_tier_evicts_lru_files(tmp_path: Path) -> None:
    tier = DiskTier(5000, tmp_path)
    for i in range(4):
        assert tier.put(f"k{i}", np.zeros(1500, np.uint8))
    assert tier.used_bytes <= 5000 and _files_bytes(tmp_path) == tier.used_bytes
    assert "k0" not in tier and "k3" in tier
    assert not tier.put("huge", np.zeros(6000, np.uint8))  # never fits: rejected, no file left
    assert _files_bytes(tmp_path) == tier.used_bytes
