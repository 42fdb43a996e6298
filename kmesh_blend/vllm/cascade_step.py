"""One cascade decode step, planned: which requests decode in cascade, and what they read.

Called by `kmesh_blend.vllm.cascade_decode.CascadeDecode` at the first layer of each step (the
same attention metadata serves every layer). A request decodes in cascade when its plan is armed,
its blocks are the ones it was blended into, and it decodes one token; a new reader is armed
here (its rows verified against the masters, its masters tiled, its blocks given back where
sharing and the speed guard allow it). Plain torch: vLLM only through the seam.
"""

from __future__ import annotations

from collections import Counter
from typing import TYPE_CHECKING

import torch

from kmesh_blend.vllm.cascade_attend import KernelCalls, Step
from kmesh_blend.vllm.cascade_buffers import Sources, compose, partition
from kmesh_blend.vllm.decode_plan import DecodePlan, SharedMaster
from kmesh_blend.vllm.seam.cpu_attention import sub_batch

if TYPE_CHECKING:
    from kmesh_blend.vllm.cascade_decode import CascadeDecode
    from kmesh_blend.vllm.seam.cpu_attention import AttnLayer, StepBatch

__all__ = ["PINNED", "PREEMPTED", "arm_reader", "build_step", "without_lone_readers"]

PREEMPTED = "preempted: {}; later steps on vLLM's kernel"
PINNED = (
    "kmesh: requests whose segment blocks went back to vLLM's pool (kmesh.share_kv_memory) "
    "cannot be served by vLLM's kernel, and this step cannot run in cascade: {}"
)


def build_step(d: CascadeDecode, batch: StepBatch, layer: AttnLayer, dtype: torch.dtype,
               only_pinned: bool = False) -> Step | None:  # fmt: skip
    """The step of ``d``'s cascade requests in ``batch`` (None: vLLM's forward serves it):
    plans matched by request id and block table, new readers armed (`arm_reader`; one alone
    with its masters only where `SpeedGuard.arms_alone`), lone readers
    left to vLLM's kernel where the speed guard says so, the set composed, vLLM's sub-batch of
    the other requests built. Records the step's arming time (new readers' own rows placed in
    their slots included: paid once per reader, as its verification) and context rows on
    ``d``."""
    num_reqs = int(batch.seq_lens.numel())
    ids = d.req_ids(num_reqs)
    if ids is None or len(ids) < num_reqs:
        if d.num_pinned:
            raise RuntimeError(PINNED.format("the batch's request ids are unknown"))
        return None
    starts = batch.query_start_loc.tolist()
    seq_lens = batch.seq_lens.tolist()
    decoding: list[tuple[int, DecodePlan]] = []
    for i, req_id in enumerate(ids[:num_reqs]):
        plan = d.plans.get(req_id)
        if plan is None or (only_pinned and not plan.pinned):
            continue
        if not plan.holds(batch.block_table[i]):
            d.drop(req_id, PREEMPTED.format("its blocks changed"))
        elif starts[i + 1] - starts[i] == 1 and seq_lens[i] > plan.num_tokens:
            decoding.append((i, plan))
        elif plan.armed:  # prefilled again after a preemption: its rows are new
            d.drop(req_id, PREEMPTED.format("its prompt was computed again"))
    # a new reader alone with its masters is armed only where that pays (`SpeedGuard.arms_alone`);
    # else once another reader of them decodes beside it
    readers = Counter(key for _, plan in decoding for key in {use.key for use in plan.uses})
    chosen: list[tuple[int, DecodePlan]] = []
    armed_now: set[str] = set()
    for i, plan in decoding:
        req_id = plan.req_id
        if not plan.armed:
            if not d.guard.arms_alone and all(readers[use.key] == 1 for use in plan.uses):
                continue
            plan.complete(batch.block_table[i], d.layout.block_size)
            if (why := d.guard.keeps_out(plan.steps_left(seq_lens[i]))) is not None:
                d.drop(req_id)  # one log line says the rule (the guard's), its report says why
                d.reports.setdefault(req_id, {})["cascade_off"] = why
                continue
            if not arm_reader(d, req_id, plan):
                continue
            armed_now.add(req_id)
        chosen.append((i, plan))
    if d.guard.alone_on_stock and chosen:
        chosen = without_lone_readers(chosen)
    if not chosen:
        return None
    for _, plan in chosen:
        plan.steps += 1
        d.reports.setdefault(plan.req_id, {}).update(
            cascade_steps=plan.steps,
            cascade_shared_rows=plan.shared_rows,
            cascade_kernel="cpu" if d.kernel is not None else "torch",
        )
    rows = [i for i, _ in chosen]
    d.step_context_rows = sum(seq_lens[i] for i in rows)
    generated = [seq_lens[i] - 1 - plan.num_tokens for i, plan in chosen]
    # blocks given back this step still hold their rows: the scheduler takes them after it
    intact = frozenset(d.sharing.pending) if d.sharing is not None else frozenset()
    sources = Sources(d.masters, d.caches, d.layout, d.rope, intact)
    if armed_now:  # a new reader's own rows into its slot: once per reader, part of its arming
        start = d.clock.now()
        for r, (i, plan) in enumerate(chosen):
            if plan.req_id in armed_now:
                d.pool.place(plan, batch.block_table[i], generated[r], sources)
        d.step_arm_s += d.clock.now() - start
    composition = compose(batch, chosen, generated, d.composition, d.pool, sources)
    d.composition = composition
    for slot, g in zip(composition.slots, generated, strict=True):
        d.pool.filled[slot] = g + 1  # this step's row, appended by every layer
    others = sorted(set(range(num_reqs)) - set(rows))
    tokens = torch.tensor([starts[i] for i in rows], dtype=torch.int64)
    done = torch.tensor(generated, dtype=torch.int64)
    groups = [(group, tokens[group.rows], done[group.rows]) for group in composition.groups]
    calls = d.calls  # the CPU kernel's: built again only when the set or the pool changed
    if d.kernel is not None and (calls is None or not calls.serves(composition, d.pool)):
        calls = d.calls = KernelCalls(composition, d.pool, d.heads)
    if calls is not None:
        calls.advance(groups)
    others_batch = sub_batch(batch, layer, dtype, others, starts) if others else None
    lone = all(int(group.rows.numel()) == 1 for group in composition.groups)
    return Step(tokens, groups, others_batch, calls, lone)


def arm_reader(d: CascadeDecode, req_id: str, plan: DecodePlan) -> bool:
    """Arm ``plan`` at its first decode step: verify its rows (`DecodePlan.arm`), hold its
    masters in the kernel's layout, give its blocks back where sharing and the speed guard
    allow; False (and the plan dropped, saying why) when it cannot decode in cascade."""
    start = d.clock.now()
    reason = plan.arm(d.layout, d.caches, d.rope)
    if reason is None and d.guard.timing is not None and 2 * plan.shared_rows < plan.num_tokens:
        # what cascade saves grows with the rows a reader shares; its own rows cost as on
        # vLLM's kernel, and widen every slot of the pool
        plan.armed = False  # (no master counts it yet)
        reason = (f"speed guard: {plan.shared_rows} of its {plan.num_tokens} prompt rows are "
                  "read from masters, fewer than its own: vLLM's kernel serves it")  # fmt: skip
    if reason is not None:
        d.step_arm_s += d.clock.now() - start
        d.drop(req_id, reason)
        return False
    for use in plan.uses:
        if use.key not in d.masters:
            d.masters[use.key] = SharedMaster.of(
                use.master, d.caches[0].dtype, tiled=d.kernel is not None, gemm=d.level.gemm
            )
        d.masters[use.key].users += 1
    if d.sharing is not None:
        plan.releasable = d.sharing.releasable(plan, d.layout.block_size)
    if d.sharing is not None and (why := d.guard.gives_back) is not None:
        d.reports.setdefault(req_id, {})["kv_share_off"] = why
    elif d.sharing is not None:
        field, value = d.sharing.consider(plan, d.layout.block_size, d.layout, d.caches)
        d.reports.setdefault(req_id, {})[field] = value
    d.step_arm_s += d.clock.now() - start
    return True


def without_lone_readers(chosen: list[tuple[int, DecodePlan]]) -> list[tuple[int, DecodePlan]]:
    """``chosen`` less each request that is a master's only reader in the step and still holds
    its blocks: vLLM's kernel serves it faster here (`SpeedGuard.alone_on_stock`)."""
    plans = [plan for _, plan in chosen]
    lone = {g[0] for g in partition(plans) if len(g) == 1 and not plans[g[0]].pinned}
    return [pair for r, pair in enumerate(chosen) if r not in lone]
