"""Slot tensors of the hybrid controller aligned token by token (0 = no slot): parts joined
in one index space, and a part placed at its tokens with 0 elsewhere."""

from __future__ import annotations

import numpy as np
import torch

from hicache.pools import IndexSpace, Indices
from hicache.pools.arg_checks import check_int


def empty_indices(space: IndexSpace) -> Indices:
    """No slots of ``space`` (an empty int64 CPU tensor)."""
    return Indices(torch.empty(0, dtype=torch.int64), space)


def cat_space(parts: list[Indices], space: IndexSpace) -> Indices:
    """``parts`` one after the other as int64 indices of ``space`` (a part alone when the
    others are empty: no copy made for it)."""
    found = [p.tensor for p in parts if p.tensor.numel()]
    if len(found) == 1 and found[0].dtype == torch.int64:
        return Indices(found[0], space)
    if not found:
        return Indices(torch.empty(0, dtype=torch.int64), space)
    return Indices(torch.cat([t.to(torch.int64) for t in found]), space)


def in_tail(part: Indices, num_tokens: int, start: int, space: IndexSpace) -> Indices:
    """``[num_tokens]`` int64 CPU indices: ``part`` from ``start`` on, 0 before."""
    aligned = np.zeros(num_tokens, dtype=np.int64)
    aligned[start:] = part.tensor.numpy()
    return Indices(torch.from_numpy(aligned), space)


def scatter_aligned(part: Indices, mask: torch.Tensor, space: IndexSpace) -> Indices:
    """``[len(mask)]`` int64 CPU indices: ``part`` where ``mask``, 0 elsewhere (numpy: a
    masked store there costs a quarter of torch's at a request's size)."""
    aligned = np.zeros(mask.numel(), dtype=np.int64)
    aligned[mask.numpy()] = part.tensor.numpy()
    return Indices(torch.from_numpy(aligned), space)


def tail_start(num_tokens: int, swa_tail_tokens: int, page_size: int) -> int:
    """First token of a load's window tail of ``swa_tail_tokens`` tokens rounded up to whole
    pages, capped at ``num_tokens``.

    Raises:
        TypeError: ``swa_tail_tokens`` is not an int (a NaN would mean "every token").
        ValueError: it is negative.
    """
    if type(swa_tail_tokens) is not int:
        swa_tail_tokens = check_int(swa_tail_tokens, "swa_tail_tokens", "load")
    if swa_tail_tokens < 0:
        raise ValueError(f"load: swa_tail_tokens must be >= 0, got {swa_tail_tokens}")
    return num_tokens - min(num_tokens, -(-swa_tail_tokens // page_size) * page_size)


def checked_skip(swa_skip: torch.Tensor, mapped: torch.Tensor, page: int) -> torch.Tensor:
    """A write's ``swa_skip`` checked against its tokens' ``mapped`` mask (tokens with an SWA
    slot; whole pages in order of ``page`` tokens): a bool tensor of that shape that skips
    whole SWA pages, since a host SWA page holds the rows of one device page. Raises
    ``ValueError`` naming the first page it splits."""
    if swa_skip.dtype != torch.bool or swa_skip.shape != mapped.shape:
        raise ValueError(f"write: swa_skip must be a bool tensor of shape "
                         f"{tuple(mapped.shape)}, got {swa_skip.dtype} {tuple(swa_skip.shape)}")
    left = (mapped & ~swa_skip).view(-1, page)
    split = torch.nonzero(left.any(1) & ~left.all(1))
    if split.numel():
        at = int(split[0, 0]) * page
        raise ValueError(f"write: swa_skip skips part of the SWA page of tokens "
                         f"{at}..{at + page - 1}; skip whole SWA pages")
    return swa_skip
