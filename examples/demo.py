"""The first demo: our pure-torch reference model and real vLLM agree on a tiny Llama.

Builds the embedded tiny checkpoint (random weights, local tokenizer; nothing is downloaded),
continues a prompt greedily with both `ReferenceModel` and vLLM (CPU, in-process), and compares
the generated tokens and the log-probabilities each assigns to the prompt. Exit status 1 on a
mismatch.

Run: ``make demo`` (or ``.venv/bin/python examples/demo.py``).
"""

from __future__ import annotations

import sys
import time

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
    print("RESULT: reference and vLLM agree" if same else "RESULT: MISMATCH")
    return 0 if same else 1


if __name__ == "__main__":
    sys.exit(main())
