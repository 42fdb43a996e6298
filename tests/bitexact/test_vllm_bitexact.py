"""Bit-exactness through real vLLM: stores, schedules, the failure case, and a negative control.

Against a reference run (store ``cpu``, schedule ``layer_sync``), every other run of the same
model and dtype must give every follow-up the same generated tokens, the same log-probability
bits and the same prompt KV in every layer, read back from vLLM's paged cache. `make test` runs
the CI subset (tiny Llama, fp32; cpu and lm:// stores; both schedules; the failure case; the
real SmolLM2 has its own CI checks in tests/vllm/test_own_model.py); `make bitexact` runs models
(the tiny ones and SmolLM2) × dtypes × stores (cpu, lm://, redis://, disk://) × schedules and
prints the summary table.
"""

from __future__ import annotations

import copy
import itertools
from pathlib import Path

import pytest
import torch

from tests.bitexact.vllm_matrix import (
    FULL,
    GROUPS,
    LAYOUTS,
    SUMMARY,
    Outcome,
    difference,
    run_engine,
)

pytestmark = pytest.mark.vllm

MODEL_DTYPES = (
    list(itertools.product(["llama", "qwen2", "qwen3", "smollm2"], ["fp32", "bf16"]))
    if FULL
    else [("llama", "fp32")]
)
STORES = ["cpu", "lm", "redis", "disk"] if FULL else ["cpu", "lm"]
VARIANTS = [
    (store, schedule)
    for store in STORES
    for schedule in ("layer_sync", "sequential")
    if (store, schedule) != ("cpu", "layer_sync")  # the reference
]
_runs: dict[tuple[str, ...], dict[str, Outcome]] = {}


@pytest.fixture(scope="module")
def store_specs(
    request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory
) -> dict[str, str]:
    specs = {"cpu": "cpu", "lm": request.getfixturevalue("lm_server")}
    if FULL:
        specs["redis"] = request.getfixturevalue("redis_server")
        specs["disk"] = f"disk://{Path(tmp_path_factory.mktemp('kmesh-disk')).resolve()}"
    return specs


def _run(specs: dict[str, str], model: str, dtype: str, store: str, schedule: str,
         fail: str | None = None, cascade: bool = False,
         drift: str = "auto") -> dict[str, Outcome]:  # fmt: skip
    key = (model, dtype, store, schedule, fail or "", str(cascade), drift)
    if key not in _runs:
        _runs[key] = run_engine(model, dtype, specs[store], schedule, fail, cascade, drift)
    return _runs[key]


@pytest.mark.parametrize(("model", "dtype"), MODEL_DTYPES)
def test_reference_run_really_reuses(store_specs: dict[str, str], model: str, dtype: str) -> None:
    ref = _run(store_specs, model, dtype, "cpu", "layer_sync")
    assert len(ref) == len(LAYOUTS) * sum(GROUPS)
    for key, out in ref.items():
        assert out.report.get("fallback") is None, key
        assert out.report["reused_tokens"] >= 64, key  # at least segment A
        assert 0 < out.report["recomputed_tokens"] < out.report["reused_tokens"], key
        assert out.kv is not None and len(out.tokens) == len(out.logprobs) > 0, key


@pytest.mark.parametrize(("store", "schedule"), VARIANTS)
@pytest.mark.parametrize(("model", "dtype"), MODEL_DTYPES)
def test_run_is_bit_identical_to_reference(
    store_specs: dict[str, str], model: str, dtype: str, store: str, schedule: str
) -> None:
    ref = _run(store_specs, model, dtype, "cpu", "layer_sync")
    got = _run(store_specs, model, dtype, store, schedule)
    diffs = {k: d for k in ref if (d := difference(ref[k], got[k])) is not None}
    case = f"{model} {dtype} store={store} schedule={schedule}"
    first = next(iter(diffs.items()), None)
    SUMMARY.append((case, "cpu, layer_sync", len(ref), f"FAIL {first}" if first else "identical"))
    assert set(got) == set(ref)
    assert not diffs, f"{len(diffs)} follow-ups differ; first: {first}"


@pytest.mark.parametrize(("model", "dtype"), MODEL_DTYPES)
def test_one_failed_load_recomputes_and_siblings_keep_their_bits(
    store_specs: dict[str, str], model: str, dtype: str
) -> None:
    """One of four follow-ups fails its load: it recomputes its whole prompt (tokens equal to
    vLLM's own full prefill of it); the three others keep their reuse, tokens and prompt KV."""
    fail = "middle/4/2"
    ref = _run(store_specs, model, dtype, "cpu", "layer_sync")
    got = _run(store_specs, model, dtype, "cpu", "layer_sync", fail=fail)
    failed = got[fail]
    assert str(failed.report.get("fallback")).startswith("load error: injected")
    assert failed.report["reused_tokens"] == 0
    assert failed.tokens == got[f"{fail}/plain"].tokens
    for i in (0, 1, 3):
        key = f"middle/4/{i}"
        assert got[key].report.get("fallback") is None and got[key].report["reused_tokens"] > 0
        assert got[key].tokens == ref[key].tokens
        assert got[key].kv is not None and ref[key].kv is not None
        assert torch.equal(got[key].kv, ref[key].kv)
    SUMMARY.append((f"{model} {dtype} one failed load", "cpu, layer_sync", 4, "as required"))


CASCADE_LOGPROB_BOUND = 1e-4  # fp32: cascade decode sums the same attention in another order


@pytest.mark.parametrize(("model", "dtype"), [md for md in MODEL_DTYPES if md[1] == "fp32"])
def test_cascade_decode_keeps_every_layout(store_specs: dict[str, str], model: str, dtype: str,
                                           monkeypatch: pytest.MonkeyPatch) -> None:  # fmt: skip
    """Cascade decode on, every layout (one document read twice, adjacent or apart, included):
    the same tokens as the reference (cascade off), log-probabilities within
    `CASCADE_LOGPROB_BOUND`, the same prompt KV bit for bit, every decode step in cascade."""
    # Both without drift correction: the engine turns it off under cascade decode. Both stop
    # the blend where an engine does (`scheduler_reuse.blend_end`), cascade decode or not.
    ref = _run(store_specs, model, dtype, "cpu", "layer_sync", drift="off")
    got = _run(store_specs, model, dtype, "cpu", "layer_sync", cascade=True, drift="off")
    bad = {}
    for key, want in ref.items():
        out = got[key]
        assert out.report.get("cascade_steps") == len(out.tokens) - 1, (key, out.report)
        assert out.report.get("cascade_off") is None, (key, out.report)
        worst = max(abs(a - b) for a, b in zip(out.logprobs, want.logprobs, strict=True))
        if out.tokens != want.tokens or worst > CASCADE_LOGPROB_BOUND:
            bad[key] = f"tokens {out.tokens} vs {want.tokens}, log-probabilities {worst:.2e} apart"
        elif out.kv is None or want.kv is None or not torch.equal(out.kv, want.kv):
            bad[key] = "prompt KV differs"
    first = next(iter(bad.items()), None)
    result = (
        f"FAIL {first}" if first else f"tokens equal, log-probabilities ≤ {CASCADE_LOGPROB_BOUND}"
    )
    SUMMARY.append((f"{model} {dtype} cascade decode on", "cpu, layer_sync", len(ref), result))
    assert not bad, f"{len(bad)} follow-ups differ; first: {first}"


def test_negative_control_one_bit_is_detected(store_specs: dict[str, str]) -> None:
    model, dtype = MODEL_DTYPES[0]
    ref = _run(store_specs, model, dtype, "cpu", "layer_sync")
    out = ref["several/4/1"]
    assert difference(out, out) is None
    flipped = copy.deepcopy(out)
    assert flipped.kv is not None
    raw = flipped.kv.view(-1).view(torch.uint8)
    raw[raw.numel() // 2] ^= 1  # one bit of one KV entry
    assert difference(out, flipped) is not None
    lp = copy.deepcopy(out)
    bits = torch.tensor(lp.logprobs, dtype=torch.float64).view(torch.int64)
    bits[-1] ^= 1  # the last bit of one log-probability
    lp.logprobs = bits.view(torch.float64).tolist()
    assert difference(out, lp) is not None
    SUMMARY.append((f"{model} {dtype} negative control", "itself, one bit flipped", 1, "detected"))
