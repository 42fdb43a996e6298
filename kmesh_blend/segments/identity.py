"""Segment identity: a content hash of a segment's token ids, namespaced by everything that
decides what its KV is.

Two segments share stored KV only if they have the same token ids **and** the same `Namespace`:
model, KV dtype, KV layout (layers, KV heads, head dim), RoPE configuration and cache salt
(vLLM's per-tenant ``cache_salt``). Position is deliberately *not* part of the identity: the same
segment at any offset, in any order, in any prompt gets the same id (the blend re-positions it).

Hash: SHA-256 (``hashlib``) over a versioned header, the namespace digest, the token count and the
token ids as little-endian int64. The ids are hex strings, stable across processes, machines and
Python versions, so they can key remote stores.
"""

from __future__ import annotations

import hashlib
import json
import sys
from array import array
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field, replace
from typing import NewType

from kmesh_blend.segments.annotation import Span

__all__ = [
    "Namespace",
    "SegmentId",
    "make_namespace",
    "segment_id",
    "segment_ids",
]

SegmentId = NewType("SegmentId", str)
"""64 hex characters (SHA-256)."""

_VERSION = b"kmesh-segment-v1\0"  # bump if the hashed byte layout ever changes


@dataclass(frozen=True)
class Namespace:
    """What, besides token ids, decides a segment's KV. All fields are canonical strings."""

    model: str
    """Model name or path, plus revision if any."""
    dtype: str
    """KV dtype, e.g. ``"bfloat16"``."""
    kv_layout: str
    """Shape of a master per token, e.g. ``"L=24,Hkv=2,D=64"``."""
    rope: str = ""
    """Canonical JSON of the RoPE parameters (theta, scaling type and factors)."""
    cache_salt: str = ""
    """Per-tenant salt; requests with different salts never share KV."""
    _digest: bytes = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        for name in ("model", "dtype", "kv_layout", "rope", "cache_salt"):
            if not isinstance(getattr(self, name), str):
                raise TypeError(f"Namespace.{name} must be a str, got {getattr(self, name)!r}")
        blob = json.dumps(
            [self.model, self.dtype, self.kv_layout, self.rope, self.cache_salt],
            ensure_ascii=True,
            separators=(",", ":"),
        )
        object.__setattr__(self, "_digest", hashlib.sha256(blob.encode()).digest())

    @property
    def digest(self) -> bytes:
        """32-byte SHA-256 of the fields (computed once)."""
        return self._digest

    def with_salt(self, cache_salt: str | None) -> Namespace:
        """The same namespace for a request's ``cache_salt`` (``None`` = no salt)."""
        return replace(self, cache_salt=cache_salt or "")


def make_namespace(
    model: str,
    dtype: object,
    *,
    num_layers: int,
    num_kv_heads: int,
    head_dim: int,
    rope: Mapping[str, object] | None = None,
    cache_salt: str = "",
) -> Namespace:
    """Build a `Namespace` from typed parts (``dtype`` may be a ``torch.dtype`` or a string)."""
    dtype_name = str(dtype).removeprefix("torch.")
    layout = f"L={int(num_layers)},Hkv={int(num_kv_heads)},D={int(head_dim)}"
    rope_json = json.dumps(dict(rope or {}), sort_keys=True, separators=(",", ":"), default=str)
    return Namespace(model, dtype_name, layout, rope_json, cache_salt)


def segment_id(namespace: Namespace, token_ids: Sequence[int] | Iterable[int]) -> SegmentId:
    """Content id of one segment: ``token_ids`` [T] ints (a list, or a tensor via ``tolist``).

    Raises `ValueError` for an empty segment or an id outside int64.
    """
    ids = _as_int_list(token_ids)
    if not ids:
        raise ValueError("a segment must have at least one token")
    try:
        packed = array("q", ids)
    except OverflowError as exc:
        raise ValueError(f"token id out of int64 range: {exc}") from None
    if sys.byteorder == "big":
        packed.byteswap()
    h = hashlib.sha256(_VERSION)
    h.update(namespace.digest)
    h.update(len(ids).to_bytes(8, "little"))
    h.update(packed.tobytes())
    return SegmentId(h.hexdigest())


def segment_ids(
    namespace: Namespace, token_ids: Sequence[int], spans: Iterable[Span]
) -> list[SegmentId]:
    """Ids of every span ``(start, end)`` of a prompt's ``token_ids`` [T], in span order."""
    ids = _as_int_list(token_ids)
    return [segment_id(namespace, ids[start:end]) for start, end in spans]


def _as_int_list(token_ids: object) -> list[int]:
    tolist = getattr(token_ids, "tolist", None)
    raw = tolist() if callable(tolist) else list(token_ids)  # type: ignore[call-overload]
    if set(map(type, raw)) <= {int}:  # the common case, checked at C speed (bool is not int)
        return raw
    out = []
    for t in raw:
        if isinstance(t, bool) or not isinstance(t, int):
            raise TypeError(f"token ids must be ints, got {t!r}")
        out.append(t)
    return out
