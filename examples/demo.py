"""The main demo: KMesh reuses a shared document inside real vLLM (CPU, in-process).

1. Builds the embedded tiny Llama (random weights, local tokenizer; nothing is downloaded) and
   checks that our pure-torch reference model and stock vLLM agree on it (greedy tokens, prompt
   log-probabilities) — the blend runs on that reference executor.
2. Starts vLLM with the KMesh connector (engine args only), reads a 416-token document once,
   then sends four follow-ups that put their own instructions before the document and their own
   question after it, and prints each follow-up's reuse report. At recompute ratio 1.0 the
   follow-ups' tokens must equal stock vLLM's.

Exit status 1 on a mismatch.

Run: ``make demo`` (or ``.venv/bin/python examples/demo.py``).
"""

from __future__ import annotations

import gc
import sys
import time
from typing import Any

import torch

from kmesh_blend.models import ReferenceModel, greedy_generate, prefill
from kmesh_blend.testing import TINY_LLAMA, build_checkpoint
from kmesh_blend.testing.engine import make_llm, prompt_logprobs

PROMPT = "import os\nimport sys\n\n\ndef main(argv):\n    parser = argparse.ArgumentParser("
MAX_TOKENS = 16
LOGPROB_TOLERANCE = 1e-3  # fp32: different kernels, same math


def main() -> int:
    path = build_checkpoint(TINY_LLAMA)
    print(f"checkpoint: {path}")
    ref = ReferenceModel.load(path, torch.float32)
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(path)
    ids = tokenizer(PROMPT)["input_ids"]
    print(f"prompt: {len(ids)} tokens")

    t0 = time.perf_counter()
    ref_tokens = greedy_generate(ref, torch.tensor(ids), MAX_TOKENS)
    ref_scores = torch.log_softmax(prefill(ref, torch.tensor(ids)).logits, dim=-1)
    ref_logprobs = [float(ref_scores[i, ids[i + 1]]) for i in range(len(ids) - 1)]
    print(f"reference model: {time.perf_counter() - t0:.2f} s")

    from vllm import SamplingParams

    llm = make_llm(path)
    params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, prompt_logprobs=0)
    out = llm.generate([{"prompt_token_ids": ids}], params, use_tqdm=False)[0]
    vllm_tokens = list(out.outputs[0].token_ids)
    worst = max(abs(a - b) for a, b in zip(ref_logprobs, prompt_logprobs(out), strict=True))

    print(f"reference greedy: {ref_tokens}")
    print(f"vLLM greedy:      {vllm_tokens}")
    print(f"text: {tokenizer.decode(vllm_tokens)!r}")
    print(f"max |prompt logprob difference|: {worst:.2e} (tolerance {LOGPROB_TOLERANCE:g})")
    same = ref_tokens == vllm_tokens and worst <= LOGPROB_TOLERANCE
    print("reference and vLLM agree" if same else "MISMATCH between reference and vLLM")
    stock = _family_tokens(llm, None)
    del llm
    gc.collect()
    reuse_ok = _kmesh_family(path, stock)
    print("RESULT: OK" if same and reuse_ok else "RESULT: MISMATCH")
    return 0 if same and reuse_ok else 1


def _family() -> list[tuple[list[int], list[list[int]]]]:
    """A 416-token document, then follow-ups: private instructions + document + question."""
    gen = torch.Generator().manual_seed(0)
    doc = torch.randint(3, TINY_LLAMA.vocab_size, (416,), generator=gen).tolist()
    out = []
    for i in range(5):
        private = torch.randint(3, TINY_LLAMA.vocab_size, (20 + 7 * i,), generator=gen).tolist()
        question = torch.randint(3, TINY_LLAMA.vocab_size, (12,), generator=gen).tolist()
        out.append((private + doc + question, [[len(private), len(private) + 416]]))
    return out


def _family_tokens(llm: Any, annotate: bool | None) -> list[list[int]]:
    from vllm import SamplingParams

    outs = []
    for ids, spans in _family():
        extra = {"kv_transfer_params": {"kmesh": {"segments": spans}}} if annotate else None
        sp = SamplingParams(temperature=0.0, max_tokens=8, extra_args=extra)
        out = llm.generate([{"prompt_token_ids": ids}], sp, use_tqdm=False)[0]
        outs.append(list(out.outputs[0].token_ids))
        if annotate:
            print(f"  prompt of {len(ids)} tokens: {out.kv_transfer_params['kmesh']}")
    return outs


def _kmesh_family(path: Any, stock: list[list[int]]) -> bool:
    config = {
        "kv_connector": "KMeshConnector",
        "kv_connector_module_path": "kmesh_blend.vllm",
        "kv_role": "kv_both",
        "kv_connector_extra_config": {"kmesh.store": "cpu", "kmesh.recompute_ratio": 1.0},
    }
    llm = make_llm(path, kv_transfer_config=config, enable_prefix_caching=False)
    print("KMesh (recompute_ratio 1.0): the first prompt stores the document, the rest reuse it")
    tokens = _family_tokens(llm, True)
    same = tokens == stock
    print("follow-up tokens equal stock vLLM's" if same else "MISMATCH with stock vLLM")
    return same


if __name__ == "__main__":
    sys.exit(main())
