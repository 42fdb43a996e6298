"""Workarounds for third-party interactions, each with the reason it exists.

`guard_llvmlite`: LMCache imports numba, which loads llvmlite. llvmlite's ``ffi.lib`` wrapper
answers *any* attribute, ``__dict__`` included, with a wrapped C function. vLLM 0.32's CPU
platform scans every module attribute's ``vars(...)`` when it registers its Triton-kernel
fallbacks at engine start, and crashes on that object
(``'_lib_fn_wrapper' object has no attribute 'get'``). So any process that imports LMCache before
starting vLLM fails to start it. Seeding the wrapper's function table with a real (empty) dict
for ``__dict__`` makes the scan see an ordinary object; nothing in llvmlite reads that entry.
"""

from __future__ import annotations

import sys

__all__ = ["guard_llvmlite"]


def guard_llvmlite() -> None:
    """Make llvmlite's ffi.lib safe for ``vars()`` scans (no-op when llvmlite is not loaded)."""
    ffi = sys.modules.get("llvmlite.binding.ffi")
    lib = getattr(ffi, "lib", None) if ffi is not None else None
    fntab = getattr(lib, "_fntab", None)
    if isinstance(fntab, dict):
        fntab.setdefault("__dict__", {})
