"""Two tensor-parallel ranks on one GPU whose write-through copies finish at different
times (``tests/rank_helpers.py``'s ``late_copy``): without an agreement the rank whose copy
finished evicts the node and the other cannot, so one allocation succeeds where the other
is refused and the ranks' trees part ways; with one (``build_service(tp_group=...)``) both
refuse until both copies are acknowledged, then both succeed. The run without agreement is
the check that the scenario does make the ranks disagree.

Then two ranks with shared stores serve random requests on the GPU (copies really
asynchronous, each rank's store losing pages of its own choosing): the same answers."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from gpu_shapes import scaled
from rank_helpers import bounds_trip, late_copy, run_ranks
from rank_store_helpers import store_traffic

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]

# ~1 s (~4 s under the sanitizer): longer than rank 0's synchronisation, two barriers and
# two steps on both ranks
SLEEP_CYCLES = scaled(2_000_000_000, 8_000_000_000)


@pytest.mark.parametrize("agreed", [True, False], ids=["agreed", "alone"])
def test_ranks_whose_copies_finish_apart(tmp_path: Path, agreed: bool) -> None:
    first, second = run_ranks(late_copy, 2, tmp_path, agreed, SLEEP_CYCLES)
    assert second["copy_still_running"], "rank 1's copy finished early: raise SLEEP_CYCLES"
    assert not first["copy_still_running"]
    if agreed:
        assert first["first_refused"] and second["first_refused"]
    else:
        assert not first["first_refused"] and second["first_refused"]
    assert not first["second_refused"] and not second["second_refused"]


@pytest.mark.parametrize(("write_policy", "mla"), [("write_through", False),
                                                   ("write_back", False),
                                                   ("write_back", True)])
def test_ranks_with_stores_on_a_gpu_give_the_same_answers(tmp_path: Path, write_policy: str,
                                                          mla: bool) -> None:
    """``mla``: the ranks share one copy in the store, each writing its share of it."""
    case = {"device": "cuda", "backend": "staged", "write_policy": write_policy, "mla": mla}
    first, second = run_ranks(store_traffic, 2, tmp_path, str(tmp_path / "l3"), case, 5, 120)
    for result in (first, second):
        assert result["diverged"] is None and result["held"] == 0 and result["stored"] > 0
        assert (result["share"] is not None) is mla
    assert first["answers"] == second["answers"]


def test_a_bounds_error_on_one_rank_raises_on_every_rank_at_its_step(tmp_path: Path) -> None:
    """Rank 1's forward wrote past its pool (the device's bounds check tripped): at the next
    step every rank raises ``RanksDivergedError``, rank 1's caused by the ``BoundsError``."""
    first, second = run_ranks(bounds_trip, 2, tmp_path)
    for result in (first, second):
        assert "steps that raised by rank: 0, 1" in result["error"]
    assert first["cause"] is None
    assert second["cause"].startswith("BoundsError: set_kv(layer=0): slot ")
