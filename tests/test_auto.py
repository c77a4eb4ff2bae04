"""The auto backend: per-op choice from a measured table, visible in the stats."""

from __future__ import annotations

import json
from importlib import resources
from pathlib import Path

import pytest
import torch
from controller_helpers import make_controller
from test_controller import round_trip

from hicache.controller import Direction, TorchBackend
from hicache.controller.auto import AutoBackend, AutoRow, load_table
from hicache.controller.staged import StagedBackend
from hicache.pools import HostLayout

D2H, H2D = Direction.DEVICE_TO_HOST, Direction.HOST_TO_DEVICE
LF, PF = HostLayout.LAYER_FIRST, HostLayout.PAGE_FIRST
PFD = HostLayout.PAGE_FIRST_DIRECT


def auto(rows: list[AutoRow]) -> AutoBackend:
    return AutoBackend({"torch": TorchBackend(), "staged": StagedBackend(8)}, rows, "torch")


def test_largest_fitting_row_wins() -> None:
    """Among matching rows the one with the largest min_tokens not above the size wins."""
    backend = auto([AutoRow(D2H, LF, False, 0, "torch"), AutoRow(D2H, LF, False, 64, "staged")])
    assert backend.select(D2H, LF, 63, layer_wise=False).name == "torch"
    assert backend.select(D2H, LF, 64, layer_wise=False).name == "staged"


def test_rows_match_direction_layout_and_mode() -> None:
    """A row for another direction, layout or layer mode does not apply."""
    backend = auto([AutoRow(H2D, PF, True, 0, "staged")])
    assert backend.select(H2D, PF, 10, layer_wise=True).name == "staged"
    assert backend.select(D2H, PF, 10, layer_wise=True).name == "torch"
    assert backend.select(H2D, LF, 10, layer_wise=True).name == "torch"
    assert backend.select(H2D, PF, 10, layer_wise=False).name == "torch"


def test_rows_naming_missing_backends_are_ignored() -> None:
    """A table row for a backend this machine lacks (no Triton) falls back."""
    backend = auto([AutoRow(D2H, LF, False, 0, "kernel")])
    assert backend.select(D2H, LF, 10, layer_wise=False).name == "torch"


def test_bad_fallback_raises() -> None:
    """The fallback must be one of the backends."""
    with pytest.raises(ValueError, match="fallback 'kernel'"):
        AutoBackend({"torch": TorchBackend()}, [], "kernel")


def test_load_table_from_file(tmp_path: Path) -> None:
    """A benchmark-written table loads into rows."""
    path = tmp_path / "table.json"
    path.write_text(json.dumps({"rows": [{"direction": "device_to_host", "layout": "page_first",
                                          "layer_wise": False, "min_tokens": 16,
                                          "backend": "staged"}]}))
    assert load_table(path) == [AutoRow(D2H, PF, False, 16, "staged")]


def test_shipped_table_parses() -> None:
    """The table shipped with the package (if any) names known backends."""
    assert all(r.backend in {"torch", "kernel", "staged"} for r in load_table())


def test_shipped_table_sends_large_page_first_direct_ops_to_staged() -> None:
    """page_first_direct rows (measured) exist for writes and layer-wise loads and send
    large ops of both to staged (the layout's intended fast path)."""
    rows = load_table()
    shipped = json.loads(resources.files("hicache.controller").joinpath("auto_table.json")
                         .read_text())
    direct = [r for r in shipped["rows"] if r["layout"] == "page_first_direct"]
    assert direct and not any("unmeasured" in r for r in direct)
    assert {(r["direction"], r["layer_wise"]) for r in direct} == {
        ("device_to_host", False), ("host_to_device", True)}
    found = {"torch": TorchBackend(), "staged": StagedBackend(8), "kernel": TorchBackend()}
    backend = AutoBackend(found, rows, "torch")
    assert backend.select(D2H, PFD, 32768, layer_wise=False) is found["staged"]
    assert backend.select(H2D, PFD, 32768, layer_wise=True) is found["staged"]


def test_controller_runs_the_selected_backend() -> None:
    """Writes and loads run on the backend the table picks; stats carry the label."""
    rows = [AutoRow(D2H, LF, False, 0, "staged"), AutoRow(H2D, LF, True, 0, "torch")]
    ctrl = make_controller(auto(rows), page_size=1)
    device = ctrl.device_allocator.try_alloc(12)
    assert device is not None
    round_trip(ctrl, device)
    assert ctrl.stats.backend_ops == {("device_to_host", "staged"): 1,
                                      ("host_to_device", "torch"): 1}


def test_auto_is_torch_on_cpu() -> None:
    """Without CUDA, auto builds the torch backend directly."""
    from hicache.controller import make_backend

    assert make_backend("auto", torch.device("cpu")).name == "torch"
