"""What `bench/selection_ceiling.py` and `bench/beyond_selection.py` share: the SmolLM2 quality
tasks on an fp32 engine, and one request's blend run layer by layer on given stale rows."""

from __future__ import annotations

from typing import Any

from kmesh_blend.blend import BlendResult, RequestBlend


def run_on_stale(blend: RequestBlend, stale: BlendResult) -> BlendResult:
    """All layers of one request; the stored rows are ``stale``'s (a ratio-0 blend of the same
    request: the re-positioned masters), copied per layer since the blend writes into them."""
    for layer in range(len(stale.keys)):
        inp = blend.begin(layer, stale.keys[layer].clone(), stale.values[layer].clone())
        blend.end(layer, blend.attend(layer, inp))
    return blend.finish()


def smollm2_tasks(quick: bool, check_layers: tuple[int, ...],
                  num_tasks: int = 8) -> tuple[Any, list[Any], Any, Any]:  # fmt: skip
    """(tokenizer, tasks, engine, model): `bench/quality.py --model smollm2`'s chat tasks (the
    first ``num_tasks``, 2 when ``quick``) and an fp32 vLLM engine with KMesh, whose loaded model
    the blends run on (close the engine with `kmesh_blend.quality.report.close`)."""
    from transformers import AutoTokenizer

    from kmesh_blend.quality.chat import chat_tasks
    from kmesh_blend.quality.report import engine
    from kmesh_blend.testing import smollm2_checkpoint

    tokenizer = AutoTokenizer.from_pretrained(smollm2_checkpoint())
    tasks = chat_tasks(tokenizer, 2 if quick else num_tasks, doc_tokens=192)
    llm, model = engine(smollm2_checkpoint(), check_layers, 2048)
    return tokenizer, tasks, llm, model
