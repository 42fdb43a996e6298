"""The seam: only `kmesh_blend/vllm/seam/` reaches into vLLM's internals.

Every file of the package is parsed (no import, no vLLM needed): its vLLM imports (anywhere in
the file, ``TYPE_CHECKING`` blocks included), the vLLM module names it spells as strings, and
the vLLM-internal attributes it touches. Other files may use vLLM's public KV-connector API
(`PUBLIC`) and the seam; the seam may use `SEAM` besides. A vLLM upgrade that moves one of these
is then found in one place.
"""

from __future__ import annotations

import ast
import re
import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PACKAGE = ROOT / "kmesh_blend"
SEAM_DIR = PACKAGE / "vllm" / "seam"

# vLLM's public KV-connector API: the base class and the types in its method signatures, and
# the offline entry point. Any file may import these.
PUBLIC: dict[str, set[str]] = {
    "vllm": {"LLM", "SamplingParams"},
    "vllm.config": {"KVTransferConfig", "ModelConfig", "VllmConfig"},
    "vllm.distributed.kv_transfer.kv_connector.v1.base": {
        "KVConnectorBase_V1",
        "KVConnectorMetadata",
        "KVConnectorRole",
        "KVConnectorWorkerMetadata",
    },
    "vllm.distributed.kv_transfer.kv_connector.v1.metrics": {
        "KVConnectorPromMetrics",
        "KVConnectorStats",
    },
    "vllm.forward_context": {"ForwardContext"},
    "vllm.v1.attention.backend": {"AttentionMetadata"},
    "vllm.v1.core.kv_cache_manager": {"KVCacheBlocks", "KVCacheManager"},
    "vllm.v1.core.sched.output": {"SchedulerOutput"},
    "vllm.v1.kv_cache_interface": {"KVCacheConfig"},
    "vllm.v1.outputs": {"KVConnectorOutput"},
    "vllm.v1.request": {"Request"},
}
# What the seam may use besides: vLLM's internals, each for a reason its docstring gives.
SEAM: dict[str, set[str]] = {
    "vllm": {"_custom_ops", "envs", "vllm"},  # ``import vllm``: the installed version
    "vllm.distributed": {
        "get_tensor_model_parallel_rank",
        "get_tensor_model_parallel_world_size",
        "tensor_model_parallel_all_reduce",
    },
    "vllm.distributed.kv_transfer.kv_transfer_state": {
        "get_kv_transfer_group",
        "has_kv_transfer_group",
    },
    "vllm.forward_context": {"get_forward_context"},
    "vllm.model_executor.layers.attention.attention": {"Attention"},
    "vllm.sampling_params": {"SamplingParams"},
    "vllm.utils.hashing": {"get_hash_fn_by_name"},
    "vllm.v1.attention.backends.cpu_attn": {"CPUAttentionBackendImpl", "CPUAttentionMetadata"},
    "vllm.v1.core.kv_cache_manager": {"KVCacheManager"},
    "vllm.v1.core.kv_cache_utils": {"BlockHash", "get_request_block_hasher", "init_none_hash"},
    "vllm.v1.request": {"RequestStatus"},
}
SEAM_STRINGS = {  # vLLM modules the seam names as strings (runner classes it wraps, state)
    "vllm.v1.worker.gpu_model_runner", "vllm.v1.worker.cpu_model_runner",
    "vllm.v1.worker.gpu.model_runner", "vllm.distributed.kv_transfer.kv_transfer_state",
}  # fmt: skip
# vLLM modules anyone may name: the OpenAI server's module, run as a command (`python -m`).
PUBLIC_STRINGS = {"vllm.entrypoints.openai.api_server"}
LOGGER = "vllm.kmesh_blend"  # our logger under vLLM's: a name, not a module
# Members of vLLM objects outside the connector API: only the seam touches them.
INTERNAL_ATTRS = {
    "block_hashes", "_k_scale_float", "_v_scale_float", "impl", "do_kv_cache_update",
    "static_forward_context", "kv_load_failure_policy", "input_batch", "scheduled_new_reqs",
    "scheduled_cached_reqs", "resumed_req_ids", "new_block_ids", "load_model", "isa",
    "register_forward_hook", "get_forward_context", "scheduler_metadata", "_kmesh_route",
    "req_to_blocks", "single_type_managers", "null_block", "evict_blocks", "free_blocks",
}  # fmt: skip
_MODULE_NAME = re.compile(r"^vllm(\.\w+)+$")


def _files() -> list[Path]:
    return sorted(PACKAGE.rglob("*.py"))


def _in_seam(path: Path) -> bool:
    return SEAM_DIR in path.parents


def _uses(path: Path) -> tuple[set[tuple[str, str]], set[str], set[str]]:
    """(vLLM imports as (module, name), vLLM module names in strings, attributes touched)."""
    tree = ast.parse(path.read_text(), filename=str(path))
    imports: set[tuple[str, str]] = set()
    strings: set[str] = set()
    attrs: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                if alias.name == "vllm" or alias.name.startswith("vllm."):
                    module, _, name = alias.name.rpartition(".")
                    imports.add((module or "vllm", name))
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            if node.module == "vllm" or node.module.startswith("vllm."):
                imports.update((node.module, alias.name) for alias in node.names)
        elif isinstance(node, ast.Constant) and isinstance(node.value, str):
            if _MODULE_NAME.match(node.value) and node.value != LOGGER:
                strings.add(node.value)
        elif isinstance(node, ast.Attribute):
            attrs.add(node.attr)
        elif (
            isinstance(node, ast.Call)
            and getattr(node.func, "id", None)
            in (
                "getattr",
                "setattr",
            )
            and len(node.args) > 1
            and isinstance(node.args[1], ast.Constant)
        ):
            attrs.add(str(node.args[1].value))
    return imports, strings, attrs


def _named_member(node: ast.AST) -> bool:
    """``getattr(x, "name")`` / ``setattr(x, "name", v)``."""
    return (
        isinstance(node, ast.Call)
        and getattr(node.func, "id", None) in ("getattr", "setattr")
        and len(node.args) > 1
        and isinstance(node.args[1], ast.Constant)
    )


def _allowed(table: dict[str, set[str]], module: str, name: str) -> bool:
    return name in table.get(module, set())


def test_only_the_seam_reaches_into_vllm() -> None:
    problems = []
    for path in _files():
        imports, strings, attrs = _uses(path)
        where = path.relative_to(ROOT)
        seam = _in_seam(path)
        for module, name in sorted(imports):
            if not (_allowed(PUBLIC, module, name) or (seam and _allowed(SEAM, module, name))):
                problems.append(f"{where}: imports {module}.{name}")
        for text in sorted(strings - PUBLIC_STRINGS - (SEAM_STRINGS if seam else set())):
            problems.append(f"{where}: names the vLLM module {text!r}")
        if not seam:
            problems += [f"{where}: touches vLLM's .{a}" for a in sorted(attrs & INTERNAL_ATTRS)]
    assert not problems, "\n".join(problems)


def test_the_check_is_able_to_fail(tmp_path: Path) -> None:
    """An internal import, a runner module named as a string and a private member, outside the
    seam, are each found."""
    bad = tmp_path / "bad.py"
    bad.write_text(
        "from vllm.v1.worker.gpu_model_runner import GPUModelRunner\n"
        "import vllm._custom_ops\n"
        "NAME = 'vllm.v1.worker.cpu_model_runner'\n"
        "def f(layer, request):\n"
        "    return layer._k_scale_float, getattr(request, 'block_hashes')\n"
    )
    imports, strings, attrs = _uses(bad)
    assert ("vllm.v1.worker.gpu_model_runner", "GPUModelRunner") in imports
    assert ("vllm", "_custom_ops") in imports
    assert not any(_allowed(PUBLIC, m, n) for m, n in imports)
    assert strings == {"vllm.v1.worker.cpu_model_runner"}
    assert {"_k_scale_float", "block_hashes"} <= attrs & INTERNAL_ATTRS


def test_every_seam_entry_is_used() -> None:
    """The lists stay exact: each symbol the seam may use, it does use."""
    used: set[tuple[str, str]] = set()
    for path in _files():
        if _in_seam(path):
            used |= _uses(path)[0]
    unused = {(m, n) for m, names in SEAM.items() for n in names} - used
    assert not unused, sorted(unused)


def test_mypy_reads_vllms_types_for_the_seam() -> None:
    """No blanket skip for what the seam imports: each vLLM module it uses is followed."""
    config = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["mypy"]["overrides"]
    followed = {m for o in config if o.get("follow_imports") == "silent" for m in o["module"]}
    modules = set()
    for path in _files():
        if _in_seam(path):
            modules |= {m for m, n in _uses(path)[0] if m != "vllm" or n == "_custom_ops"}
    modules = {"vllm._custom_ops" if m == "vllm" else m for m in modules}
    missing = modules - followed
    assert not missing, sorted(missing)
