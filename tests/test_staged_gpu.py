"""The staged backend on a GPU, bit for bit against the torch backend: fragmented host runs,
both layouts, MHA and MLA, all-layer writes and per-layer loads, with 2D copies and with the
row-by-row fallback used where no CUDA runtime library is found."""

from __future__ import annotations

import pytest
import torch
from test_staged import fragmented_round_trip

from hicache.controller import TorchBackend, copy2d
from hicache.controller.staged import StagedBackend
from hicache.pools import AttentionKind, HostLayout

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]


@pytest.mark.parametrize("layout", list(HostLayout), ids=lambda x: x.value)
@pytest.mark.parametrize("kind", list(AttentionKind), ids=lambda x: x.value)
@pytest.mark.parametrize("two_d", [True, False], ids=["2d", "row-by-row"])
def test_staged_equals_torch(layout: HostLayout, kind: AttentionKind, two_d: bool,
                             monkeypatch: pytest.MonkeyPatch) -> None:
    if two_d:
        assert copy2d.have_2d_copies(), "no CUDA runtime library found for 2D copies"
    else:
        monkeypatch.setattr(copy2d, "_cudart", lambda: None)
    expected = fragmented_round_trip(TorchBackend(), layout, kind, "cuda")
    found = fragmented_round_trip(StagedBackend(staging_tokens=6), layout, kind, "cuda")
    assert torch.equal(found[0], expected[0])
    assert torch.equal(found[1], expected[1])
