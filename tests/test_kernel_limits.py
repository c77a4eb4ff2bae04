"""The row kernel at the edges of its launch plan, on a CPU under the Triton interpreter:
rows one element past a power of two, a launch of fewer work items than components, the
int32 bound on work items, an uncounted launch that must leave its counters argument alone,
the warps a block gets, and a machine without Triton (the kernel backend refused with the
fix named, never a crash at the first transfer)."""

from __future__ import annotations

import sys

import pytest
import torch
from test_kernel import INTERPRETED, needs_kernel, random_pairs, run_case

from hicache.controller import copy_rows_kernel, row_copy
from hicache.controller.backends import make_backend
from hicache.controller.kernel import transfer_rows
from hicache.controller.row_copy import RowCopy
from hicache.pools import HostLayout

CPU = torch.device("cpu")


@needs_kernel
@pytest.mark.parametrize("to_host", [True, False], ids=["d2h", "h2d"])
@pytest.mark.parametrize("row", [5, 17, 129])
def test_rows_one_past_a_power_of_two_are_copied_whole(row: int, to_host: bool) -> None:
    """A row of 2**k + 1 elements gets a block of 2**(k + 1): every element moves, the
    last one included (a block one power too small would drop it)."""
    host, device = random_pairs(9, seed=row)
    for layout in HostLayout:
        run_case(layout=layout, to_host=to_host, host_indices=host, device_indices=device,
                 row=row)


@needs_kernel
@pytest.mark.parametrize("to_host", [True, False], ids=["d2h", "h2d"])
def test_one_pair_of_one_layer_of_two_components(to_host: bool) -> None:
    """One tile of one layer of K and V: two work items, both run (the grid is sized by the
    items, components included)."""
    host, device = random_pairs(1, seed=4)
    run_case(kind="mha", to_host=to_host, host_indices=host, device_indices=device,
             layers=3, layer_range=(2, 3))


def test_work_items_past_the_int32_loop_bound_are_refused() -> None:
    """2**31 work items (2**20 one-pair tiles x 1024 layers x K and V) overflow the kernel's
    int32 loop: refused with the way out named, before any launch. An empty layer range of
    the same copy is no error: it launches nothing."""
    pairs = torch.arange(1, 2**20 + 1, dtype=torch.int32)
    device = torch.zeros(2, 1024, 2, 1)
    host = torch.zeros(2, 1024, 2, 1)
    copy = RowCopy(device_data=device, host_data=host, host_layout=HostLayout.LAYER_FIRST,
                   host_indices=pairs, device_indices=pairs, to_host=True, tokens_per_tile=1)
    with pytest.raises(ValueError, match=r"2147483648 work items exceed the int32 loop bound; "
                                         r"split the transfer or raise tokens_per_tile"):
        copy.launch(0, 1024)
    copy.launch(5, 5)  # an empty range launches nothing


@needs_kernel
def test_an_uncounted_launch_never_writes_its_stand_in_counters() -> None:
    """An uncounted launch passes a one-element stand-in as the counters argument (so both
    launches specialise alike); the kernel must not add to it (a count per layer there
    would write past its one element)."""
    stand_in = row_copy._no_counters(CPU)
    host, device = random_pairs(9, seed=8)
    run_case(host_indices=host, device_indices=device, layers=4)
    run_case(host_indices=host, device_indices=device, layers=4, to_host=False)
    assert stand_in.tolist() == [0]


@pytest.mark.parametrize(("block_bytes", "warps"), [
    (1, 1), (2048, 1), (4096, 1), (8192, 2), (12288, 4), (16384, 4), (65536, 16),
    (2 << 20, 16)])
def test_a_block_gets_a_warp_per_4_kib_rounded_up_to_a_power_of_two(block_bytes: int,
                                                                    warps: int) -> None:
    """About 128 bytes per thread (4 KiB a warp), 1 to 16 warps, a power of two: a
    launch never asks for more threads than the 16 warps the kernel is tuned for."""
    assert row_copy._num_warps(block_bytes) == warps


@pytest.fixture
def no_triton(monkeypatch: pytest.MonkeyPatch):  # type: ignore[no-untyped-def]
    """Triton cannot be imported (as on a machine where it is not installed); the kernel's
    cached compilation is dropped before and after."""
    for name in [name for name in sys.modules if name == "triton" or name.startswith("triton.")]:
        monkeypatch.delitem(sys.modules, name)
    monkeypatch.setitem(sys.modules, "triton", None)  # import triton raises ImportError
    copy_rows_kernel.compiled_kernel.cache_clear()
    yield
    copy_rows_kernel.compiled_kernel.cache_clear()


def test_without_triton_the_kernel_is_unavailable_and_named(no_triton: None) -> None:
    """No Triton: the kernel reads as unavailable, a kernel backend is refused at
    configuration with the fix named, and a direct launch raises the install hint."""
    assert not copy_rows_kernel.kernel_available()
    with pytest.raises(ValueError, match=r"io_backend 'kernel' needs Triton.*install triton "
                                         r"or choose io_backend: torch"):
        make_backend("kernel", CPU) if INTERPRETED else _kernel_check_only()
    pairs = torch.tensor([1, 2])
    with pytest.raises(RuntimeError, match=r"transfer_rows needs Triton \(pip install "
                                           r"'hicache\[kernel\]'\); use the torch backend"):
        transfer_rows(device_data=torch.zeros(2, 2, 4, 8), host_data=torch.zeros(2, 2, 4, 8),
                      host_layout=HostLayout.LAYER_FIRST, host_indices=pairs,
                      device_indices=pairs, layer_begin=0, layer_end=2, to_host=True)
    assert sys.modules["triton"] is None  # nothing imported it behind the test's back


def _kernel_check_only() -> None:
    """Without the interpreter a CPU device is refused first; ask about Triton directly."""
    from hicache.controller.backends import KernelBackend

    with pytest.MonkeyPatch.context() as patch:
        patch.setenv(copy_rows_kernel.INTERPRET_ENV, "1")
        KernelBackend(16).check_device(CPU)
