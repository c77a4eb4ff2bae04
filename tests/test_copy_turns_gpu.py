"""Copy turns on a GPU: the staged and direct backends with every copy taking turns (the
thresholds forced down so the small shapes exercise them) bit for bit against the torch
backend, and a copy that waits on the GPU for the big one before it."""

from __future__ import annotations

import time

import pytest
import torch
from test_layouts import write_then_layer_wise_load
from test_staged import fragmented_round_trip

from hicache.controller import TorchBackend, TransferBackend, copy_turns
from hicache.controller.copy_turns import CopyTurns
from hicache.controller.direct import DirectBackend
from hicache.controller.staged import StagedBackend
from hicache.pools import AttentionKind, HostLayout

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]

BACKENDS = {"staged": lambda: StagedBackend(staging_tokens=6), "direct": DirectBackend}


@pytest.fixture
def every_copy_takes_turns(monkeypatch: pytest.MonkeyPatch) -> None:
    """Every copy makes the next wait, and every block goes one layer a piece."""
    monkeypatch.setattr(copy_turns, "TURN_BYTES", 1)
    monkeypatch.setattr(copy_turns, "PIECE_BYTES", 1)


@pytest.mark.usefixtures("every_copy_takes_turns")
@pytest.mark.parametrize("name", list(BACKENDS))
@pytest.mark.parametrize("layout", list(HostLayout), ids=lambda x: x.value)
@pytest.mark.parametrize("kind", list(AttentionKind), ids=lambda x: x.value)
def test_turns_move_the_same_bytes(name: str, layout: HostLayout, kind: AttentionKind) -> None:
    backend: TransferBackend = BACKENDS[name]()
    expected = fragmented_round_trip(TorchBackend(), layout, kind, "cuda")
    found = fragmented_round_trip(backend, layout, kind, "cuda")
    assert torch.equal(found[0], expected[0])
    assert torch.equal(found[1], expected[1])


@pytest.mark.usefixtures("every_copy_takes_turns")
@pytest.mark.parametrize("name", list(BACKENDS))
@pytest.mark.parametrize("layout", list(HostLayout), ids=lambda x: x.value)
def test_turns_keep_layer_wise_loads_exact(name: str, layout: HostLayout) -> None:
    write_then_layer_wise_load(BACKENDS[name](), layout, 4, AttentionKind.MHA, "cuda")



@pytest.mark.usefixtures("every_copy_takes_turns")
@pytest.mark.parametrize("layout", list(HostLayout), ids=lambda x: x.value)
def test_direct_orders_its_copy_streams_once_an_op(layout: HostLayout,
                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    """The direct backend orders its copy streams after the side stream's start of an op
    once (a write, then a layer-wise load in several layer groups: two starts), while
    every group still joins the side stream; the rows land exactly."""
    starts: list[CopyTurns] = []
    joins: list[CopyTurns] = []
    start, join = CopyTurns.start, CopyTurns.join

    def counted_start(turns: CopyTurns) -> None:
        starts.append(turns)
        start(turns)

    def counted_join(turns: CopyTurns) -> None:
        joins.append(turns)
        join(turns)

    monkeypatch.setattr(CopyTurns, "start", counted_start)
    monkeypatch.setattr(CopyTurns, "join", counted_join)
    write_then_layer_wise_load(DirectBackend(), layout, 4, AttentionKind.MHA, "cuda")
    assert len(starts) == 2 and len(joins) > 2

def _two_copies(first_bytes: int) -> tuple[torch.cuda.Event, torch.cuda.Event, list[bool]]:
    """A copy of ``first_bytes`` held on the GPU behind a long kernel on its stream, then a
    16-byte copy through the turns; the events after each, and the checks of the bytes."""
    turns = CopyTurns(torch.cuda.Stream())
    first, second = turns.streams
    assert first is not None and second is not None
    host = torch.arange(max(first_bytes, 16), dtype=torch.uint8).pin_memory()
    device = torch.zeros(first_bytes + 16, dtype=torch.uint8, device="cuda")
    done_first, done_second = torch.cuda.Event(), torch.cuda.Event()
    with torch.cuda.stream(first):
        torch.cuda._sleep(1_000_000_000)  # about half a second of GPU time: holds the copy
    assert turns.next(first_bytes) == first.cuda_stream
    with torch.cuda.stream(first):
        device[:first_bytes].copy_(host[:first_bytes], non_blocking=True)
        done_first.record()
    turns.end()
    assert turns.next(16) == second.cuda_stream
    with torch.cuda.stream(second):
        device[first_bytes:].copy_(host[:16], non_blocking=True)
        done_second.record()
    turns.end()
    turns.join()
    turns.side.synchronize()  # the side stream waited for both
    assert done_first.query() and done_second.query()
    checks = [torch.equal(device[:first_bytes].cpu(), host[:first_bytes]),
              torch.equal(device[first_bytes:].cpu(), host[:16])]
    return done_first, done_second, checks


def test_a_copy_after_a_big_one_waits_for_it_on_the_gpu(monkeypatch: pytest.MonkeyPatch) -> None:
    """The copy after a big one, on the other copy stream, runs only after it: its event
    is not reached while the big copy is held (with no turn it would be, at once)."""
    turns_seen: list[bool] = []
    original = CopyTurns.end

    def end_and_look(self: CopyTurns) -> None:
        original(self)
        if self._next == 0:  # the second copy was just issued: is it held?
            time.sleep(0.05)
            turns_seen.append(self._done[1].query())

    monkeypatch.setattr(CopyTurns, "end", end_and_look)
    _, _, checks = _two_copies(copy_turns.TURN_BYTES)
    assert turns_seen == [False], "the copy after a big one ran before it"
    assert all(checks)


def test_a_copy_after_a_small_one_does_not_wait(monkeypatch: pytest.MonkeyPatch) -> None:
    """Small copies queue together: the second runs while the first is still held."""
    seen: list[bool] = []
    original = CopyTurns.end

    def end_and_look(self: CopyTurns) -> None:
        original(self)
        if self._next == 0:
            self._done[1].synchronize()  # returns while the first copy is still held
            seen.append(self._done[0].query())

    monkeypatch.setattr(CopyTurns, "end", end_and_look)
    _, _, checks = _two_copies(1024)
    assert seen == [False], "the small copy waited for the one before it"
    assert all(checks)
