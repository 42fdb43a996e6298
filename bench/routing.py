"""Families across two engines behind vLLM's router: family routing vs round robin vs cache-aware.

Workload (tiny Llama, fp32, `kmesh_blend.testing.fleet`): Redis as the shared store, two vLLM
OpenAI servers with KMesh (cascade decode on, ratio 0.15), each pinned to its own core, and
``vllm-router`` in front. 8 families, each over its own 1,024-token document: first one notice per
family (``max_tokens`` 1: it computes and stores the document), all 8 at once; then the 4 members
of every family at once (32 requests, each with its own instructions before the document and its
own question after it), each decoding 32 tokens (``ignore_eos``). Every request carries the same
annotation and the ``X-Session-ID`` header (`Encoded.routed`); only the router's policy changes:

- ``family``: ``sticky_least_loaded`` (the header keeps a family on one engine);
- ``round_robin``: requests alternate between engines;
- ``cache_aware``: vLLM's prefix-aware policy (the members' prompts differ from their first
  token, so it sees nothing in common between them).

The workload runs 3 times per policy (fresh documents and families each time, in the same
fleet). Per policy: storage reads per family (sum of the reports' ``storage_reads`` / families),
master bytes held summed over engines after the first round (``vllm:kmesh_retained_bytes``) / the
documents' KV bytes, the members' decode steps run in cascade (sum of ``cascade_steps`` / decode
steps), and the workload's wall time (notices + members; median of the rounds). value = family
routing's master bytes held / the documents' (goal 1.0); config.wall_vs_round_robin = family
routing's median wall time / round robin's (goal ≤ 1.0). Each policy gets a fresh fleet (≈1 min
to start on 2 cores, not in the wall time). ``--quick``: 4 families, 512-token documents, 16
tokens, one round.

Run: python bench/routing.py [--quick]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import emit, plot_bars, progress

from kmesh_blend.segments.client import Encoded
from kmesh_blend.testing import TINY_LLAMA, build_checkpoint
from kmesh_blend.testing.fleet import Fleet, metric_sum

POLICIES = {"family": "sticky_least_loaded", "round_robin": "round_robin",
            "cache_aware": "cache_aware"}  # fmt: skip
MEMBERS, RATIO = 4, 0.15


def workload(families: int, doc_len: int, seed: int) -> dict[str, list[Encoded]]:
    """Per family: its notice, then its members (the same for the same seed)."""
    gen, vocab = torch.Generator().manual_seed(seed), TINY_LLAMA.vocab_size
    out = {}
    for k in range(families):
        doc = torch.randint(3, vocab, (doc_len,), generator=gen).tolist()
        prompts = []
        for i in range(MEMBERS + 1):
            private = torch.randint(3, vocab, (20 + 7 * i,), generator=gen).tolist()
            question = torch.randint(3, vocab, (12 + i,), generator=gen).tolist()
            prompts.append(
                Encoded(private + doc + question, [(len(private), len(private) + doc_len)])
            )
        out[f"s{seed}-family-{k}"] = prompts
    return out


def run_policy(policy: str, rounds: list[dict[str, list[Encoded]]], tokens: int,
               logs: Path) -> dict[str, Any]:  # fmt: skip
    """One fresh fleet under ``policy``; each round's families run in it one after another."""
    model = str(build_checkpoint(TINY_LLAMA))
    settings = {"recompute_ratio": RATIO, "cascade_decode": True}
    walls, held, notices, reports = [], [0.0, 0.0], [], []
    engines: dict[str, set[str]] = {}
    with Fleet(model, logs / policy, policy=policy, settings=settings) as fleet:

        def send(name: str, enc: Encoded, max_tokens: int) -> dict[str, Any]:
            routed = enc.routed(family=name)
            body = {"model": model, "prompt": enc.token_ids, "max_tokens": max_tokens,
                    "temperature": 0, "ignore_eos": True, **routed.extra_body}  # fmt: skip
            out = fleet.post("/v1/completions", body, routed.headers)
            report = dict(out["kv_transfer_params"]["kmesh"])
            report["tokens"] = out["usage"]["completion_tokens"]
            engines.setdefault(name, set()).add(report["engine"])
            return report

        for r, fams in enumerate(rounds):
            jobs = [(name, enc) for name, members in fams.items() for enc in members[1:]]
            start = time.perf_counter()
            with ThreadPoolExecutor(max_workers=len(jobs)) as pool:
                notices += pool.map(lambda name, f=fams: send(name, f[name][0], 1), fams)
                reports += pool.map(lambda job: send(job[0], job[1], tokens), jobs)
            walls.append(time.perf_counter() - start)
            if r == 0:  # the first round's masters only (later rounds add their own)
                held = [metric_sum(fleet.metrics(i), "vllm:kmesh_retained_bytes") for i in (0, 1)]
    decode_steps = sum(max(r["tokens"] - 1, 0) for r in reports)
    return {
        "reads_per_family": sum(r.get("storage_reads", 0) for r in notices + reports)
        / len(engines),
        "held_bytes": sum(held),
        "held_per_engine": held,
        "cascade_fraction": sum(r.get("cascade_steps", 0) for r in reports) / max(decode_steps, 1),
        "wall_s": round(statistics.median(walls), 3),
        "wall_rounds_s": [round(w, 3) for w in walls],
        "engines_per_family": sum(len(e) for e in engines.values()) / len(engines),
        "fallbacks": sum(1 for r in reports if r.get("fallback")),
        "cascade_off": sorted({r["cascade_off"] for r in reports if r.get("cascade_off")})[:3],
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--quick", action="store_true", help="4 families, 512-token documents")
    args = parser.parse_args()
    families, doc_len, tokens, repeats = (4, 512, 16, 1) if args.quick else (8, 1024, 32, 3)
    rounds = [workload(families, doc_len, seed) for seed in range(repeats)]
    spec = TINY_LLAMA
    doc_bytes = families * doc_len * spec.num_layers * 2 * spec.num_kv_heads * spec.head_dim * 4
    results = {}
    with tempfile.TemporaryDirectory(prefix="kmesh-routing-") as tmp:
        for label, policy in progress(POLICIES.items(), "policies"):
            results[label] = run_policy(policy, rounds, tokens, Path(tmp))
            results[label]["held_vs_documents"] = round(results[label]["held_bytes"] / doc_bytes, 4)
            print(label, results[label], file=sys.stderr, flush=True)
    fam, rr = results["family"], results["round_robin"]
    title = f"{families} families x {MEMBERS} members, 2 engines: workload wall time"
    plot_bars("routing", list(results), [r["wall_s"] for r in results.values()], title)
    emit({
        "name": "routing",
        "metric": "master bytes held over both engines / the documents' KV bytes, family routing",
        "value": fam["held_vs_documents"],
        "unit": "x",
        "goal": 1.0,
        "baseline": "round_robin and cache_aware routing of the same requests, same fleet set-up",
        "quick": args.quick,
        "config": {
            "model": "tiny-llama (fp32)", "engines": 2, "families": families, "members": MEMBERS,
            "document_tokens": doc_len, "decode_tokens": tokens, "recompute_ratio": RATIO,
            "rounds": repeats,
            "documents_bytes": doc_bytes, "wall_goal": 1.0,
            "wall_vs_round_robin": round(fam["wall_s"] / rr["wall_s"], 4),
            "reads_per_family_goal": 1.0, "policies": results,
        },
    })  # fmt: skip


if __name__ == "__main__":
    main()
