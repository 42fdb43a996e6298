"""`weights_fingerprint`: stable across copies, changed by any weight replacement that touches the
sampled bytes, cheap on a large file, and honest ("unverified:") about paths it cannot read."""

from __future__ import annotations

import shutil
import time
from pathlib import Path

import pytest

from kmesh_blend.segments.fingerprint import (
    UNVERIFIED_PREFIX,
    weights_fingerprint,
    window_offsets,
)

LARGE_FILE_BUDGET_S = 0.5  # a fixed number of 4 KiB reads; measured ≈ 1 ms on a 1 GiB file


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A private copy of the tiny Llama checkpoint (tests modify their own copies of it)."""
    from kmesh_blend.testing import TINY_LLAMA, build_checkpoint

    out = tmp_path_factory.mktemp("fp") / "tiny"
    shutil.copytree(build_checkpoint(TINY_LLAMA), out)
    return out


def _copy(src: Path, dst: Path) -> Path:
    shutil.copytree(src, dst)
    return dst


def test_same_dir_same_value(checkpoint: Path) -> None:
    first = weights_fingerprint(checkpoint)
    assert first == weights_fingerprint(str(checkpoint))
    assert len(first) == 64 and not first.startswith(UNVERIFIED_PREFIX)


def test_copy_elsewhere_same_value(checkpoint: Path, tmp_path: Path) -> None:
    copy = _copy(checkpoint, tmp_path / "elsewhere" / "renamed")
    time.sleep(0.01)
    (copy / "model.safetensors").touch()  # a newer mtime changes nothing
    assert weights_fingerprint(copy) == weights_fingerprint(checkpoint)


def test_perturbed_weights_change_value(checkpoint: Path, tmp_path: Path) -> None:
    import torch
    from safetensors import safe_open
    from safetensors.torch import save_file

    copy = _copy(checkpoint, tmp_path / "perturbed")
    file = copy / "model.safetensors"
    with safe_open(str(file), framework="pt") as f:
        metadata = f.metadata()
        tensors = {name: f.get_tensor(name) for name in f.keys()}  # noqa: SIM118
    gen = torch.Generator().manual_seed(0)
    noisy = {k: t + 1e-3 * torch.randn(t.shape, generator=gen) for k, t in tensors.items()}
    save_file(noisy, str(file), metadata=metadata)

    # Same names, dtypes, shapes and offsets: only the sampled windows can see the change.
    assert _header(file) == _header(checkpoint / "model.safetensors")
    assert weights_fingerprint(copy) != weights_fingerprint(checkpoint)


def test_one_byte_in_a_sampled_window_changes_value(checkpoint: Path, tmp_path: Path) -> None:
    copy = _copy(checkpoint, tmp_path / "one-byte")
    file = copy / "model.safetensors"
    offsets = window_offsets(file.stat().st_size)
    assert offsets, "the tiny checkpoint must be larger than the sampled windows"
    target = offsets[len(offsets) // 2] + 100  # inside a middle window, in the tensor data
    with open(file, "r+b") as f:
        f.seek(target)
        byte = f.read(1)
        f.seek(target)
        f.write(bytes([byte[0] ^ 0x01]))
    assert weights_fingerprint(copy) != weights_fingerprint(checkpoint)


def test_byte_between_windows_is_not_seen(tmp_path: Path) -> None:
    """The documented blind spot, pinned so that a change in sampling is a conscious one."""
    file = tmp_path / "weights.bin"
    file.write_bytes(bytes(1 << 20))
    offsets = window_offsets(1 << 20)
    before = weights_fingerprint(file)
    with open(file, "r+b") as f:
        f.seek(offsets[1] - 1)  # just before the second window
        f.write(b"\x01")
    assert weights_fingerprint(file) == before


def test_single_file_and_small_file(tmp_path: Path) -> None:
    small = tmp_path / "a.gguf"
    small.write_bytes(b"x" * 1000)
    value = weights_fingerprint(small)
    small.write_bytes(b"x" * 999 + b"y")  # small files are hashed whole
    assert weights_fingerprint(small) != value


def test_config_change_changes_value(checkpoint: Path, tmp_path: Path) -> None:
    copy = _copy(checkpoint, tmp_path / "config")
    config = copy / "config.json"
    config.write_text(config.read_text().replace("10000", "10001", 1))
    assert weights_fingerprint(copy) != weights_fingerprint(checkpoint)


def test_large_sparse_file_is_cheap(tmp_path: Path) -> None:
    file = tmp_path / "big.safetensors"
    with open(file, "wb") as f:
        f.truncate(1 << 30)  # 1 GiB, sparse: costs no disk
    start = time.perf_counter()
    value = weights_fingerprint(tmp_path)
    elapsed = time.perf_counter() - start
    assert not value.startswith(UNVERIFIED_PREFIX)
    assert elapsed < LARGE_FILE_BUDGET_S, f"{elapsed:.3f} s on a 1 GiB file"


@pytest.mark.parametrize("path", ["HuggingFaceTB/SmolLM2-135M-Instruct", "/no/such/dir"])
def test_non_local_path_is_unverified(path: str) -> None:
    assert weights_fingerprint(path) == f"{UNVERIFIED_PREFIX}{path}"


def test_dir_without_weights_is_unverified(tmp_path: Path) -> None:
    (tmp_path / "config.json").write_text("{}")
    assert weights_fingerprint(tmp_path) == f"{UNVERIFIED_PREFIX}{tmp_path}"


def _header(file: Path) -> bytes:
    with open(file, "rb") as f:
        length = int.from_bytes(f.read(8), "little")
        return f.read(length)
