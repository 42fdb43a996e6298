"""Worker side of the connector: blend the step's reusing requests, write their KV into vLLM's
paged cache before the forward, and store new masters after it.

The blend runs on the model vLLM loaded (`VllmModel`: vLLM's own modules and weights, reached
through our plugin), after a start-up check that our layer steps give the same bits as the
model's own forward; a model that fails it is served on the stock path (every reuse falls back,
naming the reason). Any problem with one request — a master that cannot be read or fails its
checksum, an unknown cache layout, an exception in the blend — marks that request's blocks as
failed loads, so vLLM recomputes it from scratch; its siblings are unaffected.
"""

from __future__ import annotations

import dataclasses
import logging
import re
import time
import traceback
from collections.abc import Callable
from typing import Any, NamedTuple

import torch

from kmesh_blend.blend import (
    BlendOptions,
    BlendRequest,
    BlendResult,
    MasterSource,
    SegmentUse,
    blend_group,
)
from kmesh_blend.config import KMeshConfig
from kmesh_blend.mirror.lifecycle import MirrorStore
from kmesh_blend.segments.cache import SegmentCache
from kmesh_blend.segments.identity import SegmentId
from kmesh_blend.segments.index import SegmentIndex
from kmesh_blend.segments.master import MasterLayout
from kmesh_blend.segments.store import open_store
from kmesh_blend.vllm.cascade_decode import CascadeDecode, Heads, MasterUse
from kmesh_blend.vllm.cascade_install import install as install_cascade
from kmesh_blend.vllm.meta import VLLM_TAIL, KMeshMetadata, KMeshWorkerMetadata, LoadRequest
from kmesh_blend.vllm.model import VllmModel, check_decomposition
from kmesh_blend.vllm.paged import PagedLayout, slot_mapping
from kmesh_blend.vllm.paged_attention import PagedAttention
from kmesh_blend.vllm.registry import LruDict
from kmesh_blend.vllm.tails import Tails
from kmesh_blend.vllm.turns import restore_turn, save_turn

__all__ = ["WorkerSide", "set_fault_injector"]

log = logging.getLogger("vllm.kmesh_blend")  # under vLLM's handlers and format

# Test hook: called with each LoadRequest; a non-None string fails that load with this reason.
_fault_injector: Callable[[LoadRequest], str | None] | None = None


def set_fault_injector(fn: Callable[[LoadRequest], str | None] | None) -> None:
    """Install (or clear) a load-fault injector. For failure tests only."""
    global _fault_injector
    _fault_injector = fn


# Test hook (tests/bitexact): called after the forward of a step with (request id, prompt KV read
# back from the paged cache: [L, 2, T, Hkv, D]) for every request this step blended (not failed).
_kv_capture: Callable[[str, torch.Tensor], None] | None = None


def set_kv_capture(fn: Callable[[str, torch.Tensor], None] | None) -> None:
    """Install (or clear) a KV capture callback. For the bit-exactness suite only."""
    global _kv_capture
    _kv_capture = fn


class WorkerSide:
    """``model``: the ``nn.Module`` vLLM loaded (None when it could not be reached);
    ``hf_config``: its Hugging Face config; ``shard``: (tensor-parallel rank, size)."""

    def __init__(self, config: KMeshConfig, model: Any, hf_config: Any, dtype: torch.dtype,
                 block_size: int, static_forward_context: dict[str, Any],
                 shard: tuple[int, int] = (0, 1),
                 batch_ids: Callable[[int], list[str] | None] | None = None) -> None:  # fmt: skip
        self.config, self.block_size = config, block_size
        self.batch_ids = batch_ids  # ids of the step's requests in batch order (cascade decode)
        self.cascade: CascadeDecode | None = None
        self.cascade_off: str | None = "the paged KV layout is unknown"  # reported when it is on
        self.model, self.unsupported = _adapt(model, hf_config, dtype)
        config.validate_for_model(self.model.shape.num_layers)
        shape = self.model.shape
        dtype_name = str(dtype).removeprefix("torch.")
        rank, world = shard  # under tensor parallelism each rank stores masters of its own heads
        self.layout = MasterLayout(
            shape.num_layers, shape.num_kv_heads, shape.head_dim, dtype_name, rank, world
        )
        self.store = open_store(
            config.store_spec, self.layout, cpu_bytes=config.store_cpu_bytes,
            timeout_s=config.store_timeout_s,
        )  # fmt: skip
        self.cache = SegmentCache(
            self.store,
            index=SegmentIndex(keep_rounds=config.round_lifetime),
            retention_bytes=config.retention_bytes,
            timeout_s=config.singleflight_timeout_s,
        )
        self._retired: LruDict[str, int | None] = LruDict(1 << 16)  # id → round, for reasons
        self._closed_upto = 0  # the highest family-close number applied (meta.py)
        self.mirrors = MirrorStore(self.cache, compress=config.compress_mirrors)
        self.options = BlendOptions.from_config(config)
        self.attn_layers = static_forward_context
        self.kv_caches: list[torch.Tensor] = []
        self.paged: PagedLayout | None = None
        self.kernel: PagedAttention | None = None  # vLLM's attention kernel for blends, if checked
        self.failed_blocks: set[int] = set()
        self.out = KMeshWorkerMetadata()
        # The blend's results for the tokens vLLM computes itself (kmesh_blend/vllm/tails.py).
        self.tails = Tails(model if self.unsupported is None else None, self._failed)
        self._stats_seen: dict[str, Any] = {}  # segment metrics at the last `take_stats`
        self._gauges: dict[str, int] = {}

    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        if self.unsupported is not None:
            return
        names = sorted(kv_caches, key=_layer_index)
        if len(names) != self.model.shape.num_layers:
            log.warning("kmesh: %d KV cache layers for a %d-layer model; reuse disabled",
                        len(names), self.model.shape.num_layers)  # fmt: skip
            return
        self.kv_caches = [kv_caches[n] for n in names]
        shape = self.model.shape
        self.paged = PagedLayout.discover(
            self.attn_layers.get(names[0]), self.kv_caches[0], shape.num_kv_heads, shape.head_dim,
            self.block_size,
        )  # fmt: skip
        if self.paged is not None:
            self.kernel = PagedAttention.create(
                [self.attn_layers[n] for n in names], self.kv_caches, self.paged,
                shape.num_heads, shape.num_kv_heads, shape.head_dim, self.model.attend,
            )  # fmt: skip
        if self.paged is not None and self.config.cascade_decode:
            if self.batch_ids is None:
                self.cascade_off = "the model runner's batch order is not reachable"
            else:
                self.cascade, self.cascade_off = install_cascade(
                    [self.attn_layers[n] for n in names], self.kv_caches, self.paged,
                    self.model.rope, Heads(shape.num_heads, shape.num_kv_heads, shape.head_dim),
                    self.batch_ids,
                )  # fmt: skip

    @torch.no_grad()
    def load(self, meta: KMeshMetadata) -> None:
        """Blend and write every load request of this step (before the forward)."""
        self._lifetimes(meta)
        ready: list[tuple[LoadRequest, BlendRequest]] = []
        masters: dict[str, Any] = {}
        blends = []
        for load in meta.loads:
            if load.turn is not None:  # a continuing request: its earlier prompt, restored
                self._restore_turn(load)
                continue
            blends.append((load, self._prepare(load, masters)))
        for load, reason in self._agree(blends):
            if reason is None:
                ready.append((load, self._blend_request(load, masters)))
            else:
                self._fail(load, reason)
        if not ready:
            return
        # With vLLM's kernel, each layer's KV goes into the paged cache as the blend runs.
        hooks = [
            self.kernel.hook(load.block_ids, len(load.token_ids), first=load.first)
            if self.kernel is not None
            else None
            for load, _ in ready
        ]
        try:
            results = self._blend(ready, MasterSource(masters), hooks)
            for (load, _), result, hook in zip(ready, results, hooks, strict=True):
                if hook is None:
                    self._write(load, result.keys, result.values)
                n = len(load.token_ids)
                final = self.model.final_norm(result.last_state)[0]
                self.tails.keep(load.req_id, load.block_ids, self.block_size, n, n - VLLM_TAIL,
                                result.keys, result.values, final)  # fmt: skip
                report = self.out.reports.setdefault(load.req_id, {})
                report["reused_tokens"] = int(result.num_reused)
                report["recomputed_tokens"] = int(result.num_recomputed)
                self._decode_plan(load, masters, report)
        except Exception as exc:  # never serve doubtful KV: the whole group recomputes
            # The traceback as text: a record holding the exception would keep the engine's
            # frames (and the engine) alive for as long as a log handler keeps the record.
            log.warning("kmesh: blend failed; %d requests recompute\n%s", len(ready),
                        traceback.format_exc())  # fmt: skip
            for load, _ in ready:
                self._fail(load, f"blend error: {type(exc).__name__}: {exc}")

    @torch.no_grad()
    def save(self, meta: KMeshMetadata) -> None:
        """Store the KV of new segments, read back from the paged cache (after the forward)."""
        if self.paged is None:
            return
        self.tails.write_back(self.paged, self.kv_caches)
        if _kv_capture is not None:
            self._capture(meta)
        for load in meta.loads:
            if load.keep is not None and not self._failed(load.req_id):
                self._keep_turn(load)
        for save in meta.saves:
            if self._failed(save.req_id):  # its blocks hold no valid KV until vLLM recomputes
                self.out.unpublished.extend(ref.segment_id for ref in save.segments)
                continue
            for ref in save.segments:
                slots = slot_mapping(save.block_ids, self.block_size, ref.start, ref.end)
                rows = [self.paged.read(cache, slots) for cache in self.kv_caches]
                kv = torch.stack([torch.stack(kv_pair) for kv_pair in rows])  # [L, 2, S, Hkv, D]
                positions = torch.arange(ref.start, ref.end, dtype=torch.int64)
                if self.cache.publish(ref.segment_id, kv.cpu(), positions, round=save.round,
                                      family=save.family, scope=save.scope):  # fmt: skip
                    self.out.published.append(ref.segment_id)
                    self._retired.pop(ref.segment_id)
                    if save.family is not None:
                        self.cache.hold(ref.segment_id, save.family)
                else:
                    log.warning("kmesh: could not store segment %s", ref.segment_id[:16])
                    self.out.unpublished.append(ref.segment_id)
                    why = getattr(self.store, "last_error", "") or "the store refused it"
                    self.out.store_errors[ref.segment_id] = f"{self.store.tier} store: {why}"
        if any(save.round is not None for save in meta.saves):
            # A round announced late may be one its tenant has outlived: its segments go now
            # (the tenant's clock as the scheduler knows it, should the index have forgotten it).
            known = {s.scope: s.scope_round for s in meta.saves if s.scope_round is not None}
            self._report_retired(self._advance(known) + self.cache.retire_expired())

    def _blend(
        self, ready: list[tuple[LoadRequest, BlendRequest]], source: MasterSource, hooks: list[Any]
    ) -> list[BlendResult]:
        """One group blend per distinct setting (requests may carry their own ratio and sink
        tokens); results in ``ready``'s order."""
        groups: dict[BlendOptions, list[int]] = {}
        for i, (load, _) in enumerate(ready):
            options = self.options
            if load.recompute_ratio is not None:
                options = dataclasses.replace(options, recompute_ratio=load.recompute_ratio)
            if load.sink_tokens is not None:
                options = dataclasses.replace(options, sink_tokens=load.sink_tokens)
            groups.setdefault(options, []).append(i)
        results: list[BlendResult | None] = [None] * len(ready)
        for options, members in groups.items():
            outs = blend_group(self.model, [ready[i][1] for i in members], source, options,
                               [hooks[i] for i in members])  # fmt: skip
            for i, out in zip(members, outs, strict=True):
                results[i] = out
        assert all(r is not None for r in results)
        return [r for r in results if r is not None]

    def _lifetimes(self, meta: KMeshMetadata) -> None:
        """Move the round-aware index to the announced round and close finished families; what
        that retires is deleted from the store and reported (the scheduler forgets it)."""
        retired = self._advance(meta.rounds)
        self.out.rounds.update({scope: self.cache.index.round_of(scope) for scope in meta.rounds})
        for number, family in meta.closes:
            if number > self._closed_upto:
                retired += self.cache.close_family(family)
                self._closed_upto = self.out.closed_upto = number
        self._report_retired(retired)

    def _advance(self, rounds: dict[str, int]) -> list[Any]:
        """Move each scope's clock forward to ``rounds[scope]``; what that retires."""
        retired = []
        for scope, round_ in rounds.items():
            if round_ > self.cache.index.round_of(scope):
                retired += self.cache.advance_round(round_, scope)
        return retired

    def _report_retired(self, retired: list[Any]) -> None:
        """Segments the index retired (their masters are deleted): remembered for the reason
        their next readers get, and told to the scheduler."""
        for info in retired:
            self._retired[info.segment_id] = info.round
            self.out.retired[info.segment_id] = -1 if info.round is None else info.round
        if retired:
            log.info("kmesh: %d segments retired by their rounds or families", len(retired))

    def _decode_plan(self, load: LoadRequest, masters: dict[str, Any], report: Any) -> None:
        """Hand a blended request to the cascade decode path (armed at its first decode step)."""
        if self.cascade is None:
            if self.config.cascade_decode:
                report["cascade_off"] = self.cascade_off
            return
        uses = [MasterUse(r.segment_id, r.start, r.end, masters[r.segment_id])
                for r in load.segments if r.segment_id in masters]  # fmt: skip
        self.cascade.add(load.req_id, load.block_ids, len(load.token_ids), uses)

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
        out.disabled = self.unsupported
        if self.cascade is not None:
            for req_id, fields in self.cascade.take_reports().items():
                out.reports.setdefault(req_id, {}).update(fields)  # type: ignore[typeddict-item]
        return out if (out.reports or out.published or out.disabled or out.lost
                       or out.unpublished or out.retired or out.closed_upto
                       or out.rounds) else None  # fmt: skip

    def take_stats(self) -> dict[str, Any] | None:
        """Metrics payload (`kmesh_blend.vllm.stats`): segment-layer counters since the last
        call and the host-RAM gauges; None when nothing changed."""
        now = self.cache.metrics.as_dict()
        seen, self._stats_seen = self._stats_seen, now
        pairs = [(f"store_reads|{tier}", now["reads"][tier], seen.get("reads", {}).get(tier, 0))
                 for tier in now["reads"]]  # fmt: skip
        for ours, theirs in [("retention_hits", "hits"), ("store_misses", "misses"),
                             ("singleflight_joins", "singleflight_joins")]:  # fmt: skip
            pairs.append((ours, now[theirs], seen.get(theirs, 0)))
        health = self.store.health
        pairs.append(("store_outages", health.num_down, seen.get("store_outages", 0)))
        now["store_outages"] = health.num_down
        counters = {name: n - before for name, n, before in pairs if n != before}
        gauges = {
            "retained_bytes": int(now["retained_bytes"]),
            "indexed_segments": len(self.cache.index),
            "store_up": int(health.up),
        }
        if not counters and gauges == self._gauges:
            return None
        self._gauges = gauges
        return {"counters": counters, "gauges": gauges}

    def close(self) -> None:
        self.tails.close()
        self.store.close()

    # --- helpers --------------------------------------------------------------------------------

    def _prepare(self, load: LoadRequest, masters: dict[str, Any]) -> str | None:
        """Fetch the masters of ``load`` into ``masters``; the failure reason, or None."""
        if self.unsupported is not None:
            return self.unsupported
        if self.paged is None:
            return "paged KV layout unknown"
        if _fault_injector is not None and (reason := _fault_injector(load)) is not None:
            return reason
        reads, waited = 0, 0.0
        for ref in load.segments:
            if ref.segment_id in masters:
                continue
            start = time.perf_counter()
            fetched = self.cache.fetch(ref.segment_id, family=load.family)
            waited += time.perf_counter() - start
            reads += fetched.reads
            if fetched.master is None:
                return self._missing(ref.segment_id, fetched.source, fetched.reason)
            if load.family is not None:
                self.cache.hold(ref.segment_id, load.family)
            if fetched.master.num_tokens != ref.end - ref.start:
                self.out.lost.append(ref.segment_id)
                return f"segment {ref.segment_id[:16]} has {fetched.master.num_tokens} tokens"
            masters[ref.segment_id] = fetched.master
        report = self.out.reports.setdefault(load.req_id, {})
        report["storage_reads"], report["load_ms"] = reads, round(waited * 1e3, 3)
        return None

    def _missing(self, segment_id: SegmentId, source: str, reason: str) -> str:
        """Why a master could not be had, in words; one the store no longer holds is reported
        lost (the scheduler forgets it and the recomputed request stores it again)."""
        if reason:  # the store failed: the master is not lost
            return reason
        rejected = self.store.rejected(segment_id)
        if rejected is not None:  # deleted by the store
            self.out.lost.append(segment_id)
            return f"segment {segment_id[:16]} failed its integrity check: {rejected}"
        if segment_id in self._retired:
            round_ = self._retired.get(segment_id)
            return f"master retired: segment {segment_id[:16]} published in round {round_}"
        self.out.lost.append(segment_id)
        return f"segment {segment_id[:16]} {source}"

    def _blend_request(self, load: LoadRequest, masters: dict[str, Any]) -> BlendRequest:
        """What the blend computes for ``load``. Tokens before ``load.first`` came from vLLM's
        prefix cache: their exact KV is read back as a pseudo-segment the blend never recomputes,
        and a segment reaching into them is cut to its part after them."""
        first, uses = load.first, []
        if first > 0:
            prefix_id = f"prefix:{load.req_id}"
            masters[prefix_id] = _Rows(self._prompt_kv(load, 0, first).cpu(), torch.arange(first))
            uses.append(SegmentUse(0, first, prefix_id))
        for ref in load.segments:
            if ref.end <= first:
                continue
            segment_id: str = ref.segment_id
            start = max(ref.start, first)
            if start > ref.start:  # keep the stored rows of [start, end) only
                cut, master = start - ref.start, masters[ref.segment_id]
                segment_id = f"{ref.segment_id}@{cut}"
                masters[segment_id] = _Rows(master.kv[:, :, cut:], master.positions[cut:])
            uses.append(SegmentUse(start, ref.end, segment_id))
        return BlendRequest(torch.tensor(load.token_ids), tuple(uses), exact_prefix=first)

    def _write(
        self, load: LoadRequest, keys: list[torch.Tensor], values: list[torch.Tensor]
    ) -> None:
        assert self.paged is not None
        end = len(load.token_ids) - VLLM_TAIL  # vLLM computes the last tokens itself
        slots = slot_mapping(load.block_ids, self.block_size, load.first, end)
        for cache, k, v in zip(self.kv_caches, keys, values, strict=True):
            self.paged.write(
                cache, k[load.first : end], v[load.first : end], slots.to(cache.device)
            )

    def _agree(
        self, blends: list[tuple[LoadRequest, str | None]]
    ) -> list[tuple[LoadRequest, str | None]]:
        """Under tensor parallelism every rank must blend the same requests (the blend's
        projections all-reduce across ranks): a request that failed on any rank fails on all."""
        world = getattr(self.model, "world_size", 1)
        if world == 1 or not blends:
            return blends
        from vllm.distributed import tensor_model_parallel_all_reduce

        failed = torch.tensor([float(reason is not None) for _, reason in blends])
        failed = tensor_model_parallel_all_reduce(failed)
        return [
            (load, reason or ("failed on another tensor-parallel rank" if bad > 0 else None))
            for (load, reason), bad in zip(blends, failed.tolist(), strict=True)
        ]

    def _capture(self, meta: KMeshMetadata) -> None:
        assert _kv_capture is not None
        for load in meta.loads:
            if not self._failed(load.req_id):
                _kv_capture(load.req_id, self._prompt_kv(load))

    def _prompt_kv(self, load: LoadRequest, start: int = 0, end: int | None = None) -> torch.Tensor:
        """Prompt KV of tokens [start, end) (default: all) read back from the paged cache:
        [L, 2, end − start, Hkv, D]."""
        assert self.paged is not None
        end = len(load.token_ids) if end is None else end
        slots = slot_mapping(load.block_ids, self.block_size, start, end)
        rows = [self.paged.read(cache, slots) for cache in self.kv_caches]
        return torch.stack([torch.stack(kv) for kv in rows])

    def _failed(self, req_id: str) -> bool:
        return bool(self.out.reports.get(req_id, {}).get("fallback"))

    def _restore_turn(self, load: LoadRequest) -> None:
        assert load.turn is not None
        if self.paged is None:
            self._fail(load, "paged KV layout unknown")
            return
        reason = _fault_injector(load) if _fault_injector is not None else None
        if reason is None:
            reason = restore_turn(
                self.mirrors, load.turn, load.turn_len, self.paged, self.kv_caches,
                load.block_ids, self.model.rope.inv_freq,
            )  # fmt: skip
        if reason is not None:
            self._fail(load, reason)
            return
        report = self.out.reports.setdefault(load.req_id, {})
        report["reused_tokens"], report["recomputed_tokens"] = load.turn_len, 0
        report["storage_reads"] = 0

    def _keep_turn(self, load: LoadRequest) -> None:
        assert load.keep is not None
        masters = {r.segment_id: self.cache.fetch(r.segment_id).master for r in load.segments}
        if any(m is None for m in masters.values()):
            log.warning("kmesh: turn of %s not kept: a master is gone", load.req_id)
            return
        size = save_turn(
            self.mirrors, load.keep, self._prompt_kv(load), load.segments, masters,
            self.model.rope.inv_freq,
        )  # fmt: skip
        if size:
            self.out.turns.append(load.keep)
            self.out.reports.setdefault(load.req_id, {})["kept_bytes"] = size
        else:
            log.warning("kmesh: turn of %s could not be stored", load.req_id)

    def _fail(self, load: LoadRequest, reason: str) -> None:
        log.warning("kmesh: request %s recomputes: %s", load.req_id, reason)
        if self.cascade is not None:
            self.cascade.drop(load.req_id)
        self.failed_blocks.update(load.block_ids)
        self.out.reports[load.req_id] = {
            "reused_tokens": 0,
            "recomputed_tokens": 0,
            "fallback": f"load error: {reason}",
        }


def _adapt(model: Any, hf_config: Any, dtype: torch.dtype) -> tuple[VllmModel, str | None]:
    """(adapter, None) when the blend can run on ``model``; else (adapter or a shape-only
    stand-in, the reason every reuse falls back)."""
    from kmesh_blend.vllm.version import unsupported_vllm

    outside = unsupported_vllm()
    if outside is not None:
        reason = outside
    elif model is None:
        reason = "the loaded model was not reachable (is the kmesh_blend vLLM plugin enabled?)"
    else:
        try:
            adapter = VllmModel(model, hf_config, dtype)
        except Exception as exc:
            reason = f"model not supported: {type(exc).__name__}: {exc}"
        else:
            problem = check_decomposition(adapter)
            if problem is None:
                log.info("kmesh: blend runs on vLLM's loaded model (layer check passed)")
                return adapter, None
            reason = f"model not supported: {problem}"
    log.warning("kmesh: reuse disabled, every request is served on the stock path: %s", reason)
    return _ShapeOnly(hf_config, dtype), reason  # type: ignore[return-value]


class _Rows(NamedTuple):
    """Stored rows in the master's shape: kv [L, 2, S, Hkv, D], positions [S] int64."""

    kv: torch.Tensor
    positions: torch.Tensor


class _ShapeOnly:
    """Sizes of a model the blend cannot run on: enough to open the store and report."""

    def __init__(self, hf_config: Any, dtype: torch.dtype) -> None:
        from kmesh_blend.models.layerwise import ModelShape
        from kmesh_blend.models.rope import RopeConfig, RotaryEmbedding

        heads = int(hf_config.num_attention_heads)
        head_dim = int(getattr(hf_config, "head_dim", None) or hf_config.hidden_size // heads)
        self.shape = ModelShape(
            int(hf_config.num_hidden_layers), heads,
            int(getattr(hf_config, "num_key_value_heads", None) or heads), head_dim,
            int(hf_config.hidden_size), int(hf_config.vocab_size), dtype,
        )  # fmt: skip
        self.rope = RotaryEmbedding(RopeConfig(head_dim=head_dim))


def _layer_index(name: str) -> int:
    match = re.search(r"layers\.(\d+)\.", name)
    return int(match.group(1)) if match else -1
