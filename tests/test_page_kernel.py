"""The page copy kernel's refusals that need no GPU: CPU views and indices are declined
(the staged backend then keeps torch's copies, which the CPU tests run), and the libraries
torch mapped are found by name; without NVRTC there is no kernel, and the log says why."""

from __future__ import annotations

import logging

import pytest
import torch

from hicache.controller import cuda_libraries, page_kernel


def test_cpu_views_and_indices_are_declined() -> None:
    staged = torch.zeros(2, 3, 4, 16, 8, dtype=torch.int64)
    paged = torch.zeros(2, 3, 10, 16, 8, dtype=torch.int64)
    assert page_kernel.page_launches([staged], [paged], scatter=True) is None
    assert page_kernel.page_launches([staged], [paged], scatter=False) is None
    assert not page_kernel.index_fits(torch.arange(4))


def test_mapped_libraries_are_found_by_prefix() -> None:
    found = cuda_libraries.mapped_libraries("libtorch")  # torch is imported: libtorch is mapped
    assert found and all("libtorch" in path for path in found)
    assert cuda_libraries.mapped_libraries("libno_such_library_") == []


def test_without_nvrtc_there_is_no_kernel_and_it_says_so(monkeypatch: pytest.MonkeyPatch,
                                                         caplog: pytest.LogCaptureFixture
                                                         ) -> None:
    """No NVRTC library: the kernel is declined (torch's copies then), logged once with the
    reason; nothing raises."""
    def missing() -> None:
        raise OSError("no NVRTC library (libnvrtc) found")

    monkeypatch.setattr(page_kernel, "_nvrtc", missing)
    with caplog.at_level(logging.INFO, logger=page_kernel.__name__):
        assert page_kernel._kernel.__wrapped__((9, 0)) is None
    assert "no NVRTC library" in caplog.text and "indexed copies" in caplog.text
