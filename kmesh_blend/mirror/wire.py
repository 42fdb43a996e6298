"""The stored byte format of a mirror: checksummed, bound to one master version.

Layout (little-endian)::

    magic  b"KMR1"            4 bytes
    digest BLAKE2b-128        16 bytes, over n and everything after the fixed header
    n      uint32             length of the JSON header
    JSON   {format, master_id, master_checksum, predictor, unit, shape [L, S, H, D], dtype,
            num_rows, planes}
    positions  int64 [S]
    changed    packed bits of the [L, 2, U] unit mask (numpy ``packbits``, big bit order)
    rows       [num_rows, H, D] in ``dtype``, C order — or, when ``planes`` is a list, the rows'
               bytes split into byte planes (plane i = byte i of every element, little-endian),
               each stored as it is (``planes[i] == -1``) or zlib-compressed to ``planes[i]``
               bytes. The high planes of float KV (sign, exponent) compress; the low ones do not,
               so a plane is kept compressed only when that is smaller. Lossless either way.

`decode` raises `MirrorFormatError` on anything that does not add up: wrong magic or format,
digest mismatch (corruption anywhere), a length that disagrees with the header (truncation),
a row count that disagrees with the unit mask. The caller then recomputes.
"""

from __future__ import annotations

import hashlib
import json
import struct
import zlib
from typing import NamedTuple

import numpy as np
import torch

from kmesh_blend.mirror.codec import Mirror

__all__ = ["MirrorFormatError", "WireHeader", "decode", "encode_bytes"]

_MAGIC = b"KMR1"
_FORMAT = 1
_FIXED = struct.Struct("<4s16sI")
_DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}


class MirrorFormatError(ValueError):
    """A stored mirror is malformed, truncated or corrupted."""


class WireHeader(NamedTuple):
    """What a stored mirror says about itself (JSON fields of the header)."""

    master_id: str
    master_checksum: str
    predictor: str
    unit: int
    shape: tuple[int, int, int, int]
    """[L, S, H, D]."""
    dtype: str
    num_rows: int


def encode_bytes(mirror: Mirror, master_id: str, compress: bool = False) -> bytes:
    """Serialise ``mirror`` (bound to master ``master_id`` and ``mirror.master_checksum``);
    ``compress``: byte-plane zlib coding of the rows (see the module docstring)."""
    L, S = mirror.num_layers, mirror.num_tokens
    H, D = (int(x) for x in mirror.rows.shape[1:])
    dtype = str(mirror.rows.dtype).removeprefix("torch.")
    if dtype not in _DTYPES:
        raise ValueError(f"mirror rows dtype {mirror.rows.dtype}; valid: {sorted(_DTYPES)}")
    head = json.dumps(
        {
            "format": _FORMAT,
            "master_id": master_id,
            "master_checksum": mirror.master_checksum,
            "predictor": mirror.predictor,
            "unit": mirror.unit,
            "shape": [L, S, H, D],
            "dtype": dtype,
            "num_rows": int(mirror.rows.shape[0]),
            "planes": None,
        },
        separators=(",", ":"),
    )
    raw = mirror.rows.contiguous().reshape(-1).view(torch.uint8).numpy()
    rows = raw.tobytes()
    if compress and raw.size:
        planes, rows = _encode_planes(raw, mirror.rows.element_size())
        head = head.replace('"planes":null', f'"planes":{json.dumps(planes)}')
    body = b"".join(
        (
            head.encode(),
            mirror.positions.to(torch.int64).contiguous().numpy().astype("<i8").tobytes(),
            np.packbits(mirror.changed.reshape(-1).numpy()).tobytes(),
            rows,
        )
    )
    n = len(head.encode())
    return _FIXED.pack(_MAGIC, _digest(n, body), n) + body


def decode(blob: bytes) -> tuple[Mirror, WireHeader]:
    """Inverse of `encode_bytes`; raises `MirrorFormatError` (see the module docstring)."""
    if len(blob) < _FIXED.size:
        raise MirrorFormatError(f"mirror object of {len(blob)} bytes is shorter than its header")
    magic, digest, n = _FIXED.unpack_from(blob)
    if magic != _MAGIC:
        raise MirrorFormatError(f"bad mirror magic {magic!r}")
    body = memoryview(blob)[_FIXED.size :]
    if _digest(n, body) != digest:
        raise MirrorFormatError("mirror checksum mismatch (corrupted or truncated)")
    try:
        head = json.loads(bytes(body[:n]))
        if head.get("format") != _FORMAT:
            raise MirrorFormatError(f"mirror format {head.get('format')!r} != {_FORMAT}")
        L, S, H, D = (int(x) for x in head["shape"])
        header = WireHeader(
            str(head["master_id"]),
            str(head["master_checksum"]),
            str(head["predictor"]),
            int(head["unit"]),
            (L, S, H, D),
            str(head["dtype"]),
            int(head["num_rows"]),
        )
        dtype = _DTYPES[header.dtype]
    except (KeyError, TypeError, ValueError) as exc:
        if isinstance(exc, MirrorFormatError):
            raise
        raise MirrorFormatError(f"malformed mirror header: {exc}") from None
    if min(L, S, H, D, header.unit) < 1 or header.num_rows < 0:
        raise MirrorFormatError(f"mirror header has impossible sizes {head}")
    num_units = -(-S // header.unit)
    elem = torch.empty((), dtype=dtype).element_size()
    planes = head.get("planes")
    raw_rows = header.num_rows * H * D * elem
    if planes is not None and (
        not isinstance(planes, list) or len(planes) != elem
        or not all(isinstance(x, int) and not isinstance(x, bool) and x >= -1 for x in planes)
    ):  # fmt: skip
        raise MirrorFormatError(f"malformed mirror planes {planes!r}")
    stored_rows = (
        raw_rows if planes is None else sum(raw_rows // elem if x < 0 else x for x in planes)
    )
    sizes = (8 * S, (L * 2 * num_units + 7) // 8, stored_rows)
    if len(body) - n != sum(sizes):
        raise MirrorFormatError(
            f"mirror body holds {len(body) - n} bytes, header says {sum(sizes)}"
        )
    at = n
    positions = torch.frombuffer(bytearray(body[at : at + sizes[0]]), dtype=torch.int64)
    at += sizes[0]
    bits = np.unpackbits(np.frombuffer(body[at : at + sizes[1]], dtype=np.uint8))
    changed = torch.from_numpy(bits[: L * 2 * num_units].astype(bool)).reshape(L, 2, num_units)
    at += sizes[1]
    row_bytes = bytes(body[at:]) if planes is None else _decode_planes(body[at:], planes, raw_rows)
    raw = torch.frombuffer(bytearray(row_bytes), dtype=torch.uint8) if raw_rows else None
    rows = (
        raw.view(dtype).reshape(header.num_rows, H, D)
        if raw is not None
        else torch.empty(0, H, D, dtype=dtype)
    )
    stored = changed.repeat_interleave(header.unit, dim=2)[:, :, :S]
    if int(stored.sum()) != header.num_rows:
        raise MirrorFormatError(
            f"mirror holds {header.num_rows} rows, its mask wants {stored.sum()}"
        )
    mirror = Mirror(positions, changed, rows, header.unit, header.master_checksum, header.predictor)
    return mirror, header


def _encode_planes(raw: np.ndarray, elem: int) -> tuple[list[int], bytes]:
    """Bytes [N·elem] → (per-plane stored length or −1 for raw, the planes' bytes in order)."""
    lengths, parts = [], []
    for plane in raw.reshape(-1, elem).T:
        data = np.ascontiguousarray(plane).tobytes()
        packed = zlib.compress(data, 1)
        keep = len(packed) < len(data)
        lengths.append(len(packed) if keep else -1)
        parts.append(packed if keep else data)
    return lengths, b"".join(parts)


def _decode_planes(stored: memoryview, planes: list[int], raw_rows: int) -> bytes:
    elem = len(planes)
    per = raw_rows // elem
    out = np.empty((per, elem), dtype=np.uint8)
    at = 0
    for i, length in enumerate(planes):
        size = per if length < 0 else length
        chunk = bytes(stored[at : at + size])
        at += size
        try:
            data = chunk if length < 0 else _inflate(chunk, per)
        except zlib.error as exc:
            raise MirrorFormatError(f"mirror plane {i} does not decompress: {exc}") from None
        if len(data) != per:
            raise MirrorFormatError(f"mirror plane {i} holds {len(data)} bytes, want {per}")
        out[:, i] = np.frombuffer(data, dtype=np.uint8)
    return out.tobytes()


def _inflate(chunk: bytes, size: int) -> bytes:
    """zlib ``chunk`` → at most ``size`` + 1 bytes: a plane that would inflate past its size
    (a corrupt or hostile object) stops there instead of filling memory."""
    inflater = zlib.decompressobj()
    data = inflater.decompress(chunk, size + 1)
    if len(data) > size or inflater.unconsumed_tail or not inflater.eof:
        raise zlib.error(f"the plane does not inflate to exactly {size} bytes")
    return data


def _digest(n: int, body: bytes | memoryview) -> bytes:
    h = hashlib.blake2b(struct.pack("<I", n), digest_size=16)
    h.update(body)
    return h.digest()
