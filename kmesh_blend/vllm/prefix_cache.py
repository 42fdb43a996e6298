"""Running beside vLLM's prefix caching: blended blocks are cached under hashes no one else has.

vLLM's prefix cache keys a full block by ``request.block_hashes[i]``, a hash chained over the
prompt's tokens (and ``cache_salt``, LoRA, multimodal keys) up to the block's end. It caches a
request's blocks when it allocates them — including blocks whose KV a connector provides — and a
later request whose own chain reaches the same hash gets the block as exact prefix KV. A blended
block is an approximation of the exact prefill, so it must never be found that way.

The mechanism (`privatize`): when the connector accepts a request for reuse, before vLLM
allocates its blocks, every entry of ``request.block_hashes`` from the first token the connector
provides onward is replaced by a hash private to that request (a per-engine serial number mixed
with the original). Blocks are then cached under keys no other request's chain produces, and the
hashes vLLM appends later (generated tokens) chain from a private one, so they are private too.
The exact leading prefix — the blocks vLLM found in its own cache — keeps its real hashes.

Consequences: unannotated traffic keeps its prefix-cache hits; an annotated request takes its
leading prefix from the cache and the blend starts after it; a prompt that repeats or extends a
blended request's prompt gets exact hits only up to where the blend began, and recomputes the
rest. Blended requests never share blocks with each other, not even identical ones: a blend's KV
depends on its siblings (collective selection) and on the master it read, so equal annotations do
not prove equal KV. A block whose load failed is recomputed exactly by vLLM and stays under its
private hash (a lost hit, never a wrong one). Privatization is sticky: a request rescheduled after
preemption keeps the private hashes it had.

Assumptions, checked at start against the running vLLM (`seam.blocks.check_prefix_caching`; if
one fails, the connector refuses to start with prefix caching on, naming it): one KV cache group;
the hasher gives one hash per ``hash_block_size`` tokens; `KVCacheManager` caches blocks under
``request.block_hashes`` at allocation and looks them up by the same list.
"""

from __future__ import annotations

import hashlib
import itertools
from typing import TYPE_CHECKING

from kmesh_blend.vllm.seam.blocks import rewrite_hashes

if TYPE_CHECKING:
    from vllm.v1.request import Request

__all__ = ["Privatizer"]

_TAG = b"kmesh-blended\0"


class Privatizer:
    """Replaces a request's block hashes from a token onward with private ones (see module doc).

    ``hash_block_size``: tokens per entry of ``request.block_hashes``."""

    def __init__(self, hash_block_size: int) -> None:
        if hash_block_size <= 0:
            raise ValueError(f"hash_block_size={hash_block_size} must be positive")
        self.hash_block_size = hash_block_size
        self._serial = itertools.count()
        self._private_from: dict[str, int] = {}  # request id → first private entry

    def privatize(self, request: Request, first_token: int) -> int:
        """Make every hash entry covering tokens ≥ ``first_token`` private; returns the index of
        the first private entry. Idempotent per request, and never un-privatizes an entry."""
        start = first_token // self.hash_block_size
        salt = next(self._serial).to_bytes(8, "little")
        done = self._private_from.get(request.request_id)  # entries from here on are private

        def mix(entry: bytes) -> bytes:
            return hashlib.sha256(_TAG + salt + entry).digest()

        total = rewrite_hashes(request, start, done if done is not None else 1 << 62, mix)
        first = min(start, done if done is not None else total)
        self._private_from[request.request_id] = first
        return first

    def is_private(self, request_id: str) -> bool:
        return request_id in self._private_from

    def forget(self, request_id: str) -> None:
        """The request finished: its entries stay private in the cache; only our record goes."""
        self._private_from.pop(request_id, None)
