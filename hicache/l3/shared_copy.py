"""Tensor-parallel ranks that keep one copy of each page in the store: which rank writes it.

The ranks of an MLA model hold the same latent rows, so they name their pages alike and
read one copy. Were every rank to write every page, as a service of its own does, the
store would take the same bytes under the same name once per rank. Instead each page is
written by one rank, picked by its hash (:meth:`WriteShare.written`, so a node's pages spread
over the ranks), and the others leave it out of their put. The ranks agree on a put's
result as on any other (:mod:`hicache.l3.held_jobs`): each rank reports its own share, and
a node is stored once every rank's share of its pages is.

That holds only when the ranks see one store. Ranks on two machines, each with a file store
on a local disk, give their stores the same name but not the same files: there every rank
must write every page itself. :func:`probe_shared_store` finds out at build, on every rank
at once: rank 0 puts a probe page under a fresh random hash, every other rank asks its
store whether that page is there, and the writes are shared only if every rank saw it. A
probe that fails (a store down at build, an error) leaves every rank writing every page.
"""

from __future__ import annotations

import logging
import os
from typing import TYPE_CHECKING, NamedTuple

import numpy as np

from hicache.storage import PAGE_HASH_BYTES, StorageBackend, StorageResult

if TYPE_CHECKING:
    from hicache.rank_agreement import RankAgreement

logger = logging.getLogger(__name__)

_WORDS = PAGE_HASH_BYTES // 8  # the probe's hash, as int64 words of a collective


class WriteShare(NamedTuple):
    """The pages rank ``rank`` of ``size`` writes to a store the ranks share."""

    rank: int
    size: int

    def written(self, page_hashes: list[bytes]) -> np.ndarray:
        """Whether this rank writes each page of ``page_hashes`` (32 bytes each; exactly one
        rank writes a page): a bool per page, the first 8 bytes of its hash, little-endian,
        modulo the ranks, equal to this rank."""
        words = np.frombuffer(b"".join(page_hashes), dtype="<u8")[::PAGE_HASH_BYTES // 8]
        return words % self.size == self.rank  # type: ignore[no-any-return]


def probe_shared_store(store: StorageBackend, agreement: RankAgreement) -> WriteShare | None:
    """This rank's :class:`WriteShare` if every rank of ``agreement``'s group sees the page
    rank 0 writes to ``store``, else ``None`` (every rank writes every page). Every rank calls
    it at the same point (two collectives); the probe page is removed before it returns."""
    mine: list[int] = [0] * (_WORDS + 1)
    if agreement.rank == 0:
        probe = os.urandom(PAGE_HASH_BYTES)
        mine = [*np.frombuffer(probe, dtype=np.int64).tolist(), int(_put(store, probe))]
    rank0 = agreement.gather(mine)[0]
    probe, written = np.array(rank0[:_WORDS], dtype=np.int64).tobytes(), bool(rank0[_WORDS])
    seen = written and (agreement.rank == 0 or _seen(store, probe))
    shared = all(row[0] for row in agreement.gather([int(seen)]))
    if agreement.rank == 0 and written:
        _call(store, "delete", probe)
    if not shared:
        logger.info("shared store: not every one of the %d ranks sees rank 0's probe page "
                    "(stores of their own, or one that failed): each rank writes every page",
                    agreement.size)
        return None
    logger.info("shared store: the %d ranks see one store; each writes the pages whose hash "
                "falls to it", agreement.size)
    return WriteShare(agreement.rank, agreement.size)


def _put(store: StorageBackend, probe: bytes) -> bool:
    page = [bytearray(size) for size in store.namespace.segment_bytes]
    result = _call(store, "put", probe, [page])
    return result is not None and result.num_leading_ok == 1


def _seen(store: StorageBackend, probe: bytes) -> bool:
    result = _call(store, "exists", probe)
    return result is not None and result.num_leading_ok == 1


def _call(store: StorageBackend, op: str, probe: bytes, *pages: object
          ) -> StorageResult | None:
    """``store.<op>([probe], ...)``; ``None`` (logged) if it raised."""
    try:
        result: StorageResult = getattr(store, op)([probe], *pages)
        return result
    except Exception as exc:  # the probe decides nothing but sharing: never fail the build
        logger.warning("shared store: the probe page's %s raised %s: %s", op,
                       type(exc).__name__, exc)
        return None
