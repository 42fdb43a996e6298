"""`Tails` without an engine: the forward hook places the blend's final hidden states at the rows
whose slots are the request's last prompt tokens, and only there; a forward of kept tails only
is not run at all."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from kmesh_blend.vllm import tails as tails_mod
from kmesh_blend.vllm.paged import slot_mapping
from kmesh_blend.vllm.tails import Tails


class _Model(torch.nn.Module):
    """vLLM's call shape: ``model(input_ids=…, positions=…)`` → [T, 4], every entry 2.0."""

    def __init__(self) -> None:
        super().__init__()
        self.calls = 0

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        self.calls += 1
        return torch.full((input_ids.shape[0], 4), 2.0)


def _run(model: _Model, num_tokens: int) -> torch.Tensor:
    out = model(input_ids=torch.ones(num_tokens, dtype=torch.int64),
                positions=torch.arange(num_tokens))  # fmt: skip
    assert isinstance(out, torch.Tensor)
    return out


def _kept(tails: Tails, req_id: str, block: int, final: torch.Tensor,
          written: bool = False) -> None:  # fmt: skip
    """``final``: [m, 4], the states of the last m of the tail's 2 tokens."""
    k = torch.zeros(6, 1, 2)  # [T, Hkv, D]; rows 4..5 are the tail
    tails.keep(req_id, slot_mapping([block], 16, 4, 6), 4, [k], [k.clone()], final, written)


def test_final_hidden_state_replaces_only_its_own_row(monkeypatch: pytest.MonkeyPatch) -> None:
    failed: set[str] = set()
    model = _Model()
    tails = Tails(model, lambda r: r in failed)
    # Two requests in one forward: req a's last token sits at slot 3*16+5, b's at 7*16+5.
    slots = torch.tensor([3 * 16 + 4, 3 * 16 + 5, 7 * 16 + 4, 7 * 16 + 5, 99])
    monkeypatch.setattr(tails_mod, "step_slots", lambda: slots)
    _kept(tails, "a", 3, torch.full((1, 4), 7.0))
    _kept(tails, "b", 7, torch.full((1, 4), 9.0))
    failed.add("b")  # a failed load keeps vLLM's own output
    out = _run(model, 5)
    want = torch.full((5, 4), 2.0)
    want[1] = 7.0
    assert torch.equal(out, want)
    assert tails.placed == 1
    out = _run(model, 5)  # a later forward: nothing pending any more
    assert torch.equal(out, torch.full((5, 4), 2.0))


def test_missing_slot_or_closed_hook_leaves_vllms_output(monkeypatch: pytest.MonkeyPatch) -> None:
    model = _Model()
    tails = Tails(model, lambda r: False)
    monkeypatch.setattr(tails_mod, "step_slots", lambda: torch.tensor([1, 2, 3]))
    _kept(tails, "a", 3, torch.full((1, 4), 7.0))
    assert torch.equal(_run(model, 3), torch.full((3, 4), 2.0))
    assert tails.placed == 0
    tails.close()
    monkeypatch.setattr(tails_mod, "step_slots", lambda: torch.tensor([3 * 16 + 5]))
    _kept(tails, "a", 3, torch.full((1, 4), 7.0))
    assert torch.equal(_run(model, 1), torch.full((1, 4), 2.0))


def test_write_back_skips_failed_requests() -> None:
    written: list[Any] = []

    class _Paged:
        def write(self, cache: Any, k: Any, v: Any, slots: torch.Tensor) -> None:
            written.append(slots.tolist())

    tails = Tails(None, lambda r: r == "bad")
    _kept(tails, "good", 2, torch.zeros(1, 4))
    _kept(tails, "bad", 5, torch.zeros(1, 4))
    tails.write_back(_Paged(), [torch.zeros(1)])  # type: ignore[arg-type]
    assert written == [[2 * 16 + 4, 2 * 16 + 5]]
    assert tails.rows == {} and tails.finals == {}


def _two_tails(tails: Tails) -> torch.Tensor:
    """Requests a (block 3) and b (block 7), both tail rows with their states; returns the
    forward's output the skip must give for the step order [b's 2 rows, a's 2 rows]."""
    states_a = torch.tensor([[1.0] * 4, [3.0] * 4])
    states_b = torch.tensor([[5.0] * 4, [7.0] * 4])
    _kept(tails, "a", 3, states_a, written=True)  # the blend wrote a's rows into the cache
    _kept(tails, "b", 7, states_b)
    return torch.cat([states_b, states_a])


def test_a_forward_of_kept_tails_only_is_not_run(monkeypatch: pytest.MonkeyPatch) -> None:
    model = _Model()
    tails = Tails(model, lambda r: False, skip_forward=True)
    slots = torch.tensor([7 * 16 + 4, 7 * 16 + 5, 3 * 16 + 4, 3 * 16 + 5])
    monkeypatch.setattr(tails_mod, "step_slots", lambda: slots)
    want = _two_tails(tails)
    assert torch.equal(_run(model, 4), want)  # each row its own slot's state, in step order
    assert (model.calls, tails.skipped, tails.placed) == (0, 1, 0)
    assert list(tails.rows) == ["b"]  # a's rows stand in the cache: no forward wrote over them
    assert torch.equal(_run(model, 4), torch.full((4, 4), 2.0))  # consumed: the next one runs
    assert model.calls == 1
    tails.close()
    assert "forward" not in model.__dict__  # the class's own forward again


@pytest.mark.parametrize("case", ["other token", "failed", "last state only", "off"])
def test_the_forward_runs_unless_every_token_is_a_kept_tail(
    monkeypatch: pytest.MonkeyPatch, case: str
) -> None:
    model = _Model()
    failed = {"b"} if case == "failed" else set()
    tails = Tails(model, lambda r: r in failed, skip_forward=case != "off")
    slots = [7 * 16 + 4, 7 * 16 + 5, 3 * 16 + 4, 3 * 16 + 5]
    if case == "other token":
        slots.append(99)  # another request's decode token in the same step
    monkeypatch.setattr(tails_mod, "step_slots", lambda: torch.tensor(slots))
    if case == "last state only":
        _kept(tails, "a", 3, torch.full((1, 4), 3.0))
        _kept(tails, "b", 7, torch.full((1, 4), 7.0))
    else:
        _two_tails(tails)
    out = _run(model, len(slots))
    assert model.calls == 1 and tails.skipped == 0
    want = torch.full((len(slots), 4), 2.0)
    want[3] = 3.0  # the states are placed into the forward's output instead
    if case != "failed":
        want[1] = 7.0
    if case not in ("last state only",):
        want[2] = 1.0
        if case != "failed":
            want[0] = 5.0
    assert torch.equal(out, want)
