"""`Tails` without an engine: the forward hook places the blend's final hidden state at the row
whose slot is the request's last prompt token, and only there."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from kmesh_blend.vllm import tails as tails_mod
from kmesh_blend.vllm.paged import slot_mapping
from kmesh_blend.vllm.tails import Tails


class _Model(torch.nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * 2.0


def _kept(tails: Tails, req_id: str, block: int, final: torch.Tensor) -> None:
    k = torch.zeros(6, 1, 2)  # [T, Hkv, D]; rows 4..5 are the tail
    tails.keep(req_id, slot_mapping([block], 16, 4, 6), 4, [k], [k.clone()], final)


def test_final_hidden_state_replaces_only_its_own_row(monkeypatch: pytest.MonkeyPatch) -> None:
    failed: set[str] = set()
    model = _Model()
    tails = Tails(model, lambda r: r in failed)
    # Two requests in one forward: req a's last token sits at slot 3*16+5, b's at 7*16+5.
    slots = torch.tensor([3 * 16 + 4, 3 * 16 + 5, 7 * 16 + 4, 7 * 16 + 5, 99])
    monkeypatch.setattr(tails_mod, "step_slots", lambda: slots)
    _kept(tails, "a", 3, torch.full((4,), 7.0))
    _kept(tails, "b", 7, torch.full((4,), 9.0))
    failed.add("b")  # a failed load keeps vLLM's own output
    out = model(torch.ones(5, 4))
    want = torch.full((5, 4), 2.0)
    want[1] = 7.0
    assert torch.equal(out, want)
    assert tails.placed == 1
    out = model(torch.ones(5, 4))  # a later forward: nothing pending any more
    assert torch.equal(out, torch.full((5, 4), 2.0))


def test_missing_slot_or_closed_hook_leaves_vllms_output(monkeypatch: pytest.MonkeyPatch) -> None:
    model = _Model()
    tails = Tails(model, lambda r: False)
    monkeypatch.setattr(tails_mod, "step_slots", lambda: torch.tensor([1, 2, 3]))
    _kept(tails, "a", 3, torch.full((4,), 7.0))
    assert torch.equal(model(torch.ones(3, 4)), torch.full((3, 4), 2.0))
    assert tails.placed == 0
    tails.close()
    monkeypatch.setattr(tails_mod, "step_slots", lambda: torch.tensor([3 * 16 + 5]))
    _kept(tails, "a", 3, torch.full((4,), 7.0))
    assert torch.equal(model(torch.ones(1, 4)), torch.full((1, 4), 2.0))


def test_write_back_skips_failed_requests() -> None:
    written: list[Any] = []

    class _Paged:
        def write(self, cache: Any, k: Any, v: Any, slots: torch.Tensor) -> None:
            written.append(slots.tolist())

    tails = Tails(None, lambda r: r == "bad")
    _kept(tails, "good", 2, torch.zeros(4))
    _kept(tails, "bad", 5, torch.zeros(4))
    tails.write_back(_Paged(), [torch.zeros(1)])  # type: ignore[arg-type]
    assert written == [[2 * 16 + 4, 2 * 16 + 5]]
    assert tails.rows == {} and tails.finals == {}
