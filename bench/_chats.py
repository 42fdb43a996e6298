"""Chat requests sharing one long system prompt: the unannotated half of the mixed workload.

Every chat is the same system prompt of ``system_len`` tokens followed by its own user turn, so
vLLM's prefix cache serves the system prompt's full blocks to every chat after the first — the
exact-prefix reuse a deployment relies on, which KMesh must leave intact.
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import torch

from kmesh_blend.quality.text import reference_text

SYSTEM_TOPICS = ("for", "while", "if", "with")  # Language Reference sections: ≈ 2,600 tokens
USER_TURNS = [
    "Does a for loop's else clause run after a break?",
    "How is the with statement's __exit__ told about an exception?",
    "What does elif add over nested if statements?",
    "Can the target of a for loop be a tuple? Give an example.",
    "When is the else clause of a while loop executed?",
    "What does the with statement do with several context managers?",
    "Summarize the if statement's rules in one sentence.",
    "Is the loop variable still bound after a for loop ends?",
    "What is the order of __enter__ calls with nested managers?",
    "How does continue interact with a for loop's else clause?",
    "What does the while statement repeat, exactly?",
    "What value does the with statement bind with 'as'?",
    "Can an if statement have an empty body? What to write?",
]


def shared_system_chats(
    model: str, path: Path, count: int, system_len: int = 1024
) -> tuple[list[list[int]], dict[str, Any]]:
    """``count`` chat prompts (token ids) sharing a ``system_len``-token system prompt, and the
    workload's facts for a result's config. ``model``: ``smollm2`` (its chat template around
    real text) or ``bench`` (random tokens, seeded)."""
    if count > len(USER_TURNS):
        raise ValueError(f"at most {len(USER_TURNS)} distinct chats, asked for {count}")
    if model == "bench":
        from kmesh_blend.testing import BENCH_LLAMA

        gen = torch.Generator().manual_seed(1)

        def rand(n: int) -> list[int]:
            return torch.randint(3, BENCH_LLAMA.vocab_size, (n,), generator=gen).tolist()

        system = rand(system_len)
        chats = [system + rand(32) for _ in range(count)]
        return chats, {"chat_system_tokens": system_len, "chat_user_tokens": 32}
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(path)

    def encode(text: str) -> list[int]:
        return list(tok(text, add_special_tokens=False)["input_ids"])

    system = encode(reference_text(SYSTEM_TOPICS))[:system_len]
    placeholder = "\x00SYSTEM\x00"
    chats = []
    for turn in USER_TURNS[:count]:
        messages = [{"role": "system", "content": placeholder}, {"role": "user", "content": turn}]
        text = tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
        before, after = text.split(placeholder)
        chats.append(encode(before) + system + encode(after))
    details = {
        "chat_system_source": f"kmesh_blend.quality.text.reference_text({SYSTEM_TOPICS}) "
        f"(Python {sys.version.split()[0]}), cut at {system_len} SmolLM2 tokens",
        "chat_tokens": [len(c) for c in chats],
    }
    return chats, details
