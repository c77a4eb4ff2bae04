"""Copy turns on a CPU: which copies wait for the one before, and how a big block's copies are cut
into batches (the streams themselves are tested on a GPU in ``test_copy_turns_gpu.py``)."""

from __future__ import annotations

import random

import pytest
import torch

from hicache.controller import copy2d, copy_turns
from hicache.controller.copy2d import Copy2D
from hicache.controller.copy_turns import TURN_BYTES, copy_batches, takes_turns


def test_only_a_big_copy_makes_the_next_wait() -> None:
    assert not takes_turns(0)
    assert not takes_turns(TURN_BYTES - 1)
    assert takes_turns(TURN_BYTES)
    assert takes_turns(4 << 30)


def _random_copies(rng: random.Random, piece: int) -> list[Copy2D]:
    """2D copies of rows a pitch apart, each row at its own place on both sides."""
    copies, host, device = [], 0, 0
    for _ in range(rng.randint(1, 6)):
        width = rng.choice([1, 7, piece // 3, piece, 2 * piece + 5])
        height = rng.randint(1, 9)
        host_pitch, device_pitch = width + rng.randint(0, 5), width + rng.randint(0, 3)
        copies.append((host, host_pitch, device, device_pitch, width, height))
        host += host_pitch * height + 3
        device += device_pitch * height + 1
    return copies


@pytest.mark.parametrize("seed", range(40))
def test_batches_move_the_same_bytes_in_bounded_turns(seed: int,
                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    """Batches of random copies (their rows cut where a copy is bigger than a batch) move
    the bytes the copies move, and each batch but the last is just at or over the size."""
    piece = 64
    monkeypatch.setattr(copy_turns, "PIECE_BYTES", piece)
    rng = random.Random(seed)
    copies = _random_copies(rng, piece)
    host = torch.randint(0, 256, (8192,), dtype=torch.uint8)
    expected = torch.zeros(8192, dtype=torch.uint8)
    found = torch.zeros(8192, dtype=torch.uint8)
    copy2d.emulate_copies(copies, host, 0, expected, to_host=False)
    batches = copy_batches(copies)
    for batch, size in batches:
        assert size == sum(width * height for *_, width, height in batch)
        copy2d.emulate_copies(batch, host, 0, found, to_host=False)
    assert torch.equal(found, expected)
    assert sum(size for _, size in batches) == sum(w * h for *_, w, h in copies)
    for batch, size in batches[:-1]:
        biggest = max(width * height for *_, width, height in batch)
        assert piece <= size < piece + biggest
    # a copy is cut only where it holds more than a batch, into parts of at most a batch
    # (or one row)
    for batch, _ in batches:
        for copy in batch:
            width, height = copy[4], copy[5]
            assert copy in copies or height == 1 or width * height <= piece


def test_a_32k_token_run_goes_a_layer_a_batch_and_small_runs_share_one() -> None:
    layer = 32768 * 2048  # one component's rows of one layer: 64 MiB
    big = [(0, layer, 0, layer, layer, 32)]
    batches = copy_batches(big)
    assert [size for _, size in batches] == [layer] * 32
    assert [copy[0] for batch, _ in batches for copy in batch] == [i * layer for i in range(32)]
    small = [(i * 4096, 4096, i * 4096, 4096, 4096, 32) for i in range(8)]  # 8 x 128 KiB
    assert copy_batches(small) == [(small, 8 * 4096 * 32)]


def test_copies_of_no_rows_make_no_batch() -> None:
    """A copy of zero rows (or of zero-width rows) moves nothing and issues nothing."""
    assert copy_batches([]) == []
    assert copy_batches([(0, 8, 0, 8, 0, 0), (0, 8, 0, 8, 8, 0), (0, 8, 0, 8, 0, 3)]) == [
        ([(0, 8, 0, 8, 0, 3)], 0)]
