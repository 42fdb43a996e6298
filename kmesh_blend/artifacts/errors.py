"""Errors of the artifact layer. Every message names the bad field and the value it got."""

from __future__ import annotations

__all__ = [
    "ArtifactError",
    "ArtifactInputError",
    "ArtifactLoadError",
    "BudgetError",
    "DoubleReleaseError",
    "UnknownArtifactError",
    "UnknownFamilyError",
]


class ArtifactError(Exception):
    """Base class of every error raised by `kmesh_blend.artifacts`."""


class ArtifactInputError(ArtifactError, ValueError):
    """A bad argument (wrong type, out of range); the message names the field."""


class UnknownFamilyError(ArtifactError, LookupError):
    """A family that was never opened (``family``)."""


class UnknownArtifactError(ArtifactError, LookupError):
    """An artifact key that was never declared, or was released with its family (``key``)."""


class DoubleReleaseError(ArtifactError):
    """A family closed twice, a child view closed twice, or a closed family used again."""


class BudgetError(ArtifactError):
    """A child's private copy does not fit in host RAM without evicting held objects."""


class ArtifactLoadError(ArtifactError):
    """A loader (embedding model, vector index, tool call) failed; ``__cause__`` says why."""
