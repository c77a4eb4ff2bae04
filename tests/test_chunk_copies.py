"""The staged backend's copy templates (hicache.controller.chunk_copies): a run's copies are
planned once per run shape and shifted for every other run of that shape, equal to copies
planned from the run's own views, and the templates kept stay bounded."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from hicache.controller.chunk_copies import MAX_TEMPLATES, CopyTemplates, run_copies
from hicache.controller.copy2d import plan_copies

COMPONENTS, LAYERS, SLOTS, ROW = 2, 3, 64, 8


def layer_first() -> tuple[torch.Tensor, torch.Tensor]:
    """A ``layer_first`` host ``[C, L, slots, row]`` and a staging view ``[C, L, n, row]``."""
    return (torch.zeros(COMPONENTS, LAYERS, SLOTS, ROW),
            torch.zeros(COMPONENTS, LAYERS, 16, ROW))


def token_major() -> tuple[torch.Tensor, torch.Tensor]:
    """A ``page_first`` host ``[slots, C, L, row]`` and a staging view ``[n, C, L, row]``."""
    return (torch.zeros(SLOTS, COMPONENTS, LAYERS, ROW),
            torch.zeros(16, COMPONENTS, LAYERS, ROW))


@pytest.mark.parametrize("make, major", [(layer_first, False), (token_major, True)],
                         ids=["layer_first", "page_first"])
def test_each_run_shape_is_planned_once_and_shifted_exactly(make, major: bool) -> None:
    """Runs (position, length) (0, 3), (3, 5), (8, 3), (11, 3) of layers 0..1 at staged
    block offset 1: two shapes planned; every run's copies equal those planned from its own
    views."""
    host, staged = make()
    host_slots = np.array([40, 41, 42, 7, 8, 9, 10, 11, 20, 21, 22, 50, 51, 52])
    runs = [(0, 3), (3, 5), (8, 3), (11, 3)]
    templates = CopyTemplates()
    copies = run_copies(templates, host, staged, major, runs, host_slots, 1, 2)
    assert templates.planned == 2
    expected = []
    for position, length in runs:
        first = int(host_slots[position])
        if major:
            views = (host[first:first + length, :, :2],
                     staged[position:position + length, :, 1:3])
        else:
            views = (host[:, :2, first:first + length],
                     staged[:, 1:3, position:position + length])
        expected += plan_copies(*views, host.data_ptr(), staged.data_ptr())
    assert copies == expected
    again = run_copies(templates, host, staged, major, runs[::-1], host_slots, 1, 2)
    assert templates.planned == 2 and sorted(again) == sorted(expected)
    run_copies(templates, host, staged, major, runs, host_slots, 0, 2)
    assert templates.planned == 4  # another block offset is another shape


def test_the_templates_kept_are_bounded() -> None:
    """MAX_TEMPLATES shapes are kept; the next one starts the cache afresh."""
    templates = CopyTemplates()
    host, staged = torch.zeros(1, 1, 4, 2), torch.zeros(1, 1, 4, 2)
    for i in range(MAX_TEMPLATES):
        templates.plan(("shape", i), host, staged, host.data_ptr(), staged.data_ptr())
    assert templates.planned == MAX_TEMPLATES
    assert templates.get(("shape", 0)) is not None and templates.get(("shape", MAX_TEMPLATES - 1))
    templates.plan(("shape", MAX_TEMPLATES), host, staged, host.data_ptr(), staged.data_ptr())
    assert templates.get(("shape", 0)) is None
    assert templates.get(("shape", MAX_TEMPLATES)) is not None
    assert len(templates._known) == 1
