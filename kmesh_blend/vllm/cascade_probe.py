"""Timing the cascade path against vLLM's own kernel at engine start (`speed_guard.Timing`).

One attention layer (the first) on scratch blocks with this engine's heads, dtype, block size
and paged layout, never the live cache: ``family`` readers, each with ``own`` private rows
followed by one master of ``rows`` rows, decoding one token each; then the first of them alone.
Each runs on the cascade path (`CascadeDecode.forward`, its step planned once, as every later
layer of a step reuses it) and on vLLM's kernel over the same requests' whole contexts, in turn,
``reps`` times after one warm-up; the fastest of each, and how many of the paired runs the cascade
path lost (the guard's sign test); and what arming one reader costs (verifying its rows against
the master, `DecodePlan.arm`, and placing its own rows in its slot), per layer, the fastest of
`ARMS` fresh plans of the family. Well under a second on 2 cores.
"""

from __future__ import annotations

import math

import torch

from kmesh_blend.cpu.caches import fastest_cold
from kmesh_blend.cpu.level import KernelLevel
from kmesh_blend.segments.master import Master
from kmesh_blend.vllm.cascade_attend import EngineKV, Kernel, per_call
from kmesh_blend.vllm.cascade_decode import CascadeDecode, MasterUse
from kmesh_blend.vllm.cascade_timing import Timing
from kmesh_blend.vllm.paged import slot_mapping
from kmesh_blend.vllm.seam import cpu_attention as vllm_attn

__all__ = ["ARMS", "probe"]

ARMS = 3  # the family armed afresh this many times; the fastest counts (as for the paths)


def probe(kv: EngineKV, kernel: Kernel | None, family: int = 8, rows: int = 1024,
          own: int = 64, reps: int = 11, level: KernelLevel | None = None) -> Timing:  # fmt: skip
    """`Timing` of ``family`` readers (at most one kernel call's worth) and of one alone; with
    the kernel reads masters as ``level`` says (`CascadeDecode.level`)."""
    layer, cache, layout, rope, heads = kv.layers[0], kv.caches[0], kv.layout, kv.rope, kv.heads
    bs, dtype = layout.block_size, cache.dtype
    num_heads, num_kv_heads, head_dim = heads
    family = max(2, min(family, per_call(heads)))
    gen = torch.Generator().manual_seed(0)

    def rand(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=gen)

    positions = torch.arange(own, own + rows)
    master_k = rope.apply(rand(rows, num_kv_heads, head_dim), positions).to(dtype)
    master_v = rand(rows, num_kv_heads, head_dim).to(dtype)
    master = Master(torch.stack((master_k, master_v))[None], positions)
    prompt = own + rows
    per = -(-(prompt + 1) // bs)
    scratch = cache.new_zeros((family * per, *cache.shape[1:]))
    blocks = [list(range(r * per, (r + 1) * per)) for r in range(family)]
    for ids in blocks:
        k = rope.apply(rand(prompt, num_kv_heads, head_dim), torch.arange(prompt)).to(dtype)
        v = rand(prompt, num_kv_heads, head_dim).to(dtype)
        k[own:], v[own:] = master_k, master_v
        vllm_attn.write_kv(layer, k, v, scratch, slot_mapping(ids, bs, 0, prompt))
    position = torch.full((family,), prompt)
    query = rope.apply(rand(family, num_heads, head_dim), position).to(dtype)
    key = rope.apply(rand(family, num_kv_heads, head_dim), position).to(dtype)
    value = rand(family, num_kv_heads, head_dim).to(dtype)
    scratch_kv = EngineKV([layer], [scratch], layout, rope, heads)
    stock = vllm_attn.stock_forward(layer)
    names = [f"probe{r}" for r in range(family)]

    def pair(n: int) -> tuple[float, float, int, float]:
        """(cascade, vLLM) seconds for the first n readers; runs the cascade path lost; the
        fastest arming of a reader (fresh plans, `ARMS` times)."""
        table = torch.tensor(blocks[:n], dtype=torch.int32)
        meta = vllm_attn.scratch_batch(
            layer, torch.arange(n + 1, dtype=torch.int32),
            torch.full((n,), prompt + 1, dtype=torch.int32), table, dtype,
        )  # fmt: skip
        batch = vllm_attn.step_batch(meta)
        assert batch is not None
        q, k, v = query[:n], key[:n], value[:n]
        out = torch.zeros_like(q)

        def vllm() -> torch.Tensor:
            return stock(q, k, v, scratch, meta, out)

        def cascade() -> torch.Tensor:
            return decode.forward(0, vllm, layer, q, k, v, scratch, batch, out)

        arm = math.inf
        for _ in range(ARMS):
            decode = CascadeDecode(scratch_kv, lambda m: names[:m], kernel)
            decode.level = level or KernelLevel()
            for name, ids in zip(names[:n], blocks[:n], strict=True):
                uses = [MasterUse("probe", own, prompt, master)]
                decode.add(name, ids, slot_mapping(ids, bs, 0, prompt), uses)
            cascade()  # plans the step (arms the readers), as a step's first layer does
            if decode.broken is not None or decode.reports[names[0]].get("cascade_steps") != 1:
                why = decode.broken
                raise RuntimeError(f"the probe's readers did not decode in cascade: {why}")
            arm = min(arm, decode.clock.steps[-1].arm_s / n)
        return (*fastest_cold(cascade, vllm, reps), arm)

    family_s, family_stock_s, family_lost, arm_s = pair(family)
    alone_s, alone_stock_s, alone_lost, _ = pair(1)
    return Timing(family, rows, prompt + 1, family_s, family_stock_s, alone_s, alone_stock_s,
                  reps, family_lost, alone_lost, arm_s)  # fmt: skip
