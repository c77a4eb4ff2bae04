"""hicache bench scheduler's figures time the calls their names say, on the inputs the README
describes: the chat workload's prompts, the tree figures' requests, keys and evictions, the
allocator's pools and the controller's ops, each clock only around its call, and the slope
of the medians."""

from __future__ import annotations

import math
import time
from typing import Any

import numpy as np
import pytest

import hicache.bench.scheduler as scheduler_module
import hicache.bench.scheduler_ops as ops_module
import hicache.bench.scheduler_thread as thread_module
from hicache.bench.scheduler import (
    PAGE,
    REQUEST_TOKENS,
    SYSTEM_TOKENS,
    TURN_TOKENS,
    ChatWorkload,
    Figure,
    admit,
    fill,
    free_tail,
    make_service,
    measure_tree,
    serve,
)
from hicache.bench.scheduler_ops import measure_allocator, measure_controller
from hicache.pools import Indices, PageAllocator
from hicache.service import HiCacheService


def test_the_chat_workload_is_the_one_described() -> None:
    """1,000 system prompts of ``SYSTEM_TOKENS``; a prompt is a new conversation or the
    next turn of one (``TURN_TOKENS`` more); a request is a system prompt and new tokens up
    to ``REQUEST_TOKENS``."""
    workload = ChatWorkload(5)
    assert len(workload.systems) == 1000
    assert {len(system) for system in workload.systems} == {SYSTEM_TOKENS}
    for _ in range(50):
        prompt = workload.next_prompt()
        turns, rest = divmod(len(prompt) - SYSTEM_TOKENS, TURN_TOKENS)
        assert turns >= 1 and rest == 0 and prompt[:SYSTEM_TOKENS] in workload.systems
    request = workload.request(workload.systems[:3])
    assert len(request) == REQUEST_TOKENS and request[:SYSTEM_TOKENS] in workload.systems[:3]


def test_the_bench_service_is_one_layer_of_small_rows_written_through() -> None:
    """The service every scheduler figure uses: a CPU pool of one layer of 2-element rows
    (bookkeeping dominates), write-through, every host hit loaded back, no metrics."""
    service = make_service(capacity_tokens=4096, host_ratio=2.0)
    try:
        pool, tree = service.device_pool, service.tree
        assert (pool.num_layers, pool.geometry.num_kv_heads, pool.geometry.head_dim) == (1, 1, 2)
        assert pool.device.type == "cpu"
        assert tree.write_policy.value == "write_through"
        assert tree.load_back_threshold_tokens == 0
        assert service.exporter is None
        assert pool.num_slots - PAGE == 4096  # the padding page apart
        assert service.controller.host_pool.num_slots - PAGE == 8192
    finally:
        service.stop()


def test_a_request_allocates_what_its_match_missed_and_frees_its_partial_page() -> None:
    """``admit`` allocates only the tokens the match did not find (the slots of every token,
    whole pages); ``free_tail`` gives back exactly the last partial page's slots."""
    service = make_service(capacity_tokens=16_384)
    try:
        workload = ChatWorkload(1)
        serve(service, workload.systems[0] + [7] * (REQUEST_TOKENS - SYSTEM_TOKENS))
        serve(service, workload.systems[2][:SYSTEM_TOKENS - PAGE])  # cached in part only
        assert workload.cached_systems(service) == [workload.systems[0]]
        free_before = service.controller.device_allocator.num_free_tokens
        tokens = workload.systems[0] + [9] * (REQUEST_TOKENS - SYSTEM_TOKENS + 5)
        key, match, slots = admit(service, tokens)
        assert match.device_hit_tokens == SYSTEM_TOKENS
        assert len(slots) == REQUEST_TOKENS + PAGE  # 5 tokens past the last whole page
        allocated = free_before - service.controller.device_allocator.num_free_tokens
        assert allocated == REQUEST_TOKENS - SYSTEM_TOKENS + PAGE
        service.insert(key, slots)
        held = service.controller.device_allocator.num_free_tokens
        free_tail(service, len(tokens), slots)
        assert service.controller.device_allocator.num_free_tokens == held + PAGE
        free_tail(service, REQUEST_TOKENS, Indices(slots.tensor[:REQUEST_TOKENS],
                                                slots.space))  # no partial page: no-op
        assert service.controller.device_allocator.num_free_tokens == held + PAGE
        service.release(match.last_device_node)
        service.step()
    finally:
        service.stop()


def test_a_figure_slope_is_the_log_log_slope_of_its_medians() -> None:
    figure = Figure("f", None, {10: [1.0, 2.0, 100.0], 1000: [3.0, 20.0, 5000.0]})
    assert figure.summary(10) == (1.0, 2.0, 100.0)
    assert figure.slope() == pytest.approx(math.log(10) / math.log(100))
    assert Figure("f", None, {10: [1.0]}).slope() is None


SPIED = ("capacity", "options", "key", "match", "listed", "keys_then", "evict", "write")


def spy_service(monkeypatch: pytest.MonkeyPatch, module: Any,
                calls: dict[str, list[Any]]) -> None:
    """Make ``module``'s ``make_service`` record its capacity and the arguments of the
    service's ``key``, ``match``, ``evict`` and the controller's ``write``."""

    def spied(capacity_tokens: int, **options: Any) -> HiCacheService:
        calls["capacity"].append(capacity_tokens)
        calls["options"].append(options)
        service = make_service(capacity_tokens, **options)
        key, match, evict = service.key, service.match, service.evict
        write = service.controller.write

        def spied_key(tokens: Any) -> Any:
            calls["key"].append(len(tokens))
            return key(tokens)

        def spied_match(tokens: Any) -> Any:
            calls["match"].append(len(tokens))
            if isinstance(tokens, list):
                calls["listed"].append(len(tokens))
                calls["keys_then"].append(len(calls["key"]))
            return match(tokens)

        def spied_evict(num_tokens: int) -> Any:
            calls["evict"].append(num_tokens)
            return evict(num_tokens)

        def spied_write(device: Indices, *args: Any, **kwargs: Any) -> Any:
            calls["write"].append(len(device))
            return write(device, *args, **kwargs)

        monkeypatch.setattr(service, "key", spied_key)
        monkeypatch.setattr(service, "match", spied_match)
        monkeypatch.setattr(service, "evict", spied_evict)
        monkeypatch.setattr(service.controller, "write", spied_write)
        return service

    monkeypatch.setattr(module, "make_service", spied)


def test_tree_figures_time_their_calls_on_the_described_inputs(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """At a tree of 5,000 tokens, 40 repeats: the service the other figures use, a 2k and a
    32k key made and matched (the 32k one max(3, repeats // 10) times), one-page evictions
    then one of a tenth of the tree, one value per repeat, and no clock longer than the
    whole call."""
    calls: dict[str, list[Any]] = {name: [] for name in SPIED}
    spy_service(monkeypatch, scheduler_module, calls)
    start = time.perf_counter()
    out = measure_tree(5_000, 40, seed=2)
    elapsed_us = (time.perf_counter() - start) * 1e6
    assert calls["capacity"] == [2 * 5_000 + 65_536]
    at_32k = calls["key"].index(32_768)  # the 2k key is made just before it
    assert calls["key"][at_32k - 1] == SYSTEM_TOKENS + 1024 == REQUEST_TOKENS
    assert calls["match"].count(32_768) == 4
    assert calls["evict"] == [PAGE] * 40 + [500]
    lengths = {name: len(values) for name, values in out.items()}
    assert lengths == {
        "key of a 2k-token prompt (token checks)": 40,
        "match of a 2k-token prompt": 40,
        "match of a 32k-token prompt": 4,
        "one request's cycle (2k tokens)": 40,
        "insert of a 2k-token prompt (backup queued)": 40,
        "evict one page": 40,
        "evict 10% of the tree": 1,
        "check_integrity() (full, one hold of the lock)": 1,
        "background integrity check, longest lock hold": 1,
        "the same, collections inside a hold excluded": 1,
        "Python bytes per cached page": 1,
    }
    for name, values in out.items():
        if name != "Python bytes per cached page":
            assert all(0 < value < elapsed_us for value in values), name
    # what the tree keeps per cached page: a few hundred bytes (265-322 in the README's run)
    assert 50 < out["Python bytes per cached page"][0] < 5_000


def test_allocator_figures_use_a_fresh_and_an_every_other_page_pool(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """Two pools of 65,536 pages (1M tokens): one fresh, one with every other page free
    (32,768 one-page holes); one-page calls on each, the 2048-page call on the holey one
    max(5, repeats // 10) times; each call's pages given back (the pools end as they
    began), no clock longer than the whole call."""
    made: list[PageAllocator] = []
    asked: list[tuple[int, int]] = []

    class SpiedAllocator(PageAllocator):
        def __init__(self, *args: Any) -> None:
            super().__init__(*args)
            made.append(self)

        def try_alloc(self, num_tokens: int) -> Indices | None:
            asked.append((made.index(self), num_tokens))
            return super().try_alloc(num_tokens)

    monkeypatch.setattr(ops_module, "PageAllocator", SpiedAllocator)
    start = time.perf_counter()
    out = measure_allocator(20)
    elapsed_us = (time.perf_counter() - start) * 1e6
    fresh, holey = made
    assert (fresh.num_pages, fresh.page_size, holey.num_pages) == (65_536, PAGE, 65_536)
    assert fresh.num_free_tokens == 65_536 * PAGE
    first, lengths = holey.free_runs()
    assert first.tolist() == list(range(1, 65_536, 2)) and set(lengths.tolist()) == {1}
    assert asked == ([(1, 65_536 * PAGE)] + [(0, PAGE)] * 20 + [(1, PAGE)] * 20
                     + [(1, 2048 * PAGE)] * 5)
    assert [len(values) for values in out.values()] == [20, 20, 5]
    assert all(0 < v < elapsed_us for values in out.values() for v in values)


def test_controller_figures_time_ops_of_one_and_256_pages(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """Write ops of 1 and 256 pages on a service of 65,536 tokens, then one-page ops for the
    poll figure; the copy-excluded figure is each op's time less its copy (no more than
    the op, not negative), no clock longer than the whole call."""
    calls: dict[str, list[Any]] = {name: [] for name in SPIED}
    spy_service(monkeypatch, ops_module, calls)
    start = time.perf_counter()
    out = measure_controller(10)
    elapsed_us = (time.perf_counter() - start) * 1e6
    assert calls["capacity"] == [1 << 16]
    assert calls["write"] == [PAGE] * 10 + [256 * PAGE] * 10 + [PAGE] * 10
    assert [len(values) for values in out.values()] == [10] * 5
    for pages in (1, 256):
        whole = np.array(out[f"controller op, {pages} page(s), with its copy"])
        bare = np.array(out[f"controller op, {pages} page(s), copy excluded"])
        assert (bare > 0).all() and (bare < whole).all()
    assert all(0 < v < elapsed_us for values in out.values() for v in values)



def test_thread_figures_are_p99s_of_2k_calls_on_two_services_alike(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """Two services of the tree figures' capacity, the running one's thread checking every
    10 ms; every match is of a 2k-token prompt and every cycle a 2k-token request; the p99s
    and the max are of the timed calls, none longer than the whole call."""
    calls: dict[str, list[Any]] = {name: [] for name in SPIED}
    spy_service(monkeypatch, thread_module, calls)
    monkeypatch.setattr(thread_module, "WARM_S", 0.05)
    probe = make_service(2 * 10_000 + 65_536)
    try:  # the workload's next prompt at this size and seed is a new conversation: too short
        workload = ChatWorkload(0)
        fill(probe, workload, 10_000)
        assert len(workload.next_prompt()) == SYSTEM_TOKENS + TURN_TOKENS < 2048
    finally:
        probe.stop()
    start = time.perf_counter()
    out = thread_module.measure_thread_latency(10_000, 40, 0)
    elapsed_us = (time.perf_counter() - start) * 1e6
    assert calls["capacity"] == [2 * 10_000 + 65_536] * 2
    assert calls["options"] == [{"interval_s": 0.01}] * 2
    # the match figure's calls take the prompt's token list (a request's cycle its key)
    assert len(calls["listed"]) >= 2 * 40 and set(calls["listed"]) == {2048}
    # the cycles come after the matches: each a conversation's last 2048 tokens at most
    cycles = calls["key"][calls["keys_then"][-1]:]
    assert len(cycles) >= 2 * 40 and max(cycles) == 2048
    assert len(out) == 7 and all(len(values) == 1 for values in out.values())
    assert all(0 < values[0] < elapsed_us for values in out.values())
    assert out["2k match, background thread on (max)"][0] >= out[
        "2k match, background thread on (p99)"][0]


def test_p99_is_the_value_below_which_99_percent_of_the_calls_fall() -> None:
    p99 = thread_module.p99
    assert p99([5.0]) == 5.0
    assert p99([float(v) for v in reversed(range(1000))]) == 990.0
    assert p99([float(v) for v in range(50)]) == 49.0
