"""Shared helpers of the benchmark scripts: timing, the final JSON line, and the PNG plot."""

from __future__ import annotations

import ctypes.util
import json
import os
import statistics
import sys
import time
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any, TypeVar

import torch

from kmesh_blend.blend import (
    BlendRequest,
    DenseSegmentSource,
    SegmentUse,
    segment_kv_from_prefill,
)
from kmesh_blend.models import LayerwiseModel

FULL_RESULTS = Path(__file__).resolve().parent / "results"
# A --quick run writes apart (bench/results/quick/, not committed): it never replaces a full
# run's results, which the docs' tables are generated from.
RESULTS = FULL_RESULTS / "quick" if "--quick" in sys.argv else FULL_RESULTS
T = TypeVar("T")


def follow_up_family(
    model: LayerwiseModel,
    doc_len: int,
    num_requests: int,
    private_step: int = 0,
    source_cls: type[DenseSegmentSource] = DenseSegmentSource,
) -> tuple[list[BlendRequest], DenseSegmentSource]:
    """The benchmarks' shared workload: a random document of ``doc_len`` tokens stored as master
    ``"doc"`` (prefilled alone at positions 0..doc_len−1), and follow-ups = private tokens
    (64 + i·``private_step``) + the document + 32 question tokens. Seeded: same every run."""
    gen = torch.Generator().manual_seed(0)
    vocab = model.shape.vocab_size
    doc = torch.randint(3, vocab, (doc_len,), generator=gen)
    source = source_cls({"doc": segment_kv_from_prefill(model, doc)})
    requests = []
    for i in range(num_requests):
        private = torch.randint(3, vocab, (64 + private_step * i,), generator=gen)
        question = torch.randint(3, vocab, (32,), generator=gen)
        use = SegmentUse(private.numel(), private.numel() + doc_len, "doc")
        requests.append(BlendRequest(torch.cat([private, doc, question]), (use,)))
    return requests, source


def interleaved(fns: dict[str, Callable[[], Any]], repeats: int) -> dict[str, float]:
    """Median wall time (s) per label, measured round-robin.

    Every function runs once untimed first, then the timed rounds alternate between them, so a
    process that is still warming up (allocator growth, caches) does not favour whichever
    configuration happens to be measured last.
    """
    for fn in fns.values():
        fn()
    times: dict[str, list[float]] = {label: [] for label in fns}
    for _ in progress(range(repeats), "timed rounds"):
        for label, fn in fns.items():
            t0 = time.perf_counter()
            fn()
            times[label].append(time.perf_counter() - t0)
    return {label: statistics.median(ts) for label, ts in times.items()}


def progress(items: Iterable[T], label: str, total: int | None = None) -> Iterable[T]:
    """``items`` with a progress bar on stderr when it is a terminal (tqdm; silent otherwise,
    so logs and CI stay clean). ``make bench`` passes the scripts' stderr through."""
    from tqdm import tqdm

    return tqdm(items, desc=label, total=total, file=sys.stderr, leave=False, disable=None)


def plot_bars(name: str, labels: list[str], seconds: list[float], title: str) -> Path:
    """Write ``<name>.png`` into `RESULTS`: one bar per configuration (seconds)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    RESULTS.mkdir(parents=True, exist_ok=True)
    fig, ax = plt.subplots(figsize=(7, 3.5))
    bars = ax.bar(labels, seconds, color="#4878a8")
    ax.bar_label(bars, labels=[f"{s:.2f}s" for s in seconds])
    ax.set_ylabel("seconds")
    ax.set_title(title, fontsize=10)
    fig.tight_layout()
    path = RESULTS / f"{name}.png"
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path


def cpu_flags() -> dict[str, bool | str]:
    """This machine's CPU model and the instruction sets figures depend on (from
    /proc/cpuinfo): ratios move between CPUs of the same kind, so every result names them."""
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return {}
    flags = set(next((ln for ln in text.splitlines() if ln.startswith("flags")), "").split())
    name = next((ln.split(":", 1)[1].strip() for ln in text.splitlines()
                 if ln.startswith("model name")), "")  # fmt: skip
    found: dict[str, bool | str] = {"model": name, "cores": str(os.cpu_count())}
    for flag in ("avx2", "avx512f", "avx512_bf16", "amx_tile"):
        found[flag] = flag in flags
    return found


def emit(result: dict[str, Any]) -> None:
    """Print the contract's last line: one JSON object; its ``config.cpu`` names this machine's
    CPU (`cpu_flags`) unless the script set it."""
    if isinstance(result.get("config"), dict):
        result["config"].setdefault("cpu", cpu_flags())
    print(json.dumps(result), flush=True)


def use_allocator(name: str) -> str:
    """Run this script under the memory allocator ``name``; returns the one in effect.

    ``"tcmalloc"`` is what vLLM's CPU installation guide asks for (its CPU worker warns at start-up
    when libtcmalloc is not in LD_PRELOAD): glibc's malloc maps and unmaps every large buffer, and
    the page faults cost more than many of the ops on a 2-core machine. Both engines of a
    benchmark run in the same process, so they get the same allocator. The script re-executes
    itself once with LD_PRELOAD set; without the library (``scripts/services.sh`` installs it)
    it says so and stays on ``"system"``.
    """
    if name == "system":
        return "system"
    if "tcmalloc" in os.environ.get("LD_PRELOAD", ""):
        return "tcmalloc"
    lib = ctypes.util.find_library("tcmalloc_minimal") or ctypes.util.find_library("tcmalloc")
    if lib is None:
        print("allocator: libtcmalloc not found (scripts/services.sh installs it); system malloc")
        return "system"
    preload = " ".join(filter(None, [os.environ.get("LD_PRELOAD"), lib]))
    os.execve(sys.executable, [sys.executable, *sys.argv], {**os.environ, "LD_PRELOAD": preload})
    raise AssertionError("unreachable")
