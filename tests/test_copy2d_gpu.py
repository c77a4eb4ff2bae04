"""copy_block between pinned host memory and a GPU through the CUDA runtime's 2D copy, both
ways, for strided views on either side: the viewed elements arrive, nothing else moves."""

from __future__ import annotations

import pytest
import torch

from hicache.controller import copy2d

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]

S, C, L, R = 40, 2, 4, 8  # host slots, components, layers, row elements

VIEWS = {
    "rows_a_token_apart": (lambda t: t[5:12, :, 2:3], lambda t: t[20:27, :, 3:4]),
    "one_row": (lambda t: t[3:4, 1, 0], lambda t: t[9:10, 0, 0]),
    "parts_of_rows": (lambda t: t[2:9, :, 1:3, 2:6], lambda t: t[10:17, :, 0:2, 4:8]),
}


@pytest.mark.parametrize("name", list(VIEWS))
def test_copy_block_moves_exactly_the_view_both_ways(name: str) -> None:
    assert copy2d.have_2d_copies(), "no CUDA runtime library found for 2D copies"
    host_view, device_view = VIEWS[name]
    host = torch.full((S, C, L, R), -1.0).pin_memory()
    device = torch.arange(S * C * L * R, dtype=torch.float32, device="cuda").view(S, C, L, R)
    copy2d.copy_block(host_view(host), device_view(device))  # device -> host
    torch.cuda.current_stream().synchronize()
    assert torch.equal(host_view(host), device_view(device).cpu())
    host_view(host).fill_(-1.0)
    assert (host == -1.0).all()
    host.copy_(torch.randn(host.shape))
    before = device.clone()
    copy2d.copy_block(device_view(device), host_view(host))  # host -> device
    torch.cuda.current_stream().synchronize()
    assert torch.equal(device_view(device).cpu(), host_view(host))
    device_view(device).copy_(device_view(before))
    assert torch.equal(device, before)


def test_copy_block_runs_on_the_current_stream() -> None:
    """Issued on a side stream that first waits for a long kernel writing the source:
    the copy sees the kernel's result only because it follows it on that stream."""
    host = torch.zeros(S, C, L, R).pin_memory()
    source = torch.zeros(S, C, L, R, device="cuda")
    side = torch.cuda.Stream()
    with torch.cuda.stream(side):
        torch.cuda._sleep(20_000_000)
        source.fill_(3.0)
        copy2d.copy_block(host[5:12, :, 2:3], source[5:12, :, 2:3])
    side.synchronize()
    assert (host[5:12, :, 2:3] == 3.0).all()
    assert int((host != 0).sum()) == 7 * C * R
