"""Rotary position embedding (RoPE), including the scaled variants our models use.

The blend moves stored keys to new positions; that is only correct when the rotation used here is
the one the model was trained with, *including* its frequency scaling (LMCache passes scaling as
`None`, its issue #4666). So the rotation is derived from the checkpoint's own RoPE parameters.

Layout convention (the one Llama/Qwen checkpoints use): the head dimension is split in two halves,
and channel ``i`` is rotated together with channel ``i + head_dim/2`` by the angle
``position * inv_freq[i]``.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, NamedTuple

import torch

__all__ = ["RopeConfig", "RotaryEmbedding", "Rotation", "rotate", "rotate_half"]

SUPPORTED_ROPE_TYPES = ("default", "llama3")


@dataclass(frozen=True)
class RopeConfig:
    """The RoPE parameters of a checkpoint.

    Attributes:
        head_dim: rotated channels per head (the full head dimension).
        theta: the base of the geometric frequency ladder (``rope_theta``).
        rope_type: ``"default"`` or ``"llama3"`` (frequency-dependent scaling).
        factor, low_freq_factor, high_freq_factor, original_max_position: ``llama3`` parameters.
    """

    head_dim: int
    theta: float = 10000.0
    rope_type: str = "default"
    factor: float = 1.0
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_position: int = 8192

    def __post_init__(self) -> None:
        if self.rope_type not in SUPPORTED_ROPE_TYPES:
            raise ValueError(
                f"rope_type={self.rope_type!r} is not supported; valid: {SUPPORTED_ROPE_TYPES}"
            )
        if self.head_dim <= 0 or self.head_dim % 2:
            raise ValueError(f"head_dim must be a positive even number, got {self.head_dim}")

    @classmethod
    def from_hf_config(cls, config: Mapping[str, Any], head_dim: int) -> RopeConfig:
        """Read RoPE settings from a Hugging Face ``config.json`` dict.

        Accepts both spellings: ``rope_parameters`` (transformers ≥ 5) and the older
        ``rope_scaling`` + ``rope_theta``.
        """
        params = config.get("rope_parameters") or config.get("rope_scaling") or {}
        if not isinstance(params, Mapping):
            raise ValueError(f"rope parameters must be a mapping, got {params!r}")
        theta = params.get("rope_theta", config.get("rope_theta", 10000.0))
        rope_type = params.get("rope_type", params.get("type", "default"))
        kwargs: dict[str, Any] = {}
        if rope_type == "llama3":
            kwargs = {
                "factor": float(params["factor"]),
                "low_freq_factor": float(params["low_freq_factor"]),
                "high_freq_factor": float(params["high_freq_factor"]),
                "original_max_position": int(params["original_max_position_embeddings"]),
            }
        return cls(
            head_dim=head_dim,
            theta=float(theta),
            rope_type=str(rope_type),
            **kwargs,
        )


class RotaryEmbedding:
    """Applies RoPE at arbitrary (possibly non-contiguous) positions.

    Angles are computed in fp32 and the cos/sin tables are cast to the input dtype before the
    rotation, as Hugging Face models do, so keys computed here match theirs.
    """

    def __init__(self, config: RopeConfig) -> None:
        self.config = config
        self.inv_freq = _inv_freq(config)  # [head_dim/2] fp32
        # The last tables, kept while callers pass the very same positions tensor again (q and k
        # of a layer, and the layers that compute the same tokens). Positions are never mutated.
        self._memo: tuple[torch.Tensor, torch.dtype, torch.Tensor, torch.Tensor] | None = None

    def apply(self, x: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """Rotate ``x``: [T, heads, head_dim] (any float dtype) to ``positions``: [T] int.

        Returns a new tensor of the same shape and dtype: x·cos + rotate_half(x)·sin, computed
        as x·cos + swap(x)·(−sin, sin) — the same bits (negation is exact), one pass fewer.
        """
        if x.dim() != 3 or x.shape[-1] != self.config.head_dim:
            raise ValueError(
                f"x must be [tokens, heads, {self.config.head_dim}], got {tuple(x.shape)}"
            )
        if positions.shape != (x.shape[0],):
            raise ValueError(f"positions must be [{x.shape[0]}], got {tuple(positions.shape)}")
        return rotate(x, self._tables(positions, x.dtype))

    def tables(self, positions: torch.Tensor, dtype: torch.dtype) -> Rotation:
        """The rotation to ``positions`` [T] int (negative ones rotate back): tables in
        ``dtype``, for callers that rotate several tensors to the same positions (`rotate`)."""
        angles = positions.to(torch.float32)[:, None] * self.inv_freq[None, :]
        cos = torch.cat((angles, angles), dim=-1).cos().to(dtype)
        sin = angles.sin().to(dtype)
        return Rotation(cos, torch.cat((-sin, sin), dim=-1))

    def _tables(self, positions: torch.Tensor, dtype: torch.dtype) -> Rotation:
        """`tables`, memoized for the last ``positions`` tensor (the blend passes the same one
        layer after layer)."""
        memo = self._memo
        if memo is not None and memo[0] is positions and memo[1] == dtype:
            return Rotation(memo[2], memo[3])
        rotation = self.tables(positions, dtype)
        self._memo = (positions, dtype, *rotation)
        return rotation


class Rotation(NamedTuple):
    """RoPE tables of T positions: ``cos`` and ``signed_sin`` = (−sin, sin), each [T, head_dim]."""

    cos: torch.Tensor
    signed_sin: torch.Tensor


def rotate(x: torch.Tensor, rotation: Rotation) -> torch.Tensor:
    """``x`` [T, heads, head_dim] (or [1, heads, head_dim]: one vector per head, broadcast over
    the T positions) rotated by ``rotation``: x·cos + swap(x)·(−sin, sin), a new tensor."""
    half = x.shape[-1] // 2
    swapped = torch.cat((x[..., half:], x[..., :half]), dim=-1)
    out = x * rotation.cos[:, None, :]
    out += swapped * rotation.signed_sin[:, None, :]
    return out


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    """(x1, x2) → (−x2, x1) over the two halves of the last dimension."""
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


def _inv_freq(config: RopeConfig) -> torch.Tensor:
    exponents = torch.arange(0, config.head_dim, 2, dtype=torch.int64).to(torch.float32)
    inv_freq = 1.0 / (config.theta ** (exponents / config.head_dim))
    if config.rope_type == "llama3":
        inv_freq = _llama3_scale(inv_freq, config)
    return inv_freq


def _llama3_scale(inv_freq: torch.Tensor, c: RopeConfig) -> torch.Tensor:
    # Llama 3 scaling: long wavelengths (low frequencies) are slowed by `factor`, short ones kept,
    # and the band between is interpolated smoothly in wavelength.
    low_freq_wavelen = c.original_max_position / c.low_freq_factor
    high_freq_wavelen = c.original_max_position / c.high_freq_factor
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > low_freq_wavelen, inv_freq / c.factor, inv_freq)
    smooth = (c.original_max_position / wavelen - c.low_freq_factor) / (
        c.high_freq_factor - c.low_freq_factor
    )
    smoothed = (1 - smooth) * scaled / c.factor + smooth * scaled
    in_band = ~(wavelen < high_freq_wavelen) & ~(wavelen > low_freq_wavelen)
    return torch.where(in_band, smoothed, scaled)
