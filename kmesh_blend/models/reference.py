"""Pure-torch reference implementation of `LayerwiseModel` for Llama, Qwen2 and Qwen3 checkpoints.

It loads a Hugging Face checkpoint directory (``config.json`` + ``*.safetensors``) and needs neither
vLLM nor transformers at run time. Architecture differences are read from the weights themselves:
q/k/v biases (Qwen2), per-head q/k RMSNorm (Qwen3), tied embeddings.

Numerics follow the Hugging Face models: linear layers in the model dtype, RMSNorm in fp32 then
cast back, RoPE tables in fp32 cast to the model dtype. Attention is computed in fp32 (softmax
included, one fused SDPA call) and cast back, which keeps it deterministic and close to every
backend.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from einops import rearrange
from safetensors.torch import load_file

from kmesh_blend.models.layerwise import QKV, ModelShape
from kmesh_blend.models.rope import RopeConfig, RotaryEmbedding

__all__ = ["LinearFactory", "ReferenceModel", "rotate_pair", "sdpa_attend", "torch_linear"]

SUPPORTED_MODEL_TYPES = ("llama", "qwen2", "qwen3")

# (weight [N, K], bias [N] or None) → x [M, K] ↦ [M, N] in the model dtype. Only tests and
# benchmarks run the reference model (vLLM serves on its own modules): `torch_linear` by default.
LinearFactory = Callable[
    [torch.Tensor, "torch.Tensor | None"], Callable[[torch.Tensor], torch.Tensor]
]


def torch_linear(
    weight: torch.Tensor, bias: torch.Tensor | None
) -> Callable[[torch.Tensor], torch.Tensor]:
    """The default `LinearFactory`: ``F.linear``."""
    return lambda x: F.linear(x, weight, bias)


class ReferenceModel:
    """A `LayerwiseModel` over plain tensors. Construct with `ReferenceModel.load(path)`."""

    def __init__(
        self,
        config: dict[str, Any],
        weights: dict[str, torch.Tensor],
        dtype: torch.dtype,
        linear: LinearFactory = torch_linear,
    ) -> None:
        model_type = config.get("model_type")
        if model_type not in SUPPORTED_MODEL_TYPES:
            raise ValueError(
                f"model_type={model_type!r} is not supported; valid: {SUPPORTED_MODEL_TYPES}"
            )
        if config.get("hidden_act", "silu") != "silu":
            raise ValueError(f"hidden_act={config.get('hidden_act')!r}; only 'silu' is supported")
        hidden_size = int(config["hidden_size"])
        num_heads = int(config["num_attention_heads"])
        head_dim = int(config.get("head_dim") or hidden_size // num_heads)
        self.shape = ModelShape(
            num_layers=int(config["num_hidden_layers"]),
            num_heads=num_heads,
            num_kv_heads=int(config.get("num_key_value_heads") or num_heads),
            head_dim=head_dim,
            hidden_size=hidden_size,
            vocab_size=int(config["vocab_size"]),
            dtype=dtype,
        )
        self.eps = float(config.get("rms_norm_eps", 1e-6))
        self.scale = head_dim**-0.5
        self.rope = RotaryEmbedding(RopeConfig.from_hf_config(config, head_dim))
        self.w = {name: t.to(dtype) for name, t in weights.items()}
        if "lm_head.weight" not in self.w:  # tied embeddings
            self.w["lm_head.weight"] = self.w["model.embed_tokens.weight"]
        for layer in range(self.shape.num_layers):
            p = f"model.layers.{layer}."
            _fuse(self.w, p + "self_attn.", ("q_proj", "k_proj", "v_proj"), "qkv_proj")
            _fuse(self.w, p + "mlp.", ("gate_proj", "up_proj"), "gate_up_proj")
        q_size = self.shape.num_heads * head_dim
        self._qkv_split = [q_size, *[self.shape.num_kv_heads * head_dim] * 2]
        self._linears = {
            f"model.layers.{layer}.{name}": linear(
                self.w[f"model.layers.{layer}.{name}.weight"],
                self.w.get(f"model.layers.{layer}.{name}.bias"),
            )
            for layer in range(self.shape.num_layers)
            for name in _LINEARS
        }

    @classmethod
    def load(
        cls,
        path: str | Path,
        dtype: torch.dtype = torch.float32,
        linear: LinearFactory = torch_linear,
    ) -> ReferenceModel:
        """Load a checkpoint directory written by ``save_pretrained`` (safetensors); ``linear``
        builds the layers' GEMMs (prefill and blend use the same ones, so they stay exact)."""
        path = Path(path)
        config = json.loads((path / "config.json").read_text())
        weights: dict[str, torch.Tensor] = {}
        files = sorted(path.glob("*.safetensors"))
        if not files:
            raise FileNotFoundError(f"no *.safetensors file in {path}")
        for file in files:
            weights.update(load_file(str(file)))
        return cls(config, weights, dtype, linear)

    # --- LayerwiseModel -------------------------------------------------------------------------

    def embed(self, token_ids: torch.Tensor) -> torch.Tensor:
        """[T] int64 → [T, E]."""
        return F.embedding(token_ids, self.w["model.embed_tokens.weight"])

    def project_qkv(self, layer: int, hidden: torch.Tensor) -> QKV:
        """hidden [T, E] → q [T, H, D], k / v [T, Hkv, D], before RoPE."""
        p = f"model.layers.{layer}."
        x = self._rms_norm(hidden, self.w[p + "input_layernorm.weight"])
        # One GEMM for q, k and v (and one for gate and up below): fewer, larger calls.
        q, k, v = self._linear(x, p + "self_attn.qkv_proj").split(self._qkv_split, dim=-1)
        d = self.shape.head_dim
        q = rearrange(q, "t (h d) -> t h d", d=d)
        k = rearrange(k, "t (h d) -> t h d", d=d)
        v = rearrange(v, "t (h d) -> t h d", d=d)
        if p + "self_attn.q_norm.weight" in self.w:  # Qwen3: RMSNorm per head, before RoPE
            q = self._rms_norm(q, self.w[p + "self_attn.q_norm.weight"])
            k = self._rms_norm(k, self.w[p + "self_attn.k_norm.weight"])
        return QKV(q, k, v)

    def rotate_qk(
        self, layer: int, q: torch.Tensor, k: torch.Tensor, positions: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """RoPE of q [n, H, D] and k [n, Hkv, D] at ``positions`` [n] (same table every layer)."""
        return rotate_pair(self.rope, q, k, positions)

    def attend(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor
    ) -> torch.Tensor:
        """q [Tq, H, D], k / v [Tk, Hkv, D], mask [Tq, Tk] bool → [Tq, H, D] (model dtype)."""
        return sdpa_attend(q, k, v, mask, self.scale)

    def finish_layer(self, layer: int, hidden: torch.Tensor, attn: torch.Tensor) -> torch.Tensor:
        """Layer input [T, E] + attention [T, H, D] → layer output [T, E]."""
        p = f"model.layers.{layer}."
        hidden = hidden + self._linear(rearrange(attn, "t h d -> t (h d)"), p + "self_attn.o_proj")
        x = self._rms_norm(hidden, self.w[p + "post_attention_layernorm.weight"])
        gate, up = self._linear(x, p + "mlp.gate_up_proj").chunk(2, dim=-1)
        return hidden + self._linear(F.silu(gate) * up, p + "mlp.down_proj")

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """[T, E] → [T, vocab] fp32."""
        x = self._rms_norm(hidden, self.w["model.norm.weight"])
        return F.linear(x, self.w["lm_head.weight"]).float()

    def combine_scores(self, scores: torch.Tensor) -> torch.Tensor:
        """All heads are here: [n] unchanged."""
        return scores

    # --- helpers --------------------------------------------------------------------------------

    def _linear(self, x: torch.Tensor, prefix: str) -> torch.Tensor:
        return self._linears[prefix](x)

    def _rms_norm(self, x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        xf = x.float()
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        return weight * xf.to(x.dtype)


def sdpa_attend(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor, scale: float
) -> torch.Tensor:
    """q [Tq, H, D], k / v [Tk, Hkv, D], mask [Tq, Tk] bool → [Tq, H, D] in q's dtype.

    One fused fp32 kernel (torch SDPA, GQA native): no [H, Tq, Tk] score tensor is built,
    which matters on CPU where those element-wise passes cost more than the matmuls. A query
    with no visible key gets zeros, not NaN.
    """
    out = F.scaled_dot_product_attention(
        rearrange(q.float(), "t h d -> h t d"),
        rearrange(k.float(), "t h d -> h t d"),
        rearrange(v.float(), "t h d -> h t d"),
        attn_mask=mask,
        scale=scale,
        enable_gqa=True,
    )
    out = rearrange(out, "h t d -> t h d")
    empty = ~mask.any(dim=1)
    if bool(empty.any()):
        out[empty] = 0.0
    return out.to(q.dtype)


def rotate_pair(
    rope: RotaryEmbedding, q: torch.Tensor, k: torch.Tensor, pos: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """RoPE of q [n, H, D] and k [n, Hkv, D] at ``pos``; one pass when k's heads directly follow
    q's in one buffer (a fused q/k/v projection) — element-wise, so the same bits either way."""
    n, heads, dim = q.shape
    adjacent = (
        k.dtype == q.dtype
        and k.shape[0] == n
        and k.stride() == q.stride()
        and q.stride(2) == 1
        and q.stride(1) == dim
        and k.data_ptr() == q.data_ptr() + heads * dim * q.element_size()
    )
    if not adjacent or n == 0:
        return rope.apply(q, pos), rope.apply(k, pos)
    qk = q.as_strided((n, heads + k.shape[1], dim), q.stride())
    out = rope.apply(qk, pos)
    return out[:, :heads], out[:, heads:]


_LINEARS = ("self_attn.qkv_proj", "self_attn.o_proj", "mlp.gate_up_proj", "mlp.down_proj")


def _fuse(w: dict[str, torch.Tensor], prefix: str, parts: tuple[str, ...], fused: str) -> None:
    """Replace the linears ``prefix + part`` by one whose output rows are theirs, in order."""
    weights = [w.pop(prefix + n + ".weight") for n in parts]
    biases = [w.pop(prefix + n + ".bias", None) for n in parts]
    w[prefix + fused + ".weight"] = torch.cat(weights)
    if any(b is not None for b in biases):  # a missing bias is a zero one
        pairs = zip(biases, weights, strict=True)
        w[prefix + fused + ".bias"] = torch.cat(
            [b if b is not None else wt.new_zeros(wt.shape[0]) for b, wt in pairs]
        )
