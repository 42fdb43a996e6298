"""CPU kernels in C++ (AVX-512), compiled on first use; public API: `cascade_decode_op`,
`verify_rows_op` (arming a cascade reader: its rows against a master, `verify_rows.cpp`),
`fill_own_op` (a reader's own rows from the paged cache into the kernel's tiles, `fill_own.cpp`),
`reposition_op` (stored keys moved to new positions in one pass, `reposition.cpp`),
`shift_rows_op` / `drift_means_op` (drift correction's shift of stale rows in place, and its
estimate; the same file).

A family's decode attention on this CPU is bound by arithmetic (vLLM's fused CPU kernel reaches
≈ 31 GFLOP/s on it), and cascade does the same arithmetic as per-request attention; what it
changes is the shape: one master's K/V against all readers' queries at once. `cascade_decode.cpp`
does that pass per layer in one call (append, rotate, score, softmax, weight, merge), with bf16
dot-product instructions on K/V read in their stored dtype, which plain torch ops cannot do
without a kernel launch per product and a copy per dtype conversion (docs/cascade.md).

Triton has no compiled CPU backend here (only its interpreter), hence C++. The source is compiled
with torch's extension builder into torch's extension cache (``TORCH_EXTENSIONS_DIR``) the first
time a process asks for it (≈ 20 s on two cores; later processes load the cached library);
``make install`` warms the cache. Missing AVX-512, a missing compiler or a failed build leaves
`cascade_decode_op` returning None with the reason, and callers keep the plain-torch path.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

__all__ = [
    "cascade_decode_op", "cpu_flags", "cpu_kernel_expected", "drift_means_op", "fill_own_op",
    "loaded_op", "reposition_op", "shift_rows_op", "verify_rows_op",
]  # fmt: skip

log = logging.getLogger("kmesh_blend.cpu")

_SOURCES = [
    Path(__file__).with_name(name)
    for name in ("cascade_decode.cpp", "verify_rows.cpp", "fill_own.cpp", "reposition.cpp")
]
_NEEDED = ("avx512f", "avx512bw", "avx512vl", "avx512_bf16")
# -ffp-contract=off: products and sums rounded one by one, as torch's ops round them
_FLAGS = ["-O3", "-ffp-contract=off", "-mavx512f", "-mavx512bw", "-mavx512vl", "-mavx512bf16",
          "-mfma", "-fopenmp"]  # fmt: skip
_NAME = "kmesh_cpu_cascade"
_STALE_LOCK_S = 600  # a build takes ≈ 20 s; an older lock is a killed build's
_loaded: tuple[Callable[..., Any] | None, str | None] | None = None


def cpu_flags() -> set[str]:
    """This machine's CPU feature flags (Linux ``/proc/cpuinfo``; empty elsewhere)."""
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return set()
    for line in text.splitlines():
        if line.startswith("flags"):
            return set(line.split(":", 1)[1].split())
    return set()


def cpu_kernel_expected() -> bool:
    """Whether this machine should build the kernel: the CPU has the instructions, a C++
    compiler is on PATH, and ``KMESH_CPU_KERNELS`` does not turn it off. (Tests use it to insist
    on the kernel where it must work.)"""
    import shutil

    return (
        os.environ.get("KMESH_CPU_KERNELS", "1") != "0"
        and all(flag in cpu_flags() for flag in _NEEDED)
        and shutil.which(os.environ.get("CXX", "c++")) is not None
    )


def cascade_decode_op() -> tuple[Callable[..., Any] | None, str | None]:
    """(``torch.ops.kmesh_cpu.cascade_decode``, None) once built and loaded, else (None, why).

    Built at most once per process; set ``KMESH_CPU_KERNELS=0`` to keep it off.
    """
    global _loaded
    if _loaded is None:
        _loaded = _load()
        if _loaded[1] is not None:
            log.warning("kmesh: the CPU cascade kernel is unavailable: %s", _loaded[1])
    return _loaded


def loaded_op(name: str) -> Callable[..., Any] | None:
    """``torch.ops.kmesh_cpu.<name>`` once this process loaded the kernels, else None (callers
    keep their torch ops). Never builds: arming and blending must not wait on a compiler; the
    kernels are built at install and loaded by `cascade_decode_op` at an engine's start."""
    import torch

    return getattr(torch.ops.kmesh_cpu, name) if _loaded is not None and _loaded[0] else None


def verify_rows_op() -> Callable[..., Any] | None:
    """`verify_rows.cpp`: a reader's paged rows against a master in one pass (`loaded_op`)."""
    return loaded_op("verify_rows")


def fill_own_op() -> Callable[..., Any] | None:
    """`fill_own.cpp`: a reader's rows from the paged cache into its slot of own rows, every
    layer in one call (`loaded_op`)."""
    return loaded_op("fill_own")


def reposition_op() -> Callable[..., Any] | None:
    """`reposition.cpp`: keys moved by position shifts, the torch reference's bits."""
    return loaded_op("reposition")


def shift_rows_op() -> Callable[..., Any] | None:
    """`reposition.cpp`: drift correction's shift of stale rows in one pass,
    `shift_rows_reference`'s bits."""
    return loaded_op("shift_rows")


def drift_means_op() -> Callable[..., Any] | None:
    """`reposition.cpp`: drift correction's estimate in one pass, within 1e-6 of
    `drift_means_reference`."""
    return loaded_op("drift_means")


def _load() -> tuple[Callable[..., Any] | None, str | None]:
    if os.environ.get("KMESH_CPU_KERNELS", "1") == "0":
        return None, "KMESH_CPU_KERNELS=0"
    missing = [flag for flag in _NEEDED if flag not in cpu_flags()]
    if missing:
        return None, f"this CPU lacks {', '.join(missing)}"
    try:
        import torch
        from torch.utils.cpp_extension import _get_build_directory, load

        _drop_stale_lock(Path(_get_build_directory(_NAME, verbose=False)) / "lock")
        load(
            name=_NAME,
            sources=[str(source) for source in _SOURCES],
            extra_cflags=_FLAGS,
            extra_ldflags=["-fopenmp"],
            is_python_module=False,
            verbose=False,
        )
        return torch.ops.kmesh_cpu.cascade_decode, None
    except Exception as exc:  # no compiler, headers, or a build error: keep the torch path
        text = str(exc) + str(getattr(exc.__cause__, "output", "") or "")
        errors = [line.strip() for line in text.splitlines() if "error" in line.lower()]
        return None, f"build failed: {type(exc).__name__}: {(errors or [''])[0][:300]}"


def _drop_stale_lock(lock: Path) -> None:
    """torch's builder waits forever on a lock a killed build left behind: remove an old one."""
    import time

    try:
        if time.time() - lock.stat().st_mtime > _STALE_LOCK_S:
            lock.unlink()
            log.warning("kmesh: removed a stale build lock %s (a build was killed)", lock)
    except OSError:  # no lock (the usual case), or another process just took it
        pass
