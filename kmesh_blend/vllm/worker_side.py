"""Worker side of the connector: blend the step's reusing requests, write their KV into vLLM's
paged cache before the forward, and store new masters after it.

The blend runs on the model vLLM loaded (`VllmModel`: vLLM's own modules and weights, reached
through the seam), after a start-up check that our layer steps give the same bits as the
model's own forward; a model that fails it is served on the stock path (every reuse falls back,
naming the reason). Any problem with one request — a master that cannot be read or fails its
checksum, an unknown cache layout, an exception in the blend — marks that request's blocks as
failed loads, so vLLM recomputes it from scratch; its siblings are unaffected. Concerns live
apart: loading (`worker_load`), lifetimes (`worker_lifetimes`), metrics (`worker_stats`).
"""

from __future__ import annotations

import logging
import traceback
from collections.abc import Callable
from typing import TYPE_CHECKING

import torch

from kmesh_blend.blend import BlendOptions, BlendRequest
from kmesh_blend.config import KMeshConfig
from kmesh_blend.mirror.lifecycle import MirrorStore
from kmesh_blend.segments.cache import SegmentCache
from kmesh_blend.segments.index import SegmentIndex
from kmesh_blend.segments.master import MasterLayout
from kmesh_blend.segments.store import open_store
from kmesh_blend.vllm.cascade_attend import EngineKV, Heads
from kmesh_blend.vllm.cascade_decode import CascadeDecode, MasterUse
from kmesh_blend.vllm.cascade_install import install as install_cascade
from kmesh_blend.vllm.meta import KMeshMetadata, KMeshWorkerMetadata, LoadRequest, Report
from kmesh_blend.vllm.model import VllmModel, adapt
from kmesh_blend.vllm.paged import PagedLayout
from kmesh_blend.vllm.paged_attention import PagedAttention
from kmesh_blend.vllm.seam.engine import in_model_order
from kmesh_blend.vllm.stats import Payload
from kmesh_blend.vllm.tails import Tails
from kmesh_blend.vllm.turns import keep_turn, restore_turn
from kmesh_blend.vllm.worker_lifetimes import Lifetimes
from kmesh_blend.vllm.worker_load import (
    Masters,
    WorkerHooks,
    agree,
    blend_groups,
    blend_request,
    fetch_masters,
)
from kmesh_blend.vllm.worker_publish import publish
from kmesh_blend.vllm.worker_stats import WorkerStats

if TYPE_CHECKING:
    from transformers import PretrainedConfig

    from kmesh_blend.vllm.seam.cpu_attention import AttnLayer
    from kmesh_blend.vllm.seam.runners import BatchOrder

__all__ = ["WorkerHooks", "WorkerSide"]

log = logging.getLogger("vllm.kmesh_blend")  # under vLLM's handlers and format


class WorkerSide:
    """``model``: the ``nn.Module`` vLLM loaded (None when it could not be reached);
    ``layers``: the attention layers by name; ``shard``: (tensor-parallel rank, size);
    ``batch_ids``: the step's request ids in batch order (`seam.runners.batch_order`);
    ``skip_tail_forward``: a forward of prompt tails alone may be skipped (`Tails`)."""

    def __init__(self, config: KMeshConfig, model: torch.nn.Module | None,
                 hf_config: PretrainedConfig, dtype: torch.dtype, block_size: int,
                 layers: dict[str, AttnLayer], shard: tuple[int, int] = (0, 1),
                 batch_ids: BatchOrder | None = None,
                 skip_tail_forward: bool = False) -> None:  # fmt: skip
        self.config, self.block_size, self.batch_ids = config, block_size, batch_ids
        self.world_size = shard[1]
        self.hooks = WorkerHooks()
        self.cascade: CascadeDecode | None = None
        self.cascade_off: str | None = "the paged KV layout is unknown"  # reported when it is on
        adapter, self.unsupported = adapt(model, hf_config, dtype)
        self.model = adapter if isinstance(adapter, VllmModel) else None  # what the blend runs on
        shape = self.shape = adapter.shape
        self.rope = adapter.rope
        config.validate_for_model(shape.num_layers)
        rank, world = shard  # under tensor parallelism each rank stores masters of its own heads
        self.layout = MasterLayout(shape.num_layers, shape.num_kv_heads, shape.head_dim,
                                   str(dtype).removeprefix("torch."), rank, world)  # fmt: skip
        self.store = open_store(config.store_spec, self.layout, cpu_bytes=config.store_cpu_bytes,
                                timeout_s=config.store_timeout_s)  # fmt: skip
        self.cache = SegmentCache(
            self.store, index=SegmentIndex(keep_rounds=config.round_lifetime),
            retention_bytes=config.retention_bytes, timeout_s=config.singleflight_timeout_s,
        )  # fmt: skip
        self.lifetimes = Lifetimes(self.cache)
        self.stats = WorkerStats(self.cache, self.store)
        self.mirrors = MirrorStore(self.cache, compress=config.compress_mirrors)
        self.options = BlendOptions.from_config(config)
        self.attn_layers = layers
        self.kv_caches: list[torch.Tensor] = []
        self.paged: PagedLayout | None = None
        self.kernel: PagedAttention | None = None  # vLLM's attention kernel for blends, if checked
        self.failed_blocks: set[int] = set()  # for vLLM, taken each step
        self.failed_reqs: set[str] = set()  # requests that recompute: this step's, until output
        self.out = KMeshWorkerMetadata()
        # The blend's results for the tokens vLLM computes itself (kmesh_blend/vllm/tails.py).
        tail_model = model if self.unsupported is None else None
        self.tails = Tails(tail_model, self._failed, skip_tail_forward and self.world_size == 1)

    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        if self.model is None:
            return
        names = in_model_order(kv_caches)
        shape = self.shape
        if len(names) != shape.num_layers:
            log.warning("kmesh: %d KV cache layers for a %d-layer model; reuse disabled",
                        len(names), shape.num_layers)  # fmt: skip
            return
        self.kv_caches = [kv_caches[n] for n in names]
        layers = [self.attn_layers[n] for n in names]
        self.paged = PagedLayout.discover(layers[0], self.kv_caches[0], shape.num_kv_heads,
                                          shape.head_dim, self.block_size)  # fmt: skip
        if self.paged is None:
            return
        self.kernel = PagedAttention.create(layers, self.kv_caches, self.paged, shape.num_heads,
                                            shape.num_kv_heads, shape.head_dim,
                                            self.model.attend)  # fmt: skip
        if not self.config.cascade_decode:
            return
        if self.batch_ids is None:
            self.cascade_off = "the model runner's batch order is not reachable"
        else:
            heads = Heads(shape.num_heads, shape.num_kv_heads, shape.head_dim)
            kv = EngineKV(layers, self.kv_caches, self.paged, self.rope, heads)
            self.cascade, self.cascade_off = install_cascade(kv, self.batch_ids, self.config)
            self.stats.held = self.cascade.gauges if self.cascade is not None else None
            if self.cascade is not None and self.config.share_kv_memory:
                self.cascade.share(self.world_size, self.config.share_kv_host_bytes)

    @torch.no_grad()
    def load(self, meta: KMeshMetadata) -> None:
        """Blend and write every load request of this step (before the forward)."""
        self.lifetimes.apply(meta, self.out)
        masters: Masters = {}
        blends = []
        for load in meta.loads:
            if load.turn is not None:  # a continuing request: its earlier prompt, restored
                self._restore_turn(load)
            else:
                blends.append((load, self._prepare(load, masters)))
        ready: list[tuple[LoadRequest, BlendRequest]] = []
        world = self.model.world_size if self.model is not None else 1
        for load, reason in agree(blends, world):
            if reason is None:
                ready.append((load, blend_request(load, masters, self._prefix_kv(load))))
            else:
                self._fail(load, reason)
        if ready:
            self._blend_and_write(ready, masters)

    @torch.no_grad()
    def save(self, meta: KMeshMetadata) -> None:
        """Store the KV of new segments, read back from the paged cache (after the forward)."""
        if self.paged is None:
            return
        self.tails.write_back(self.paged, self.kv_caches)
        if self.hooks.capture is not None:
            for load in meta.loads:
                if not self._failed(load.req_id):
                    self.hooks.capture(load.req_id, self._prompt_kv(load.slots(self.block_size)))
        for load in meta.loads:
            if load.keep is not None and not self._failed(load.req_id):
                kv = self._prompt_kv(load.slots(self.block_size))
                keep_turn(load, kv, self.mirrors, self.cache, self.rope.inv_freq, self.out)
        for save in meta.saves:
            if self._failed(save.req_id):  # its blocks hold no valid KV until vLLM recomputes
                self.out.unpublished.extend(ref.segment_id for ref in save.segments)
            else:
                publish(save, self._prompt_kv, self.block_size, self.cache, self.store,
                        self.lifetimes, self.out)  # fmt: skip
        self.lifetimes.after_saves(meta.saves, self.out)

    def finished(self, req_ids: set[str]) -> None:
        """Requests vLLM finished: their decode plans go (their blocks may be reused)."""
        if self.cascade is not None:
            for req_id in req_ids:
                self.cascade.drop(req_id)

    def take_failed_blocks(self) -> set[int]:
        failed, self.failed_blocks = self.failed_blocks, set()
        return failed

    def take_output(self) -> KMeshWorkerMetadata | None:
        out, self.out = self.out, KMeshWorkerMetadata()
        self.failed_reqs = set()
        out.disabled = self.unsupported
        if self.cascade is not None:
            for req_id, fields in self.cascade.take_reports().items():
                out.reports.setdefault(req_id, {}).update(fields)  # type: ignore[typeddict-item]
            if self.cascade.sharing is not None:
                out.releases = self.cascade.sharing.take()
        return out if (out.reports or out.releases or out.published or out.disabled or out.lost
                       or out.unpublished or out.retired or out.closed_upto
                       or out.rounds) else None  # fmt: skip

    def take_stats(self) -> Payload | None:
        return self.stats.take()

    def close(self) -> None:
        self.tails.close()
        self.store.close()

    # --- helpers --------------------------------------------------------------------------------

    def _prepare(self, load: LoadRequest, masters: Masters) -> str | None:
        """Fetch the masters of ``load`` into ``masters``; the failure reason, or None."""
        if self.unsupported is not None:
            return self.unsupported
        if self.paged is None:
            return "paged KV layout unknown"
        if (reason := load.unheld(self.block_size)) is not None:
            return reason
        if self.hooks.fault is not None and (reason := self.hooks.fault(load)) is not None:
            return reason
        return fetch_masters(load, masters, self.cache, self.lifetimes, self.out)

    def _blend_and_write(self, ready: list[tuple[LoadRequest, BlendRequest]],
                         masters: Masters) -> None:  # fmt: skip
        try:
            # With vLLM's kernel, each layer's KV goes into the paged cache as the blend runs.
            bs, kernel = self.block_size, self.kernel
            hooks = [kernel.hook(load.block_ids, load.slots(bs)[: load.blend_len], first=load.first)
                     if kernel is not None else None for load, _ in ready]  # fmt: skip
            assert self.model is not None  # a load is ready only when the blend can run
            results = blend_groups(self.model, ready, masters, self.options, hooks)
            for (load, _), result, hook in zip(ready, results, hooks, strict=True):
                slots, n = load.slots(self.block_size), load.blend_len
                if hook is None and self.paged is not None:
                    rows = slots[load.first : n - load.tail]
                    self.paged.write_layers(self.kv_caches, result.keys, result.values, rows,
                                            load.first)  # fmt: skip
                if load.tail:
                    finals = self.model.final_norm(result.last_state[-load.tail :])
                    written = hook is not None  # vLLM's kernel path wrote every row already
                    self.tails.keep(load.req_id, slots[n - load.tail : n], n - load.tail,
                                    result.keys, result.values, finals, written)  # fmt: skip
                report = self.out.reports.setdefault(load.req_id, {})
                report.update(result.report_fields())  # type: ignore[typeddict-item]
                self._decode_plan(load, masters, report)
        except Exception as exc:  # never serve doubtful KV: the whole group recomputes
            # As text: a log record holding the exception would keep the engine's frames alive.
            log.warning("kmesh: blend failed; %d requests recompute\n%s", len(ready),
                        traceback.format_exc())  # fmt: skip
            for load, _ in ready:
                self._fail(load, f"blend error: {type(exc).__name__}: {exc}")

    def _decode_plan(self, load: LoadRequest, masters: Masters, report: Report) -> None:
        """Hand a blended request to the cascade decode path (armed at its first decode step)."""
        if self.cascade is None:
            if self.config.cascade_decode:
                report["cascade_off"] = self.cascade_off
            return
        uses = [MasterUse(r.segment_id, r.start, r.end, masters[r.segment_id])
                for r in load.segments if r.segment_id in masters]  # fmt: skip
        self.cascade.add(load.req_id, load.block_ids, load.slots(self.block_size), uses, load.first,
                         len(load.token_ids), load.max_tokens)  # fmt: skip

    def _prompt_kv(self, slots: torch.Tensor) -> torch.Tensor:
        """KV at ``slots`` [n] read back from the paged cache: [L, 2, n, Hkv, D]."""
        assert self.paged is not None
        return self.paged.read_layers(self.kv_caches, slots)

    def _prefix_kv(self, load: LoadRequest) -> Callable[[int], torch.Tensor]:
        return lambda first: self._prompt_kv(load.slots(self.block_size)[:first])

    def _failed(self, req_id: str) -> bool:
        return req_id in self.failed_reqs

    def _restore_turn(self, load: LoadRequest) -> None:
        assert load.turn is not None
        reason = "paged KV layout unknown" if self.paged is None else None
        if reason is None:
            reason = load.unheld(self.block_size)
        if reason is None and self.hooks.fault is not None:
            reason = self.hooks.fault(load)
        if reason is None and self.paged is not None:
            reason = restore_turn(self.mirrors, load.turn, load.turn_len, self.paged,
                                  self.kv_caches, load.slots(self.block_size),
                                  self.rope.inv_freq)  # fmt: skip
        if reason is not None:
            return self._fail(load, reason)
        restored = {"reused_tokens": load.turn_len, "recomputed_tokens": 0, "storage_reads": 0}
        self.out.reports.setdefault(load.req_id, {}).update(restored)  # type: ignore[typeddict-item]

    def _fail(self, load: LoadRequest, reason: str) -> None:
        log.warning("kmesh: request %s recomputes: %s", load.req_id, reason)
        if self.cascade is not None:
            self.cascade.drop(load.req_id)
        self.failed_blocks.update(load.block_ids)
        self.failed_reqs.add(load.req_id)
        fields: Report = {"reused_tokens": 0, "recomputed_tokens": 0}
        self.out.reports[load.req_id] = {**fields, "fallback": f"load error: {reason}"}
