"""Families of agents across two engines behind vLLM's router, over the OpenAI API.

Starts, on 127.0.0.1: ``redis-server`` (the shared store), two vLLM OpenAI servers with the KMesh
connector (tiny Llama; engine ids ``engine-0`` / ``engine-1``; the ``FamilyHeader`` middleware)
and ``vllm-router --policy sticky_least_loaded`` in front (`kmesh_blend.testing.fleet`; docs/
routing.md has the same set-up as shell commands). Then three families of agents, each over its
own document: a notice per family (``max_tokens`` 1: it computes and stores the document), then
three agents per family at once, each with its own instructions before the document and its own
question after it, sent with the official ``openai`` client: ``Encoded.routed`` gives the
request's ``kv_transfer_params`` and its ``X-Session-ID`` header. Each answer's report says which
engine served it (``engine``), for which family, and what it reused. The last request of each
family closes it, and ``end_session`` ends the router's session. Everything is stopped at the end.

Run: ``.venv/bin/python examples/routed_agents.py`` (about 2 minutes on 2 cores)
"""

from __future__ import annotations

import tempfile
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import openai
import torch

from kmesh_blend.routing import end_session
from kmesh_blend.segments.client import Encoded
from kmesh_blend.testing import TINY_LLAMA, build_checkpoint
from kmesh_blend.testing.fleet import Fleet

FAMILIES, AGENTS, DOC = 3, 3, 512


def main() -> None:
    model = str(build_checkpoint(TINY_LLAMA))
    gen = torch.Generator().manual_seed(0)
    families: dict[str, list[Encoded]] = {}
    for k in range(FAMILIES):
        doc = torch.randint(3, 2048, (DOC,), generator=gen).tolist()
        families[f"team-{k}"] = []
        for i in range(AGENTS + 1):  # the notice, then the agents
            lead = torch.randint(3, 2048, (16 + 5 * i,), generator=gen).tolist()
            question = torch.randint(3, 2048, (10,), generator=gen).tolist()
            families[f"team-{k}"].append(
                Encoded(lead + doc + question, [(len(lead), len(lead) + DOC)])
            )
    print("starting Redis, two engines and the router (about a minute)…", flush=True)
    with tempfile.TemporaryDirectory() as logs, Fleet(model, Path(logs)) as fleet:
        client = openai.OpenAI(base_url=f"{fleet.router}/v1", api_key="unused")

        def ask(name: str, i: int, max_tokens: int = 8, close: bool = False) -> str:
            enc = families[name][i]
            routed = enc.routed(family=name, close=close)
            reply = client.completions.create(
                model=model, prompt=enc.token_ids, max_tokens=max_tokens, temperature=0,
                extra_body=routed.extra_body, extra_headers=routed.headers,
            )  # fmt: skip
            report = (reply.model_extra or {})["kv_transfer_params"]["kmesh"]
            role = "notice" if i == 0 else f"agent {i}"
            reads, why = report["storage_reads"], report["fallback"]
            return (f"{name} {role:8} → {report['engine']}: reused {report['reused_tokens']:3}, "
                    f"storage reads {reads}, fallback {why}")  # fmt: skip

        with ThreadPoolExecutor(max_workers=FAMILIES * AGENTS) as pool:
            for line in pool.map(lambda name: ask(name, 0, max_tokens=1), families):
                print(line)
            jobs = [(name, i) for name in families for i in range(1, AGENTS + 1)]
            for line in pool.map(lambda job: ask(*job, close=job[1] == AGENTS), jobs):
                print(line)
        for name in families:
            end_session(fleet.router, name)
        print(f"families closed; router sessions ended: {', '.join(families)}")


if __name__ == "__main__":
    main()
