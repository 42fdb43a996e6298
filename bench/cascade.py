"""Shared-segment KV bytes read per decode step and time: cascade vs per-request attention.

Workload: a family of N siblings (N = 1, 2, 4, 8, 16), each = 64 private tokens + a shared
document of S tokens (its master stored at positions 0..S-1) + 32 question tokens, with 15% of the
document rows replaced per sibling (its mirror rows: the default recompute ratio). One decode step:
one query per sibling at the position after its context, attention shape of the 158M Llama anchor
(16 heads, 8 KV heads, head_dim 64).

- per-request (baseline): each sibling attends its own materialized KV (document rows moved to
  its offset, replaced rows its own) — torch SDPA, the reference model's attention, one call per
  sibling; the materialized copies are built outside the timed region (they live in the cache).
- cascade: `cascade_attention` (torch backend on this CPU): the master read once for the group
  with rotated queries and per-sibling masks, each sibling's unique rows, exact state merge.

Bytes (analytic, bf16 KV as a server stores it; row = K+V of one token in one layer):
  per-request shared bytes = Σ_i (S − r_i) · row     (r_i replaced rows of sibling i)
  cascade shared bytes     = passes · S · row + N · S · 1 B (replaced-row masks, uint8)
passes = ⌈N·G / 64⌉ row blocks of the Triton kernel per KV head (G = 2 query heads per KV head;
1 up to N = 32). Also printed: all bytes of the document span (shared + replaced rows) both ways.
value = cascade / per-request shared bytes at N = 8 (goal ≤ 0.15).

Run: python bench/cascade.py [--quick]
"""

from __future__ import annotations

import argparse
import math
import sys
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import emit, interleaved, plot_bars

from kmesh_blend.attention import SharedSegment, Sibling, cascade_attention
from kmesh_blend.attention.reference import materialized_kv
from kmesh_blend.models.rope import RopeConfig, RotaryEmbedding

GROUPS = (1, 2, 4, 8, 16)
HEADS, KV_HEADS, DIM = 16, 8, 64
PRIVATE, QUESTION, REPLACED = 64, 32, 0.15
KV_BYTES = 2  # bf16
BLOCK_M = 64  # Triton level kernel rows per program on a GPU
ROW_BYTES = 2 * KV_HEADS * DIM * KV_BYTES
H200_BYTES_PER_S = 4.8e12


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--quick", action="store_true")
    args = parser.parse_args()
    doc_len = 512 if args.quick else 2048
    repeats = 5 if args.quick else 30
    torch.manual_seed(0)
    torch.set_num_threads(1)  # stable on a shared 2-core machine (2 threads contend: ~100x noise)
    rope = RopeConfig(head_dim=DIM, theta=500000.0)
    inv_freq = RotaryEmbedding(rope).inv_freq
    master = SharedSegment(
        torch.randn(doc_len, KV_HEADS, DIM),
        torch.randn(doc_len, KV_HEADS, DIM),
        torch.arange(doc_len),
    )
    rows, labels, seconds = [], [], []
    for n in GROUPS:
        siblings, materialized = _family(n, master, inv_freq)
        replaced = sum(int(s.replaced[0].sum()) for s in siblings)  # type: ignore[union-attr]
        per_req_shared = (n * doc_len - replaced) * ROW_BYTES
        passes = math.ceil(n * HEADS // KV_HEADS / BLOCK_M)
        casc_shared = passes * doc_len * ROW_BYTES + n * doc_len
        span_per_req = n * doc_len * ROW_BYTES
        span_casc = casc_shared + replaced * ROW_BYTES

        def cascade(siblings: list[Sibling] = siblings) -> None:
            cascade_attention(siblings, [master], DIM**-0.5, inv_freq, backend="torch")

        def per_request(siblings: list[Sibling] = siblings, kv: list = materialized) -> None:
            for sib, (k, v, pos) in zip(siblings, kv, strict=True):
                F.scaled_dot_product_attention(
                    sib.q.transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1),
                    attn_mask=pos[None, :] <= sib.q_positions[:, None], scale=DIM**-0.5,
                    enable_gqa=True,
                )  # fmt: skip

        t = interleaved({"cascade": cascade, "per_request": per_request}, repeats)
        rows.append(
            {
                "N": n,
                "shared_bytes_ratio": casc_shared / per_req_shared,
                "span_bytes_ratio": span_casc / span_per_req,
                "per_request_shared_MiB": per_req_shared / 2**20,
                "cascade_shared_MiB": casc_shared / 2**20,
                "cascade_ms": 1e3 * t["cascade"],
                "per_request_ms": 1e3 * t["per_request"],
            }
        )
        labels += [f"N={n}\ncascade", f"N={n}\nper-req"]
        seconds += [t["cascade"], t["per_request"]]
        r = rows[-1]
        print(
            f"N={n:2d}: shared bytes/layer per-request {r['per_request_shared_MiB']:.2f} MiB, "
            f"cascade {r['cascade_shared_MiB']:.2f} MiB → {r['shared_bytes_ratio']:.3f}x "
            f"(document span incl. replaced rows {r['span_bytes_ratio']:.3f}x); "
            f"time cascade {r['cascade_ms']:.2f} ms, per-request {r['per_request_ms']:.2f} ms "
            f"(CPU, torch, fp32)",
            flush=True,
        )
    plot_bars("cascade", labels, seconds, f"decode step, one layer, S={doc_len} (CPU torch fp32)")
    at8 = next(r for r in rows if r["N"] == 8)
    est = _vllm_estimate(doc_len)
    print(
        f"estimate for vLLM decode (158M Llama, 12 layers, bf16, S={doc_len}, N=8, H200 at "
        f"{H200_BYTES_PER_S / 1e12:.1f} TB/s): shared-KV read per step {est['per_request_us']:.0f} "
        f"µs per-request vs {est['cascade_us']:.0f} µs cascade (bandwidth bound, KV reads only)"
    )
    emit(
        {
            "name": "cascade",
            "metric": "shared-segment bytes read per step, cascade / per-request",
            "value": round(at8["shared_bytes_ratio"], 4),
            "unit": "x",
            "goal": 0.15,
            "baseline": "per-request attention over materialized KV",
            "quick": args.quick,
            "config": {
                "document_tokens": doc_len,
                "private_tokens": PRIVATE + QUESTION,
                "replaced_fraction": REPLACED,
                "heads": HEADS,
                "kv_heads": KV_HEADS,
                "head_dim": DIM,
                "kv_dtype_for_bytes": "bfloat16",
                "timing": "CPU 1 thread, torch backend, fp32, one layer, median, interleaved",
                "per_N": rows,
                "vllm_decode_estimate_N8": est,
            },
        }
    )


def _family(
    n: int, master: SharedSegment, inv_freq: torch.Tensor
) -> tuple[list[Sibling], list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]]]:
    """N siblings with a decode query each, and each one's materialized KV (k, v, positions)."""
    gen = torch.Generator().manual_seed(n)
    doc_len = master.k.shape[0]
    siblings, materialized = [], []
    for i in range(n):
        offset = PRIVATE + 8 * i  # private instructions of different lengths before the document
        total = offset + doc_len + QUESTION
        rep = torch.rand(doc_len, generator=gen) < REPLACED
        own = torch.ones(total + 1, dtype=torch.bool)  # + the decode token itself
        own[offset : offset + doc_len] = rep
        pos = own.nonzero().squeeze(1)
        k, v = torch.randn(2, pos.numel(), KV_HEADS, DIM, generator=gen)
        q = torch.randn(1, HEADS, DIM, generator=gen)
        sib = Sibling(q, torch.tensor([total]), [offset], [rep], k, v, pos)
        siblings.append(sib)
        materialized.append(
            materialized_kv([tuple(master)], [offset], [rep], (k, v, pos), inv_freq)  # type: ignore[list-item]
        )
    return siblings, materialized


def _vllm_estimate(doc_len: int, layers: int = 12, n: int = 8) -> dict[str, float]:
    per_request = layers * n * (1 - REPLACED) * doc_len * ROW_BYTES
    cascade = layers * (doc_len * ROW_BYTES + n * doc_len)
    return {
        "per_request_us": 1e6 * per_request / H200_BYTES_PER_S,
        "cascade_us": 1e6 * cascade / H200_BYTES_PER_S,
        "per_request_MiB": per_request / 2**20,
        "cascade_MiB": cascade / 2**20,
    }


if __name__ == "__main__":
    main()
