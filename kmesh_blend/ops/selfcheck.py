"""Start-up self-checks of the blend's kernels, registered with `kmesh_blend.ops.dispatch`.

Each check runs one kernel (``backend="triton"``) and its fp32 torch reference on a small scratch
input; ``"auto"`` runs it once per (kernel, device) and, on a mismatch or a launch error, logs one
warning line naming the kernel and takes the torch path for that kernel from then on.
Tolerances: re-positioning 1e-4 (sin/cos differ by ulps), deviation 1e-4 relative (summation
order); paged scatter/gather bit-exact (data movement).
"""

from __future__ import annotations

import torch

from kmesh_blend.ops import dispatch, reference
from kmesh_blend.ops.dispatch import expect_close, self_check

__all__ = ["KERNELS", "run_self_check", "triton_ok"]

KERNELS = ("reposition_kernel", "deviation_kernel", "scatter_paged_kernel", "gather_paged_kernel")


def triton_ok(device: torch.device) -> bool:
    """True when every kernel of `kmesh_blend.ops` matched its reference on ``device``."""
    return all(dispatch.kernel_ok(kernel, device) for kernel in KERNELS)


def run_self_check(device: torch.device | str) -> str | None:
    """Run each kernel's check now; None, or the first failure (``"<kernel>: <error>"``)."""
    for kernel in KERNELS:
        failure = dispatch.run_self_check(kernel, device)
        if failure is not None:
            return failure
    return None


# --- the checks (scratch inputs: 37 rows, 2 heads, head_dim 64, fp32) ---------------------------


def _scratch(device: torch.device) -> tuple[torch.Tensor, torch.Generator]:
    gen = torch.Generator().manual_seed(0)
    return torch.randn(37, 2, 64, generator=gen).to(device), gen


@self_check("reposition_kernel")
def _check_reposition(device: torch.device) -> None:
    from kmesh_blend.ops.launch import reposition_keys

    k, gen = _scratch(device)
    delta = torch.randint(-500, 500, (37,), generator=gen)
    inv_freq = (1.0 / 10000.0 ** (torch.arange(0, 64, 2) / 64)).float()
    got = reposition_keys(k, delta.to(device), inv_freq.to(device), backend="triton")
    want = reference.reposition_reference(k.cpu(), delta, inv_freq)
    expect_close("rotated keys", got, want, rtol=1e-4, atol=1e-4)


@self_check("deviation_kernel")
def _check_deviation(device: torch.device) -> None:
    from kmesh_blend.ops.launch import token_deviation

    k, gen = _scratch(device)
    other = torch.randn(37, 2, 64, generator=gen)
    got = token_deviation(k, other.to(device), backend="triton")
    want = reference.deviation_reference(k.cpu(), other)
    expect_close("deviation", got, want, rtol=1e-4, atol=1e-3)


@self_check("scatter_paged_kernel")
def _check_scatter(device: torch.device) -> None:
    from kmesh_blend.ops.launch import scatter_paged

    k, gen = _scratch(device)
    slots = torch.randperm(96, generator=gen)[:37]  # 3 blocks of 32, the last one partial
    got = torch.zeros(3, 32, 2, 64, device=device).permute(0, 2, 1, 3)  # NHD cache, viewed
    want = torch.zeros(3, 32, 2, 64).permute(0, 2, 1, 3)
    scatter_paged(k, got, slots.to(device), 32, backend="triton")
    reference.scatter_paged_reference(k.cpu(), want, slots, 32)
    expect_close("written cache", got, want)


@self_check("gather_paged_kernel")
def _check_gather(device: torch.device) -> None:
    from kmesh_blend.ops.launch import gather_paged

    _, gen = _scratch(device)
    cache = torch.randn(3, 2, 32, 64, generator=gen)  # HND
    slots = torch.randperm(96, generator=gen)[:37]
    got = gather_paged(cache.to(device), slots.to(device), 32, backend="triton")
    expect_close("gathered rows", got, reference.gather_paged_reference(cache, slots, 32))
