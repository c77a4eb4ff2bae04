"""The Triton transfer kernel against a plain torch reference, on CPU under the interpreter.

Run with ``TRITON_INTERPRET=1`` set before Triton is imported (CI sets it for the session);
without it the kernel tests skip. Argument validation runs before Triton is touched, so those
tests run everywhere. Shapes are tiny: the interpreter executes every program in Python.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from typing import Any

import pytest
import torch

from hicache.controller import row_copy
from hicache.controller.kernel import INTERPRET_ENV, kernel_available, transfer_rows
from hicache.pools import HostLayout, as_layer_first

SENTINEL = -7.0
INTERPRETED = os.environ.get(INTERPRET_ENV, "0") == "1"
needs_kernel = pytest.mark.skipif(
    not (INTERPRETED and kernel_available()),
    reason=f"CPU kernel tests need Triton and {INTERPRET_ENV}=1 set before Triton is imported "
    f"(run: {INTERPRET_ENV}=1 python -m pytest tests/test_kernel.py)",
)
LAYOUTS = tuple(HostLayout)
COMPONENTS = {"mha": 2, "mla": 1}
PAGE_SIZE = 4  # of page_first_direct host buffers unless a test says otherwise


def canonical(data: torch.Tensor, layout: HostLayout) -> torch.Tensor:
    """``[C, L, S, R]`` rows of a pool buffer in any storage order (a copy for
    page_first_direct)."""
    return as_layer_first(data, layout)


def store_canonical(data: torch.Tensor, layout: HostLayout, value: torch.Tensor) -> None:
    """Write ``[C, L, S, R]`` ``value`` into ``data`` in its storage order."""
    if layout is HostLayout.PAGE_FIRST_DIRECT:
        c, n, _, r = value.shape
        data.copy_(value.reshape(c, n, -1, data.shape[3], r).permute(2, 0, 1, 3, 4))
    else:
        canonical(data, layout).copy_(value)


def make_buffer(
    components: int, layers: int, slots: int, row: int, layout: HostLayout, dtype: torch.dtype,
    page_size: int = PAGE_SIZE,
) -> torch.Tensor:
    """Contiguous sentinel-filled buffer in storage order."""
    shape: tuple[int, ...] = (components, layers, slots, row)
    if layout is HostLayout.PAGE_FIRST:
        shape = (slots, components, layers, row)
    elif layout is HostLayout.PAGE_FIRST_DIRECT:
        shape = (slots // page_size, components, layers, page_size, row)
    return torch.full(shape, SENTINEL, dtype=dtype)


def fill_pattern(data: torch.Tensor, layout: HostLayout) -> None:
    """Give every element a distinct, exactly representable value that encodes its position.

    float32: ``code * R + column`` with ``code = (slot * L + layer) * C + component``;
    half types keep only ``code`` (integers below 256 are exact in bfloat16).
    """
    c, n, s, r = canonical(data, layout).shape
    slot = torch.arange(s).view(1, 1, s, 1)
    layer = torch.arange(n).view(1, n, 1, 1)
    component = torch.arange(c).view(c, 1, 1, 1)
    code = (slot * n + layer) * c + component
    if data.dtype == torch.float32:
        value = code * r + torch.arange(r).view(1, 1, 1, r)
    else:
        assert int(code.max()) < 256, "pattern would not be exact in a half type"
        value = code.expand(c, n, s, r)
    store_canonical(data, layout, value.to(data.dtype))


def expected_after(
    dst: torch.Tensor,
    src: torch.Tensor,
    dst_indices: torch.Tensor,
    src_indices: torch.Tensor,
    layers: slice,
) -> torch.Tensor:
    """Torch reference on canonical ``[C, L, S, R]`` tensors: copy pairs without a 0."""
    out = dst.clone()
    for s, d in zip(src_indices.tolist(), dst_indices.tolist(), strict=True):
        if s != 0 and d != 0:
            out[:, layers, d] = src[:, layers, s]
    return out


def run_case(
    *,
    kind: str = "mha",
    layout: HostLayout = HostLayout.LAYER_FIRST,
    to_host: bool = True,
    host_indices: torch.Tensor,
    device_indices: torch.Tensor,
    layers: int = 2,
    layer_range: tuple[int, int] | None = None,
    device_slots: int = 80,
    host_slots: int = 96,
    row: int = 8,
    dtype: torch.dtype = torch.float32,
    page_size: int = PAGE_SIZE,
    **launch: Any,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Fill the source with the pattern, the destination with the sentinel, run the kernel,
    check the source is unchanged and the destination equals the reference; return both
    canonical buffers (source, destination)."""
    components = COMPONENTS[kind]
    device = make_buffer(components, layers, device_slots, row, HostLayout.LAYER_FIRST, dtype)
    host = make_buffer(components, layers, host_slots, row, layout, dtype, page_size)
    begin, end = layer_range or (0, layers)
    src, src_layout = (device, HostLayout.LAYER_FIRST) if to_host else (host, layout)
    dst, dst_layout = (host, layout) if to_host else (device, HostLayout.LAYER_FIRST)
    fill_pattern(src, src_layout)
    src_before = src.clone()
    dst_before = canonical(dst, dst_layout).clone()
    transfer_rows(
        device_data=device, host_data=host, host_layout=layout,
        host_indices=host_indices, device_indices=device_indices,
        layer_begin=begin, layer_end=end, to_host=to_host, **launch,
    )
    assert torch.equal(src, src_before), "the source buffer changed"
    src_view, dst_view = canonical(src, src_layout), canonical(dst, dst_layout)
    dst_indices, src_indices = (
        (host_indices, device_indices) if to_host else (device_indices, host_indices)
    )
    want = expected_after(dst_before, src_view, dst_indices, src_indices, slice(begin, end))
    assert torch.equal(dst_view, want), "moved rows differ from the source or a row was touched"
    return src_view, dst_view


def random_pairs(n: int, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """``n`` duplicate-free non-padding pairs: (host_indices, device_indices), int64."""
    gen = torch.Generator().manual_seed(seed)
    host = torch.randperm(95, generator=gen)[:n] + 1
    device = torch.randperm(79, generator=gen)[:n] + 1
    return host, device


@needs_kernel
@pytest.mark.parametrize("to_host", [True, False], ids=["d2h", "h2d"])
@pytest.mark.parametrize("num_pairs", [1, 7, 8, 9, 63, 64, 65])
def test_pair_counts_straddling_tiles(num_pairs: int, to_host: bool) -> None:
    """Pair counts around the 8-token tile and 64 move exactly their rows, nothing else."""
    host, device = random_pairs(num_pairs, seed=num_pairs)
    run_case(host_indices=host, device_indices=device, to_host=to_host)


@needs_kernel
@pytest.mark.parametrize("to_host", [True, False], ids=["d2h", "h2d"])
@pytest.mark.parametrize("kind", ["mha", "mla"])
@pytest.mark.parametrize("layout", LAYOUTS, ids=[layout.value for layout in LAYOUTS])
def test_layouts_and_kinds(layout: HostLayout, kind: str, to_host: bool) -> None:
    """Every host layout, K+V and latent rows, both directions (9 pairs, 16-wide rows)."""
    host, device = random_pairs(9, seed=3)
    run_case(kind=kind, layout=layout, to_host=to_host, host_indices=host,
             device_indices=device, row=16)


@needs_kernel
@pytest.mark.parametrize("to_host", [True, False], ids=["d2h", "h2d"])
@pytest.mark.parametrize("page_size", [1, 16, 64])
def test_page_first_direct_page_sizes(page_size: int, to_host: bool) -> None:
    """page_first_direct hosts of 1-, 16- and 64-slot pages: rows land at
    ``[slot // page_size, :, layer, slot % page_size]``, layers [1, 3) of 4 only."""
    host, device = random_pairs(33, seed=page_size)
    _, dst = run_case(layout=HostLayout.PAGE_FIRST_DIRECT, page_size=page_size,
                      host_slots=128, layers=4, layer_range=(1, 3), to_host=to_host,
                      host_indices=host, device_indices=device)
    assert bool((dst[:, [0, 3]] == SENTINEL).all())


@needs_kernel
@pytest.mark.parametrize("row", [4, 12, 24])
def test_row_width_not_a_power_of_two_of_the_block(row: int) -> None:
    """Rows narrower than their power-of-two block (like 576 of 1024) stay within the row."""
    host, device = random_pairs(9, seed=row)
    run_case(kind="mla", layout=HostLayout.PAGE_FIRST, host_indices=host,
             device_indices=device, row=row)


@needs_kernel
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_dtypes(dtype: torch.dtype) -> None:
    """bfloat16, float16 and float32 rows are copied bit for bit."""
    gen = torch.Generator().manual_seed(5)
    host = torch.randperm(15, generator=gen)[:9] + 1
    device = torch.randperm(15, generator=gen)[:9] + 1
    for to_host in (True, False):
        run_case(dtype=dtype, host_indices=host, device_indices=device, device_slots=16,
                 host_slots=16, to_host=to_host, layout=HostLayout.PAGE_FIRST)


@needs_kernel
@pytest.mark.parametrize(
    ("host_dtype", "device_dtype"),
    [(torch.int32, torch.int32), (torch.int64, torch.int64),
     (torch.int32, torch.int64), (torch.int64, torch.int32)],
    ids=["i32", "i64", "i32-i64", "i64-i32"],
)
def test_index_dtypes(host_dtype: torch.dtype, device_dtype: torch.dtype) -> None:
    """int32 and int64 indices, also mixed between the two sides."""
    host, device = random_pairs(9, seed=7)
    for to_host in (True, False):
        run_case(host_indices=host.to(host_dtype), device_indices=device.to(device_dtype),
                 layout=HostLayout.PAGE_FIRST, to_host=to_host)


@needs_kernel
@pytest.mark.parametrize("to_host", [True, False], ids=["d2h", "h2d"])
def test_layer_subrange(to_host: bool) -> None:
    """Only layers [1, 3) of 4 move; rows of layers 0 and 3 keep the sentinel."""
    host, device = random_pairs(9, seed=11)
    _, dst = run_case(host_indices=host, device_indices=device, layers=4,
                      layer_range=(1, 3), to_host=to_host, layout=HostLayout.PAGE_FIRST)
    assert bool((dst[:, [0, 3]] == SENTINEL).all())


@needs_kernel
@pytest.mark.parametrize("to_host", [True, False], ids=["d2h", "h2d"])
def test_padding_pairs_skipped(to_host: bool) -> None:
    """Pairs with slot 0 on either side move nothing; slot 0 of the destination is untouched."""
    host = torch.tensor([0, 5, 0, 7, 9, 11, 13, 0, 2], dtype=torch.int64)
    device = torch.tensor([3, 0, 0, 4, 6, 0, 8, 10, 1], dtype=torch.int32)
    _, dst = run_case(host_indices=host, device_indices=device, to_host=to_host)
    assert bool((dst[:, :, 0] == SENTINEL).all())
    untouched = [3, 5, 10] if not to_host else [0, 5, 11]
    assert bool((dst[:, :, untouched] == SENTINEL).all())


@needs_kernel
@pytest.mark.parametrize("to_host", [True, False], ids=["d2h", "h2d"])
def test_out_of_range_slots_are_never_dereferenced(to_host: bool) -> None:
    """A slot index past its pool's end, or negative, is skipped instead of read or written."""
    host = torch.tensor([96, 4, -3, 6], dtype=torch.int64)
    device = torch.tensor([2, 80, 5, 7], dtype=torch.int64)
    device_buf = make_buffer(2, 2, 80, 8, HostLayout.LAYER_FIRST, torch.float32)
    host_buf = make_buffer(2, 2, 96, 8, HostLayout.PAGE_FIRST, torch.float32)
    src, src_layout = (
        (device_buf, HostLayout.LAYER_FIRST) if to_host else (host_buf, HostLayout.PAGE_FIRST)
    )
    fill_pattern(src, src_layout)
    transfer_rows(device_data=device_buf, host_data=host_buf, host_layout=HostLayout.PAGE_FIRST,
                  host_indices=host, device_indices=device, layer_begin=0, layer_end=2,
                  to_host=to_host)
    host_view = canonical(host_buf, HostLayout.PAGE_FIRST)
    assert torch.equal(host_view[:, :, 6], device_buf[:, :, 7])
    dst, moved = (host_view, 6) if to_host else (device_buf, 7)
    others = torch.ones(dst.shape[2], dtype=torch.bool)
    others[moved] = False
    assert bool((dst[:, :, others] == SENTINEL).all())


@needs_kernel
@pytest.mark.parametrize("order", ["reversed", "random"])
def test_orders(order: str) -> None:
    """Reversed and shuffled (duplicate-free) pair orders land every row at its slot."""
    host = torch.arange(1, 41)
    device = torch.arange(20, 60)
    if order == "reversed":
        host = host.flip(0)
    else:
        perm = torch.randperm(40, generator=torch.Generator().manual_seed(1))
        host, device = host[perm], device[torch.randperm(40)]
    for to_host in (True, False):
        run_case(host_indices=host, device_indices=device, to_host=to_host,
                 layout=HostLayout.PAGE_FIRST)


@pytest.mark.parametrize("layer_range", [(0, 2), (1, 1)], ids=["no-pairs", "no-layers"])
def test_empty_input_is_a_no_op(layer_range: tuple[int, int]) -> None:
    """No pairs or an empty layer range launch nothing (and need no Triton at all)."""
    device = make_buffer(2, 2, 8, 8, HostLayout.LAYER_FIRST, torch.float32)
    host = make_buffer(2, 2, 8, 8, HostLayout.LAYER_FIRST, torch.float32)
    fill_pattern(device, HostLayout.LAYER_FIRST)
    pairs = 0 if layer_range == (0, 2) else 3
    index = torch.arange(1, pairs + 1)
    transfer_rows(device_data=device, host_data=host, host_layout=HostLayout.LAYER_FIRST,
                  host_indices=index, device_indices=index, layer_begin=layer_range[0],
                  layer_end=layer_range[1], to_host=True)
    assert bool((host == SENTINEL).all())


@needs_kernel
def test_grid_and_tile_sizes_give_identical_results() -> None:
    """1 or 16 programs, and other tile sizes, produce the same destination."""
    host, device = random_pairs(65, seed=13)
    results = [
        run_case(host_indices=host, device_indices=device, to_host=False,
                 layout=HostLayout.PAGE_FIRST, num_programs=programs,
                 tokens_per_tile=tile)[1]
        for programs, tile in ((1, 8), (16, 8), (3, 1), (16, 32), (2, 1024))
    ]
    for result in results[1:]:
        assert torch.equal(result, results[0])


def _args(**overrides: Any) -> dict[str, Any]:
    args: dict[str, Any] = {
        "device_data": torch.zeros(2, 3, 16, 8),
        "host_data": torch.zeros(2, 3, 20, 8),
        "host_layout": HostLayout.LAYER_FIRST,
        "host_indices": torch.tensor([1, 2], dtype=torch.int64),
        "device_indices": torch.tensor([3, 4], dtype=torch.int32),
        "layer_begin": 0,
        "layer_end": 3,
        "to_host": True,
    }
    args.update(overrides)
    return args


BAD_ARGUMENTS: list[tuple[str, Callable[[], dict[str, Any]], str]] = [
    ("length", lambda: _args(device_indices=torch.tensor([3], dtype=torch.int32)),
     r"same length, got 2 and 1"),
    ("float-index", lambda: _args(host_indices=torch.tensor([1.0, 2.0])),
     r"host_indices must be int32 or int64, got torch.float32"),
    ("2d-index", lambda: _args(device_indices=torch.tensor([[3, 4]])),
     r"device_indices must be 1-D, got shape \(1, 2\)"),
    ("index-device", lambda: _args(host_indices=torch.tensor([1, 2], device="meta")),
     r"host_indices must be on cpu \(device_data's device\), got meta"),
    ("dtype", lambda: _args(host_data=torch.zeros(2, 3, 20, 8, dtype=torch.bfloat16)),
     r"dtype must match device_data: expected torch.float32, got torch.bfloat16"),
    ("row", lambda: _args(host_data=torch.zeros(2, 3, 20, 16)),
     r"expected \(2, 3, 8\), got \(2, 3, 16\)"),
    ("components", lambda: _args(host_data=torch.zeros(1, 3, 20, 8)),
     r"expected \(2, 3, 8\), got \(1, 3, 8\)"),
    ("layers", lambda: _args(host_data=torch.zeros(20, 2, 4, 8),
                             host_layout=HostLayout.PAGE_FIRST),
     r"\(page_first\) must match device_data: expected \(2, 3, 8\), got \(2, 4, 8\)"),
    ("layer-end", lambda: _args(layer_end=4), r"layer range \[0, 4\) must lie in \[0, 3\]"),
    ("layer-begin", lambda: _args(layer_begin=-1), r"layer range \[-1, 3\)"),
    ("layer-order", lambda: _args(layer_begin=2, layer_end=1), r"with begin <= end"),
    ("programs", lambda: _args(num_programs=0), r"num_programs must be >= 1, got 0"),
    ("tile", lambda: _args(tokens_per_tile=6), r"power of two in \[1, 1024\], got 6"),
    ("tile-past-the-bound", lambda: _args(tokens_per_tile=2048),
     r"power of two in \[1, 1024\], got 2048"),
    ("tile-zero", lambda: _args(tokens_per_tile=0), r"power of two in \[1, 1024\], got 0"),
    ("device-strided", lambda: _args(device_data=torch.zeros(2, 3, 8, 16)[..., :8]),
     r"device_data must be contiguous"),
    ("host-strided", lambda: _args(host_data=torch.zeros(3, 2, 20, 8).transpose(0, 1)),
     r"host_data must be contiguous"),
    ("not-4d", lambda: _args(host_data=torch.zeros(2, 3, 160)),
     r"host_data must be a 4-D tensor \(layer_first\), got \(2, 3, 160\)"),
    ("direct-not-5d", lambda: _args(host_data=torch.zeros(20, 2, 3, 8),
                                    host_layout=HostLayout.PAGE_FIRST_DIRECT),
     r"host_data must be a 5-D tensor \(page_first_direct\), got \(20, 2, 3, 8\)"),
    ("direct-layers", lambda: _args(host_data=torch.zeros(5, 2, 2, 4, 8),
                                    host_layout=HostLayout.PAGE_FIRST_DIRECT),
     r"\(page_first_direct\) must match device_data: expected \(2, 3, 8\), got \(2, 2, 8\)"),
    ("not-a-tensor", lambda: _args(host_data=[[0.0] * 8]),
     r"host_data must be a 4-D tensor \(layer_first\), got list"),
    ("layout-name", lambda: _args(host_layout="layer_first"),
     r"host_layout must be a HostLayout, got 'layer_first'"),
]


@pytest.mark.parametrize(("name", "make", "message"), BAD_ARGUMENTS,
                         ids=[case[0] for case in BAD_ARGUMENTS])
def test_bad_arguments_raise_value_error(
    name: str, make: Callable[[], dict[str, Any]], message: str
) -> None:
    """Each malformed argument raises ValueError saying what was expected and what came."""
    with pytest.raises(ValueError, match=message):
        transfer_rows(**make())


def test_bad_arguments_raise_after_a_good_launch() -> None:
    """The buffer checks, done once per buffer geometry, still refuse every malformed
    argument after a launch has passed them for well-formed buffers."""
    no_pairs = torch.empty(0, dtype=torch.int64)
    transfer_rows(**_args(host_indices=no_pairs, device_indices=no_pairs))
    for _, make, message in BAD_ARGUMENTS:
        with pytest.raises(ValueError, match=message):
            transfer_rows(**make())


def test_buffer_checks_run_once_per_geometry(monkeypatch: pytest.MonkeyPatch) -> None:
    """Launches over buffers of one geometry check them once; another geometry (or a strided
    view of the same shape) is checked again."""
    checked: list[tuple[int, ...]] = []
    check = row_copy._check_buffers

    def counted(device: torch.Tensor, host: torch.Tensor, layout: HostLayout) -> None:
        checked.append(tuple(host.shape))
        check(device, host, layout)

    monkeypatch.setattr(row_copy, "_check_buffers", counted)
    monkeypatch.setattr(row_copy, "_PLANS", {})
    no_pairs = torch.empty(0, dtype=torch.int64)
    for host in (torch.zeros(2, 3, 20, 8), torch.zeros(2, 3, 20, 8), torch.zeros(2, 3, 24, 8)):
        transfer_rows(**_args(host_data=host, host_indices=no_pairs, device_indices=no_pairs))
    assert checked == [(2, 3, 20, 8), (2, 3, 24, 8)]
    with pytest.raises(ValueError, match="host_data must be contiguous"):
        transfer_rows(**_args(host_data=torch.zeros(2, 20, 3, 8).transpose(1, 2)))


@needs_kernel
def test_kernel_available_under_the_interpreter() -> None:
    """With Triton and the interpreter on, callers may pick the kernel backend."""
    assert kernel_available()
