"""Smoke end-to-end: real vLLM (CPU, in-process) serves our test checkpoints and agrees with the
reference model — greedy tokens equal, prompt log-probabilities within fp32 kernel noise."""

import gc

import pytest
import torch

from kmesh_blend.models import ReferenceModel, greedy_generate, prefill
from kmesh_blend.testing import TINY_LLAMA, TINY_QWEN3, ModelSpec, build_checkpoint
from kmesh_blend.testing.engine import make_llm, prompt_logprobs

pytestmark = pytest.mark.vllm
MAX_TOKENS = 12
LOGPROB_ATOL = 1e-3  # fp32, different attention kernels; observed ≈ 1e-6


@pytest.mark.parametrize("spec", [TINY_LLAMA, TINY_QWEN3], ids=lambda s: s.name)
def test_vllm_matches_reference(spec: ModelSpec) -> None:
    from vllm import SamplingParams

    path = build_checkpoint(spec)
    prompts = [
        torch.randint(3, spec.vocab_size, (n,), generator=torch.Generator().manual_seed(n)).tolist()
        for n in (5, 33, 130)
    ]
    llm = make_llm(path)
    try:
        params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, prompt_logprobs=0)
        outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    finally:
        del llm
        gc.collect()

    ref = ReferenceModel.load(path, torch.float32)
    for ids, out in zip(prompts, outputs, strict=True):
        assert list(out.prompt_token_ids) == ids
        expected = greedy_generate(ref, torch.tensor(ids), MAX_TOKENS)
        assert list(out.outputs[0].token_ids) == expected
        scores = torch.log_softmax(prefill(ref, torch.tensor(ids)).logits, dim=-1)
        ours = torch.tensor([float(scores[i, ids[i + 1]]) for i in range(len(ids) - 1)])
        theirs = torch.tensor(prompt_logprobs(out))
        torch.testing.assert_close(theirs, ours, rtol=0, atol=LOGPROB_ATOL)


def test_vllm_starts_after_lmcache_import() -> None:
    """LMCache (through numba/llvmlite) must not break vLLM's start in the same process."""
    import subprocess
    import sys

    code = (
        "import os; os.environ['VLLM_ENABLE_V1_MULTIPROCESSING']='0'\n"
        "import lmcache.v1.platform.torch_ops.pos_kernels\n"
        "from kmesh_blend.compat import guard_llvmlite; guard_llvmlite()\n"
        "from kmesh_blend.testing import TINY_LLAMA, build_checkpoint\n"
        "from kmesh_blend.testing.engine import make_llm\n"
        "llm = make_llm(build_checkpoint(TINY_LLAMA))\n"
        "print('STARTED')\n"
    )
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert "STARTED" in proc.stdout, proc.stderr[-3000:]
