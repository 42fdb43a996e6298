"""Replay a `Trace` against a real `ArtifactStore` in virtual time, under one caching policy.

Policies (same store class, same tiers, same byte budgets, same loaders, same outputs):

* ``"lru"`` — ordinary caching: the store is used without family information, so host RAM and
  disk are plain LRU caches (content-keyed singleflight included: it is not family knowledge).
* ``"family"`` — family-aware: a family is opened when announced (or at its first request),
  its ancestors are declared for it and prepared ahead through the application notice when the
  trace announces it early, every get of an ancestor pins it for the family (catalog gets are
  plain LRU gets), and closing the family (after its last request) deletes its ancestors.

Every store call is real (real payload bytes in host RAM, real files in the disk tier); only
*time* is virtual: a RAM hit costs 0 s, a disk read and a loader call cost what `CostModel` says
(the benchmark measures these on the real loaders). A get that finds an object whose load is
still running in virtual time waits for it (a singleflight join). Requests run on ``slots``
agent slots (FIFO queue); each does its gets in order, then its copy-on-write change, then
``work_s`` of agent work. Both host-RAM and disk budgets are checked after every event.
"""

from __future__ import annotations

import heapq
import math
import zlib
from collections import Counter, deque
from typing import Literal

import numpy as np

from kmesh_blend.artifacts.costs import DEFAULT_COSTS, CostModel
from kmesh_blend.artifacts.errors import ArtifactInputError, BudgetError
from kmesh_blend.artifacts.objects import ChildView, digest, thaw
from kmesh_blend.artifacts.report import ReplayResult
from kmesh_blend.artifacts.store import ArtifactStore, Fetched
from kmesh_blend.artifacts.trace import Trace, synthetic_loader

__all__ = ["POLICIES", "Policy", "ReplayResult", "replay"]

Policy = Literal["lru", "family"]
POLICIES: tuple[str, ...] = ("lru", "family")
_ANNOUNCE, _ARRIVE, _STEP, _FINISH = 0, 1, 2, 3


def replay(
    trace: Trace,
    policy: str,
    *,
    ram_bytes: int,
    disk_bytes: int,
    slots: int = 16,
    costs: CostModel = DEFAULT_COSTS,
) -> ReplayResult:
    """Replay ``trace`` under ``policy`` (``"lru"`` or ``"family"``); see the module docstring."""
    if policy not in POLICIES:
        raise ArtifactInputError(f"policy must be one of {POLICIES}, got {policy!r}")
    if isinstance(slots, bool) or not isinstance(slots, int) or slots < 1:
        raise ArtifactInputError(f"slots must be an int >= 1, got {slots!r}")
    store = ArtifactStore(ram_bytes, disk_bytes)
    try:
        return _Replay(trace, policy, store, slots, costs).run()
    finally:
        store.close()


class _Replay:
    def __init__(
        self, trace: Trace, policy: str, store: ArtifactStore, slots: int, costs: CostModel
    ) -> None:
        self.trace, self.policy, self.store, self.costs = trace, policy, store, costs
        self.family_aware = policy == "family"
        self.free_slots = slots
        self.queue: deque[int] = deque()
        self.events: list[tuple[float, int, int, int, int]] = []
        self.seq = 0
        self.available_at: dict[str, float] = {}
        n = len(trace.requests)
        self.start_s = [0.0] * n
        self.ready_s = [0.0] * n
        self.finish_s = [math.inf] * n
        self.sources: list[list[str]] = [[] for _ in range(n)]
        self.crc = [0] * n
        self.views: dict[int, ChildView] = {}
        self.left = {f.name: len(f.request_ids) for f in trace.families}
        self.open: set[str] = set()
        """Families whose ancestors count as working set: open in the store (family policy),
        or from their first started request to their last finished one (lru)."""
        self.family_index = {f.name: i for i, f in enumerate(trace.families)}
        self.last_t = 0.0
        self.ram_area = self.ws_area = 0.0
        self.ram_peak = self.ws_peak = 0
        self.copy_overflows = 0

    def run(self) -> ReplayResult:
        ancestors_scoped = self.family_aware
        for spec in self.trace.artifacts.values():
            if spec.family is None or not ancestors_scoped:
                self.store.declare(spec.key, synthetic_loader(spec), kind=spec.kind)
        if self.family_aware:
            for i, fam in enumerate(self.trace.families):
                self._push(fam.announce_s, _ANNOUNCE, i)
        for req in self.trace.requests:
            self._push(req.arrival_s, _ARRIVE, req.rid)
        while self.events:
            t, _, kind, a, b = heapq.heappop(self.events)
            self._track(t)
            if kind == _ANNOUNCE:
                self._announce(t, a)
            elif kind == _ARRIVE:
                self.queue.append(a)
                self._start_queued(t)
            elif kind == _STEP:
                self._step(t, a, b)
            else:
                self._finish(t, a)
            self._check_budgets()
        return self._result()

    # -- events --------------------------------------------------------------------------------

    def _push(self, t: float, kind: int, a: int, b: int = 0) -> None:
        heapq.heappush(self.events, (t, self.seq, kind, a, b))
        self.seq += 1

    def _announce(self, t: float, index: int) -> None:
        fam = self.trace.families[index]
        self.store.open_family(fam.name)
        self.open.add(fam.name)
        for key in fam.ancestors:
            spec = self.trace.artifacts[key]
            self.store.declare(key, synthetic_loader(spec), kind=spec.kind, family=fam.name)
        if fam.ancestors and fam.announce_s < fam.first_arrival_s:
            prepared = self.store.prepare(fam.name, fam.ancestors)
            for key, got in zip(fam.ancestors, prepared.fetched, strict=True):
                if got is not None:
                    self._cost(key, got, t)

    def _start_queued(self, t: float) -> None:
        while self.free_slots and self.queue:
            rid = self.queue.popleft()
            self.free_slots -= 1
            self.start_s[rid] = t
            self.open.add(self.trace.requests[rid].family)
            self._step(t, rid, 0)

    def _step(self, t: float, rid: int, i: int) -> None:
        req = self.trace.requests[rid]
        if i < len(req.keys):
            key = req.keys[i]
            # Family knowledge is about the declared ancestors: catalog gets are never pinned.
            pin = self.family_aware and self.trace.artifacts[key].family is not None
            got = self.store.get(key, family=req.family if pin else None)
            wait, label = self._cost(key, got, t)
            self.sources[rid].append(label)
            self._fold(rid, digest(got.artifact.payload))
            self._push(t + wait, _STEP, rid, i + 1)
            return
        wait = 0.0
        if req.copy_key is not None:
            scope = req.family if self.family_aware else f"request{rid}"
            if not self.family_aware:
                self.store.open_family(scope)
            view = self.store.view(req.copy_key, family=scope, child=f"child{req.child}/r{rid}")
            source = view.source if view.source in ("ram", "joined", "disk", "loaded") else "ram"
            got = Fetched(view.artifact, source, 0, 0)  # type: ignore[arg-type]
            wait = self._cost(req.copy_key, got, t)[0]
            try:
                copy = view.write()
            except BudgetError:  # the copy does not fit even with every family pin released:
                self.copy_overflows += 1  # the child works on an uncharged copy (counted)
                copy = thaw(view.artifact.payload)
            _change(copy, rid)
            self._fold(rid, digest(copy))
            self.views[rid] = view
        self.ready_s[rid] = t + wait
        self._push(t + wait + req.work_s, _FINISH, rid)

    def _finish(self, t: float, rid: int) -> None:
        req = self.trace.requests[rid]
        self.finish_s[rid] = t
        view = self.views.pop(rid, None)
        if view is not None:
            view.close()
            if not self.family_aware:
                self.store.close_family(view.family)
        self.left[req.family] -= 1
        if self.left[req.family] == 0:
            if self.family_aware:
                self.store.close_family(req.family)
            self.open.discard(req.family)
        self.free_slots += 1
        self._start_queued(t)

    # -- accounting ----------------------------------------------------------------------------

    def _fold(self, rid: int, crc: int) -> None:
        self.crc[rid] = zlib.crc32(crc.to_bytes(4, "little"), self.crc[rid])

    def _cost(self, key: str, got: Fetched, t: float) -> tuple[float, str]:
        """Virtual seconds until ``got`` is usable at time ``t``, and how it was served."""
        spec = self.trace.artifacts[key]
        pending = max(0.0, self.available_at.get(key, -math.inf) - t)
        if got.source in ("ram", "joined"):
            return pending, "joined" if pending > 0 else "ram"
        if got.source == "disk":
            return pending + self.costs.disk_s(spec.nbytes), "disk"
        if pending > 0:  # the store called the loader again while a load is still running
            return pending, "loaded"
        cost = self.costs.origin_s(spec.kind, spec.nbytes)
        self.available_at[key] = t + cost
        return cost, "loaded"

    def _track(self, t: float) -> None:
        dt = t - self.last_t
        used = self.store.ram_used_bytes
        ws = self._family_ws()
        self.ram_area += used * dt
        self.ws_area += ws * dt
        self.ram_peak, self.ws_peak = max(self.ram_peak, used), max(self.ws_peak, ws)
        self.last_t = t

    def _family_ws(self) -> int:
        ram = self.store.ram
        total = sum(v.private_nbytes for v in self.views.values())
        for name in self.open:
            for key in self._ancestors(name):
                if key in ram:
                    total += self.trace.artifacts[key].nbytes
        return total

    def _ancestors(self, family: str) -> tuple[str, ...]:
        return self.trace.families[self.family_index[family]].ancestors

    def _check_budgets(self) -> None:
        ram, disk = self.store.ram_used_bytes, self.store.disk_used_bytes
        if ram > self.store.ram.budget_bytes or disk > self.store.disk.budget_bytes:
            raise AssertionError(f"budget exceeded: ram {ram}, disk {disk} bytes")

    def _result(self) -> ReplayResult:
        trace, mix = self.trace, self.trace.mix
        horizon = trace.span_s + mix.work_s
        done = [r for r in trace.requests if self.finish_s[r.rid] <= horizon + 1e-9]
        waits = np.array([self.ready_s[r.rid] - r.arrival_s for r in trace.requests])
        makespan = max(self.finish_s)
        counts: Counter[str] = Counter({"ram": 0, "joined": 0, "disk": 0, "loaded": 0})
        shared = [0, 0]
        catalog = [0, 0]
        for req in trace.requests:
            for key, label in zip(req.keys, self.sources[req.rid], strict=True):
                counts[label] += 1
                bucket = catalog if trace.artifacts[key].family is None else shared
                bucket[0] += 1
                bucket[1] += label in ("ram", "joined")
        reads = self.store.metrics.as_dict()["reads"]
        self._track(makespan)
        return ReplayResult(
            policy=self.policy,
            mix=mix.name,
            num_requests=len(trace.requests),
            completed_requests=len(done),
            completed_work_s=sum(r.work_s for r in done),
            horizon_s=horizon,
            makespan_s=makespan,
            wait_mean_s=float(waits.mean()),
            wait_p95_s=float(np.percentile(waits, 95)),
            sources=dict(counts),
            shared_accesses=shared[0],
            shared_ram=shared[1],
            catalog_accesses=catalog[0],
            catalog_ram=catalog[1],
            storage_reads=int(reads.get("disk", 0)),
            origin_loads=int(reads.get("origin", 0)),
            ram_mean_bytes=self.ram_area / makespan,
            ram_peak_bytes=self.ram_peak,
            family_ws_mean_bytes=self.ws_area / makespan,
            family_ws_peak_bytes=self.ws_peak,
            ram_budget=self.store.ram.budget_bytes,
            disk_budget=self.store.disk.budget_bytes,
            copy_overflows=self.copy_overflows,
            busy_slot_s=sum(f - s for f, s in zip(self.finish_s, self.start_s, strict=True)),
            access_sources=tuple(tuple(s) for s in self.sources),
            outputs=tuple(self.crc),
        )


def _change(copy: object, rid: int) -> None:
    """A child's change to its own copy (deterministic per request)."""
    if isinstance(copy, np.ndarray) and copy.size:
        copy.reshape(-1).view(np.uint8)[0] ^= (rid % 255) + 1
    elif isinstance(copy, bytearray) and copy:
        copy[0] ^= (rid % 255) + 1
