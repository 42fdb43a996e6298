"""Reuse-quality tasks: a shared segment after differing private prefixes, then a cue to copy.

Each task is one shared segment (a chunk of a source file) read by a group of requests. Request
``i`` is ``prefix_i + segment + cue_i``: its own private prefix (a chunk of *another* file), the
shared segment, and a cue — a few consecutive segment tokens quoted again. The true continuation
is the segment tokens that followed the cue, so it is predictable only by reading back into the
segment: exactly the attention that stale (position-shifted, prefix-blind) reused KV can damage.

Everything here is token ids; `tasks_from_files` takes the tokenizer as a plain ``encode``
function, so the module needs neither transformers nor a model.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

import torch

from kmesh_blend.blend import BlendRequest, SegmentUse

__all__ = ["QualityRequest", "QualityTask", "make_tasks", "tasks_from_files"]


@dataclass(frozen=True)
class QualityRequest:
    """One follow-up: ``prefix`` [P] (private), then the task's segment, then ``cue`` [Q]
    (private); ``continuation`` [K] is the true text after the prompt. All int64."""

    prefix: torch.Tensor
    cue: torch.Tensor
    continuation: torch.Tensor


@dataclass(frozen=True)
class QualityTask:
    """A shared ``segment`` [S] int64 and the requests that reuse it (a sibling group)."""

    segment: torch.Tensor
    requests: tuple[QualityRequest, ...]
    segment_id: str = "segment"

    def prompt(self, i: int) -> torch.Tensor:
        """Request ``i``'s prompt [P + S + Q] int64: prefix, segment, cue."""
        r = self.requests[i]
        return torch.cat([r.prefix, self.segment, r.cue])

    def blend_request(self, i: int) -> BlendRequest:
        """Request ``i`` with the segment marked as reused at [P, P + S)."""
        start = self.requests[i].prefix.numel()
        use = SegmentUse(start, start + self.segment.numel(), self.segment_id)
        return BlendRequest(self.prompt(i), (use,))


def make_tasks(
    segments: Sequence[torch.Tensor],
    prefix_pool: Sequence[torch.Tensor],
    group_size: int = 4,
    prefix_tokens: tuple[int, int] = (64, 128),
    cue_tokens: int = 8,
    continuation_tokens: int = 16,
    seed: int = 0,
) -> list[QualityTask]:
    """Build one task per segment ([S_j] int64 each, S_j > cue + continuation + 8).

    Prefixes are random windows (length uniform in ``prefix_tokens``, inclusive) of random
    texts of ``prefix_pool`` ([N_k] int64 each, N_k ≥ the upper length); each request quotes a
    cue at its own random place in the segment (never in its first 8 tokens, so the cue is
    not the segment's opening) and continues with the K tokens that followed it there.
    """
    gen = torch.Generator().manual_seed(seed)
    lo, hi = prefix_tokens
    need = cue_tokens + continuation_tokens
    tasks = []
    for j, segment in enumerate(segments):
        if segment.numel() <= need + 8:
            raise ValueError(f"segment {j} has {segment.numel()} tokens, needs > {need + 8}")
        requests = []
        for _ in range(group_size):
            text = prefix_pool[_randint(gen, 0, len(prefix_pool) - 1)]
            length = _randint(gen, lo, hi)
            if text.numel() < length:
                raise ValueError(f"a prefix text has {text.numel()} tokens, needs {length}")
            start = _randint(gen, 0, text.numel() - length)
            cue = _randint(gen, 8, segment.numel() - need)
            requests.append(
                QualityRequest(
                    prefix=text[start : start + length].clone(),
                    cue=segment[cue : cue + cue_tokens].clone(),
                    continuation=segment[cue + cue_tokens : cue + need].clone(),
                )
            )
        tasks.append(QualityTask(segment.clone(), tuple(requests), f"segment-{j}"))
    return tasks


def tasks_from_files(
    encode: Callable[[str], list[int]],
    files: Sequence[Path],
    num_tasks: int,
    segment_tokens: int = 384,
    group_size: int = 4,
    continuation_tokens: int = 16,
    seed: int = 0,
) -> list[QualityTask]:
    """Tasks over source files: segments are ``segment_tokens``-long chunks of the first
    ``num_tasks`` usable files (at a seeded offset), prefixes come from the files after them.

    ``encode``: text → token ids (no special tokens). Other arguments as in `make_tasks`.
    """
    gen = torch.Generator().manual_seed(seed)
    texts = []
    for path in files:
        ids = torch.tensor(encode(path.read_text(encoding="utf-8", errors="replace")))
        if ids.numel() >= segment_tokens + 1:  # long enough for a segment and for any prefix
            texts.append(ids.to(torch.int64))
        if len(texts) >= 2 * num_tasks:
            break
    if len(texts) < num_tasks + 1:
        raise ValueError(f"only {len(texts)} files of ≥ {segment_tokens + 1} tokens")
    segments = []
    for ids in texts[:num_tasks]:
        start = _randint(gen, 0, ids.numel() - segment_tokens)
        segments.append(ids[start : start + segment_tokens])
    return make_tasks(
        segments,
        texts[num_tasks:],
        group_size=group_size,
        continuation_tokens=continuation_tokens,
        seed=seed,
    )


def _randint(gen: torch.Generator, lo: int, hi: int) -> int:
    """Uniform integer in [lo, hi] (inclusive) from ``gen``."""
    return int(torch.randint(lo, hi + 1, (), generator=gen))
