"""Cascade attention in vLLM's decode: requests that read the same master attend to it once.

Switched on by ``kmesh.cascade_decode``. The worker gives each attention layer of this engine a
subclass of its backend implementation (`kmesh_blend.vllm.cascade_install`: vLLM's CPU backend,
no file patched, no global registry entry; `kmesh_blend.vllm.seam.cpu_attention.route`) whose
``forward`` asks `CascadeDecode.forward`. Per
step — the same attention metadata object serves every layer, so the step is planned once — the
batch's requests are matched to decode plans (`kmesh_blend.vllm.decode_plan`) by request id (the
runner's batch order) *and* by their block-table rows. Requests decoding one token whose plan is
armed attend in cascade: each master's K/V read once for all its readers (rows a reader replaced
masked for it), and each request's own rows (its other prompt rows, copied out of its blocks when
the set of decoding requests forms, and its generated rows, appended from the forward's key/value
every step). Two implementations of the same math: the CPU kernel
(`kmesh_blend.cpu.cascade_decode_op`: one call per layer, K/V in the cache dtype, tiled by
`kmesh_blend.cpu.layout`) when it is built and the shapes allow, else plain torch
(`kmesh_blend.attention.decode.decode_cascade`, fp32 copies). Every other request of the
step runs on vLLM's own kernel as a sub-batch (`seam.cpu_attention.sub_batch`); a
step with no cascade request, or whose metadata is anything but plain causal attention, runs
vLLM's forward unchanged. An exception inside the path hands every later step to vLLM's forward.
"""

from __future__ import annotations

import logging
import traceback
from collections.abc import Callable
from typing import TYPE_CHECKING

import torch

from kmesh_blend.cpu.level import KernelLevel
from kmesh_blend.vllm.cascade_attend import (
    EngineKV,
    Heads,
    Kernel,
    KernelCalls,
    Step,
    attend_kernel,
    attend_torch,
)
from kmesh_blend.vllm.cascade_buffers import Composition, OwnPool
from kmesh_blend.vllm.cascade_clock import StepClock, StepParts
from kmesh_blend.vllm.cascade_step import PINNED, build_step
from kmesh_blend.vllm.decode_plan import DecodePlan, MasterUse, SharedMaster
from kmesh_blend.vllm.kv_release import Sharing
from kmesh_blend.vllm.seam.cpu_attention import attn_scale, run_kernel
from kmesh_blend.vllm.speed_guard import SpeedGuard

if TYPE_CHECKING:
    from kmesh_blend.vllm.seam.cpu_attention import AttnLayer, StepBatch, Stock

__all__ = ["CascadeDecode", "Heads", "Kernel", "MasterUse"]

log = logging.getLogger("vllm.kmesh_blend")  # under vLLM's handlers and format

ReqIds = Callable[[int], "list[str] | None"]
Fields = dict[str, "int | str | None"]  # report fields of one request


class CascadeDecode:
    """``kv``: the engine's attention layers, caches, layout, rope and heads; ``req_ids(n)``:
    the ids of the batch's first n requests in the order of the attention metadata (None when
    unknown: no cascade).
    ``paused``: every step runs vLLM's forward while set, plans stay (benchmarks compare both
    in one engine)."""

    def __init__(self, kv: EngineKV, req_ids: ReqIds, kernel: Kernel | None = None) -> None:
        self.layers, self.caches, self.layout, self.rope, heads = kv
        self.kernel = kernel
        self.heads = heads
        self.num_heads, self.num_kv_heads, self.head_dim = heads
        self.req_ids = req_ids
        self.plans: dict[str, DecodePlan] = {}
        self.masters: dict[str, SharedMaster] = {}
        self.reports: dict[str, Fields] = {}  # req_id → report fields, taken per step
        self.paused = False
        self._meta: tuple[object, int] | None = None  # what the cached step was built for
        self._step: Step | None = None
        self.composition: Composition | None = None
        self.calls: KernelCalls | None = None  # the CPU kernel's, of the last composition
        # each cascade request's own rows, one slot for its whole decode (CPU kernel: the KV
        # dtype in its tiles; torch path: fp32)
        self.pool = OwnPool(len(self.caches), (self.num_kv_heads, self.head_dim),
                            self.caches[0].dtype, tiled=kernel is not None)  # fmt: skip
        self.broken: str | None = None  # set by an error inside the path: vLLM's forward only
        self.sharing: Sharing | None = None  # with kmesh.share_kv_memory (`share`)
        self.guard = SpeedGuard("off")  # set by `cascade_install.install` (kmesh.speed_guard)
        self.level = KernelLevel()  # how the CPU kernel reads masters (`cascade_install`)
        self.clock = StepClock()  # the parts of recent cascade steps
        self._parts: StepParts | None = None
        self.step_arm_s = 0.0  # of this step's plan: arming new readers (once per request)
        self.step_context_rows = 0  # of this step's cascade requests
        self._began: tuple[int, float] | None = None  # (tokens, clock) of the step under way
        self.pool_blocks = max(1, self.layout.views(self.caches[0])[0].shape[0])  # vLLM's pool

    def share(self, world_size: int, cap: int) -> None:
        """Give back readers' segment blocks from now on (``kmesh.share_kv_memory``), their
        mirrors within ``cap`` bytes."""
        off = None  # (the speed guard decides per reader: `cascade_step.arm_reader`)
        if self.kernel is None:
            off = "cascade decode runs on its plain-torch fallback, not the CPU kernel"
        elif world_size > 1:
            off = f"tensor parallelism ({world_size} ranks would each have to agree)"
        self.sharing = Sharing(off, cap)

    # --- lifecycle ------------------------------------------------------------------------------

    def add(self, req_id: str, block_ids: list[int], slots: torch.Tensor, uses: list[MasterUse],
            first: int = 0, prompt_len: int | None = None,
            max_tokens: int | None = None) -> None:  # fmt: skip
        """A request blended this step (``slots`` [T'] int64: the slots of the prompt tokens its
        blocks hold so far, of ``prompt_len`` (None: T'); the blend wrote tokens ``first``.. of
        them; it generates at most ``max_tokens``); its plan is completed and armed at its first
        decode step."""
        self.drop(req_id)
        if self.broken is not None:
            self.reports[req_id] = {"cascade_off": f"cascade decode failed: {self.broken}"}
        elif uses and not self.guard.admits:
            self.reports[req_id] = {"cascade_off": self.guard.reason}
        elif uses:
            self.plans[req_id] = DecodePlan(req_id, list(block_ids), slots, uses, first,
                                            prompt_len, max_tokens)  # fmt: skip
            self.reports[req_id] = {"cascade_steps": 0}

    def drop(self, req_id: str, reason: str | None = None) -> None:
        plan = self.plans.pop(req_id, None)
        self.pool.release(req_id)
        if self.sharing is not None:
            self.sharing.forget(req_id)
        if plan is None:
            return
        if reason is not None:
            log.info("kmesh: request %s leaves cascade decode: %s", req_id, reason)
            self.reports.setdefault(req_id, {})["cascade_off"] = reason
        if plan.armed:
            for use in plan.uses:
                master = self.masters.get(use.key)
                if master is not None:
                    master.users -= 1
                    if master.users <= 0:
                        del self.masters[use.key]
        self.composition = None

    def note_memory(self, short: bool, tokens: int = 0) -> None:
        """A step begins (before its loads and forward), with the scheduler's signals for the
        speed guard: a request waited for KV blocks; the step computes ``tokens`` tokens."""
        self._began = (tokens, self.clock.now())
        self._note(self.guard.note_memory(short))

    def step_done(self) -> None:
        """The step's forward ended: its time (the guard's fit of step time against tokens) and
        that of its cascade part (from planning on)."""
        now = self.clock.now()
        if self._began is not None:
            tokens, began = self._began
            self._note(self.guard.note_step(tokens, now - began))
            self._began = None
        if self._parts is not None and not self._parts.period_s:
            self._parts.period_s = now - self._parts.opened

    def _withdraw(self, reason: str | None) -> None:
        """The speed guard turned the path off: every reader that still holds its blocks goes
        to vLLM's kernel from this step on (those whose blocks went back stay: only this path
        can read them)."""
        pinned = self.sharing.pinned if self.sharing is not None else {}
        for req_id in [r for r in self.plans if r not in pinned]:
            self.drop(req_id)  # (the guard's own log line says why, once)
            self.reports.setdefault(req_id, {})["cascade_off"] = reason

    def _note(self, line: str | None) -> None:
        if line is not None:
            log.info("%s", line)

    def take_reports(self) -> dict[str, Fields]:
        out, self.reports = self.reports, {}
        return out

    # --- the attention forward ------------------------------------------------------------------

    def forward(
        self,
        index: int,
        stock: Stock,
        layer: AttnLayer,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        kv_cache: torch.Tensor,
        batch: StepBatch,
        output: torch.Tensor,
    ) -> torch.Tensor:
        """Attention of layer ``index``; ``stock()`` runs vLLM's own forward of this call."""
        if not self.plans and self._parts is None:  # nothing to plan, nothing left to weigh
            return stock()
        # The same metadata object serves every layer of a step; its total length grows every
        # step, so a backend that reused the object would still be noticed.
        stamp = (batch.key, int(batch.seq_lens.sum()))
        if self._meta is None or stamp[0] is not self._meta[0] or stamp[1] != self._meta[1]:
            if self._parts is not None:  # the last cascade step, finished: weighed
                self._note(self.guard.observe(self._parts, len(self.layers), self.freed))
                if not self.guard.admits:
                    self._withdraw(self.guard.reason)
            self._meta, self._step, self._parts = stamp, None, None
            # paused: only readers whose blocks went back still need the path
            if self.plans and self.broken is None and (not self.paused or self.num_pinned):
                start, self.step_arm_s = self.clock.now(), 0.0
                try:
                    self._step = self._build(batch, layer, query.dtype, only_pinned=self.paused)
                except Exception as exc:
                    self._break(exc)
                if self._step is not None:
                    self._parts = self.clock.open(
                        int(self._step.tokens.numel()),
                        0 if self._step.others is None else int(self._step.others[0].numel()),
                        self.clock.now() - start,
                        self.step_arm_s,
                        self.step_context_rows,
                        self._step.lone,
                    )
        step, parts = self._step, self._parts
        if step is None or parts is None:
            return stock()
        num = batch.num_tokens
        out = output[:num].view(num, self.num_heads, self.head_dim)
        try:
            start = self.clock.now()
            if self.kernel is not None:
                self._run_kernel(index, step, layer, query, key, value, out)
            else:
                self._attend(index, step, layer, query, key, value, out)
            middle = self.clock.now()
            parts.cascade_s += middle - start
            if step.others is not None:
                rows, kernel_batch = step.others
                out[rows] = run_kernel(layer, kv_cache, query[rows], kernel_batch)
                parts.others_s += self.clock.now() - middle
        except Exception as exc:  # never serve doubtful KV: this and later steps run stock
            self._break(exc)
            self._step = None
            return stock()
        return output

    @property
    def master_bytes(self) -> int:
        """Bytes of the masters held for live readers (next to vLLM's KV budget)."""
        return sum(m.k_t.nbytes + m.v.nbytes for m in self.masters.values())

    def gauges(self) -> dict[str, int]:
        """``/metrics`` gauges: KV held next to vLLM's budget (bytes: masters, and mirrors with
        sharing) and the speed guard's decision (`SpeedGuard.gauges`)."""
        mirrors = self.sharing.mirror_bytes if self.sharing is not None else 0
        return {"shared_master_bytes": self.master_bytes, "mirror_bytes": mirrors,
                **self.guard.gauges()}  # fmt: skip

    @property
    def freed(self) -> float:
        """Blocks the armed readers gave back or would give back (where sharing may), a share of
        the engine's pool (the speed guard)."""
        back = sum(p.releasable for p in self.plans.values() if p.armed)
        return back / self.pool_blocks

    @property
    def num_pinned(self) -> int:
        return len(self.sharing.pinned) if self.sharing is not None else 0

    def unreadable_step(self) -> None:
        """A step whose metadata the path cannot read runs on vLLM's kernel: refused while a
        reader's blocks are given back (that kernel would read blocks others now hold)."""
        if self.num_pinned:
            raise RuntimeError(PINNED.format("its attention metadata is not plain causal"))

    def _run_kernel(self, index: int, step: Step, layer: AttnLayer, query: torch.Tensor,
                    key: torch.Tensor, value: torch.Tensor, out: torch.Tensor) -> None:  # fmt: skip
        assert self.kernel is not None and step.calls is not None
        attend_kernel(self.kernel, index, step.calls, query, key, value, out, self.heads,
                      attn_scale(layer), self.level.exact)  # fmt: skip

    def _attend(self, index: int, step: Step, layer: AttnLayer, query: torch.Tensor,
                key: torch.Tensor, value: torch.Tensor, out: torch.Tensor) -> None:  # fmt: skip
        attend_torch(index, step, self.pool, query, key, value, out, self.heads, self.rope,
                     attn_scale(layer))  # fmt: skip

    def _break(self, exc: Exception) -> None:
        pinned = self.num_pinned
        self.broken = f"{type(exc).__name__}: {exc}"
        log.warning(
            "kmesh: cascade decode failed, vLLM's forward serves from now on: %s\n%s",
            self.broken,
            traceback.format_exc(),
        )
        for req_id in list(self.plans):
            self.drop(req_id, f"cascade decode failed: {self.broken}")
        if pinned:  # vLLM's kernel would read blocks other requests now hold
            raise RuntimeError(PINNED.format(f"cascade decode failed: {self.broken}")) from exc

    # --- per-step plan (`kmesh_blend.vllm.cascade_step`) -----------------------------------------

    def _build(self, batch: StepBatch, layer: AttnLayer, dtype: torch.dtype,
               only_pinned: bool = False) -> Step | None:  # fmt: skip
        return build_step(self, batch, layer, dtype, only_pinned)
