"""The page copy kernel on a GPU: whole pages between staged page views and a device pool's
paged rows, bit for bit against torch's ``index_copy_`` / ``index_select``, for blocks of
layers anywhere in the pool; index entries outside the pool move nothing; views it cannot
serve are declined; the staged backend's round trips over ``page_first_direct`` and
``layer_first`` hosts run through it, and through torch's copies where it is declined, with
the same rows."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from controller_helpers import make_controller
from test_layouts import write_then_layer_wise_load

from hicache.controller import (
    MovedTransfer,
    chunk_moves,
    chunk_pages,
    index_moves,
    page_kernel,
    staged,
)
from hicache.controller.staged import StagedBackend
from hicache.pools import AttentionKind, HostLayout
from hicache.pools.pinned_uploads import UPLOADS

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]


def pool_and_staging(components: int, layers: int, pages: int, page_size: int, width: int,
                     staged_pages: int, dtype: torch.dtype = torch.int64
                     ) -> tuple[torch.Tensor, torch.Tensor]:
    """A device pool's rows ``[C, L, pages * page_size, width]`` viewed by pages and a
    staging buffer's whole pages ``[staged_pages, C, L, page_size, width]`` permuted to
    ``[C, L, staged_pages, page_size, width]`` (as the staged backend views them), both
    random."""
    gen = torch.Generator(device="cuda").manual_seed(pages + layers)
    rows = torch.randint(-2**20, 2**20, (components, layers, pages * page_size, width),
                         generator=gen, device="cuda").to(dtype)
    staging = torch.randint(-2**20, 2**20, (staged_pages, components, layers, page_size, width),
                            generator=gen, device="cuda").to(dtype)
    return (rows.view(components, layers, pages, page_size, width),
            staging.permute(1, 2, 0, 3, 4))


@pytest.mark.parametrize("components,layers,begin,count", [(2, 4, 0, 4), (2, 8, 3, 2),
                                                           (1, 6, 5, 1)])
@pytest.mark.parametrize("page_size,width,staged_pages", [(16, 256, 16), (64, 32, 3),
                                                          (16, 256, 700), (1, 2, 40)])
def test_scatter_and_gather_equal_torch(components: int, layers: int, begin: int, count: int,
                                        page_size: int, width: int, staged_pages: int) -> None:
    paged, staged_all = pool_and_staging(components, layers, 1024, page_size, width,
                                         staged_pages)
    device, staged = paged.narrow(1, begin, count), staged_all.narrow(1, 0, count)
    index = torch.randperm(1024, device="cuda")[:staged_pages].contiguous()
    expected_pool = paged.clone()
    expected_pool.narrow(1, begin, count).index_copy_(2, index, staged)
    launches = page_kernel.page_launches([staged], [device], scatter=True)
    assert launches is not None
    page_kernel.launch_pages(launches, index.data_ptr())
    assert torch.equal(paged, expected_pool)

    staged_all.zero_()
    gather = page_kernel.page_launches([staged], [device], scatter=False)
    assert gather is not None
    page_kernel.launch_pages(gather, index.data_ptr())
    assert torch.equal(staged, torch.index_select(device, 2, index))
    assert not staged_all.narrow(1, count, layers - count).any()  # other layers untouched


def test_index_entries_outside_the_pool_move_nothing() -> None:
    paged, staged = pool_and_staging(2, 2, 64, 16, 256, 4)
    before = paged.clone()
    index = torch.tensor([-1, 64, 2**40, 5], device="cuda")
    launches = page_kernel.page_launches([staged], [paged], scatter=True)
    assert launches is not None
    page_kernel.launch_pages(launches, index.data_ptr())
    expected = before.clone()
    expected[:, :, 5] = staged[:, :, 3]
    assert torch.equal(paged, expected)


def test_views_it_cannot_serve_are_declined() -> None:
    paged, staged = pool_and_staging(2, 2, 64, 16, 256, 4)
    flat = paged.reshape(2, 2, -1)
    odd = paged[..., :255]  # another row width, rows not contiguous
    assert page_kernel.page_launches([staged], [flat], scatter=True) is None  # not 5-D
    assert page_kernel.page_launches([staged], [odd], scatter=True) is None  # other shape
    shifted = torch.empty(2 * 2 * 64 * 16 * 256 + 1, dtype=torch.int32, device="cuda")[1:]
    misaligned = shifted.view(2, 2, 64, 16, 256)  # 4-byte aligned only
    aligned = torch.empty_like(misaligned)
    assert page_kernel.page_launches([aligned], [misaligned], scatter=True) is None
    assert page_kernel.page_launches([staged], [paged.float()], scatter=True) is None
    assert page_kernel.page_launches([staged.cpu()], [paged.cpu()], scatter=True) is None
    assert page_kernel.page_launches([], [], scatter=True) is None
    # pages of 12 bytes (one token of three int32) 16 bytes apart: every stride and start
    # aligned, but a page is not whole 16-byte vectors
    def padded(pages: int) -> torch.Tensor:
        view = torch.empty(2, 2, pages, 4, dtype=torch.int32, device="cuda")[..., :3]
        return view.unsqueeze(3)  # [2, 2, pages, 1, 3], pages 16 bytes apart

    assert page_kernel.page_launches([padded(4)], [padded(64)], scatter=True) is None
    # 16-byte pages and an aligned start, but a layer stride of 4100 bytes
    layers = torch.empty(2, 2, 64 * 4 * 4 + 1, dtype=torch.int32, device="cuda")
    odd_stride = layers.as_strided((2, 2, 64, 4, 4), (2 * 1025, 1025, 16, 4, 1))
    assert odd_stride.data_ptr() % 16 == 0
    assert page_kernel.page_launches([staged.int()[:, :, :, :4, :4].contiguous()], [odd_stride],
                                     scatter=True) is None
    assert not page_kernel.index_fits(torch.arange(4, device="cuda")[::2])
    assert not page_kernel.index_fits(torch.arange(4, dtype=torch.int32, device="cuda"))
    assert page_kernel.index_fits(torch.arange(4, device="cuda"))


@pytest.mark.parametrize("kernel", [True, False], ids=["kernel", "torch"])
@pytest.mark.parametrize("page_size", [16, 64])
@pytest.mark.parametrize("layout", [HostLayout.PAGE_FIRST_DIRECT, HostLayout.LAYER_FIRST],
                         ids=lambda x: x.value)
def test_round_trip_through_the_kernel(kernel: bool, page_size: int, layout: HostLayout,
                                       monkeypatch: pytest.MonkeyPatch) -> None:
    """Random device pages into a fragmented host and back layer by layer (the reference
    rows checked by the helper): with the kernel the chunks' gathers and scatters launch it;
    declined, torch's page copies (``page_first_direct``) or slot copies (``layer_first``)
    move the same rows."""
    calls: list[int] = []
    launch = page_kernel.launch_pages

    def counted(launches: Any, *args: Any) -> None:
        calls.append(len(launches))
        launch(launches, *args)

    monkeypatch.setattr(chunk_pages, "launch_pages", counted)
    monkeypatch.setattr(chunk_moves, "launch_pages", counted)
    if not kernel:
        monkeypatch.setattr(chunk_pages, "page_launches", lambda *args: None)
    write_then_layer_wise_load(StagedBackend(128), layout, page_size, AttentionKind.MHA, "cuda")
    assert (len(calls) > 0) is kernel


@pytest.mark.parametrize("kernel", [True, False], ids=["kernel", "torch"])
@pytest.mark.parametrize("layout", [HostLayout.PAGE_FIRST_DIRECT, HostLayout.LAYER_FIRST],
                         ids=lambda x: x.value)
def test_a_move_of_whole_pages_uploads_its_page_ids_alone(
        kernel: bool, layout: HostLayout, monkeypatch: pytest.MonkeyPatch) -> None:
    """A staged move of whole pages uploads one id a page and keeps its device slots on the
    CPU; where its chunks cannot move whole pages (the kernel declined on a ``layer_first``
    host: slot copies) the first of them uploads the move's slots, once, on the stream of
    the copies that read them. The rows land either way (the round trip checks them)."""
    page_size = 16
    moved: list[MovedTransfer] = []
    found = index_moves.move_whole_pages

    def spy(*args: Any) -> MovedTransfer | None:
        result = found(*args)
        if result is not None:
            moved.append(result)
        return result

    uploads: list[int] = []
    upload = UPLOADS.upload

    def counted(parts: Any, device: torch.device) -> torch.Tensor:
        uploads.append(sum(part.size for part in parts))
        return upload(parts, device)

    monkeypatch.setattr(index_moves, "move_whole_pages", spy)
    monkeypatch.setattr(UPLOADS, "upload", counted)
    if not kernel:
        monkeypatch.setattr(chunk_pages, "page_launches", lambda *args: None)
    write_then_layer_wise_load(StagedBackend(128), layout, page_size, AttentionKind.MHA, "cuda")
    assert moved, "no op moved whole pages"
    most_pages = 0
    for move in moved:
        assert move.device_page_index is not None and move.device_page_index.is_cuda
        assert not move.device_index.is_cuda
        pages = move.device_index.numel() // page_size
        assert move.device_page_index.numel() == pages
        assert move.device_page_index.tolist() == (move.device_index[::page_size]
                                                   // page_size).tolist()
        most_pages = max(most_pages, pages)
    slot_uploads = [count for count in uploads if count > most_pages]
    if not kernel and layout is HostLayout.LAYER_FIRST:  # slot copies: each move's, once
        assert sorted(slot_uploads) == sorted(move.device_index.numel() for move in moved)
    else:
        assert not slot_uploads


@pytest.mark.parametrize("layout", [HostLayout.PAGE_FIRST_DIRECT, HostLayout.LAYER_FIRST],
                         ids=lambda x: x.value)
@pytest.mark.parametrize("declined", [0, 2, 3], ids=["none", "every-2nd", "every-3rd"])
def test_chunks_on_the_copy_streams_and_the_side_stream_mix(
        layout: HostLayout, declined: int, monkeypatch: pytest.MonkeyPatch) -> None:
    """A load's chunk the page kernel scatters runs on its buffer's copy stream alone (copy,
    then scatter); one it declines is scattered on the side stream, with events. With the
    kernel declined for every 2nd chunk, one buffer's chunks run one way and the other's
    the other way, side by side; for every 3rd, each buffer passes between the two ways (a
    buffer a side-stream scatter drained is filled on its copy stream, and the reverse): a
    128-page write of 16 layers and its layer-wise load back in one-page chunks, three
    times over, land every row."""
    page_size, layers, pages = 16, 16, 128
    ctrl = make_controller(StagedBackend(page_size), device="cuda", page_size=page_size,
                           device_pages=2 * pages + 8, host_pages=pages + 8,
                           num_layers=layers, layout=layout, dtype=torch.float32)
    kinds: list[str] = []
    found = staged.kernel_launches

    def sometimes(*args: Any) -> Any:
        launches = found(*args)
        if declined and launches is not None and len(kinds) % declined == declined - 1:
            launches = None
        kinds.append("side" if launches is None else "copier")
        return launches

    monkeypatch.setattr(staged, "kernel_launches", sometimes)
    source = ctrl.device_allocator.try_alloc(pages * page_size)
    assert source is not None
    before = ctrl.device_pool.data[:, :, source.tensor.cuda()].clone()
    for _ in range(3):
        host = ctrl.write(source)
        assert host is not None
        ctrl.start_writing()
        ctrl.drain()
        loaded = ctrl.load(host)
        assert loaded is not None
        ctrl.start_loading()
        ctrl.drain()
        torch.cuda.synchronize()
        assert torch.equal(ctrl.device_pool.data[:, :, loaded.tensor.cuda()], before)
        ctrl.evict_device(loaded)
        ctrl.evict_host(host)
    assert "copier" in kinds and (("side" in kinds) == bool(declined))
