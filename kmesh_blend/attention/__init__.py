"""Cascade attention over shared segments placed at different offsets (mirror-aware).

Public API: `cascade_attention` with its inputs `SharedSegment` and `Sibling`
(`kmesh_blend.attention.cascade`); the building blocks `level_state` and `merge_state`
(`kmesh_blend.attention.launch`); fp32 references in `kmesh_blend.attention.reference`; the
``"auto"`` backend choice with its start-up self-check in `kmesh_blend.attention.backend`; group
recomputation's attention in `kmesh_blend.attention.hook` — `CascadeGroupAttention`, one call per
layer for the whole group, and per-request `cascade_hooks` (imported on demand: it imports the
blend).

Decode of a family inside vLLM: `kmesh_blend.attention.decode.decode_cascade` (one query per
request, each master's K/V read once for all its readers, one softmax over own rows and
masters),
served by `kmesh_blend.vllm.cascade_decode` when ``kmesh.cascade_decode`` is on: the worker gives
this engine's attention layers a subclass of vLLM's CPU backend implementation (no registry entry,
no file patched); the stored master itself is the shared level (not a sibling's paged copy), and
which rows each request reads from it is verified against its paged rows before it decodes
(`kmesh_blend.vllm.decode_plan`). Freeing the duplicate blocks would additionally need
non-prefix block sharing in vLLM's KV cache manager, which hashes prefixes only: each request
still holds its own copy. Measured in `bench/cascade_decode.py`.
Estimate for a GPU (bench/cascade.py, full mode; bandwidth model, KV reads only): a 158M Llama
(12 layers, 8 KV heads × 64, bf16), document of 2,048 tokens, N = 8 siblings, 15% replaced rows:
shared-KV reads per decode step drop from 326 MiB to 48 MiB (0.147×), ≈ 71 µs → 11 µs at 4.8 TB/s
(H200), next to ≈ 66 µs of weight reads per step — roughly a 1.8× shorter decode step for this
family. The saving grows with N·S; at N = 1 cascade reads 1.17× (the whole master plus masks).
"""

from kmesh_blend.attention.cascade import SharedSegment, Sibling, cascade_attention
from kmesh_blend.attention.launch import CascadeBackend, level_state, merge_state

__all__ = [
    "CascadeBackend",
    "SharedSegment",
    "Sibling",
    "cascade_attention",
    "level_state",
    "merge_state",
]
