"""The model runners: the loaded model, the runner's batch order (seam; the plugin's work).

vLLM hands a KV connector no handle to the model. Every vLLM process runs the callables of the
``vllm.general_plugins`` entry-point group at start (our ``pyproject.toml`` registers `register`),
before any model is loaded. `register` wraps the model runners' ``load_model`` so that each loaded
model is recorded against the runner's ``VllmConfig``; the worker builds its connector after
``load_model``, so `loaded_model` finds it there. No vLLM file is patched, and the runner modules
are wrapped only when something imports them (an API-server process never does).

Light on purpose (no torch, no vLLM import): an API-server process runs it too. A deployment
that sets ``VLLM_PLUGINS`` must list ``kmesh_blend`` in it; without the plugin the
connector falls back to the runner found on its caller's stack, and failing that serves every
request on the stock path (one log line says why).
"""

from __future__ import annotations

import contextlib
import functools
import importlib.abc
import importlib.machinery
import inspect
import sys
import threading
import weakref
from collections.abc import Callable, Sequence
from importlib.machinery import ModuleSpec
from types import ModuleType
from typing import TYPE_CHECKING, Any

from kmesh_blend.vllm.seam import REPORT

if TYPE_CHECKING:
    import torch
    from vllm.config import VllmConfig

__all__ = ["BatchOrder", "batch_order", "loaded_model", "register"]

# Runner classes whose ``load_model`` we wrap, by module (CPU's runner does not call super()).
_RUNNERS = {
    "vllm.v1.worker.gpu_model_runner": "GPUModelRunner",
    "vllm.v1.worker.cpu_model_runner": "CPUModelRunner",
    "vllm.v1.worker.gpu.model_runner": "ModelRunner",
}
# Weak: an engine's model (and, through the cascade decode path installed on its attention
# layers, its KV cache) must go with the engine, not live as long as the process.
_models: dict[int, weakref.ref[torch.nn.Module]] = {}  # id(VllmConfig) → loaded model
_last: list[weakref.ref[torch.nn.Module]] = []  # the most recently loaded model in this process
_runners: dict[int, weakref.ref[object]] = {}  # id(VllmConfig) → the runner that loaded it
_lock = threading.Lock()
_registered = False


def register() -> None:
    """Entry point: wrap the runners' ``load_model`` (now, or when their module is imported)."""
    global _registered
    with _lock:
        if _registered:
            return
        _registered = True
    for module_name, class_name in _RUNNERS.items():
        _when_imported(module_name, functools.partial(_wrap_runner, class_name=class_name))
    REPORT.note_found("plugin", "registered")


def loaded_model(vllm_config: VllmConfig) -> torch.nn.Module | None:
    """The model loaded for ``vllm_config`` in this process, or None.

    Falls back to the single model this process loaded, then to a model runner on the caller's
    stack (when the plugin did not run)."""
    with _lock:
        ref = _models.get(id(vllm_config))
        model = ref() if ref is not None else None
        if model is None and len(_last) == 1:
            model = _last[0]()
    if model is not None:
        REPORT.note_found("model", f"{type(model).__name__} (via load_model)")
        return model
    model = _runner_on_stack()
    if model is not None:
        REPORT.note_found("model", f"{type(model).__name__} (via the caller's stack)")
    return model


BatchOrder = Callable[[int], "list[str] | None"]


def batch_order(vllm_config: VllmConfig) -> BatchOrder | None:
    """``ids(n)``: the step's first n request ids in the order of its attention metadata (the
    runner's ``input_batch.req_ids``), None when unreadable; None without a recorded runner.
    Holds the runner weakly (the runner reaches the connector)."""
    with _lock:
        ref = _runners.get(id(vllm_config))
    if ref is None or ref() is None:
        return None
    REPORT.note_found("batch order", f"{type(ref()).__name__}.input_batch.req_ids")

    def ids(num_reqs: int) -> list[str] | None:
        batch = getattr(ref(), "input_batch", None)
        got = getattr(batch, "req_ids", None)
        if not isinstance(got, list) or len(got) < num_reqs:
            return None
        return list(got[:num_reqs])

    return ids


def _record(runner: Any) -> None:
    model = runner.get_model() if hasattr(runner, "get_model") else getattr(runner, "model", None)
    if model is None:
        return
    try:
        ref = weakref.ref(model)
    except TypeError:  # not weak-referenceable: found on the caller's stack instead
        return
    with _lock:
        _models[id(runner.vllm_config)] = ref
        _last[:] = [ref]
        # A runner that is not weak-referenceable leaves the cascade decode path off.
        with contextlib.suppress(TypeError):
            _runners[id(runner.vllm_config)] = weakref.ref(runner)


def _wrap_runner(module: ModuleType, class_name: str) -> None:
    cls = getattr(module, class_name, None)
    load = getattr(cls, "load_model", None) if cls is not None else None
    if load is None or getattr(load, "_kmesh_wrapped", False):
        return

    @functools.wraps(load)
    def load_model(self: Any, *args: Any, **kwargs: Any) -> Any:
        out = load(self, *args, **kwargs)
        _record(self)
        return out

    load_model._kmesh_wrapped = True  # type: ignore[attr-defined]
    cls.load_model = load_model  # type: ignore[union-attr]
    REPORT.note_changed(f"{class_name}.load_model", "wrapped to record the loaded model")


def _runner_on_stack() -> torch.nn.Module | None:
    """A model runner held by a frame that called us (a worker's ``self.model_runner``)."""
    frame = inspect.currentframe()
    try:
        while frame is not None:
            owner = frame.f_locals.get("self")
            runner = getattr(owner, "model_runner", None)
            if runner is not None and hasattr(runner, "get_model"):
                try:
                    return runner.get_model()
                except Exception:
                    return None
            frame = frame.f_back
    finally:
        del frame
    return None


def _when_imported(name: str, fn: Callable[[ModuleType], None]) -> None:
    """Call ``fn(module)`` now if ``name`` is imported, else right after its first import."""
    if name in sys.modules:
        fn(sys.modules[name])
        return
    sys.meta_path.insert(0, _AfterImport(name, fn))


class _AfterImport(importlib.abc.MetaPathFinder):
    """A finder that lets the normal machinery load one module, then runs a callback on it."""

    def __init__(self, name: str, fn: Callable[[ModuleType], None]) -> None:
        self.name, self.fn = name, fn

    def find_spec(self, fullname: str, path: Sequence[str] | None,
                  target: ModuleType | None = None) -> ModuleSpec | None:  # fmt: skip
        if fullname != self.name:
            return None
        sys.meta_path.remove(self)
        spec = importlib.machinery.PathFinder.find_spec(fullname, path)
        if spec is None or spec.loader is None:
            return spec
        exec_module = spec.loader.exec_module
        fn = self.fn

        def exec_then_call(module: ModuleType) -> None:
            exec_module(module)
            fn(module)

        spec.loader.exec_module = exec_then_call  # type: ignore[method-assign]
        return spec
