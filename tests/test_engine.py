"""The reference engine (hicache.engine): end-to-end verification on a CPU."""

from __future__ import annotations

import copy
import re
from pathlib import Path
from typing import Any

import pytest
import torch
import yaml
from gpu_shapes import scaled, under_sanitizer

from hicache.cli import main
from hicache.config import HiCacheConfig, WritePolicy, config_from_dict
from hicache.engine import DemoOptions, ModelSpec, TinyDecoder, run_demo
from hicache.engine.attention import DecodeBuffers, PagedKV, exact_batch
from hicache.engine.reference import DenseKV
from hicache.pools import HybridSWAPool, IndexSpace, Indices

SMALL = DemoOptions(quick=True, conversations=5, turns=3)


@pytest.fixture
def default_config(default_dict: dict[str, Any]) -> HiCacheConfig:
    return config_from_dict(default_dict, check_ram=False)


def test_demo_verifies_and_history_comes_back_from_host(default_config: HiCacheConfig) -> None:
    """A reduced workload passes, evicts device pages and serves prompt tokens from host."""
    report = run_demo(default_config, SMALL)
    assert report.failure() is None
    assert report.passed
    assert report.host_hit_tokens > 0
    assert report.evicted_device_tokens > 0
    assert report.loaded_back_tokens > 0
    assert report.pages_checked > 0
    parts = (report.device_hit_tokens + report.host_hit_tokens + report.recomputed_tokens
             + report.new_tokens)
    assert parts == report.prompt_tokens


def test_demo_on_a_model_without_swa(default_dict: dict[str, Any]) -> None:
    """The plain (full-attention only) pool path passes too, bfloat16 KV included."""
    data = copy.deepcopy(default_dict)
    data["model"]["swa_layers"] = []
    del data["model"]["window_tokens"]
    del data["device_pool"]["swa_num_tokens"]
    data["model"]["dtype"] = "bfloat16"
    data["device_pool"]["num_tokens"] = 512
    report = run_demo(config_from_dict(data, check_ram=False), SMALL)
    assert report.passed, report.failure()
    assert report.host_hit_tokens > 0


def test_write_back_policy_passes(default_config: HiCacheConfig) -> None:
    """Under write_back, pages are written only when evicted, and still come back intact."""
    options = DemoOptions(quick=True, conversations=5, turns=3,
                          write_policy=WritePolicy.WRITE_BACK)
    report = run_demo(default_config, options)
    assert report.passed, report.failure()
    assert report.write_policy == "write_back"


def test_corrupted_host_byte_is_reported(
    default_dict: dict[str, Any], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """One flipped host byte: the page that carried it is named and the exit code is 1."""
    path = tmp_path / "config.yaml"
    path.write_text(yaml.safe_dump(default_dict))
    code = main(["demo", "--config", str(path), "--quick", "--conversations", "5",
                 "--corrupt-host-byte"])
    captured = capsys.readouterr()
    assert code == 1
    assert "MISMATCH page: conversation" in captured.out
    assert "result             FAIL" in captured.out
    (line,) = captured.err.splitlines()
    assert line.startswith("hicache: error: conversation ")
    assert "host page" in line and "differs from its backup" in line
    # the page named is the one holding the flipped byte, of the full-attention pool
    found = re.search(r"corrupted {10}one byte of host slot (\d+)", captured.out)
    assert found is not None
    page = int(found.group(1)) // default_dict["page_size_tokens"]
    assert f"host page {page} of pool 'full' loaded into device page" in line


def test_report_without_corruption_target_fails() -> None:
    """--corrupt-host-byte that found no page to corrupt is a failure, not a silent pass."""
    from hicache.engine.report import DemoReport

    report = DemoReport("c", "cpu", 0, 1, 1, corruption_requested=True)
    assert not report.passed
    assert "nothing was corrupted" in (report.failure() or "")


# ---- batch invariance and padded buffers ---------------------------------------------------


def _pool(config: HiCacheConfig) -> HybridSWAPool:
    model = config.model
    return HybridSWAPool(
        num_layers=model.num_layers, swa_layers=model.swa_layer_ids, full_pages=16,
        swa_pages=16, page_size=config.page_size_tokens, geometry=model.row_geometry,
        device="cpu",
    )


def _prefill(
    model: TinyDecoder, pool: HybridSWAPool, prompts: list[list[int]], page: int
) -> tuple[list[int], list[Indices]]:
    """Prefill ``prompts`` in one batch on fresh pages; next tokens and each one's slots."""
    slots = [pool.try_alloc(-(-len(p) // page) * page) for p in prompts]
    assert all(s is not None for s in slots)
    owned = [s for s in slots if s is not None]
    tokens, positions, rows, locs, logit_rows = [], [], [], [], []
    for row, (prompt, own) in enumerate(zip(prompts, owned, strict=True)):
        tokens += prompt
        positions += list(range(len(prompt)))
        rows += [row] * len(prompt)
        locs += own.tensor[:len(prompt)].tolist()
        logit_rows.append(len(tokens) - 1)
    page_rows = [(own.tensor[::page] // page).tolist() for own in owned]
    batch = exact_batch(pool, locs, rows, positions, page_rows, max_pages=8, page_size=page)
    kv = PagedKV(pool, batch, model.spec, page)
    return model.forward(tokens, positions, kv, logit_rows), owned


def test_tokens_do_not_depend_on_batch_composition(default_config: HiCacheConfig) -> None:
    """A request alone and the same request between two others: same token, same KV bytes."""
    torch.manual_seed(0)
    page = default_config.page_size_tokens
    model = TinyDecoder(ModelSpec.from_config(default_config), seed=3, device="cpu")
    prompt = torch.randint(0, 256, (70,)).tolist()
    others = [torch.randint(0, 256, (n,)).tolist() for n in (33, 90)]
    alone_pool, batch_pool = _pool(default_config), _pool(default_config)
    (alone,), (alone_slots,) = _prefill(model, alone_pool, [prompt], page)
    batched, slots = _prefill(model, batch_pool, [others[0], prompt, others[1]], page)
    assert batched[1] == alone
    for layer in range(default_config.model.num_layers):
        sub, local = alone_pool.pool_of(layer)
        if alone_pool.is_swa_layer(layer):
            mine = alone_pool.swa_slots_of(alone_slots).tensor[:70]
            theirs = batch_pool.swa_slots_of(slots[1]).tensor[:70]
            other = batch_pool.swa
        else:
            mine, theirs, other = alone_slots.tensor[:70], slots[1].tensor[:70], batch_pool.full
        assert torch.equal(sub.data[:, local, mine], other.data[:, local, theirs])


def test_engine_tokens_same_alone_and_in_batches(default_config: HiCacheConfig) -> None:
    """One request in flight at a time or four: every turn generates the same tokens."""
    from hicache.engine.demo import serve  # the engine without the baseline
    from hicache.engine.report import DemoReport
    from hicache.engine.workload import make_workload

    results = []
    for max_running in (1, 4):
        options = DemoOptions(quick=True, conversations=4, turns=2, max_running=max_running)
        spec = ModelSpec.from_config(default_config)
        model = TinyDecoder(spec, 0, "cpu")
        workload = make_workload(options.workload_spec(), default_config.page_size_tokens,
                                 spec.vocab_size)
        report = DemoReport("c", "cpu", 0, workload.num_turns, 4)
        engine = serve(default_config, options, model, workload, report)
        results.append(engine.generated)
    assert results[0] == results[1]


def _buffers(max_batch: int, max_pages: int, page: int) -> DecodeBuffers:
    return DecodeBuffers(max_batch=max_batch, max_pages=max_pages, device=torch.device("cpu"),
                         page_size=page)


def test_padded_decode_rows_point_at_slot_zero(default_config: HiCacheConfig) -> None:
    """After a batch of 4 then a batch of 2, rows 2 and 3 of every buffer are padding (0)."""
    pool = _pool(default_config)
    page = default_config.page_size_tokens
    slots = pool.try_alloc(4 * page)
    assert slots is not None
    buffers = _buffers(4, 3, page)
    locs = [int(slots.tensor[i * page]) for i in range(4)]
    rows = [[locs[i] // page] for i in range(4)]
    buffers.fill(pool, locs, [0] * 4, rows)
    batch = buffers.fill(pool, locs[:2], [0, 0], rows[:2])
    assert batch.locs.full.tensor.tolist() == [*locs[:2], 0, 0]
    assert batch.locs.swa is not None
    swa = batch.locs.swa.tensor
    assert swa[2:].tolist() == [0, 0] and bool((swa[:2] != 0).all())
    assert buffers.page_table[2:].eq(0).all()
    assert batch.swa_page_table is not None and batch.swa_page_table.tensor[2:].eq(0).all()
    assert batch.locs.full.space is IndexSpace.DEVICE_FULL
    assert batch.locs.swa.space is IndexSpace.DEVICE_SWA
    assert batch.swa_page_table.space is IndexSpace.DEVICE_SWA


def test_padded_rows_leave_the_padding_slot_zero(default_config: HiCacheConfig) -> None:
    """A padded decode forward writes real rows only; the padding slot stays all zeros."""
    pool = _pool(default_config)
    page = default_config.page_size_tokens
    model = TinyDecoder(ModelSpec.from_config(default_config), seed=1, device="cpu")
    slots = pool.try_alloc(page)
    assert slots is not None
    buffers = _buffers(4, 2, page)
    loc = int(slots.tensor[0])
    batch = buffers.fill(pool, [loc], [0], [[loc // page]])
    model.forward([7], [0], PagedKV(pool, batch, model.spec, page), [0])
    assert pool.full.data[:, :, 0].eq(0).all() and pool.swa.data[:, :, 0].eq(0).all()
    assert pool.full.data[:, :, loc].ne(0).any()


def test_refused_decode_fill_changes_no_buffer(default_config: HiCacheConfig) -> None:
    """A page row wider than max_pages is refused before out_cache_loc or the page table is
    written: every buffer keeps the previous batch."""
    pool = _pool(default_config)
    page = default_config.page_size_tokens
    slots = pool.try_alloc(3 * page)
    assert slots is not None
    buffers = _buffers(4, 2, page)
    locs = [int(slots.tensor[i * page]) for i in range(3)]
    buffers.fill(pool, locs[:2], [0, 0], [[locs[0] // page], [locs[1] // page]])
    before = buffers.out_cache_loc.clone(), buffers.page_table.clone()
    with pytest.raises(ValueError, match=r"page table row 1: 3 pages > max_pages 2"):
        buffers.fill(pool, locs[2:], [0], [[1], [1, 2, 3]])
    assert torch.equal(buffers.out_cache_loc, before[0])
    assert torch.equal(buffers.page_table, before[1])


def test_more_page_rows_than_max_batch_are_refused(default_config: HiCacheConfig) -> None:
    """Five page rows for a 4-row buffer name both counts instead of an IndexError."""
    pool = _pool(default_config)
    page = default_config.page_size_tokens
    buffers = _buffers(4, 2, page)
    before = buffers.page_table.clone()
    with pytest.raises(ValueError, match=r"5 page-table rows do not fit a table of 4 rows"):
        buffers.fill(pool, [0], [0], [[0]] * 5)
    assert torch.equal(buffers.page_table, before)


def test_a_sliding_window_layer_reads_the_window_ending_at_its_token(
        default_config: HiCacheConfig) -> None:
    """Layers 1 and 3 read the 64 positions ending at the token (itself included); layers
    0 and 2 read from position 0."""
    spec = ModelSpec.from_config(default_config)
    assert (spec.swa_layers, spec.window_tokens) == ((1, 3), 64)
    for layer in (1, 3):
        assert [spec.first_key(layer, p) for p in (0, 63, 64, 100)] == [0, 0, 1, 37]
    for layer in (0, 2):
        assert [spec.first_key(layer, p) for p in (0, 100)] == [0, 0]


def test_the_baselines_dense_kv_takes_tokens_up_to_its_capacity(
        default_config: HiCacheConfig) -> None:
    kv = DenseKV(ModelSpec.from_config(default_config), 4, torch.device("cpu"))
    kv.begin(3)
    kv.commit()
    with pytest.raises(ValueError, match=r"dense KV of 4 tokens is full"):
        kv.begin(2)
    kv.begin(1)
    kv.commit()
    assert kv.length == 4


@pytest.mark.parametrize("row", [-1, 2])
def test_a_token_row_outside_the_page_table_is_refused(default_config: HiCacheConfig,
                                                        row: int) -> None:
    """A prefill token naming page-table row 2 of two rows (or row -1) is refused before
    anything is written, naming the rows given."""
    pool = _pool(default_config)
    page = default_config.page_size_tokens
    with pytest.raises(ValueError, match=r"a token's page-table row is outside the 2 rows "
                                         r"given"):
        exact_batch(pool, [page, page + 1], [0, row], [0, 0], [[1], [2]], max_pages=2,
                    page_size=page)
    assert pool.full.data.eq(0).all()


def test_decode_fill_refuses_out_of_range_location(default_config: HiCacheConfig) -> None:
    """A location past the full pool is refused (seed 004) and the buffers stay as they were."""
    pool = _pool(default_config)
    page = default_config.page_size_tokens
    buffers = _buffers(4, 2, page)
    with pytest.raises(ValueError, match=r"decode batch: slot -1 is negative for pool 'full'"):
        buffers.fill(pool, [-1], [0], [[0]])
    assert buffers.page_table.eq(0).all() and buffers.out_cache_loc.eq(0).all()
    assert pool.full.data.eq(0).all() and pool.swa.data.eq(0).all()


def test_gather_past_the_page_table_row_is_refused(default_config: HiCacheConfig) -> None:
    """A decode position past its page-table row raises instead of attending to fewer keys."""
    pool = _pool(default_config)
    page = default_config.page_size_tokens
    model = TinyDecoder(ModelSpec.from_config(default_config), seed=1, device="cpu")
    slots = pool.try_alloc(2 * page)
    assert slots is not None
    loc = int(slots.tensor[page])  # position `page` lives on the second page
    batch = _buffers(1, 1, page).fill(pool, [loc], [page], [[int(slots.tensor[0]) // page]])
    with pytest.raises(ValueError, match=rf"token 0 at position {page} lies past its "
                                         rf"page-table row \(1 pages"):
        model.forward([7], [page], PagedKV(pool, batch, model.spec, page), [0])


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("policy", [
    pytest.param(WritePolicy.WRITE_THROUGH, marks=pytest.mark.skipif(
        under_sanitizer(), reason="under the sanitizer write_back alone covers both ways")),
    WritePolicy.WRITE_BACK,
])
def test_demo_on_a_gpu(default_config: HiCacheConfig, policy: WritePolicy) -> None:
    """Real streams: the forward on its own producer stream, layer-wise loads on the load
    stream; tokens and loaded pages still verify."""
    # Under the sanitizer (memcheck with the caching allocator off and racecheck did not
    # finish this test in 330 s and 240 s with 8-16 generated tokens a turn; synccheck took
    # 21 s): 2 conversations of up to 2 turns, the least that still brings evicted history
    # back from the host, prefill chunks of 64 tokens and 1-2 generated tokens a turn
    # (fewer forwards, so fewer launches and allocations).
    options = DemoOptions(quick=True, device="cuda", write_policy=policy,
                          conversations=scaled(None, 2), turns=scaled(None, 2),
                          prefill_chunk_tokens=scaled(16, 64),
                          new_tokens=scaled(None, (1, 2)))
    report = run_demo(default_config, options)
    assert report.passed, report.failure()
    assert report.host_hit_tokens > 0 and report.pages_checked > 0
    if not under_sanitizer():  # ops enough in each direction to time more than the first
        for line in report.transfers:
            assert line.gb_per_s is not None and line.gb_per_s > 0, line
            assert line.seconds is not None and line.seconds < report.engine_s, line
