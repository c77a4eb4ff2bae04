"""The upload kernel (:mod:`hicache.pools.upload_kernel`) on a CPU: its body in Triton's
interpreter moves every value at lengths around a block, and uploads of at most
``INLINE_BYTES`` (or with no kernel to run) are left to the plain copy. The GPU side (the
kernel reading pinned memory, and an upload not queued behind a load's copies) is in
``test_pinned_uploads_gpu.py``."""

from __future__ import annotations

import functools
import importlib.util

import pytest
import torch

from hicache.pools import upload_kernel
from hicache.pools.triton_jit import jit_or_none
from hicache.pools.upload_kernel import BLOCK, INLINE_BYTES, upload_through_sms

CPU = torch.device("cpu")
needs_triton = pytest.mark.skipif(importlib.util.find_spec("triton") is None,
                                  reason="needs triton")


@needs_triton
@pytest.mark.parametrize("count", [INLINE_BYTES // 8 + 1, BLOCK * 3, BLOCK * 3 + 1, 70_001])
def test_the_kernel_moves_every_value(count: int, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    # a kernel wrapped for the interpreter, for this test only: in a process that already
    # launched the compiled one (GPU tests first), the module's cached kernel is compiled
    monkeypatch.setattr(upload_kernel, "_compiled",
                        functools.cache(lambda: jit_or_none(upload_kernel._upload_kernel)))
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


def test_a_kernel_that_fails_once_leaves_every_upload_to_the_copy(
        monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture) -> None:
    """A Triton that cannot compile here raises at the first launch: the upload returns
    ``None`` (the caller copies), says why once, and no later upload tries the kernel."""
    launches: list[int] = []

    class Broken:
        def __getitem__(self, grid: object) -> object:
            def launch(*args: object, **kwargs: object) -> None:
                launches.append(1)
                raise RuntimeError("no compiler for this device")
            return launch

    monkeypatch.setenv("TRITON_INTERPRET", "1")
    monkeypatch.setattr(upload_kernel, "_compiled", lambda: Broken())
    monkeypatch.setattr(upload_kernel, "_failed", [])
    source = torch.arange(INLINE_BYTES)
    with caplog.at_level("WARNING", logger="hicache.pools.upload_kernel"):
        assert upload_through_sms(source, CPU) is None
        assert upload_through_sms(source, CPU) is None
    assert launches == [1]
    assert "no compiler for this device" in caplog.text
