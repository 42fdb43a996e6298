"""kmesh-blend: reuse the KV cache of shared prompt segments at new positions in vLLM.

``import kmesh_blend`` is light: it imports neither vLLM nor FlashInfer (nor torch). The vLLM
connector lives in ``kmesh_blend.vllm``; models in ``kmesh_blend.models``; test checkpoints in
``kmesh_blend.testing`` (in the repository only: the wheel leaves test fixtures out).
"""

from kmesh_blend.config import KNOWN_KEYS, ConfigError, KMeshConfig, StoreSpec, parse_store

__version__ = "0.1.0"

__all__ = ["KNOWN_KEYS", "ConfigError", "KMeshConfig", "StoreSpec", "__version__", "parse_store"]
