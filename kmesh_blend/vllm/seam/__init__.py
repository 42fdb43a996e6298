"""The seam: the one part of kmesh-blend that reaches into vLLM's internals.

Every other file of the package uses vLLM's public KV-connector API (`KVConnectorBase_V1` and
the types in its signatures) or this package; ``tests/vllm/test_seam.py`` lists the vLLM modules
and symbols each may import and fails on any other. A vLLM upgrade is checked here, and only
here. What the seam reaches, by owner file:

- `runners`: the model runners' ``load_model`` (wrapped, through a ``sys.meta_path`` finder, when
  the plugin runs) to find the loaded model, and the runner's batch order
  (``input_batch.req_ids``); a fallback that looks for a runner on the caller's stack.
- `cpu_attention`: vLLM's CPU attention backend — its impl class (a per-engine subclass routes
  ``forward`` through the cascade decode path), its metadata, the custom ops
  (``vllm._custom_ops``), private scale members (``layer._k_scale_float``), ``do_kv_cache_update``.
- `engine`: the forward context's slot mapping, a forward hook on the loaded model, tensor
  parallelism, ``kv_load_failure_policy``, the attention layers of the static forward context,
  attention ``forward`` swapped during the start-up layer check, the installed version.
- `blocks`: ``request.block_hashes`` (read and rewritten), a scratch ``KVCacheManager`` for the
  prefix-caching check, and the fields of ``SchedulerOutput`` the connector reads.

What the seam found and what it changed in this process is gathered in `REPORT`, logged once
per process (`log_report`) and exported on ``/metrics`` as ``vllm:kmesh_vllm_seam_info``.
"""

from __future__ import annotations

import logging
import threading

__all__ = ["REPORT", "SeamReport", "log_report"]

log = logging.getLogger("vllm.kmesh_blend")  # under vLLM's handlers and format


class SeamReport:
    """What the seam found in the running vLLM (``found``: item → what) and what it changed in
    vLLM's objects (``changed``: item → what), in this process. Thread-safe; items are
    overwritten, never duplicated."""

    def __init__(self) -> None:
        self.found: dict[str, str] = {}
        self.changed: dict[str, str] = {}
        self._lock = threading.Lock()
        self._logged = False

    def note_found(self, item: str, what: str) -> None:
        with self._lock:
            self.found[item] = what

    def note_changed(self, item: str, what: str) -> None:
        with self._lock:
            self.changed[item] = what

    def labels(self) -> dict[str, str]:
        """The report as the ``/metrics`` info metric's labels (sorted, ``;``-joined)."""
        with self._lock:
            found = "; ".join(f"{k}: {v}" for k, v in sorted(self.found.items()))
            changed = "; ".join(f"{k}: {v}" for k, v in sorted(self.changed.items()))
        return {"found": found, "changed": changed}

    def take_log(self) -> str | None:
        """The report as one log line the first time it is asked for in this process."""
        with self._lock:
            if self._logged:
                return None
            self._logged = True
        labels = self.labels()
        return f"vLLM seam: found [{labels['found']}]; changed [{labels['changed'] or 'nothing'}]"


REPORT = SeamReport()


def log_report() -> None:
    """Log `REPORT` once per process (the worker calls it when its connector is ready)."""
    line = REPORT.take_log()
    if line is not None:
        log.info("kmesh: %s", line)
