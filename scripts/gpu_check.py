"""One prepared check of every Triton kernel on a lent GPU: compiled, against the fp32 references.

    PYTHONPATH=. python scripts/gpu_check.py [--out bench/results/gpu_check.json]

1. Correctness: each kernel runs compiled on CUDA (``TRITON_INTERPRET`` is removed) on the shapes
   that matter — fp32/bf16 (fp16 where the tests have it), head_dim 64/128, GQA 1/4/8, block size
   16/32/128, a 2,048-token segment — against its fp32 torch reference on the CPU, with the
   tests' tolerances: bit-exact for data movement (paged scatter/gather, mirror restore), stated
   absolute tolerances for float math. Then every registered start-up self-check (what
   ``backend="auto"`` runs) and the cascade's end-to-end check. One ``PASS``/``FAIL`` line each.
2. Timing (bf16, head_dim 128, 8 KV heads; 2,048 and 32,768 tokens): CUDA events, warm-up, the
   median of several repetitions of back-to-back launches queued behind a GPU sleep, so the
   figure is device time. Achieved bandwidth = bytes the kernel must move (reads + writes, each
   input once) / time, printed next to ``dst.copy_(src)`` moving the same number of bytes in the
   same run. At 2,048 tokens the working sets fit in the H200's L2 cache (kernel and copy alike);
   32,768 tokens do not. ``op µs`` is one call of the public launcher, host time included
   (the paged and mirror launchers check the slot range, which waits for the GPU).

Writes a JSON (``--out``). Exit codes: 0 all PASS, 1 any FAIL, 2 no CUDA (nothing ran),
3 the time budget (``--budget-s``) ran out before every case ran. ``--cpu-dry-run`` runs the same
logic on the CPU under ``TRITON_INTERPRET=1`` with tiny shapes: it checks this script, not the GPU.

Imports only `kmesh_blend.ops`, `kmesh_blend.kernels`, `kmesh_blend.attention` and
`kmesh_blend.mirror` (none imports vLLM, LMCache or FlashInfer); Python 3.12, Triton 3.6 APIs.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import time
from collections.abc import Callable
from functools import partial
from pathlib import Path
from typing import Any

import torch

from kmesh_blend.attention import launch as attn
from kmesh_blend.mirror import codec
from kmesh_blend.mirror import restore as mirror
from kmesh_blend.ops import dispatch, reference
from kmesh_blend.ops import launch as ops

F32, BF16, F16 = torch.float32, torch.bfloat16, torch.float16
CPU = torch.device("cpu")
REPOSITION_TOL = {F32: 6e-5, F16: 1.2e-2, BF16: 9.6e-2}  # tests/test_kernels.py: 3 × TOL[dtype]
STATE_TOL = 2e-6  # tests/attention/test_kernels.py: level states and merges, v and s
DEVIATION_RTOL = DEVIATION_ATOL = 1e-5  # tests/test_kernels.py
_INT = {F32: torch.int32, BF16: torch.int16, F16: torch.int16}


class Check:
    """The run's settings, results and clock."""

    def __init__(self, args: argparse.Namespace) -> None:
        dry = args.cpu_dry_run
        self.dev = torch.device("cpu" if dry else "cuda")
        self.tokens, self.queries, self.kv_heads = (48, 8, 2) if dry else (2048, 64, 8)
        self.timing_tokens = (48,) if dry else (2048, 32768)
        self.reps = 2 if dry else 10
        self.budget_s, self.start = args.budget_s, time.perf_counter()
        self.gen = torch.Generator().manual_seed(0)
        self.cases: list[dict[str, Any]] = []
        self.timings: list[dict[str, Any]] = []

    def randn(self, *shape: int, dtype: torch.dtype = F32) -> torch.Tensor:
        return torch.randn(*shape, generator=self.gen).to(dtype)

    def run(
        self, kernel: str, label: str, fn: Callable[[], list[tuple[str, float, float]]]
    ) -> None:
        """Run one case; ``fn`` returns (what, max error, tolerance) per compared output."""
        row: dict[str, Any] = {"kernel": kernel, "case": label}
        if time.perf_counter() - self.start > self.budget_s:
            row.update(status="SKIP", error="time budget spent")
        else:
            try:
                parts = fn()
                row["outputs"] = [{"what": w, "max_err": e, "tol": t} for w, e, t in parts]
                row["status"] = "PASS" if all(e <= t for _, e, t in parts) else "FAIL"
            except Exception as exc:  # a compile/launch error is a FAIL of that kernel
                row.update(status="FAIL", error=f"{type(exc).__name__}: {exc}".splitlines()[0])
        detail = row.get("error") or "; ".join(
            f"{o['what']} {o['max_err']:.3g} (tol {o['tol']:g})" for o in row["outputs"]
        )
        print(f"{row['status']:4}  {kernel:24} {label:44} {detail}", flush=True)
        self.cases.append(row)


def max_err(got: torch.Tensor, want: torch.Tensor, rtol: float = 0.0) -> float:
    """max(|got − want| − rtol·|want|) on the CPU; equal values (infinities too) count 0."""
    got, want = _same(got, want)
    diff = (got.float() - want.float()).abs() - rtol * want.float().abs()
    diff[got.float() == want.float()] = 0.0
    return float(diff.nan_to_num(nan=float("inf")).max()) if diff.numel() else 0.0


def bits_differ(got: torch.Tensor, want: torch.Tensor) -> float:
    """How many elements differ in their bits (data movement must give 0)."""
    got, want = _same(got, want)
    return float((got.view(_INT[got.dtype]) != want.view(_INT[want.dtype])).sum())


def _same(got: torch.Tensor, want: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    got, want = got.detach().cpu(), want.detach().cpu()
    if got.shape != want.shape or got.dtype != want.dtype:
        raise ValueError(f"got {tuple(got.shape)} {got.dtype}, want {want.shape} {want.dtype}")
    return got, want


def inv_freq(d: int) -> torch.Tensor:
    return 1.0 / 10000.0 ** (torch.arange(0, d, 2, dtype=F32) / d)


def cache_view(
    layout: str, blocks: int, heads: int, bs: int, d: int, dtype: torch.dtype, dev: torch.device
) -> torch.Tensor:
    """A zeroed ``[block, head, offset, dim]`` view of an NHD (vLLM flash) or HND cache."""
    if layout == "nhd":
        return torch.zeros(blocks, bs, heads, d, dtype=dtype, device=dev).permute(0, 2, 1, 3)
    return torch.zeros(blocks, heads, bs, d, dtype=dtype, device=dev)


# --- correctness (kernel on the device, reference on the CPU) ----------------------------------

Parts = list[tuple[str, float, float]]


def correctness(c: Check) -> None:
    for dtype in (F32, BF16, F16):
        for d in (64, 128):
            c.run("reposition_kernel", f"{dtype} D={d} n={c.tokens}", _reposition(c, dtype, d))
    for dtype in (F32, BF16):
        for d in (64, 128):
            c.run("deviation_kernel", f"{dtype} D={d} n={c.tokens}", _deviation(c, dtype, d))
            for bs, layout in ((16, "nhd"), (32, "hnd"), (128, "nhd"), (16, "hnd")):
                label = f"{dtype} D={d} bs={bs} {layout} n={c.tokens}"
                scatter, gather = _paged(c, dtype, d, bs, layout)
                c.run("scatter_paged_kernel", label, scatter)
                c.run("gather_paged_kernel", label, gather)
            for group in (1, 4, 8):
                label = f"{dtype} D={d} GQA {group} M={c.queries} S={c.tokens} shift+exclude"
                c.run("level_attention_kernel", label, _level(c, dtype, d, group))
            c.run("merge_state_kernel", f"{dtype} D={d} n={c.tokens}", _merge(c, dtype, d))
            for bs in (16, 32, 128):
                label = f"{dtype} D={d} bs={bs} n={c.tokens}, 15% rows changed"
                c.run("mirror_restore_kernel", label, _mirror(c, dtype, d, bs))
    label = f"{F32} D=128 GQA 4 M={c.queries} S={c.tokens} plain"
    c.run("level_attention_kernel", label, _level(c, F32, 128, 4, masks=False))
    c.run("mirror_restore_kernel", f"{F16} D=128 bs=16 n={c.tokens}", _mirror(c, F16, 128, 16))
    for kernel in dispatch.registered_kernels():
        check = partial(dispatch.run_self_check, kernel, c.dev)
        c.run(kernel, "start-up self-check (what 'auto' runs)", partial(_verdict, check))
    from kmesh_blend.attention.backend import run_self_check as cascade_check

    check = partial(cascade_check, "triton", c.dev, F32)
    c.run("cascade_attention", "end-to-end self-check, triton, fp32", partial(_verdict, check))


def _verdict(check: Callable[[], str | None]) -> Parts:
    failure = check()
    return [(failure or "failures", 0.0 if failure is None else 1.0, 0.0)]


def _reposition(c: Check, dtype: torch.dtype, d: int) -> Callable[[], Parts]:
    def case() -> Parts:
        k, delta = (
            c.randn(c.tokens, c.kv_heads, d, dtype=dtype),
            torch.randint(-3000, 3000, (c.tokens,)),
        )
        got = ops.reposition_keys(k.to(c.dev), delta.to(c.dev), inv_freq(d).to(c.dev), "triton")
        want = reference.reposition_reference(k, delta, inv_freq(d))
        return [("keys max|err|", max_err(got, want), REPOSITION_TOL[dtype])]

    return case


def _deviation(c: Check, dtype: torch.dtype, d: int) -> Callable[[], Parts]:
    def case() -> Parts:
        a, b = (c.randn(c.tokens, c.kv_heads, d, dtype=dtype) for _ in "ab")
        got = ops.token_deviation(a.to(c.dev), b.to(c.dev), "triton")
        err = max_err(got, reference.deviation_reference(a, b), DEVIATION_RTOL)
        return [("max(|err| - rtol|ref|)", err, DEVIATION_ATOL)]

    return case


def _paged(
    c: Check, dtype: torch.dtype, d: int, bs: int, layout: str
) -> tuple[Callable[[], Parts], Callable[[], Parts]]:
    """Scatter into / gather from a cache view: exact copies, untouched slots stay zero."""
    n, h, dev, blocks = c.tokens, c.kv_heads, c.dev, -(-c.tokens // bs) + 2

    def inputs() -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        rows, slots = c.randn(n, h, d, dtype=dtype), torch.randperm(blocks * bs)[:n]
        want = cache_view(layout, blocks, h, bs, d, dtype, CPU)
        reference.scatter_paged_reference(rows, want, slots, bs)
        return rows, slots, want, cache_view(layout, blocks, h, bs, d, dtype, dev)

    def scatter() -> Parts:
        rows, slots, want, got = inputs()
        ops.scatter_paged(rows.to(dev), got, slots.to(dev), bs, "triton")
        return [("cache: bits differing", bits_differ(got, want), 0.0)]

    def gather() -> Parts:
        rows, slots, want, cache = inputs()
        cache.copy_(want)  # the reference's cache, in the same strided layout on the device
        got = ops.gather_paged(cache, slots.to(dev), bs, "triton")
        return [("rows: bits differing", bits_differ(got, rows), 0.0)]

    return scatter, gather


def _level(
    c: Check, dtype: torch.dtype, d: int, group: int, masks: bool = True
) -> Callable[[], Parts]:
    m, s, h = c.queries, c.tokens, c.kv_heads

    def case() -> Parts:
        q = c.randn(m, h * group, d, dtype=dtype)
        k, v = (c.randn(s, h, d, dtype=dtype) for _ in "kv")
        k_pos, q_lim = torch.arange(100, 100 + s), torch.randint(90, 105 + s, (m,))
        q_lim[0] = 50  # sees no key: the empty state (0, −inf)
        ex = torch.rand(3, s) < 0.15 if masks else None
        ex_row = torch.randint(0, 3, (m,)) if masks else None
        shift, freq = (torch.randint(-2000, 2000, (m,)), inv_freq(d)) if masks else (None, None)
        want = attn.level_state(q, k, v, k_pos, q_lim, d**-0.5, ex, ex_row, shift, freq, "torch")
        qd, kd, vd, kp, ql = (x.to(c.dev) for x in (q, k, v, k_pos, q_lim))
        exd, erd, shd, frd = (None if x is None else x.to(c.dev) for x in (ex, ex_row, shift, freq))
        got = attn.level_state(qd, kd, vd, kp, ql, d**-0.5, exd, erd, shd, frd, "triton")
        return [
            ("v max|err|", max_err(got[0], want[0]), STATE_TOL),
            ("s max|err|", max_err(got[1], want[1]), STATE_TOL),
        ]

    return case


def _merge(c: Check, dtype: torch.dtype, d: int) -> Callable[[], Parts]:
    n, h = c.tokens, 4 * c.kv_heads

    def case() -> Parts:
        va, vb = (c.randn(n, h, d, dtype=dtype) for _ in "ab")
        sa, sb = (c.randn(n, h) * 20 for _ in "ab")
        sa[0], sb[1], sa[2], sb[2], sa[3], sb[3] = (float("-inf"),) * 4 + (150.0, -150.0)
        dva, dsa, dvb, dsb = (x.to(c.dev) for x in (va, sa, vb, sb))
        got = attn.merge_state(dva, dsa, dvb, dsb, "triton")
        want = attn.merge_state(va, sa, vb, sb, "torch")
        return [
            ("v max|err|", max_err(got[0], want[0]), STATE_TOL),
            ("s max|err|", max_err(got[1], want[1]), STATE_TOL),
        ]

    return case


def make_mirror(c: Check, layers: int, n: int, d: int, dtype: torch.dtype) -> tuple:
    """(master [L, 2, n, H, D], master positions, mirror, sibling K, sibling V); 15% changed."""
    master = c.randn(layers, 2, n, c.kv_heads, d, dtype=dtype)
    mpos, pos = torch.arange(n) + 7, torch.arange(n) + 500
    pos[n // 2 :] += 13  # a second shift: a gap in the sibling's prompt
    pred = [codec.predict_layer(master, mpos, pos, layer, inv_freq(d)) for layer in range(layers)]
    keys, values = (torch.stack([p[i] for p in pred]).clone() for i in (0, 1))
    for x in (keys, values):
        x[torch.rand(layers, n) < 0.15] += 1.0
    return master, mpos, codec.encode(master, mpos, keys, values, pos, inv_freq(d)), keys, values


def _mirror(c: Check, dtype: torch.dtype, d: int, bs: int) -> Callable[[], Parts]:
    n, h, dev, blocks = c.tokens, c.kv_heads, c.dev, -(-c.tokens // bs) + 2

    def case() -> Parts:
        master, mpos, mir, keys, values = make_mirror(c, 2, n, d, dtype)
        slots = torch.randperm(blocks * bs)[:n]
        plan = mirror.plan_restore(master.to(dev), mpos.to(dev), mir, inv_freq(d))
        ref_plan = mirror.plan_restore(master, mpos, mir, inv_freq(d))
        parts: Parts = []
        for layer in range(2):
            gk, gv = (cache_view("nhd", blocks, h, bs, d, dtype, dev) for _ in "kv")
            wk, wv = (cache_view("nhd", blocks, h, bs, d, dtype, CPU) for _ in "kv")
            mirror.restore_layer(plan, master.to(dev), layer, gk, gv, slots.to(dev), bs, "triton")
            mirror.restore_layer(ref_plan, master, layer, wk, wv, slots, bs, "torch")
            got, want = (gk, gv), (wk, wv)
            sibling = [ops.gather_paged(x.cpu(), slots, bs, "torch") for x in got]
            differ = bits_differ(got[0], want[0]) + bits_differ(got[1], want[1])
            lost = bits_differ(sibling[0], keys[layer]) + bits_differ(sibling[1], values[layer])
            parts += [
                (f"layer {layer} K+V: bits differing from the reference", differ, 0.0),
                (f"layer {layer} K+V: bits differing from the sibling", lost, 0.0),
            ]
        return parts

    return case


# --- timing -------------------------------------------------------------------------------------


def device_us(c: Check, fn: Callable[[], object], queued: bool = True) -> float:
    """Median time per call in µs. On CUDA: ``inner`` back-to-back calls between two events,
    queued behind a GPU sleep (``queued``) so host launch overhead stays hidden; without the
    sleep, one call per event pair (the host's cost included)."""
    fn()
    if c.dev.type != "cuda":
        times = []
        for _ in range(c.reps):
            t0 = time.perf_counter()
            fn()
            times.append((time.perf_counter() - t0) * 1e6)
        return statistics.median(times)
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    fn()
    end.record()
    end.synchronize()
    one = start.elapsed_time(end) * 1e3
    inner = max(1, min(50, int(2000 / max(one, 1.0)))) if queued else 1
    sleep = queued and hasattr(torch.cuda, "_sleep")
    times = []
    for _ in range(c.reps):
        if sleep:
            torch.cuda._sleep(10_000_000)  # ≈ 5 ms at ~2 GHz: the launches below queue up behind it
        start.record()
        for _ in range(inner):
            fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) * 1e3 / inner)
    return statistics.median(times)


Run = tuple[str, int, Callable[[], object], Callable[[], object]]


def timed_runs(c: Check, n: int) -> list[Run]:
    """(kernel, bytes it must move, its Triton launch alone, the public launcher) at ``n`` tokens:
    bf16 rows of 8 KV heads × 128; level: 128 queries, GQA 4, shifts and exclusions; merge: fp32
    states of 32 heads; mirror: one layer, 15% changed rows; paged caches NHD, block size 16."""
    dev, h, d = c.dev, c.kv_heads, 128
    k, k2 = (c.randn(n, h, d, dtype=BF16).to(dev) for _ in "ab")
    delta, freq = torch.randint(-3000, 3000, (n,)).to(dev), inv_freq(d).to(dev)
    out, row_bytes, blocks = torch.empty_like(k), k.nbytes, -(-n // 16) + 2
    cache = cache_view("nhd", blocks, h, 16, d, BF16, dev)
    slots = torch.randperm(blocks * 16)[:n].to(dev)
    m, group = 128, 4
    q = c.randn(m, h * group, d, dtype=BF16).to(dev)
    k_pos, q_lim = torch.arange(n).to(dev), torch.randint(0, n, (m,)).to(dev)
    ex, ex_row = (torch.rand(4, n) < 0.15).to(dev), torch.randint(0, 4, (m,)).to(dev)
    shift, scale = torch.randint(-2000, 2000, (m,)).to(dev), d**-0.5
    level_bytes = q.nbytes + 2 * row_bytes + 8 * n + n * 4 + 24 * m + m * 4 * h * (d + 1) * 4
    va, vb = (c.randn(n, 4 * h, d).to(dev) for _ in "ab")
    sa, sb = (c.randn(n, 4 * h).to(dev) for _ in "ab")
    master, mpos, mir, _, _ = make_mirror(c, 1, n, d, BF16)
    master = master.to(dev)
    plan = mirror.plan_restore(master, mpos.to(dev), mir, inv_freq(d))
    kc, vc = (cache_view("nhd", blocks, h, 16, d, BF16, dev) for _ in "kv")
    return [
        (
            "reposition_kernel",
            2 * row_bytes + 8 * n,
            lambda: ops._reposition_triton(k, delta, freq, out),
            lambda: ops.reposition_keys(k, delta, freq, "triton", out),
        ),
        (
            "deviation_kernel",
            2 * row_bytes + 4 * n,
            lambda: ops._deviation_triton(k, k2),
            lambda: ops.token_deviation(k, k2, "triton"),
        ),
        (
            "scatter_paged_kernel",
            2 * row_bytes + 8 * n,
            lambda: ops._scatter_triton(k, cache, slots, 16),
            lambda: ops.scatter_paged(k, cache, slots, 16, "triton"),
        ),
        (
            "gather_paged_kernel",
            2 * row_bytes + 8 * n,
            lambda: ops._gather_triton(cache, slots, 16, out),
            lambda: ops.gather_paged(cache, slots, 16, "triton"),
        ),
        (
            "level_attention_kernel",
            level_bytes,
            lambda: attn._level_triton(q, k, k2, k_pos, q_lim, ex, ex_row, shift, freq, scale),
            lambda: attn.level_state(
                q, k, k2, k_pos, q_lim, scale, ex, ex_row, shift, freq, backend="triton"
            ),
        ),
        (
            "merge_state_kernel",
            3 * va.nbytes + 3 * sa.nbytes,
            lambda: attn._merge_triton(va, sa, vb, sb),
            lambda: attn.merge_state(va, sa, vb, sb, "triton"),
        ),
        (
            "mirror_restore_kernel",
            4 * row_bytes + 32 * n,
            lambda: mirror._launch(plan, master, 0, kc, vc, slots, 16),
            lambda: mirror.restore_layer(plan, master, 0, kc, vc, slots, 16, "triton"),
        ),
    ]


def timing(c: Check) -> None:
    for n in c.timing_tokens:
        if time.perf_counter() - c.start > c.budget_s:
            print(f"SKIP  timing at {n} tokens: time budget spent")
            c.timings.append({"tokens": n, "status": "SKIP"})
            continue
        for kernel, nbytes, kernel_fn, op_fn in timed_runs(c, n):
            row: dict[str, Any] = {"kernel": kernel, "tokens": n, "bytes": nbytes}
            try:
                row.update(_time_one(c, nbytes, kernel_fn, op_fn), status="OK")
            except Exception as exc:
                row.update(status="FAIL", error=f"{type(exc).__name__}: {exc}".splitlines()[0])
                print(f"FAIL  timing {kernel} at {n} tokens: {row['error']}")
            else:
                print(
                    f"{kernel:24} {n:>6} {nbytes / 2**20:>9.2f} {row['kernel_us']:>10.1f}"
                    f" {row['kernel_GBps']:>9.0f} {row['copy_us']:>9.1f} {row['copy_GBps']:>9.0f}"
                    f" {row['kernel_us'] / row['copy_us']:>8.2f} {row['op_us']:>9.1f}"
                )
            c.timings.append(row)


def _time_one(
    c: Check, nbytes: int, kernel_fn: Callable[[], object], op_fn: Callable[[], object]
) -> dict[str, float]:
    src = torch.empty(nbytes // 2, dtype=torch.uint8, device=c.dev)  # a copy moves 2× its size
    dst = torch.empty_like(src)
    kernel_us, copy_us = device_us(c, kernel_fn), device_us(c, lambda: dst.copy_(src))
    return {
        "kernel_us": kernel_us,
        "kernel_GBps": nbytes / kernel_us / 1e3,
        "copy_us": copy_us,
        "copy_GBps": 2 * src.nbytes / copy_us / 1e3,
        "op_us": device_us(c, op_fn, queued=False),
    }


# --- main ---------------------------------------------------------------------------------------


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", default="bench/results/gpu_check.json", help="JSON path")
    parser.add_argument("--budget-s", type=float, default=240.0, help="stop starting cases after")
    parser.add_argument(
        "--cpu-dry-run", action="store_true", help="tiny shapes, CPU, TRITON_INTERPRET=1"
    )
    args = parser.parse_args()
    if "triton" in sys.modules:
        print("gpu_check: triton was imported before the interpreter setting", file=sys.stderr)
        return 2
    if args.cpu_dry_run:
        os.environ["TRITON_INTERPRET"] = "1"
    else:
        os.environ.pop("TRITON_INTERPRET", None)  # compiled kernels only
        if not torch.cuda.is_available():
            print(
                "gpu_check: no CUDA device here (torch.cuda.is_available() is False); this "
                "script checks the compiled Triton kernels on a GPU. Nothing was run.",
                file=sys.stderr,
            )
            return 2
        torch.backends.cuda.matmul.allow_tf32 = False  # fp32 references stay fp32
    import triton

    c = Check(args)
    env = {
        "python": platform.python_version(),
        "torch": torch.__version__,
        "triton": triton.__version__,
        "device": str(c.dev),
        "device_name": torch.cuda.get_device_name() if c.dev.type == "cuda" else "cpu",
        "interpreter": bool(args.cpu_dry_run),
    }
    print(" ".join(f"{k}={v}" for k, v in env.items()))
    how = "interpreted (dry run)" if args.cpu_dry_run else "compiled"
    print(f"\n== correctness: {how} kernel vs fp32 torch reference (CPU) ==")
    correctness(c)
    print(
        "\n== timing: bf16, D=128, 8 KV heads; GB/s = bytes moved / time "
        "(copy: dst.copy_(src) of the same bytes) =="
    )
    print(
        f"{'kernel':24} {'tokens':>6} {'MiB':>9} {'kernel µs':>10} {'GB/s':>9} {'copy µs':>9}"
        f" {'copy GB/s':>9} {'k/copy':>8} {'op µs':>9}"
    )
    timing(c)
    statuses = [r["status"] for r in c.cases] + [t["status"] for t in c.timings]
    verdict = _worst(statuses)
    kernels = sorted({r["kernel"] for r in c.cases})
    per_kernel = {k: _worst([r["status"] for r in c.cases if r["kernel"] == k]) for k in kernels}
    print("\n== summary ==")
    for k, s in per_kernel.items():
        print(f"{s:4}  {k}")
    elapsed = time.perf_counter() - c.start
    word = {"SKIP": "INCOMPLETE"}.get(verdict, verdict)
    print(
        f"{word}: {statuses.count('FAIL')} failed, {statuses.count('SKIP')} skipped "
        f"(cases and timing rows), {len(c.cases)} cases in {elapsed:.0f} s"
    )
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    result = {"env": env, "verdict": verdict, "per_kernel": per_kernel, "seconds": elapsed}
    out.write_text(json.dumps({**result, "cases": c.cases, "timings": c.timings}, indent=1))
    print(f"wrote {out}")
    return {"PASS": 0, "FAIL": 1, "SKIP": 3}[verdict]


def _worst(statuses: list[str]) -> str:
    """FAIL if any failed, else SKIP if any did not run (the budget ran out), else PASS."""
    return "FAIL" if "FAIL" in statuses else "SKIP" if "SKIP" in statuses else "PASS"


if __name__ == "__main__":
    sys.exit(main())
