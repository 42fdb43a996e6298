"""Storage of 8 blended siblings: 8 dense copies vs 8 mirrors of one master; restore time.

Workload: the bench model (24 layers, Llama-style) in bf16 (the KV dtype a server stores), a
shared document of D tokens stored as a master (prefilled alone at positions 0..D-1), and 8
siblings = private tokens (64 + 8·i) + document + 32 question tokens, blended as one group
(`blend_group`, layer_sync, per-request selection) at several recompute ratios. Each sibling's
post-blend KV of the document span is encoded as a mirror (stored bytes: header, positions,
unit bitmap, replacement rows) at token / 16 / 32-token granularity.

Printed side by side from one run:
- dense bytes (8 × the span's KV) / mirror bytes (8 stored objects), per ratio and granularity;
- the lossless limits: dense / bytes of the K|V rows that differ (what a row diff must keep), and
  dense / bytes of the single elements whose bits differ (a bound no row-based coding reaches);
- token mirrors with the changed rows' bytes coded losslessly (`kmesh.compress_mirrors`: byte
  planes, zlib; the sign/exponent plane compresses), which goes beyond the row limit;
- restore time of one sibling into a paged cache (vLLM CPU layout, torch path: decode + plan +
  24 layers) vs a dense copy of the same rows into the same cache (`scatter_paged`, torch).
value = dense / mirror bytes at ratio 0.15, token granularity; goal 6×.

Run: python bench/mirror_storage.py [--quick]
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import emit, follow_up_family, interleaved, plot_bars

from kmesh_blend.blend import (
    BlendOptions,
    blend_group,
    master_tensor,
)
from kmesh_blend.mirror.codec import GRANULARITIES, encode, predict_layer
from kmesh_blend.mirror.restore import plan_restore, restore_layer
from kmesh_blend.mirror.wire import decode, encode_bytes
from kmesh_blend.models import ReferenceModel
from kmesh_blend.ops import scatter_paged
from kmesh_blend.testing import BENCH_LLAMA, build_checkpoint

RATIOS = (0.05, 0.075, 0.15, 0.3)
SIBLINGS = 8
BLOCK = 32  # vLLM CPU block size


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--quick", action="store_true")
    args = parser.parse_args()
    doc_len = 256 if args.quick else 2048
    repeats = 1 if args.quick else 5
    torch.manual_seed(0)

    model = ReferenceModel.load(build_checkpoint(BENCH_LLAMA), torch.bfloat16)
    requests, source = follow_up_family(model, doc_len, SIBLINGS, private_step=8)
    master = source.segments["doc"]
    master_kv = master_tensor(master)

    inv_freq = model.rope.inv_freq
    elem = master_kv.element_size()
    dense = SIBLINGS * master_kv.numel() * elem
    table: dict[str, dict[str, float]] = {}
    blobs: dict[float, list[bytes]] = {}
    for ratio in RATIOS:
        opts = BlendOptions(recompute_ratio=ratio, backend="torch")
        results = blend_group(model, requests, source, opts)
        sizes = dict.fromkeys(GRANULARITIES, 0)
        row_bytes = element_bytes = zlib_bytes = 0
        for req, res in zip(requests, results, strict=True):
            use = req.uses[0]
            keys = torch.stack([k[use.start : use.end] for k in res.keys])
            values = torch.stack([v[use.start : use.end] for v in res.values])
            pos = torch.arange(use.start, use.end)
            for g in GRANULARITIES:
                mirror = encode(master_kv, master.positions, keys, values, pos, inv_freq, g)  # type: ignore[arg-type]
                blob = encode_bytes(mirror, "0" * 64)
                sizes[g] += len(blob)
                if g == "token":
                    zlib_bytes += len(encode_bytes(mirror, "0" * 64, compress=True))
                    row_bytes += mirror.rows.numel() * elem
                    changed = _changed_elements(
                        master_kv, master.positions, keys, values, pos, inv_freq
                    )
                    element_bytes += changed * elem
                    blobs.setdefault(ratio, []).append(blob)
        row = {f"x_{g}": dense / n for g, n in sizes.items()}
        row["x_token_zlib"] = dense / zlib_bytes
        row["limit_rows"] = dense / max(row_bytes, 1)
        row["limit_elements"] = dense / max(element_bytes, 1)
        row["recomputed"] = sum(r.num_recomputed for r in results) / (SIBLINGS * doc_len)
        table[str(ratio)] = row
        print(
            f"ratio {ratio:5.3f}: dense/mirror token {row['x_token']:6.2f}x, block16 "
            f"{row['x_block16']:6.2f}x, block32 {row['x_block32']:6.2f}x | lossless limit: "
            f"rows {row['limit_rows']:6.2f}x, elements {row['limit_elements']:6.2f}x "
            f"(token mirror = {row['x_token'] / row['limit_rows']:.3f} of the row limit) | "
            f"token + byte-plane zlib {row['x_token_zlib']:6.2f}x"
        )

    # Restore one sibling (ratio 0.15) into a vLLM-CPU paged cache vs a dense copy of its rows.
    L, _, S, H, D = master_kv.shape
    blob = blobs[0.15][-1]
    blocks = -(-S // BLOCK) + 1
    cache = torch.zeros(L, blocks, H, BLOCK, 2 * D, dtype=master_kv.dtype)
    views = [_cpu_views(cache[layer]) for layer in range(L)]
    slots = torch.arange(S) + 7
    dense_k, dense_v = master_kv[:, 0].clone(), master_kv[:, 1].clone()

    def restore() -> None:
        mirror, _ = decode(blob)
        plan = plan_restore(master_kv, master.positions, mirror, inv_freq)
        for layer, (k, v) in enumerate(views):
            restore_layer(plan, master_kv, layer, k, v, slots, BLOCK, "torch")

    def copy() -> None:
        for layer, (k, v) in enumerate(views):
            scatter_paged(dense_k[layer], k, slots, BLOCK, "torch")
            scatter_paged(dense_v[layer], v, slots, BLOCK, "torch")

    times = interleaved({"restore": restore, "dense copy": copy}, repeats)
    print(
        f"restore of one {S}-token sibling into the paged cache: {times['restore'] * 1e3:.1f} ms "
        f"(torch path) vs dense copy {times['dense copy'] * 1e3:.1f} ms "
        f"= {times['restore'] / times['dense copy']:.2f}x"
    )
    plot_bars(
        "mirror_storage",
        ["mirror restore", "dense copy"],
        [times["restore"], times["dense copy"]],
        f"one sibling, {S} tokens x {L} layers into a paged cache (torch path); "
        f"storage {table['0.15']['x_token']:.1f}x smaller at ratio 0.15",
    )
    emit(
        {
            "name": "mirror_storage",
            "metric": "dense_bytes / mirror_bytes",
            "value": round(table["0.15"]["x_token"], 3),
            "unit": "x",
            "goal": 6.0,
            "baseline": "8 dense copies",
            "quick": args.quick,
            "config": {
                "model": BENCH_LLAMA.name,
                "dtype": "bfloat16",
                "document": doc_len,
                "siblings": SIBLINGS,
                "dense_bytes": dense,
                "per_ratio": {
                    r: {k: round(v, 4) for k, v in row.items()} for r, row in table.items()
                },
                "restore_s": round(times["restore"], 5),
                "dense_copy_s": round(times["dense copy"], 5),
                "threads": torch.get_num_threads(),
            },
        }
    )


def _changed_elements(
    master_kv: torch.Tensor,
    master_positions: torch.Tensor,
    keys: torch.Tensor,
    values: torch.Tensor,
    positions: torch.Tensor,
    inv_freq: torch.Tensor,
) -> int:
    """Elements whose bits differ from the prediction (the element-level lossless bound)."""
    view = torch.int16 if keys.element_size() == 2 else torch.int32
    n = 0
    for layer in range(keys.shape[0]):
        k, v = predict_layer(master_kv, master_positions, positions, layer, inv_freq)
        n += int((k.view(view) != keys[layer].view(view)).sum())
        n += int((v.view(view) != values[layer].view(view)).sum())
    return n


def _cpu_views(c: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """vLLM CPU layer cache [blocks, H, bs, 2·D] → (K, V) [block, head, offset, dim] views, K
    transposed within a block (fp32/bf16 on x86, `kmesh_blend.vllm.paged`)."""
    blocks, heads, bs, two_d = c.shape
    base = c.view(blocks, heads, 2 * bs, two_d // 2)
    s = base.stride()
    k = base.as_strided((blocks, heads, bs, two_d // 2), (s[0], s[1], 1, bs), base.storage_offset())
    return k, base[:, :, bs:]


if __name__ == "__main__":
    main()
