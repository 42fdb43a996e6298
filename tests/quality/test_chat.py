"""Multi-document chat tasks (built with SmolLM2's own chat template) and their harness (on the
trained quality model): exactness at ratio 1.0, metrics that can fail, the rules' token counts."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from kmesh_blend.models import ReferenceModel
from kmesh_blend.quality import Setting
from kmesh_blend.quality.chat import ChatDocument, ChatPrompt, ChatTask, chat_tasks
from kmesh_blend.quality.chat_harness import (
    evaluate_chat,
    full_prefill_agreement,
    masters,
    near_ties,
    references,
)
from kmesh_blend.testing.quality import quality_model_dir


@pytest.fixture(scope="module")
def tokenizer() -> Any:
    from transformers import AutoTokenizer

    from kmesh_blend.testing.smollm2 import smollm2_checkpoint

    return AutoTokenizer.from_pretrained(smollm2_checkpoint())


def test_chat_tasks_place_each_document_whole_in_every_prompt(tokenizer: Any) -> None:
    tasks = chat_tasks(tokenizer, 4, doc_tokens=96, group_size=4)
    assert [len(t.documents) for t in tasks] == [2, 3, 4, 1]
    names = [d.name for t in tasks for d in t.documents]
    assert len(set(names)) == len(names)  # distinct documents across tasks
    assert any(n.startswith("code:") for n in names) and any(n.startswith("ref:") for n in names)
    for task in tasks:
        docs = {d.name: d for d in task.documents}
        for prompt in (*task.readers, *task.requests):
            text = tokenizer.decode(list(prompt.token_ids))
            assert text.startswith("<|im_start|>system\n")
            assert text.endswith("<|im_start|>assistant\n")
            for start, end, name in prompt.spans:
                assert prompt.token_ids[start:end] == docs[name].token_ids
                assert len(docs[name].token_ids) == 96
        assert all(len(r.spans) == 1 for r in task.readers)
        assert all(len(r.spans) == len(task.documents) for r in task.requests)
    # The family varies the order of its documents and its private text.
    orders = {tuple(n for *_, n in r.spans) for r in tasks[2].requests}
    assert len(orders) > 1
    assert len({r.token_ids[:30] for r in tasks[2].requests}) == 4
    assert [r.kind for r in tasks[0].requests] == ["quote", "which", "summary", "quote"]
    assert {r.kind for r in tasks[0].readers} == {"reader"}


@pytest.fixture(scope="module")
def model() -> ReferenceModel:
    return ReferenceModel.load(quality_model_dir(), torch.float32)


def _random_task(vocab: int, seed: int) -> ChatTask:
    """Two 40-token documents read by readers and a family of three (random ids)."""
    gen = torch.Generator().manual_seed(seed)

    def ids(n: int) -> tuple[int, ...]:
        return tuple(torch.randint(3, vocab, (n,), generator=gen).tolist())

    docs = (ChatDocument("a", "A", ids(40)), ChatDocument("b", "B", ids(40)))

    def prompt(order: list[ChatDocument], head: int) -> ChatPrompt:
        tokens, spans = list(ids(head)), []
        for doc in order:
            spans.append((len(tokens), len(tokens) + 40, doc.name))
            tokens += list(doc.token_ids) + list(ids(3))
        return ChatPrompt(tuple(tokens + list(ids(6))), tuple(spans))

    readers = tuple(prompt([d], 5 + k) for k, d in enumerate(docs))
    family = (prompt(list(docs), 9), prompt(list(docs[::-1]), 12), prompt([docs[1]], 7))
    return ChatTask(docs, readers, family)


def test_harness_is_exact_at_ratio_one_and_can_fail(model: ReferenceModel) -> None:
    tasks = [_random_task(model.shape.vocab_size, seed) for seed in range(2)]
    settings = [Setting(1.0), Setting(0.0), Setting(0.0, sink_tokens=6)]
    settings.append(Setting(0.25, sink_tokens=4))
    report = evaluate_chat(model, tasks, settings, check_layers=(1,), answer_tokens=6)
    exact, plain, sinks, both = report.results
    assert (exact.agreement, exact.kl, exact.identical_answers, exact.answer_prefix) == (1, 0, 1, 1)
    assert exact.recomputed == 1.0
    assert plain.kl > 0 and plain.recomputed == 0.0  # stale KV shows
    assert sinks.kl != plain.kl
    reused = sum(40 * len(r.spans) for t in tasks for r in t.requests)
    uses = sum(len(r.spans) for t in tasks for r in t.requests)
    assert sinks.recomputed == pytest.approx(6 * uses / reused)
    # sink+deviation: 4 sinks per use, then 0.25 of the other 36 tokens (9) by deviation.
    assert both.recomputed == pytest.approx(13 * uses / reused)
    assert report.num_positions == 6 * 6 and report.documents == [2, 2, 1] * 2
    assert exact.agreement_by_kind == {"reader": 1.0}  # the random tasks' prompts have no kind
    assert plain.kl_se > 0


def test_masters_come_from_each_documents_reader(model: ReferenceModel) -> None:
    task = _random_task(model.shape.vocab_size, 0)
    source = masters(model, task)
    for reader in task.readers:
        ((start, end, name),) = reader.spans
        assert torch.equal(source.positions(name), torch.arange(start, end))


def test_the_report_compares_rules_at_equal_recomputed_tokens() -> None:
    from kmesh_blend.blend import keep_count
    from kmesh_blend.quality import frontier as real

    settings = real.rule_settings(192)
    assert len(settings) == 29 and len(set(settings)) == 29
    assert {s for s in settings if s.ratio in real.GOAL_RATIOS} == {
        Setting(r, drift=d) for r in real.GOAL_RATIOS for d in ("off", "auto")
    }
    drift = [s for s in settings if s.drift == "auto"]
    assert [s.ratio for s in drift] == [0.05, 0.15, 0.3, 0.5, 0.7]
    assert {s.rule for s in drift} == {"deviation+drift"} and drift[1].label.endswith(" drift")
    assert Setting(0.0, drift="auto").rule == "none"  # no check layer: nothing to correct
    assert [real.nominal(Setting(r), 192) for r in real.GOAL_RATIOS] == [
        "deviation 0.5",
        "deviation 0.7",
    ]
    counts: dict[tuple[str, str], set[int]] = {}
    for s in settings:
        share = real.nominal(s, 192).split()[-1]
        count = s.sink_tokens + keep_count(s.ratio, 192 - s.sink_tokens)
        counts.setdefault((s.selection, share), set()).add(count)
    assert all(len(c) == 1 for c in counts.values()), counts  # every rule: the same tokens
    assert counts[("per_request", "0.15")] == {29}


def test_precision_floor_scores_another_models_full_prefill(model: ReferenceModel) -> None:
    tasks = [_random_task(model.shape.vocab_size, seed) for seed in range(2)]
    refs = references(model, tasks, answer_tokens=6)
    same = full_prefill_agreement(model, tasks, refs)
    assert (same.agreement, same.kl, same.identical_answers) == (1.0, 0.0, 1.0)
    coarse = ReferenceModel.load(quality_model_dir(), torch.bfloat16)
    other = full_prefill_agreement(coarse, tasks, refs)
    assert other.kl > 0  # bf16 numerics move the scores
    ties = near_ties(refs, (0.0, 1e9))
    assert ties == {0.0: 0.0, 1e9: 1.0}
    mid = near_ties(refs, (0.5,))[0.5]
    lead = torch.cat([r.rows for t in refs for r in t]).log_softmax(-1).topk(2).values
    assert mid == pytest.approx(float((lead[:, 0] - lead[:, 1] < 0.5).float().mean()))
