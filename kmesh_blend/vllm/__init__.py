"""vLLM integration: ``kv_connector_module_path = "kmesh_blend.vllm"`` loads `KMeshConnector`.

Importing this package imports vLLM; ``import kmesh_blend`` alone does not.
"""

from kmesh_blend.compat import guard_llvmlite
from kmesh_blend.vllm.connector import KMeshConnector

guard_llvmlite()  # LMCache (imported by the store) loads llvmlite; keep vLLM's start-up scan safe

__all__ = ["KMeshConnector"]
