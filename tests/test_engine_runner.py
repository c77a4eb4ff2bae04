"""The reference engine's scheduler (hicache.engine.runner) on a CPU: what every request
hands back, retraction when the device pool is too small for the running batch, batching,
progress, and the prefix an admission reuses."""

from __future__ import annotations

import copy
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import pytest
import torch

from hicache.config import HiCacheConfig, config_from_dict
from hicache.engine import DemoOptions, ModelSpec, TinyDecoder
from hicache.engine.demo import serve
from hicache.engine.report import DemoReport
from hicache.engine.request import Request
from hicache.engine.runner import DemoEngine, EngineError
from hicache.engine.verify import TransferAudit
from hicache.engine.workload import Turn, Workload, make_workload
from hicache.factory import build_service
from hicache.radix import TreeNode
from hicache.service import HiCacheService

OPTIONS = DemoOptions(quick=True, conversations=5, turns=3, max_running=4)


def full_attention(data: dict[str, Any], device_tokens: int) -> HiCacheConfig:
    """``data`` as a model without SWA layers whose device pool holds ``device_tokens``."""
    data = copy.deepcopy(data)
    data["model"]["swa_layers"] = []
    del data["model"]["window_tokens"]
    del data["device_pool"]["swa_num_tokens"]
    data["device_pool"]["num_tokens"] = device_tokens
    return config_from_dict(data, check_ram=False)


class CountingDecoder(TinyDecoder):
    """The decoder, remembering how many sequences each forward produced logits for."""

    def __init__(self, *args: Any) -> None:
        super().__init__(*args)
        self.logit_rows: list[int] = []

    def forward(self, *args: Any) -> list[int]:
        self.logit_rows.append(len(args[3]))
        return super().forward(*args)


def run(config: HiCacheConfig, options: DemoOptions = OPTIONS
        ) -> tuple[DemoEngine, DemoReport, CountingDecoder, Workload]:
    spec = ModelSpec.from_config(config)
    model = CountingDecoder(spec, options.seed, "cpu")
    workload = make_workload(options.workload_spec(), config.page_size_tokens,
                             spec.vocab_size)
    report = DemoReport("c", "cpu", 0, workload.num_turns, options.max_running)
    return serve(config, options, model, workload, report), report, model, workload


def assert_everything_handed_back(engine: DemoEngine, report: DemoReport,
                                  workload: Workload) -> None:
    """Every turn finished once; no device page is still the engine's and no node locked;
    each request's figures add up to what it reused."""
    service = engine.service
    assert len(engine.finished) == workload.num_turns
    assert sorted(engine.generated) == sorted(
        (c.conversation, t.index) for c in workload.conversations for t in c.turns)
    assert service.engine_held_tokens == 0
    assert service.tree.root.lock_count == 0
    for request in engine.finished:
        assert request.device_tokens + request.host_tokens == len(request.prefix)
        assert 0 <= request.device_tokens + request.host_tokens <= request.matched_tokens
        assert request.matched_tokens < len(request.prompt)
        assert request.recomputed_tokens >= 0 and request.new_tokens >= 1
    assert report.host_hit_tokens <= report.loaded_back_tokens
    assert report.retracted_requests == engine.num_retracted


def test_the_default_config_hands_everything_back(default_dict: dict[str, Any]) -> None:
    engine, report, model, workload = run(config_from_dict(default_dict, check_ram=False))
    assert report.device_hit_tokens > 0 and report.host_hit_tokens > 0
    assert_everything_handed_back(engine, report, workload)
    assert max(model.logit_rows) > 1  # requests ran side by side


def test_a_full_attention_model_batches_requests(default_dict: dict[str, Any]) -> None:
    engine, report, model, workload = run(full_attention(default_dict, 1024))
    assert engine.num_retracted == 0
    assert_everything_handed_back(engine, report, workload)
    assert max(model.logit_rows) == OPTIONS.max_running


def test_a_pool_too_small_for_the_batch_retracts_and_still_serves_every_turn(
        default_dict: dict[str, Any]) -> None:
    """192 device tokens: four running requests do not fit; the newest gives back its pages
    and restarts later, the tokens still equal the reference's (run_demo checks them)."""
    engine, report, _, workload = run(full_attention(default_dict, 192))
    assert engine.num_retracted > 0
    assert_everything_handed_back(engine, report, workload)
    alone, _, _, _ = run(full_attention(default_dict, 1024))
    assert engine.generated == alone.generated


def test_a_request_that_cannot_fit_alone_is_an_engine_error(
        default_dict: dict[str, Any]) -> None:
    with pytest.raises(EngineError, match=r"needs 16 more device tokens and nothing else can "
                                          r"be evicted; raise device_pool.num_tokens"):
        run(full_attention(default_dict, 128))


def test_progress_is_told_after_every_finished_turn(default_dict: dict[str, Any]) -> None:
    config = full_attention(default_dict, 1024)
    spec = ModelSpec.from_config(config)
    workload = make_workload(OPTIONS.workload_spec(), config.page_size_tokens, spec.vocab_size)
    told: list[tuple[int, int]] = []
    with engine_on(config) as engine:
        engine.serve(workload, lambda done, total: told.append((done, total)))
    total = workload.num_turns
    assert told == [(done, total) for done in range(1, total + 1)]


@contextmanager
def engine_on(config: HiCacheConfig, prefill_chunk_tokens: int = 64,
              engine: type[DemoEngine] = DemoEngine) -> Iterator[DemoEngine]:
    """A started service of ``config`` and an ``engine`` over it (page table for sequences
    of 512 tokens); the service stops on exit."""
    service = build_service(config)
    audit = TransferAudit(service.controller)
    model = TinyDecoder(ModelSpec.from_config(config), 0, "cpu")
    with service:
        try:
            yield engine(service, model, max_running=4,
                         prefill_chunk_tokens=prefill_chunk_tokens, max_tokens=512,
                         audit=audit)
        finally:
            audit.close()


class RecordingEngine(DemoEngine):
    """The engine, writing down each admission (with how many requests ran), retraction
    (and whether it took the newest running request) and finish, in order."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.events: list[tuple[str, int | bool]] = []

    def _try_admit(self, turn: Turn, prompt: list[int]) -> Request | None:
        running = len(self.running)
        request = super()._try_admit(turn, prompt)
        if request is not None:
            self.events.append(("admit", running))
        return request

    def _retract(self, request: Request) -> None:
        self.events.append(("retract", request is self.running[-1]))
        super()._retract(request)

    def _finish(self, request: Request) -> None:
        self.events.append(("finish", True))
        super()._finish(request)


def test_a_retraction_takes_the_newest_request_and_pauses_admission_until_a_finish(
        default_dict: dict[str, Any]) -> None:
    config = full_attention(default_dict, 192)
    spec = ModelSpec.from_config(config)
    workload = make_workload(OPTIONS.workload_spec(), config.page_size_tokens, spec.vocab_size)
    with engine_on(config, engine=RecordingEngine) as engine:
        engine.serve(workload)
    assert isinstance(engine, RecordingEngine)
    kinds = [kind for kind, _ in engine.events]
    assert engine.num_retracted == kinds.count("retract") > 0
    assert kinds.count("finish") == workload.num_turns
    assert kinds.count("admit") == workload.num_turns + engine.num_retracted
    paused = False
    for kind, detail in engine.events:
        if kind == "retract":
            assert detail, "a retraction took another request than the newest"
            paused = True
        elif kind == "finish":
            paused = False
        elif paused:  # admitted after a retraction with no finish since: only into an
            assert detail == 0  # empty batch


@pytest.mark.parametrize(("asked", "chunk"), [(70, 64), (64, 64), (10, 16)])
def test_the_prefill_chunk_is_whole_pages_and_at_least_one(
        default_dict: dict[str, Any], asked: int, chunk: int) -> None:
    with engine_on(full_attention(default_dict, 1024), asked) as engine:
        assert engine.page_size == 16
        assert engine.chunk == chunk
        assert engine.max_pages == 512 // 16 + 1


@pytest.mark.parametrize("extra", [1, 2, 16])
def test_admission_reuses_every_cached_page_but_the_one_holding_the_last_token(
        default_dict: dict[str, Any], extra: int) -> None:
    """Three cached pages and a prompt ``extra`` tokens longer: the last prompt token is
    computed (its logits give the first new token), so with one extra token all three pages
    are reused, and with a whole extra page too (the prompt's own last page is computed)."""
    with engine_on(full_attention(default_dict, 1024)) as engine:
        service = engine.service
        cached = list(range(1, 49))
        slots = service.alloc_device(48)
        assert slots is not None
        service.insert(cached, slots)
        prompt = cached + [7] * extra
        request = engine._try_admit(Turn(0, 0, (), 1), prompt)
        assert request is not None
        assert len(request.prefix) == 48
        assert torch.equal(request.prefix.tensor, slots.tensor)
        assert (request.device_tokens, request.host_tokens) == (48, 0)
        assert request.matched_tokens == 48
        service.release(request.lock_node)


def cache_pages(service: HiCacheService, count: int, first_token: int = 1) -> list[TreeNode]:
    """``count`` cached sequences of one page each (distinct first tokens), inserted from
    fresh device pages; their nodes."""
    nodes = []
    for n in range(count):
        tokens = [first_token + n] * 16
        slots = service.alloc_device(16)
        assert slots is not None
        service.insert(tokens, slots)
        nodes.append(service.match(service.key(tokens)).last_device_node)
    return nodes


def hybrid(data: dict[str, Any], policy: str) -> HiCacheConfig:
    data = copy.deepcopy(data)
    data["controller"]["write_policy"] = policy
    return config_from_dict(data, check_ram=False)


@pytest.mark.parametrize("policy", ["write_through", "write_through_selective"])
def test_room_for_one_more_evicts_cached_windows_just_enough(
        default_dict: dict[str, Any], policy: str) -> None:
    """Twelve cached pages leave 4 of the 16 SWA pages free; one more request wants 9 (its
    window, its page, its next chunk): the room check evicts exactly 5 cached pages' SWA
    rows, with a host copy (write_through) or with the nodes (a prefix hit once is not
    backed up under write_through_selective)."""
    with engine_on(hybrid(default_dict, policy)) as engine:
        window, service = engine.window, engine.service
        assert window is not None
        swa = window.pool.swa_allocator
        cache_pages(service, 12)
        service.step()
        want = window.tokens_wanted([])
        assert (want, swa.num_free_tokens) == (144, 64)
        assert engine._has_room_for_one_more()
        assert swa.num_free_tokens == want
        assert service.engine_held_tokens == 0


def test_no_room_for_one_more_when_the_cached_windows_are_locked(
        default_dict: dict[str, Any]) -> None:
    with engine_on(hybrid(default_dict, "write_through")) as engine:
        window, service = engine.window, engine.service
        assert window is not None
        nodes = cache_pages(service, 12)
        for node in nodes:
            service.lock(node)
        assert not engine._has_room_for_one_more()
        assert window.pool.swa_allocator.num_free_tokens == 64
        for node in nodes:
            service.release(node)


def test_a_device_hit_gets_its_windows_swa_rows_back_from_the_host(
        default_dict: dict[str, Any]) -> None:
    """A cached prefix whose SWA rows left the device (they have a host copy) is still a
    device hit: admission loads the rows of its last window back, so all three pages are
    reused and none is recomputed."""
    with engine_on(hybrid(default_dict, "write_through")) as engine:
        service = engine.service
        cached = list(range(1, 49))
        slots = service.alloc_device(48)
        assert slots is not None
        service.insert(cached, slots)
        service.step()  # the backup lands
        assert service.evict_swa(48) == 48
        request = engine._try_admit(Turn(0, 0, (), 1), [*cached, 7])
        assert request is not None
        assert torch.equal(request.prefix.tensor, slots.tensor)
        assert (request.device_tokens, request.host_tokens) == (48, 0)
        assert service.tree.stats.restored_swa_tokens > 0
        service.start_loading()
        service.step()
        service.release(request.lock_node)
