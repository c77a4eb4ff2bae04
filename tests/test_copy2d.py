"""Planning strided staged copies as one 2D copy: which views collapse to equal rows, with
what widths and pitches, and that the block copy moves exactly the viewed elements."""

from __future__ import annotations

import pytest
import torch

from hicache.controller.copy2d import (
    MAX_PITCH_BYTES,
    CopyPlanner,
    RowPlan,
    _copy_rows,
    as_bytes,
    copy_block,
    emulate_copies,
    plan_block,
    plan_copies,
    plan_rows,
)

C, L, S, R = 2, 4, 40, 8  # components, layers, host slots, row elements


def test_layer_first_run_of_all_layers_is_one_copy() -> None:
    """All components and layers of a run: rows of len*R, one per (component, layer)."""
    host = torch.zeros(C, L, S, R)
    staging = torch.zeros(C, L, 16, R)
    plan = plan_rows(host[:, :, 5:12], staging[:, :, 3:10])
    assert plan is not None
    dst, src = plan
    size = host.element_size()
    assert (dst.height, dst.width_bytes, dst.pitch_bytes) == (C * L, 7 * R * size, S * R * size)
    assert (src.height, src.width_bytes, src.pitch_bytes) == (C * L, 7 * R * size, 16 * R * size)
    assert dst.ptr == host[0, 0, 5].data_ptr() and src.ptr == staging[0, 0, 3].data_ptr()


def test_layer_first_one_layer_is_one_copy() -> None:
    """One layer of a run: one row per component, a whole component apart on the host."""
    host = torch.zeros(C, L, S, R)
    staging = torch.zeros(C, 1, 16, R)
    plan = plan_rows(host[:, 2:3, 5:12], staging[:, :, 0:7])
    assert plan is not None
    size = host.element_size()
    assert plan[0].height == C and plan[0].pitch_bytes == L * S * R * size
    assert plan[1].pitch_bytes == 16 * R * size and plan[0].width_bytes == 7 * R * size


def test_page_first_one_layer_rows_a_token_apart() -> None:
    """One layer of a page_first run: rows of R, one per (token, component)."""
    host = torch.zeros(S, C, L, R)
    staging = torch.zeros(16, C, 1, R)
    plan = plan_rows(host[5:12, :, 1:2], staging[0:7])
    assert plan is not None
    size = host.element_size()
    assert (plan[0].height, plan[0].width_bytes, plan[0].pitch_bytes) == (7 * C, R * size,
                                                                          L * R * size)
    assert plan[1].pitch_bytes == R * size


def test_page_first_layer_block_rows_span_the_block() -> None:
    """Layers 1..2 of a page_first run: each row holds the block's layers of one component."""
    host = torch.zeros(S, C, L, R)
    staging = torch.zeros(16, C, 2, R)
    plan = plan_rows(host[5:12, :, 1:3], staging[0:7])
    assert plan is not None
    assert plan[0].height == 7 * C and plan[0].width_bytes == 2 * R * host.element_size()


def test_contiguous_on_both_sides_is_one_row() -> None:
    host = torch.zeros(S, C, L, R)
    staging = torch.zeros(16, C, L, R)
    plan = plan_rows(host[5:12], staging[0:7])
    assert plan is not None and plan[0].height == 1
    assert plan[0].width_bytes == 7 * C * L * R * host.element_size()


def test_non_collapsing_leading_dims_have_no_plan() -> None:
    """Layers 0..1 of every component of a layer_first run: rows are not evenly spaced."""
    host = torch.zeros(C, L, S, R)
    staging = torch.zeros(C, 2, 7, R)
    assert plan_rows(host[:, 0:2, 5:12], staging) is None


def test_copy_block_moves_exactly_the_view() -> None:
    """On the CPU the block copy writes the viewed elements and nothing else."""
    host = torch.full((S, C, L, R), -1.0)
    staging = torch.arange(7 * C * R, dtype=torch.float32).view(7, C, 1, R)
    copy_block(host[5:12, :, 2:3], staging)
    assert torch.equal(host[5:12, :, 2:3], staging)
    host[5:12, :, 2:3] = -1.0
    assert (host == -1.0).all()


def test_mismatched_views_are_refused() -> None:
    """Views of different shapes or dtypes, or with a strided last dimension, are refused
    with the reason (``copy_`` would broadcast or convert silently)."""
    with pytest.raises(ValueError, match="one shape and dtype"):
        copy_block(torch.zeros(4, R), torch.zeros(1, R))
    with pytest.raises(ValueError, match="one shape and dtype"):
        plan_rows(torch.zeros(4, R), torch.zeros(4, R, dtype=torch.float16))
    with pytest.raises(ValueError, match="last dimension"):
        copy_block(torch.zeros(4, R), torch.zeros(R, 4).t())


def test_page_first_direct_layer_of_a_page_run_is_one_copy() -> None:
    """One layer of 3 consecutive page_first_direct pages: one row per (page, component) of
    page_size rows, a layer-major page block apart on the host, packed in the staging."""
    page = 4
    host = torch.zeros(S // page, C, L, page, R)
    staging = torch.zeros(3, C, 1, page, R)
    plan = plan_rows(host[2:5, :, 1:2], staging)
    assert plan is not None
    size = host.element_size()
    assert (plan[0].height, plan[0].width_bytes, plan[0].pitch_bytes) == (
        3 * C, page * R * size, L * page * R * size)
    assert plan[1].pitch_bytes == page * R * size
    assert plan[0].ptr == host[2, 0, 1].data_ptr()


def test_page_first_direct_run_of_all_layers_is_contiguous() -> None:
    """All layers of a run of whole pages: one contiguous block on both sides."""
    page = 4
    host = torch.zeros(S // page, C, L, page, R)
    staging = torch.zeros(3, C, L, page, R)
    plan = plan_rows(host[2:5], staging)
    assert plan is not None and plan[0].height == 1
    assert plan[0].width_bytes == 3 * C * L * page * R * host.element_size()


def test_planned_copies_move_another_layer_exactly() -> None:
    """Copies planned for layer 0 of a run, issued with the host offset of layer 2 (CPU
    emulation of the 2D copies), move exactly layer 2's rows, both ways, and nothing else."""
    host = torch.full((C, L, S, R), -1.0)
    staging = torch.arange(100, 100 + C * 16 * R, dtype=torch.float32).view(C, 1, 16, R)
    copies = plan_copies(host[:, 0:1, 5:12], staging[:, :, 3:10], host.data_ptr(),
                         staging.data_ptr())
    layer_bytes = host.stride(1) * host.element_size()
    emulate_copies(copies, as_bytes(host), 2 * layer_bytes, as_bytes(staging), to_host=True)
    assert torch.equal(host[:, 2:3, 5:12], staging[:, :, 3:10])
    host[:, 2:3, 5:12] = -1.0
    assert (host == -1.0).all()
    host[:, 2:3, 5:12] = 5.0
    emulate_copies(copies, as_bytes(host), 2 * layer_bytes, as_bytes(staging), to_host=False)
    assert (staging[:, :, 3:10] == 5.0).all()
    assert (staging[:, :, :3] != 5.0).all() and (staging[:, :, 10:] != 5.0).all()


def test_non_collapsing_views_plan_one_copy_per_part() -> None:
    """Layers 0..1 of a layer_first run (rows not evenly spaced) plan one 2D copy per
    component, which together move the view exactly."""
    host = torch.full((C, L, S, R), -1.0)
    staging = torch.arange(C * 2 * 7 * R, dtype=torch.float32).view(C, 2, 7, R)
    plans = plan_block(host[:, 0:2, 5:12], staging)
    assert [plan[0].height for plan in plans] == [2] * C
    copies = plan_copies(host[:, 0:2, 5:12], staging, host.data_ptr(), staging.data_ptr())
    emulate_copies(copies, as_bytes(host), 0, as_bytes(staging), to_host=True)
    assert torch.equal(host[:, 0:2, 5:12], staging)
    host[:, 0:2, 5:12] = -1.0
    assert (host == -1.0).all()


def test_planner_reuses_the_plan_of_equal_views_only() -> None:
    """Runs of one length (views of equal shapes and strides) share one plan, shifted to
    where each starts; a run of another length gets its own plan."""
    host, staging = torch.zeros(C, L, S, R), torch.zeros(C, L, 16, R)
    planner = CopyPlanner(host.data_ptr(), staging.data_ptr())
    runs = [(host[:, :, 5:9], staging[:, :, 0:4]), (host[:, :, 20:24], staging[:, :, 4:8]),
            (host[:, :, 30:36], staging[:, :, 8:14])]
    for host_view, staged_view in runs:
        assert planner.plan(host_view, staged_view) == plan_copies(
            host_view, staged_view, host.data_ptr(), staging.data_ptr())
    assert len(planner._known) == 2


def test_a_pitch_a_2d_copy_cannot_take_splits_the_block() -> None:
    """A pitch of MAX_PITCH_BYTES still goes as one copy; one byte more, the block goes as
    one copy per row, each at its row's address (meta tensors: no memory behind them)."""
    space = torch.empty(2**20, dtype=torch.uint8, device="meta")
    rows = torch.empty(2, 3, 4, dtype=torch.uint8, device="meta")
    at_limit = space.as_strided((2, 3, 4), (MAX_PITCH_BYTES, 4, 1))
    assert MAX_PITCH_BYTES == 2**31 - 1
    assert plan_block(at_limit, rows) == [(RowPlan(0, MAX_PITCH_BYTES, 12, 2),
                                           RowPlan(0, 12, 12, 2))]
    past = space.as_strided((2, 3, 4), (MAX_PITCH_BYTES + 1, 4, 1))
    assert plan_block(past, rows) == [
        (RowPlan(0, 12, 12, 1), RowPlan(0, 12, 12, 1)),
        (RowPlan(MAX_PITCH_BYTES + 1, 12, 12, 1), RowPlan(12, 12, 12, 1))]


def test_a_block_of_one_element_is_one_row() -> None:
    dst, src = torch.zeros(1, 1, 1), torch.ones(1, 1, 1)
    assert plan_rows(dst, src) == (RowPlan(dst.data_ptr(), 4, 4, 1),
                                   RowPlan(src.data_ptr(), 4, 4, 1))


@pytest.mark.parametrize("view", [
    lambda t: t[5:12, :, 2:3],       # rows a token apart
    lambda t: t[3:4, 1, 0],          # one row
    lambda t: t[2:9, :, 1:3, 2:6],   # parts of rows: no plan, split along dimension 0
    lambda t: t[7, 1, 3, 5],         # one element (a 0-dim view)
], ids=["strided", "one_row", "split", "scalar"])
def test_the_row_by_row_fallback_moves_exactly_the_view(view) -> None:
    """Without a CUDA runtime library the block moves with copy_ part by part: the viewed
    elements change, nothing else does."""
    host = torch.full((S, C, L, R), -1.0)
    target = view(host)
    source = torch.arange(target.numel(), dtype=torch.float32).view(target.shape)
    _copy_rows(target, source)
    assert torch.equal(view(host), source)
    view(host).fill_(-1.0)
    assert (host == -1.0).all()
