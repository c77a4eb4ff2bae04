"""The page copy kernel's refusals that need no GPU: CPU views and indices are declined
(the staged backend then keeps torch's copies, which the CPU tests run), and the libraries
torch mapped are found by name."""

from __future__ import annotations

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
