"""The reference executor is deterministic: the same prompt twice gives identical bits.

Everything the bit-exactness suite compares later (sequential vs layer-synchronous, stores, mirror
restores) assumes this of the executor it runs in.
"""

import pytest
import torch

from kmesh_blend.models import ReferenceModel, prefill
from kmesh_blend.testing import TEST_MODELS, build_checkpoint


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("spec", TEST_MODELS, ids=lambda s: s.name)
def test_prefill_twice_is_bit_identical(spec: object, dtype: torch.dtype) -> None:
    path = build_checkpoint(spec)  # type: ignore[arg-type]
    ids = torch.randint(3, 2048, (97,), generator=torch.Generator().manual_seed(7))
    a = prefill(ReferenceModel.load(path, dtype), ids)
    b = prefill(ReferenceModel.load(path, dtype), ids)
    assert torch.equal(a.logits, b.logits)
    for ka, kb, va, vb in zip(a.keys, b.keys, a.values, b.values, strict=True):
        assert torch.equal(ka, kb) and torch.equal(va, vb)
    # Guard: a different prompt must change the result, or the comparison proves nothing.
    c = prefill(ReferenceModel.load(path, dtype), ids.flip(0))
    assert not torch.equal(a.logits, c.logits)
