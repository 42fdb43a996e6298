"""Families across engines, through real processes: ``redis-server``, two vLLM OpenAI servers with
KMesh (tiny Llama, fp32, ratio 1.0) and ``vllm-router --policy sticky_least_loaded`` in front.

One run (module fixture, ≈3 min on 2 cores): four families of four members over their own
416-token documents, members sent through the router with `Encoded.routed`; after each family's
second member one engine is killed; the third members are sent with a client's retries until the
router's breaker takes the dead engine out; the fourth close their families, and
`routing.end_session` ends the router's sessions. A family in separator mode is named by the
``X-Session-ID`` header alone (the `FamilyHeader` middleware). Then stock vLLM, in this process
and one request at a time, answers every prompt for comparison.
"""

from __future__ import annotations

import gc
from pathlib import Path
from typing import Any

import pytest
import torch

from kmesh_blend.routing import end_session, session_headers
from kmesh_blend.segments.client import Encoded
from kmesh_blend.testing import TINY_LLAMA, build_checkpoint
from kmesh_blend.testing.engine import make_llm
from kmesh_blend.testing.fleet import Fleet, metric_sum

pytestmark = [pytest.mark.vllm, pytest.mark.timeout(1500)]

DOC, FAMILIES, MEMBERS, SEP = 416, 4, 4, [2, 2]
Out = tuple[list[int], dict[str, Any]]  # generated tokens, kmesh report


def _family(seed: int) -> list[Encoded]:
    gen = torch.Generator().manual_seed(seed)
    doc = torch.randint(3, 2048, (DOC,), generator=gen).tolist()
    out = []
    for i in range(MEMBERS):
        private = torch.randint(3, 2048, (17 + 6 * i,), generator=gen).tolist()
        question = torch.randint(3, 2048, (9 + i,), generator=gen).tolist()
        out.append(Encoded(private + doc + question, [(len(private), len(private) + DOC)]))
    return out


def _separated(seed: int, n: int) -> list[list[int]]:
    """Separator-mode prompts ``lead-in <sep> document <sep> question`` (no annotation)."""
    gen = torch.Generator().manual_seed(seed)
    doc = torch.randint(3, 2048, (DOC,), generator=gen).tolist()
    return [
        torch.randint(3, 2048, (11 + 4 * i,), generator=gen).tolist() + SEP + doc + SEP
        + torch.randint(3, 2048, (7,), generator=gen).tolist()
        for i in range(n)
    ]  # fmt: skip


class Run:
    """What the run recorded: per family, per member, (tokens, report)."""

    def __init__(self) -> None:
        self.members: dict[str, list[Out]] = {}
        self.prompts: dict[str, list[list[int]]] = {}
        self.retained: list[float] = []  # per engine, before the kill
        self.killed = ""
        self.router_log = ""
        self.stock: dict[str, list[list[int]]] = {}


def _send(fleet: Fleet, model: str, ids: list[int], body: dict[str, Any],
          headers: dict[str, str], retries: int = 0) -> Out:  # fmt: skip
    request = {"model": model, "prompt": ids, "max_tokens": 8, "temperature": 0,
               "return_token_ids": True, **body}  # fmt: skip
    out = fleet.post("/v1/completions", request, headers, retries=retries)
    return list(out["choices"][0]["token_ids"]), (out.get("kv_transfer_params") or {}).get(
        "kmesh", {}
    )


@pytest.fixture(scope="module")
def run(tmp_path_factory: pytest.TempPathFactory) -> Run:
    model = str(build_checkpoint(TINY_LLAMA))
    fams = {f"fam-{k}": _family(100 + k) for k in range(FAMILIES)}
    got = Run()
    got.prompts = {name: [e.token_ids for e in members] for name, members in fams.items()}
    got.prompts["sep-fam"] = _separated(7, 2)
    got.prompts["no-header"] = _separated(8, 1)
    got.members = {name: [] for name in got.prompts}
    logs = tmp_path_factory.mktemp("fleet")
    with Fleet(model, logs, settings={"recompute_ratio": 1.0, "separator": SEP}) as fleet:

        def member(name: str, j: int, retries: int = 0) -> None:
            enc = fams[name][j]
            routed = enc.routed(family=name, close=j == MEMBERS - 1)
            got.members[name].append(
                _send(fleet, model, enc.token_ids, routed.extra_body, routed.headers, retries)
            )

        for j in (0, 1):  # every family's first member first: the router places four sessions
            for name in fams:
                member(name, j)
        got.retained = [metric_sum(fleet.metrics(i), "vllm:kmesh_retained_bytes") for i in (0, 1)]
        for ids in got.prompts["sep-fam"]:  # separator mode: the header alone names the family
            got.members["sep-fam"].append(_send(fleet, model, ids, {}, session_headers("sep-fam")))
        ids = got.prompts["no-header"][0]
        got.members["no-header"].append(_send(fleet, model, ids, {}, {}))
        got.killed = got.members["fam-1"][1][1]["engine"]
        fleet.kill(int(got.killed.rsplit("-", 1)[1]))
        for j in (2, 3):
            for name in fams:
                member(name, j, retries=20)
        for name in fams:
            end_session(fleet.router, name)
        got.router_log = (logs / "router.log").read_text(errors="replace")
    llm = make_llm(model)  # stock vLLM, one request at a time (its batching changes bits)
    try:
        from vllm import SamplingParams

        params = SamplingParams(temperature=0.0, max_tokens=8)
        for name, prompts in got.prompts.items():
            outs = [llm.generate([{"prompt_token_ids": p}], params, use_tqdm=False)[0]
                    for p in prompts]  # fmt: skip
            got.stock[name] = [list(o.outputs[0].token_ids) for o in outs]
    finally:
        del llm
        gc.collect()
    return got


def _engines(run: Run, name: str, members: range) -> set[str]:
    return {run.members[name][j][1]["engine"] for j in members}


def test_a_family_sticks_to_one_engine_and_families_split_across_both(run: Run) -> None:
    for name in (f"fam-{k}" for k in range(FAMILIES)):
        assert len(_engines(run, name, range(2))) == 1, run.members[name]
        assert all(r["family"] == name for _, r in run.members[name])
    placed = [next(iter(_engines(run, f"fam-{k}", range(2)))) for k in range(FAMILIES)]
    assert sorted(placed) == ["engine-0", "engine-0", "engine-1", "engine-1"]


def test_each_master_is_held_by_one_engine_and_read_from_the_store_at_most_once(run: Run) -> None:
    for k in range(FAMILIES):
        reports = [r for _, r in run.members[f"fam-{k}"]]
        assert [r["reused_tokens"] for r in reports[1:]] == [DOC] * (MEMBERS - 1)
        assert sum(r["storage_reads"] for r in reports) <= 1, reports
    # Two families per engine, each engine holding its own two masters only (equal sizes).
    assert run.retained[0] == run.retained[1] > 0


def test_a_killed_engines_families_move_and_recover_from_the_store_with_one_read(
    run: Run,
) -> None:
    moved = [f"fam-{k}" for k in range(FAMILIES) if _engines(run, f"fam-{k}", range(2)) ==
             {run.killed}]  # fmt: skip
    assert len(moved) == 2
    for name in moved:
        reports = [r for _, r in run.members[name]]
        assert {r["engine"] for r in reports[2:]} == {"engine-0", "engine-1"} - {run.killed}
        assert reports[2]["storage_reads"] == 1 and reports[2]["reused_tokens"] == DOC
        assert reports[2]["fallback"] is None
        assert reports[3]["storage_reads"] == 0 and reports[3]["reused_tokens"] == DOC


def test_every_answer_equals_stock_vllm_at_ratio_one(run: Run) -> None:
    for name, members in run.members.items():
        assert [tokens for tokens, _ in members] == run.stock[name], name


def test_separator_mode_takes_the_family_from_the_header_alone(run: Run) -> None:
    first, second = (r for _, r in run.members["sep-fam"])
    assert first["family"] == second["family"] == "sep-fam"
    assert first["engine"] == second["engine"]
    assert second["reused_tokens"] >= DOC and second["fallback"] is None
    alone = run.members["no-header"][0][1]  # separator mode without the header: no family
    assert "family" not in alone and alone["fallback"] is None


def test_closing_a_family_ends_its_router_session(run: Run) -> None:
    for k in range(FAMILIES):
        assert f"SLL: finished session 'fam-{k}'" in run.router_log
    assert "finish_session for unknown session" not in run.router_log


@pytest.mark.timeout(900)
def test_the_routed_agents_example_keeps_each_team_on_one_engine() -> None:
    import re
    import subprocess
    import sys

    root = Path(__file__).resolve().parents[2]
    proc = subprocess.run(
        [sys.executable, str(root / "examples" / "routed_agents.py")],
        cwd=root, capture_output=True, text=True, timeout=850,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    pattern = re.compile(r"(team-\d) +(notice|agent \d) +→ (engine-\d): reused +(\d+), "
                         r"storage reads (\d+), fallback (.*)")  # fmt: skip
    rows = [m.groups() for m in map(pattern.match, proc.stdout.splitlines()) if m]
    assert len(rows) == 3 * 4, proc.stdout
    for team in {r[0] for r in rows}:
        mine = [r for r in rows if r[0] == team]
        assert len({r[2] for r in mine}) == 1, mine  # one engine per team
        assert all(r[3] == "512" and r[5] == "None" for r in mine if r[1] != "notice"), mine
    assert proc.stdout.rstrip().endswith("router sessions ended: team-0, team-1, team-2")
