"""The staged backend on a GPU, bit for bit against the torch backend: fragmented host runs,
every layout, MHA and MLA, all-layer writes and per-layer loads, with 2D copies and with the
row-by-row fallback used where no CUDA runtime library is found; page_first_direct hosts of
16- and 64-slot pages against a plain reference copy, every backend; plans of 2D copies
reused across layers against fresh plans."""

from __future__ import annotations

import pytest
import torch
from controller_helpers import make_controller
from test_layouts import write_then_layer_wise_load
from test_staged import fragmented_round_trip
from test_staged_plans import copy_groups, scattered_move

from hicache.controller import KernelBackend, TorchBackend, TransferBackend, chunk_moves, copy2d
from hicache.controller.base import Direction
from hicache.controller.direct import DirectBackend
from hicache.controller.kernel import kernel_available
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


def direct_backends() -> list[TransferBackend]:
    """Staged with chunks that cut pages (8 tokens) and that hold whole pages (128), the
    kernel where Triton is, and the torch reference."""
    found: list[TransferBackend] = [TorchBackend(), StagedBackend(8), StagedBackend(128),
                                    DirectBackend()]
    if kernel_available():
        found.append(KernelBackend(num_programs=16))
    return found


@pytest.mark.parametrize("backend", direct_backends(),
                         ids=lambda b: f"{b.name}-{getattr(b, 'staging_tokens', '')}")
@pytest.mark.parametrize("kind", list(AttentionKind), ids=lambda x: x.value)
@pytest.mark.parametrize("page_size", [16, 64])
def test_page_first_direct_round_trip(backend: TransferBackend, page_size: int,
                                      kind: AttentionKind) -> None:
    """Random device pages into a fragmented page_first_direct host and back layer by layer:
    exactly the reference rows move (staged: one 2D copy per run of pages and layer)."""
    write_then_layer_wise_load(backend, HostLayout.PAGE_FIRST_DIRECT, page_size, kind, "cuda")


@pytest.mark.parametrize("layout", list(HostLayout), ids=lambda x: x.value)
@pytest.mark.parametrize("two_d", [True, False], ids=["2d", "row-by-row"])
def test_plans_reused_across_layers_on_gpu(layout: HostLayout, two_d: bool,
                                           monkeypatch: pytest.MonkeyPatch) -> None:
    """Layer by layer through one op's plans (2D copies planned for layer 0, issued at every
    layer's offset, on both staging buffers; or, without a runtime library, each layer's
    views copied row by row): the rows that fresh plans and the torch backend move, bit for
    bit."""
    if not two_d:
        monkeypatch.setattr(copy2d, "_cudart", lambda: None)
    groups = [[layer] for layer in range(4)]
    reused = copy_groups(StagedBackend(2), layout, groups, device="cuda")
    fresh = copy_groups(StagedBackend(2), layout, groups, fresh=True, device="cuda")
    expected = copy_groups(TorchBackend(), layout, groups, device="cuda")
    for found in (reused, fresh):
        assert torch.equal(found[0], expected[0]) and torch.equal(found[1], expected[1])


def test_a_write_leaves_its_side_stream_current(monkeypatch: pytest.MonkeyPatch) -> None:
    """A write's chunks gather with the auxiliary stream current (made so once for all its
    chunks); the side stream that issued the write is current again after it, and after a
    chunk that fails."""
    backend = StagedBackend(4)
    ctrl = make_controller(backend, device="cuda", page_size=4, num_layers=4)
    side = torch.cuda.Stream()
    with torch.cuda.stream(side):
        backend.copy(scattered_move(ctrl), [0, 1, 2, 3], Direction.DEVICE_TO_HOST, [])
        assert torch.cuda.current_stream() == side
    seen = []
    gather = chunk_moves._gather

    def failing(*args: object) -> None:
        seen.append(torch.cuda.current_stream())
        if len(seen) == 2:
            raise RuntimeError("a chunk fails")
        gather(*args)  # type: ignore[arg-type]

    monkeypatch.setattr(chunk_moves, "_gather", failing)
    with torch.cuda.stream(side):
        with pytest.raises(RuntimeError, match="a chunk fails"):
            backend.copy(scattered_move(ctrl, 1), [0, 1, 2, 3], Direction.DEVICE_TO_HOST, [])
        assert torch.cuda.current_stream() == side
    assert len(seen) == 2 and all(stream != side for stream in seen)
    torch.cuda.synchronize()
