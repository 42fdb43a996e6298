"""Public kernel ops (launchers with validation and backend dispatch) and their references."""

from kmesh_blend.ops.launch import (
    Backend,
    drift_means,
    gather_paged,
    reposition_keys,
    scatter_paged,
    shift_rows,
    token_deviation,
)

__all__ = [
    "Backend", "drift_means", "gather_paged", "reposition_keys", "scatter_paged", "shift_rows",
    "token_deviation",
]  # fmt: skip
