"""Layer groups of layer-wise loads: the planner, and grouped loads through the controller
(bit-exact rows, every layer's event recorded after its group's copy, hybrid pools)."""

from __future__ import annotations

import os
from collections.abc import Sequence

import pytest
import torch
from controller_helpers import (
    SENTINEL,
    back_up_and_evict,
    device_rows,
    host_rows,
    make_controller,
    make_hybrid,
    untouched,
    written_and_wiped,
)

from hicache.controller import (
    Direction,
    Event,
    KernelBackend,
    MovedTransfer,
    TorchBackend,
    TransferBackend,
    load_groups,
)
from hicache.controller.direct import DirectBackend
from hicache.controller.kernel import INTERPRET_ENV, kernel_available
from hicache.controller.load_groups import GROUP_BYTES, local_groups, plan_load_groups
from hicache.controller.staged import StagedBackend
from hicache.pools import HostLayout

MIB = 2**20
NUM_LAYERS = 32
SMALL_LOAD = [range(0, 1), range(1, 2), range(2, 4), range(4, 8), range(8, 16),
              range(16, 24), range(24, 32)]  # the plan before copy costs were modelled
LINK_BOUND_LOAD = [range(0, 1), range(1, 4), range(4, 10), range(10, 22), range(22, 32)]
HYBRID_SWA_LAYERS = (1, 3, 4, 5, 6, 10, 13)


def backends() -> list[TransferBackend]:
    """Every backend that serves CPU pools here; staged with chunks smaller than a group."""
    found: list[TransferBackend] = [TorchBackend(), StagedBackend(staging_tokens=1),
                                    DirectBackend()]
    if kernel_available() and os.environ.get(INTERPRET_ENV) == "1":
        found.append(KernelBackend(num_programs=4))
    return found


class SpyBackend(TorchBackend):
    """Torch backend that logs each call's local layers into a shared log."""

    def __init__(self, log: list[tuple[str, int]]) -> None:
        self.log = log

    def copy(self, moved: MovedTransfer, local_layers: Sequence[int], direction: Direction,
             keep_alive: list[torch.Tensor]) -> None:
        if direction is Direction.HOST_TO_DEVICE:
            self.log.extend(("copy", layer) for layer in local_layers)
            self.log.append(("call", len(local_layers)))
        super().copy(moved, local_layers, direction, keep_alive)


# ---- the planner -------------------------------------------------------------------------

def modelled_ready(groups: Sequence[range], layer_bytes: int, copy_s: float) -> list[float]:
    """Per layer, when the planner's model has it in place: copies issued one after the
    other, each moved once issued and the one before it is done."""
    link = layer_bytes / load_groups.LINK_BYTES_PER_S
    ready: list[float] = []
    issued = done = 0.0
    for group in groups:
        issued += copy_s
        done = max(issued, done) + len(group) * link
        ready.extend(done for _ in group)
    return ready


@pytest.mark.parametrize("num_layers", [1, 2, 3, 5, 8, 31, 32, 61, 80, 128])
@pytest.mark.parametrize("layer_mib", [0, 0.01, 1, 3, 8, 9, 128])
@pytest.mark.parametrize("copy_us", [0, 10, 25, 70, 300])
def test_groups_cover_every_layer_once_and_keep_each_ready_in_time(
        num_layers: int, layer_mib: float, copy_us: int) -> None:
    """Layer 0 alone first, then consecutive groups within the byte bound (one layer may
    exceed it on its own, every group may hold the copy-count bound's layers, a last group
    may take a tail that moves in less than one copy's issue); every layer ready, in the
    model, at most LATENESS times as late as per-layer copies make it (plus one copy's
    issue, for the merged tail); about MAX_COPIES copies at most."""
    layer_bytes, copy_s = int(layer_mib * MIB), copy_us * 1e-6
    groups = plan_load_groups(num_layers, layer_bytes, copy_s=copy_s)
    assert groups[0] == range(0, 1)
    assert [layer for group in groups for layer in group] == list(range(num_layers))
    for_copies = load_groups.copy_bound_layers(num_layers)
    link = layer_bytes / load_groups.LINK_BYTES_PER_S
    for group in groups[1:-1]:
        assert len(group) <= for_copies or len(group) * layer_bytes <= GROUP_BYTES
    if len(groups) > 1:
        last = groups[-1]
        over = len(last) - max(for_copies, GROUP_BYTES // max(1, layer_bytes))
        assert over <= 0 or over * link < copy_s
    if len(groups) > 2:  # a tail shorter on the link than one copy's issue was merged
        assert len(groups[-1]) * link * 1.05 >= copy_s
    ready = modelled_ready(groups, layer_bytes, copy_s)
    for layer in range(num_layers):
        alone = load_groups.per_layer_ready(layer, link, copy_s)
        assert ready[layer] <= load_groups.LATENESS * alone + copy_s + 1e-12, layer
    for group in groups[1:-1]:  # only a group of one layer, or the merged tail, may be late
        alone = load_groups.per_layer_ready(group.start, link, copy_s)
        assert len(group) == 1 or ready[group.start] <= load_groups.LATENESS * alone * 1.05
    ramp = (max(1, for_copies) - 1).bit_length() + 1  # copies before groups reach the bound
    assert len(groups) <= load_groups.MAX_COPIES + ramp


def test_small_staged_load_of_32_layers_is_four_copies() -> None:
    """256 tokens of 32 layers (1 MiB a layer, 21 us on the link) with staged chunks of
    70 us: the CPU is the slower, so groups grow as it falls behind: 1, 8, 16, 7 layers
    (the old ramp took 7 copies), and the last layer is ready sooner than with 7 or 32."""
    groups = plan_load_groups(NUM_LAYERS, MIB, copy_s=70e-6)
    assert [len(g) for g in groups] == [1, 8, 16, 7]
    last = modelled_ready(groups, MIB, 70e-6)[-1]
    assert last < modelled_ready(SMALL_LOAD, MIB, 70e-6)[-1]
    assert last < modelled_ready([range(i, i + 1) for i in range(NUM_LAYERS)], MIB, 70e-6)[-1]


def test_groups_grow_as_the_cpu_falls_behind() -> None:
    """The costlier a copy against its layers' transfer, the fewer copies a small load."""
    counts = [len(plan_load_groups(NUM_LAYERS, MIB, copy_s=us * 1e-6))
              for us in (0, 10, 25, 70, 300)]
    assert counts == sorted(counts, reverse=True)
    assert counts[0] > counts[-1]


def test_groups_stop_growing_at_the_byte_bound() -> None:
    """4 MiB layers (80 us on the link, longer than a copy's issue): groups grow to 4 layers
    (16 MiB) and stay there."""
    sizes = [len(g) for g in plan_load_groups(NUM_LAYERS, 4 * MIB, copy_s=25e-6)]
    assert sizes == [1, 3] + [4] * 7


def test_big_layers_load_in_groups_of_the_copy_bound() -> None:
    """Layers of more than half the byte bound: groups of the copy-count bound's size
    (3 layers of 32) after layer 0, 12 copies instead of 32."""
    for layer_bytes in (GROUP_BYTES // 2 + 1, GROUP_BYTES, 128 * MIB):
        assert [len(g) for g in plan_load_groups(NUM_LAYERS, layer_bytes)] == [
            1] + [3] * 10 + [1]


def test_a_link_bound_load_ramps_up() -> None:
    """Copies that cost no CPU: each group about as large as the layers before it allow
    (a layer at most twice as late as alone), up to the byte bound."""
    sizes = [len(g) for g in plan_load_groups(NUM_LAYERS, MIB, copy_s=0)]
    assert sizes == [1, 3, 6, 12, 10]


def test_without_the_copy_bound_big_layers_load_layer_by_layer(
        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(load_groups, "MAX_COPIES", NUM_LAYERS)
    assert list(plan_load_groups(NUM_LAYERS, 128 * MIB)) == [
        range(i, i + 1) for i in range(NUM_LAYERS)]


def test_cheap_copies_load_big_layers_one_by_one_and_small_ones_grouped() -> None:
    """Without the copy-count bound (a backend of cheap copies), big layers are one group
    each; small ones are grouped by the lateness and byte rules as before."""
    assert list(plan_load_groups(NUM_LAYERS, GROUP_BYTES // 2 + 1, cheap_copies=True,
                                 copy_s=10e-6)) == [range(i, i + 1) for i in range(NUM_LAYERS)]
    assert ([len(g) for g in plan_load_groups(NUM_LAYERS, MIB, cheap_copies=True,
                                              copy_s=10e-6)] == [1, 3, 6, 12, 10])


class DirectSpy(DirectBackend):
    """The direct backend, logging each load call's local layers."""

    def __init__(self, log: list[int]) -> None:
        super().__init__()
        self.log = log

    def copy(self, moved: MovedTransfer, local_layers: Sequence[int], direction: Direction,
             keep_alive: list[torch.Tensor]) -> None:
        if direction is Direction.HOST_TO_DEVICE:
            self.log.append(len(local_layers))
        super().copy(moved, local_layers, direction, keep_alive)


def test_direct_loads_big_layers_one_copy_each(monkeypatch: pytest.MonkeyPatch) -> None:
    """Through the controller: with layers above half the byte bound, the direct backend
    copies every layer on its own (no copy-count bound), and the rows arrive exactly."""
    monkeypatch.setattr(load_groups, "GROUP_BYTES", 2)  # every layer counts as big
    monkeypatch.setattr(load_groups, "LINK_BYTES_PER_S", 1.0)  # and slow to move
    log: list[int] = []
    ctrl = make_controller(DirectSpy(log), num_layers=NUM_LAYERS)
    host, rows = written_and_wiped(ctrl, 4)
    loaded = ctrl.load(host)
    assert loaded is not None
    ctrl.drain()
    assert log == [1] * NUM_LAYERS
    assert torch.equal(device_rows(ctrl.device_pool)[loaded.tensor], rows)


def test_one_and_two_layer_models() -> None:
    """One layer: one group; two layers: one group each, whatever the bytes."""
    for layer_bytes in (0, 1, 64 * MIB):
        assert plan_load_groups(1, layer_bytes) == (range(0, 1),)
        assert plan_load_groups(2, layer_bytes) == (range(0, 1), range(1, 2))


def test_planner_rejects_bad_arguments() -> None:
    with pytest.raises(ValueError, match="num_layers must be >= 1, got 0"):
        plan_load_groups(0, MIB)
    with pytest.raises(ValueError, match="layer_bytes must be >= 0, got -1"):
        plan_load_groups(4, -1)
    with pytest.raises(ValueError, match="copy_s must be >= 0, got -1"):
        plan_load_groups(4, MIB, copy_s=-1)


def test_local_groups_of_a_pool_holding_some_layers() -> None:
    """A pool of model layers 0, 2, 5 and 9: local ids per group, empty where it holds none."""
    groups = plan_load_groups(12, MIB, copy_s=0)
    assert [len(g) for g in groups] == [1, 3, 6, 2]
    assert local_groups((0, 2, 5, 9), groups) == ((0,), (1,), (2, 3), ())
    assert local_groups(tuple(range(12)), groups) == tuple(tuple(g) for g in groups)


# ---- through the controller --------------------------------------------------------------

@pytest.mark.parametrize("backend", backends(), ids=lambda b: b.name)
@pytest.mark.parametrize("layout", list(HostLayout), ids=lambda x: x.value)
def test_grouped_load_is_bit_exact(backend: TransferBackend, layout: HostLayout) -> None:
    """A grouped 32-layer load brings back every row bit for bit and nothing else."""
    ctrl = make_controller(backend, page_size=2, num_layers=NUM_LAYERS, layout=layout,
                           device_pages=16, host_pages=16)
    host, rows = written_and_wiped(ctrl, 10)
    loaded = ctrl.load(host)
    assert loaded is not None
    ctrl.start_loading()
    ctrl.drain()
    after = device_rows(ctrl.device_pool)
    assert torch.equal(after[loaded.tensor], rows)
    assert (untouched(after, loaded.tensor) == SENTINEL).all()


def test_every_event_recorded_after_its_group(monkeypatch: pytest.MonkeyPatch) -> None:
    """One copy per group; after it, the event of the group's last layer is recorded and
    every other layer's event follows it (fires with it), before the next group's copy.
    Copies of no CPU cost over a slow link: the plan of a link-bound load."""
    log: list[tuple[str, int]] = []
    spy = SpyBackend(log)
    spy.copy_s = 0.0
    monkeypatch.setattr(load_groups, "LINK_BYTES_PER_S", 1.0)
    ctrl = make_controller(spy, num_layers=NUM_LAYERS)
    host, _ = written_and_wiped(ctrl, 4)
    events = ctrl.layer_events._sets[0]
    position = {id(event): layer for layer, event in enumerate(events)}
    record = Event.record

    def logged(self: Event, stream: torch.cuda.Stream | None = None) -> None:
        if id(self) in position:
            log.append(("event", position[id(self)]))
        record(self, stream)

    follow = Event.follow

    def followed(self: Event, leader: Event) -> None:
        log.append(("follow", position[id(self)]))
        assert leader is events[max(i for i, e in enumerate(events) if e is leader)]
        follow(self, leader)

    monkeypatch.setattr(Event, "record", logged)
    monkeypatch.setattr(Event, "follow", followed)
    assert ctrl.load(host) is not None
    assert ctrl.start_loading() == 0
    expected: list[tuple[str, int]] = []
    for group in LINK_BOUND_LOAD:
        expected += [("copy", layer) for layer in group] + [("call", len(group))]
        expected += [("event", group[-1])] + [("follow", layer) for layer in group[:-1]]
    assert log == expected
    assert all(event.is_recorded for event in events)


def test_a_following_event_fires_with_its_leader_until_recorded_again() -> None:
    leader, member = Event(torch.device("cpu")), Event(torch.device("cpu"))
    leader.record()
    member.follow(leader)
    assert member.is_recorded and member.query()
    member.record()  # its own record point again: no longer a follower
    assert member._leader is None


@pytest.mark.parametrize(("copy_s", "calls"), [(0.0, [1, 3, 6, 12, 10]), (1.0, [1, 31])])
def test_the_controller_plans_with_its_backend_copy_cost(
        monkeypatch: pytest.MonkeyPatch, copy_s: float, calls: list[int]) -> None:
    """The controller plans a load's groups with its backend's ``copy_s``: copies of no CPU
    cost over a slow link ramp up; copies that cost far more than the link takes make the
    load layer 0 and then one copy of the rest."""
    log: list[tuple[str, int]] = []
    spy = SpyBackend(log)
    spy.copy_s = copy_s
    monkeypatch.setattr(load_groups, "LINK_BYTES_PER_S", 1e6)  # 256 us a layer here
    ctrl = make_controller(spy, num_layers=NUM_LAYERS)
    host, _ = written_and_wiped(ctrl, 4)
    assert ctrl.load(host) is not None
    ctrl.start_loading()
    assert [count for entry, count in log if entry == "call"] == calls


def test_big_layers_are_copied_one_by_one(monkeypatch: pytest.MonkeyPatch) -> None:
    """With the byte bound below one layer's bytes and no copy-count bound, the controller
    issues one copy per layer, as before groups."""
    log: list[tuple[str, int]] = []
    ctrl = make_controller(SpyBackend(log), num_layers=NUM_LAYERS)
    host, _ = written_and_wiped(ctrl, 4)
    monkeypatch.setattr(load_groups, "GROUP_BYTES", 1)
    monkeypatch.setattr(load_groups, "MAX_COPIES", NUM_LAYERS)
    monkeypatch.setattr(load_groups, "LINK_BYTES_PER_S", 1.0)  # each layer slow to move
    assert ctrl.load(host) is not None
    ctrl.start_loading()
    assert [entry for entry in log if entry[0] == "call"] == [("call", 1)] * NUM_LAYERS


def test_wait_until_every_layer_after_a_grouped_load() -> None:
    """wait_until accepts every model layer of a grouped load; the rows are all there."""
    ctrl = make_controller(TorchBackend(), num_layers=NUM_LAYERS)
    host, rows = written_and_wiped(ctrl, 6)
    loaded = ctrl.load(host)
    assert loaded is not None
    ctrl.start_loading()
    for layer in range(NUM_LAYERS):
        ctrl.wait_until(layer)
    assert torch.equal(device_rows(ctrl.device_pool)[loaded.tensor], rows)
    assert len(ctrl.poll()) == 1


@pytest.mark.parametrize("backend", backends(), ids=lambda b: b.name)
@pytest.mark.parametrize("layout", list(HostLayout), ids=lambda x: x.value)
def test_hybrid_grouped_load(backend: TransferBackend, layout: HostLayout,
                             monkeypatch: pytest.MonkeyPatch) -> None:
    """16 model layers over a slow link (layer 0, then groups growing to 7 layers); SWA
    layers 1, 3-6, 10 and 13, so groups hold layers of one pool and of both: full rows of
    every token and SWA rows of the tail come back bit for bit, nothing else changes."""
    monkeypatch.setattr(load_groups, "LINK_BYTES_PER_S", 1.0)
    ctrl = make_hybrid(backend, layout=layout, num_layers=16, swa_layers=HYBRID_SWA_LAYERS)
    pool = ctrl.hybrid_pool
    _, host, swa_before, full_rows, swa_rows = back_up_and_evict(ctrl, 10, no_swa_tokens=6)
    back = ctrl.load(host.full, host.swa, swa_tail_tokens=4)
    assert back is not None
    ctrl.start_loading()
    for layer in range(16):
        ctrl.wait_until(layer)
    ctrl.drain()
    tail = back.swa.tensor != 0
    after_full, after_swa = device_rows(pool.full), device_rows(pool.swa)
    assert torch.equal(after_full[back.full.tensor], full_rows)
    assert (untouched(after_full, back.full.tensor) == SENTINEL).all()
    assert torch.equal(after_swa[back.swa.tensor[tail]], swa_rows[swa_before[tail]])
    assert (untouched(after_swa, back.swa.tensor[tail]) == SENTINEL).all()
    assert (host_rows(ctrl.host_swa)[host.swa.tensor[tail]] == swa_rows[swa_before[tail]]).all()
    pool.check_integrity()


def test_plans_are_kept_by_their_arguments_and_bounds(monkeypatch: pytest.MonkeyPatch) -> None:
    """A plan asked for again is the one made before (one derivation per op size); one
    asked for after a bound changed is derived for that bound."""
    first = plan_load_groups(NUM_LAYERS, 64 * 2**20, copy_s=70e-6)
    assert plan_load_groups(NUM_LAYERS, 64 * 2**20, copy_s=70e-6) is first
    monkeypatch.setattr(load_groups, "MAX_COPIES", NUM_LAYERS)
    unbounded = plan_load_groups(NUM_LAYERS, 64 * 2**20, copy_s=70e-6)
    assert unbounded != first and len(unbounded) > len(first)
    monkeypatch.undo()
    assert plan_load_groups(NUM_LAYERS, 64 * 2**20, copy_s=70e-6) == first
