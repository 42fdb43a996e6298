"""A local byte-level BPE tokenizer, trained offline on text every machine has.

The corpus is the Python standard library's own sources (sorted, so training is deterministic on
a given Python build), so text prompts work with no network and no hub download.
"""

from __future__ import annotations

import hashlib
import os
import sysconfig
import tempfile
from collections.abc import Iterator
from pathlib import Path

__all__ = ["BOS", "EOS", "PAD", "cache_dir", "corpus_files", "get_tokenizer_dir"]

BOS, EOS, PAD = "<|bos|>", "<|eos|>", "<|pad|>"
_CORPUS_BYTES = 4_000_000  # enough for stable merges at vocab 8k; trains in seconds on 2 cores
_FORMAT = 1  # bump when the training recipe changes, so old caches are not reused


def cache_dir() -> Path:
    """Where generated tokenizers and checkpoints live: ``$KMESH_CACHE_DIR`` or ~/.cache."""
    root = os.environ.get("KMESH_CACHE_DIR") or Path.home() / ".cache" / "kmesh_blend"
    path = Path(root)
    path.mkdir(parents=True, exist_ok=True)
    return path


def corpus_files() -> list[Path]:
    """The standard library's ``*.py`` files in a fixed order (tests excluded)."""
    stdlib = Path(sysconfig.get_paths()["stdlib"])
    files = sorted(
        p
        for p in stdlib.rglob("*.py")
        if "site-packages" not in p.parts and "test" not in p.parts and "tests" not in p.parts
    )
    if not files:
        raise RuntimeError(f"no Python sources found under {stdlib} to train the tokenizer on")
    return files


def get_tokenizer_dir(vocab_size: int) -> Path:
    """Train (once) and return a directory loadable by ``AutoTokenizer.from_pretrained``."""
    key = hashlib.sha256(f"{_FORMAT}-{vocab_size}-{_CORPUS_BYTES}".encode()).hexdigest()[:12]
    target = cache_dir() / "tokenizers" / f"bpe-{vocab_size}-{key}"
    if (target / "tokenizer.json").exists():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=target.parent) as tmp:
        _train(vocab_size).save_pretrained(tmp)
        try:
            os.rename(tmp, target)
        except OSError:  # another process finished first: theirs is equivalent
            if not (target / "tokenizer.json").exists():
                raise
        else:
            os.makedirs(tmp)  # TemporaryDirectory cleans up the (now moved) path
    return target


def _corpus_chunks() -> Iterator[str]:
    total = 0
    for path in corpus_files():
        text = path.read_text(encoding="utf-8", errors="replace")
        yield text
        total += len(text)
        if total >= _CORPUS_BYTES:
            return


def _train(vocab_size: int):  # type: ignore[no-untyped-def]
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=[BOS, EOS, PAD],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(_corpus_chunks(), trainer=trainer)
    return PreTrainedTokenizerFast(
        tokenizer_object=tok, bos_token=BOS, eos_token=EOS, pad_token=PAD
    )
