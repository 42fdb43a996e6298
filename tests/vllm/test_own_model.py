"""The blend runs on vLLM's own loaded model: exactness against stock vLLM, model identity, and
models the blend cannot run on.

Exactness is compared with the same batching (one request at a time): stock vLLM on this CPU is
not batch-invariant, so a batch against single requests would differ for reasons of its own.
"""

from __future__ import annotations

import gc
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any, TypeVar

import pytest
import torch

from kmesh_blend.testing import TINY_LLAMA, build_checkpoint, smollm2_checkpoint
from kmesh_blend.testing.engine import make_llm
from kmesh_blend.testing.tokenizer import get_tokenizer_dir
from tests.vllm.family import DOC_LEN, kv_transfer_config, prompts

pytestmark = pytest.mark.vllm

T = TypeVar("T")
Result = tuple[list[int], list[float], dict[str, Any] | None]


def _params(spans: list[list[int]] | None, max_tokens: int = 8) -> Any:
    from vllm import SamplingParams

    extra = {"kv_transfer_params": {"kmesh": {"segments": spans}}} if spans is not None else None
    return SamplingParams(temperature=0.0, max_tokens=max_tokens, logprobs=0, extra_args=extra)


def _run(llm: Any, items: list[tuple[list[int], list[list[int]] | None]]) -> list[Result]:
    """One request at a time: (tokens, their log-probabilities, kmesh report)."""
    out = []
    for ids, spans in items:
        (o,) = llm.generate([{"prompt_token_ids": ids}], _params(spans), use_tqdm=False)
        out.append(_result(o))
    return out


def _result(o: Any) -> Result:
    tokens = list(o.outputs[0].token_ids)
    logprobs = [float(lp[t].logprob) for t, lp in zip(tokens, o.outputs[0].logprobs, strict=True)]
    report = (o.kv_transfer_params or {}).get("kmesh")
    if report is not None:  # a wall-clock time: never equal between two runs
        report = {k: v for k, v in report.items() if k != "load_ms"}
    return tokens, logprobs, report


def _with_engine(path: Path | str, dtype: str, fn: Callable[[Any], T], **kmesh: Any) -> T:
    """``fn(llm)`` on a fresh engine (KMesh when ``kmesh`` settings are given), then close it.

    The engine is referenced only here: an in-process engine that is collected late tears down
    vLLM's process-wide parallel state under the next one."""
    extra = {"kv_transfer_config": kv_transfer_config(**kmesh)} if kmesh else {}
    llm = make_llm(path, dtype=dtype, enable_prefix_caching=False, **extra)
    try:
        return fn(llm)
    finally:
        del llm
        gc.collect()


def _family_runs(path: Path | str, dtype: str, **kmesh: Any) -> tuple[list[Result], list[Result]]:
    """(stock, kmesh) on the family prompts: a first reader, then the follow-ups."""
    stock, kmesh_runs, _ = _family_runs_skips(path, dtype, **kmesh)
    return stock, kmesh_runs


def _family_runs_skips(path: Path | str, dtype: str,
                       **kmesh: Any) -> tuple[list[Result], list[Result], int]:  # fmt: skip
    """`_family_runs` and how many of the KMesh engine's forwards were skipped (`Tails`)."""
    from kmesh_blend.vllm.seam.engine import worker_connector

    def run(llm: Any) -> tuple[list[Result], int]:
        results = _run(llm, family)
        connector: Any = worker_connector()
        return results, connector.worker.tails.skipped

    family = prompts()
    stock = _with_engine(path, dtype, lambda llm: _run(llm, [(ids, None) for ids, _ in family]))
    return stock, *_with_engine(path, dtype, run, store="cpu", **kmesh)


MODELS = {"tiny": lambda: build_checkpoint(TINY_LLAMA), "smollm2": smollm2_checkpoint}


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("model", sorted(MODELS))
def test_ratio_one_equals_stock_vllm(model: str, dtype: str) -> None:
    stock, kmesh, skipped = _family_runs_skips(MODELS[model](), dtype, recompute_ratio=1.0)
    for (s_tokens, s_lp, _), (k_tokens, k_lp, _) in zip(stock, kmesh, strict=True):
        assert k_tokens == s_tokens
        assert k_lp == s_lp  # every bit, the first token's too (kmesh_blend/vllm/tails.py)
    # Each follow-up's prompt tail was a step of its own: vLLM's forward of it did not run, the
    # blend's states and KV stood in for it, and the bits above are still stock's.
    assert skipped == len(kmesh) - 1
    assert all(r is not None and r["reused_tokens"] == DOC_LEN for *_, r in kmesh[1:])
    assert all(r is not None and r["recomputed_tokens"] == DOC_LEN for *_, r in kmesh[1:])


def test_a_request_carries_its_own_ratio_and_sink_tokens() -> None:
    """An engine at ratio 0.15: a follow-up asking for ratio 1.0 gets stock vLLM's bits, one
    asking for the start-of-segment rule recomputes just its sinks, in one batch (one blend group
    per setting); a follow-up without a setting of its own keeps the engine's."""
    from vllm import SamplingParams

    path = build_checkpoint(TINY_LLAMA)
    family = prompts()
    stock = _with_engine(path, "float32", lambda llm: _run(llm, [(ids, None) for ids, _ in family]))
    own = [{"recompute_ratio": 1.0}, {"recompute_ratio": 0.0, "sink_tokens": 4}, {}, {}]

    def params(spans: list[list[int]], setting: dict[str, Any]) -> Any:
        annotation = {"kmesh": {"segments": spans, **setting}}
        return SamplingParams(temperature=0.0, max_tokens=8, logprobs=0,
                              extra_args={"kv_transfer_params": annotation})  # fmt: skip

    def run(llm: Any) -> list[Result]:
        _run(llm, family[:1])
        batch = llm.generate(
            [{"prompt_token_ids": ids} for ids, _ in family[1:]],
            [params(spans, setting) for (_, spans), setting in zip(family[1:], own, strict=True)],
            use_tqdm=False,
        )
        (alone,) = llm.generate([{"prompt_token_ids": family[4][0]}],
                                params(family[4][1], own[0]), use_tqdm=False)  # fmt: skip
        return [_result(o) for o in [*batch, alone]]

    kmesh = _with_engine(path, "float32", run, store="cpu", recompute_ratio=0.15)
    reports = [r for *_, r in kmesh]
    assert all(r is not None and r["reused_tokens"] == DOC_LEN for r in reports), reports
    assert [r["recomputed_tokens"] for r in reports if r] == [DOC_LEN, 4, 62, 62, DOC_LEN]
    exact, _, default, _, alone = kmesh
    assert exact[0] == stock[1][0]  # in a batch: the same tokens (decode batching differs)
    assert alone[:2] == stock[4][:2]  # alone, as stock ran: every log-probability bit too
    assert default[1] != stock[3][1]  # the engine's own ratio still blends


def test_real_model_schedules_agree_and_blend_reuses() -> None:
    """SmolLM2 in bf16 at ratio 0.15: follow-ups in one batch (one layer-synchronous group) give
    the same bits as the sequential schedule, and they really reuse the document."""
    path = smollm2_checkpoint()
    family = prompts()

    def reader_then_batch(llm: Any) -> list[Result]:
        _run(llm, family[:1])
        outs = llm.generate(
            [{"prompt_token_ids": ids} for ids, _ in family[1:]],
            [_params(spans) for _, spans in family[1:]],
            use_tqdm=False,
        )
        return [_result(o) for o in outs]

    runs = {
        schedule: _with_engine(
            path,
            "bfloat16",
            reader_then_batch,
            store="cpu",
            recompute_ratio=0.15,
            schedule=schedule,
        )
        for schedule in ("layer_sync", "sequential")
    }
    assert runs["layer_sync"] == runs["sequential"]
    assert all(r["reused_tokens"] == DOC_LEN and r["fallback"] is None
               for *_, r in runs["layer_sync"])  # fmt: skip


def test_the_blend_holds_no_second_copy_of_the_weights() -> None:
    from kmesh_blend.testing.engine import live_worker
    from kmesh_blend.vllm.model import VllmModel

    def check(llm: Any) -> None:
        worker = live_worker()
        assert isinstance(worker.model, VllmModel)
        core = llm.llm_engine.engine_core.engine_core
        served = core.model_executor.driver_worker.worker.model_runner.get_model()
        assert worker.model.model is served
        served_ptrs = {p.data_ptr() for p in served.parameters()}
        # Nothing the blend runs on is a tensor of its own: every module it calls is vLLM's.
        blend_ptrs = {p.data_ptr() for layer in worker.model.layers for p in layer.parameters()}
        assert blend_ptrs and blend_ptrs <= served_ptrs

    _with_engine(build_checkpoint(TINY_LLAMA), "float32", check, store="cpu")


def _perturbed_copy(src: Path, dst: Path, scale: float) -> None:
    from safetensors.torch import load_file, save_file

    shutil.copytree(src, dst, dirs_exist_ok=True)
    for file in dst.glob("*.safetensors"):
        gen = torch.Generator().manual_seed(1)
        weights = load_file(str(file))
        noisy = {k: v + scale * torch.randn(v.shape, generator=gen) for k, v in weights.items()}
        save_file({k: v.contiguous() for k, v in noisy.items()}, str(file))


def test_new_weights_at_the_same_path_never_reuse_old_kv(tmp_path: Path, lm_server: str) -> None:
    path = tmp_path / "model"
    shutil.copytree(build_checkpoint(TINY_LLAMA), path)
    family = prompts()

    def kmesh(items: list[Any]) -> Result:
        run = lambda llm: _run(llm, items)[0]  # noqa: E731
        return _with_engine(path, "float32", run, store=lm_server, recompute_ratio=0.15)

    kmesh(family[:1])  # publishes the document's master in the shared store
    # Control: the same weights in a new engine read that master.
    assert kmesh(family[1:2])[2]["reused_tokens"] == DOC_LEN  # type: ignore[index]
    _perturbed_copy(build_checkpoint(TINY_LLAMA), path, scale=0.02)
    tokens, _, report = kmesh(family[1:2])
    assert report is not None and report["reused_tokens"] == 0
    stock = _with_engine(path, "float32", lambda llm: _run(llm, [(family[1][0], None)]))
    assert tokens == stock[0][0]


def _tiny_gpt2(out: Path) -> Path:
    """A random GPT-2 (no Llama-shaped layers) with the local tokenizer."""
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(0)
    config = GPT2Config(vocab_size=2048, n_positions=2048, n_embd=128, n_layer=2, n_head=4)
    GPT2LMHeadModel(config).save_pretrained(out)
    for file in get_tokenizer_dir(2048).iterdir():
        shutil.copy(file, out / file.name)
    return out


def test_a_model_the_blend_cannot_run_on_is_served_stock_with_a_reason(tmp_path: Path) -> None:
    path = _tiny_gpt2(tmp_path / "gpt2")
    stock, kmesh = _family_runs(path, "float32", recompute_ratio=0.15)
    assert [t for t, *_ in kmesh] == [t for t, *_ in stock]
    for *_, report in kmesh:
        assert report is not None and report["reused_tokens"] == 0
        assert "model not supported" in report["fallback"]
        assert "GPT2" in report["fallback"]
