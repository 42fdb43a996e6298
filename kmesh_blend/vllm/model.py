"""`LayerwiseModel` over the model vLLM loaded: the blend runs on vLLM's own modules and weights.

Every step of the blend's forward is a call into the engine's modules — embedding, the norms
with their fused residual add, the fused q/k/v projection (and per-head q/k norms where the model
has them), the rotary embedding, the output projection, the MLP, the final norm and the logits
processor. No weight is loaded or copied; our code only decides which tokens each layer computes
and re-positions stored keys. Attention itself goes through vLLM's paged kernel
(`kmesh_blend.vllm.paged_attention`) or, where that is unavailable, `sdpa_attend`.

Which models fit: decoder layers of the Llama shape — ``input_layernorm``,
``self_attn.{qkv_proj, rotary_emb, o_proj}`` (optionally ``q_norm``/``k_norm`` per head),
``post_attention_layernorm``, ``mlp`` and the forward ``layer(positions, hidden, residual)``
(Llama, Mistral, Qwen2, Qwen3 and others). `check_decomposition` proves it per engine at start:
it runs the model's own layer forwards (attention swapped for `sdpa_attend`) next to our
decomposition on a few tokens and demands the same bits. A model that fails is served on
vLLM's stock path.

State between layers (the blend's ``hidden``): [T, 2, E] in the model dtype — the layer's input
hidden states and the residual stream, because vLLM's norms add the residual inside the norm.
Layer 0 has no residual yet; its second half is ignored.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Any

import torch
from einops import rearrange

from kmesh_blend.models.layerwise import QKV, ModelShape, causal_mask
from kmesh_blend.models.reference import sdpa_attend
from kmesh_blend.models.rope import RopeConfig, RotaryEmbedding
from kmesh_blend.vllm.seam.engine import all_reduce, swapped_forwards, tp_world_size

if TYPE_CHECKING:
    from transformers import PretrainedConfig

__all__ = ["ShapeOnly", "VllmModel", "adapt", "check_decomposition"]

log = logging.getLogger("vllm.kmesh_blend")  # under vLLM's handlers and format


class VllmModel:
    """A `LayerwiseModel` whose every step calls the modules of ``model`` (vLLM's loaded
    ``nn.Module``; its decoder under ``model.model``). Shapes are this rank's: under tensor
    parallelism ``num_heads`` / ``num_kv_heads`` are the local shard's."""

    def __init__(self, model: Any, hf_config: PretrainedConfig,
                 dtype: torch.dtype) -> None:  # fmt: skip
        self.model = model
        inner = getattr(model, "model", None)
        if inner is None or not hasattr(inner, "layers") or not hasattr(inner, "embed_input_ids"):
            raise ValueError(f"{type(model).__name__} has no decoder under .model.layers")
        if hasattr(inner, "normalizer"):  # e.g. Gemma scales embeddings inside its forward
            raise ValueError(f"{type(inner).__name__} rescales its embeddings in its forward")
        start, end = getattr(inner, "start_layer", 0), getattr(inner, "end_layer", None)
        self.layers = list(inner.layers)[start:end]
        if start != 0 or len(self.layers) != len(inner.layers):
            raise ValueError("pipeline-parallel shards are not supported")
        self.inner = inner
        attn = self.layers[0].self_attn
        for layer in self.layers:
            for name in ("input_layernorm", "post_attention_layernorm", "mlp", "self_attn"):
                if not hasattr(layer, name):
                    raise ValueError(f"decoder layer has no {name!r}")
            for name in ("qkv_proj", "rotary_emb", "o_proj", "q_size", "kv_size", "head_dim"):
                if not hasattr(layer.self_attn, name):
                    raise ValueError(f"attention has no {name!r}")
        head_dim = int(attn.head_dim)
        num_heads, num_kv_heads = attn.q_size // head_dim, attn.kv_size // head_dim
        self.shape = ModelShape(
            num_layers=len(self.layers),
            num_heads=num_heads,
            num_kv_heads=num_kv_heads,
            head_dim=head_dim,
            hidden_size=int(hf_config.hidden_size),
            vocab_size=int(hf_config.vocab_size),
            dtype=dtype,
        )
        self.scale = float(getattr(attn, "scaling", head_dim**-0.5))
        self.world_size = tp_world_size()
        # Where the engine keeps the model: token ids and positions go there (CPU or CUDA).
        self.device = next(iter(model.parameters())).device
        config = hf_config.to_dict() if hasattr(hf_config, "to_dict") else dict(vars(hf_config))
        self.rope = RotaryEmbedding(RopeConfig.from_hf_config(config, head_dim))

    # --- LayerwiseModel -------------------------------------------------------------------------

    def embed(self, token_ids: torch.Tensor) -> torch.Tensor:
        """[T] int64 → state [T, 2, E] (residual half unused until layer 0 ends)."""
        hidden = self.inner.embed_input_ids(token_ids.to(self.device))
        return torch.stack([hidden, hidden], dim=1)

    def project_qkv(self, layer: int, hidden: torch.Tensor) -> QKV:
        """state [T, 2, E] → q [T, H, D], k / v [T, Hkv, D] before RoPE."""
        attn = self.layers[layer].self_attn
        x, _ = self._input_norm(layer, hidden)
        qkv, _ = attn.qkv_proj(x)
        q, k, v = qkv.split([attn.q_size, attn.kv_size, attn.kv_size], dim=-1)
        d = self.shape.head_dim
        if getattr(attn, "q_norm", None) is not None:  # Qwen3: RMSNorm per head, before RoPE
            q = attn.q_norm(q.view(*q.shape[:-1], -1, d)).view(q.shape)
            k = attn.k_norm(k.view(*k.shape[:-1], -1, d)).view(k.shape)
        return QKV(q.view(-1, self.shape.num_heads, d), k.view(-1, self.shape.num_kv_heads, d),
                   v.view(-1, self.shape.num_kv_heads, d))  # fmt: skip

    def rotate_qk(
        self, layer: int, q: torch.Tensor, k: torch.Tensor, positions: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """The layer's own rotary embedding (vLLM's kernel; it may rotate in place)."""
        n = q.shape[0]
        q2, k2 = self.layers[layer].self_attn.rotary_emb(
            positions.to(self.device), q.reshape(n, -1), k.reshape(n, -1)
        )
        d = self.shape.head_dim
        return q2.view(n, -1, d), k2.view(n, -1, d)

    def attend(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor
    ) -> torch.Tensor:
        """Reference attention (fp32 SDPA); the worker uses vLLM's paged kernel when it can."""
        return sdpa_attend(q, k, v, mask, self.scale)

    def finish_layer(self, layer: int, hidden: torch.Tensor, attn: torch.Tensor) -> torch.Tensor:
        """state [T, 2, E] + attention [T, H, D] → the next layer's state [T, 2, E]."""
        mod = self.layers[layer]
        # What the input norm's fused add produced (one rounding of the same sum; the start-up
        # check proves the bits): cheaper than running the norm a second time.
        residual = hidden[:, 0] + hidden[:, 1] if layer else hidden[:, 0].contiguous()
        out, _ = mod.self_attn.o_proj(rearrange(attn, "t h d -> t (h d)"))
        x, residual = mod.post_attention_layernorm(out, residual)
        return torch.stack([mod.mlp(x), residual], dim=1)

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """state [T, 2, E] → [T, vocab] fp32, through the final norm and vLLM's logits path."""
        return self.model.compute_logits(self.final_norm(hidden)).float()

    def final_norm(self, hidden: torch.Tensor) -> torch.Tensor:
        """state [T, 2, E] → [T, E] model dtype: what the model's forward returns for these
        tokens (the final norm with its fused residual add), i.e. what vLLM's sampler reads."""
        x, _ = self.inner.norm(hidden[:, 0].contiguous(), hidden[:, 1].contiguous())
        return x

    def combine_scores(self, scores: torch.Tensor) -> torch.Tensor:
        """[n] fp32 summed over the tensor-parallel ranks (each holds some KV heads)."""
        return scores if self.world_size == 1 else all_reduce(scores)

    # --- helpers --------------------------------------------------------------------------------

    def _input_norm(self, layer: int, hidden: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(normed [T, E], residual [T, E]) as the layer's own forward computes them; on fresh
        copies, because vLLM's fused residual norm may work in place."""
        norm = self.layers[layer].input_layernorm
        if layer == 0:
            residual = hidden[:, 0].contiguous()
            return norm(residual.clone()), residual
        return norm(hidden[:, 0].contiguous(), hidden[:, 1].contiguous())


@torch.no_grad()
def check_decomposition(adapter: VllmModel, num_tokens: int = 12) -> str | None:
    """None when our layer steps give the same bits as the model's own layer forwards on a few
    tokens (attention in both swapped for `sdpa_attend`); else the first difference, in words.

    Runs before the engine serves (the attention modules' ``forward`` is replaced for the
    duration of the call and restored after it)."""
    gen = torch.Generator().manual_seed(0)
    vocab = min(adapter.shape.vocab_size, 1000)
    ids = torch.randint(1, vocab, (num_tokens,), generator=gen).to(adapter.device)
    positions = torch.arange(num_tokens, device=adapter.device)
    mask = causal_mask(positions, positions)
    shape = adapter.shape
    seen: list[tuple[torch.Tensor, torch.Tensor]] = []

    def fake_attention(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                       *args: Any, **kwargs: Any) -> torch.Tensor:  # fmt: skip
        d = shape.head_dim
        k = key.reshape(num_tokens, -1, d)
        v = value.reshape(num_tokens, -1, d)
        seen.append((k.clone(), v.clone()))
        out = sdpa_attend(query.reshape(num_tokens, -1, d), k, v, mask, adapter.scale)
        return out.reshape(num_tokens, -1)

    attn_modules = [layer.self_attn.attn for layer in adapter.layers]
    try:
        with swapped_forwards(attn_modules, fake_attention):
            hidden = adapter.embed(ids)[
                :, 0
            ].contiguous()  # own copy: the forward may work in place
            residual = None
            for layer in adapter.layers:
                hidden, residual = layer(positions, hidden, residual)
    except Exception as exc:
        return f"the model's own layer forward failed: {type(exc).__name__}: {exc}"
    try:
        state = adapter.embed(ids)
        for layer in range(shape.num_layers):
            q, k, v = adapter.project_qkv(layer, state)
            q, k = adapter.rotate_qk(layer, q, k, positions)
            want_k, want_v = seen[layer]
            if not (torch.equal(k, want_k) and torch.equal(v, want_v)):
                err = float((k.float() - want_k.float()).abs().max())
                return f"layer {layer}: keys/values differ from the model's forward (max {err:.3g})"
            state = adapter.finish_layer(layer, state, adapter.attend(q, k, v, mask))
    except Exception as exc:
        return f"layer steps failed: {type(exc).__name__}: {exc}"
    assert residual is not None
    if not (torch.equal(state[:, 0], hidden) and torch.equal(state[:, 1], residual)):
        return "final hidden states differ from the model's forward"
    return None


def adapt(model: torch.nn.Module | None, hf_config: PretrainedConfig,
          dtype: torch.dtype) -> tuple[VllmModel | ShapeOnly, str | None]:  # fmt: skip
    """(adapter, None) when the blend can run on ``model``; else (a shape-only stand-in, the
    reason every reuse falls back)."""
    from kmesh_blend.vllm.version import unsupported_vllm

    reason = unsupported_vllm()
    if reason is None and model is None:
        reason = "the loaded model was not reachable (is the kmesh_blend vLLM plugin enabled?)"
    if reason is None and model is not None:
        try:
            adapter = VllmModel(model, hf_config, dtype)
        except Exception as exc:
            reason = f"model not supported: {type(exc).__name__}: {exc}"
        else:
            problem = check_decomposition(adapter)
            if problem is None:
                log.info("kmesh: blend runs on vLLM's loaded model (layer check passed)")
                return adapter, None
            reason = f"model not supported: {problem}"
    log.warning("kmesh: reuse disabled, every request is served on the stock path: %s", reason)
    return ShapeOnly(hf_config, dtype), reason


class ShapeOnly:
    """Sizes of a model the blend cannot run on: enough to open the store and report."""

    def __init__(self, hf_config: PretrainedConfig, dtype: torch.dtype) -> None:
        heads = int(hf_config.num_attention_heads)
        head_dim = int(getattr(hf_config, "head_dim", None) or hf_config.hidden_size // heads)
        self.shape = ModelShape(
            int(hf_config.num_hidden_layers), heads,
            int(getattr(hf_config, "num_key_value_heads", None) or heads), head_dim,
            int(hf_config.hidden_size), int(hf_config.vocab_size), dtype,
        )  # fmt: skip
        self.rope = RotaryEmbedding(RopeConfig(head_dim=head_dim))
