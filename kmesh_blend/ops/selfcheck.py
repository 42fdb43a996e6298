"""Start-up self-check: each Triton kernel against its torch reference on a small input.

On any mismatch or launch error, one warning line names the kernel and the reason, and every later
call on that device takes the torch path — doubtful kernels never produce KV that is served.
"""

from __future__ import annotations

import logging
from functools import cache

import torch

__all__ = ["run_self_check", "triton_ok"]

log = logging.getLogger("kmesh_blend.ops")


@cache
def triton_ok(device: torch.device) -> bool:
    """True when every kernel matched its reference on ``device`` (checked once per device)."""
    failure = run_self_check(device)
    if failure is None:
        log.info("kmesh kernels: Triton self-check passed on %s", device)
        return True
    log.warning("kmesh kernels: using the torch path on %s: %s", device, failure)
    return False


def run_self_check(device: torch.device | str) -> str | None:
    """Run each kernel once against its reference; return None, or why it failed."""
    from kmesh_blend.ops import launch, reference

    device = torch.device(device)
    gen = torch.Generator().manual_seed(0)
    try:
        k = torch.randn(37, 2, 64, generator=gen).to(device)
        delta = torch.randint(-500, 500, (37,), generator=gen).to(device)
        inv_freq = (1.0 / 10000.0 ** (torch.arange(0, 64, 2) / 64)).float().to(device)
        got = launch.reposition_keys(k, delta, inv_freq, backend="triton")
        want = reference.reposition_reference(k.cpu(), delta.cpu(), inv_freq.cpu())
        if not torch.allclose(got.cpu(), want, rtol=1e-4, atol=1e-4):
            return "reposition_kernel differs from its reference"
        other = torch.randn(37, 2, 64, generator=gen).to(device)
        dev = launch.token_deviation(k, other, backend="triton")
        if not torch.allclose(dev.cpu(), reference.deviation_reference(k.cpu(), other.cpu()),
                              rtol=1e-4, atol=1e-3):  # fmt: skip
            return "deviation_kernel differs from its reference"
        cache_ = torch.zeros(3, 2, 32, 64, device=device)
        slots = torch.randperm(96, generator=gen)[:37].to(device)
        launch.scatter_paged(k, cache_, slots, 32, backend="triton")
        if not torch.equal(launch.gather_paged(cache_, slots, 32, backend="triton").cpu(), k.cpu()):
            return "paged scatter/gather kernels do not round-trip exactly"
    except Exception as exc:  # any launch/compile problem means: do not trust the kernels
        return f"{type(exc).__name__}: {exc}"
    return None
