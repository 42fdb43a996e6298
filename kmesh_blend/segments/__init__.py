"""Shared segments: annotation, content identity, the round-aware index and its storage.

Importing this package is light (no torch, LMCache or vLLM). The torch/LMCache parts are imported
from their modules: `kmesh_blend.segments.store` (masters through LMCache backends),
`kmesh_blend.segments.master` (master layout and metadata), `kmesh_blend.segments.cache`
(`SegmentCache`: index + store + singleflight + retention + metrics),
`kmesh_blend.segments.notice` (application notice) and `kmesh_blend.segments.metrics`.
"""

from kmesh_blend.segments.annotation import (
    Annotation,
    AnnotationError,
    ParsedRequest,
    Span,
    parse_annotation,
    parse_request,
    validate_spans,
)
from kmesh_blend.segments.client import Encoded, Shared, encode_marked, encode_parts
from kmesh_blend.segments.fingerprint import weights_fingerprint
from kmesh_blend.segments.identity import Namespace, SegmentId, make_namespace, segment_id
from kmesh_blend.segments.index import SegmentIndex, SegmentInfo, SegmentState
from kmesh_blend.segments.retention import RetentionPool
from kmesh_blend.segments.separator import split_on_separator
from kmesh_blend.segments.singleflight import (
    Outcome,
    SingleFlight,
    SingleFlightError,
    SingleFlightTimeout,
)

__all__ = [
    "Annotation",
    "AnnotationError",
    "Encoded",
    "Namespace",
    "Outcome",
    "ParsedRequest",
    "RetentionPool",
    "SegmentId",
    "SegmentIndex",
    "SegmentInfo",
    "SegmentState",
    "Shared",
    "SingleFlight",
    "SingleFlightError",
    "SingleFlightTimeout",
    "Span",
    "encode_marked",
    "encode_parts",
    "make_namespace",
    "parse_annotation",
    "parse_request",
    "segment_id",
    "split_on_separator",
    "validate_spans",
    "weights_fingerprint",
]
