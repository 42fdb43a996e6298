"""Scheduler side of the connector: annotations, segment lookup, the load/save plan, reports.

Plain Python over vLLM's request objects; no tensors, no model. vLLM's connector contract is a
prefix extension, so a request that reuses segments reports every prompt token but the last as
"matched": the worker side writes the blended KV of all of them, and vLLM computes the last
token itself over that KV.
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Callable
from typing import TYPE_CHECKING, cast

from kmesh_blend.config import KMeshConfig
from kmesh_blend.segments.annotation import parse_request
from kmesh_blend.segments.identity import Namespace, SegmentId, segment_ids
from kmesh_blend.vllm.meta import (
    KMeshMetadata,
    KMeshWorkerMetadata,
    Report,
    SaveRequest,
    SegmentRef,
)
from kmesh_blend.vllm.prefix_cache import Privatizer
from kmesh_blend.vllm.reports import count, merge, resumed, short
from kmesh_blend.vllm.rounds import RoundClocks, family_key, scope_of
from kmesh_blend.vllm.scheduler_plan import Plan
from kmesh_blend.vllm.scheduler_reuse import plan_reuse
from kmesh_blend.vllm.scheduler_segments import SegmentRegistry
from kmesh_blend.vllm.stats import Payload
from kmesh_blend.vllm.turn_registry import TurnRegistry

if TYPE_CHECKING:
    from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorWorkerMetadata
    from vllm.v1.request import Request

    from kmesh_blend.vllm.seam.blocks import StepRequest

Release = Callable[["Request", list[tuple[int, int]]], int]

__all__ = ["SchedulerSide"]

# Registry bounds (kmesh_blend/vllm/registry.py): ids are 64 hex chars, so ≈10 MiB at most.
_MAX_PUBLISHED, _MAX_TURNS, _MAX_SCOPES = 1 << 16, 1 << 12, 1 << 16

log = logging.getLogger("vllm.kmesh_blend")  # under vLLM's handlers and format


class SchedulerSide:
    """Per-engine scheduler state. ``contains`` asks a shared store (``lm://``, ``redis://``)
    whether another engine published a segment; None for stores private to this engine."""

    def __init__(
        self,
        config: KMeshConfig,
        namespace: Namespace,
        max_model_len: int,
        contains: Callable[[SegmentId], bool] | None = None,
        privatizer: Privatizer | None = None,
        engine: str = "",
        release: Release | None = None,
    ) -> None:
        """``release(request, [(index, block id)])`` gives a running request's blocks back to
        vLLM's pool and says how many went (`seam.blocks.release_blocks`); None: never."""
        self.config, self.namespace, self.max_model_len = config, namespace, max_model_len
        self.engine = engine  # the kv_transfer_config's engine_id: each report names it
        # With vLLM's prefix caching on: makes blended blocks' hashes private (prefix_cache.py).
        self.privatizer = privatizer
        self.release = release
        self.segments = SegmentRegistry(contains, _MAX_PUBLISHED)
        # Set from the worker's first output when the blend cannot run on the loaded model:
        # then every annotated request is served stock, its report naming this reason.
        self.disabled: str | None = None
        self.plans: dict[str, Plan] = {}
        self.turns = TurnRegistry(_MAX_TURNS)  # continuing requests' stored prompts
        # Reports handed out this step. A request that finishes in the step of its prefill
        # (max_tokens=1) is reported before the worker's outcome arrives later in the same
        # `update_from_output`; the outcome is merged into the same dict before vLLM emits it.
        self._recent: dict[str, Report] = {}
        self._counted: set[str] = set()  # of `_recent`, already in the metrics
        self._recent_before: dict[str, Report] = {}  # of `_recent`, the resumed ones' `before`
        self._gauges: dict[str, int] = {}
        # Rounds per tenant, and families closed by finished requests (sent every step until
        # the worker applied them: a step without a forward may never reach it).
        self.rounds = RoundClocks(config.max_round_jump, _MAX_SCOPES)
        self._closing: list[tuple[int, str]] = []  # (number, family) until the worker applied it
        self._close_seq = 0

    def num_matched(self, request: Request, num_computed_tokens: int) -> int:
        """Tokens beyond ``num_computed_tokens`` the worker side will provide (0: stock path).

        vLLM asks again, each step, for a request that waits for memory: the answer of the first
        ask stands (no re-hashing, no new plan) until the local prefix hit changes."""
        old = self.plans.get(request.request_id)
        fresh = old is not None and not old.blocks and not old.pending_load
        if fresh and old is not None and old.asked == num_computed_tokens:
            return old.matched
        matched = self._num_matched(request, num_computed_tokens)
        plan = self.plans.get(request.request_id)
        if plan is not None:
            plan.asked, plan.matched, plan.request = num_computed_tokens, matched, request
        return matched

    def _num_matched(self, request: Request, num_computed_tokens: int) -> int:
        old = self.plans.get(request.request_id)
        params = request.kv_transfer_params
        if params is None and not self.config.separator:
            return 0  # unannotated traffic: nothing to parse
        tokens = list(request.prompt_token_ids or [])
        parsed = parse_request(
            params,
            len(tokens),
            max_model_len=self.max_model_len,
            token_ids=tokens,
            separator=self.config.separator,
        )
        if parsed.annotation is None:
            if parsed.fallback is not None:
                self._without_reuse(request.request_id, tokens, short(parsed.fallback))
            return 0
        if self.disabled is not None:
            self.plans[request.request_id] = plan = Plan(tokens, [])
            plan.report["fallback"] = self.disabled
            return 0
        spans = parsed.annotation.spans
        namespace = self.namespace
        salt = getattr(request, "cache_salt", None)
        if salt:  # tenants with different salts never share KV
            namespace = dataclasses.replace(namespace, cache_salt=str(salt))
        scope = scope_of(salt)
        annotation = parsed.annotation
        jump = self.rounds.refusal(scope, annotation.round)
        if jump is not None:
            self._without_reuse(request.request_id, tokens, jump)
            return 0
        ids = segment_ids(namespace, tokens, spans)
        refs = [SegmentRef(s, e, i) for (s, e), i in zip(spans, ids, strict=True)]
        # A family name is the tenant's own: another tenant's family of the same name is another.
        family = None if annotation.family is None else family_key(salt, annotation.family)
        plan = Plan(tokens, refs, first=num_computed_tokens, family=family,
                     round=annotation.round, scope=scope, close=annotation.close,
                     options=annotation.blend_settings)  # fmt: skip
        plan.report.update({"family": annotation.family} if annotation.family else {})
        self.rounds.announce(scope, annotation.round)
        # Rescheduled after a preemption (perhaps asked again while it waited for memory): the
        # report keeps what it reused before.
        before = None if old is None else old.report if old.blocks else old.before
        if before is not None:
            plan.before, plan.report = before, resumed(before)
        if self.privatizer is not None and plan.before is None:
            # (after a preemption the cache holds the request's own blocks: not a prefix hit)
            plan.report["prefix_cached_tokens"] = num_computed_tokens
        self.plans[request.request_id] = plan
        skip = bool(getattr(request, "skip_reading_prefix_cache", False))
        matched = plan_reuse(
            plan,
            parsed.annotation,
            namespace,
            num_computed_tokens,
            skip,
            self.turns,
            self.segments,
            self.config.round_lifetime,
            self.config.recompute_ratio,
        )
        if matched and self.privatizer is not None:
            self.privatizer.privatize(request, num_computed_tokens)
        return matched

    def _without_reuse(self, req_id: str, tokens: list[int], reason: str) -> None:
        """The request runs on the stock path; its report says why."""
        self.plans[req_id] = plan = Plan(tokens, [])
        plan.report["fallback"] = reason
        log.warning("kmesh: request %s runs without reuse: %s", req_id, reason)

    def after_alloc(self, req_id: str, num_external_tokens: int) -> None:
        if (plan := self.plans.get(req_id)) is not None and num_external_tokens > 0:
            plan.pending_load = True

    def build_meta(self, step: list[StepRequest]) -> KMeshMetadata:
        """The step's loads, saves, rounds and closes (``step``: `seam.blocks.step_requests`)."""
        for done in (self._recent, self._recent_before, self._counted):
            done.clear()
        self.turns.new_step()
        meta = KMeshMetadata(rounds=self.rounds.news(), closes=list(self._closing))
        for req in step:
            plan = self.plans.get(req.req_id)
            if plan is None:
                continue
            if req.whole:  # new, or resumed after a preemption with all its blocks anew
                plan.blocks = list(req.blocks)
                self._load(meta, req.req_id, plan)
            else:
                plan.blocks.extend(req.blocks)
            self._maybe_save(meta, req.req_id, plan, req.num_computed + req.num_scheduled)
        return meta

    def _load(self, meta: KMeshMetadata, req_id: str, plan: Plan) -> None:
        """The worker provides the tokens this plan matched, in this step (before the forward)."""
        if plan.pending_load:
            plan.pending_load = False
            meta.loads.append(plan.load_request(req_id))

    def on_worker_output(self, worker_meta: KVConnectorWorkerMetadata | None) -> None:
        if not isinstance(worker_meta, KMeshWorkerMetadata):
            return
        if worker_meta.disabled is not None:
            self.disabled = worker_meta.disabled
        self.segments.apply(worker_meta)
        self._closing = [(n, f) for n, f in self._closing if n > worker_meta.closed_upto]
        self.rounds.applied(worker_meta.rounds)
        self.turns.stored(worker_meta.turns)
        for req_id, blocks in worker_meta.releases.items():
            plan = self.plans.get(req_id)
            if plan is not None and plan.request is not None and self.release is not None:
                gone = self.release(cast("Request", plan.request), blocks)
                plan.released += gone
                plan.report["released_blocks"] = plan.report.get("released_blocks", 0) + gone
        published = self.segments.published
        for req_id, report in worker_meta.reports.items():
            plan = self.plans.get(req_id)
            target = plan.report if plan is not None else self._recent.get(req_id)
            before = plan.before if plan is not None else self._recent_before.get(req_id)
            if target is not None:
                merge(target, report, before)
            if plan is not None and report.get("fallback") and plan.turn is None:
                # The load failed and vLLM recomputes the prompt: once it has, store every
                # segment of it the store does not hold.
                plan.saved = False
                plan.saves = [r for r in plan.segments if r.segment_id not in published]

    def finished(self, req_id: str, paged_bytes: int | None = None) -> dict[str, Report] | None:
        """The report for ``RequestOutput.kv_transfer_params``; None for unannotated requests.
        ``paged_bytes``: its blocks in vLLM's pool at its end, in bytes (with sharing on)."""
        if self.privatizer is not None:
            self.privatizer.forget(req_id)
        plan = self.plans.pop(req_id, None)
        if plan is None:
            return None
        if plan.keep is not None:
            self.turns.finished(plan.keep)
        if plan.close and plan.family is not None:
            self._close_seq += 1
            self._closing.append((self._close_seq, plan.family))
        if self.disabled is not None and plan.report["fallback"] is None:
            plan.report["fallback"] = self.disabled  # it ran before the worker's word arrived
        if paged_bytes is not None and plan.report.get("reused_tokens"):
            plan.report["kv_held_bytes"] = paged_bytes + plan.report.get("mirror_bytes", 0)
        plan.report["engine"] = self.engine
        self._recent[req_id] = plan.report
        if plan.before is not None:
            self._recent_before[req_id] = plan.before
        return {"kmesh": plan.report}

    def take_stats(self) -> Payload | None:
        """Metrics payload (`kmesh_blend.vllm.stats`): the final reports of requests finished
        since the last call, and registry sizes; None when nothing changed. vLLM asks after the
        step's worker outcomes are merged, so a report is counted once it is complete."""
        fresh = [(r, rep) for r, rep in self._recent.items() if r not in self._counted]
        self._counted.update(r for r, _ in fresh)
        counters = count([rep for _, rep in fresh])
        gauges = {
            "published_segments": len(self.segments.published),
            "turn_records": len(self.turns.records),
            "pending_keeps": self.turns.num_pending,
            "plans": len(self.plans),
            "released_blocks_live": sum(plan.released for plan in self.plans.values()),
        }
        if not counters and gauges == self._gauges:
            return None
        self._gauges = gauges
        return {"counters": counters, "gauges": gauges}

    # --- helpers --------------------------------------------------------------------------------

    def _maybe_save(self, meta: KMeshMetadata, req_id: str, plan: Plan, done: int) -> None:
        if plan.saved or done < len(plan.token_ids):
            return
        plan.saved = True
        todo = self.segments.claim_saves(plan.saves)
        if todo:
            save = SaveRequest(req_id, list(plan.blocks), todo)
            save.family, save.round, save.scope = plan.family, plan.round, plan.scope
            save.scope_round = self.rounds.now(plan.scope)
            meta.saves.append(save)
