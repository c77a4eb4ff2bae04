"""The upload kernel (:mod:`hicache.pools.upload_kernel`) on a CPU: its body in Triton's
interpreter moves every value at lengths around a block, and uploads of at most
``INLINE_BYTES`` (or with no kernel to run) are left to the plain copy. The GPU side (the
kernel reading pinned memory, and an upload not queued behind a load's copies) is in
``test_pinned_uploads_gpu.py``."""

from __future__ import annotations

import importlib.util

import pytest
import torch

from hicache.pools.upload_kernel import BLOCK, INLINE_BYTES, upload_through_sms

CPU = torch.device("cpu")
needs_triton = pytest.mark.skipif(importlib.util.find_spec("triton") is None,
                                  reason="needs triton")


@needs_triton
@pytest.mark.parametrize("count", [INLINE_BYTES // 8 + 1, BLOCK * 3, BLOCK * 3 + 1, 70_001])
def test_the_kernel_moves_every_value(count: int, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    source = torch.arange(count, dtype=torch.int64) * 7 - (1 << 40)
    got = upload_through_sms(source, CPU)
    assert got is not None and got.dtype == torch.int64
    assert torch.equal(got, source)


def test_small_uploads_are_left_to_the_copy(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    assert upload_through_sms(torch.arange(INLINE_BYTES // 8), CPU) is None


def test_without_cuda_or_the_interpreter_the_copy_runs(monkeypatch: pytest.MonkeyPatch
                                                        ) -> None:
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    assert upload_through_sms(torch.arange(INLINE_BYTES), CPU) is None
