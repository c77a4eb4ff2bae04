"""The index tensors an op moves (hicache.controller.index_moves), on the CPU: copies of a
call's slots made from page bounds only where the pages are one ascending run, pairs that
touch the padding slot dropped, and the op's own tensors never shared with the caller."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from controller_helpers import make_controller

from hicache.controller import TorchBackend
from hicache.controller.index_moves import move_checked, owned_pages_copy
from hicache.pools import IndexSpace, Indices

PAGE = 2


def slots_of(pages: list[int]) -> Indices:
    ids = torch.tensor(pages, dtype=torch.int64)[:, None] * PAGE + torch.arange(PAGE)
    return Indices(ids.reshape(-1), IndexSpace.DEVICE_FULL)


@pytest.mark.parametrize("pages", [[3, 4, 5], [7], [1, 3, 2, 4], [4, 3, 2], [2, 9, 5],
                                   [2, 5, 9], [1, 2, 4], [1, 2, 5]],
                         ids=["run", "one", "span_unordered", "descending", "scattered",
                              "ascending_gaps", "run_then_gap", "run_then_wider_gap"])
@pytest.mark.parametrize("ascending", [None, "known"])
def test_a_copy_keeps_the_slots_order_and_owns_its_memory(pages: list[int],
                                                          ascending: str | None) -> None:
    """Whatever path makes it (bounds of an ascending run, or the slots read), the copy is
    the call's slots in their order, int64, in memory of its own."""
    given = slots_of(pages)
    known = None if ascending is None else pages == sorted(pages)
    copy = owned_pages_copy(given, np.array(pages, dtype=np.int64), PAGE, known)
    assert copy.tensor.tolist() == given.tensor.tolist()
    assert copy.tensor.dtype is torch.int64 and copy.space is IndexSpace.DEVICE_FULL
    given.tensor.fill_(0)
    assert copy.tensor.tolist() != given.tensor.tolist()


def pools():
    ctrl = make_controller(TorchBackend(), page_size=PAGE)
    return ctrl.host_pool, ctrl.device_pool


@pytest.mark.parametrize("owned", [False, True])
@pytest.mark.parametrize("host, device, kept", [
    ([4, 0, 6, 7, 0], [10, 11, 0, 13, 0], [0, 3]),
    ([4, 0, 6], [10, 11, 12], [0, 2]),
    ([4, 5, 6], [0, 11, 12], [1, 2]),
], ids=["both_sides", "host_side", "device_side"])
def test_pairs_touching_the_padding_slot_are_dropped(owned: bool, host: list[int],
                                                     device: list[int], kept: list[int]
                                                     ) -> None:
    """A pair whose host or device slot is 0 is not moved; the rest keep their order."""
    host_t, device_t = torch.tensor(host), torch.tensor(device)
    moved_host, moved_device = move_checked(host_t, device_t, *pools(), TorchBackend(),
                                            owned=owned)
    assert moved_host.tolist() == [host[i] for i in kept]
    assert moved_device.tolist() == [device[i] for i in kept]
    assert host_t.tolist() == host and device_t.tolist() == device  # not changed


def test_the_op_owns_what_it_moves() -> None:
    """Without padding: the caller's int32 tensors are copied to int64 (not owned); the op's
    own int64 tensors move as they are (owned), also when the caller's checks found no
    padding slot to look for (``may_pad=False``)."""
    for may_pad in (True, False):
        host = torch.tensor([4, 5, 6], dtype=torch.int32)
        device = torch.tensor([10, 11, 12], dtype=torch.int32)
        moved_host, moved_device = move_checked(host, device, *pools(), TorchBackend(),
                                                may_pad=may_pad)
        assert moved_host.dtype is torch.int64 and moved_device.dtype is torch.int64
        host.fill_(1)
        device.fill_(1)
        assert moved_host.tolist() == [4, 5, 6] and moved_device.tolist() == [10, 11, 12]
    own_host, own_device = torch.tensor([4, 5]), torch.tensor([10, 11])
    for may_pad in (True, False):
        found = move_checked(own_host, own_device, *pools(), TorchBackend(), owned=True,
                             may_pad=may_pad)
        assert found[0] is own_host and found[1] is own_device
