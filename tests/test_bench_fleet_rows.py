"""hicache bench fleet's rows count what the replay did, exactly: a hand-made trace on one
instance whose device holds three blocks gives known device and host hits, the rows a request
reuses are checked on the requests ``verify_every`` names, a request's partial last page goes
back to the pool, the store keeps its pages unless asked to clear them, and the token ids and
rows that make every reuse checkable are the documented ones."""

from __future__ import annotations

import time
from pathlib import Path

import numpy as np
import pytest
import torch

from hicache.bench.fleet import (
    MODEL_ID,
    FleetRow,
    expected_rows,
    fleet_config,
    replay_fleet,
    serve,
    trace_tokens,
)
from hicache.bench.trace import BLOCK, TraceRequest
from hicache.factory import build_service

# Device of 3 blocks, host of 16, one instance: A fills 2 blocks; B needs all 3, so A goes
# to the host; A again with a new block loads A's 2 blocks back (B leaves the device) and
# computes 76 tokens of a partial page; A once more finds its 2 blocks on the device.
REQUESTS = [TraceRequest(2 * BLOCK, (1, 2)), TraceRequest(3 * BLOCK, (3, 4, 5)),
            TraceRequest(2 * BLOCK + 76, (1, 2, 6)), TraceRequest(2 * BLOCK, (1, 2))]
INPUT_TOKENS = 9 * BLOCK + 76


def test_trace_tokens_are_the_ids_of_their_blocks() -> None:
    """Block ``b`` is the ids ``b * 512 .. b * 512 + 511``, cut to the input length."""
    tokens = trace_tokens(TraceRequest(BLOCK + 188, (3, 7)))
    assert tokens.dtype == np.int64
    assert tokens.tolist() == [*range(3 * BLOCK, 4 * BLOCK), *range(7 * BLOCK, 7 * BLOCK + 188)]
    assert tokens.tolist() == TraceRequest(BLOCK + 188, (3, 7)).tokens()


def test_expected_rows_hold_the_id_and_the_position_exactly() -> None:
    """K: the id's high and low 12 bits; V: the position and 1; ids up to 2**24 are exact
    in float32, and two different ids or positions never give the same row."""
    ids = np.array([0, 4095, 4096, 2**24 - 1, 123_456], dtype=np.int64)
    rows = expected_rows(ids, 7)
    assert rows.shape == (5, 2, 1, 2) and rows.dtype == torch.float32
    assert rows[:, 0, 0].tolist() == [[0, 0], [0, 4095], [1, 0], [4095, 4095], [30, 576]]
    assert rows[:, 1, 0].tolist() == [[7, 1], [8, 1], [9, 1], [10, 1], [11, 1]]


def test_an_instance_is_one_layer_of_small_rows_in_block_pages() -> None:
    config = fleet_config(3, 16, "/srv/pages", "timeout")
    assert (config.page_size_tokens, config.model.num_layers, config.model.head_dim) == (
        BLOCK, 1, 2)
    assert (config.device_pool.num_tokens, config.host.ratio) == (3 * BLOCK, 16 / 3)
    assert config.controller.write_policy.value == "write_through"
    assert config.controller.load_back_threshold_tokens == 0
    assert not config.service.metrics_enabled
    store = config.storage
    assert (store.backend.value, store.path, store.write_policy.value,
            store.prefetch_policy.value) == ("file", "/srv/pages", "write_through", "timeout")
    redis = fleet_config(3, 16, "redis://127.0.0.1:6379").storage
    assert (redis.backend.value, redis.url, redis.prefetch_policy.value) == (
        "redis", "redis://127.0.0.1:6379", "wait_complete")
    assert fleet_config(3, 16, None).storage.backend.value == "none"


@pytest.mark.parametrize(("verify_every", "verified"), [(1, 2), (2, 1), (3, 1), (0, 0)])
def test_a_row_counts_each_tier_and_the_verified_requests(verify_every: int,
                                                          verified: int) -> None:
    """The trace above: 1024 tokens from the host (request 2) and 1024 from the device
    (request 3); requests 2 and 3 reuse rows, checked when their index is a multiple of
    ``verify_every`` (0: none)."""
    row = FleetRow(1, "none", 3, 16)
    start = time.perf_counter()
    assert replay_fleet(REQUESTS, row, None, verify_every=verify_every) is row
    elapsed = time.perf_counter() - start
    assert (row.requests, row.input_tokens) == (4, INPUT_TOKENS)
    assert (row.device_hit_tokens, row.host_hit_tokens, row.l3_hit_tokens) == (
        2 * BLOCK, 2 * BLOCK, 0)
    assert row.hit_rate == 4 * BLOCK / INPUT_TOKENS
    assert (row.verified_requests, row.verified_l3_tokens) == (verified, 0)
    assert 0 < row.seconds <= elapsed
    assert row.requests_per_s == 4 / row.seconds
    assert row.share_of_ideal == 0.0  # no ideal given
    row.ideal_hit_rate = 0.5
    assert row.share_of_ideal == row.hit_rate / 0.5


def test_a_request_gives_back_its_partial_last_page() -> None:
    """``serve`` inserts the whole pages and frees the slots of the rest: the engine holds
    no slot after a request of 2 blocks and 76 tokens, nor after one of exactly 2 blocks."""
    service = build_service(fleet_config(3, 16, None), model_id=MODEL_ID, model_revision="r")
    try:
        for request in (REQUESTS[2], REQUESTS[0]):
            tokens = trace_tokens(request)
            served = serve(service, service.key(tokens), tokens, True, "test")
            assert service.engine_held_tokens == 0
            service.step()
        assert served.device == 2 * BLOCK and served.verified
        assert service.tree.stats.inserted_tokens == 2 * BLOCK
    finally:
        service.stop()


@pytest.mark.parametrize("clear", [False, True], ids=["kept", "cleared"])
def test_the_store_keeps_its_pages_unless_cleared(tmp_path: Path, clear: bool) -> None:
    """Every whole block written through to the file store (blocks 1-5; block 6 is a
    partial page) is there after the run, or none with ``clear_store``; the row counts the
    bytes of their rows (16 a token) and the prefetches that found nothing."""
    row = FleetRow(1, "file", 3, 16)
    options = {"clear_store": True} if clear else {}  # kept: by default
    replay_fleet(REQUESTS, row, str(tmp_path), **options)
    pages = list(tmp_path.glob("*/*/*.kv"))  # namespace / fan-out / page
    assert len(pages) == (0 if clear else 5)
    assert (row.l3_bytes_written, row.l3_bytes_read) == (5 * BLOCK * 16, 0)
    assert row.prefetch_tokens == {"not_found": 5 * BLOCK}
