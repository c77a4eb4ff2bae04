"""hicache bench scheduler: the CPU benchmark runs, writes its JSON, and its trace replay and
LRU reference count hits exactly on a hand-made trace."""

from __future__ import annotations

import json
import time
from pathlib import Path
from types import SimpleNamespace

import pytest

import hicache.bench.scheduler_requests as requests_module
import hicache.bench.trace as trace_module
from hicache.bench.scheduler import SYSTEM_TOKENS, make_service
from hicache.bench.scheduler_cli import main
from hicache.bench.scheduler_requests import (
    BATCH,
    REQUEST_TOKENS,
    RequestsRow,
    measure_requests,
    render_requests,
)
from hicache.bench.trace import TraceRequest, lru_hit_rate, read_trace, replay
from hicache.cli import main as cli_main

# Requests 2, 3 and 5 share whole blocks with request 1; request 4 shares nothing.
TRACE = [
    {"timestamp": 0, "input_length": 1024, "output_length": 1, "hash_ids": [1, 2]},
    {"timestamp": 1, "input_length": 1536, "output_length": 1, "hash_ids": [1, 2, 3]},
    {"timestamp": 2, "input_length": 512, "output_length": 1, "hash_ids": [1]},
    {"timestamp": 3, "input_length": 1024, "output_length": 1, "hash_ids": [4, 5]},
    {"timestamp": 4, "input_length": 512, "output_length": 1, "hash_ids": [1]},
]
HITS, TOKENS = 1024 + 512 + 512, 4608


@pytest.fixture
def trace(tmp_path: Path) -> Path:
    path = tmp_path / "trace.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in TRACE), encoding="utf-8")
    return path


def test_lru_reference_counts_prefix_blocks(trace: Path) -> None:
    """Unlimited: 1024 + 512 + 512 hit tokens of 4608; room for one block: the newest
    prefix only, which no later request starts with, so nothing hits."""
    requests = read_trace(trace, 10)
    assert lru_hit_rate(requests, 100) == pytest.approx(HITS / TOKENS)
    assert lru_hit_rate(requests, 1) == 0.0
    # room for exactly two blocks: request 2 finds request 1's two (1024 tokens); from then
    # on each request's blocks push the older ones out before they are asked for again
    assert lru_hit_rate(requests, 2) == pytest.approx(1024 / TOKENS)


def test_replay_matches_the_lru_reference_when_nothing_is_evicted(trace: Path) -> None:
    """With room for everything the service hits exactly the shared prefixes."""
    row = replay(read_trace(trace, 10), device_blocks=16, host_blocks=16, page_size=16)
    assert (row.requests, row.input_tokens) == (5, TOKENS)
    assert row.device_hit_tokens + row.host_hit_tokens == HITS
    assert row.hit_rate == pytest.approx(row.lru_hit_rate)


def test_replay_counts_host_hits_after_device_eviction(trace: Path) -> None:
    """A device of 2 blocks: request 2 does not fit (its hits count, nothing is cached),
    request 4 evicts blocks 1 and 2 to the host (write-through), and request 5's block 1
    comes back from there."""
    row = replay(read_trace(trace, 10), device_blocks=2, host_blocks=8, page_size=16)
    assert (row.device_hit_tokens, row.host_hit_tokens) == (1024 + 512, 512)
    assert row.hit_rate == pytest.approx(HITS / TOKENS)  # both tiers' hits


def test_replay_hands_back_the_slots_of_a_partial_last_page(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """Requests whose length is not a whole number of pages: the tree keeps whole pages, and
    the replay frees the partial page's slots, so no slot stays with the engine and the
    pools account for every slot afterwards (else the device fills with leaked slots)."""
    made = []
    make = trace_module.make_service

    def recorded(*args: object, **kwargs: object) -> object:
        made.append(make(*args, **kwargs))  # type: ignore[arg-type]
        return made[-1]

    monkeypatch.setattr(trace_module, "make_service", recorded)
    requests = [TraceRequest(1000, (1, 2)), TraceRequest(1000, (1, 2)),
                TraceRequest(1530, (1, 2, 3)), TraceRequest(7, (9,))]
    row = replay(requests, device_blocks=8, host_blocks=8, page_size=16)
    # request 2: request 1's 62 whole pages; request 3: the same 992 tokens
    assert row.device_hit_tokens == 992 + 992
    (service,) = made
    assert service.engine_held_tokens == 0
    service.check_integrity()


def test_replay_times_the_service_not_the_token_lists(trace: Path,
                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    """A request's token list is made before its clock starts. The replay's clock here is the
    real one plus an hour for every token list made: had any list been made while a request's
    clock ran, the replay's seconds would hold that hour (the test does not depend on how fast
    the machine serves the five requests)."""
    hour = 3600.0
    made = []
    make_tokens = TraceRequest.tokens

    def clock() -> float:
        return time.perf_counter() + hour * len(made)

    def counted_tokens(request: TraceRequest) -> list[int]:
        made.append(request)
        return make_tokens(request)

    monkeypatch.setattr(trace_module, "time", SimpleNamespace(perf_counter=clock))
    monkeypatch.setattr(TraceRequest, "tokens", counted_tokens)
    row = replay(read_trace(trace, 10), device_blocks=16, host_blocks=16, page_size=16)
    assert row.requests == len(made) == 5
    assert 0 < row.seconds < hour


def test_benchmark_runs_and_writes_json(tmp_path: Path, trace: Path,
                                        capsys: pytest.CaptureFixture[str]) -> None:
    """Two tiny trees, two repeats, the replay: every figure is in the table and the JSON."""
    out = tmp_path / "scheduler.json"
    code = main(["--sizes", "1000", "2000", "--repeats", "2", "--trace", str(trace),
                 "--capacities", "16:16", "--json", str(out)])
    assert code == 0
    printed = capsys.readouterr().out
    for name in ("match of a 32k-token prompt", "evict one page", "poll() per acknowledged op",
                 "replay of trace.jsonl: 5 requests"):
        assert name in printed
    saved = json.loads(out.read_text(encoding="utf-8"))
    names = {f["name"] for f in saved["figures"]}
    assert {"one request's cycle (2k tokens)", "background integrity check, longest lock hold",
            "the same, collections inside a hold excluded",
            "key of a 2k-token prompt (token checks)",
            "allocate + free 2048 pages, fragmented",
            "controller op, 1 page(s), copy excluded"} <= names
    by_name = {f["name"]: f["by_size"] for f in saved["figures"]}
    for pages in (1, 256):  # the copy is timed and taken out of every op
        whole = next(iter(by_name[f"controller op, {pages} page(s), with its copy"].values()))
        kept = next(iter(by_name[f"controller op, {pages} page(s), copy excluded"].values()))
        assert all(0 < k < w for k, w in zip(kept, whole, strict=True))
    holds = by_name["background integrity check, longest lock hold"]
    own = by_name["the same, collections inside a hold excluded"]
    assert all(0 < own[size][0] <= holds[size][0] for size in ("1000", "2000"))
    inserts = by_name["insert of a 2k-token prompt (backup queued)"]
    assert set(inserts) == {"1000", "2000"} and all(
        len(v) == 2 and min(v) > 0 for v in inserts.values())
    assert saved["replay"][0]["input_tokens"] == TOKENS
    assert "end to end: 2048-token requests with shared prefixes" in printed
    assert [(r["tree_tokens"], r["requests"], r["per_step"]) for r in saved["requests"]] == [
        (1000, 10, 1), (1000, 10, BATCH), (2000, 10, 1), (2000, 10, BATCH)]
    assert all(r["requests_per_s"] > 0 for r in saved["requests"])


def test_end_to_end_requests_hit_their_shared_prefix() -> None:
    """Each request is a cached system prompt and new tokens: with room for all of them,
    every request finds exactly its system prompt on the device, and nothing else."""
    row = measure_requests(5_000, 20, seed=3)
    assert (row.tree_tokens, row.requests, row.prompt_tokens, row.per_step) == (
        5_000, 20, 20 * REQUEST_TOKENS, 1)
    assert row.device_hit_tokens == 20 * SYSTEM_TOKENS
    assert row.hit_rate == pytest.approx(SYSTEM_TOKENS / REQUEST_TOKENS)
    assert row.seconds > 0 and row.requests_per_s == pytest.approx(20 / row.seconds)


def test_end_to_end_requests_in_steps_of_several() -> None:
    """Eight requests between two steps (the last step serves four): each finds exactly its
    system prompt on the device, as when served one a step."""
    row = measure_requests(5_000, 20, seed=3, per_step=8)
    assert (row.requests, row.per_step) == (20, 8)
    assert row.device_hit_tokens == 20 * SYSTEM_TOKENS


def test_end_to_end_requests_refuse_no_requests() -> None:
    with pytest.raises(ValueError, match="count and per_step must be >= 1, got 0 and 1"):
        measure_requests(1_000, 0, seed=0)
    with pytest.raises(ValueError, match="got 5 and 0"):
        measure_requests(1_000, 5, seed=0, per_step=0)


@pytest.mark.parametrize(("count", "per_step", "steps"), [(1, 1, 1), (20, 1, 20), (20, 8, 3)],
                         ids=["one-request", "one-a-step", "eight-a-step"])
def test_end_to_end_requests_are_the_rows_they_say(monkeypatch: pytest.MonkeyPatch,
                                                    count: int, per_step: int,
                                                    steps: int) -> None:
    """What the end-to-end row reports is what ran: the service the other tree figures use
    (device capacity ``2 * size + 65536``), every request ``REQUEST_TOKENS`` long, one
    ``step()`` per ``per_step`` requests (the last one short), and ``seconds`` the clock of
    those calls, not more than the call's own wall time."""
    made: list[tuple[int, float]] = []
    lengths: list[int] = []
    step_calls: list[int] = []

    def spied_service(capacity_tokens: int, host_ratio: float = 1.0) -> object:
        made.append((capacity_tokens, host_ratio))
        service = make_service(capacity_tokens, host_ratio)
        key, step = service.key, service.step

        def counted_key(tokens: object) -> object:
            lengths.append(len(tokens))  # type: ignore[arg-type]
            return key(tokens)  # type: ignore[arg-type]

        def counted_step() -> None:
            step_calls.append(len(lengths))
            step()

        monkeypatch.setattr(service, "key", counted_key)
        monkeypatch.setattr(service, "step", counted_step)
        return service

    monkeypatch.setattr(requests_module, "make_service", spied_service)
    start = time.perf_counter()
    row = measure_requests(5_000, count, seed=3, per_step=per_step)
    elapsed = time.perf_counter() - start
    assert made == [(2 * 5_000 + 65_536, 1.0)]
    # the fill's prompts come first; the measured requests are the last `count` keys
    assert lengths[-count:] == [REQUEST_TOKENS] * count
    measured_steps = [at for at in step_calls if at > len(lengths) - count]
    assert len(measured_steps) == steps and measured_steps[-1] == len(lengths)
    assert row.device_hit_tokens == count * SYSTEM_TOKENS
    assert 0 < row.seconds <= elapsed


def test_end_to_end_table_lines_up() -> None:
    """The rule under the header is as wide as the header, and each row as wide as both."""
    table = render_requests([RequestsRow(10_000, 1000, 1000 * REQUEST_TOKENS,
                                         500 * REQUEST_TOKENS, 0.25, BATCH)]).splitlines()
    header, rule, row = table[1:]
    assert len(rule) == len(header) == len(row) and set(rule) == {"-"}
    assert row.split() == ["10000", str(BATCH), "1000", "50.0%", "4000.0", "2000"]


def test_cli_dispatches_bench_scheduler(capsys: pytest.CaptureFixture[str]) -> None:
    """`hicache bench scheduler` reaches this benchmark (bad sizes: exit 2, one line)."""
    assert cli_main(["bench", "scheduler", "--sizes", "10"]) == 2
    assert "--sizes 10: must be >= 1000" in capsys.readouterr().err


# ---- the trace and the capacities, checked before anything is measured ---------------------


@pytest.mark.parametrize(("text", "problem"), [
    ('{"input_length": 5}\n', "line 1: hash_ids None: need a list of whole numbers"),
    ('\n{"input_length": true, "hash_ids": [1]}\n', "line 2: input_length True"),
    ('{"input_length": 1025, "hash_ids": [1, 2]}\n', "2 hash_ids cover 1024 tokens"),
    ('[1, 2]\n', "line 1: not a JSON object"),
    ("not json\n", "line 1: not JSON"),
    ("\n\n", "holds no request"),
    ('{"input_length": 0, "hash_ids": [1]}\n', "input_length 0: need a whole number >= 1"),
    ('{"input_length": 5, "hash_ids": ["1"]}\n', "hash_ids ['1']: need a list of whole"),
    ('{"input_length": 5, "hash_ids": [true]}\n', "hash_ids [True]: need a list of whole"),
    ('{"input_length": 5, "hash_ids": [' + ", ".join(['"x"'] * 20) + ']}\n',
     "hash_ids ['x', 'x', 'x', 'x', 'x', 'x', 'x', '...: need"),  # 37 characters, cut
], ids=["no-hash-ids", "bool-length", "too-few-ids", "array", "garbage", "empty",
        "zero-length", "string-id", "bool-id", "long-value-cut"])
def test_read_trace_names_the_file_line_and_problem(text: str, problem: str,
                                                    tmp_path: Path) -> None:
    """A trace that cannot be replayed: ``TraceError`` naming the file and what is wrong."""
    path = tmp_path / "t.jsonl"
    path.write_text(text, encoding="utf-8")
    with pytest.raises(trace_module.TraceError) as caught:
        read_trace(path, 10)
    assert str(caught.value).startswith(str(path)) and problem in str(caught.value)


def test_read_trace_reads_up_to_its_limit(trace: Path) -> None:
    """The first ``limit`` requests, a one-token request among them, each as written."""
    path = trace.with_name("short.jsonl")
    path.write_text(trace.read_text(encoding="utf-8").replace(
        '"input_length": 512,', '"input_length": 1,', 1), encoding="utf-8")
    requests = read_trace(path, 3)
    assert requests == [TraceRequest(1024, (1, 2)), TraceRequest(1536, (1, 2, 3)),
                        TraceRequest(1, (1,))]
    assert requests[2].tokens() == [512]
    assert requests[0].tokens() == list(range(512, 1536))  # block b: b * 512 + i


def test_read_trace_refuses_bytes_that_are_not_utf8(tmp_path: Path) -> None:
    path = tmp_path / "t.jsonl"
    path.write_bytes(b"\xff\xfe\n")
    with pytest.raises(trace_module.TraceError, match="not UTF-8"):
        read_trace(path, 10)


def test_replay_capacities_are_checked_against_the_trace(
        trace: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """A device smaller than the longest request (1536 tokens: 3 blocks) is refused before
    anything is measured; a host smaller than the device is allowed (the replay runs)."""
    assert main(["--trace", str(trace), "--capacities", "2:8"]) == 2
    err = capsys.readouterr().err
    assert "--capacities 2:8" in err and "device >= 3" in err and err.count("\n") == 1
    assert [replay(read_trace(trace, 10), 4, 2, page_size=16).requests] == [5]


def test_thread_latency_feeds_both_services_the_same_calls(monkeypatch: pytest.MonkeyPatch
                                                           ) -> None:
    """The thread-off and thread-on services take the same calls in turns: afterwards both
    trees cached and evicted the same tokens (small pools, so the cycles evict), each side
    timed every repeat, the running service's thread is stopped, and the p99 of the calls
    no collection stopped is never above the p99 of all of them."""
    import gc

    import hicache.bench.scheduler_thread as thread_bench
    from hicache.bench.scheduler import make_service

    monkeypatch.setattr(thread_bench, "WARM_S", 0.05)
    quiet, running = (make_service(capacity_tokens=16_384, interval_s=0.01) for _ in range(2))
    try:
        sides = (thread_bench._Side(quiet, 3, 4096), thread_bench._Side(running, 3, 4096))
        running.start()
        gc.callbacks.append(thread_bench._COLLECTIONS.count)
        off, on = thread_bench._in_turns(sides, "cycle", 40)
        assert len(off) == len(on) == 40
        assert len(off.collected) == len(on.collected) == 40
        for stat in ("inserted_tokens", "evicted_device_tokens", "evicted_host_tokens"):
            assert getattr(quiet.tree.stats, stat) == getattr(running.tree.stats, stat)
        assert quiet.tree.stats.evicted_device_tokens > 0  # the cycles evicted: trees changed
        assert quiet.match(sides[0].prompt).device_hit_tokens == \
            running.match(sides[1].prompt).device_hit_tokens
    finally:
        gc.callbacks.remove(thread_bench._COLLECTIONS.count)
        quiet.stop()
        running.stop()
    out = thread_bench.measure_thread_latency(4096, 50, 0)
    assert gc.callbacks.count(thread_bench._COLLECTIONS.count) == 0
    for side in ("off", "on"):
        whole = out[f"one request's cycle, background thread {side} (p99)"][0]
        spared = out[f"the same, thread {side}, calls no collection stopped (p99)"][0]
        assert 0 < spared <= whole


def test_a_collection_inside_a_slice_is_taken_out_of_the_check_own_hold(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """A full collection made inside every slice of the walk lengthens the lock hold by its
    time; the figure without collections takes exactly that time out (within a tenth of a
    millisecond) and stays positive."""
    import gc

    from hicache.bench.scheduler import ChatWorkload, background_check_holds, fill, make_service
    from hicache.integrity_slices import TreeCheck

    service = make_service(capacity_tokens=40_000)
    try:
        fill(service, ChatWorkload(0), 10_000)
        walk = TreeCheck.walk
        spent: list[float] = []

        def collecting_walk(self: TreeCheck, deadline: float) -> bool:
            begin = time.perf_counter()
            gc.collect()
            spent.append(time.perf_counter() - begin)
            return walk(self, deadline + spent[-1])

        monkeypatch.setattr(TreeCheck, "walk", collecting_walk)
        holds = background_check_holds(service)
        held = holds["background integrity check, longest lock hold"][0]
        own = holds["the same, collections inside a hold excluded"][0]
        assert spent and held >= max(spent) * 1e6
        assert 0 < own <= held - min(spent) * 1e6 + 100
    finally:
        service.stop()
