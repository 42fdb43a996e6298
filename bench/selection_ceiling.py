"""How good can 15 % selection get on the real model? Oracle selections against the deviation rule.

The real-model quality goal (top-1 agreement ≥ 0.99 at recompute ratio 0.15, `bench/quality.py
--model smollm2`) asks which tokens to recompute. This bench gives the selection knowledge no
serving rule has — the full prefill of the very prompt — and measures what the best-informed
choices reach at the same token count. Every choice recomputes 15 % of a request's reused tokens
(ranked across its documents, as the default rule does) and runs through the same executor
(`RequestBlend`); only the score that ranks the candidates differs:

- ``deviation``: the default rule (fresh vs stored keys at check layers 1–3, gradual filtering);
- ``oracle K`` / ``oracle V``: the stored rows' true distance from the full prefill's, summed over
  all 30 layers (each layer's squared distance over its mean squared norm);
- ``oracle attention``: the attention the full prefill's post-document tokens (question, headers,
  the assistant turn) pay each document token, summed over layers and heads;
- ``oracle attention × V``: both;
- ``drift auto``: the default rule with the stale rows' drift corrected (`kmesh.drift_correction:
  auto`): not a selection, the method beyond selection the engine ships, against the ceiling.

Besides each row's agreement ± its standard error, each row's difference from the deviation
rule on the same answer positions ± its paired standard error (clustered by task), and drift
auto's paired differences (agreement, KL) from the best oracle.

Same tasks, references and metrics as `bench/quality.py --model smollm2` (fp32 engine, the
blend's `VllmModel`). `make bench` keeps its result line in
bench/results/selection_ceiling.json.

Run: python bench/selection_ceiling.py [--quick | --tasks N]   (2 tasks; the first N, 8 by default)
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
import time
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _stale_rows import run_on_stale, smollm2_tasks

from kmesh_blend.blend import BlendOptions, BlendRequest, RequestBlend, blend_group
from kmesh_blend.models.layerwise import LayerwiseModel, causal_mask
from kmesh_blend.quality.metrics import compare, continuation_logits

RATIO = 0.15


class _Ranked(RequestBlend):
    """A request blend whose (single) check layer ranks candidates by a given score [T] fp32
    instead of their deviation."""

    def __init__(self, model: LayerwiseModel, request: BlendRequest, score: torch.Tensor) -> None:
        super().__init__(model, request, BlendOptions(recompute_ratio=RATIO, check_layers=(1,)))
        self.score = score

    def _score(self, k: Any, v: Any, stored_k: Any, stored_v: Any) -> torch.Tensor:
        return self.score[self.computed]


def _distance(full: list[torch.Tensor], stale: list[torch.Tensor]) -> torch.Tensor:
    """[T] Σ over layers of each row's squared distance over the layer's mean squared norm."""
    out = torch.zeros(full[0].shape[0])
    for a, b in zip(full, stale, strict=True):
        out += (a - b).float().pow(2).sum((1, 2)) / a.float().pow(2).sum((1, 2)).mean()
    return out


@torch.no_grad()
def _full_prefill(
    model: LayerwiseModel, request: BlendRequest
) -> tuple[list[torch.Tensor], list[torch.Tensor], torch.Tensor]:
    """The request's full prefill (`prefill`'s steps): per layer keys and values [T, Hkv, D],
    and [T] the attention the tokens after the last document pay each token, summed over
    layers and heads."""
    ids = request.token_ids
    pos = torch.arange(ids.numel())
    after = request.uses[-1].end
    mask = causal_mask(pos, pos)
    hidden = model.embed(ids)
    mass = torch.zeros(ids.numel())
    keys, values = [], []
    for layer in range(model.shape.num_layers):
        q, k, v = model.project_qkv(layer, hidden)
        q, k = model.rotate_qk(layer, q, k, pos)
        keys.append(k)
        values.append(v)
        qs = q[after:].float()
        ks = k.float().repeat_interleave(q.shape[1] // k.shape[1], dim=1)
        scores = torch.einsum("nhd,thd->hnt", qs, ks) / qs.shape[-1] ** 0.5
        scores = scores.masked_fill(~mask[after:][None], float("-inf"))
        mass += scores.softmax(-1).sum((0, 1))
        hidden = model.finish_layer(layer, hidden, model.attend(q, k, v, mask))
    return keys, values, mass


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="2 tasks instead of --tasks")
    parser.add_argument("--tasks", type=int, default=8, help="chat tasks, 4 follow-ups each")
    args = parser.parse_args()
    from _common import emit
    from quality import SMOLLM2_CHECKS

    from kmesh_blend.quality.chat_harness import masters, references
    from kmesh_blend.quality.report import ANSWER_TOKENS, close

    began = time.perf_counter()
    tokenizer, tasks, llm, model = smollm2_tasks(args.quick, SMOLLM2_CHECKS, args.tasks)
    oracles = ("oracle K", "oracle V", "oracle attention", "oracle attention × V")
    rules = ("deviation", *oracles, "drift auto")
    parts: dict[str, list[Any]] = {rule: [] for rule in rules}
    kinds: list[str] = []
    try:
        stop = (int(tokenizer.eos_token_id),)
        refs = references(model, tasks, ANSWER_TOKENS, None, stop)
        for j, (task, task_refs) in enumerate(zip(tasks, refs, strict=True)):
            source = masters(model, task)
            requests = [r.blend_request() for r in task.requests]
            options = BlendOptions(recompute_ratio=RATIO, check_layers=SMOLLM2_CHECKS)
            default = blend_group(model, requests, source, options)
            drift = dataclasses.replace(options, drift_correction="auto")
            drifted = blend_group(model, requests, source, drift)
            plain = BlendOptions(recompute_ratio=0.0, check_layers=(1,))
            rows_of = zip(task.requests, requests, task_refs, default, drifted, strict=True)
            for prompt, request, ref, out, corrected in rows_of:
                kinds.append(prompt.kind)
                stale = blend_group(model, [request], source, plain)[0]
                keys, values, mass = _full_prefill(model, request)
                k_dist = _distance(keys, stale.keys)
                v_dist = _distance(values, stale.values)
                scores = {"oracle K": k_dist, "oracle V": v_dist, "oracle attention": mass,
                          "oracle attention × V": mass * v_dist}  # fmt: skip
                outs = {"deviation": out, "drift auto": corrected}
                for rule, score in scores.items():
                    outs[rule] = run_on_stale(_Ranked(model, request, score), stale)
                for rule, res in outs.items():
                    if res.num_recomputed != out.num_recomputed:
                        raise SystemExit(f"{rule} recomputed {res.num_recomputed} tokens, "
                                         f"the default rule {out.num_recomputed}")  # fmt: skip
                    rows = continuation_logits(model, res.keys, res.values, res.logits, ref.answer)
                    parts[rule].append((j, compare(ref.rows, rows, ref.answer)))
            print(f"[{time.perf_counter() - began:5.0f} s] task {j + 1}/{len(tasks)}", flush=True)
    finally:
        close(llm)
    table = [_row(rule, parts[rule], kinds, parts["deviation"]) for rule in rules]
    for row in table:
        print(f"  {row['rule']:22s} top-1 agreement {row['agreement']:.4f} ± "
              f"{row['agreement_se']:.4f} ({row['vs_deviation']:+.4f} ± "
              f"{row['vs_deviation_se']:.4f} paired, vs deviation), KL {row['kl']:.2e}, "
              f"identical answers {row['identical_answers']:.3f}")  # fmt: skip
    best = max(table[1:-1], key=lambda r: r["agreement"])
    past = _paired(parts["drift auto"], parts[best["rule"]])
    past_kl = _paired(parts["drift auto"], parts[best["rule"]], "kl")
    print(f"  drift auto − {best['rule']} (paired): agreement {past[0]:+.4f} ± {past[1]:.4f}, "
          f"KL {past_kl[0]:+.2e} ± {past_kl[1]:.2e}")  # fmt: skip
    result = {
        "name": "selection_ceiling",
        "metric": "top-1 agreement at ratio 0.15: best oracle selection / the deviation rule",
        "value": round(best["agreement"] / table[0]["agreement"], 4),
        "unit": "x",
        "quick": args.quick,
        "config": {"model": "SmolLM2-135M-Instruct (fp32)", "ratio": RATIO,
                   "tasks": len(tasks), "follow_ups": len(parts["deviation"]),
                   "positions": sum(p.agree.numel() for _, p in parts["deviation"]),
                   "best_oracle": best["rule"], "table": table,
                   "drift_auto_vs_best_oracle": {"agreement": [round(past[0], 4),
                                                               round(past[1], 4)],
                                                 "kl": [float(f"{x:.3g}") for x in past_kl]},
                   "seconds": round(time.perf_counter() - began, 1)},
    }  # fmt: skip
    emit(result)


def _paired(parts: list[Any], base: list[Any], of: str = "agree") -> tuple[float, float]:
    from kmesh_blend.quality.chat_harness import paired_difference

    clusters = [j for j, _ in parts]
    return paired_difference([p for _, p in parts], [p for _, p in base], clusters, of)


def _row(rule: str, parts: list[Any], kinds: list[str], base: list[Any]) -> dict[str, Any]:
    from kmesh_blend.quality import Setting
    from kmesh_blend.quality.chat_harness import aggregate

    comparisons, clusters = [p for _, p in parts], [j for j, _ in parts]
    r = aggregate(Setting(RATIO), comparisons, kinds, clusters, RATIO, 0.0)
    gain, gain_se = _paired(parts, base)
    return {
        "rule": rule,
        "agreement": round(r.agreement, 4),
        "agreement_se": round(r.agreement_se, 4),
        "vs_deviation": round(gain, 4),
        "vs_deviation_se": round(gain_se, 4),
        "kl": float(f"{r.kl:.4g}"),
        "kl_se": float(f"{r.kl_se:.3g}"),
        "identical_answers": round(r.identical_answers, 4),
    }


if __name__ == "__main__":
    main()
