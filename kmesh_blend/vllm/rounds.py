"""Scheduler side of rounds: one clock per tenant, bounded jumps, announcements until confirmed.

Rounds count per tenant *scope* (`scope_of`: the request's ``cache_salt``), so no request moves
another tenant's round; a request may announce at most ``kmesh.max_round_jump`` past its
tenant's round. The worker's round-aware index (`kmesh_blend.segments.index`) keeps the same
clocks; an announcement is sent with every step until the worker confirms it (a step without a
forward may never reach the worker). Family names are per tenant too (`family_key`).
"""

from __future__ import annotations

import json

from kmesh_blend.vllm.registry import LruDict

__all__ = ["RoundClocks", "family_key", "scope_of"]


def scope_of(cache_salt: object) -> str:
    """The round scope of a request: its tenant, by ``cache_salt`` ("" without)."""
    return f"{cache_salt}\x00" if cache_salt else ""


def family_key(cache_salt: object, family: str) -> str:
    """A family's name inside the engine: the tenant's name for it, unambiguously (JSON)."""
    return json.dumps([str(cache_salt or ""), family])


class RoundClocks:
    """The latest round each scope announced (at most ``capacity`` scopes, least recent out)."""

    def __init__(self, max_jump: int, capacity: int) -> None:
        self.max_jump = max_jump
        self._rounds: LruDict[str, int] = LruDict(capacity)
        self._news: dict[str, int] = {}  # announced, not yet confirmed by the worker

    def now(self, scope: str) -> int | None:
        """``scope``'s round, or None before it announced one."""
        return self._rounds.get(scope)

    def refusal(self, scope: str, round_: int | None) -> str | None:
        """Why ``round_`` is refused for a request of ``scope``, or None."""
        if round_ is None:
            return None
        now = self._rounds.get(scope) or 0
        if round_ <= now + self.max_jump:
            return None
        return (
            f"round refused: round={round_}; valid: at most {now + self.max_jump} (this "
            f"tenant's round {now} + kmesh.max_round_jump {self.max_jump})"
        )

    def announce(self, scope: str, round_: int | None) -> None:
        if round_ is not None and round_ > (self._rounds.get(scope) or 0):
            self._rounds[scope] = self._news[scope] = round_

    def news(self) -> dict[str, int]:
        """Announcements the worker has not confirmed: scope → round."""
        return dict(self._news)

    def applied(self, rounds: dict[str, int]) -> None:
        """The worker's index is at these rounds."""
        for scope_, applied in rounds.items():
            if self._news.get(scope_, applied + 1) <= applied:
                del self._news[scope_]
