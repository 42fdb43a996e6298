"""User-facing settings of the kmesh-blend KV connector.

All settings arrive through vLLM's ``kv_connector_extra_config`` dict, under keys prefixed
``kmesh.``; keys without that prefix belong to other connectors and are ignored.
"""

from __future__ import annotations

import dataclasses
import difflib
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Literal, NamedTuple, get_args

from kmesh_blend.config_checks import STORE_VALID as _STORE_VALID
from kmesh_blend.config_checks import (
    ConfigError,
    check_bool,
    check_choice,
    check_int,
    check_layers,
    check_ratio,
    check_seconds,
    check_separator,
)
from kmesh_blend.config_checks import fail as _fail
from kmesh_blend.config_checks import parse_host_port as _parse_host_port
from kmesh_blend.rules import sink_tokens_problem

StoreKind = Literal["cpu", "disk", "lm", "redis"]
Selection = Literal["per_request", "collective"]
Schedule = Literal["layer_sync", "sequential"]
Deviation = Literal["k", "v", "kv"]
Drift = Literal["off", "auto"]  # = rules.DRIFTS
Guard = Literal["auto", "off"]
Level = Literal["auto", "loops", "gemm"]  # = cpu.level.LEVELS

PREFIX = "kmesh."


class StoreSpec(NamedTuple):
    """Parsed form of ``kmesh.store``."""

    kind: StoreKind
    path: str | None = None
    host: str | None = None
    port: int | None = None

    @property
    def address(self) -> str:
        """The ``kmesh.store`` value this was parsed from (``lm://127.0.0.1:65432``, …)."""
        if self.kind == "cpu":
            return "cpu"
        if self.kind == "disk":
            return f"disk://{self.path}"
        return f"{self.kind}://{self.host}:{self.port}"


def parse_store(value: str) -> StoreSpec:
    """Parse a ``kmesh.store`` value; raises :class:`ConfigError` naming ``kmesh.store``."""
    if not isinstance(value, str):
        _fail("kmesh.store", value, "not a string", _STORE_VALID)
    if value == "cpu":
        return StoreSpec("cpu")
    if value.startswith("disk://"):
        path = value[len("disk://") :]
        if not path.startswith("/"):
            _fail("kmesh.store", value, "disk path must be absolute", _STORE_VALID)
        return StoreSpec("disk", path=path)
    for kind in ("lm", "redis"):
        if value.startswith(f"{kind}://"):
            host, port = _parse_host_port(value, value[len(kind) + 3 :])
            return StoreSpec(kind, host=host, port=port)
    _fail("kmesh.store", value, "unknown store form", _STORE_VALID)


@dataclass(frozen=True)
class KMeshConfig:
    """Validated kmesh-blend settings (validation runs on every construction)."""

    store: str = "cpu"
    """Where reused KV lives: ``cpu`` (host RAM), ``disk:///abs/path``, ``lm://HOST:PORT``
    (an LMCache server process) or ``redis://HOST:PORT``."""
    recompute_ratio: float = 0.15
    """Share of reused tokens that are recomputed, in [0, 1] (1.0 = recompute all)."""
    check_layers: tuple[int, ...] = (1,)
    """Layers where KV deviation is measured: non-empty, non-negative, strictly increasing."""
    sink_tokens: int = 0
    """Tokens at the start of every reused segment recomputed in every layer, like private tokens
    (≥ 0). The rule: 0 = deviation ranking only (``recompute_ratio`` at ``check_layers``); > 0
    with ratio 0 = the start-of-segment rule alone (no check layer runs); both = the sinks, then
    ``recompute_ratio`` of the segment's other tokens by deviation. Ratio 1.0 recomputes all."""
    selection: Selection = "per_request"
    """How recompute tokens are picked: per request (bit-identical across schedules), or one
    selection per shared segment for the whole group of siblings (cheaper)."""
    schedule: Schedule = "layer_sync"
    """How a group of siblings is recomputed: layer l for every sibling before layer l+1, or one
    request at a time."""
    deviation: Deviation = "k"
    """What a check layer compares between fresh and stored rows: keys, values, or both."""
    drift_correction: Drift = "auto"
    """``auto``: shift the rows a blend leaves stale by the drift its recomputed rows of the same
    segment show, scaled by the share of it the dropped rows had at the check layers
    (`kmesh_blend.blend.drift`); ``off``: stale rows stay as stored (plain CacheBlend). No
    effect at ratio 0 or 1. With ``cascade_decode`` on, the engine's blends run without it
    (cascade reads stale rows from the master as stored); a request may still ask for it."""
    round_lifetime: int = 2
    """Rounds a published segment stays in the index unless pinned by an active family (≥ 1)."""
    max_round_jump: int = 64
    """How far past its tenant's current round a request may announce a round (≥ 1). Rounds
    count per tenant (``cache_salt``); a request beyond the bound runs without reuse, its report
    naming the field, so one mistaken number cannot retire a tenant's segments."""
    retention_bytes: int = 1 << 30
    """Host-RAM budget (bytes) for restored masters kept for their family/round (≥ 0)."""
    singleflight_timeout_s: float = 10.0
    """Longest wait (s) for another request's read of the same segment before recomputing."""
    separator: tuple[int, ...] = ()
    """Token ids that split prompts into segments (separator mode); empty = off."""
    store_cpu_bytes: int = 1 << 30
    """LMCache host-RAM pool (bytes): the store itself for ``cpu``, staging for the others."""
    store_timeout_s: float = 0.5
    """Base deadline (s) of one store operation; each also gets 10 ms per MB it moves. A store
    that misses it is marked down: requests skip it (and say so) until a background probe finds
    it answering."""
    compress_mirrors: bool = False
    """Store mirrors' changed rows with lossless byte-plane zlib coding (≈1.4× smaller for bf16,
    ≈16 ms more per 2k-token mirror on one core); off keeps keeping a turn cheapest."""
    cascade_decode: bool = False
    """Decode the readers of a stored master in cascade: each decode step reads the master's KV
    once for all of them (`kmesh_blend/vllm/cascade_decode.py`). Off by default: it saves KV
    bandwidth, which bounds decode on a GPU, but on CPU (the only backend wired) it is slower than
    vLLM's fused kernel for the same arithmetic (docs/cascade.md); and it sums in
    another order (fp32 tokens equal, log-probabilities differ in the last bits)."""
    share_kv_memory: bool = False
    """With ``cascade_decode``: once a reader of stored masters decodes in cascade, the blocks of
    its prompt that hold only segment rows go back to vLLM's block pool; the family's master is
    held once next to vLLM's KV budget (host RAM), each reader's replaced rows (its mirror)
    beside it (`kmesh_blend/vllm/kv_release.py`). More agents fit one KV budget; blocks stay
    wherever every later step cannot be served by the cascade path (the report says why)."""
    share_kv_host_bytes: int = 1 << 30
    """With ``share_kv_memory``: host RAM (bytes) the released readers' mirrors may hold next to
    vLLM's KV budget (≥ 0); a reader whose mirror would pass it keeps its blocks (its report
    says so). The masters cascade decode reads are not counted here (one per document)."""
    speed_guard: Guard = "auto"
    """With ``cascade_decode``: ``auto`` times the cascade path against vLLM's own attention
    kernel at engine start on this engine's shapes (a family reading one master, one reader
    alone), then weighs every cascade step's cost against vLLM's kernel for the same requests
    while serving (start-up "slower" only beyond noise: a sign test over paired runs); where
    cascade costs more, readers that hold their blocks decode on vLLM's kernel, and
    ``share_kv_memory`` gives blocks back only once the path is weighed and pays, or requests
    wait for KV blocks and what the blocks buy outweighs what the path adds to each step (their
    share of vLLM's pool times the share of a step's time that does not grow with its tokens,
    fitted on the engine's own steps); where one reader alone is slower, a master's only
    reader of a step is read on vLLM's kernel; a reader whose tokens left (``max_tokens``) cannot
    repay arming it (verifying its rows, timed at start) stays on vLLM's kernel unless requests
    wait for blocks and sharing pays (`kmesh_blend/vllm/speed_guard.py`; each decision, with its
    figures, in one log line, the reports and ``/metrics``). ``off`` trusts the settings (tests
    and benchmarks of the raw path)."""
    cascade_level: Level = "auto"
    """With ``cascade_decode`` on the CPU kernel and a bf16 cache: how a master is read.
    ``loops``: AVX-512 vector loops; ``gemm``: bf16 matrix products with fp32 sums (torch's
    micro-kernels: AMX tiles where the CPU has them); ``auto`` times both at engine start on
    this engine's heads and keeps the faster (`kmesh_blend/cpu/level.py`; the log line says
    which, with its figures)."""
    cascade_exact: bool = False
    """With ``cascade_decode`` on the CPU kernel and a bf16 cache: the operands bf16 does not
    hold (queries rotated into a master's frame, softmax probabilities) enter the products as
    two bf16 terms, products as exact as fp32 on the stored K/V, at about twice the shared
    level's arithmetic; off, they are rounded to bf16 once, as vLLM's own bf16 kernels round
    theirs (greedy tokens within the bf16 bound of docs/cascade.md either way)."""
    _store_spec: StoreSpec = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        def norm(name: str, value: object) -> None:
            object.__setattr__(self, name, value)

        norm("_store_spec", parse_store(self.store))
        norm("recompute_ratio", check_ratio(self.recompute_ratio))
        norm("check_layers", check_layers(self.check_layers))
        for name, choices in _CHOICES.items():
            norm(name, check_choice(PREFIX + name, getattr(self, name), choices))
        if (problem := sink_tokens_problem(self.sink_tokens)) is not None:
            _fail("kmesh.sink_tokens", self.sink_tokens, problem, "an int ≥ 0")
        norm("sink_tokens", int(self.sink_tokens))
        for name, minimum in _INT_MINIMA.items():
            check_int(PREFIX + name, getattr(self, name), minimum)
        for name in ("singleflight_timeout_s", "store_timeout_s"):
            norm(name, check_seconds(PREFIX + name, getattr(self, name)))
        norm("separator", check_separator(self.separator))
        for name in ("compress_mirrors", "cascade_decode", "share_kv_memory"):
            check_bool(PREFIX + name, getattr(self, name))
        if self.share_kv_memory and not self.cascade_decode:
            _fail(
                "kmesh.share_kv_memory",
                True,
                "needs kmesh.cascade_decode (the only path that reads a released reader's KV)",
                "false, or kmesh.cascade_decode true",
            )

    @property
    def store_spec(self) -> StoreSpec:
        """The parsed ``store`` (parsed once, at construction)."""
        return self._store_spec

    @classmethod
    def from_extra_config(cls, extra: Mapping[str, object] | None) -> KMeshConfig:
        """Build from vLLM's whole ``kv_connector_extra_config``; ``None`` gives the defaults."""
        if extra is None:
            return cls()
        if not isinstance(extra, Mapping):
            _fail("kv_connector_extra_config", extra, "not a mapping", "a dict of settings")
        ours = {k: v for k, v in extra.items() if isinstance(k, str) and k.startswith(PREFIX)}
        for key in ours:
            if key not in KNOWN_KEYS:
                close = difflib.get_close_matches(key, KNOWN_KEYS, n=1)
                hint = f" (did you mean {close[0]!r}?)" if close else ""
                raise ConfigError(
                    f"unknown key {key!r}={ours[key]!r}{hint}; known keys: {', '.join(KNOWN_KEYS)}",
                    key=key,
                )
        # Values are validated (and normalized) once, by __post_init__.
        return cls(**{key[len(PREFIX) :]: value for key, value in ours.items()})  # type: ignore[arg-type]

    def validate_for_model(self, num_layers: int) -> None:
        """Check that every ``check_layers`` entry exists in a model of ``num_layers`` layers."""
        if isinstance(num_layers, bool) or not isinstance(num_layers, int) or num_layers < 1:
            raise ValueError(f"num_layers must be a positive int, got {num_layers!r}")
        bad = [layer for layer in self.check_layers if layer >= num_layers]
        if bad:
            _fail(
                "kmesh.check_layers",
                list(self.check_layers),
                f"layer(s) {bad} beyond the model's {num_layers} layers",
                f"layer indices in 0..{num_layers - 1}",
            )

    def to_extra_config(self) -> dict[str, object]:
        """The ``kmesh.*`` entries that rebuild this config via :meth:`from_extra_config`."""
        return {
            PREFIX + f.name: list(value) if isinstance(value, tuple) else value
            for f in dataclasses.fields(self)
            if f.init and (value := getattr(self, f.name)) is not None
        }


# Every setting, in the order of `KMeshConfig`'s fields (the one source of the settings table).
KNOWN_KEYS: tuple[str, ...] = tuple(
    PREFIX + f.name for f in dataclasses.fields(KMeshConfig) if f.init
)


_CHOICES: dict[str, tuple[str, ...]] = {
    "selection": get_args(Selection),
    "schedule": get_args(Schedule),
    "deviation": get_args(Deviation),
    "drift_correction": get_args(Drift),
    "speed_guard": get_args(Guard),
    "cascade_level": get_args(Level),
}
_INT_MINIMA = {
    "round_lifetime": 1,
    "max_round_jump": 1,
    "retention_bytes": 0,
    "store_cpu_bytes": 1,
    "share_kv_host_bytes": 0,
}
