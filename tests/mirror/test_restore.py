"""Restore into paged KV caches: the fused Triton kernel (interpreter) and the torch reference.

Both must write the sibling's KV bit for bit — stored rows and V are data movement, and predicted
K rows use the same cos/sin tables and unfused fp32 ops in both (the kernel rounds bf16 by hand
because the interpreter truncates). Layouts: NHD, HND, vLLM CPU ``[blocks, Hkv, bs, 2·D]`` with K
transposed within a block, and the same with K as rows.
"""

from __future__ import annotations

import pytest
import torch

from kmesh_blend.mirror.codec import Mirror, encode
from kmesh_blend.mirror.restore import plan_restore, restore_layer, run_self_check
from tests.mirror.test_codec import bits, inv_freq, sibling

GEN = torch.Generator().manual_seed(0)
BS = 16


def _views(layout: str, blocks: int, heads: int, dim: int, dtype: torch.dtype) -> tuple:
    """(k_view, v_view, backing tensor): [block, head, offset, dim] views of one layer's cache."""
    shape = {
        "nhd": (2, blocks, BS, heads, dim),
        "hnd": (blocks, 2, heads, BS, dim),
    }.get(layout, (blocks, heads, BS, 2 * dim))  # vLLM CPU
    c = torch.zeros(shape, dtype=dtype)
    return (*_rebuild(layout, c), c)


def _case(dtype: torch.dtype, granularity: str, tokens: int = 37, share: float = 0.2) -> tuple:
    L, H, D = 2, 2, 32
    master = torch.randn(L, 2, tokens, H, D, generator=GEN).to(dtype)
    mpos = torch.arange(tokens) + 3
    pos = torch.arange(tokens) + 250  # one shift for the whole segment (the common case)
    pos[tokens // 2 :] += 9  # ... and a second one (a gap in the sibling's prompt)
    changed = torch.rand(L, 2, tokens, generator=GEN) < share
    keys, values = sibling(master, mpos, pos, changed, GEN)
    mirror = encode(master, mpos, keys, values, pos, inv_freq(D), granularity)  # type: ignore[arg-type]
    return master, mpos, mirror, keys, values


def _restore(master, mpos, mirror, layout, backend, blocks=4, freq=None):  # type: ignore[no-untyped-def]
    L, _, S, H, D = master.shape
    slots = torch.randperm(blocks * BS, generator=GEN)[:S]
    plan = plan_restore(master, mpos, mirror, inv_freq(D) if freq is None else freq)
    caches = [_views(layout, blocks, H, D, master.dtype) for _ in range(L)]
    for layer, (k, v, _) in enumerate(caches):
        restore_layer(plan, master, layer, k, v, slots, BS, backend)
    blk, off = slots // BS, slots % BS
    keys = torch.stack([k[blk, :, off] for k, _, _ in caches])
    values = torch.stack([v[blk, :, off] for _, v, _ in caches])
    return keys, values, [c for _, _, c in caches], slots


@pytest.mark.parametrize("layout", ["nhd", "hnd", "cpu_k_transposed", "cpu_rows"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16], ids=str)
@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_restore_writes_the_sibling_bit_for_bit(
    backend: str, dtype: torch.dtype, layout: str
) -> None:
    master, mpos, mirror, keys, values = _case(dtype, "token")
    got_k, got_v, caches, slots = _restore(master, mpos, mirror, layout, backend)
    assert torch.equal(bits(got_k), bits(keys)) and torch.equal(bits(got_v), bits(values))
    # Nothing outside the slots was written.
    untouched = torch.ones(4 * BS, dtype=torch.bool)
    untouched[slots] = False
    rest = untouched.nonzero().squeeze(1)
    for c in caches:
        view_k, view_v = _rebuild(layout, c)
        assert (
            not view_k[rest // BS, :, rest % BS].any()
            and not view_v[rest // BS, :, rest % BS].any()
        )


def _rebuild(layout: str, c: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    if layout == "nhd":
        return c[0].permute(0, 2, 1, 3), c[1].permute(0, 2, 1, 3)
    if layout == "hnd":
        return c[:, 0], c[:, 1]
    blocks, heads, _, two_d = c.shape
    base = c.view(blocks, heads, 2 * BS, two_d // 2)
    if layout == "cpu_rows":
        return base[:, :, :BS], base[:, :, BS:]
    s = base.stride()
    k = base.as_strided((blocks, heads, BS, two_d // 2), (s[0], s[1], 1, BS), base.storage_offset())
    return k, base[:, :, BS:]


@pytest.mark.parametrize("granularity", ["token", "block16", "block32"])
@pytest.mark.parametrize("share", [0.0, 0.1, 1.0], ids=["empty", "sparse", "full"])
def test_triton_and_torch_agree_for_every_granularity(granularity: str, share: float) -> None:
    master, mpos, mirror, keys, values = _case(torch.bfloat16, granularity, tokens=21, share=share)
    for backend in ("triton", "torch"):
        got_k, got_v, _, _ = _restore(master, mpos, mirror, "cpu_k_transposed", backend)
        assert torch.equal(bits(got_k), bits(keys)) and torch.equal(bits(got_v), bits(values))


def test_a_wrong_shift_is_caught() -> None:
    """Guard: the comparison can fail — the same mirror claimed at positions one further on."""
    master, mpos, mirror, keys, _ = _case(torch.float32, "token", tokens=9, share=0.0)
    moved = Mirror(mirror.positions + 1, mirror.changed, mirror.rows, mirror.unit, "")
    got_k, _, _, _ = _restore(master, mpos, moved, "hnd", "triton")
    assert not torch.equal(got_k, keys)


def test_self_check_passes_under_the_interpreter_and_can_fail(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    assert run_self_check("cpu") is None
    import kmesh_blend.mirror.reference as ref

    true_restore = ref.restore_paged_reference

    def wrong_restore(*args, **kwargs):  # type: ignore[no-untyped-def]
        true_restore(*args, **kwargs)
        args[6].view(-1)[0] += 1.0  # one value of the V cache off

    monkeypatch.setattr(ref, "restore_paged_reference", wrong_restore)
    assert (run_self_check("cpu") or "").startswith("mirror_restore_kernel: V cache of layer 0")


def test_plan_and_launch_validate_inputs() -> None:
    master, mpos, mirror, _, _ = _case(torch.float32, "token", tokens=9)
    with pytest.raises(ValueError, match="predictor"):
        other = Mirror(mirror.positions, mirror.changed, mirror.rows, 1, "", "rope-v0")
        plan_restore(master, mpos, other, inv_freq(32))
    with pytest.raises(ValueError, match="does not fit"):
        plan_restore(master[:, :, :8], mpos[:8], mirror, inv_freq(32))
    with pytest.raises(ValueError, match="rows"):
        plan_restore(master.half(), mpos, mirror, inv_freq(32))
    truncated = Mirror(mirror.positions, mirror.changed, mirror.rows[:-1], 1, "")
    with pytest.raises(ValueError, match="rows"):
        plan_restore(master, mpos, truncated, inv_freq(32))
    plan = plan_restore(master, mpos, mirror, inv_freq(32))
    k, v, _ = _views("hnd", 1, 2, 32, torch.float32)
    with pytest.raises(ValueError, match="slots out of range"):
        restore_layer(plan, master, 0, k, v, torch.arange(9) + 10, BS)
    with pytest.raises(ValueError, match="k_cache"):
        restore_layer(plan, master, 0, k.half(), v, torch.arange(9), BS)
    with pytest.raises(ValueError, match="layer"):
        restore_layer(plan, master, 5, k, v, torch.arange(9), BS)
