"""Which implementation of the shared level serves here: the vector loops or matrix products.

The CPU kernel reads a master one of two ways (`cascade_decode.cpp`): its AVX-512 loops over the
tiled layout, or torch's bf16 GEMM with fp32 output (``at::native::cpublas::brgemm`` on plain
operands: oneDNN's matmul, on AMX tiles where the CPU has them) over the chunked layout
(`kmesh_blend.cpu.layout`). Which is
faster depends on the CPU and not on a constant: on an AMD EPYC with AVX-512 BF16 the loops win
(a family of 8 over 2,048 rows: 0.39 vs 0.63 ms, two threads), on a Xeon with AMX the matrix
units beat any vector loop. `choose_level` times both on this engine's heads, each run from
caches that hold none of its data, and keeps the faster (``kmesh.cascade_level: auto``).
Plain torch and the kernel; no vLLM.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, NamedTuple

import torch

from kmesh_blend.cpu.caches import fastest_cold
from kmesh_blend.cpu.layout import gemm_chunks, pair_values, tile_keys

__all__ = ["LEVELS", "KernelLevel", "LevelTiming", "choose_level", "time_levels"]

LEVELS = ("auto", "loops", "gemm")


class KernelLevel(NamedTuple):
    """How the CPU kernel reads masters: ``gemm`` by matrix products (else its vector loops);
    ``exact``: bf16 operands it must round (rotated queries, probabilities) as two terms."""

    gemm: bool = False
    exact: bool = False


class LevelTiming(NamedTuple):
    """Fastest seconds of one kernel call (a family reading one master) on each level."""

    loops_s: float
    gemm_s: float
    family: int
    rows: int

    @property
    def gemm(self) -> bool:
        return self.gemm_s < self.loops_s

    def line(self) -> str:
        chosen = "matrix products" if self.gemm else "vector loops"
        loops, gemm = self.loops_s * 1e3, self.gemm_s * 1e3
        return (f"shared level on {chosen} ({self.family} readers of {self.rows} rows: loops "
                f"{loops:.3f} ms, matrix products {gemm:.3f} ms)")  # fmt: skip


def choose_level(setting: str, kernel: Any, dtype: torch.dtype, heads: tuple[int, int, int],
                 exact: bool = False) -> tuple[bool, str]:  # fmt: skip
    """(whether masters are read by matrix products, why) for ``kmesh.cascade_level``
    ``setting`` on this engine: ``loops`` / ``gemm`` as set (matrix products need bf16),
    ``auto`` the faster of the two as `time_levels` finds them (with ``exact`` operands)."""
    if setting not in LEVELS:
        raise ValueError(f"kmesh.cascade_level must be one of {LEVELS}, not {setting!r}")
    if setting == "loops":
        return False, "shared level on vector loops (kmesh.cascade_level: loops)"
    if dtype != torch.bfloat16:
        return False, f"shared level on vector loops (matrix products read bfloat16, not {dtype})"
    if setting == "gemm":
        return True, "shared level on matrix products (kmesh.cascade_level: gemm)"
    timing = time_levels(kernel, heads, exact=exact)
    return timing.gemm, timing.line()


def time_levels(kernel: Any, heads: tuple[int, int, int], family: int = 8, rows: int = 1024,
                reps: int = 7, exact: bool = False) -> LevelTiming:  # fmt: skip
    """One bf16 kernel call of ``family`` readers (at most 64 query rows) over one master of
    ``rows`` rows, 16 own rows each, on either level: the fastest of ``reps`` runs each, in
    turn, every run from evicted caches (`fastest_cold`)."""
    num_heads, kv_heads, dim = heads
    family = max(1, min(family, 64 * kv_heads // num_heads))
    gen = torch.Generator().manual_seed(0)

    def rand(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=gen).to(torch.bfloat16)

    own, pool = 16, family
    q, k, v = rand(family, num_heads, dim), rand(family, kv_heads, dim), rand(family, kv_heads, dim)
    master_k, master_v = rand(1, rows, kv_heads, dim), rand(1, rows, kv_heads, dim)
    own_k = tile_keys(rand(pool, kv_heads, dim, own))
    own_v = pair_values(rand(pool, kv_heads, own, dim))
    tokens, slots = torch.arange(family), torch.arange(family)
    cols = torch.zeros(family, dtype=torch.int64)
    rotation = torch.eye(dim).expand(family, dim, dim).contiguous()
    bias = [torch.zeros(family, rows)]
    chunk_k, chunk_v = gemm_chunks(master_k, master_v)
    tiled = tile_keys(master_k[0].permute(1, 2, 0)), pair_values(master_v[0].transpose(0, 1))
    layouts = {"loops": ([tiled[0]], [tiled[1]]), "gemm": ([chunk_k[0]], [chunk_v[0]])}

    def call(level: str) -> Callable[[], object]:
        out = torch.zeros_like(q)
        mk, mv = layouts[level]
        return lambda: kernel(out, tokens, q, k, v, own_k, own_v, torch.zeros(pool, own),
                              slots, cols, mk, mv, bias, [rotation], dim**-0.5, exact)  # fmt: skip

    loops_s, gemm_s, _ = fastest_cold(call("loops"), call("gemm"), reps)
    return LevelTiming(loops_s, gemm_s, family, rows)
