"""What memory buys: whether requests wait for KV blocks, and what more of them in flight gain.

`waits_for_blocks` is the scheduler side's signal that memory is short. The speed guard
(`kmesh_blend.vllm.speed_guard`) weighs the blocks sharing gives back against what the cascade
path costs. With the pool full, blocks given back admit more requests, but a step that carries
their tokens takes longer by their tokens' time; what more requests in flight gain is the part
of a step that does not grow with its tokens (reading the weights once for the batch,
launching, the scheduler's share), spread over more of them. `StepFit` estimates that part from
the engine's own recent steps: on a GPU a decode step is mostly that part; on a CPU whose steps
carry prefill chunks, little of it. Plain Python.
"""

from __future__ import annotations

from collections import deque

__all__ = ["FIT", "LEAST", "StepFit", "waits_for_blocks"]

FIT = 256  # engine steps in the fit
LEAST = 16  # steps before a fit is given


def waits_for_blocks(needs: list[int], block_size: int, budget: int, free: int) -> bool:
    """Whether a request the scheduler asked about and then did not admit waits for KV blocks:
    ``needs`` its tokens not yet computed, its next chunk at most ``budget`` tokens (vLLM's
    batched-token budget), ``free`` the blocks vLLM's pool can hand out."""
    return any(-(-min(n, budget) // block_size) > free for n in needs if n > 0)


class StepFit:
    """The last `FIT` engine steps' (tokens computed, forward seconds), with running sums: a fit
    costs the same few operations however many steps it holds (it is read every step)."""

    def __init__(self) -> None:
        self.steps: deque[tuple[int, float]] = deque()
        self._sums = [0.0] * 4  # Σtokens, Σseconds, Σtokens², Σtokens·seconds

    def add(self, tokens: int, seconds: float) -> None:
        if tokens <= 0 or seconds <= 0:
            return
        self.steps.append((tokens, seconds))
        self._move(tokens, seconds, 1)
        if len(self.steps) > FIT:
            self._move(*self.steps.popleft(), -1)

    def _move(self, tokens: int, seconds: float, sign: int) -> None:
        for i, term in enumerate((tokens, seconds, tokens * tokens, tokens * seconds)):
            self._sums[i] += sign * term

    @property
    def fixed_share(self) -> float | None:
        """The share of a step's time that does not grow with its tokens: the intercept of the
        least-squares line of seconds against tokens, over their mean seconds, within [0, 1]
        (None: fewer than `LEAST` steps, or all of one size)."""
        n = len(self.steps)
        if n < LEAST:
            return None
        sum_t, sum_s, sum_tt, sum_ts = self._sums
        spread = sum_tt - sum_t * sum_t / n
        if spread <= 1e-9 * max(1.0, sum_tt):  # (running sums: rounding, not spread)
            return None
        slope = (sum_ts - sum_t * sum_s / n) / spread
        mean_s = sum_s / n
        return min(1.0, max(0.0, (mean_s - slope * sum_t / n) / mean_s))
