"""The mirror codec and its wire format: lossless round trips, fuzzed (plain torch, no kernels).

Every comparison is on integer views (bit for bit), stricter than `torch.equal` (−0.0 vs 0.0).
"""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from kmesh_blend.mirror.codec import GRANULARITIES, Mirror, encode, predict_layer
from kmesh_blend.mirror.reference import restore_dense_reference
from kmesh_blend.mirror.wire import MirrorFormatError, decode, encode_bytes

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
_INT = {torch.float32: torch.int32, torch.bfloat16: torch.int16, torch.float16: torch.int16}


def bits(x: torch.Tensor) -> torch.Tensor:
    return x.view(_INT[x.dtype])


def inv_freq(dim: int) -> torch.Tensor:
    return 1.0 / 10000.0 ** (torch.arange(0, dim, 2, dtype=torch.float32) / dim)


def sibling(
    master: torch.Tensor,
    mpos: torch.Tensor,
    pos: torch.Tensor,
    changed: torch.Tensor,
    gen: torch.Generator,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The prediction with the rows of ``changed`` [L, 2, S] given other bits (one element each,
    flipped by a random non-zero mask, so every chosen row really differs)."""
    L, _, S, H, D = master.shape
    pred = [predict_layer(master, mpos, pos, layer, inv_freq(D)) for layer in range(L)]
    kv = torch.stack([torch.stack([k, v]) for k, v in pred]).clone()  # [L, 2, S, H, D]
    flat = bits(kv).view(L, 2, S, H * D)
    rows = changed.nonzero()
    col = torch.randint(0, H * D, (rows.shape[0],), generator=gen)
    flip = torch.randint(1, 1 << 15, (rows.shape[0],), generator=gen).to(flat.dtype)
    flat[rows[:, 0], rows[:, 1], rows[:, 2], col] ^= flip
    return kv[:, 0], kv[:, 1]


@settings(max_examples=60, deadline=None)
@given(
    dtype=st.sampled_from(sorted(DTYPES)),
    layers=st.integers(1, 3),
    tokens=st.integers(1, 40),
    heads=st.integers(1, 2),
    dim=st.sampled_from([2, 4, 8]),
    granularity=st.sampled_from(sorted(GRANULARITIES)),
    fill=st.sampled_from(["empty", "full", "random"]),
    seed=st.integers(0, 2**16),
)
def test_round_trip_is_bit_exact(
    dtype: str, layers: int, tokens: int, heads: int, dim: int, granularity: str, fill: str,
    seed: int,
) -> None:  # fmt: skip
    gen = torch.Generator().manual_seed(seed)
    master = (torch.randn(layers, 2, tokens, heads, dim, generator=gen) * 4).to(DTYPES[dtype])
    mpos = torch.randint(0, 500, (tokens,), generator=gen)
    pos = torch.randint(0, 5000, (tokens,), generator=gen)
    p = {"empty": 0.0, "full": 1.0, "random": float(torch.rand((), generator=gen))}[fill]
    changed = torch.rand(layers, 2, tokens, generator=gen) < p
    keys, values = sibling(master, mpos, pos, changed, gen)

    mirror = encode(master, mpos, keys, values, pos, inv_freq(dim), granularity, "v1")  # type: ignore[arg-type]
    got_k, got_v = restore_dense_reference(master, mpos, mirror, inv_freq(dim))
    assert torch.equal(bits(got_k), bits(keys)) and torch.equal(bits(got_v), bits(values))

    # The diff holds exactly the units with a changed row, and nothing else.
    unit = GRANULARITIES[granularity]
    pad = -tokens % unit
    units = torch.nn.functional.pad(changed, (0, pad)).view(layers, 2, -1, unit).any(dim=3)
    assert torch.equal(mirror.changed, units)
    stored_tokens = units.repeat_interleave(unit, dim=2)[:, :, :tokens]
    assert mirror.rows.shape[0] == int(stored_tokens.sum())
    if fill == "empty":
        assert mirror.rows.shape[0] == 0
    if fill == "full":
        assert mirror.rows.shape[0] == layers * 2 * tokens

    # Wire round trip, plain and byte-plane compressed: the same mirror, bit for bit.
    for compress in (False, True):
        back, header = decode(encode_bytes(mirror, "ab" * 32, compress))
        assert header.master_id == "ab" * 32 and header.master_checksum == "v1"
        assert torch.equal(back.changed, mirror.changed) and torch.equal(back.positions, pos)
        assert back.rows.dtype == mirror.rows.dtype
        assert torch.equal(bits(back.rows), bits(mirror.rows))
        assert (back.unit, back.predictor) == (mirror.unit, mirror.predictor)


def test_signed_zero_counts_as_a_change() -> None:
    """Bitwise, not numeric: −0.0 where the prediction has +0.0 must be stored."""
    master = torch.zeros(1, 2, 4, 1, 2)
    pos = torch.arange(4)
    keys, values = master[:, 0].clone(), master[:, 1].clone()
    values[0, 2, 0, 1] = -0.0
    mirror = encode(master, pos, keys, values, pos, inv_freq(2))
    assert mirror.changed[0, 1].tolist() == [False, False, True, False]
    _, got_v = restore_dense_reference(master, pos, mirror, inv_freq(2))
    assert torch.equal(bits(got_v), bits(values))


def test_restore_against_another_master_is_caught_by_the_comparison() -> None:
    """Guard: the round-trip comparison can fail (one bit of the master changed)."""
    gen = torch.Generator().manual_seed(3)
    master = torch.randn(2, 2, 10, 2, 8, generator=gen)
    pos = torch.arange(10) + 7
    keys, values = sibling(master, pos - 7, pos, torch.zeros(2, 2, 10, dtype=torch.bool), gen)
    mirror = encode(master, pos - 7, keys, values, pos, inv_freq(8))
    other = master.clone()
    bits(other)[1, 0, 4, 1, 3] ^= 1
    got_k, _ = restore_dense_reference(other, pos - 7, mirror, inv_freq(8))
    assert not torch.equal(bits(got_k), bits(keys))


def test_encode_validates_inputs() -> None:
    master = torch.randn(2, 2, 5, 1, 4)
    pos = torch.arange(5)
    with pytest.raises(ValueError, match="granularity"):
        encode(master, pos, master[:, 0], master[:, 1], pos, inv_freq(4), "block8")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="do not match"):
        encode(master, pos, master[:, 0, :4], master[:, 1], pos, inv_freq(4))
    with pytest.raises(ValueError, match="dtype"):
        encode(master, pos, master[:, 0].half(), master[:, 1], pos, inv_freq(4))
    with pytest.raises(ValueError, match="positions"):
        encode(master, pos, master[:, 0], master[:, 1], pos[:4], inv_freq(4))


def _blob(compress: bool = False) -> tuple[bytes, Mirror]:
    gen = torch.Generator().manual_seed(5)
    master = torch.randn(2, 2, 9, 2, 8, generator=gen).bfloat16()
    pos = torch.arange(9)
    changed = torch.rand(2, 2, 9, generator=gen) < 0.3
    keys, values = sibling(master, pos, pos + 40, changed, gen)
    mirror = encode(master, pos, keys, values, pos + 40, inv_freq(8), "token", "c0ffee")
    return encode_bytes(mirror, "cd" * 32, compress), mirror


@settings(max_examples=40, deadline=None)
@given(data=st.data())
def test_any_corruption_or_truncation_is_detected(data: st.DataObject) -> None:
    blob, _ = _blob(data.draw(st.booleans()))
    at = data.draw(st.integers(0, len(blob) - 1))
    mask = data.draw(st.integers(1, 255))
    corrupted = bytearray(blob)
    corrupted[at] ^= mask
    with pytest.raises(MirrorFormatError):
        decode(bytes(corrupted))
    cut = data.draw(st.integers(0, len(blob) - 1))
    with pytest.raises(MirrorFormatError):
        decode(blob[:cut])


@pytest.mark.parametrize("compress", [False, True])
def test_intact_blob_decodes(compress: bool) -> None:
    """Guard for the test above: the same blob, untouched, decodes."""
    blob, mirror = _blob(compress)
    back, _ = decode(blob)
    assert torch.equal(bits(back.rows), bits(mirror.rows)) and back.rows.shape[0] > 0


def test_a_plane_that_would_inflate_past_its_size_stops_there() -> None:
    """A hostile compressed plane (a "zip bomb") is refused after at most size + 1 bytes."""
    import zlib

    from kmesh_blend.mirror import wire

    bomb = zlib.compress(b"\0" * (64 << 20), 9)  # 64 MiB from ≈ 64 KiB
    with pytest.raises(zlib.error, match="exactly 16 bytes"):
        wire._inflate(bomb, 16)
    assert wire._inflate(zlib.compress(b"x" * 16), 16) == b"x" * 16
    with pytest.raises(zlib.error):
        wire._inflate(zlib.compress(b"x" * 16)[:-3], 16)  # cut short
