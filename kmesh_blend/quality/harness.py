"""Run quality tasks through full prefill and through the blend, setting by setting.

For every task (a shared segment and its group of requests) the reference is the full prefill
of each prompt; each setting (recompute ratio × selection mode) blends the whole group at once
(`blend_group`, ``layer_sync``) reusing the segment's master — the segment prefilled alone at
positions 0..S-1, as it is first stored. Both are scored on the true continuation with the same
teacher-forced read over their KV (`continuation_logits`), and compared position by position:
top-1 agreement, KL(full ‖ blended), perplexity of the truth, and bit-identity.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import NamedTuple

import torch

from kmesh_blend.blend import (
    BlendOptions,
    DenseSegmentSource,
    SegmentKV,
    blend_group,
    segment_kv_from_prefill,
)
from kmesh_blend.config import Drift, Selection
from kmesh_blend.models.layerwise import LayerwiseModel, prefill
from kmesh_blend.quality.metrics import Comparison, compare, continuation_logits
from kmesh_blend.quality.tasks import QualityTask, tasks_from_files

__all__ = [
    "RATIOS",
    "SELECTIONS",
    "MasterHook",
    "QualityReport",
    "Setting",
    "SettingResult",
    "default_settings",
    "evaluate",
    "format_table",
    "standard_tasks",
]

RATIOS = (0.0, 0.05, 0.15, 0.3, 1.0)
SELECTIONS: tuple[Selection, ...] = ("per_request", "collective")

# Applied to each segment's master before the blends read it (tests use it to corrupt one).
MasterHook = Callable[[SegmentKV], SegmentKV]


@dataclass(frozen=True)
class Setting:
    """One blend configuration: ``recompute_ratio``, ``selection`` mode, ``sink_tokens`` and
    ``drift`` (`BlendOptions.drift_correction`)."""

    ratio: float
    selection: Selection = "per_request"
    sink_tokens: int = 0
    drift: Drift = "off"

    @property
    def rule(self) -> str:
        """Which rule acts: ``deviation``, ``sink``, ``sink+deviation``, each with ``+drift``
        when drift correction is on, or ``none`` (plain reuse) / ``all`` (ratio 1.0)."""
        if self.ratio >= 1.0:
            return "all"
        if self.sink_tokens:
            rule = "sink+deviation" if self.ratio > 0 else "sink"
        else:
            rule = "deviation" if self.ratio > 0 else "none"
        # Drift correction needs a check layer (a deviation ratio) to act.
        return f"{rule}+drift" if self.drift == "auto" and self.ratio > 0 else rule

    @property
    def label(self) -> str:
        sinks = f" sinks {self.sink_tokens}" if self.sink_tokens else ""
        drift = " drift" if self.drift == "auto" else ""
        return f"{self.selection} {self.ratio:g}{sinks}{drift}"

    def options(self, check_layers: tuple[int, ...]) -> BlendOptions:
        """The blend options of this setting (``layer_sync`` groups)."""
        return BlendOptions(
            recompute_ratio=self.ratio,
            check_layers=check_layers,
            selection=self.selection,
            schedule="layer_sync",
            sink_tokens=self.sink_tokens,
            drift_correction=self.drift,
        )


class SettingResult(NamedTuple):
    """Aggregates over every continuation position of every request of every task.

    agreement: share of positions with the full prefill's top-1 token. kl: mean KL(full ‖
    blended), nats. perplexity: exp(mean NLL) of the true continuation under the blend.
    identical: share of positions whose score rows equal the full prefill's bit for bit.
    recomputed: recomputed / reused tokens, summed over requests.
    """

    setting: Setting
    agreement: float
    kl: float
    perplexity: float
    identical: float
    recomputed: float


class QualityReport(NamedTuple):
    """All settings' results, the full prefill's own perplexity, and the sample sizes."""

    results: list[SettingResult]
    full_perplexity: float
    num_tasks: int
    num_requests: int
    num_positions: int

    def result(self, ratio: float, selection: Selection = "per_request") -> SettingResult:
        """The result of one setting (ValueError if it was not evaluated)."""
        for r in self.results:
            if r.setting == Setting(ratio, selection):
                return r
        raise ValueError(f"setting ({ratio}, {selection!r}) was not evaluated")


def default_settings(
    ratios: Sequence[float] = RATIOS, selections: Sequence[Selection] = SELECTIONS
) -> list[Setting]:
    """Every ratio under every selection mode (selection-major)."""
    return [Setting(r, s) for s in selections for r in ratios]


@torch.no_grad()
def evaluate(
    model: LayerwiseModel,
    tasks: Sequence[QualityTask],
    settings: Sequence[Setting] | None = None,
    check_layers: tuple[int, ...] = (1,),
    master_hook: MasterHook | None = None,
) -> QualityReport:
    """Score every setting on every task against full prefill (see the module docstring)."""
    settings = default_settings() if settings is None else list(settings)
    full_rows: list[list[torch.Tensor]] = []
    full_nll: list[torch.Tensor] = []
    for task in tasks:
        rows = []
        for i, req in enumerate(task.requests):
            ref = prefill(model, task.prompt(i), last_only=True)
            rows.append(
                continuation_logits(model, ref.keys, ref.values, ref.logits, req.continuation)
            )
            full_nll.append(compare(rows[-1], rows[-1], req.continuation).nll)
        full_rows.append(rows)
    masters = [segment_kv_from_prefill(model, task.segment) for task in tasks]
    if master_hook is not None:
        masters = [master_hook(m) for m in masters]

    results = []
    for setting in settings:
        options = setting.options(check_layers)
        parts: list[Comparison] = []
        num_reused = num_recomputed = 0
        for task, rows, master in zip(tasks, full_rows, masters, strict=True):
            source = DenseSegmentSource({task.segment_id: master})
            requests = [task.blend_request(i) for i in range(len(task.requests))]
            blended = blend_group(model, requests, source, options)
            for req, out, row in zip(task.requests, blended, rows, strict=True):
                assert out.logits is not None  # whole-prompt blends: the last token's output
                scores = continuation_logits(
                    model, out.keys, out.values, out.logits, req.continuation
                )
                parts.append(compare(row, scores, req.continuation))
                num_reused += out.num_reused
                num_recomputed += out.num_recomputed
        merged = Comparison(*(torch.cat(field) for field in zip(*parts, strict=True)))
        results.append(
            SettingResult(
                setting=setting,
                agreement=float(merged.agree.float().mean()),
                kl=float(merged.kl.mean()),
                perplexity=math.exp(float(merged.nll.mean())),
                identical=float(merged.identical.float().mean()),
                recomputed=num_recomputed / max(1, num_reused),
            )
        )
    nll = torch.cat(full_nll)
    return QualityReport(
        results=results,
        full_perplexity=math.exp(float(nll.mean())),
        num_tasks=len(tasks),
        num_requests=sum(len(t.requests) for t in tasks),
        num_positions=nll.numel(),
    )


def format_table(report: QualityReport) -> str:
    """A plain-text table: one row per setting, full prefill's perplexity in the header."""
    lines = [
        f"{report.num_tasks} tasks, {report.num_requests} requests, "
        f"{report.num_positions} continuation positions; "
        f"full-prefill perplexity {report.full_perplexity:.3f}",
        f"{'selection':<12} {'ratio':>5} {'recomp':>6} {'agree':>7} {'KL':>9} "
        f"{'ppl':>7} {'bit-id':>6}",
    ]
    for r in report.results:
        lines.append(
            f"{r.setting.selection:<12} {r.setting.ratio:>5.2f} {r.recomputed:>6.3f} "
            f"{r.agreement:>7.4f} {r.kl:>9.2e} {r.perplexity:>7.3f} {r.identical:>6.3f}"
        )
    return "\n".join(lines)


def standard_tasks(
    num_tasks: int,
    segment_tokens: int = 384,
    group_size: int = 4,
    continuation_tokens: int = 16,
    seed: int = 0,
) -> list[QualityTask]:
    """Tasks over the standard library files the quality model never trained on, tokenized by
    the model's own tokenizer (`kmesh_blend.testing.quality`: the repository's test fixtures,
    not in the wheel; elsewhere build tasks with `tasks_from_files`)."""
    from tokenizers import Tokenizer

    try:
        from kmesh_blend.testing.quality import held_out_files, quality_model_dir
    except ImportError as exc:
        raise RuntimeError(
            "standard_tasks needs the repository's committed quality model (kmesh_blend.testing, "
            "not shipped in the wheel); build tasks from your own files with tasks_from_files"
        ) from exc

    tokenizer = Tokenizer.from_file(str(quality_model_dir() / "tokenizer.json"))

    def encode(text: str) -> list[int]:
        return list(tokenizer.encode(text, add_special_tokens=False).ids)

    return tasks_from_files(
        encode,
        held_out_files(),
        num_tasks,
        segment_tokens=segment_tokens,
        group_size=group_size,
        continuation_tokens=continuation_tokens,
        seed=seed,
    )
