"""vLLM plugin entry point (``vllm.general_plugins`` in ``pyproject.toml``): every vLLM process
calls `register` at start, before any model is loaded. It lets the connector reach the loaded
model (`kmesh_blend.vllm.seam.runners`); it stays light, since an API-server process runs it too.

A deployment that sets ``VLLM_PLUGINS`` must list ``kmesh_blend`` in it; without the plugin the
connector looks for the runner on its caller's stack, and failing that serves every request on
the stock path (one log line says why).
"""

from kmesh_blend.vllm.seam.runners import register

__all__ = ["register"]
