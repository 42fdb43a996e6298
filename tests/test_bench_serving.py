"""bench/serving.py: the agent-family workload, the client's arguments, the sustained-rate rule,
the counters read from ``/metrics``, and the quick run end to end (real OpenAI servers, vLLM's
own client) with every field of its result checked."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

BENCH = Path(__file__).resolve().parents[1] / "bench"
sys.path.insert(0, str(BENCH))
import _serving  # noqa: E402
import serving  # noqa: E402


@pytest.fixture(scope="module")
def tokenizer() -> Any:
    from transformers import AutoTokenizer

    from kmesh_blend.testing import smollm2_checkpoint

    return AutoTokenizer.from_pretrained(str(smollm2_checkpoint()))


def test_families_share_their_document_between_separators(tokenizer: Any) -> None:
    work = _serving.agent_families(tokenizer, 3, 4, (200, 260), 16, seed=3)
    assert len(work.rows) == 12 and all(r["output_tokens"] == 16 for r in work.rows)
    sep = _serving.separator_id(tokenizer)
    docs: dict[int, set[tuple[int, ...]]] = {}
    for row, k in zip(work.rows, work.family, strict=True):
        ids = tokenizer(row["prompt"], add_special_tokens=False)["input_ids"]
        assert ids.count(sep) == 2, "one document between two separators"
        a, b = ids.index(sep), len(ids) - 1 - ids[::-1].index(sep)
        docs.setdefault(k, set()).add(tuple(ids[a + 1 : b]))
        assert ids[:a] != [], "the agent's own instructions come first"
    for k, found in docs.items():
        assert len(found) == 1, f"family {k}'s agents read different document tokens"
        assert 190 <= len(next(iter(found))) <= 270
    assert len({next(iter(d)) for d in docs.values()}) == 3  # one document per family
    # Interleaved: family 1 starts before family 0 has sent all its agents; readers come first.
    assert work.family.index(1) < max(i for i, k in enumerate(work.family) if k == 0)
    for k in range(3):
        agents = [a for a, f in zip(work.agent, work.family, strict=True) if f == k]
        assert agents == sorted(agents) and agents[0] == 0
    again = _serving.agent_families(tokenizer, 3, 4, (200, 260), 16, seed=3)
    assert again == work  # seeded: the same prompts for every engine and run


def test_workload_arguments_are_checked(tokenizer: Any) -> None:
    with pytest.raises(ValueError, match="agents must be"):
        _serving.agent_families(tokenizer, 1, 0, (100, 120), 4)
    with pytest.raises(ValueError, match="families"):
        _serving.agent_families(tokenizer, 999, 2, (100, 120), 4)


def test_the_client_gets_vllms_own_flags(tmp_path: Path) -> None:
    argv = _serving.client_argv(
        "http://127.0.0.1:1",
        "m",
        tmp_path / "d.jsonl",
        0.3,
        tmp_path,
        "run",
        {"ttft": 3000.0, "tpot": 250.0},
        max_concurrency=1,
    )
    text = " ".join(argv)
    for flag in ("--dataset-name custom", "--request-rate 0.3", "--goodput ttft:3000 tpot:250",
                 "--disable-shuffle", "--skip-chat-template", "--ignore-eos", "--save-detailed",
                 "--max-concurrency 1", "--ready-check-timeout-sec 0"):  # fmt: skip
        assert flag in text, flag
    from vllm.benchmarks import serve
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    parser = FlexibleArgumentParser()
    serve.add_cli_args(parser)
    args = parser.parse_args(argv)  # vLLM's own parser takes every one
    assert args.request_rate == 0.3 and args.dataset_name == "custom" and args.disable_shuffle


def test_engines_differ_only_in_the_connector() -> None:
    stock = serving.engine_args("bfloat16", None, 5)
    share = serving.engine_args("bfloat16", serving.ENGINES["kmesh_share"], 5, kv_blocks=64)
    assert "--kv-transfer-config" not in stock and "--enable-prefix-caching" in stock
    at = share.index("--kv-transfer-config")
    assert share[:at] == [*stock, "--num-gpu-blocks-override", "64"]
    extra = json.loads(share[at + 1])["kv_connector_extra_config"]
    assert extra == {"kmesh.store": "cpu", "kmesh.separator": [5], "kmesh.cascade_decode": True,
                     "kmesh.share_kv_memory": True}  # fmt: skip


def test_a_rate_is_sustained_only_with_every_lower_one() -> None:
    rows = {0.1: {"within_slo": 0.95}, 0.2: {"within_slo": 0.85}, 0.4: {"within_slo": 0.92}}
    assert serving.sustained(rows) == 0.1
    assert serving.sustained({0.1: {"within_slo": 0.5}}) is None
    assert serving.sustained({0.1: {"within_slo": 0.9}, 0.2: {"within_slo": 1.0}}) == 0.2


def test_server_counters_and_fallback_reasons() -> None:
    page = "\n".join([
        'vllm:kmesh_requests_total{engine="0",outcome="reused"} 4.0',
        'vllm:kmesh_requests_total{engine="0",outcome="fallback"} 2.0',
        'vllm:kmesh_fallbacks_total{engine="0",reason="bad annotation"} 1.0',
        'vllm:kmesh_fallbacks_total{engine="0",reason="load error"} 1.0',
        'vllm:kmesh_cascade_steps_total{engine="0"} 31.0',
        'vllm:num_preemptions_total{engine="0"} 3.0',
    ])  # fmt: skip
    got = _serving.server_counters(page)
    assert got["requests_reused"] == 4 and got["requests_fallback"] == 2
    assert got["cascade_steps"] == 31 and got["preemptions"] == 3 and got["released_blocks"] == 0
    assert got["fallbacks_by_reason"] == {"bad annotation": 1.0, "load error": 1.0}


def test_slo_share_follows_the_clients_goodput_rule() -> None:
    result = {"ttfts": [1.0, 2.5, 4.0, 0.5], "latencies": [2.0, 3.0, 5.0, 9.0],
              "output_lens": [11, 11, 11, 9], "errors": ["", "", "", ""]}  # fmt: skip
    # TPOT: 0.1, 0.05, 0.1 and 1.06 s
    assert _serving.within(result, 3.0, 0.25) == 0.5
    assert _serving.within(result, 5.0, 0.25) == 0.75
    assert _serving.within(result, 5.0, 2.0) == 1.0
    result["errors"][0] = "timeout"
    assert _serving.within(result, 5.0, 2.0) == 0.75


def test_kept_runs_are_reused_only_when_asked(tmp_path: Path) -> None:
    calls = []

    def run() -> tuple[dict[str, Any], dict[str, Any]]:
        calls.append(1)
        return {"n": len(calls)}, {"c": 1}

    where = {"attn_isa": "vec"}
    assert _serving.Runs(tmp_path, where).get("a", run)[0] == {"n": 1}
    assert _serving.Runs(tmp_path, where).get("a", run)[0] == {"n": 2}  # a new run measures again
    kept = _serving.Runs(tmp_path, where, replay=True)
    assert kept.get("a", run)[0] == {"n": 2, "platform": where}  # kept, naming its platform
    assert kept.get("b", run)[0] == {"n": 3}  # missing: run
    assert json.loads((tmp_path / "b.server.json").read_text()) == {"c": 1, "platform": where}


def test_rates_are_parsed_and_checked() -> None:
    assert _serving.parse_rates("0.3,0.1") == [0.1, 0.3]
    for bad in ("", "x", "0", "-1", "inf"):
        with pytest.raises(Exception, match="--rates"):
            _serving.parse_rates(bad)


@pytest.mark.vllm
@pytest.mark.slow
def test_quick_run_through_real_servers_and_vllms_client() -> None:
    """The quick mode end to end: every engine at every rate, figures from the client's saved
    results, the servers' counters, the fp32 exactness check, the plot."""
    proc = subprocess.run([sys.executable, str(BENCH / "serving.py"), "--quick"], cwd=BENCH,
                          stdout=subprocess.PIPE, text=True, timeout=1500)  # fmt: skip
    assert proc.returncode == 0, proc.stdout[-3000:]
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    assert result["name"] == "serving" and result["quick"] is True
    config = result["config"]
    assert config["client"] == "vllm.benchmarks.serve" and config["cpu"]["model"]
    assert config["attn_isa"] in {"amx", "vec", "vec16"} and config["kv_blocks"] is None
    engines = config["engines"]
    assert set(engines) == {"stock", "kmesh", "kmesh_share", "kmesh_share_raw"}
    n = config["requests"]
    for engine, rows in engines.items():
        assert set(rows) == {"0.3", "1"}, engine
        for rate, row in rows.items():
            where = f"{engine} at {rate}"
            assert row["completed"] == n and row["failed"] == 0, where
            assert 0 <= row["within_slo"] <= 1 and row["request_throughput"] > 0, where
            # the per-request recount at the stated SLO is the client's own goodput
            assert row["within_ttft_s"]["3"] == pytest.approx(row["within_slo"], abs=1e-3), where
            assert row["within_ttft_s"]["3"] <= row["within_ttft_s"]["5"] <= row[
                "within_ttft_s"]["10"], where  # fmt: skip
            assert row["families_per_min"] > 0 and row["output_throughput"] > 0, where
            assert 0 < row["median_ttft_ms"] <= row["p99_ttft_ms"], where
            assert 0 < row["median_itl_ms"] <= row["p99_itl_ms"], where
            server = row["server"]
            assert server["prompt_tokens"] > 0 and server["server_start_s"] > 0, where
            if engine == "stock":
                assert server["requests_reused"] == 0 and server["reused_tokens"] == 0, where
                continue
            # every follow-up reuses its family's document; nothing falls back
            follow_ups = n - config["families"]
            assert server["requests_reused"] >= follow_ups, where
            assert server["requests_fallback"] == 0 and server["fallbacks_by_reason"] == {}, where
            assert server["reused_tokens"] > 0 and server["recomputed_tokens"] > 0, where
            # the guarded engine shares where its timings found cascade decode faster than vLLM's
            # kernel, at start and under the run's load (a measured decision: its gauges say
            # which; off from the start, it never decoded in cascade)
            guarded = engine == "kmesh_share" and not server["cascade_guard_admits"]
            load = server["cascade_guard_load_permille"]
            if guarded and not load:  # off from the start: its start-up timing
                assert server["cascade_guard_family_permille"] > 1000, where
                assert server["cascade_steps"] == 0 and server["released_blocks"] == 0, where
            elif guarded:  # off under the run's load
                assert load > 1000, where
            elif engine == "kmesh_share":  # admitting: blocks go back only once the path is
                # shown to pay under the load or requests wait for blocks (`gives_back`)
                repaid = server["cascade_guard_break_even_steps"]
                if (repaid < 0 or repaid > config["output_tokens"]) and not server[
                        "released_blocks"]:  # fmt: skip
                    # no reader decodes long enough to repay its arming: none is armed (where
                    # requests waited for blocks, readers were armed and gave blocks back)
                    assert server["cascade_steps"] == 0, where
                if not load:
                    assert server["released_blocks"] == 0 or server[
                        "cascade_guard_memory_short"], where  # fmt: skip
            elif engine == "kmesh_share_raw":  # the raw path shares as configured
                assert server["cascade_steps"] > 0 and server["released_blocks"] > 0, where
            else:
                assert server["cascade_steps"] == 0, where
    exact = config["exactness"]
    assert exact["reused_tokens"] > 0, "the ratio-1.0 engine reused nothing: no exactness shown"
    assert exact["identical"] == exact["requests"] == 3, exact["answers"]
    assert set(config["sustained_rate"]) == set(engines)
    cores = {
        str(row["server"]["worker_cores"]) for rows in engines.values() for row in rows.values()
    }
    assert len(cores) == 1 and cores != {"[]"}, cores  # every worker on the same cores
    if result["value"] is not None:
        assert result["value"] >= 0 and config["p99_ttft_at_stock_rate"] > 0
    assert (BENCH / "results" / "quick" / "serving.png").stat().st_size > 10_000
    import run_all  # docs/load.md's table renders from this result

    rows = run_all._serving_rows(result)
    assert rows[0].startswith("Quick run of `bench/serving.py` on ")
    assert sum(line.startswith(("| stock |", "| kmesh")) for line in rows) == 2 * len(engines)
    assert "3 of the first 3 answers" in rows[-1]


def test_a_failed_run_shows_what_its_server_said_last(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    log = tmp_path / "kmesh_share_r0.9.log"
    log.write_text("".join(f"line {i}\n" for i in range(100)) + "RuntimeError: cascade broke\n")
    server = _serving.Server("m", [], log)
    server.__exit__(None, None, None)  # a run that went well says nothing
    assert capsys.readouterr().err == ""
    server.__exit__(RuntimeError, RuntimeError("client"), None)
    err = capsys.readouterr().err
    assert "RuntimeError: cascade broke" in err and "line 99" in err and "line 5\n" not in err


def test_the_spread_judges_a_difference_by_its_standard_error() -> None:
    import serving_spread

    def runs(shares: list[float]) -> list[dict[str, float]]:
        return [{"within_slo": s, "request_throughput": 0.5, "request_goodput": s / 2,
                 "median_tpot_ms": 80.0, "median_ttft_ms": 900.0} for s in shares]  # fmt: skip

    def pair(base: list[float], other: list[float]) -> dict[str, Any]:
        return serving_spread.cells({"kmesh": {0.6: runs(base)}, "kmesh_share": {0.6: runs(other)}},
                                    requests=30)  # fmt: skip

    close = pair([0.9, 0.8, 0.85], [0.8, 0.9, 0.8])
    row = close["compared"]["0.6"]["within_slo"]
    assert row["difference"] == pytest.approx(-1 / 60, abs=1e-3) and row["within_noise"]
    assert serving_spread.value(close) == row["z"] < 0
    far = pair([0.9, 0.8, 0.85], [0.5, 0.55, 0.5])
    assert not far["compared"]["0.6"]["within_slo"]["within_noise"]
    assert serving_spread.value(far) < -serving_spread.NOISE
    # no spread on either side: the within-SLO share is judged at one request's resolution
    assert serving_spread.value(pair([0.9, 0.9], [0.9, 0.9])) == 0.0
    short = pair([0.9, 0.9], [0.8, 0.8])
    assert serving_spread.value(short) < -serving_spread.NOISE
    assert not short["compared"]["0.6"]["within_slo"]["within_noise"]
    assert short["compared"]["0.6"]["request_throughput"]["within_noise"]  # equal, no spread
    flat = [serving_spread.spread([0.5, 0.5]), serving_spread.spread([0.4, 0.4])]
    assert serving_spread.compare(*flat)["within_noise"] is False
