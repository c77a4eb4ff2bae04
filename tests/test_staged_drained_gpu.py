"""The staged backend on a GPU: a load whose chunks take both scatter paths on one staging
buffer. A chunk the page kernel cannot serve (host slots that cut pages) is scattered on the
side stream; a later chunk the page kernel scatters on a copy stream refills the same buffer
and must wait for that scatter first, or its rows land in the earlier chunk's slots."""

from __future__ import annotations

import pytest
import torch
from controller_helpers import SENTINEL, device_rows, fill_unique, host_rows, make_controller

from hicache.controller import staged
from hicache.controller.base import Direction, MovedTransfer, PoolTransfer
from hicache.controller.kernel import kernel_available
from hicache.controller.staged import StagedBackend
from hicache.pools import HostLayout, IndexSpace, Indices

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]

PAGE = 16
LAYERS = 3
SIDE_DELAY_CYCLES = 200_000_000  # about 0.1 s on current GPUs


@pytest.mark.skipif(not kernel_available(), reason="the page kernel needs Triton")
def test_a_paged_chunk_waits_for_the_side_scatter_of_its_buffer(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """Four chunks of one page each alternate the two staging buffers: whole host page
    (page kernel, buffer 0), a run cutting two host pages (side stream, buffer 1), whole
    page (buffer 0), whole page (buffer 1). The side stream is slowed before its scatter;
    the fourth chunk's copy into buffer 1 waits for it, and every device row is the host
    row it was loaded from. (The load runs twice, the first time unslowed, so that the
    second's chunks are issued well within the delay.)"""
    backend = StagedBackend(staging_tokens=PAGE)  # all layers moved: one page a chunk
    ctrl = make_controller(backend, device="cuda", page_size=PAGE, device_pages=12,
                           host_pages=24, num_layers=LAYERS,
                           layout=HostLayout.PAGE_FIRST_DIRECT)
    fill_unique(ctrl.host_pool.data)
    ctrl.device_pool.data.fill_(SENTINEL)
    host = torch.cat([torch.arange(16, 32), torch.arange(40, 56), torch.arange(64, 80),
                      torch.arange(96, 112)])
    pages = (3, 1, 4, 2)
    device = torch.cat([torch.arange(page * PAGE, (page + 1) * PAGE) for page in pages])
    transfer = PoolTransfer(name="full", host_pool=ctrl.host_pool, device_pool=ctrl.device_pool,
                            host_indices=Indices(host, IndexSpace.HOST_FULL),
                            device_indices=Indices(device, IndexSpace.DEVICE_FULL),
                            layers=tuple(range(LAYERS)))

    def load() -> None:
        # the device pages uploaded with the op, as the controller's checks hand them over
        # for whole pages (the slots stay on the CPU: uploaded where a chunk needs them)
        moved = MovedTransfer(transfer, host, device,
                              device_page_index=torch.tensor(pages, device="cuda"))
        with torch.cuda.stream(side):
            backend.copy(moved, list(range(LAYERS)), Direction.HOST_TO_DEVICE, [])
        torch.cuda.synchronize()

    paths: list[str] = []
    delay = [0]
    side_chunk, paged_chunk = staged.move_chunk, staged.move_paged_chunk

    def slow_side_chunk(*args: object, **kwargs: object) -> None:
        paths.append("side")
        if delay[0]:
            torch.cuda._sleep(delay[0])  # on the side stream, current here
        side_chunk(*args, **kwargs)  # type: ignore[arg-type]

    def counted_paged_chunk(*args: object, **kwargs: object) -> None:
        paths.append("paged")
        paged_chunk(*args, **kwargs)  # type: ignore[arg-type]

    monkeypatch.setattr(staged, "move_chunk", slow_side_chunk)
    monkeypatch.setattr(staged, "move_paged_chunk", counted_paged_chunk)
    side = torch.cuda.Stream()
    load()  # once first: kernels compiled and plans made, so the CPU issues the next fast
    ctrl.device_pool.data.fill_(SENTINEL)
    paths.clear()
    delay[0] = SIDE_DELAY_CYCLES
    load()
    assert paths == ["paged", "side", "paged", "paged"]
    got, want = device_rows(ctrl.device_pool), host_rows(ctrl.host_pool)
    assert torch.equal(got[device], want[host])
    untouched = torch.ones(got.shape[0], dtype=torch.bool)
    untouched[device] = False
    assert (got[untouched] == SENTINEL).all()
