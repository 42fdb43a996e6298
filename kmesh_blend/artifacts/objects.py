"""Immutable shared artifacts and the children's copy-on-write views of them.

A `SharedArtifact` is what every member of a family reads: its payload is frozen (numpy arrays
are read-only, byte strings are immutable), so no reader can change what its siblings see. A
child that needs to change an artifact opens a `ChildView`: reads go to the shared payload until
the first `ChildView.write`, which makes the child's own writable copy (charged to the store's
host-RAM budget and owned by the child). A sibling never sees that copy.

Payloads: ``np.ndarray`` (e.g. embeddings ``[num_docs, 384]`` float32), ``bytes`` (a tool
response) or a tuple of arrays (a retrieval result: ids ``[k]`` int64, scores ``[k]`` float32).
"""

from __future__ import annotations

import threading
import zlib
from collections.abc import Callable
from dataclasses import dataclass
from typing import Literal, TypeAlias

import numpy as np

from kmesh_blend.artifacts.errors import ArtifactInputError, DoubleReleaseError

__all__ = [
    "KINDS",
    "ArtifactKind",
    "ChildView",
    "Payload",
    "SharedArtifact",
    "WritablePayload",
    "digest",
    "freeze",
    "payload_nbytes",
    "thaw",
]

Payload: TypeAlias = np.ndarray | bytes | tuple[np.ndarray, ...]
"""What a loader returns and a shared artifact holds (frozen)."""
WritablePayload: TypeAlias = np.ndarray | bytearray | tuple[np.ndarray, ...]
"""A child's own copy: writable arrays, or a bytearray for byte payloads."""
ArtifactKind = Literal["embedding", "retrieval", "tool", "blob"]
KINDS: tuple[str, ...] = ("embedding", "retrieval", "tool", "blob")


@dataclass(frozen=True)
class SharedArtifact:
    """One immutable object shared by every reader (build it with `SharedArtifact.of`)."""

    key: str
    kind: ArtifactKind
    payload: Payload
    """Frozen: arrays have ``writeable=False``; bytes are immutable."""
    nbytes: int
    """Host-RAM bytes of the payload (what the store's budget is charged)."""

    @classmethod
    def of(cls, key: str, kind: ArtifactKind, payload: object) -> SharedArtifact:
        """Validate and freeze ``payload`` (arrays are copied once, so no caller keeps a
        writable alias of the shared object)."""
        if kind not in KINDS:
            raise ArtifactInputError(f"kind must be one of {KINDS}, got {kind!r}")
        frozen = freeze(payload, field=f"payload of {key!r}")
        return cls(key, kind, frozen, payload_nbytes(frozen))


def freeze(payload: object, *, field: str = "payload", copy: bool = True) -> Payload:
    """A read-only version of ``payload``; raises `ArtifactInputError` naming ``field`` for an
    unsupported type. ``copy=False`` only for arrays nobody else references (just decoded)."""
    if isinstance(payload, bytes):
        return payload
    if isinstance(payload, bytearray | memoryview):
        return bytes(payload)
    if isinstance(payload, np.ndarray):
        return _frozen_array(payload, copy)
    if isinstance(payload, tuple) and payload and all(isinstance(a, np.ndarray) for a in payload):
        return tuple(_frozen_array(a, copy) for a in payload)
    raise ArtifactInputError(
        f"{field} must be bytes, a numpy array or a non-empty tuple of arrays, "
        f"got {type(payload).__name__}"
    )


def thaw(payload: Payload) -> WritablePayload:
    """A writable deep copy of a frozen payload."""
    if isinstance(payload, bytes):
        return bytearray(payload)
    if isinstance(payload, np.ndarray):
        return payload.copy()
    return tuple(a.copy() for a in payload)


def payload_nbytes(payload: Payload | WritablePayload) -> int:
    """Bytes of host RAM the payload's data occupies."""
    if isinstance(payload, bytes | bytearray):
        return len(payload)
    if isinstance(payload, np.ndarray):
        return int(payload.nbytes)
    return sum(int(a.nbytes) for a in payload)


def digest(payload: Payload | WritablePayload) -> int:
    """CRC-32 of the payload's bytes (arrays: dtype, shape and data), to compare outputs."""
    if isinstance(payload, bytes | bytearray):
        return zlib.crc32(payload)
    arrays = (payload,) if isinstance(payload, np.ndarray) else payload
    crc = 0
    for a in arrays:
        crc = zlib.crc32(f"{a.dtype.str}{a.shape}".encode(), crc)
        crc = zlib.crc32(np.ascontiguousarray(a).data, crc)
    return crc


class ChildView:
    """A child's copy-on-write view of one shared artifact (made by `ArtifactStore.view`).

    `read` returns the shared payload until the first `write`, then the child's own copy.
    `close` drops the copy and the child's reference; a second `close` raises
    `DoubleReleaseError`. Closing the family closes its children's open views.
    """

    def __init__(
        self,
        artifact: SharedArtifact,
        family: str,
        child: str,
        *,
        charge: Callable[[ChildView, int], None],
        discharge: Callable[[ChildView], None],
        source: str = "ram",
    ) -> None:
        self.artifact = artifact
        self.source = source
        """How the store got the shared artifact for this view (``ram``, ``disk``, ...)."""
        self.family = family
        self.child = child
        self._charge = charge
        self._discharge = discharge
        self._copy: WritablePayload | None = None
        self._closed = False
        self._lock = threading.Lock()

    @property
    def key(self) -> str:
        return self.artifact.key

    @property
    def copy_key(self) -> str:
        """The key the child's private copy is retained under."""
        return f"{self.artifact.key}#copy:{self.family}/{self.child}"

    @property
    def is_copied(self) -> bool:
        return self._copy is not None

    @property
    def private_nbytes(self) -> int:
        """Bytes of the child's own copy (0 until the first `write`)."""
        return 0 if self._copy is None else payload_nbytes(self._copy)

    @property
    def closed(self) -> bool:
        return self._closed

    def read(self) -> Payload | WritablePayload:
        """The child's copy if it wrote, else the shared (read-only) payload."""
        self._check_open()
        return self.artifact.payload if self._copy is None else self._copy

    def write(self) -> WritablePayload:
        """The child's own writable copy, made (and charged to the budget) on the first call.

        Raises `BudgetError` (from the store) if the copy does not fit in host RAM.
        """
        with self._lock:
            self._check_open()
            if self._copy is None:
                copy = thaw(self.artifact.payload)
                self._charge(self, payload_nbytes(copy))
                self._copy = copy
            return self._copy

    def close(self) -> None:
        """Drop the private copy (frees its bytes) and the child's reference."""
        with self._lock:
            if self._closed:
                raise DoubleReleaseError(
                    f"view of {self.key!r} for child {self.child!r} of family "
                    f"{self.family!r} was already closed"
                )
            self._closed = True
        self._discharge(self)
        self._copy = None

    def _check_open(self) -> None:
        if self._closed:
            raise DoubleReleaseError(
                f"view of {self.key!r} for child {self.child!r} is closed (family "
                f"{self.family!r} released it)"
            )


def _frozen_array(a: np.ndarray, copy: bool) -> np.ndarray:
    if a.dtype == object:
        raise ArtifactInputError(f"array payloads must have a numeric dtype, got {a.dtype}")
    out = np.array(a, copy=True, order="C") if copy else np.ascontiguousarray(a)
    out.setflags(write=False)
    return out
