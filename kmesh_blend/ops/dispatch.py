"""The launch pattern every kernel launcher shares: backend choice, argument checks, self-checks.

A launcher (`kmesh_blend.ops.launch`, `kmesh_blend.attention.launch`, `kmesh_blend.mirror.restore`)

1. validates its arguments with the ``check_*`` helpers below (`ValueError` naming the argument);
2. asks ``use_triton(backend, like, "<kernel>")`` (or `resolve` when it has more backends);
3. launches the ``@triton.jit`` function of `kmesh_blend.kernels`, or calls its fp32 torch
   reference.

Start-up self-checks: each kernel registers one check with ``@self_check("<kernel>")`` — a
function of the device that runs the kernel (``backend="triton"``) and its fp32 torch reference
on a small scratch input and raises on a mismatch (`expect_close`). ``"auto"`` calls
`kernel_ok`, which runs that check once per (kernel, device); on a mismatch or any exception one
warning line names the kernel, the device and the error, and that kernel takes its torch reference
from then on — doubtful kernels never produce KV that is served. Explicit ``"triton"`` always
launches (tests and benchmarks ask for it on purpose).

Importing this module imports torch, not Triton, vLLM or LMCache.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from functools import cache
from typing import Literal, TypeVar

import torch

__all__ = [
    "FLOAT_DTYPES",
    "KERNEL_DEVICES",
    "Backend",
    "SelfCheckError",
    "check_float",
    "check_index",
    "check_like",
    "check_paged",
    "check_slots",
    "expect_close",
    "kernel_ok",
    "next_pow2",
    "registered_kernels",
    "reset_self_checks",
    "resolve",
    "run_self_check",
    "self_check",
    "use_triton",
]

log = logging.getLogger("kmesh_blend.ops")

Backend = Literal["auto", "torch", "triton"]
FLOAT_DTYPES = (torch.float32, torch.float16, torch.bfloat16)
# Device types on which "auto" considers Triton: compiled kernels need CUDA (on the CPU Triton runs
# only in its slow interpreter, so "auto" keeps the torch references there).
KERNEL_DEVICES: tuple[str, ...] = ("cuda",)

SelfCheck = Callable[[torch.device], None]
_F = TypeVar("_F", bound=SelfCheck)
_CHECKS: dict[str, SelfCheck] = {}


class SelfCheckError(AssertionError):
    """A kernel's result differs from its reference beyond the stated tolerance."""


# --- backend choice -----------------------------------------------------------------------------


def resolve(backend: str, like: torch.Tensor, kernel: str, others: Sequence[str] = ()) -> str:
    """The concrete backend of one launch.

    ``"torch"``, ``"triton"`` and any name in ``others`` (e.g. ``"flashinfer"``) are taken as
    asked; ``"auto"`` picks ``"triton"`` when ``like`` lives on a device of `KERNEL_DEVICES`
    (CUDA) and ``kernel`` passed its self-check there, ``"torch"`` otherwise. Anything else:
    `ValueError` naming the valid choices.
    """
    if backend in ("torch", "triton", *others):
        return backend
    if backend != "auto":
        valid = ", ".join(repr(b) for b in ("auto", "torch", "triton", *others))
        raise ValueError(f"backend={backend!r}; valid: {valid}")
    if like.device.type in KERNEL_DEVICES and kernel_ok(kernel, like.device):
        return "triton"
    return "torch"


def use_triton(backend: str, like: torch.Tensor, kernel: str) -> bool:
    """`resolve` for launchers with the two backends ``"torch"`` and ``"triton"``."""
    return resolve(backend, like, kernel) == "triton"


def next_pow2(n: int) -> int:
    """Smallest power of two ≥ n (Triton block sizes)."""
    return 1 << max(0, (n - 1).bit_length())


# --- self-check registry ------------------------------------------------------------------------


def self_check(kernel: str) -> Callable[[_F], _F]:
    """Register the decorated function as ``kernel``'s start-up self-check (one per kernel)."""

    def register(check: _F) -> _F:
        _CHECKS[kernel] = check
        return check

    return register


def registered_kernels() -> list[str]:
    """Names of the kernels with a registered self-check (those of the modules imported so far)."""
    return sorted(_CHECKS)


def run_self_check(kernel: str, device: torch.device | str) -> str | None:
    """Run ``kernel``'s self-check on ``device`` now: None, or ``"<kernel>: <error>"``.

    Raises `KeyError` for a kernel without a registered check (a programming error).
    """
    check = _CHECKS[kernel]
    try:
        check(torch.device(device))
    except SelfCheckError as exc:
        return f"{kernel}: {exc}"
    except Exception as exc:  # any launch/compile problem: do not trust the kernel either
        return f"{kernel}: {type(exc).__name__}: {exc}"
    return None


@cache
def kernel_ok(kernel: str, device: torch.device) -> bool:
    """True when ``kernel`` matched its reference on ``device`` (checked once per device)."""
    failure = run_self_check(kernel, device)
    if failure is None:
        log.info("kmesh kernels: %s passed its self-check on %s", kernel, device)
        return True
    log.warning(
        "kmesh kernels: %s disabled on %s, using its torch reference [%s]", kernel, device, failure
    )
    return False


def reset_self_checks() -> None:
    """Forget every cached self-check outcome (tests; a device reset)."""
    kernel_ok.cache_clear()


def expect_close(
    what: str, got: torch.Tensor, want: torch.Tensor, rtol: float = 0.0, atol: float = 0.0
) -> None:
    """Raise `SelfCheckError` unless ``got`` matches ``want`` (compared on the CPU).

    ``rtol = atol = 0`` means bit-exact (`torch.equal`, data movement); otherwise
    ``|got − want| ≤ atol + rtol·|want|`` in fp32, NaN only where the reference has NaN.
    """
    got, want = got.detach().cpu(), want.detach().cpu()
    if got.shape != want.shape or got.dtype != want.dtype:
        raise SelfCheckError(
            f"{what}: got {tuple(got.shape)} {got.dtype}, want {tuple(want.shape)} {want.dtype}"
        )
    if rtol == atol == 0.0:
        if torch.equal(got, want):
            return
    elif torch.allclose(got.float(), want.float(), rtol=rtol, atol=atol, equal_nan=True):
        return
    diff = (got.float() - want.float()).abs().nan_to_num(nan=float("inf"), posinf=float("inf"))
    worst = float(diff.max()) if diff.numel() else 0.0
    raise SelfCheckError(
        f"{what} differs from its reference (max |error| {worst:.3g}; rtol {rtol:g}, atol {atol:g})"
    )


# --- argument checks ----------------------------------------------------------------------------


def check_float(name: str, t: torch.Tensor, dims: int) -> None:
    """``t`` has ``dims`` dimensions and one of `FLOAT_DTYPES`."""
    if t.dim() != dims:
        raise ValueError(f"{name} must have {dims} dims, got shape {tuple(t.shape)}")
    if t.dtype not in FLOAT_DTYPES:
        raise ValueError(f"{name} dtype {t.dtype} unsupported; valid: {FLOAT_DTYPES}")


def check_index(name: str, t: torch.Tensor, n: int, device: torch.device) -> None:
    """``t`` is [n] int64 on ``device``."""
    if t.shape != (n,) or t.dtype != torch.int64 or t.device != device:
        raise ValueError(
            f"{name} must be [{n}] int64 on {device}, got {tuple(t.shape)} {t.dtype} on {t.device}"
        )


def check_like(
    name: str, t: torch.Tensor, device: torch.device, dtype: torch.dtype | None = None
) -> None:
    """``t`` is on ``device`` (and in ``dtype`` when given)."""
    if t.device != device or (dtype is not None and t.dtype != dtype):
        want = f"{dtype} on {device}" if dtype is not None else f"on {device}"
        raise ValueError(f"{name} is {t.dtype} on {t.device}; want {want}")


def check_paged(name: str, cache: torch.Tensor, block_size: int, heads: int, dim: int) -> None:
    """``cache`` is a ``[block, heads, block_size, dim]`` view (any strides) of a paged cache."""
    if cache.dim() != 4 or tuple(cache.shape[1:]) != (heads, block_size, dim):
        raise ValueError(
            f"{name} {tuple(cache.shape)} is not a [block, {heads}, {block_size}, {dim}] view "
            f"(head, block_size={block_size}, dim)"
        )


def check_slots(slots: torch.Tensor, n: int, device: torch.device, num_slots: int) -> None:
    """``slots`` is [n] int64 on ``device`` with every id in [0, num_slots)."""
    check_index("slots", slots, n, device)
    if slots.numel() and (int(slots.min()) < 0 or int(slots.max()) >= num_slots):
        raise ValueError(f"slots out of range [0, {num_slots})")
