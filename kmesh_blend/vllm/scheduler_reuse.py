"""Scheduler side, one annotated request's reuse decision: restore an earlier turn, load stored
segments, or run stock (the report says why)."""

from __future__ import annotations

import math

from kmesh_blend.segments.annotation import Annotation
from kmesh_blend.segments.identity import Namespace
from kmesh_blend.vllm.meta import VLLM_TAIL, SegmentRef
from kmesh_blend.vllm.reports import short
from kmesh_blend.vllm.scheduler_plan import Plan
from kmesh_blend.vllm.scheduler_segments import SegmentRegistry
from kmesh_blend.vllm.turn_registry import HEAD, TurnRegistry

__all__ = ["blend_end", "plan_reuse"]


def plan_reuse(
    plan: Plan, annotation: Annotation, namespace: Namespace, num_computed: int,
    skip_reading: bool, turns: TurnRegistry, segments: SegmentRegistry, round_lifetime: int,
    recompute_ratio: float,
) -> int:  # fmt: skip
    """Fill ``plan``'s loads, saves, turn and blend end; the tokens the worker will provide.
    ``skip_reading``: vLLM takes no KV for this request (it asked for prompt_logprobs).
    ``recompute_ratio``: the engine's (the request's own, in ``plan.options``, comes first)."""
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
    ratio = plan.options[0] if plan.options[0] is not None else recompute_ratio
    plan.end = blend_end(len(tokens), plan.loads, ratio, plan.keep is not None,
                         num_computed_tokens)  # fmt: skip
    end = len(tokens) - VLLM_TAIL if plan.end is None else plan.end
    return end - num_computed_tokens


def blend_end(num_tokens: int, loads: list[SegmentRef], ratio: float, whole: bool,
              first: int = 0) -> int | None:  # fmt: skip
    """Where the blend of a prompt of ``num_tokens`` that loads ``loads`` stops: the end of its
    last loaded segment, or None for the whole prompt (``first``: tokens vLLM's prefix cache
    already holds, which the blend reads and never computes).

    The tokens after the last loaded segment reuse nothing. Either the blend computes them in
    its own batch, or vLLM's forward does, over the blended KV. That forward reads every weight
    of the model once and runs every layer's ops for a handful of rows: a fixed cost (on a
    2-core CPU 25–35 ms of SmolLM2-135M's follow-up TTFT) the blend, already running each layer
    for its own rows, does not pay again — and with the whole prompt blended, the step holds
    only the blend's tail rows and that forward is skipped (`tails.Tails`). So the blend takes
    them whenever they at most double what it computes anyway (the tokens before the segment's
    end that are not loaded, plus the share ``ratio`` of the loaded ones): the rows cost the same
    per token in either batch, the fixed cost is saved. A long private tail after a short hit (a
    reader whose only reuse is its system prompt) stays on vLLM's forward, whose fused kernels
    under ``torch.compile`` are faster per token than the modules the blend calls one by one.

    The blend covers the whole prompt also when ``ratio`` is 1.0 (its rows in one batch are
    bit-equal to stock's full prefill; vLLM's continuation rows round apart) and when ``whole``
    says so: a request that keeps its turn (the record is read right after the load's forward,
    which must then have computed every prompt token). Under load vLLM may prefill the rest in
    chunks over later steps: the load step's blocks then end before the prompt does
    (`LoadRequest.slots`), and a cascade plan takes the rest's at its first decode step
    (`DecodePlan.complete`)."""
    last = max(ref.end for ref in loads)
    if ratio >= 1.0 or whole or last >= num_tokens - VLLM_TAIL:
        return None
    loaded = sum(max(0, ref.end - max(ref.start, first)) for ref in loads)
    own = max(0, last - first) - loaded + math.ceil(ratio * loaded)
    return None if num_tokens - last <= own else last
