"""Prompt layouts for blend tests: families of siblings sharing stored segments."""

from __future__ import annotations

import torch

from kmesh_blend.blend import BlendRequest, DenseSegmentSource, SegmentUse, segment_kv_from_prefill
from kmesh_blend.models import LayerwiseModel

LAYOUTS = ("leading", "middle", "reordered", "repeated")


def family(
    model: LayerwiseModel, layout: str, num_requests: int, seed: int = 0, seg_len: int = 48
) -> tuple[list[BlendRequest], DenseSegmentSource]:
    """Siblings whose prompts hold segments A (and B) among private tokens, per ``layout``:
    leading = A first; middle = private, A, question; reordered = A/B in alternating order;
    repeated = A twice in one prompt. Segment masters are prefilled alone at positions 0.."""
    gen = torch.Generator().manual_seed(seed)
    vocab = model.shape.vocab_size

    def tokens(n: int) -> torch.Tensor:
        return torch.randint(3, vocab, (n,), generator=gen)

    seg = {"A": tokens(seg_len), "B": tokens(seg_len // 2 + 3)}
    source = DenseSegmentSource(
        {name: segment_kv_from_prefill(model, ids) for name, ids in seg.items()}
    )
    requests = []
    for i in range(num_requests):
        pre, mid, q = tokens(5 + 3 * i), tokens(4 + i % 3), tokens(6 + i % 4)
        names = {
            "leading": ["A"],
            "middle": ["A"],
            "reordered": ["A", "B"] if i % 2 == 0 else ["B", "A"],
            "repeated": ["A", "A"],
        }[layout]
        parts: list[torch.Tensor] = [] if layout == "leading" else [pre]
        uses = []
        for j, name in enumerate(names):
            if j:
                parts.append(mid)
            start = sum(p.numel() for p in parts)
            parts.append(seg[name])
            uses.append(SegmentUse(start, start + seg[name].numel(), name))
        parts.append(q)
        requests.append(BlendRequest(torch.cat(parts), tuple(uses)))
    return requests, source
