"""Scheduler side, one annotated request's reuse decision: restore an earlier turn, load stored
segments, or run stock (the report says why)."""

from __future__ import annotations

from kmesh_blend.segments.annotation import Annotation
from kmesh_blend.segments.identity import Namespace
from kmesh_blend.vllm.meta import VLLM_TAIL
from kmesh_blend.vllm.reports import short
from kmesh_blend.vllm.scheduler_plan import Plan
from kmesh_blend.vllm.scheduler_segments import SegmentRegistry
from kmesh_blend.vllm.turn_registry import HEAD, TurnRegistry

__all__ = ["plan_reuse"]


def plan_reuse(
    plan: Plan, annotation: Annotation, namespace: Namespace, num_computed: int,
    skip_reading: bool, turns: TurnRegistry, segments: SegmentRegistry, round_lifetime: int,
) -> int:  # fmt: skip
    """Fill ``plan``'s loads, saves and turn; the tokens the worker will provide.
    ``skip_reading``: vLLM takes no KV for this request (it asked for prompt_logprobs)."""
    tokens, refs, num_computed_tokens = plan.token_ids, plan.segments, num_computed
    if skip_reading:
        plan.saves = list(refs)  # it computes them exactly: they are stored as usual
        plan.report["fallback"] = (
            "prompt_logprobs requested: vLLM computes every prompt token itself"
        )
        return 0
    turn = turns.find(namespace, tokens, refs) if num_computed_tokens == 0 else None
    if turn is not None:  # the request continues: restore its earlier prompt's KV
        plan.turn = turn
        plan.saves = [r for r in refs if r.start >= turn[1]]  # new segments: stored after
        plan.report["restored_tokens"] = turn[1]
        return turn[1]
    # A segment inside the exact prefix vLLM found in its cache needs no load.
    problems: list[str] = []
    plan.loads = [
        r for r in refs if r.end > num_computed_tokens and segments.loadable(r.segment_id, problems)
    ]
    plan.saves = [r for r in refs if r not in plan.loads]
    if not plan.loads and problems:  # the store did not answer: it says which and why
        plan.report["fallback"] = short(problems[0])
        return 0
    if not plan.loads:
        plan.report["fallback"] = segments.why_not_stored(refs, round_lifetime)
        return 0
    if len(tokens) - VLLM_TAIL <= num_computed_tokens:
        return 0
    if annotation.keep and len(tokens) >= HEAD:
        plan.keep = turns.keep(namespace, tokens, refs)
    return len(tokens) - VLLM_TAIL - num_computed_tokens
