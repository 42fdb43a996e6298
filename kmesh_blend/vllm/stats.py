"""The connector's metrics: names and payload (plain Python; the vLLM classes are in `prom`).

They appear on vLLM's own ``/metrics`` and in its periodic stats log line.

vLLM collects a connector's `KVConnectorStats` from both sides every step (the worker's travel
with the model runner's output, the scheduler's are added to them), sends them to the process
that serves ``/metrics``, and there hands them to the `KVConnectorPromMetrics` our connector
builds. Both sides report the same shape of payload::

    {"counters": {"reused_tokens": 416, "fallbacks|load error": 1, ...},   # since last report
     "gauges": {"published_segments": 12, ...},                              # current values
     "info": {"vllm_seam": {"found": "...", "changed": "..."}}}   # once per worker process

A counter name may carry one label value after ``|``. Prometheus names: ``vllm:kmesh_<name>``
(counters get ``_total``), with vLLM's engine labels, plus ``outcome`` / ``reason`` / ``tier``
labels where the name has one. ``info`` becomes ``vllm:kmesh_<name>_info`` (value 1, the
fields as labels).
"""

from __future__ import annotations

from typing import TypedDict

__all__ = ["COUNTERS", "GAUGES", "INFOS", "Payload", "fallback_reason"]


class Payload(TypedDict, total=False):
    counters: dict[str, int]
    gauges: dict[str, int]
    info: dict[str, dict[str, str]]


# name → (help text, label name or None)
COUNTERS: dict[str, tuple[str, str | None]] = {
    "requests": ("Annotated requests, by outcome (reused, fallback, no_reuse)", "outcome"),
    "reused_tokens": ("Prompt tokens whose KV came from stored segments", None),
    "recomputed_tokens": ("Reused tokens recomputed by selective recomputation", None),
    "drift_shifted_rows": ("Stale reused rows shifted by drift correction (last layer)", None),
    "storage_reads": ("Reads from the store's backing tier, per request report", None),
    "prefix_cached_tokens": ("Leading tokens of annotated requests from vLLM's prefix cache", None),
    "released_blocks": ("KV blocks readers gave back to vLLM's pool (kmesh.share_kv_memory)", None),
    "cascade_steps": ("Readers' decode steps run in cascade (kmesh.cascade_decode)", None),
    "preemptions": ("Times annotated requests were preempted and prefilled again", None),
    "fallbacks": ("Annotated requests run without reuse, by reason", "reason"),
    "store_reads": ("Reads from the backing tier, by store kind", "tier"),
    "retention_hits": ("Master fetches served from host-RAM retention", None),
    "singleflight_joins": ("Master fetches that waited for another request's read", None),
    "store_misses": ("Master fetches the store could not serve", None),
    "store_outages": ("Times the store was marked down (failed or missed a deadline)", None),
}
GAUGES: dict[str, str] = {
    "published_segments": "Segments the scheduler believes are stored",
    "turn_records": "Kept turns of continuing siblings the scheduler knows",
    "pending_keeps": "Turns waiting to be stored",
    "plans": "Requests the scheduler holds a reuse plan for",
    "retained_bytes": "Bytes of masters retained in host RAM",
    "indexed_segments": "Segments in the worker's round-aware index",
    "store_up": "1 while the worker's store answers, 0 while it is marked down",
    "shared_master_bytes": "Bytes of masters cascade decode holds for its readers, next to "
    "vLLM's KV budget (host RAM)",
    "mirror_bytes": "Bytes of released readers' own rows (mirrors) held beside the masters",
    "released_blocks_live": "KV blocks live readers have given back to vLLM's pool",
    "cascade_guard_admits": "1 while new readers decode in cascade, 0 where the speed guard "
    "found the cascade path slower than vLLM's kernel (kmesh.speed_guard)",
    "cascade_guard_family_permille": "Start-up timing of a family of readers, cascade path / "
    "vLLM's kernel, x1000 (0: not timed)",
    "cascade_guard_alone_permille": "Start-up timing of one reader alone, cascade path / vLLM's "
    "kernel, x1000 (0: not timed)",
    "cascade_guard_load_permille": "Cascade steps under the current load, their cost / what "
    "vLLM's kernel would cost for the same requests, x1000 (0: not weighed yet)",
    "cascade_guard_memory_short": "1 while requests recently waited for KV blocks (sharing then "
    "stays while the blocks it gave back outweigh what cascade adds to a step)",
    "cascade_guard_freed_permille": "KV blocks the readers in cascade give back (or would), a "
    "share of vLLM's pool, x1000",
    "cascade_guard_bought_permille": "What those blocks buy at most, a share of throughput: the "
    "freed share times the share of a step's time not growing with its tokens, x1000",
    "cascade_guard_added_permille": "Share of the weighed steps' wall time the cascade path added "
    "over vLLM's kernel, arming included, x1000 (0: not weighed yet)",
    "cascade_guard_break_even_steps": "Start-up timing: decode steps in which a family's reader "
    "repays its arming (-1: never; 0: not timed); readers with fewer left stay on vLLM's kernel",
    "cascade_guard_retries": "Times the speed guard weighed the cascade path again after it was "
    "switched off under load (each try that loses doubles the wait before the next)",
}

# name → (help text, label names)
INFOS: dict[str, tuple[str, tuple[str, ...]]] = {
    "vllm_seam": (
        "What kmesh-blend found in vLLM's internals and changed there (value 1)",
        ("found", "changed"),
    ),
}


def fallback_reason(fallback: str) -> str:
    """The reason's kind, for a label: the text before its first colon (`docs/contract.md`),
    or ``store unavailable`` for a store that was down (its reason names an address)."""
    if fallback.startswith("kmesh.store ") and " unavailable: " in fallback:
        return "store unavailable"
    return fallback.split(":", 1)[0].strip()[:40] or "unknown"
