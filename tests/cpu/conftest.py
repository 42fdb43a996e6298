"""The CPU kernels, built once per test session (skipped only where this machine cannot build
them: `cpu_kernel_expected`)."""

from __future__ import annotations

from typing import Any

import pytest

from kmesh_blend.cpu import cascade_decode_op, cpu_kernel_expected


@pytest.fixture(scope="session")
def kernel() -> Any:
    op, why = cascade_decode_op()
    if op is None:
        assert not cpu_kernel_expected(), f"this machine should build the kernel: {why}"
        pytest.skip(f"no CPU kernel here: {why}")
    return op
