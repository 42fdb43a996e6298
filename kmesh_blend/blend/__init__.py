"""The blend: selective recomputation of reused segments, for one request or a sibling group."""

from kmesh_blend.blend.executor import BlendResult, RequestBlend
from kmesh_blend.blend.group import blend_group, blend_one
from kmesh_blend.blend.plan import (
    BlendOptions,
    BlendRequest,
    SegmentUse,
    check_ratios,
    keep_count,
    select_top,
)
from kmesh_blend.blend.source import (
    DenseSegmentSource,
    MasterSource,
    SegmentKV,
    SegmentSource,
    master_tensor,
    segment_kv_from_prefill,
)

__all__ = [
    "BlendOptions",
    "BlendRequest",
    "BlendResult",
    "DenseSegmentSource",
    "MasterSource",
    "RequestBlend",
    "SegmentKV",
    "SegmentSource",
    "SegmentUse",
    "blend_group",
    "blend_one",
    "check_ratios",
    "keep_count",
    "master_tensor",
    "segment_kv_from_prefill",
    "select_top",
]
