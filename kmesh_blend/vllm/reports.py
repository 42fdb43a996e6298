"""Merging the worker's per-request outcomes into the scheduler side's reports; counting them.

A request's report (`kmesh_blend.vllm.meta.Report`) is owned by the scheduler side; each step
the worker sends fields for it. `merge` puts them in: reasons cut to `REASON_CHARS`, every
distinct ``cascade_off`` reason kept once, and for a request scheduled again after a preemption
(`resumed`) the counts of its earlier prefills added.
"""

from __future__ import annotations

from kmesh_blend.vllm.meta import Report
from kmesh_blend.vllm.stats import fallback_reason

__all__ = ["REASON_CHARS", "count", "merge", "resumed", "short"]

REASON_CHARS = 200  # a reason echoes at most this much of the bad input
# Fields that count work: a request preempted and prefilled again adds both prefills'.
_ADDITIVE = ("reused_tokens", "recomputed_tokens", "drift_shifted_rows", "storage_reads", "load_ms",
             "cascade_steps", "restored_tokens", "kept_bytes")  # fmt: skip


def short(reason: str) -> str:
    """``reason`` cut to `REASON_CHARS` characters (a bad field may be megabytes)."""
    if len(reason) <= REASON_CHARS:
        return reason
    suffix = f"… ({len(reason)} chars)"
    return reason[: REASON_CHARS - len(suffix)] + suffix


def resumed(before: Report) -> Report:
    """The report a request starts with when it is scheduled again after a preemption: what it
    reused before, one more preemption, no fallback yet."""
    out: Report = {**before, "fallback": None}
    out["preemptions"] = before.get("preemptions", 0) + 1
    return out


def merge(target: Report, fields: Report, before: Report | None) -> Report:
    """Put the worker's ``fields`` into ``target``; ``before``: the request's report when it
    was preempted (its counts are added), or None. Returns the fields as merged."""
    out = dict(fields)
    reason = fields.get("fallback")
    if reason:
        out["fallback"] = short(reason)
    if before is not None:
        for key in _ADDITIVE:
            if key in fields:
                total = before.get(key, 0) + fields[key]  # type: ignore[literal-required]
                out[key] = round(total, 3) if isinstance(total, float) else total
    off, seen = out.get("cascade_off"), target.get("cascade_off")
    if off and seen:  # every reason, once
        out["cascade_off"] = seen if off in seen.split("; ") else short(f"{seen}; {off}")
    target.update(out)  # type: ignore[typeddict-item]
    return out  # type: ignore[return-value]


def count(reports: list[Report]) -> dict[str, int]:
    """The metrics counters (`kmesh_blend.vllm.stats`) of finished requests' final reports."""
    counters: dict[str, int] = {}

    def add(name: str, n: int | float | None) -> None:
        if n:
            counters[name] = counters.get(name, 0) + int(n)

    for report in reports:
        add("reused_tokens", report.get("reused_tokens"))
        add("recomputed_tokens", report.get("recomputed_tokens"))
        add("drift_shifted_rows", report.get("drift_shifted_rows"))
        add("storage_reads", report.get("storage_reads"))
        add("prefix_cached_tokens", report.get("prefix_cached_tokens"))
        add("released_blocks", report.get("released_blocks"))
        add("cascade_steps", report.get("cascade_steps"))
        add("preemptions", report.get("preemptions"))
        why = report.get("fallback")
        if why:
            add("requests|fallback", 1)
            add(f"fallbacks|{fallback_reason(why)}", 1)
        elif report.get("reused_tokens") or report.get("restored_tokens"):
            add("requests|reused", 1)
        else:
            add("requests|no_reuse", 1)
    return counters
