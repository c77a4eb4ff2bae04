"""The page object's header and checksum, and the checks on page buffers."""

from __future__ import annotations

import pytest
import torch
import xxhash
from storage_helpers import PAGE_SIZE, hashes, make_pool, namespace, views

from hicache.pools import HostLayout, IndexSpace, Indices
from hicache.storage import PageFormat, byte_view, host_page_views
from hicache.storage.host_views import check_batch
from hicache.storage.page_format import payload_checksum
from hicache.storage.page_segments import PageRows


def test_a_page_verifies_against_its_own_header() -> None:
    """The header of a page verifies its payload, for its namespace and hash only."""
    pool = make_pool()
    fmt = PageFormat(namespace(pool))
    page, key = views(pool, 1, 1)[0], hashes(2)
    header = fmt.header(key[0], page)
    assert len(header) == fmt.header_len and fmt.header_len % 8 == 0
    assert fmt.verify(header, key[0], page)
    assert not fmt.verify(header, key[1], page)
    assert not PageFormat(namespace(pool, "r2")).verify(header, key[0], page)
    assert not fmt.verify(header[:-8], key[0], page)


def test_every_single_bit_flip_in_the_header_is_detected() -> None:
    """Flipping any one bit of the header makes verification fail."""
    pool = make_pool()
    fmt = PageFormat(namespace(pool))
    page, key = views(pool, 1, 1)[0], hashes(1)[0]
    header = fmt.header(key, page)
    for bit in range(8 * len(header)):
        flipped = bytearray(header)
        flipped[bit // 8] ^= 1 << (bit % 8)
        assert not fmt.verify(bytes(flipped), key, page), f"bit {bit} not detected"


def test_a_payload_bit_flip_is_detected_with_checksums_only() -> None:
    """With checksums a flipped payload bit fails; without, only the header is checked."""
    pool = make_pool(HostLayout.LAYER_FIRST)
    page, key = views(pool, 1, 1)[0], hashes(1)[0]
    on, off = PageFormat(namespace(pool)), PageFormat(namespace(pool), checksum=False)
    header_on, header_off = on.header(key, page), off.header(key, page)
    page[5][3] ^= 0x10
    assert not on.verify(header_on, key, page)
    assert off.verify(header_off, key, page) and on.verify(header_off, key, page)


def test_host_page_views_share_the_pool_memory_in_every_layout() -> None:
    """Writing through a view changes exactly that page's rows in the pool."""
    for layout, num_segments in ((HostLayout.PAGE_FIRST, 1), (HostLayout.LAYER_FIRST, 6),
                                 (HostLayout.PAGE_FIRST_DIRECT, 1)):
        pool = make_pool(layout)
        before = pool.read_rows(torch_slots(0, pool.num_slots))
        page = views(pool, 2, 1)[0]
        assert len(page) == num_segments
        for segment in page:
            segment[:] = bytes(segment.nbytes)
        changed = (pool.read_rows(torch_slots(0, pool.num_slots)) != before).nonzero()
        assert set(changed[:, 0].tolist()) <= set(range(8, 12))
        assert pool.read_rows(torch_slots(8, 12)).count_nonzero() == 0


def test_a_page_first_direct_page_is_one_segment_in_layer_order() -> None:
    """A page_first_direct page is ONE segment: its bytes are the page's rows as
    [components, layers, page_size, row]."""
    pool = make_pool(HostLayout.PAGE_FIRST_DIRECT)
    page = views(pool, 3, 1)[0]
    assert len(page) == 1 and page[0].nbytes == namespace(pool).page_bytes
    rows = pool.read_rows(torch_slots(12, 16)).permute(1, 2, 0, 3).contiguous()
    assert bytes(page[0]) == rows.view(torch.uint8).numpy().tobytes()


@pytest.mark.parametrize("layout", list(HostLayout))
def test_host_page_views_are_each_pages_rows_in_component_then_layer_order(
        layout: HostLayout) -> None:
    """Pages in any order (not a run, not sorted): each page's segments, joined, are its rows
    as [page_size, components, layers, row] for page_first, as [components, layers,
    page_size, row] for the others; a layer_first page is one segment per component and
    layer, of page_size rows."""
    pool = make_pool(layout, num_layers=5)
    order = [7, 2, 19, 3, 0, 23]
    index = Indices(torch.cat([torch.arange(p * PAGE_SIZE, (p + 1) * PAGE_SIZE) for p in order]),
                    IndexSpace.HOST_FULL)
    pages = host_page_views(pool, index)
    row_bytes = pool.data.element_size() * pool.geometry.row_elems
    components = pool.geometry.num_components
    for page, segments in zip(order, pages, strict=True):
        rows = pool.read_rows(torch_slots(page * PAGE_SIZE, (page + 1) * PAGE_SIZE))
        if layout is not HostLayout.PAGE_FIRST:
            rows = rows.permute(1, 2, 0, 3).contiguous()
        expected = rows.view(torch.uint8).numpy().tobytes()
        assert b"".join(bytes(s) for s in segments) == expected
        if layout is HostLayout.LAYER_FIRST:
            assert [s.nbytes for s in segments] == [PAGE_SIZE * row_bytes] * (components * 5)
        else:
            assert len(segments) == 1
        assert all(s.format == "B" and s.ndim == 1 and not s.readonly for s in segments)


def test_a_layer_first_pages_checksum_over_its_rows_is_its_segments_checksum() -> None:
    """A layer_first page's checksum is taken over one copy of its rows (the view the page
    carries); it equals the XXH3 of its segments in order, with and without a hybrid page's
    SWA segment after them, so pages written either way verify either way."""
    pool = make_pool(HostLayout.LAYER_FIRST, num_layers=5, page_size=16, heads=8, head_dim=64)
    order = [9, 4, 17]
    index = Indices(torch.cat([torch.arange(p * 16, (p + 1) * 16) for p in order]),
                    IndexSpace.HOST_FULL)
    swa = memoryview(bytearray(range(200)))
    for page in host_page_views(pool, index):
        assert isinstance(page, PageRows) and page.rows is not None
        assert page.rows.tobytes() == b"".join(bytes(s) for s in page)
        assert payload_checksum(page) == xxhash.xxh3_64_intdigest(b"".join(page)) \
            == payload_checksum(list(page))
        hybrid = page.with_segment(swa)
        assert hybrid.rows is page.rows and list(hybrid) == [*page, swa]
        assert payload_checksum(hybrid) == xxhash.xxh3_64_intdigest(b"".join([*page, swa]))
    other = host_page_views(make_pool(HostLayout.PAGE_FIRST_DIRECT, num_layers=5, page_size=16,
                                      heads=8, head_dim=64), index)[0]
    assert not isinstance(other, PageRows)


def test_byte_views_that_are_not_contiguous_or_are_read_only_are_still_refused() -> None:
    """The quick path for one-dimensional byte views leaves every refusal in place."""
    pool = make_pool()
    ns, key = namespace(pool), hashes(1)
    good = views(pool, 1, 1)[0][0]
    assert check_batch("get", ns, key, [[good]], writable=True) == [[good]]
    read_only = memoryview(bytes(good))
    assert check_batch("put", ns, key, [[read_only]], writable=False)
    with pytest.raises(ValueError, match="read-only"):
        check_batch("get", ns, key, [[read_only]], writable=True)
    floats = memoryview(bytearray(ns.page_bytes)).cast("f")  # not bytes: cast, then counted
    assert [v.nbytes for v in check_batch("put", ns, key, [[floats]], writable=False)[0]] == \
        [ns.page_bytes]
    square = memoryview(bytearray(ns.page_bytes)).cast("B", (2, ns.page_bytes // 2))
    assert [v.nbytes for v in check_batch("get", ns, key, [[square]], writable=True)[0]] == \
        [ns.page_bytes]
    doubled = memoryview(bytearray(2 * ns.page_bytes))[::2]
    with pytest.raises(ValueError, match="non-contiguous"):
        check_batch("put", ns, key, [[doubled]], writable=False)
    with pytest.raises(ValueError, match="holds 8 bytes"):
        check_batch("put", ns, key, [[good[:8]]], writable=False)


def torch_slots(start: int, end: int) -> Indices:
    return Indices(torch.arange(start, end), IndexSpace.HOST_FULL)


def test_host_page_views_refuse_slots_that_are_not_whole_pages() -> None:
    """Slots not in runs of page_size from a page boundary are refused."""
    pool = make_pool()
    with pytest.raises(ValueError, match="whole pages"):
        host_page_views(pool, torch_slots(2, 6))
    with pytest.raises(ValueError, match="whole number"):
        host_page_views(pool, torch_slots(4, 7))


def test_bad_buffers_are_refused_with_what_to_do() -> None:
    """Wrong sizes, read-only destinations, count mismatches, dtypes and keys are named."""
    pool = make_pool()
    ns, keys = namespace(pool), hashes(2)
    good = views(pool, 1, 2)
    with pytest.raises(ValueError, match="2 page hashes but 1 page buffers"):
        check_batch("get", ns, keys, good[:1], writable=True)
    with pytest.raises(ValueError, match="holds 192 bytes"):
        check_batch("get", ns, keys[:1], [[good[0][0][:192]]], writable=True)
    with pytest.raises(ValueError, match="read-only"):
        check_batch("get", ns, keys[:1], [[bytes(ns.page_bytes)]], writable=True)
    with pytest.raises(TypeError, match="float32 tensor"):
        check_batch("put", ns, keys[:1], [[torch.zeros(ns.page_bytes // 4)]], writable=False)
    with pytest.raises(TypeError, match="list of segments"):
        check_batch("put", ns, keys[:1], [good[0][0]], writable=False)  # type: ignore[list-item]
    with pytest.raises(ValueError, match="32 bytes"):
        check_batch("exists", ns, [b"x"], None, writable=False)
    assert check_batch("put", ns, keys[:1], [[byte_view(torch.zeros(ns.page_bytes,
                                              dtype=torch.uint8))]], writable=False)


def test_a_header_holds_its_fields_where_the_format_puts_them() -> None:
    """Two segments (a hybrid page: full rows, then SWA rows): the fixed fields, the
    payload checksum (XXH3-64 of the segments in order) and each segment's length, padded
    to the alignment; the page verifies."""
    import dataclasses
    import struct

    pool = make_pool()
    single = namespace(pool)
    two = dataclasses.replace(single, segment_bytes=(single.page_bytes - 64, 64))
    fmt = PageFormat(two, align=16)
    page, key = views(pool, 1, 1)[0], hashes(1)[0]
    header = fmt.header(key, page)
    fixed = struct.Struct("<4sHHHHQ16s16sQ")
    assert fmt.header_len == len(header) == -(-(fixed.size + 16) // 16) * 16
    magic, version, header_len, flags, segments, payload, digest, prefix, checksum = \
        fixed.unpack_from(header)
    assert (magic, version, header_len, flags, segments) == (b"HCKV", 1, fmt.header_len, 1, 2)
    assert (payload, digest, prefix) == (two.page_bytes, two.digest, key[:16])
    assert checksum == xxhash.xxh3_64_intdigest(b"".join(bytes(s) for s in page))
    assert struct.unpack_from("<2Q", header, fixed.size) == two.segment_bytes
    assert not any(header[fixed.size + 16:])
    assert fmt.verify(header, key, page)


@pytest.mark.parametrize("align", [4, 12, 0])
def test_an_alignment_that_is_not_a_power_of_two_of_8_or_more_is_refused(align: int) -> None:
    with pytest.raises(ValueError, match=f"align must be a power of two >= 8, got {align}"):
        PageFormat(namespace(make_pool()), align=align)


def test_a_header_longer_than_its_u16_length_is_refused() -> None:
    import dataclasses

    fits = dataclasses.replace(namespace(make_pool()), segment_bytes=(1,) * 8183)
    assert PageFormat(fits).header_len == 65528
    too_many = dataclasses.replace(fits, segment_bytes=(1,) * 8184)  # 65536 bytes
    with pytest.raises(ValueError, match="header of 65536 bytes does not fit its u16 length"):
        PageFormat(too_many)
