"""A *master*: the dense KV of one shared segment, all layers, plus the metadata we keep with it.

Layout (what `MasterStore.put` takes and `MasterStore.get` returns)::

    kv:        [num_layers, 2, T, num_kv_heads, head_dim]   (index 0 = K, 1 = V), model dtype;
               K is stored *after* RoPE at ``positions``.
    positions: [T] int64, the positions the KV was computed at.

In LMCache the KV is stored as one memory object in LMCache's own chunk layout ``KV_2LTD``
(``[2, L, T, Hkv*D]``), so the stored bytes read as a normal LMCache KV object. Our metadata
(`MasterMeta`: token count, shape, dtype, positions, a checksum of the KV bytes and a *seal*
binding all of them to the segment id, see `master_seal`) is a second,
small ``uint8`` object under its own key, because LMCache's remote backends keep only
shape/dtype/format and drop ``cached_positions``. The metadata object is written *after* the KV
and read *first*, so it doubles as a commit marker; a KV whose checksum does not match is never
served, nor one whose positions were altered or that was stored under another segment's id.
"""

from __future__ import annotations

import dataclasses
import hashlib
import hmac
import json
import struct
import sys
from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol

if TYPE_CHECKING:
    import torch

    from kmesh_blend.segments.identity import SegmentId

__all__ = [
    "Master", "MasterLayout", "MasterMeta", "MasterStore", "kv_checksum", "master_seal",
]  # fmt: skip

_FORMAT = 2  # bump when the metadata byte layout changes (2: the seal)
_HEADER = struct.Struct("<4sI")  # magic, JSON length
_MAGIC = b"KMM1"


@dataclass(frozen=True)
class MasterLayout:
    """Per-token shape of masters in one store (one model): ``[L, 2, ·, Hkv, D]`` of ``dtype``."""

    num_layers: int
    num_kv_heads: int
    head_dim: int
    dtype: str = "bfloat16"
    """A ``torch`` dtype name (``"bfloat16"``, ``"float16"``, ``"float32"``)."""
    rank: int = 0
    """Tensor-parallel rank whose KV heads these masters hold (``num_kv_heads`` are its own)."""
    world_size: int = 1
    """Tensor-parallel size of the engine that stores them."""

    def torch_dtype(self) -> torch.dtype:
        import torch

        dtype = getattr(torch, self.dtype, None)
        if not isinstance(dtype, torch.dtype):
            raise ValueError(f"MasterLayout.dtype={self.dtype!r} is not a torch dtype")
        return dtype

    def bytes_per_token(self) -> int:
        import torch

        elem = torch.empty((), dtype=self.torch_dtype()).element_size()
        return self.num_layers * 2 * self.num_kv_heads * self.head_dim * elem


@dataclass(frozen=True)
class Master:
    """A segment's KV ``[L, 2, T, Hkv, D]`` and its ``positions`` ``[T]`` int64 (CPU tensors).

    Objects handed out by a store or cache may be shared between readers: treat as read-only.
    """

    kv: torch.Tensor
    positions: torch.Tensor

    @property
    def num_tokens(self) -> int:
        return int(self.kv.shape[2])

    @property
    def nbytes(self) -> int:
        """Host bytes held: KV plus positions."""
        return int(
            self.kv.numel() * self.kv.element_size()
            + self.positions.numel() * self.positions.element_size()
        )

    def check(self, layout: MasterLayout) -> None:
        """Raise `ValueError` unless ``kv``/``positions`` fit ``layout`` (shape, dtype, device)."""
        import torch

        kv, pos = self.kv, self.positions
        want = (layout.num_layers, 2, layout.num_kv_heads, layout.head_dim)
        if kv.dim() != 5 or (kv.shape[0], kv.shape[1], kv.shape[3], kv.shape[4]) != want:
            raise ValueError(
                f"kv shape {tuple(kv.shape)}; want [L={want[0]}, 2, T, Hkv={want[2]}, D={want[3]}]"
            )
        if kv.dtype != layout.torch_dtype():
            raise ValueError(f"kv dtype {kv.dtype}; want {layout.dtype}")
        if kv.shape[2] < 1:
            raise ValueError("a master needs at least one token")
        if pos.dtype != torch.int64 or tuple(pos.shape) != (kv.shape[2],):
            raise ValueError(
                f"positions {tuple(pos.shape)} {pos.dtype}; want [{kv.shape[2]}] torch.int64"
            )
        if kv.device.type != "cpu" or pos.device.type != "cpu":
            raise ValueError("masters are stored from CPU tensors")


@dataclass(frozen=True)
class MasterMeta:
    """What we store next to the KV (and LMCache would otherwise lose)."""

    num_tokens: int
    shape: tuple[int, ...]
    """Shape of ``kv`` ``[L, 2, T, Hkv, D]``."""
    dtype: str
    checksum: str
    """`kv_checksum` of the KV bytes."""
    positions: tuple[int, ...]
    seal: str = ""
    """`master_seal` of these fields for the segment id the master was stored under."""

    def encode(self) -> bytes:
        """Header (magic, JSON length), JSON fields, positions as little-endian int64."""
        head = json.dumps(
            {
                "format": _FORMAT,
                "num_tokens": self.num_tokens,
                "shape": list(self.shape),
                "dtype": self.dtype,
                "checksum": self.checksum,
                "seal": self.seal,
            },
            separators=(",", ":"),
        ).encode()
        pos = struct.pack(f"<{len(self.positions)}q", *self.positions)
        return _HEADER.pack(_MAGIC, len(head)) + head + pos

    @classmethod
    def decode(cls, blob: bytes) -> MasterMeta:
        """Inverse of `encode`; raises `ValueError` on anything malformed."""
        if len(blob) < _HEADER.size:
            raise ValueError("master metadata too short")
        magic, n = _HEADER.unpack_from(blob)
        if magic != _MAGIC:
            raise ValueError(f"bad master metadata magic {magic!r}")
        head = json.loads(blob[_HEADER.size : _HEADER.size + n])
        if head.get("format") != _FORMAT:
            raise ValueError(f"master metadata format {head.get('format')!r} != {_FORMAT}")
        num = int(head["num_tokens"])
        rest = blob[_HEADER.size + n :]
        if len(rest) != 8 * num:
            raise ValueError(f"master metadata holds {len(rest)} position bytes, want {8 * num}")
        positions = struct.unpack(f"<{num}q", rest)
        return cls(
            num, tuple(head["shape"]), str(head["dtype"]), str(head["checksum"]), positions,
            str(head.get("seal", "")),
        )  # fmt: skip

    def sealed(self, segment_id: str) -> MasterMeta:
        """This metadata with its seal for ``segment_id``."""
        return dataclasses.replace(self, seal=master_seal(segment_id, self))

    def seal_holds(self, segment_id: str) -> bool:
        """Whether this metadata was sealed for ``segment_id`` and is unchanged since."""
        return bool(self.seal) and hmac.compare_digest(self.seal, master_seal(segment_id, self))


def master_seal(segment_id: str, meta: MasterMeta) -> str:
    """BLAKE2b-128 over the segment id (which holds the namespace: model, weights, dtype,
    layout, RoPE, salt), token count, shape, dtype, positions and the KV checksum, hex. A master
    is accepted only under the id it was sealed for, with the positions it was computed at."""
    h = hashlib.blake2b(digest_size=16, person=b"kmesh-master")
    fields = [segment_id, str(meta.num_tokens), ",".join(map(str, meta.shape)), meta.dtype,
              meta.checksum]  # fmt: skip
    h.update("\0".join(fields).encode())
    h.update(struct.pack(f"<{len(meta.positions)}q", *meta.positions))
    return h.hexdigest()


def kv_checksum(kv: torch.Tensor) -> str:
    """BLAKE2b-128 (``hashlib``) of the tensor's bytes in C order, hex."""
    import torch

    flat = kv.detach().contiguous().reshape(-1).view(torch.uint8)
    if sys.byteorder == "big":  # pragma: no cover - every supported platform is little-endian
        raise RuntimeError("masters are defined in little-endian byte order")
    return hashlib.blake2b(flat.numpy().data, digest_size=16).hexdigest()


class MasterStore(Protocol):
    """Where masters live. ``tier`` is the ``kmesh.store`` kind (``cpu``, ``disk``, ``lm``,
    ``redis``)."""

    tier: str
    layout: MasterLayout

    def put(self, segment_id: SegmentId, kv: torch.Tensor, positions: torch.Tensor) -> bool:
        """Store a master; False if the tier refused it (full, unreachable)."""
        ...

    def get(self, segment_id: SegmentId) -> Master | None:
        """One read from the tier: a fresh copy of the master, or None."""
        ...

    def delete(self, segment_id: SegmentId) -> bool: ...

    def rejected(self, segment_id: SegmentId) -> str | None:
        """Why the last `get` of ``segment_id`` refused its master (integrity), else None."""
        ...

    def put_blob(self, object_id: SegmentId, blob: bytes) -> bool:
        """Store opaque bytes (a mirror) next to the masters; False if the tier refused."""
        ...

    def get_blob(self, object_id: SegmentId) -> bytes | None: ...

    def delete_blob(self, object_id: SegmentId) -> bool: ...

    def close(self) -> None: ...
