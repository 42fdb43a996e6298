"""Thin adapters over LMCache 0.5.6 storage backends: put / get / remove one memory object.

Which LMCache classes are used, per ``kmesh.store`` kind:

=========  ==================================================================================
``cpu``    ``LocalCPUBackend`` (``local_cpu=True``): its allocator and hot cache *are* the
           store; LMCache evicts LRU objects when its pool is full.
``disk``   ``LocalDiskBackend`` (files under the path), with a ``LocalCPUBackend``
           (``local_cpu=False``) as the staging allocator LMCache reads into.
``lm``     ``LMCServerConnector`` to a ``python -m lmcache.v1.server HOST PORT cpu`` process.
``redis``  ``RedisConnector`` to a Redis server.
=========  ==================================================================================

Remote connectors are async: they run on one private event loop thread per store. Every
operation has a deadline (``deadline(nbytes)``, from `kmesh_blend.segments.health`); one that
misses it raises `TimeoutError`, and on ``lm://`` its connection is shut down (LMCache's client
reads with blocking calls on the loop thread: shutting the socket down is what frees that
thread). LMCache's ``lm://`` client never reconnects, so an operation that fails on it opens a
new connection and is tried once more (a restarted server is used again at once; one that is
down fails fast). Not used:
``StorageManager`` / ``LMCacheEngine`` (they chunk by LMCache's prefix token hashes and need a
GPU connector; we store whole segments by our own content id), and ``RedisConnector.close`` (it
deadlocks its own loop: we shut its executor down and close its client directly). Every call
here is serialised by the caller (`kmesh_blend.segments.store`).
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import logging
import os
import socket
import threading
import time
from collections.abc import Callable, Coroutine
from typing import Any

import torch

from kmesh_blend.config import StoreSpec
from kmesh_blend.segments.master import MasterLayout

__all__ = ["LMCacheTier", "make_key", "open_tier"]

log = logging.getLogger(__name__)

_CHUNK = 256  # LMCacheMetadata wants a chunk size; we never chunk, objects are whole segments


def make_key(
    prefix: str, segment_hex: str, dtype: torch.dtype, rank: int = 0, world_size: int = 1
) -> Any:
    """LMCache ``CacheEngineKey`` for one object: ``prefix@<world>@<rank>@<segment hex>@<dtype>``.

    The namespace (model, dtype, layout, RoPE, salt) is already inside the segment id, so the
    key's model name is a short fixed prefix (LMCache's wire protocol caps keys at 150 chars).
    ``rank`` / ``world_size``: the tensor-parallel shard the object holds (each rank stores its
    own heads; an engine with another parallel layout never reads them as its own).
    """
    from lmcache.utils import CacheEngineKey

    return CacheEngineKey(prefix, world_size, rank, int(segment_hex, 16), dtype)


class LMCacheTier:
    """One LMCache storage backend seen as a dict of memory objects."""

    def __init__(
        self,
        spec: StoreSpec,
        layout: MasterLayout,
        *,
        cpu_bytes: int,
        disk_bytes: int = 8 << 30,
        deadline: Callable[[int], float] = lambda nbytes: 30.0,
    ) -> None:
        """``deadline(nbytes)``: seconds an operation moving ``nbytes`` may take."""
        from lmcache.v1.config import LMCacheEngineConfig
        from lmcache.v1.metadata import LMCacheMetadata
        from lmcache.v1.storage_backend.local_cpu_backend import LocalCPUBackend

        from kmesh_blend.compat import guard_llvmlite

        guard_llvmlite()  # LMCache loaded llvmlite; keep vLLM's start-up scan working
        self.kind = spec.kind
        self.deadline = deadline
        kwargs: dict[str, Any] = dict(
            chunk_size=_CHUNK,
            local_cpu=spec.kind == "cpu",
            max_local_cpu_size=cpu_bytes / 2**30,
        )
        if spec.kind == "disk":
            kwargs.update(local_disk=spec.path, max_local_disk_size=disk_bytes / 2**30)
        self.config = LMCacheEngineConfig.from_defaults(**kwargs)
        self.metadata = LMCacheMetadata(
            model_name="kmesh",
            world_size=1,
            local_world_size=1,
            worker_id=0,
            local_worker_id=0,
            kv_dtype=layout.torch_dtype(),
            kv_shape=(layout.num_layers, 2, _CHUNK, layout.num_kv_heads, layout.head_dim),
            chunk_size=_CHUNK,
        )
        self.cpu = LocalCPUBackend(self.config, self.metadata, dst_device="cpu")
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None
        self.disk: Any = None
        self.conn: Any = None
        if spec.kind in ("disk", "lm", "redis"):
            self._start_loop()
        if spec.kind == "disk":
            from lmcache.v1.storage_backend.local_disk_backend import LocalDiskBackend

            self.disk = LocalDiskBackend(self.config, self._loop, self.cpu, dst_device="cpu")
        elif spec.kind == "lm":
            self._address = (spec.host, spec.port)
            with contextlib.suppress(OSError):  # down at start: the caller's probe says so
                self.conn = self._connect_lm()
        elif spec.kind == "redis":
            from lmcache.v1.storage_backend.connector.redis_connector import RedisConnector

            url = f"redis://{spec.host}:{spec.port}"
            self.conn = RedisConnector(url, self._loop, self.cpu)

    # -- objects ------------------------------------------------------------------------------

    def allocate(self, shape: tuple[int, ...], dtype: torch.dtype) -> Any:
        """A fresh LMCache ``MemoryObj`` (ref count 1) from the backend's allocator, or None."""
        from lmcache.v1.memory_management import MemoryFormat

        return self.cpu.allocate(torch.Size(shape), dtype, MemoryFormat.KV_2LTD, busy_loop=False)

    def put(self, key: Any, obj: Any) -> None:
        """Store ``obj`` under ``key``; blocks until the backend holds it (or raises
        `TimeoutError` at its deadline). The caller keeps (and must drop) its own reference."""
        if self.kind == "cpu":
            self.cpu.submit_put_task(key, obj)
        elif self.kind == "disk":
            os.makedirs(self.disk.path, exist_ok=True)  # a removed directory is made again
            if self.disk.contains(key):  # LMCache would skip it, though its file may be gone
                with contextlib.suppress(Exception):
                    self.disk.remove(key)
            done = threading.Event()
            self.disk.submit_put_task(key, obj, on_complete_callback=lambda _k: done.set())
            # LMCache skips the write silently (no callback) when the key is already there or
            # being written, or when it does not fit: poll `contains` up to a deadline.
            limit = self.deadline(obj.get_size())
            deadline = time.monotonic() + limit
            while not done.wait(0.005) and not self.disk.contains(key):
                if time.monotonic() > deadline:
                    raise TimeoutError(f"disk write not done within {limit:.2f} s")
        else:
            self._remote(lambda: self.conn.put(key, obj), obj.get_size())

    def get(self, key: Any, nbytes: int = 0) -> Any:
        """The stored object (the caller owns one reference and must drop it), or None.
        ``nbytes``: its expected size, when known (the deadline grows with it)."""
        if self.kind == "cpu":
            return self.cpu.get_blocking(key)
        if self.kind == "disk":
            try:
                return self.disk.get_blocking(key)
            except KeyError:  # its file was gone: LMCache dropped the key, a put writes it again
                return None
        return self._remote(lambda: self.conn.get(key), nbytes)

    def remove(self, key: Any) -> bool:
        """Delete ``key``. ``lm://`` has no delete (the LMCache server never frees anything):
        returns False there. For Redis the two keys ``RedisConnector`` writes are deleted."""
        if self.kind == "cpu":
            return bool(self.cpu.remove(key))
        if self.kind == "disk":
            return bool(self.disk.remove(key))
        if self.kind == "redis":
            name = key.to_string()
            return bool(
                self._run(self.conn.connection.delete(name + "kv_bytes", name + "metadata"))
            )
        return False

    def close(self) -> None:
        if self.conn is not None and self._loop is not None:
            with contextlib.suppress(Exception):  # a store that is down closes what it can
                if self.kind == "redis":
                    self._run(self.conn.pq_executor.shutdown_async(wait=True))
                    self._run(self.conn.connection.aclose())
                else:
                    self._drop_connection()
            self.conn = None
        if self.disk is not None:
            self.disk.close()
            self.disk = None
        if self._loop is not None:
            self._loop.call_soon_threadsafe(self._loop.stop)
            if self._thread is not None:
                self._thread.join(timeout=5)
            self._loop = None
        self.cpu.close()

    # -- remote connections -------------------------------------------------------------------

    def _connect_lm(self) -> Any:
        from lmcache.v1.storage_backend.connector.lm_connector import LMCServerConnector

        host, port = self._address
        # LMCache connects without a timeout: reach the address under our deadline first.
        socket.create_connection((host, port), timeout=self.deadline(0)).close()
        return LMCServerConnector(host, port, self._loop, self.cpu)

    def _remote(self, op: Callable[[], Coroutine[Any, Any, Any]], nbytes: int = 0) -> Any:
        """Run ``op()`` on the connection under its deadline; on ``lm://`` a failure other than
        a missed deadline reopens the connection and retries once."""
        if self.kind == "lm" and self.conn is None:
            self._reopen()
        try:
            return self._run(op(), nbytes)
        except Exception as exc:
            if self.kind != "lm" or isinstance(exc, TimeoutError):
                raise
            log.info("kmesh store lm: %s; reconnecting to %s:%s", str(exc), *self._address)
            self._reopen()
            return self._run(op(), nbytes)

    def _reopen(self) -> None:
        """A fresh ``lm://`` connection; raises (and leaves none) while the server is down."""
        self._drop_connection()
        self.conn = self._connect_lm()

    def _drop_connection(self) -> None:
        old, self.conn = self.conn, None
        if old is not None:
            with contextlib.suppress(Exception):
                old.client_socket.shutdown(socket.SHUT_RDWR)  # frees a blocked read
            with contextlib.suppress(Exception):
                old.client_socket.close()

    # -- event loop ---------------------------------------------------------------------------

    def _start_loop(self) -> None:
        loop = asyncio.new_event_loop()
        self._loop = loop
        self._thread = threading.Thread(
            target=loop.run_forever, name=f"kmesh-{self.kind}-io", daemon=True
        )
        self._thread.start()

    def _run(self, coro: Coroutine[Any, Any, Any], nbytes: int = 0) -> Any:
        assert self._loop is not None
        limit = self.deadline(nbytes)
        future = asyncio.run_coroutine_threadsafe(coro, self._loop)
        try:
            return future.result(limit)
        except concurrent.futures.TimeoutError:
            future.cancel()
            if self.kind == "lm":  # its read blocks the loop thread: free it
                self._drop_connection()
            raise TimeoutError(f"no answer within {limit:.2f} s") from None


def open_tier(spec: StoreSpec, layout: MasterLayout, *, cpu_bytes: int) -> LMCacheTier:
    return LMCacheTier(spec, layout, cpu_bytes=cpu_bytes)
