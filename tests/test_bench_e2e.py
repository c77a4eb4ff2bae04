"""hicache bench e2e: the decoder's attention is the lower-right causal softmax, a host hit
through the service computes the resident forward's output bit for bit (and the recompute's),
wrong loaded bytes fail the run, and the command prints every column."""

from __future__ import annotations

import contextlib
import json
from pathlib import Path
from typing import Any

import pytest
import torch
from gpu_shapes import scaled, under_sanitizer
from torch.nn.attention import SDPBackend, sdpa_kernel

from hicache.bench.e2e import measure
from hicache.bench.e2e.bare import pool_sources
from hicache.bench.e2e.cli import main
from hicache.bench.e2e.host_hit import HostHit
from hicache.bench.e2e.kv import PoolKV
from hicache.bench.e2e.measure import E2EBench, E2EOptions, check_output, run_e2e
from hicache.bench.e2e.model import TINY, Decoder, DecoderSpec, attend
from hicache.bench.e2e.report import COLUMNS, E2ERow, render
from hicache.bench.e2e.setup import Buffers, device_pool, put_prefix, service_config
from hicache.bench.workload import BenchmarkError
from hicache.cli import main as cli_main
from hicache.factory import build_service

needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


def naive_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """Softmax attention of ``T`` new tokens after ``S - T`` cached ones, head by head."""
    tokens, length, group = q.shape[0], k.shape[0], q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)
    scores = torch.einsum("thd,shd->hts", q, k) / q.shape[-1] ** 0.5
    allowed = torch.arange(length)[None, :] <= torch.arange(tokens)[:, None] + length - tokens
    weights = scores.masked_fill(~allowed, float("-inf")).softmax(dim=-1)
    return torch.einsum("hts,shd->thd", weights, v).reshape(tokens, -1)


@pytest.mark.parametrize(("tokens", "length"), [(5, 12), (1, 12), (7, 7)])
def test_attention_is_lower_right_causal_over_grouped_heads(tokens: int, length: int) -> None:
    """New token i attends to every cached row and new rows 0..i; 4 query heads share 2."""
    gen = torch.Generator().manual_seed(0)
    q = torch.randn(tokens, 4, 8, generator=gen)
    k, v = torch.randn(length, 2, 8, generator=gen), torch.randn(length, 2, 8, generator=gen)
    torch.testing.assert_close(attend(q, k, v), naive_attention(q, k, v))


def tiny_options(device: str = "cpu", dtype: torch.dtype = torch.float32,
                 new_tokens: int = 5, **changes: Any) -> E2EOptions:
    spec = DecoderSpec(**{**TINY.__dict__, "dtype": dtype})
    fields: dict[str, Any] = {"spec": spec, "device": torch.device(device),
                              "cached_tokens": (32, 64), "new_tokens": new_tokens,
                              "repeats": 1, "warmup": 0, "backend": "torch", **changes}
    return E2EOptions(**fields)


def test_host_hit_equals_resident_and_recompute_on_cpu() -> None:
    """Every prefix length: the host hit's output is the resident forward's bit for bit and
    the recompute's last rows (float32), read from one run of pool slots; times are set."""
    rows = run_e2e(tiny_options())
    assert [r.cached_tokens for r in rows] == [32, 64]
    for row in rows:
        assert row.outputs_equal and row.hit_max_diff == 0.0
        assert row.recompute_rel_diff < 1e-5
        assert row.gathered_layers == 0
        assert min(row.recompute_prefix_ms, row.recompute_ms, row.copy_ms, row.resident_ms,
                   row.bare_ms, row.hit_ms, row.device_hit_ms) > 0


def test_the_device_hit_loads_nothing(monkeypatch: pytest.MonkeyPatch) -> None:
    """The device-hit path finds the whole prefix on the device and issues no load; its
    output is checked against the resident forward's like the host hit's."""
    loads: list[int] = []
    run_device = HostHit.run_device

    def counted(hit: HostHit) -> torch.Tensor:
        submitted = hit.service.controller.stats.ops_submitted
        before = submitted["host_to_device"]
        out = run_device(hit)
        loads.append(hit.service.controller.stats.ops_submitted["host_to_device"] - before)
        return out

    monkeypatch.setattr(HostHit, "run_device", counted)
    (row,) = run_e2e(tiny_options(cached_tokens=(32,)))
    assert loads and set(loads) == {0} and row.device_hit_ms > 0


def test_a_device_hit_without_the_prefix_on_the_device_fails_the_run(
        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(HostHit, "make_resident", HostHit.reset)  # the prefix stays on the host
    with pytest.raises(BenchmarkError, match="the device hit found 0 of 32 cached tokens"):
        run_e2e(tiny_options(cached_tokens=(32,)))


def test_a_prefix_left_on_the_device_is_not_taken_for_a_host_hit(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """Backed up but not evicted (the eviction does nothing here): the prefix is a device
    hit, and the run stops rather than time it as a host hit."""
    from hicache.service import HiCacheService

    monkeypatch.setattr(HiCacheService, "evict", lambda self, num_tokens: 0)
    with pytest.raises(BenchmarkError, match="the 32-token prefix is not a host-only hit after "
                                             "backup and eviction: 32 device and 0 host"):
        run_e2e(tiny_options(cached_tokens=(32,)))


def test_a_prefix_gone_from_both_tiers_is_not_taken_for_a_host_hit(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """Evicted from the host too (the eviction takes both tiers here): no hit at all, and
    the run stops."""
    from hicache.service import HiCacheService

    evict = HiCacheService.evict

    def evict_both(self: HiCacheService, num_tokens: int) -> int:
        evicted = evict(self, num_tokens)
        self.evict_host(num_tokens)
        return evicted

    monkeypatch.setattr(HiCacheService, "evict", evict_both)
    with pytest.raises(BenchmarkError, match="backup and eviction: 0 device and 0 host"):
        run_e2e(tiny_options(cached_tokens=(32,)))


def test_a_refused_load_back_fails_the_run(monkeypatch: pytest.MonkeyPatch) -> None:
    """A host hit whose load-back is refused (no device quota here) is not timed as one."""
    from hicache.service import HiCacheService

    load_back, run = HiCacheService.load_back, HostHit.run
    in_host_hit = [False]  # the device hit's own load-back (make_resident) is left alone

    def refused_run(self: HostHit) -> torch.Tensor:
        in_host_hit[0] = True
        try:
            return run(self)
        finally:
            in_host_hit[0] = False

    monkeypatch.setattr(HostHit, "run", refused_run)
    monkeypatch.setattr(HiCacheService, "load_back", lambda self, match, quota: load_back(
        self, match, 0 if in_host_hit[0] else quota))
    with pytest.raises(BenchmarkError, match="the host hit of 32 tokens was not loaded "
                                             r"\(refused: "):
        run_e2e(tiny_options(cached_tokens=(32,)))


def test_pool_kv_reads_a_run_of_slots_as_a_view_and_gathers_other_slots() -> None:
    spec = TINY
    config = service_config(spec, torch.device("cpu"), 64, 16, "torch", "layer_first")
    with build_service(config) as service:
        pool = device_pool(service)
        pool.data.copy_(torch.randn(pool.data.shape, generator=torch.Generator().manual_seed(0)))
        rows = torch.randn(16, spec.num_kv_heads, spec.head_dim).to(pool.geometry.dtype)
        run = PoolKV(pool, torch.arange(16, 48), torch.arange(48, 64))
        assert run.span == (16, 64) and run.gather is None
        keys, _ = run.extend(0, rows, rows)
        assert keys.data_ptr() == pool.key_buffer(0)[16:64].data_ptr()  # a view, no copy
        order = torch.cat([torch.arange(32, 48), torch.arange(16, 32)])  # not one run
        split = PoolKV(pool, order, torch.arange(48, 64))
        assert split.span is None and split.gather is not None
        keys, values = split.extend(1, rows, rows)
        every = torch.cat([order, torch.arange(48, 64)])
        assert torch.equal(keys, pool.key_buffer(1).index_select(0, every))
        assert torch.equal(values[-16:], rows) and split.gathered == 1


def test_page_first_direct_host_layout_loads_the_same_rows() -> None:
    """The other host layout (pages of 16 side by side) gives the same output."""
    rows = run_e2e(tiny_options(cached_tokens=(48,), new_tokens=1, layout="page_first_direct"))
    assert rows[0].outputs_equal and rows[0].recompute_rel_diff < 1e-5


@pytest.mark.parametrize("layout", ["layer_first", "page_first", "page_first_direct"])
def test_bare_copy_reads_the_prefix_bytes_in_the_host_pool(layout: str) -> None:
    """The bare pipeline's pieces are views of the host pool's buffer holding exactly the
    prefix's K and V rows (each layer's own on layer_first, the prefix's pages cut in equal
    pieces elsewhere), so bare and host hit read the same memory."""
    options = tiny_options(cached_tokens=(48,), layout=layout)
    config = service_config(options.spec, options.device, options.capacity_tokens,
                            options.page_size, options.backend, layout)
    model = Decoder(options.spec, options.device, options.seed)
    buffers = Buffers(options.spec, options.device, 48, options.new_tokens)
    with build_service(config) as service:
        tokens = list(range(100, 148))
        x = torch.randn(48, options.spec.hidden)
        put_prefix(service, model, buffers, tokens, x)
        sources = pool_sources(service, tokens, options.spec.num_layers)
        pool = service.controller.host_pool.data
        low, high = pool.data_ptr(), pool.data_ptr() + pool.numel() * pool.element_size()
        layers = options.spec.num_layers
        assert len(sources) == layers
        for piece in (p for pieces in sources for p in pieces):
            assert low <= piece.data_ptr() < high and piece.numel() == 48 * options.spec.kv_size
        got = torch.cat([p for pieces in sources for p in pieces])
        rows = buffers.host[:, :, :48].reshape(layers * 2 * 48, -1)  # [layer, K/V, token]
        if layout == "layer_first":  # each layer's K, then V rows, in token order
            assert torch.equal(got, rows.reshape(-1))
        else:  # the same rows, in the pool's order
            pool_rows = got.view(-1, options.spec.kv_size)
            assert sorted(map(tuple, pool_rows.tolist())) == sorted(map(tuple, rows.tolist()))
        service.evict_host(48)  # the prefix's slots are gone: nothing to read in place
        with pytest.raises(BenchmarkError, match="48-token prefix has 0 host slots"):
            pool_sources(service, tokens, layers)


def test_wrong_loaded_rows_fail_the_run(monkeypatch: pytest.MonkeyPatch) -> None:
    """A host copy changed after the backup makes the run fail naming the prefix."""
    real = measure.put_prefix

    def put_then_corrupt(service: Any, *args: Any) -> None:
        real(service, *args)
        service.controller.host_pool.data.add_(1.0)  # every host row, the prefix's too

    monkeypatch.setattr(measure, "put_prefix", put_then_corrupt)
    with pytest.raises(BenchmarkError, match="32 cached tokens: the rows loaded back differ"):
        run_e2e(tiny_options(cached_tokens=(32,)))


def test_command_prints_every_column_and_writes_json(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """`hicache bench e2e --device cpu --tiny`: exit 0, a table with every column, the
    rows and their speedups in the JSON file."""
    out = tmp_path / "e2e.json"
    argv = ["bench", "e2e", "--device", "cpu", "--tiny", "--tokens", "32", "--new-tokens", "3",
            "--repeats", "1", "--warmup", "0", "--json", str(out)]
    assert cli_main(argv) == 0
    printed = capsys.readouterr().out.splitlines()
    assert printed[0].startswith("hicache bench e2e: cpu, torch")
    assert printed[1].split() == " ".join(name for name, _ in COLUMNS).split()
    assert printed[3].split()[0] == "32" and "bitwise" in printed[3]
    saved = json.loads(out.read_text(encoding="utf-8"))
    assert saved["meta"]["new_tokens"] == 3 and saved["meta"]["layers"] == 2
    (row,) = saved["rows"]
    for key in ("recompute_ms", "copy_ms", "resident_ms", "bare_ms", "hit_ms", "device_hit_ms",
                "ideal_x", "hit_x", "of_ideal_pct", "over_bare_pct", "over_device_hit_pct",
                "anchor_x", "outputs_equal"):
        assert key in row
    assert row["over_device_hit_pct"] == pytest.approx(
        100 * (row["hit_ms"] / row["device_hit_ms"] - 1))
    assert row["ideal_x"] == pytest.approx(
        row["recompute_ms"] / max(row["copy_ms"], row["resident_ms"]))


def test_the_ceiling_copies_the_kv_bytes_of_the_prefix_alone() -> None:
    """The contiguous copy that sets the ceiling moves exactly the ``N`` cached tokens' K and
    V bytes of every layer, for an ``N`` below the buffers' longest (not the whole buffer),
    once per warm-up and repeat, and reports the best time."""
    options = tiny_options(cached_tokens=(32, 64), repeats=3, warmup=1)
    buffers = Buffers(options.spec, options.device, 64, options.new_tokens)
    bench = E2EBench(options, None, None, buffers)  # type: ignore[arg-type]
    moved: list[int] = []
    seconds = iter([0.004, 0.003, 0.001, 0.002])

    def timer(fn: Any) -> tuple[float, torch.Tensor]:
        out = fn()
        moved.append(out.numel() * out.element_size())
        return next(seconds), out

    bench.timer = timer  # type: ignore[assignment]
    assert bench.copy_ms(32) == pytest.approx(1.0)  # the best of the four, in ms
    assert moved == [32 * options.spec.kv_token_bytes] * 4


def test_an_output_is_checked_against_the_resident_forwards_within_one_percent() -> None:
    """Off by less than 1% of the resident output's largest value: accepted, the largest
    difference returned; by more: the run fails naming the prefix length and the path."""
    resident = torch.tensor([[1.0, -4.0], [2.0, 0.5]])
    assert check_output(64, "the host hit", resident, resident) == 0.0
    close = resident + torch.tensor([[0.0, 0.039], [0.0, 0.0]])
    assert check_output(64, "the host hit", close, resident) == pytest.approx(0.039)
    far = resident + torch.tensor([[0.0, 0.0], [0.041, 0.0]])
    with pytest.raises(BenchmarkError, match=r"64 cached tokens: the output of the bare copy "
                                             r"differs from the resident forward's by 0\.041 "
                                             r"\(largest value 4\)"):
        check_output(64, "the bare copy", far, resident)


@pytest.mark.skipif(torch.cuda.is_available(), reason="a machine without CUDA")
def test_a_gpu_run_without_cuda_names_the_cpu_path() -> None:
    with pytest.raises(BenchmarkError, match=r"no CUDA device; --device cpu --tiny runs the "
                                             r"small CPU path"):
        run_e2e(tiny_options(device="cuda"))


def test_a_rows_figures_and_its_line_in_the_table() -> None:
    """Every derived figure of a row (the README's 2k ``page_first_direct`` row of an H200
    run, with the prefill of the cached tokens alone taken as 50 ms) and the line the
    table prints for it, column by column; a prefix length the anchor lacks prints none."""
    row = E2ERow(cached_tokens=2048, new_tokens=16, recompute_prefix_ms=50.0,
                 recompute_ms=52.24, copy_ms=4.85, resident_ms=9.22, bare_ms=11.16,
                 hit_ms=11.20, device_hit_ms=10.11, outputs_equal=True, hit_max_diff=0.0,
                 recompute_rel_diff=0.023, gathered_layers=0)
    assert row.anchor_x == 8.8
    assert row.recompute_over_copy_x == pytest.approx(50.0 / 4.85)
    assert row.ideal_x == pytest.approx(52.24 / 9.22)  # the forward, not the copy, bounds it
    assert row.hit_x == pytest.approx(52.24 / 11.20)
    assert row.of_ideal_pct == pytest.approx(100 * 9.22 / 11.20)
    assert row.over_bare_pct == pytest.approx(100 * (11.20 / 11.16 - 1))
    assert row.over_device_hit_pct == pytest.approx(100 * (11.20 / 10.11 - 1))
    lines = render([row], "title").splitlines()
    assert lines[0] == "title" and lines[2] == "-" * len(lines[1])
    assert lines[3] == ("   2048      52.24     4.85      9.22    11.16    10.11    11.20"
                        "    8.8x     10.3x   5.67x    4.66x     82.3%    +0.4%      +10.8%"
                        "  bitwise       2.3e-02")
    assert [E2ERow(n, 16, 1, 1, 1, 1, 1, 1, 1, True, 0, 0, 0).anchor_x
            for n in (512, 8192, 32768, 1024)] == [8.2, 10.3, 12.1, None]
    slow_copy = E2ERow(512, 16, 8, 20, 10, 5, 11, 12, 6, False, 0.5, 0, 0)
    assert slow_copy.ideal_x == 2.0  # the copy bounds it: 20 / max(10, 5)
    assert "5.0e-01" in render([slow_copy], "t").splitlines()[3]  # not bitwise: the diff


@pytest.mark.parametrize(("argv", "fix"), [
    (["--device", "cpu", "--tiny", "--tokens", "40"], "use multiples of 16"),
    (["--device", "cpu"], "add --tiny"),
    (["--device", "tpu", "--tiny"], "expected cuda, cuda:N or cpu"),
])
def test_usage_errors_name_the_fix(argv: list[str], fix: str,
                                   capsys: pytest.CaptureFixture[str]) -> None:
    """Ragged prefix lengths, the 8B shapes on a CPU, an unknown device: exit 2, one line."""
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert err.startswith("hicache bench e2e: error: ") and fix in err
    assert err.count("\n") == 1


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("new_tokens", [1, 5])
def test_host_hit_on_the_gpu(new_tokens: int) -> None:
    """Tiny shapes in bf16 on the GPU through the auto backend: the host hit overlapped with
    the forward computes the resident forward's output, close to the recompute's.

    Under the sanitizer attention runs on PyTorch's math backend: its fused kernels (cuDNN
    and flash attention, not hicache's) report racecheck hazards and a memcheck write past
    a small buffer of their own at these shapes, which would hide what this test checks,
    hicache's load path."""
    options = tiny_options("cuda", torch.bfloat16, new_tokens, backend="auto",
                           cached_tokens=(64, 256), repeats=scaled(2, 1), warmup=scaled(1, 0))
    attention = (sdpa_kernel(SDPBackend.MATH) if under_sanitizer()
                 else contextlib.nullcontext())
    with attention:
        rows = run_e2e(options)
    for row in rows:
        assert row.outputs_equal, row
        assert row.recompute_rel_diff < 0.05, row
        assert row.gathered_layers == 0


def test_the_options_default_to_the_documented_run() -> None:
    """The issue's run: 32 layers of the 8B shapes, prefixes of 512 to 32k tokens, 16 new
    tokens, pages of 16, ``auto`` on ``layer_first``, medians of 10 after one warm-up run,
    seed 0; --tiny: two layers and prefixes of 64 and 256 tokens."""
    import argparse

    from hicache.bench.e2e.cli import add_arguments, options

    parser = argparse.ArgumentParser()
    add_arguments(parser)
    opts = options(parser.parse_args([]))
    assert (opts.spec.num_layers, opts.spec.hidden, opts.spec.mlp, opts.device.type) == (
        32, 4096, 14336, "cuda")
    assert (opts.cached_tokens, opts.new_tokens, opts.page_size, opts.backend, opts.layout,
            opts.repeats, opts.warmup, opts.seed) == (
        (512, 2048, 8192, 32768), 16, 16, "auto", "layer_first", 10, 1, 0)
    tiny = options(parser.parse_args(["--tiny", "--device", "cpu"]))
    assert (tiny.spec.num_layers, tiny.cached_tokens, tiny.device.type) == (2, (64, 256), "cpu")


@pytest.mark.parametrize(("argv", "named"), [
    (["--new-tokens", "0"], "--new-tokens"), (["--page-size", "0"], "--page-size"),
    (["--repeats", "0"], "--repeats"), (["--warmup", "-1"], "--warmup"),
    (["--layers", "0"], "--layers"), (["--tokens", "0"], "--tokens")])
def test_counts_below_their_minimum_are_refused(argv: list[str], named: str,
                                                capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as stop:
        main(["--device", "cpu", "--tiny", *argv])
    assert stop.value.code == 2 and named in capsys.readouterr().err


def test_the_smallest_counts_run_and_an_unwritable_json_stops_first(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """One new token, pages of one token, one repeat, no warm-up, one layer: a run. A --json
    in a missing directory: exit 2 before anything runs."""
    assert main(["--device", "cpu", "--tiny", "--tokens", "3", "--new-tokens", "1",
                 "--page-size", "1", "--repeats", "1", "--warmup", "0", "--layers", "1"]) == 0
    out = capsys.readouterr().out
    assert "1 layers" in out and "1 new tokens" in out and "pages of 1; medians of 1" in out
    assert main(["--device", "cpu", "--tiny", "--json", str(tmp_path / "no" / "e2e.json")]) == 2
    err = capsys.readouterr().err
    assert err.startswith("hicache bench e2e: error: --json") and err.count("\n") == 1


def test_rotary_positions_rotate_by_position_alone() -> None:
    """Position 0 leaves a row as it is; a rotation keeps each pair's norm; the product of a
    query at position m and a key at position n depends on m - n only (what makes the
    prefill of new tokens after a cached prefix the same as the recompute's)."""
    from hicache.bench.e2e.model import _apply_rope, _rope_tables

    spec = DecoderSpec(**{**TINY.__dict__, "dtype": torch.float32, "rope": True})
    gen = torch.Generator().manual_seed(3)
    q = torch.randn(1, 1, spec.head_dim, generator=gen)
    k = torch.randn(1, 1, spec.head_dim, generator=gen)

    def at(x: torch.Tensor, position: int) -> torch.Tensor:
        return _apply_rope(x, *_rope_tables(spec, position, 1, torch.device("cpu")))[0, 0]

    assert torch.allclose(at(q, 0), q[0, 0])
    half = spec.head_dim // 2
    rotated = at(q, 7)
    assert torch.allclose(rotated[:half] ** 2 + rotated[half:] ** 2,
                          q[0, 0, :half] ** 2 + q[0, 0, half:] ** 2, atol=1e-5)
    assert not torch.allclose(rotated, q[0, 0])
    products = [float(at(q, m) @ at(k, n)) for m, n in ((5, 2), (13, 10), (103, 100))]
    assert products == pytest.approx([products[0]] * 3, rel=1e-4)
    cos, _ = _rope_tables(spec, 4, 3, torch.device("cpu"))
    assert cos.shape == (3, 1, half)
    assert torch.allclose(cos[1:2], _rope_tables(spec, 5, 1, torch.device("cpu"))[0])


def test_a_host_hit_with_rotary_positions_equals_resident_and_recompute() -> None:
    """With --rope the new tokens' positions start after the cached prefix: the host hit's
    output is the resident forward's, and within 1% of the recompute's last rows."""
    spec = DecoderSpec(**{**TINY.__dict__, "dtype": torch.float32, "rope": True})
    (row,) = run_e2e(tiny_options(cached_tokens=(32,), spec=spec))
    assert row.outputs_equal and row.hit_max_diff == 0.0 and row.recompute_rel_diff < 1e-5


def test_the_decoder_sizes_its_kv_and_weights() -> None:
    """A token's K and V over every layer (what a load moves), and the weights' bytes."""
    assert DecoderSpec().kv_token_bytes == 2 * 32 * 8 * 128 * 2  # 128 KiB a token, bf16
    assert TINY.kv_token_bytes == 2 * 2 * 2 * 64 * 2
    float32 = DecoderSpec(**{**TINY.__dict__, "dtype": torch.float32})
    assert float32.kv_token_bytes == 2 * TINY.kv_token_bytes
    per_layer = (256 + 2 * 128) * 256 + 256 * 256 + 2 * 512 * 256 + 256 * 512
    assert Decoder(TINY, torch.device("cpu")).size_bytes == 2 * per_layer * 2
