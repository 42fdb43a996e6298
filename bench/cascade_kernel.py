"""One decode step of a family in cascade, per layer: the CPU kernel vs the plain-torch path.

Shapes of `bench/cascade_decode.py`'s family on SmolLM2-135M (bf16): 8 requests, 9 query / 3 KV
heads × 64, one master of 2,048 rows (15 % of them masked per request), 480 own rows per request.
30 layers of distinct buffers are cycled, as in a model's forward, so the K/V come from memory,
not cache. Each round times one pass over the 30 layers of:
- kernel: `kmesh_blend.cpu.cascade_decode_op` — one call per layer (append this step's K/V,
  rotate the queries, attend, write the output rows), K/V in bf16, tiled;
- torch: what the fallback path does per layer (index writes of this step's K/V, the query
  rotation, `kmesh_blend.attention.decode.decode_cascade` on fp32 copies, the output write);
- kernel, master only / own rows only: the same kernel with the other level emptied.
value = kernel / torch (median per-layer time, rounds interleaved). Also printed: the master's
and the own rows' bytes per layer at bf16.

Run: python bench/cascade_kernel.py [--quick]
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import emit, interleaved

from kmesh_blend.attention.decode import MASKED, MasterRows, OwnRows, decode_cascade
from kmesh_blend.cpu import cascade_decode_op
from kmesh_blend.cpu.layout import pair_values, tile_keys

N, HEADS, KV_HEADS, DIM, DOC, OWN, LAYERS = 8, 9, 3, 64, 2048, 480, 30


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--quick", action="store_true")
    args = parser.parse_args()
    op, why = cascade_decode_op()
    if op is None:
        raise SystemExit(f"the CPU kernel is unavailable here: {why}")
    gen = torch.Generator().manual_seed(0)

    def rand(*shape: int, dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
        return torch.randn(*shape, generator=gen).to(dtype)

    tokens = torch.arange(N)
    q, k, v = rand(N, HEADS, DIM), rand(N, KV_HEADS, DIM), rand(N, KV_HEADS, DIM)
    out = torch.zeros(N, HEADS, DIM, dtype=torch.bfloat16)
    bias = torch.zeros(N, OWN + DOC)
    bias[torch.rand(N, OWN + DOC, generator=gen) < 0.15] = MASKED
    cols = torch.full((N,), OWN - 1)
    rotation = [torch.linalg.qr(torch.randn(N, DIM, DIM, generator=gen))[0].contiguous()]
    layers = []
    for _ in range(LAYERS):
        own_k, own_v = rand(N, KV_HEADS, DIM, OWN), rand(N, KV_HEADS, OWN, DIM)
        master_k, master_v = rand(KV_HEADS, DIM, DOC), rand(KV_HEADS, DOC, DIM)
        layers.append(
            {
                "kernel": (
                    tile_keys(own_k),
                    pair_values(own_v),
                    tile_keys(master_k),
                    pair_values(master_v),
                ),
                "torch": (own_k.float(), own_v.float(), master_k.float(), master_v.float()),
                "own16": (tile_keys(own_k[..., :16]), pair_values(own_v[:, :, :16])),
            }
        )

    def kernel(level: str = "both") -> None:
        for layer in layers:
            own_k, own_v, master_k, master_v = layer["kernel"]
            width = OWN
            if level == "master":
                (own_k, own_v), width = layer["own16"], 16
            masters = level != "own"
            op(
                out, tokens, q, k, v, own_k, own_v, bias[:, :width], cols.clamp(max=width - 1),
                [master_k] if masters else [], [master_v] if masters else [],
                [bias[:, OWN:]] if masters else [], rotation if masters else [], 0.125,
            )  # fmt: skip

    def plain() -> None:
        rows = torch.arange(N)
        for layer in layers:
            own_k, own_v, master_k, master_v = layer["torch"]
            own_k[rows, :, :, cols] = k.float()
            own_v[rows, :, cols] = v.float()
            bias[rows, cols] = 0.0
            qf = q.float()
            master = MasterRows(master_k, master_v, torch.bmm(qf, rotation[0]))
            got = decode_cascade(qf, OwnRows(own_k, own_v), [master], bias, 0.125)
            out[tokens] = got.to(out.dtype)

    fns: dict[str, Any] = {
        "kernel": kernel,
        "torch": plain,
        "kernel_master_only": lambda: kernel("master"),
        "kernel_own_only": lambda: kernel("own"),
    }
    med = interleaved(fns, 5 if args.quick else 30)
    per_layer = {label: 1e6 * seconds / LAYERS for label, seconds in med.items()}
    value = per_layer["kernel"] / per_layer["torch"]
    master_mib = 2 * KV_HEADS * DOC * DIM * 2 / 2**20
    own_mib = 2 * N * KV_HEADS * OWN * DIM * 2 / 2**20
    for label, us in per_layer.items():
        print(f"{label:20s} {us:8.1f} µs per layer")
    print(
        f"kernel / torch = {value:.3f}; bytes per layer (bf16): master {master_mib:.2f} MiB, "
        f"own rows {own_mib:.2f} MiB"
    )
    emit(
        {
            "name": "cascade_kernel",
            "metric": "cascade decode attention per layer, CPU kernel / plain-torch path",
            "value": round(value, 4),
            "unit": "x",
            "goal": None,
            "baseline": "the plain-torch path (fp32 copies), rounds interleaved",
            "quick": args.quick,
            "config": {
                "requests": N,
                "heads": HEADS,
                "kv_heads": KV_HEADS,
                "head_dim": DIM,
                "master_rows": DOC,
                "own_rows": OWN,
                "layers_cycled": LAYERS,
                "threads": torch.get_num_threads(),
                "us_per_layer": {label: round(us, 1) for label, us in per_layer.items()},
                "master_MiB": round(master_mib, 3),
                "own_MiB": round(own_mib, 3),
            },
        }
    )


if __name__ == "__main__":
    main()
