"""Teacher-forced scoring of a continuation over a prompt's KV cache, and the comparisons.

A server prefills the prompt once (full prefill, or a blend that reuses stored segments) and then
reads every later token against that KV cache. `continuation_logits` does exactly that: the
prompt's last-token scores predict the first continuation token, and the continuation's own
tokens, fed one causal block after the prompt's KV, predict the rest. Blended and full prefill
go through the same function, so at recompute ratio 1.0 (KV equal bit for bit) the scores are
equal bit for bit too.

Shapes: L layers, T prompt tokens, K continuation tokens, V vocabulary; keys / values per layer
[T, Hkv, D] (keys rotated at positions 0..T-1); logits fp32.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import torch.nn.functional as F

from kmesh_blend.models.layerwise import LayerwiseModel, causal_mask

__all__ = ["Comparison", "compare", "continuation_logits", "extend", "greedy"]


class Comparison(NamedTuple):
    """Per-position comparison of blended against full-prefill scores, each [N] (N positions).

    agree: bool, same top-1 token. kl: fp32 KL(full ‖ blended) of the next-token distributions
    (nats). nll: fp32 negative log-likelihood of the true token under the blended scores.
    identical: bool, the two score rows are equal bit for bit.
    """

    agree: torch.Tensor
    kl: torch.Tensor
    nll: torch.Tensor
    identical: torch.Tensor


@torch.no_grad()
def extend(
    model: LayerwiseModel,
    keys: list[torch.Tensor],
    values: list[torch.Tensor],
    token_ids: torch.Tensor,
    grow: bool = False,
) -> torch.Tensor:
    """Scores of ``token_ids`` [K] int64 placed after a cached prompt → logits [K, V] fp32.

    ``keys`` / ``values``: per layer [T, Hkv, D], the prompt's KV cache. The K tokens sit at
    positions T..T+K-1 and attend causally over the cache and each other; row k of the result
    predicts the token after ``token_ids[k]``. ``grow``: append the K tokens' KV to the lists'
    entries (the cache then holds T + K rows per layer), as a decoder does.
    """
    num_cached = keys[0].shape[0]
    positions = torch.arange(num_cached, num_cached + token_ids.numel())
    mask = causal_mask(positions, torch.arange(num_cached + token_ids.numel()))
    hidden = model.embed(token_ids)
    for layer in range(model.shape.num_layers):
        q, k, v = model.project_qkv(layer, hidden)
        q, k = model.rotate_qk(layer, q, k, positions)
        layer_k = torch.cat([keys[layer], k])
        layer_v = torch.cat([values[layer], v])
        if grow:
            keys[layer], values[layer] = layer_k, layer_v
        hidden = model.finish_layer(layer, hidden, model.attend(q, layer_k, layer_v, mask))
    return model.logits(hidden)


def continuation_logits(
    model: LayerwiseModel,
    keys: list[torch.Tensor],
    values: list[torch.Tensor],
    last_logits: torch.Tensor,
    continuation: torch.Tensor,
) -> torch.Tensor:
    """Scores predicting each of the K ``continuation`` tokens ([K] int64) → [K, V] fp32.

    ``last_logits``: [1, V], the prompt's last-token scores (they predict ``continuation[0]``);
    ``keys`` / ``values``: the prompt's KV cache as in `extend`.
    """
    if continuation.numel() == 1:
        return last_logits
    return torch.cat([last_logits, extend(model, keys, values, continuation[:-1])])


def compare(full: torch.Tensor, blended: torch.Tensor, targets: torch.Tensor) -> Comparison:
    """Compare score rows ``full`` and ``blended`` ([N, V] fp32) with true tokens [N] int64."""
    log_p = F.log_softmax(full, dim=-1)
    log_q = F.log_softmax(blended, dim=-1)
    kl = (log_p.exp() * (log_p - log_q)).sum(-1)
    nll = -log_q.gather(1, targets[:, None]).squeeze(1)
    agree = full.argmax(-1) == blended.argmax(-1)
    identical = (full == blended).all(-1)
    return Comparison(agree, kl, nll, identical)


@torch.no_grad()
def greedy(
    model: LayerwiseModel,
    keys: list[torch.Tensor],
    values: list[torch.Tensor],
    last_logits: torch.Tensor,
    num_tokens: int,
    stop_ids: tuple[int, ...] = (),
) -> torch.Tensor:
    """The greedy answer after a cached prompt → [n] int64, n ≤ ``num_tokens``, decoded one token
    at a time; it ends early with a token of ``stop_ids`` (included), as a server stops at the
    end of the turn.

    ``last_logits``: [1, V], the prompt's last-token scores; ``keys`` / ``values`` as in `extend`
    (the lists are not changed)."""
    keys, values = list(keys), list(values)
    out = [int(last_logits[-1].argmax())]
    while len(out) < num_tokens and out[-1] not in stop_ids:
        logits = extend(model, keys, values, torch.tensor(out[-1:]), grow=True)
        out.append(int(logits[-1].argmax()))
    return torch.tensor(out, dtype=torch.int64)
