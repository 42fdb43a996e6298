"""Train the small language model the reuse-quality harness runs on (CPU, about 30 minutes).

    python scripts/train_quality_model.py            # writes kmesh_blend/testing/quality_model/

A Llama-architecture decoder (transformers' ``LlamaForCausalLM``: hidden 256, 4 heads × 64,
2 KV heads, head_dim 64 so vLLM's CPU attention accepts it) learns next-token prediction on the
Python standard library's sources, tokenized by the project's local byte-level BPE (vocab 4096).
Every 10th source file (sorted order) is held out for evaluation and for the quality harness.

Sequences are `CONTEXT_LENGTH` tokens drawn at random offsets of the concatenated files (EOS
between files). A share of them (``--copy-fraction``) also repeats one of their own spans
(32–128 tokens) later in the same sequence: such synthetic copy tasks make induction heads —
attention that finds an earlier occurrence and copies what followed it — form within a few
hundred steps, and that is the behaviour whose damage by stale reused KV the harness measures.

Deterministic for a given Python build (the corpus) and thread count: fixed seeds, sorted files,
one `torch.Generator` for all sampling, ``torch.use_deterministic_algorithms(True)``, fixed
step count (no wall-clock stopping). Weights are stored in bf16 (half the bytes of fp32; the
final numbers in the log are measured on the stored weights, reloaded).

The log (``train_log.txt`` beside the weights) records the command, seed, configuration, loss
curve, held-out loss, wall time and the context check: loss on the second occurrence of a
held-out passage repeated twice in one context, against the loss on its first occurrence.
"""

from __future__ import annotations

import argparse
import math
import platform
import shlex
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a plain checkout

from kmesh_blend.testing.quality import (
    CONTEXT_LENGTH,
    VOCAB_SIZE,
    held_out_files,
    training_files,
)
from kmesh_blend.testing.tokenizer import get_tokenizer_dir

OUT = Path(__file__).resolve().parents[1] / "kmesh_blend" / "testing" / "quality_model"
MAX_BYTES = 25 * 2**20  # the repository's budget for the committed weights


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--steps", type=int, default=1000)
    p.add_argument("--batch", type=int, default=8, help="sequences per step")
    p.add_argument("--lr", type=float, default=3e-3, help="peak learning rate (AdamW)")
    p.add_argument("--warmup", type=int, default=80)
    p.add_argument("--copy-fraction", type=float, default=0.5)
    p.add_argument("--repeat-steps", type=int, default=400, help="phase 2 steps (repeat mix)")
    p.add_argument("--repeat-lr", type=float, default=1e-3, help="phase 2 peak learning rate")
    p.add_argument("--init", type=Path, default=None, help="start from this checkpoint")
    p.add_argument("--skip-check", action="store_true", help="phase 1 alone: no context check")
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--out", type=Path, default=OUT)
    args = p.parse_args()

    from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM

    torch.set_num_threads(args.threads)
    torch.manual_seed(args.seed)
    torch.use_deterministic_algorithms(True)
    log = _Log(args.out / "train_log.txt", append=args.init is not None)
    log(f"command: python {shlex.join(sys.argv)}")
    log(f"python {platform.python_version()}, torch {torch.__version__}, threads {args.threads}")
    log(f"seed {args.seed}, steps {args.steps}, batch {args.batch} x {CONTEXT_LENGTH} tokens")

    tokenizer = AutoTokenizer.from_pretrained(get_tokenizer_dir(VOCAB_SIZE))
    train_ids = _tokenize(tokenizer, training_files())
    held_ids = _tokenize(tokenizer, held_out_files())
    log(f"corpus: {train_ids.numel()} training tokens, {held_ids.numel()} held-out tokens")

    config = LlamaConfig(
        vocab_size=VOCAB_SIZE,
        hidden_size=256,
        intermediate_size=704,
        num_hidden_layers=args.layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=64,
        max_position_embeddings=CONTEXT_LENGTH,
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
        tie_word_embeddings=False,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
    )
    if args.init is None:
        model = LlamaForCausalLM(config)
    else:
        model = LlamaForCausalLM.from_pretrained(args.init, dtype=torch.float32)
        log(f"initial weights: {args.init} (the phase-1 checkpoint, bf16-rounded)")
    num_params = sum(t.numel() for t in model.parameters())
    log(f"model: {config.num_hidden_layers} layers, {num_params / 1e6:.2f} M parameters")

    start = time.perf_counter()
    if args.steps:
        log(f"phase 1: {args.steps} steps, natural text, {args.copy_fraction:.0%} with a copy")
        gen = torch.Generator().manual_seed(args.seed)
        batches = (
            _batch(train_ids, gen, args.batch, args.copy_fraction) for _ in range(args.steps)
        )
        _train(model, batches, args.steps, args.warmup, args.lr, log)
    if args.repeat_steps:
        log(f"phase 2: {args.repeat_steps} steps, repeat-heavy mix (see _repeat_batch)")
        gen = torch.Generator().manual_seed(args.seed + 1)
        batches = (_repeat_batch(train_ids, gen, args.batch) for _ in range(args.repeat_steps))
        _train(model, batches, args.repeat_steps, 20, args.repeat_lr, log)
    wall = time.perf_counter() - start
    log(f"training wall time: {wall:.0f} s ({wall / 60:.1f} min)")

    args.out.mkdir(parents=True, exist_ok=True)
    model.to(torch.bfloat16).save_pretrained(args.out)
    tokenizer.save_pretrained(args.out)
    size = (args.out / "model.safetensors").stat().st_size
    log(f"saved {args.out.name}/model.safetensors: {size / 2**20:.1f} MiB (bf16)")
    if size > MAX_BYTES:
        raise SystemExit(f"weights are {size} bytes, over the {MAX_BYTES}-byte budget")

    saved = LlamaForCausalLM.from_pretrained(args.out, dtype=torch.float32).eval()
    log(f"held-out loss (stored weights, fp32): {_held_out_loss(saved, held_ids):.4f} nats/token")
    first, second = context_check(saved, held_ids)
    log(f"context check: first occurrence {first:.4f} nats/token, repeat {second:.4f} nats/token")
    if not args.skip_check and not second < 0.25 * first:
        raise SystemExit("context check failed: the repeat is not far easier than the first read")
    return 0


def _train(
    model: torch.nn.Module,
    batches: Iterator[torch.Tensor],
    steps: int,
    warmup: int,
    peak: float,
    log: Callable[[str], None],
) -> None:
    """AdamW (fresh state) over ``steps`` batches [B, T] int64; warmup + cosine schedule."""
    opt = torch.optim.AdamW(model.parameters(), lr=peak, betas=(0.9, 0.95), weight_decay=0.1)
    start, ema = time.perf_counter(), 0.0
    model.train()
    for step, batch in enumerate(batches, start=1):
        lr = _lr(step, steps, warmup, peak)
        for group in opt.param_groups:
            group["lr"] = lr
        loss = model(input_ids=batch, labels=batch).loss
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        value = loss.item()
        ema = value if step == 1 else 0.95 * ema + 0.05 * value
        if step % 25 == 0 or step == 1:
            elapsed = time.perf_counter() - start
            log(f"step {step:5d}  loss {value:.4f}  ema {ema:.4f}  lr {lr:.2e}  {elapsed:.0f}s")
    model.eval()


@torch.no_grad()
def context_check(
    model: torch.nn.Module, ids: torch.Tensor, n: int = 16, length: int = 192
) -> tuple[float, float]:
    """Mean next-token loss (nats) on the first and the second copy of a held-out passage.

    Each of ``n`` passages (``length`` tokens, evenly spaced in ``ids``) is fed twice in one
    sequence ``[A, A]``. Positions predict tokens 1..length-1 of each copy (the first token of
    each copy is excluded: it cannot be read off anything earlier). Returns (first, second).
    """
    first, second = [], []
    starts = torch.linspace(0, ids.numel() - length - 1, n).long().tolist()
    for s in starts:
        passage = ids[s : s + length]
        seq = torch.cat([passage, passage])[None]
        nll = _token_nll(model, seq)  # [2*length - 1]: nll[i] is the loss of token i+1
        first.append(nll[: length - 1].mean())
        second.append(nll[length:].mean())
    return float(torch.stack(first).mean()), float(torch.stack(second).mean())


@torch.no_grad()
def _held_out_loss(model: torch.nn.Module, ids: torch.Tensor, n: int = 16) -> float:
    starts = torch.linspace(0, ids.numel() - CONTEXT_LENGTH - 1, n).long().tolist()
    losses = [_token_nll(model, ids[s : s + CONTEXT_LENGTH][None]).mean() for s in starts]
    return float(torch.stack(losses).mean())


def _token_nll(model: torch.nn.Module, seq: torch.Tensor) -> torch.Tensor:
    """seq [1, T] int64 → [T-1] fp32 loss of tokens 1..T-1 given their prefixes."""
    logits = model(input_ids=seq).logits[0, :-1].float()
    return F.cross_entropy(logits, seq[0, 1:], reduction="none")


def _batch(
    ids: torch.Tensor, gen: torch.Generator, size: int, copy_fraction: float
) -> torch.Tensor:
    """[size, CONTEXT_LENGTH] int64 windows at random offsets; a share gets a repeated span.

    A copy sequence keeps its text but overwrites ``x[b : b + n]`` with ``x[a : a + n]``
    (32 ≤ n ≤ 128, the source span in the first half, the copy after it).
    """
    t = CONTEXT_LENGTH
    offsets = torch.randint(0, ids.numel() - t, (size,), generator=gen)
    batch = torch.stack([ids[o : o + t] for o in offsets.tolist()])
    for row in range(size):
        if torch.rand((), generator=gen).item() >= copy_fraction:
            continue
        n = int(torch.randint(32, 129, (), generator=gen))
        a = int(torch.randint(0, t // 2 - n + 1, (), generator=gen))
        b = int(torch.randint(a + n, t - n + 1, (), generator=gen))
        batch[row, b : b + n] = batch[row, a : a + n].clone()
    return batch


def _repeat_batch(ids: torch.Tensor, gen: torch.Generator, size: int) -> torch.Tensor:
    """[size, CONTEXT_LENGTH] int64 rows that reward reading back: per row, with probability
    1/4 a random-token block repeated (n uniform in 32..256, only copying predicts it), 1/2 a
    corpus window whose first n tokens recur right after it, 1/4 the phase-1 mix.
    """
    t = CONTEXT_LENGTH
    rows = []
    for _ in range(size):
        u = torch.rand((), generator=gen).item()
        n = int(torch.randint(32, t // 2 + 1, (), generator=gen))
        o = int(torch.randint(0, ids.numel() - t, (), generator=gen))
        row = ids[o : o + t].clone()
        if u < 0.25:
            block = torch.randint(3, VOCAB_SIZE, (n,), generator=gen)
            row[:n], row[n : 2 * n] = block, block
        elif u < 0.75:
            row[n : 2 * n] = row[:n].clone()
        else:
            row = _batch(ids, gen, 1, 0.5)[0]
        rows.append(row)
    return torch.stack(rows)


def _lr(step: int, steps: int, warmup: int, peak: float) -> float:
    """Linear warmup, then cosine decay to 10% of the peak."""
    if step <= warmup:
        return peak * step / warmup
    progress = (step - warmup) / max(1, steps - warmup)
    return peak * (0.1 + 0.45 * (1 + math.cos(math.pi * progress)))


def _tokenize(tokenizer, files: list[Path]) -> torch.Tensor:  # type: ignore[no-untyped-def]
    """Concatenated token ids [N] int64 of ``files`` (in order), EOS after each file."""
    texts = [f.read_text(encoding="utf-8", errors="replace") for f in files]
    ids: list[int] = []
    for enc in tokenizer(texts, add_special_tokens=False)["input_ids"]:
        ids.extend(enc)
        ids.append(tokenizer.eos_token_id)
    return torch.tensor(ids, dtype=torch.int64)


class _Log:
    """Print a line and append it to the training log (truncated at start)."""

    def __init__(self, path: Path, append: bool = False) -> None:
        path.parent.mkdir(parents=True, exist_ok=True)
        self.path = path
        if not append:
            path.write_text("")

    def __call__(self, line: str) -> None:
        print(line, flush=True)
        with self.path.open("a") as f:
            f.write(line + "\n")


if __name__ == "__main__":
    sys.exit(main())
