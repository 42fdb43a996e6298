"""A continuing sibling restores its earlier prompt's KV from mirrors instead of blending again."""

from __future__ import annotations

import gc
from typing import Any

import pytest
import torch

from kmesh_blend.testing import TINY_LLAMA, build_checkpoint
from kmesh_blend.testing.engine import live_worker, make_llm
from tests.vllm.family import DOC_LEN, kv_transfer_config, prompts

pytestmark = pytest.mark.vllm


def _params(spans: list[list[int]] | None, keep: bool = False) -> Any:
    from vllm import SamplingParams

    kmesh: dict[str, Any] = {"segments": spans, "keep": keep}
    extra = {"kv_transfer_params": {"kmesh": kmesh}} if spans is not None else None
    return SamplingParams(temperature=0.0, max_tokens=6, logprobs=0, extra_args=extra)


def _conversation(
    fail_restore: bool = False, tamper: Any = None, compress: bool = False
) -> dict[str, Any]:
    """Reader, then a follow-up kept as a turn, then its next turn (earlier prompt + answer +
    a new question) annotated with the document at the same place, and that next turn again
    unannotated (vLLM's own prefill of it)."""
    llm = make_llm(
        build_checkpoint(TINY_LLAMA),
        kv_transfer_config=kv_transfer_config(
            store="cpu", recompute_ratio=0.15, compress_mirrors=compress
        ),
        enable_prefix_caching=False,
    )
    captured: dict[str, torch.Tensor] = {}
    hooks = live_worker().hooks
    hooks.capture = lambda rid, kv: captured.__setitem__(rid.rsplit("-", 1)[0], kv.clone())
    try:
        family = prompts()
        (reader, reader_spans), (follow, spans) = family[0], family[1]
        llm.generate([{"prompt_token_ids": reader}], _params(reader_spans), use_tqdm=False)
        first = llm.generate(
            [{"prompt_token_ids": follow}], _params(spans, keep=True), use_tqdm=False
        )[0]
        answer = list(first.outputs[0].token_ids)
        turn2 = follow + answer + [5, 17, 99, 1234, 42, 7, 300, 11]
        if fail_restore:
            hooks.fault = lambda load: "injected" if load.turn is not None else None
        if tamper is not None:
            tamper()
        second = llm.generate([{"prompt_token_ids": turn2}], _params(spans), use_tqdm=False)[0]
        hooks.fault = None
        plain = llm.generate([{"prompt_token_ids": turn2}], _params(None), use_tqdm=False)[0]
        kv = {
            f"kv_{name}": captured.get(out.request_id)
            for name, out in [("first", first), ("second", second)]
        }
        return {"follow": follow, "first": first, "second": second, "plain": plain, **kv}
    finally:
        del llm
        gc.collect()


@pytest.mark.parametrize("compress", [False, True], ids=["plain", "zlib-planes"])
def test_next_turn_restores_the_kept_prompt_bit_for_bit(compress: bool) -> None:
    run = _conversation(compress=compress)
    first = run["first"].kv_transfer_params["kmesh"]
    second = run["second"].kv_transfer_params["kmesh"]
    assert first["fallback"] is None and first["reused_tokens"] >= DOC_LEN
    dense = run["kv_first"].numel() * run["kv_first"].element_size()
    print(f"turn record {first['kept_bytes']} B vs dense prompt KV {dense} B")
    assert 0 < first["kept_bytes"] < dense
    n = len(run["follow"])
    assert second["fallback"] is None
    assert second["restored_tokens"] == n and second["reused_tokens"] == n
    assert second["recomputed_tokens"] == 0  # no blend this time
    # The restored rows are the earlier prompt's KV, bit for bit, in every layer.
    assert run["kv_second"] is not None
    assert torch.equal(run["kv_second"][:, :, :n], run["kv_first"])
    assert len(run["second"].outputs[0].token_ids) == 6


def test_a_failed_restore_recomputes_the_whole_prompt() -> None:
    run = _conversation(fail_restore=True)
    second = run["second"].kv_transfer_params["kmesh"]
    assert str(second["fallback"]).startswith("load error: injected")
    assert second["reused_tokens"] == 0
    assert list(run["second"].outputs[0].token_ids) == list(run["plain"].outputs[0].token_ids)


def test_a_corrupted_turn_record_is_caught_and_recomputed(monkeypatch: pytest.MonkeyPatch) -> None:
    """One flipped bit in the stored turn record's private rows: the checksum catches it."""
    from kmesh_blend.segments.store import LMCacheMasterStore

    real = LMCacheMasterStore.get_blob

    def flipped(self: Any, object_id: Any) -> bytes | None:
        blob = real(self, object_id)
        if blob is not None and blob[8:19] == b'{"tokens": ':  # a turn record
            blob = blob[:-1] + bytes([blob[-1] ^ 1])
        return blob

    run = _conversation(tamper=lambda: monkeypatch.setattr(LMCacheMasterStore, "get_blob", flipped))
    second = run["second"].kv_transfer_params["kmesh"]
    assert second["fallback"] == "load error: turn record checksum mismatch"
    assert list(run["second"].outputs[0].token_ids) == list(run["plain"].outputs[0].token_ids)
