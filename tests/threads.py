"""Run one function in N threads released together (tests of singleflight and shared loads)."""

from __future__ import annotations

import threading
from collections.abc import Callable


def run_together(target: Callable[[int], object], n: int, timeout: float = 30.0) -> list[object]:
    """Start ``n`` threads behind a barrier, each calling ``target(i)``; returns each thread's
    result or the exception it raised, in thread order. Fails if one never finishes."""
    results: list[object] = [None] * n
    barrier = threading.Barrier(n)

    def body(i: int) -> None:
        barrier.wait()
        try:
            results[i] = target(i)
        except BaseException as exc:
            results[i] = exc

    threads = [threading.Thread(target=body, args=(i,)) for i in range(n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=timeout)
    assert not any(t.is_alive() for t in threads), "deadlock: a thread never finished"
    return results
