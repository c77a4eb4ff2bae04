"""Index spaces: check_indices refuses the wrong space, dtype, shape and device (CPU)."""

from __future__ import annotations

import pytest
import torch

from hicache.pools import (
    DEBUG_CHECKS_ENV,
    BoundsError,
    IndexSpace,
    Indices,
    PageTable,
    check_indices,
    debug_checks_enabled,
)
from hicache.pools.base import bounds_message, check_page_multiple

NUM_SLOTS = 16
CPU = torch.device("cpu")


def _check(
    indices: object,
    space: IndexSpace = IndexSpace.DEVICE_FULL,
    device: torch.device | None = CPU,
) -> torch.Tensor:
    """check_indices for a 16-slot pool named 'full' on the CPU, op 'read'."""
    return check_indices(
        indices, space=space, pool_name="full", num_slots=NUM_SLOTS, device=device, op="read"
    )


def _full(values: list[int], dtype: torch.dtype = torch.int64) -> Indices:
    """DEVICE_FULL indices of ``values``."""
    return Indices(torch.tensor(values, dtype=dtype), IndexSpace.DEVICE_FULL)


@pytest.fixture
def debug_on(monkeypatch: pytest.MonkeyPatch) -> None:
    """HICACHE_DEBUG_CHECKS=1 for one test."""
    monkeypatch.setenv(DEBUG_CHECKS_ENV, "1")


@pytest.fixture
def debug_off(monkeypatch: pytest.MonkeyPatch) -> None:
    """HICACHE_DEBUG_CHECKS unset for one test."""
    monkeypatch.delenv(DEBUG_CHECKS_ENV, raising=False)


# ---- always-on checks ----------------------------------------------------------------------


@pytest.mark.parametrize("dtype", [torch.int32, torch.int64])
def test_valid_indices_return_the_same_tensor(dtype: torch.dtype) -> None:
    """Well-formed int32 and int64 indices pass and the raw tensor comes back unchanged."""
    indices = _full([1, 15, 0], dtype)
    assert _check(indices) is indices.tensor


def test_wrong_space_names_expected_and_got() -> None:
    """DEVICE_SWA indices for a DEVICE_FULL pool name both spaces, the op and the pool."""
    swa = Indices(torch.tensor([1, 2]), IndexSpace.DEVICE_SWA)
    with pytest.raises(ValueError, match=r"^read: pool 'full' takes indices in space "
                                         r"DEVICE_FULL, got DEVICE_SWA$"):
        _check(swa)


def test_full_indices_for_swa_pool_hint_at_translation() -> None:
    """DEVICE_FULL indices where DEVICE_SWA is expected point at translate_full_to_swa."""
    with pytest.raises(ValueError, match=r"takes indices in space DEVICE_SWA, got DEVICE_FULL; "
                                         r"translate full slots with "
                                         r"HybridSWAPool\.translate_full_to_swa first"):
        _check(_full([1, 2]), space=IndexSpace.DEVICE_SWA)


def test_host_indices_for_device_pool_raise() -> None:
    """HOST_FULL indices are refused by a DEVICE_FULL pool, without the SWA hint."""
    host = Indices(torch.tensor([1, 2]), IndexSpace.HOST_FULL)
    with pytest.raises(ValueError, match=r"space DEVICE_FULL, got HOST_FULL$"):
        _check(host)


@pytest.mark.parametrize("dtype", [torch.float32, torch.int16])
def test_wrong_dtype_raises(dtype: torch.dtype) -> None:
    """Float and int16 indices are refused, naming the accepted dtypes and the one given."""
    indices = Indices(torch.tensor([1, 2], dtype=dtype), IndexSpace.DEVICE_FULL)
    with pytest.raises(ValueError, match=rf"indices for pool 'full' must be int32 or int64, "
                                         rf"got {dtype}"):
        _check(indices)


def test_two_dimensional_indices_raise() -> None:
    """A 2-D index tensor is refused, naming its shape."""
    indices = Indices(torch.zeros(2, 3, dtype=torch.int64), IndexSpace.DEVICE_FULL)
    with pytest.raises(ValueError, match=r"pool 'full' must be 1-D, got shape \(2, 3\)"):
        _check(indices)


def test_wrong_device_raises() -> None:
    """Indices on another device ('meta' stands in for a GPU) name both devices and the fix."""
    indices = Indices(torch.empty(3, dtype=torch.int64, device="meta"), IndexSpace.DEVICE_FULL)
    with pytest.raises(ValueError, match=r"pool 'full' must be on cpu, got meta; move them "
                                         r"with Indices\.to\('cpu'\)"):
        _check(indices)


def test_device_none_skips_the_device_check() -> None:
    """device=None accepts CPU indices wherever the pool lives."""
    indices = _full([1, 2])
    assert _check(indices, device=None) is indices.tensor


def test_non_cpu_indices_need_a_guard() -> None:
    """Indices off the CPU without the pool's bounds guard are refused (they cannot be
    checked without a synchronisation)."""
    indices = Indices(torch.empty(3, dtype=torch.int64, device="meta"), IndexSpace.DEVICE_FULL)
    with pytest.raises(TypeError, match=r"read: indices on meta need the pool's bounds guard"):
        _check(indices, device=None)


def test_bare_tensor_raises_type_error() -> None:
    """A bare tensor has no space and is refused with TypeError naming the expected space."""
    with pytest.raises(TypeError, match=r"read: expected hicache\.pools\.Indices in space "
                                        r"DEVICE_FULL for pool 'full', got Tensor"):
        _check(torch.tensor([1, 2]))


def test_indices_refuse_a_non_tensor() -> None:
    """Indices must wrap a tensor."""
    with pytest.raises(TypeError, match=r"Indices\.tensor must be a torch\.Tensor, got list"):
        Indices([1, 2], IndexSpace.DEVICE_FULL)  # type: ignore[arg-type]


def test_indices_refuse_a_non_space() -> None:
    """Indices must carry an IndexSpace, not a string."""
    with pytest.raises(TypeError, match=r"Indices\.space must be an IndexSpace, got str"):
        Indices(torch.tensor([1]), "device_full")  # type: ignore[arg-type]


def test_indices_to_keeps_the_space() -> None:
    """Indices.to changes dtype and keeps the values and the space."""
    moved = _full([3, 4]).to("cpu", torch.int32)
    assert moved.tensor.dtype == torch.int32
    assert moved.tensor.tolist() == [3, 4]
    assert moved.space is IndexSpace.DEVICE_FULL
    assert len(moved) == 2


def test_host_spaces_are_host() -> None:
    """Only the HOST_* spaces report is_host."""
    assert [s.is_host for s in IndexSpace] == [False, False, True, True]


# ---- bounds checks, always on -------------------------------------------------------------


def test_debug_flag_reads_the_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    """debug_checks_enabled is true only for HICACHE_DEBUG_CHECKS=1."""
    monkeypatch.delenv(DEBUG_CHECKS_ENV, raising=False)
    assert not debug_checks_enabled()
    monkeypatch.setenv(DEBUG_CHECKS_ENV, "0")
    assert not debug_checks_enabled()
    monkeypatch.setenv(DEBUG_CHECKS_ENV, "1")
    assert debug_checks_enabled()


@pytest.mark.usefixtures("debug_off")
def test_out_of_range_index_raises_without_debug_flag() -> None:
    """A slot past the pool names the op, the pool, the value and the bound, flag unset."""
    with pytest.raises(BoundsError, match=r"^read: slot 16 is out of range for pool 'full' "
                                          r"\(valid slots are 0\.\.15\); pass only slots "
                                          r"this pool handed out$"):
        _check(_full([3, 16, 2]))


@pytest.mark.usefixtures("debug_off")
@pytest.mark.parametrize("value", [-1, -NUM_SLOTS, -NUM_SLOTS - 1])
def test_negative_index_raises_without_debug_flag(value: int) -> None:
    """Negative slots (-1 would alias the last slot, -num_slots the first) are refused."""
    with pytest.raises(BoundsError, match=rf"^read: slot {value} is negative for pool 'full'"):
        _check(_full([3, value]))


@pytest.mark.usefixtures("debug_off")
def test_bounds_error_is_a_value_error() -> None:
    """BoundsError is a ValueError, so callers catching ValueError keep working."""
    with pytest.raises(ValueError, match="out of range"):
        _check(_full([NUM_SLOTS], torch.int32))


@pytest.mark.usefixtures("debug_on")
def test_checks_accept_the_last_slot_and_empty_input() -> None:
    """Slot num_slots - 1 and an empty tensor pass the bounds check."""
    assert _check(_full([0, 15])).tolist() == [0, 15]
    assert _check(_full([])).numel() == 0


def test_indices_refuse_a_non_tensor_and_a_non_space() -> None:
    """Indices is built by hand (not the generated frozen __init__): it still refuses what
    is no tensor and what is no IndexSpace, and stays frozen."""
    with pytest.raises(TypeError, match=r"Indices.tensor must be a torch.Tensor, got list"):
        Indices([1, 2], IndexSpace.DEVICE_FULL)  # type: ignore[arg-type]
    with pytest.raises(TypeError, match=r"Indices.space must be an IndexSpace, got str"):
        Indices(torch.tensor([1]), "DEVICE_FULL")  # type: ignore[arg-type]
    made = Indices(tensor=torch.tensor([3]), space=IndexSpace.HOST_FULL)
    assert made == Indices(made.tensor, IndexSpace.HOST_FULL)
    with pytest.raises(AttributeError):
        made.space = IndexSpace.DEVICE_FULL  # type: ignore[misc]


def test_host_indices_for_an_swa_pool_get_no_translation_hint() -> None:
    """Only full slots given to an SWA pool point at the translation; host slots do not."""
    host = Indices(torch.tensor([1, 2]), IndexSpace.HOST_SWA)
    with pytest.raises(ValueError, match=r"space DEVICE_SWA, got HOST_SWA$"):
        _check(host, space=IndexSpace.DEVICE_SWA)


def test_a_bounds_message_calls_only_values_below_zero_negative() -> None:
    assert "slot 0 is out of range for pool 'p' (valid slots are 0..-1)" in \
        bounds_message("read", "p", "slot", 0, 0)
    assert "slot -1 is negative" in bounds_message("read", "p", "slot", -1, 8)
    assert "page 8 is out of range for pool 'p' (valid pages are 0..7)" in \
        bounds_message("read", "p", "page", 8, 8)


@pytest.mark.parametrize("num_tokens, ok", [(0, True), (4, True), (8, True), (-4, False),
                                            (5, False), (1, False), (-1, False)])
def test_page_multiples_are_whole_pages_of_zero_or_more(num_tokens: int, ok: bool) -> None:
    if ok:
        check_page_multiple(num_tokens, 4, "alloc")
        return
    message = (f"num_tokens must be >= 0, got {num_tokens}" if num_tokens < 0 else
               f"{num_tokens} tokens is not a whole number of pages of 4 tokens")
    with pytest.raises(ValueError, match=rf"^alloc: {message}"):
        check_page_multiple(num_tokens, 4, "alloc")


def test_a_page_table_takes_pages_of_one_token_or_more() -> None:
    table = torch.zeros(2, 3, dtype=torch.int32)
    assert PageTable(table, IndexSpace.DEVICE_FULL, 1).page_size == 1
    for bad in (0, -2, True, 2.0):
        with pytest.raises(ValueError, match=r"PageTable.page_size must be an int >= 1"):
            PageTable(table, IndexSpace.DEVICE_FULL, bad)  # type: ignore[arg-type]
