"""vLLM integration: ``kv_connector_module_path = "kmesh_blend.vllm"`` loads `KMeshConnector`.

The connector (and with it vLLM, LMCache and the blend) is imported on first access, so the
plugin entry point (`kmesh_blend.vllm.plugin`, run in every vLLM process) stays light;
``import kmesh_blend`` alone imports none of them.
"""

from typing import Any

__all__ = ["KMeshConnector"]


def __getattr__(name: str) -> Any:
    if name == "KMeshConnector":
        from kmesh_blend.compat import guard_llvmlite
        from kmesh_blend.vllm.connector import KMeshConnector

        guard_llvmlite()  # LMCache (imported by the store) loads llvmlite; keep vLLM's scan safe
        return KMeshConnector
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
