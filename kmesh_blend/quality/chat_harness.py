"""Score multi-document chat tasks (`kmesh_blend.quality.chat`) against full prefill.

Per task: each document's master is its reader prompt's KV for the document's rows (what the
first reader stores in serving: keys rotated at the reader's positions). Per follow-up: the full
prefill of its prompt and its greedy answer of at most ``answer_tokens`` tokens (it ends after
an end-of-turn token, as a served answer does). Per setting (rule ×
ratio × selection), the family is blended as one layer-synchronous group, and blended and full
prefill are scored teacher-forced over the full prefill's answer (`continuation_logits`):

- agreement: share of all answer positions with the same top-1 token;
- KL: mean KL(full ‖ blended) over all answer positions, nats;
- identical answers: share of follow-ups whose top-1 agrees at every answer position — with
  the same top-1 everywhere, greedy decoding of the blended KV gives the full prefill's answer
  (exactly so where the full prefill's teacher-forced top-1 is its greedy token at every
  position; ``ChatReport.reference_flips`` counts the positions where it is not: near-ties);
- answer prefix: mean share of an answer before its first disagreement.

Standard errors are clustered by task: a family's follow-ups share documents and one group blend,
so neither positions nor follow-ups are independent. They are the standard deviation of the
per-task values over √(tasks).

Runs on any `LayerwiseModel`; `bench/quality.py --model smollm2` runs it on the model a serving
vLLM engine loaded (the blend's own `VllmModel`).
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Sequence
from typing import NamedTuple

import torch

from kmesh_blend.blend import DenseSegmentSource, SegmentKV, blend_group
from kmesh_blend.models.layerwise import LayerwiseModel, prefill
from kmesh_blend.quality.chat import ChatTask
from kmesh_blend.quality.harness import Setting
from kmesh_blend.quality.metrics import Comparison, compare, continuation_logits, greedy

__all__ = [
    "ChatReport",
    "ChatResult",
    "Reference",
    "aggregate",
    "evaluate_chat",
    "full_prefill_agreement",
    "near_ties",
    "paired_difference",
    "references",
]


class Reference(NamedTuple):
    """A follow-up's full prefill: its greedy ``answer`` [N] int64 and the teacher-forced score
    rows over it, ``rows`` [N, V] fp32."""

    answer: torch.Tensor
    rows: torch.Tensor


class ChatResult(NamedTuple):
    """One setting's aggregates (see the module docstring); ``*_se``: standard errors.
    ``recomputed``: recomputed / reused tokens; ``blend_s``: mean blend wall time per family."""

    setting: Setting
    agreement: float
    agreement_se: float
    kl: float
    kl_se: float
    identical_answers: float
    answer_prefix: float
    recomputed: float
    blend_s: float
    agreement_by_kind: dict[str, float]  # per question kind (`kmesh_blend.quality.chat`)


class ChatReport(NamedTuple):
    results: list[ChatResult]
    num_tasks: int
    num_requests: int
    num_positions: int
    documents: list[int]  # documents per follow-up
    reference_flips: int  # answer positions whose full-prefill top-1 is not the greedy token

    def result(self, setting: Setting) -> ChatResult:
        for r in self.results:
            if r.setting == setting:
                return r
        raise ValueError(f"setting {setting.label!r} was not evaluated")


def masters(model: LayerwiseModel, task: ChatTask) -> DenseSegmentSource:
    """Each document's stored KV, taken from its reader's full prefill."""
    source = DenseSegmentSource()
    for reader in task.readers:
        ((start, end, name),) = reader.spans
        full = prefill(model, reader.blend_request().token_ids, last_only=True)
        keys = torch.stack([k[start:end] for k in full.keys])
        values = torch.stack([v[start:end] for v in full.values])
        source.add(name, SegmentKV(keys, values, torch.arange(start, end)))
    return source


@torch.no_grad()
def references(
    model: LayerwiseModel, tasks: Sequence[ChatTask], answer_tokens: int = 32,
    progress: Callable[[str], None] | None = None, stop_ids: tuple[int, ...] = (),
) -> list[list[Reference]]:  # fmt: skip
    """Every follow-up's full prefill, greedy answer (at most ``answer_tokens``, ending after a
    token of ``stop_ids``) and score rows (per task, per follow-up)."""
    out = []
    for j, task in enumerate(tasks):
        refs = []
        for request in task.requests:
            full = prefill(model, request.blend_request().token_ids, last_only=True)
            answer = greedy(model, full.keys, full.values, full.logits, answer_tokens, stop_ids)
            rows = continuation_logits(model, full.keys, full.values, full.logits, answer)
            refs.append(Reference(answer, rows))
        out.append(refs)
        if progress is not None:
            progress(f"full prefill and answers: task {j + 1}/{len(tasks)}")
    return out


@torch.no_grad()
def evaluate_chat(
    model: LayerwiseModel,
    tasks: Sequence[ChatTask],
    settings: Sequence[Setting],
    check_layers: tuple[int, ...],
    answer_tokens: int = 32,
    progress: Callable[[str], None] | None = None,
    refs: list[list[Reference]] | None = None,
    stop_ids: tuple[int, ...] = (),
) -> ChatReport:
    """Score every setting on every task against full prefill (see the module docstring).
    ``refs``: the tasks' `references`, when already computed (they do not depend on settings).
    ``stop_ids``: end-of-turn tokens; an answer ends after one."""
    if refs is None:
        refs = references(model, tasks, answer_tokens, progress, stop_ids)
    sources = [masters(model, task) for task in tasks]
    results = []
    for n, setting in enumerate(settings):
        options = setting.options(check_layers)
        parts: list[Comparison] = []
        kinds: list[str] = []
        clusters: list[int] = []
        reused = recomputed = 0
        seconds = 0.0
        for j, (task, source, task_refs) in enumerate(zip(tasks, sources, refs, strict=True)):
            start = time.perf_counter()
            blended = blend_group(
                model, [r.blend_request() for r in task.requests], source, options
            )
            seconds += time.perf_counter() - start
            for out, ref, request in zip(blended, task_refs, task.requests, strict=True):
                assert out.logits is not None  # whole-prompt blends: the last token's output
                rows = continuation_logits(model, out.keys, out.values, out.logits, ref.answer)
                parts.append(compare(ref.rows, rows, ref.answer))
                kinds.append(request.kind)
                clusters.append(j)
                reused += out.num_reused
                recomputed += out.num_recomputed
        results.append(aggregate(setting, parts, kinds, clusters, recomputed / max(1, reused),
                                  seconds / len(tasks)))  # fmt: skip
        if progress is not None:
            r = results[-1]
            progress(f"setting {n + 1}/{len(settings)} {setting.label}: agreement "
                     f"{r.agreement:.4f} ± {r.agreement_se:.4f}, KL {r.kl:.2e}, identical "
                     f"answers {r.identical_answers:.3f}")  # fmt: skip
    return ChatReport(
        results,
        num_tasks=len(tasks),
        num_requests=sum(len(t.requests) for t in tasks),
        num_positions=sum(r.answer.numel() for task_refs in refs for r in task_refs),
        documents=[len(r.spans) for t in tasks for r in t.requests],
        reference_flips=sum(
            int((r.rows.argmax(-1) != r.answer).sum()) for task_refs in refs for r in task_refs
        ),
    )


@torch.no_grad()
def full_prefill_agreement(
    model: LayerwiseModel, tasks: Sequence[ChatTask], refs: list[list[Reference]]
) -> ChatResult:
    """Every follow-up's full prefill by ``model`` (say, the same weights in bf16) scored against
    ``refs`` (another engine's full prefill) like a blend: how far the model's own numerics move
    the answers, the floor any blend's agreement is read against. ``setting``: ratio 1.0."""
    parts: list[Comparison] = []
    kinds: list[str] = []
    clusters: list[int] = []
    for j, (task, task_refs) in enumerate(zip(tasks, refs, strict=True)):
        for request, ref in zip(task.requests, task_refs, strict=True):
            full = prefill(model, request.blend_request().token_ids, last_only=True)
            rows = continuation_logits(model, full.keys, full.values, full.logits, ref.answer)
            parts.append(compare(ref.rows, rows.float(), ref.answer))
            kinds.append(request.kind)
            clusters.append(j)
    return aggregate(Setting(1.0), parts, kinds, clusters, 1.0, 0.0)


def near_ties(refs: list[list[Reference]], gaps: Sequence[float]) -> dict[float, float]:
    """Share of answer positions whose reference top-1 leads its top-2 by less than each gap
    (nats of log-probability): the positions a small perturbation flips."""
    rows = torch.cat([r.rows for task_refs in refs for r in task_refs]).log_softmax(-1)
    top = rows.topk(2, dim=-1).values
    lead = top[:, 0] - top[:, 1]
    return {gap: float((lead < gap).float().mean()) for gap in gaps}


def aggregate(
    setting: Setting, parts: list[Comparison], kinds: list[str], clusters: list[int],
    recomputed: float, blend_s: float,
) -> ChatResult:  # fmt: skip
    """One setting's `ChatResult` from its follow-ups' comparisons, their question ``kinds`` and
    task ``clusters`` (for the clustered standard errors)."""
    agree = torch.cat([p.agree for p in parts]).float()
    kl = torch.cat([p.kl for p in parts])
    pairs = zip(parts, clusters, strict=True)
    owner = torch.cat([torch.full((p.agree.numel(),), c) for p, c in pairs])
    prefix = []
    for p in parts:
        wrong = (~p.agree).nonzero()
        prefix.append(1.0 if wrong.numel() == 0 else int(wrong[0]) / p.agree.numel())
    return ChatResult(
        setting=setting,
        agreement=float(agree.mean()),
        agreement_se=_clustered_se(agree, owner),
        kl=float(kl.mean()),
        kl_se=_clustered_se(kl, owner),
        identical_answers=sum(1.0 for p in parts if bool(p.agree.all())) / len(parts),
        answer_prefix=sum(prefix) / len(prefix),
        recomputed=recomputed,
        blend_s=blend_s,
        agreement_by_kind={kind: _share(parts, kinds, kind) for kind in sorted(set(kinds))},
    )


def paired_difference(
    parts: list[Comparison], base: list[Comparison], clusters: list[int], of: str = "agree"
) -> tuple[float, float]:
    """(mean, standard error) of one setting's per-position ``of`` (a `Comparison` field: top-1
    ``agree`` or ``kl``) minus ``base``'s over the same follow-ups' answer positions (both
    teacher-forced on the same references), clustered by task: far tighter than either
    setting's own error, since the tasks' difficulty cancels."""
    pairs = zip(parts, base, strict=True)
    diff = [getattr(a, of).float() - getattr(b, of).float() for a, b in pairs]
    owner = torch.cat([torch.full((d.numel(),), c) for d, c in zip(diff, clusters, strict=True)])
    values = torch.cat(diff)
    return float(values.mean()), _clustered_se(values, owner)


def _share(parts: list[Comparison], kinds: list[str], kind: str) -> float:
    """Top-1 agreement over the answer positions of the follow-ups asking ``kind``."""
    agree = [p.agree for p, k in zip(parts, kinds, strict=True) if k == kind]
    return float(torch.cat(agree).float().mean())


def _clustered_se(values: torch.Tensor, owner: torch.Tensor) -> float:
    """Standard error of the mean of ``values`` [N] fp32 whose entries come in clusters
    (``owner`` [N], cluster ids): the spread of the per-cluster means over √(clusters)."""
    means = torch.stack([values[owner == c].mean() for c in owner.unique()])
    n = means.numel()
    return float(means.std(correction=1)) / math.sqrt(n) if n > 1 else 0.0
