"""Audit of the hybrid controller's inputs that were accepted and then damaged state.

- ``write(swa_skip=...)`` that skipped part of two SWA pages, its rows left adding up to a
  whole page: one host SWA page then held halves of two device pages, and a host copy
  could no longer be freed or loaded page by page.
- ``evict_host(full, swa)`` with more SWA slots than full ones freed the SWA copies of
  tokens whose full host copy stayed; a later load of them was refused as never written.
"""

from __future__ import annotations

import pytest
import torch
from controller_helpers import make_hybrid

from hicache.controller import TorchBackend
from hicache.pools import IndexSpace, Indices


def used_host(ctrl: object) -> tuple[int, int]:
    return (ctrl.host_pool.allocator.num_used_tokens,  # type: ignore[attr-defined]
            ctrl.host_swa.allocator.num_used_tokens)  # type: ignore[attr-defined]


@pytest.mark.parametrize("skip", [[True, False, False, True], [False, True, True, True],
                                  [True, False, True, True]])
def test_a_swa_skip_that_splits_a_page_is_refused_before_anything_is_allocated(
        skip: list[bool]) -> None:
    ctrl = make_hybrid(TorchBackend())  # pages of 2 tokens
    full = ctrl.hybrid_pool.try_alloc(4)  # two full pages, both with SWA pages
    assert full is not None
    used = used_host(ctrl)
    with pytest.raises(ValueError, match=r"skips part of the SWA page of tokens \d\.\.\d; "
                                         r"skip whole SWA pages"):
        ctrl.write(full, swa_skip=torch.tensor(skip))
    assert used_host(ctrl) == used and ctrl.num_in_flight == 0


def test_a_skip_of_whole_pages_is_taken_and_each_page_frees_alone() -> None:
    ctrl = make_hybrid(TorchBackend())
    full = ctrl.hybrid_pool.try_alloc(4)
    assert full is not None
    host = ctrl.write(full, swa_skip=torch.tensor([True, True, False, False]))
    assert host is not None
    ctrl.drain()
    assert host.swa.tensor[:2].eq(0).all() and host.swa.tensor[2:].ne(0).all()
    used = used_host(ctrl)
    ctrl.evict_host(Indices(host.full.tensor[2:], IndexSpace.HOST_FULL),
                    Indices(host.swa.tensor[2:], IndexSpace.HOST_SWA))
    assert used_host(ctrl) == (used[0] - 2, used[1] - 2)


def test_evict_host_refuses_swa_slots_not_aligned_with_the_full_ones() -> None:
    ctrl = make_hybrid(TorchBackend())
    full = ctrl.hybrid_pool.try_alloc(4)
    assert full is not None
    host = ctrl.write(full)
    assert host is not None
    ctrl.drain()
    used = used_host(ctrl)
    with pytest.raises(ValueError, match="4 HOST_SWA slots for 2 full ones; pass them aligned"):
        ctrl.evict_host(Indices(host.full.tensor[:2], IndexSpace.HOST_FULL), host.swa)
    assert used_host(ctrl) == used
    back = ctrl.load(Indices(host.full.tensor[2:], IndexSpace.HOST_FULL),
                     Indices(host.swa.tensor[2:], IndexSpace.HOST_SWA), 2)
    assert back is not None  # the second page's host copy still loads with its window
