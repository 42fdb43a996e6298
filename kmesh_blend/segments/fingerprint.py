"""A cheap fingerprint of a checkpoint's weights, so KV computed by old weights is never reused.

`weights_fingerprint` hashes, for every weight file of a checkpoint (``*.safetensors``, ``*.bin``,
``*.pt``, ``*.pth``, ``*.gguf``; sorted by path relative to the checkpoint, hidden folders
skipped) and for ``config.json`` when present:

- its relative path and its size in bytes;
- for safetensors files, the JSON header (tensor names, dtypes, shapes, data offsets and the
  ``__metadata__``), parsed and re-serialised with sorted keys;
- ``_NUM_WINDOWS`` byte windows of ``_WINDOW`` bytes at evenly spaced offsets, the first at byte 0
  and the last ending at the end of the file (a file no larger than all windows together is hashed
  whole; ``config.json`` is always hashed whole).

The cost is independent of the model's size: ≈ 34 reads of 4 KiB per file (a few ms on a
multi-GB file). Modification times are not used (a copy changes them, the weights stay the same).

What it catches: any replacement that changes a file's size, its safetensors header or any sampled
window, or ``config.json``. A retraining, fine-tune, re-quantisation, dtype change or any
perturbation that touches most tensors changes nearly every window, so it is caught.

What it does not catch: a change confined to bytes between the sampled windows, e.g. one edited
weight (or a few rows of one tensor) in a multi-MB file. Deployments that edit weights in place
that way must change the checkpoint's path or name instead.

A path that is neither a local file nor a local directory (a hub id such as
``HuggingFaceTB/SmolLM2-135M-Instruct``), and a directory holding no weight file, get
``"unverified:<path as given>"``: stable, but it proves nothing about the weights behind the name.
Callers that must not reuse KV across weight changes should treat that prefix as "unknown".

Pure Python (no torch, no vLLM): importing this module is light.
"""

from __future__ import annotations

import hashlib
import json
import struct
from pathlib import Path
from typing import BinaryIO

__all__ = ["UNVERIFIED_PREFIX", "WEIGHT_SUFFIXES", "weights_fingerprint", "window_offsets"]

UNVERIFIED_PREFIX = "unverified:"
WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth", ".gguf")

_FORMAT = 1  # bump when what is hashed changes: old fingerprints then never match new ones
_WINDOW = 4096  # bytes per sampled window
_NUM_WINDOWS = 34  # 32 evenly spaced interior windows plus the first and the last
_MAX_HEADER = 100_000_000  # safetensors' own limit on the JSON header size
_CONFIG = "config.json"


def weights_fingerprint(path: str | Path) -> str:
    """Return a hex digest of the weights at ``path`` (a checkpoint directory or one file).

    Same bytes → same value, wherever the files lie. A non-local path (a hub id) or a directory
    without weight files gives ``"unverified:<path>"`` (see the module docstring).
    """
    root = Path(path)
    if root.is_file():
        files = [(root.name, root)]
    elif root.is_dir():
        files = _weight_files(root)
        if not any(name != _CONFIG for name, _ in files):
            return f"{UNVERIFIED_PREFIX}{path}"
    else:
        return f"{UNVERIFIED_PREFIX}{path}"
    digest = hashlib.sha256(f"kmesh-weights-fingerprint-{_FORMAT}".encode())
    for name, file in files:
        _hash_file(digest, name, file)
    return digest.hexdigest()


def window_offsets(size: int) -> list[int]:
    """Start offsets of the sampled windows in a file of ``size`` bytes (empty: hashed whole)."""
    if size <= _WINDOW * _NUM_WINDOWS:
        return []
    last = size - _WINDOW
    return [i * last // (_NUM_WINDOWS - 1) for i in range(_NUM_WINDOWS)]


def _weight_files(root: Path) -> list[tuple[str, Path]]:
    found = []
    for file in root.rglob("*"):
        rel = file.relative_to(root)
        if any(part.startswith(".") for part in rel.parts) or not file.is_file():
            continue
        if file.suffix in WEIGHT_SUFFIXES or rel.as_posix() == _CONFIG:
            found.append((rel.as_posix(), file))
    return sorted(found)


def _hash_file(digest: hashlib._Hash, name: str, file: Path) -> None:
    size = file.stat().st_size
    digest.update(json.dumps({"name": name, "size": size}, sort_keys=True).encode())
    with open(file, "rb") as f:
        if file.suffix == ".safetensors":
            digest.update(b"header:" + _safetensors_header(f, size))
        offsets = [] if name == _CONFIG else window_offsets(size)
        if not offsets:
            digest.update(b"whole:" + f.read())
            return
        for offset in offsets:
            f.seek(offset)
            digest.update(f.read(_WINDOW))


def _safetensors_header(f: BinaryIO, size: int) -> bytes:
    """The header as canonical JSON, or ``b"invalid"`` when the file is not valid safetensors."""
    f.seek(0)
    prefix = f.read(8)
    if len(prefix) < 8:
        return b"invalid"
    (length,) = struct.unpack("<Q", prefix)
    if length > min(_MAX_HEADER, size - 8):
        return b"invalid"
    try:
        header = json.loads(f.read(length))
    except (UnicodeDecodeError, ValueError):
        return b"invalid"
    return json.dumps(header, sort_keys=True, separators=(",", ":")).encode()
