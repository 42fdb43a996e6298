"""`KMeshConnector`: the vLLM KV connector facade (engine args only; no vLLM file is patched).

Enable it with ``--kv-transfer-config`` / ``LLM(kv_transfer_config=...)``::

    {"kv_connector": "KMeshConnector", "kv_connector_module_path": "kmesh_blend.vllm",
     "kv_role": "kv_both", "kv_connector_extra_config": {"kmesh.store": "cpu", ...}}

vLLM builds one instance per role. The scheduler-side instance delegates to `SchedulerSide`
(annotations, lookups, plans, reports), the worker-side one to `WorkerSide` (blend, paged writes,
master storage). All loads are synchronous: the blended KV is in the paged cache before the
forward that computes each request's last prompt token.

vLLM's internals (the loaded model, attention layers, block hashes, scheduler output fields) are
reached only through `kmesh_blend.vllm.seam`.

Failed loads: the connector sets ``kv_load_failure_policy = "recompute"``, so a request whose
reuse fails (unreadable or corrupt master, unknown layout, blend error) is recomputed by vLLM
from scratch while its siblings keep their reuse.

Prefix caching: blended KV is an approximation of the exact prefill, so it must never be served
later as exact prefix KV. With vLLM's prefix caching on, the scheduler side gives a blended
request's blocks hashes private to it before vLLM caches them (`kmesh_blend.vllm.prefix_cache`);
a start-up check proves the mechanism on this vLLM, else the connector refuses to start with
prefix caching on and says why.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING, cast

import torch
from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorMetadata,
    KVConnectorRole,
    KVConnectorWorkerMetadata,
)
from vllm.distributed.kv_transfer.kv_connector.v1.metrics import KVConnectorStats

from kmesh_blend.config import KMeshConfig
from kmesh_blend.vllm.memory_value import waits_for_blocks
from kmesh_blend.vllm.meta import KMeshMetadata
from kmesh_blend.vllm.prom import KMeshPromMetrics, KMeshStats
from kmesh_blend.vllm.scheduler_side import SchedulerSide
from kmesh_blend.vllm.seam import log_report
from kmesh_blend.vllm.seam.blocks import (
    block_bytes,
    free_blocks,
    held_blocks,
    release_blocks,
    step_requests,
)
from kmesh_blend.vllm.seam.engine import attention_layers, recompute_failed_loads, tp_shard
from kmesh_blend.vllm.seam.runners import batch_order, loaded_model
from kmesh_blend.vllm.startup import engine_namespace, prefix_privatizer, shared_store_lookup
from kmesh_blend.vllm.stats import Payload
from kmesh_blend.vllm.worker_side import WorkerSide

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.forward_context import ForwardContext
    from vllm.v1.attention.backend import AttentionMetadata
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks, KVCacheManager
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.kv_cache_interface import KVCacheConfig
    from vllm.v1.outputs import KVConnectorOutput
    from vllm.v1.request import Request

__all__ = ["KMeshConnector"]

log = logging.getLogger("vllm.kmesh_blend")  # under vLLM's handlers and format


class KMeshConnector(KVConnectorBase_V1):
    def __init__(
        self, vllm_config: VllmConfig, role: KVConnectorRole, kv_cache_config: KVCacheConfig
    ) -> None:
        super().__init__(vllm_config=vllm_config, role=role, kv_cache_config=kv_cache_config)
        extra = self._kv_transfer_config.kv_connector_extra_config
        self.config = KMeshConfig.from_extra_config(extra)
        if recompute_failed_loads(self._kv_transfer_config):
            # A reuse that cannot be served is an optimization lost, never a failed request.
            log.info("kmesh: kv_load_failure_policy set to 'recompute' (failed reuse recomputes)")
        model_config = vllm_config.model_config
        self.scheduler: SchedulerSide | None = None
        self.kv_manager: KVCacheManager | None = None
        self.block_bytes = block_bytes(kv_cache_config)
        self.worker: WorkerSide | None = None
        # requests asked about this step and not (yet) admitted → tokens they still need
        self._asked: dict[str, int] = {}
        self._block_size = vllm_config.cache_config.block_size
        self._budget = vllm_config.scheduler_config.max_num_batched_tokens
        if role == KVConnectorRole.SCHEDULER:
            self.scheduler = SchedulerSide(
                self.config,
                engine_namespace(vllm_config),
                model_config.max_model_len,
                contains=shared_store_lookup(self.config, vllm_config),
                privatizer=prefix_privatizer(vllm_config, kv_cache_config),
                engine=str(self._kv_transfer_config.engine_id),
                release=self._release if self.config.share_kv_memory else None,
            )
        else:
            self.worker = WorkerSide(
                self.config,
                loaded_model(vllm_config),
                model_config.hf_config,
                cast(torch.dtype, model_config.dtype),  # resolved by vLLM's config
                vllm_config.cache_config.block_size,
                attention_layers(vllm_config),
                tp_shard(vllm_config),
                batch_order(vllm_config),
                skip_tail_forward=vllm_config.speculative_config is None,
            )
        log.info("kmesh: %s side ready (%s)", role.name.lower(), self.config)
        if self.config.cascade_decode and self.config.drift_correction == "auto":
            log.info("kmesh: drift correction is off with cascade decode (which reads stale rows "
                     "from the master as stored); a request may still ask for it")  # fmt: skip
        if self.scheduler is not None:
            log_report()  # a worker in this process has logged it after its KV caches

    # --- scheduler side -------------------------------------------------------------------------

    def get_num_new_matched_tokens(
        self, request: Request, num_computed_tokens: int
    ) -> tuple[int, bool]:
        assert self.scheduler is not None
        if self.config.cascade_decode:  # not admitted by the meta: it waits (the speed guard)
            self._asked[request.request_id] = request.num_tokens - num_computed_tokens
        return self.scheduler.num_matched(request, num_computed_tokens), False

    def update_state_after_alloc(self, request: Request, blocks: KVCacheBlocks,
                                 num_external_tokens: int) -> None:  # fmt: skip
        assert self.scheduler is not None
        self._asked.pop(request.request_id, None)
        self.scheduler.after_alloc(request.request_id, num_external_tokens)

    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> KVConnectorMetadata:
        assert self.scheduler is not None
        meta = self.scheduler.build_meta(step_requests(scheduler_output))
        meta.scheduled_tokens = scheduler_output.total_num_scheduled_tokens
        if self._asked and self.kv_manager is not None:  # (admitted ones left at their alloc)
            free = free_blocks(self.kv_manager)
            needs = list(self._asked.values())
            meta.memory_short = waits_for_blocks(needs, self._block_size, self._budget, free)
        self._asked.clear()
        return meta

    def update_connector_output(self, connector_output: KVConnectorOutput) -> None:
        assert self.scheduler is not None
        self.scheduler.on_worker_output(connector_output.kv_connector_worker_meta)

    def request_finished(self, request: Request,
                         block_ids: list[int]) -> tuple[bool, dict | None]:  # fmt: skip
        assert self.scheduler is not None
        held = None
        if self.config.share_kv_memory and self.kv_manager is not None:
            held = held_blocks(self.kv_manager, block_ids) * self.block_bytes
        return False, self.scheduler.finished(request.request_id, held)

    def bind_kv_cache_manager(self, kv_cache_manager: KVCacheManager) -> None:
        super().bind_kv_cache_manager(kv_cache_manager)
        self.kv_manager = kv_cache_manager  # where released readers' blocks go back

    def _release(self, request: Request, blocks: list[tuple[int, int]]) -> int:
        manager = self.kv_manager  # bound by vLLM's scheduler before its first step
        return 0 if manager is None else release_blocks(manager, request, blocks)

    # --- worker side ----------------------------------------------------------------------------

    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        assert self.worker is not None
        self.worker.register_kv_caches(kv_caches)
        log_report()  # what the seam found and changed, cascade decode's routing included

    def start_load_kv(self, forward_context: ForwardContext, **kwargs: object) -> None:
        meta = self._get_connector_metadata()
        if self.worker is None or not isinstance(meta, KMeshMetadata):
            return
        if self.worker.cascade is not None:
            self.worker.cascade.note_memory(meta.memory_short, meta.scheduled_tokens)
        if meta.loads or meta.rounds or meta.closes:
            self.worker.load(meta)

    def wait_for_layer_load(self, layer_name: str) -> None:
        return  # loads are complete when start_load_kv returns

    def save_kv_layer(self, layer_name: str, kv_layer: torch.Tensor,
                      attn_metadata: AttentionMetadata, **kwargs: object) -> None:  # fmt: skip
        return  # masters are read from the paged cache in wait_for_save

    def wait_for_save(self) -> None:
        meta = self._get_connector_metadata()
        if self.worker is not None and self.worker.cascade is not None:
            self.worker.cascade.step_done()
        if (
            self.worker is not None
            and isinstance(meta, KMeshMetadata)
            and (meta.saves or meta.loads)
        ):
            self.worker.save(meta)

    def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str] | None, set[str] | None]:
        if self.worker is not None:
            self.worker.finished(finished_req_ids)
        return None, None

    def get_block_ids_with_load_errors(self) -> set[int]:
        return self.worker.take_failed_blocks() if self.worker is not None else set()

    def build_connector_worker_meta(self) -> KVConnectorWorkerMetadata | None:
        return self.worker.take_output() if self.worker is not None else None

    # --- metrics (both sides; kmesh_blend/vllm/stats.py) ----------------------------------------

    def get_kv_connector_stats(self) -> KVConnectorStats | None:
        side = self.scheduler if self.scheduler is not None else self.worker
        data = side.take_stats() if side is not None else None
        return KMeshStats(data) if data else None

    @classmethod
    def build_kv_connector_stats(cls, data: dict[str, object] | None = None) -> KVConnectorStats:
        payload = cast(Payload, data or {})
        return KMeshStats({"counters": dict(payload.get("counters", {})),
                           "gauges": dict(payload.get("gauges", {})),
                           "info": dict(payload.get("info", {}))})  # fmt: skip

    @classmethod
    def build_prom_metrics(cls, vllm_config: VllmConfig, metric_types: dict[type, type],
                           labelnames: list[str], per_engine_labelvalues: dict[int, list[object]]
                           ) -> KMeshPromMetrics:  # fmt: skip
        return KMeshPromMetrics(vllm_config, metric_types, labelnames, per_engine_labelvalues)

    def shutdown(self) -> None:
        if self.worker is not None:
            self.worker.close()
