"""The engine around the model: forward context, output hook, tensor parallelism, settings (seam).

- `step_slots`: the paged-cache slot of every token of the current forward (forward context);
- `hook_model_output`: a forward hook on the loaded model (the prompt tail's final hidden state
  is placed into its output before vLLM's sampler reads it), and, where asked, a stand-in for the
  whole forward of a step whose every token's output is already known;
- `tp_shard`, `tp_world_size`, `all_reduce`: tensor parallelism;
- `recompute_failed_loads`: sets ``kv_load_failure_policy = "recompute"``;
- `attention_layers`, `in_model_order`: the attention layers by name (the static forward
  context), their names in model order;
- `swapped_forwards`: modules' ``forward`` replaced for the duration of a start-up check;
- `installed_version`, `drop_leaked_connector`, `worker_connector`, `pool_state` (in-process
  engines).
"""

from __future__ import annotations

import contextlib
import inspect
import re
import weakref
from collections.abc import Callable, Iterable, Iterator
from typing import TYPE_CHECKING, Any, NamedTuple, cast

import torch

from kmesh_blend.vllm.seam import REPORT

if TYPE_CHECKING:
    from vllm.config import KVTransferConfig, VllmConfig

    from kmesh_blend.vllm.seam.cpu_attention import AttnLayer

__all__ = [
    "all_reduce", "attention_layers", "drop_leaked_connector", "hook_model_output",
    "in_model_order", "installed_version", "pool_state", "recompute_failed_loads", "step_slots",
    "swapped_forwards", "tp_shard", "tp_world_size", "worker_connector",
]  # fmt: skip

OutputHook = Callable[[torch.Tensor], None]  # the model's output [T, E], changed in place
# (number of tokens of the forward) → the forward's whole output [T, E], or None: run it.
KnownOutput = Callable[[int], "torch.Tensor | None"]


def step_slots() -> torch.Tensor | None:
    """[num_tokens] int64: the paged-cache slot of every token of the current forward, or None
    outside a forward (or when vLLM keeps it elsewhere)."""
    try:
        from vllm.forward_context import get_forward_context

        ctx = get_forward_context()
    except Exception:
        return None
    for source in (getattr(ctx, "slot_mapping", None), getattr(ctx, "attn_metadata", None)):
        if isinstance(source, dict):
            for item in source.values():
                slots = getattr(item, "slot_mapping", item)  # a tensor, or attention metadata
                if isinstance(slots, torch.Tensor):
                    return slots
    return None


def hook_model_output(model: torch.nn.Module, fn: OutputHook,
                      known: KnownOutput | None = None) -> Callable[[], None]:  # fmt: skip
    """Call ``fn(output)`` after every forward of ``model`` whose output is one [T, E] tensor
    (not a pipeline stage's intermediate tensors); returns the hook's remover.

    ``known``: asked before every forward with its token count; where it returns the output, the
    forward (every layer, its KV writes included) does not run and that tensor is its result. The
    caller then owns everything the forward would have done for those tokens."""

    def after(module: torch.nn.Module, args: Any, output: Any) -> None:
        if isinstance(output, torch.Tensor) and output.dim() == 2:
            fn(output)

    handle = model.register_forward_hook(after)
    what = "output hook (the blended prompt tail's hidden state)"
    if known is None:
        REPORT.note_changed("model forward", what)
        return handle.remove
    # The stand-in holds neither the model nor ``known``'s owner: vLLM caches callables it
    # inspects (``supports_kw`` on ``model.forward``) for the life of the process, and a strong
    # reference from there would keep every engine's model and KV cache alive.
    model_ref = weakref.ref(model)
    known_ref = weakref.WeakMethod(known) if inspect.ismethod(known) else lambda: known
    own = type(model).forward

    def forward(*args: Any, **kwargs: Any) -> Any:
        count, answer, module = _token_count(args, kwargs), known_ref(), model_ref()
        output = None if count is None or answer is None else answer(count)
        return own(module, *args, **kwargs) if output is None else output

    # vLLM decides which arguments to pass from the forward's signature: the model's own
    forward.__signature__ = inspect.signature(model.forward)  # type: ignore[attr-defined]
    model.forward = forward
    REPORT.note_changed("model forward", f"{what}; skipped where the blend computed every token")

    def remove() -> None:
        handle.remove()
        if model.__dict__.get("forward") is forward:
            del model.forward

    return remove


def _token_count(args: tuple[Any, ...], kwargs: dict[str, Any]) -> int | None:
    """Tokens of a causal LM's forward ``(input_ids, positions, ...)`` (positions may be
    [3, T] for multimodal rotary embeddings); None when the call has another shape."""
    for i, name in enumerate(("input_ids", "positions")):
        value = kwargs.get(name, args[i] if len(args) > i else None)
        if isinstance(value, torch.Tensor) and value.dim() >= 1:
            return int(value.shape[-1])
    embeds = kwargs.get("inputs_embeds")
    return int(embeds.shape[0]) if isinstance(embeds, torch.Tensor) else None


def tp_shard(vllm_config: VllmConfig) -> tuple[int, int]:
    """(rank, world size) of this worker in tensor parallelism."""
    world = vllm_config.parallel_config.tensor_parallel_size
    if world == 1:
        return 0, 1
    from vllm.distributed import get_tensor_model_parallel_rank

    return int(get_tensor_model_parallel_rank()), world


def tp_world_size() -> int:
    """Tensor-parallel world size; 1 outside an engine (no parallel state)."""
    try:
        from vllm.distributed import get_tensor_model_parallel_world_size

        return int(get_tensor_model_parallel_world_size())
    except Exception:
        return 1


def all_reduce(tensor: torch.Tensor) -> torch.Tensor:
    """Sum of ``tensor`` over the tensor-parallel ranks."""
    from vllm.distributed import tensor_model_parallel_all_reduce

    return tensor_model_parallel_all_reduce(tensor.contiguous())


def recompute_failed_loads(kv_transfer_config: KVTransferConfig) -> bool:
    """Set ``kv_load_failure_policy = "recompute"`` (the scheduler reads it right after building
    its connector); whether it changed."""
    if kv_transfer_config.kv_load_failure_policy == "recompute":
        return False
    kv_transfer_config.kv_load_failure_policy = "recompute"
    REPORT.note_changed("kv_load_failure_policy", "recompute")
    return True


def in_model_order(layer_names: Iterable[str]) -> list[str]:
    """Attention layer names (``model.layers.<i>.self_attn.attn``) sorted by layer index."""

    def index(name: str) -> int:
        match = re.search(r"layers\.(\d+)\.", name)
        return int(match.group(1)) if match else -1

    return sorted(layer_names, key=index)


def attention_layers(vllm_config: VllmConfig) -> dict[str, AttnLayer]:
    """This engine's attention layers by name."""
    layers = vllm_config.compilation_config.static_forward_context
    REPORT.note_found("attention layers", f"{len(layers)} in the static forward context")
    return cast("dict[str, AttnLayer]", layers)


@contextlib.contextmanager
def swapped_forwards(modules: list[torch.nn.Module], fn: Callable[..., Any]) -> Iterator[None]:
    """Each module's ``forward`` is ``fn`` inside the block, its own again after it."""
    try:
        for module in modules:
            module.forward = fn
        yield
    finally:
        for module in modules:
            module.__dict__.pop("forward", None)


def installed_version() -> str:
    import vllm

    version = str(getattr(vllm, "__version__", "unknown"))
    REPORT.note_found("vLLM", version)
    return version


def drop_leaked_connector() -> bool:
    """Whether an in-process engine left vLLM's process-wide KV connector behind, and drop it.
    False when vLLM was never imported."""
    import sys

    state = sys.modules.get("vllm.distributed.kv_transfer.kv_transfer_state")
    if state is None or not state.has_kv_transfer_group():
        return False
    state.ensure_kv_transfer_shutdown()
    return True


def worker_connector() -> object | None:
    """The KV connector vLLM built for this process's worker, or None. Only an in-process
    engine has one here: tests and benchmarks reach their worker's hooks this way."""
    from vllm.distributed.kv_transfer.kv_transfer_state import (
        get_kv_transfer_group,
        has_kv_transfer_group,
    )

    return get_kv_transfer_group() if has_kv_transfer_group() else None


class PoolState(NamedTuple):
    """An in-process engine's scheduler between steps: requests running and waiting, KV blocks
    free and in all, and each live request's preemptions so far."""

    running: int
    waiting: int
    blocks_free: int
    num_blocks: int
    preemptions: dict[str, int]


def pool_state(llm: Any) -> PoolState:
    """``llm``: a ``vllm.LLM`` whose engine core runs in this process
    (``VLLM_ENABLE_V1_MULTIPROCESSING=0``)."""
    scheduler = llm.llm_engine.engine_core.engine_core.scheduler
    pool = scheduler.kv_cache_manager.block_pool
    preempted = {rid: int(r.num_preemptions) for rid, r in scheduler.requests.items()}
    return PoolState(len(scheduler.running), len(scheduler.waiting), pool.get_num_free_blocks(),
                     pool.num_gpu_blocks, preempted)  # fmt: skip
