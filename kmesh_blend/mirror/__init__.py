"""Master–Mirror storage: a sibling's post-blend segment KV as a lossless diff against its master.

- `kmesh_blend.mirror.codec`: `Mirror`, `encode`, the prediction (master re-positioned);
- `kmesh_blend.mirror.reference`: plain-torch restore (dense, one layer, into a paged cache);
- `kmesh_blend.mirror.restore`: `plan_restore` / `restore_layer` with backend dispatch and the
  fused Triton kernel (`kmesh_blend.kernels.mirror_restore`);
- `kmesh_blend.mirror.wire`: the stored byte format (checksummed, bound to a master version);
- `kmesh_blend.mirror.lifecycle`: `MirrorStore`, mirrors in the segment store and index.

Importing this package imports torch (not vLLM, LMCache or Triton).
"""

from kmesh_blend.mirror.codec import GRANULARITIES, PREDICTOR, Granularity, Mirror, encode
from kmesh_blend.mirror.reference import restore_dense_reference
from kmesh_blend.mirror.restore import RestorePlan, plan_restore, restore_layer

__all__ = [
    "GRANULARITIES",
    "PREDICTOR",
    "Granularity",
    "Mirror",
    "RestorePlan",
    "encode",
    "plan_restore",
    "restore_dense_reference",
    "restore_layer",
]
