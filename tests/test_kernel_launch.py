"""The row kernel's fast launch off the GPU path: where Triton's internals are not there
(another Triton version, or a stand-in kernel), every launch goes through the entry point
with the arguments it always had, and the fast path turns itself off instead of failing."""

from __future__ import annotations

from typing import Any

from hicache.controller.kernel_launch import FastLaunch


class EntryPointOnly:
    """A kernel object with an entry point (``kernel[grid](*args, **meta)``) and none of the
    internals the fast path reads; it records what each launch received."""

    def __init__(self) -> None:
        self.calls: list[tuple[tuple[int, ...], tuple[object, ...], dict[str, Any]]] = []

    def __getitem__(self, grid: tuple[int, ...]) -> Any:
        def launch(*args: object, **meta: Any) -> None:
            self.calls.append((grid, args, meta))
        return launch


def test_without_triton_internals_every_launch_goes_through_the_entry_point() -> None:
    kernel = EntryPointOnly()
    fast = FastLaunch(kernel)
    meta = {"ROW": 8, "BLOCK_ROW": 8, "TILE": 8, "num_warps": 1}
    for begin in range(3):
        fixed = fast.fixed_key(0, ("a", 5), (8, 8, 8, 1))
        fast.launch(fixed, (4, 1, 1), ("a",), begin, 1, (5,), (8, 8, 8), meta)
    assert not fast.enabled
    assert fast.fast_launches == 0 and fast.entry_launches == 3
    assert [call[1] for call in kernel.calls] == [("a", b, 1, 5) for b in range(3)]
    assert all(call[0] == (4, 1, 1) and call[2] == meta for call in kernel.calls)
