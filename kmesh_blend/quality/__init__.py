"""Reuse quality: how close blended prefill stays to full prefill on a trained model.

Tasks put a shared segment after differing private prefixes and ask for a continuation that only
the segment predicts (`tasks`); the harness scores every recompute ratio and selection mode
against full prefill by top-1 agreement, KL divergence and perplexity (`harness`, `metrics`).
No vLLM: it runs on any `LayerwiseModel`, usually the committed trained model
(`kmesh_blend.testing.quality.quality_model_dir`).
"""

from kmesh_blend.quality.harness import (
    RATIOS,
    SELECTIONS,
    MasterHook,
    QualityReport,
    Setting,
    SettingResult,
    default_settings,
    evaluate,
    format_table,
    standard_tasks,
)
from kmesh_blend.quality.metrics import Comparison, compare, continuation_logits, extend
from kmesh_blend.quality.tasks import QualityRequest, QualityTask, make_tasks, tasks_from_files

__all__ = [
    "RATIOS",
    "SELECTIONS",
    "Comparison",
    "MasterHook",
    "QualityReport",
    "QualityRequest",
    "QualityTask",
    "Setting",
    "SettingResult",
    "compare",
    "continuation_logits",
    "default_settings",
    "evaluate",
    "extend",
    "format_table",
    "make_tasks",
    "standard_tasks",
    "tasks_from_files",
]
