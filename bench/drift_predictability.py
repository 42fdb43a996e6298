"""Can a stale row's own error be predicted? The per-token part of drift, measured on SmolLM2.

`bench/beyond_selection.py` found that after the best segment-wide (or per-position) shift, what
limits reuse quality at ratio 0.15 is per token: each stale row moves its own way. The one
per-token signal a blend has for free is a row's deviation at the check layer, where every
candidate row is computed fresh. This script asks whether it predicts the row's deviation at the
later layers, where the row stays stale.

Same tasks as `bench/quality.py --model smollm2` (fp32 engine, the blend's `VllmModel`). Per
follow-up: every reused row's deviation (full prefill − re-positioned master; keys in RoPE's
unrotated frame) at the check layer (the feature, keys and values per KV head: [n, Hkv, 2·D]) and
at every later layer (the target, [n, Hkv, D] each for K and V); the 15 % of rows deviating most
at the check layer are the recomputed rows, the rest stale. Printed, per method: the share of the
stale rows' squared error it removes (keys, values; summed over later layers and heads):

- ``oracle segment mean``: the stale rows' own true mean deviation (per follow-up and head):
  the best any shift shared by the rows can do;
- ``drift share``: the recomputed rows' mean scaled by the share α the stale rows had of it at
  the check layer (what ``kmesh.drift_correction: auto`` estimates);
- ``other tasks' mean shift``: the mean deviation of every reused row of the *other* tasks (leave
  one task out), per layer and head — a shift that belongs to the model, not the prompt;
- ``per-token map, own rows λ``: a ridge map (feature → target, per layer and head) fit on the
  follow-up's own recomputed rows;
- ``per-token map, other tasks λ``: the same map fit on every reused row of the *other* tasks
  (leave one task out): a property of the model, if there is one to learn;
- ``per-token map, in-sample λ``: fit on the very stale rows it is scored on — an upper bound
  that overfits (about 130 features per head for a few hundred rows).

Run: python bench/drift_predictability.py [--quick] [--check N]   (--quick: 2 of the 8 tasks)
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _stale_rows import smollm2_tasks

from kmesh_blend.blend.drift import _share  # drift auto's α, the very function

RATIO = 0.15
LAMBDAS = (0.01, 0.1, 1.0)  # ridge strength, relative to the features' mean variance
MAP_LAMBDA = 0.1  # the strength `calibrated_maps` fits with (the best for values on other tasks)


def moments(x: torch.Tensor, y: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """([f+1, f+1], [f+1, o]): [x, 1]ᵀ[x, 1] and [x, 1]ᵀy, for ``x`` [n, f] and ``y`` [n, o]
    (summed over sets of rows, they fit one map to all of them)."""
    x1 = torch.cat([x, torch.ones(x.shape[0], 1, dtype=x.dtype)], 1)
    return x1.T @ x1, x1.T @ y


def ridge(stats: tuple[torch.Tensor, torch.Tensor], lam: float) -> torch.Tensor:
    """[f+1, o] fp32 affine map minimising ‖[x, 1] W − y‖² + λ·mean(diag(XᵀX))·‖W‖², from
    `moments` of the rows it is fit on."""
    a, b = stats
    a = a + lam * a.diagonal().mean() * torch.eye(a.shape[0], dtype=a.dtype)
    return torch.linalg.solve(a, b)


def apply_map(w: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    """[n, o]: the affine map ``w`` ([f+1, o]) applied to ``x`` ([n, f])."""
    return x @ w[:-1] + w[-1]


def collect(model: Any, tasks: list[Any], check: int) -> list[list[dict[str, Any]]]:
    """Per task, per follow-up: ``feat`` [n, H, 2D], ``kept`` / ``stale`` row indices and ``dev``
    {layer: ([n, H, D] K, [n, H, D] V)} for every layer after ``check``."""
    from kmesh_blend.blend import BlendOptions, blend_group
    from kmesh_blend.models.layerwise import prefill
    from kmesh_blend.quality.chat_harness import masters

    plain = BlendOptions(recompute_ratio=0.0, check_layers=(1,))
    out = []
    for task in tasks:
        source, rows = masters(model, task), []
        for prompt in task.requests:
            request = prompt.blend_request()
            full = prefill(model, request.token_ids, last_only=True)
            stale = blend_group(model, [request], source, plain)[0]
            idx = request.reused_mask.nonzero().squeeze(1)

            def dev(layer: int, idx: torch.Tensor = idx, full: Any = full, st: Any = stale) -> Any:
                dk = (full.keys[layer][idx] - st.keys[layer][idx]).float()
                return model.rope.apply(dk, -idx), (
                    full.values[layer][idx] - st.values[layer][idx]
                ).float()

            ck, cv = dev(check)
            order = (ck.pow(2).sum((1, 2)) + cv.pow(2).sum((1, 2))).argsort(descending=True)
            m = max(1, round(RATIO * idx.numel()))
            rows.append({"feat": torch.cat([ck, cv], -1), "check": (ck, cv), "kept": order[:m],
                         "stale": order[m:],
                         "dev": {n: dev(n) for n in range(check + 1, len(full.keys))}})  # fmt: skip
        out.append(rows)
    return out


def task_moments(data: list[list[dict[str, Any]]]) -> list[dict[tuple[int, int, int], Any]]:
    """Per task, per (layer, 0 = K / 1 = V, head): the `moments` of all its reused rows."""
    heads = data[0][0]["feat"].shape[1]
    return [
        {
            (layer, kv, h): _summed(
                moments(f["feat"][:, h], f["dev"][layer][kv][:, h]) for f in rows
            )
            for layer in rows[0]["dev"]
            for kv in (0, 1)
            for h in range(heads)
        }
        for rows in data
    ]


def calibrated_maps(
    per_task: list[dict[tuple[int, int, int], Any]], skip: int, mean_only: bool = False,
) -> dict[int, tuple[torch.Tensor, torch.Tensor]]:  # fmt: skip
    """{layer: (K map, V map), each [Hkv, 2·D + 1, D] fp32}: the per-token maps fit on every
    task's rows but task ``skip``'s (`task_moments`) — a model-level calibration of drift. With
    ``mean_only`` the map is their mean deviation alone (the last row; the others zero)."""
    keys = list(per_task[0])
    fit = {}
    for key in keys:
        a, b = _summed(p[key] for j, p in enumerate(per_task) if j != skip)
        if mean_only:
            fit[key] = torch.zeros_like(b)
            fit[key][-1] = b[-1] / a[-1, -1]
        else:
            fit[key] = ridge((a, b), MAP_LAMBDA)
    heads = 1 + max(h for _, _, h in keys)
    return {
        layer: tuple(torch.stack([fit[(layer, kv, h)] for h in range(heads)]) for kv in (0, 1))
        for layer in sorted({layer for layer, _, _ in keys})
    }


def removed_shares(data: list[list[dict[str, Any]]]) -> dict[str, list[float]]:
    """Method → [share of the stale keys' squared error removed, the values']."""
    acc: dict[str, torch.Tensor] = {}

    def add(name: str, kv: int, target: torch.Tensor, pred: torch.Tensor) -> None:
        got = acc.setdefault(name, torch.zeros(2, 2, dtype=torch.float64))
        base = target.pow(2).sum().item()
        got[kv] += torch.tensor([base - (target - pred).pow(2).sum().item(), base])

    heads = data[0][0]["feat"].shape[1]
    per_task = task_moments(data)
    for t, task in enumerate(data):
        others = {key: _summed(p[key] for j, p in enumerate(per_task) if j != t)
                  for key in per_task[t]}  # fmt: skip
        for f in task:
            kept, stale = f["kept"], f["stale"]
            for layer, pair in f["dev"].items():
                for kv, y in enumerate(pair):
                    check = f["check"][kv]
                    target = y[stale]
                    add("oracle segment mean", kv, target, target.mean(0))
                    alpha = _share(check[kept].mean(0), check[stale].mean(0))
                    add("drift share", kv, target, alpha * y[kept].mean(0))
                    # the other tasks' mean deviation: a shift per layer and head of the model
                    means = [others[(layer, kv, h)] for h in range(heads)]
                    shift = torch.stack([b[-1] / a[-1, -1] for a, b in means])
                    add("other tasks' mean shift", kv, target, shift.expand_as(target))
                    for lam in LAMBDAS:
                        maps = {"own rows": [], "other tasks": [], "in-sample": []}
                        for h in range(heads):
                            x = f["feat"][:, h]
                            fits = {"own rows": moments(x[kept], y[kept, h]),
                                    "other tasks": others[(layer, kv, h)],
                                    "in-sample": moments(x[stale], y[stale, h])}  # fmt: skip
                            for name, stats in fits.items():
                                maps[name].append(apply_map(ridge(stats, lam), x[stale]))
                        for name, preds in maps.items():
                            add(f"per-token map, {name} λ={lam}", kv, target, torch.stack(preds, 1))
    return {name: (got[:, 0] / got[:, 1]).tolist() for name, got in acc.items()}


def _summed(stats: Any) -> tuple[torch.Tensor, torch.Tensor]:
    """Element-wise sums of an iterable of `moments` pairs."""
    pairs = list(stats)
    return sum(p[0] for p in pairs), sum(p[1] for p in pairs)  # type: ignore[return-value]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="2 tasks instead of 8")
    parser.add_argument("--check", type=int, default=1, help="the check layer (default 1)")
    args = parser.parse_args()
    from _common import emit

    from kmesh_blend.quality.report import close

    began = time.perf_counter()
    _, tasks, llm, model = smollm2_tasks(args.quick, (1, 2, 3))
    try:
        data = collect(model, tasks, args.check)
    finally:
        close(llm)
    shares = removed_shares(data)
    for name, (k, v) in shares.items():
        print(f"  {name:36s} keys {k:+.3f}  values {v:+.3f}")
    best = max(v[0] for n, v in shares.items() if "other tasks" in n)
    oracle = shares["oracle segment mean"][0]
    emit({
        "name": "drift_predictability",
        "metric": "stale keys' error removed: best per-token map fit on other tasks / the "
                  "oracle segment mean shift",
        "value": round(best / oracle, 4),
        "unit": "x",
        "quick": args.quick,
        "config": {"model": "SmolLM2-135M-Instruct (fp32)", "ratio": RATIO, "check": args.check,
                   "tasks": len(tasks), "follow_ups": sum(len(t) for t in data),
                   "removed": {n: [round(k, 4), round(v, 4)] for n, (k, v) in shares.items()},
                   "seconds": round(time.perf_counter() - began, 1)},
    })  # fmt: skip


if __name__ == "__main__":
    main()
