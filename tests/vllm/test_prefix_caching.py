"""KMesh with vLLM's prefix caching on (kmesh_blend/vllm/prefix_cache.py), through real vLLM.

The workload: chat requests sharing a system prompt (unannotated) interleaved with a document
family whose prompts start with the same system prompt, then a blended follow-up's prompt sent
again unannotated, and extended. Three properties:
1. unannotated traffic gets the prefix-cache hits stock vLLM gives it, and stock's bits;
2. an annotated request takes its exact leading prefix from the cache; only the rest is blended;
3. no blended block is served as exact prefix KV: a blended prompt extended, then sent again,
   unannotated, gets what stock gives when the blended requests never ran — the same cache hits
   (the extension: the system prompt only) and the same tokens and log-probability bits.
"""

from __future__ import annotations

import gc
from collections.abc import Callable
from typing import Any

import pytest
import torch

from kmesh_blend.testing import TINY_LLAMA, build_checkpoint, smollm2_checkpoint
from kmesh_blend.testing.engine import leaked_connector, make_llm
from tests.vllm.family import DOC_LEN, kv_transfer_config

pytestmark = pytest.mark.vllm

SYSTEM_LEN, NUM_FOLLOW_UPS, BLOCK = 70, 3, 32  # the CPU backend wants multiples of 32
Item = tuple[str, list[int], list[list[int]] | None]  # (kind, prompt, spans or None)
Out = tuple[list[int], list[float], int, dict[str, Any] | None]  # tokens, logprobs, cached, report


def _workload(vocab: int, seed: int = 0) -> list[list[Item]]:
    """Steps of the workload; the items of one step are sent in one call (one batch)."""
    gen = torch.Generator().manual_seed(seed)

    def rand(n: int) -> list[int]:
        return torch.randint(3, vocab, (n,), generator=gen).tolist()

    system, doc = rand(SYSTEM_LEN), rand(DOC_LEN)

    def chat() -> list[Item]:
        return [("chat", system + rand(40), None)]

    def member() -> Item:
        private = rand(20)
        start = SYSTEM_LEN + len(private)
        return ("blend", system + private + doc + rand(12), [[start, start + DOC_LEN]])

    reader = [member()]
    follow_ups = [member() for _ in range(NUM_FOLLOW_UPS)]
    again = follow_ups[1][1]
    return [
        chat(), reader, chat(), follow_ups, chat(),
        [("extended", again + rand(30), None)], [("again", again, None)], chat(),
    ]  # fmt: skip


def _run(llm: Any, steps: list[list[Item]], skip_blend: bool = False) -> list[Out | None]:
    from vllm import SamplingParams

    outs: list[Out | None] = []
    for step in steps:
        items = [(kind, ids, spans) for kind, ids, spans in step]
        if skip_blend and items[0][0] == "blend":
            outs.extend(None for _ in items)
            continue
        params = [
            SamplingParams(
                temperature=0.0, max_tokens=6, logprobs=0,
                extra_args=_annotation(spans),
            )
            for _, _, spans in items
        ]  # fmt: skip
        prompts = [{"prompt_token_ids": ids} for _, ids, _ in items]
        for o in llm.generate(prompts, params, use_tqdm=False):
            tokens = list(o.outputs[0].token_ids)
            lps = [
                float(lp[t].logprob) for t, lp in zip(tokens, o.outputs[0].logprobs, strict=True)
            ]
            report = (o.kv_transfer_params or {}).get("kmesh")
            outs.append((tokens, lps, int(o.num_cached_tokens or 0), report))
    return outs


def _annotation(spans: list[list[int]] | None) -> dict[str, Any] | None:
    return {"kv_transfer_params": {"kmesh": {"segments": spans}}} if spans else None


def _engine(path: Any, fn: Callable[[Any], Any], **kmesh: Any) -> Any:
    """``fn(llm)`` on a fresh engine with prefix caching on (KMesh when settings are given)."""
    extra = {"kv_transfer_config": kv_transfer_config(**kmesh)} if kmesh else {}
    llm = make_llm(path, enable_prefix_caching=True, block_size=BLOCK, **extra)
    try:
        return fn(llm)
    finally:
        del llm
        gc.collect()


def _check(path: Any, vocab: int, seed: int, **kmesh: Any) -> None:
    steps = _workload(vocab, seed)  # a seed per test: a shared lm:// server keeps documents
    kinds = [kind for step in steps for kind, _, _ in step]
    stock_all = _engine(path, lambda llm: _run(llm, steps))
    stock_alone = _engine(path, lambda llm: _run(llm, steps, skip_blend=True))
    got = _engine(path, lambda llm: _run(llm, steps), recompute_ratio=0.15, **kmesh)
    system_hit = SYSTEM_LEN // BLOCK * BLOCK
    for kind, k, s_all, s_alone in zip(kinds, got, stock_all, stock_alone, strict=True):
        assert k is not None and s_all is not None
        if kind == "chat":  # 1: the same hits and bits as stock serving the same traffic
            assert k[:3] == s_all[:3]
            assert k[2] >= system_hit or k is got[0]
        elif kind == "blend":  # 2: the system prompt from the cache, the document blended
            report = k[3]
            assert report is not None and report["fallback"] is None
            assert report["prefix_cached_tokens"] == system_hit
            assert report["reused_tokens"] == (0 if k is got[1] else DOC_LEN)  # after the reader
        else:  # 3: as if the blended requests never ran (stock, exact, from the system prompt)
            assert s_alone is not None
            assert k[:3] == s_alone[:3]
            assert k[3] is None
            if kind == "extended":  # the first after the blend: hits the system prompt only
                assert k[2] == system_hit


@pytest.mark.parametrize(
    "seed, store, schedule",
    [(1, "cpu", "layer_sync"), (2, "lm", "sequential"), (3, "lm", "layer_sync")],
)
def test_prefix_caching_properties_tiny(seed: int, store: str, schedule: str, request: Any) -> None:
    spec = request.getfixturevalue("lm_server") if store == "lm" else "cpu"
    _check(build_checkpoint(TINY_LLAMA), 2048, seed, store=spec, schedule=schedule)


def test_prefix_caching_properties_real_model(lm_server: str) -> None:
    _check(smollm2_checkpoint(), 49152, 4, store=lm_server, schedule="layer_sync")


def test_a_failed_mechanism_check_refuses_prefix_caching(monkeypatch: pytest.MonkeyPatch) -> None:
    import kmesh_blend.vllm.startup as startup

    monkeypatch.setattr(startup, "check_prefix_caching", lambda *a: "simulated: 2 groups")
    with pytest.raises(Exception, match=r"prefix caching.*simulated: 2 groups|simulated"):
        make_llm(build_checkpoint(TINY_LLAMA), kv_transfer_config=kv_transfer_config(),
                 enable_prefix_caching=True)  # fmt: skip
    gc.collect()
    assert leaked_connector()  # the failed start left vLLM's connector set; dropped now


def test_the_mechanism_check_fails_without_privatization() -> None:
    """The start-up check is able to fail: with privatization switched off, the exact request
    finds the blended blocks and the check names it."""
    import types

    from vllm.v1.kv_cache_interface import FullAttentionSpec, KVCacheConfig, KVCacheGroupSpec

    from kmesh_blend.vllm.prefix_cache import Privatizer
    from kmesh_blend.vllm.seam.blocks import check_prefix_caching

    spec = FullAttentionSpec(block_size=16, num_kv_heads=2, head_size=8, dtype=torch.float32)
    config = KVCacheConfig(100, [], [KVCacheGroupSpec(["layer.0"], spec)])
    vllm_config = types.SimpleNamespace(
        cache_config=types.SimpleNamespace(block_size=16, prefix_caching_hash_algo="sha256")
    )
    privatize = Privatizer(16).privatize
    assert check_prefix_caching(vllm_config, config, privatize) is None
    problem = check_prefix_caching(vllm_config, config, lambda request, first: 0)
    assert problem is not None and "found 64 cached tokens" in problem
    two = KVCacheConfig(100, [], [KVCacheGroupSpec(["a"], spec), KVCacheGroupSpec(["b"], spec)])
    assert "2 KV cache groups" in str(check_prefix_caching(vllm_config, two, privatize))


def test_privatizing_is_sticky_and_per_request() -> None:
    from types import SimpleNamespace

    from kmesh_blend.vllm.prefix_cache import Privatizer

    real = [bytes([i]) * 32 for i in range(6)]
    a = SimpleNamespace(request_id="a", block_hashes=list(real))
    b = SimpleNamespace(request_id="b", block_hashes=list(real))
    p = Privatizer(32)
    assert p.privatize(a, 64) == 2 and p.privatize(b, 64) == 2
    assert a.block_hashes[:2] == real[:2] and b.block_hashes[:2] == real[:2]
    assert all(x != y for x, y in zip(a.block_hashes[2:], real[2:], strict=True))
    assert all(x != y for x, y in zip(a.block_hashes[2:], b.block_hashes[2:], strict=True))
    before = list(a.block_hashes)
    assert p.privatize(a, 96) == 2 and a.block_hashes == before  # never re-salted, never undone
    assert p.privatize(a, 32) == 1 and a.block_hashes[0] == real[0]
    assert a.block_hashes[1] != real[1] and a.block_hashes[2:] == before[2:]
