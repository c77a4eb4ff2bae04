"""Low-level helpers of the file store: its directory, O_DIRECT alignment, whole writes, its
I/O threads."""

from __future__ import annotations

import mmap
import os
import threading
from collections.abc import Iterator, Sequence
from pathlib import Path

import numpy as np

DIRECT_ALIGN = 4096


def make_directory(root: Path, namespace_hex: str) -> Path:
    """``root/namespace_hex``, made if missing; ``ValueError`` naming the path if it cannot
    be a writable directory."""
    if root.exists() and not root.is_dir():
        raise ValueError(f"file store root {str(root)!r} exists and is not a directory; "
                         "give a directory path")
    directory = root / namespace_hex
    try:
        directory.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise ValueError(f"file store root {str(root)!r} cannot be created ({exc.strerror}); "
                         "give a writable directory") from None
    if not os.access(directory, os.W_OK | os.X_OK):
        raise ValueError(f"file store directory {str(directory)!r} is not writable")
    return directory


def aligned(segments: Sequence[memoryview]) -> bool:
    """True if every segment's address and length are multiples of ``DIRECT_ALIGN``."""
    return all(s.nbytes % DIRECT_ALIGN == 0
               and np.frombuffer(s, dtype=np.uint8).ctypes.data % DIRECT_ALIGN == 0
               for s in segments)


def write_all(fd: int, buffers: list[memoryview]) -> None:
    """``pwritev`` until every byte is written (a short write happens on a full disk)."""
    offset, pending = 0, buffers
    while pending:
        written = os.pwritev(fd, pending, offset)
        if written == 0:
            raise OSError("no progress writing a page file (disk full?)")
        offset += written
        while pending and written >= pending[0].nbytes:
            written -= pending[0].nbytes
            pending = pending[1:]
        if pending and written:
            pending = [pending[0][written:], *pending[1:]]


def default_io_threads() -> int:
    """Half the CPUs this process may run on, at least 1 and at most 4. More I/O threads than
    that take cores from the engine's own threads: on 2 CPUs, 4 threads putting and getting
    pages held a scheduler thread's turn (a 0.5 ms wait, then 0.1 ms of Python) at 5-8 ms
    at its 99th percentile where 1 thread held it at 0.7-1.3 ms, and put at half the speed
    of 1 thread (``hicache bench storage``'s turn rows; docs/performance-log.md)."""
    cpus = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else \
        os.cpu_count() or 1
    return max(1, min(4, cpus // 2))


def create_tmp(directory: str, stem: str, ids: Iterator[int]) -> tuple[int, str]:
    """A new temporary file ``directory/.stem.<next id>.tmp``, open for writing and made by
    this call (``stem`` names the page and the writing store: other stores, of this process
    or of a host with the same pid, write the same page under their own names). The
    directory, or the whole store directory if it was removed (a cache cleaned by hand), is
    made again if needed."""
    while True:
        tmp = f"{directory}/.{stem}.{next(ids)}.tmp"
        try:
            return os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644), tmp
        except FileExistsError:
            continue  # someone else's: never ours to remove
        except FileNotFoundError:
            os.makedirs(directory, exist_ok=True)


def header_buffer(local: threading.local, header_len: int) -> memoryview:
    """The calling thread's 4 KiB aligned buffer of ``header_len`` bytes for a page's
    header, kept in ``local`` (O_DIRECT reads need aligned memory)."""
    buffer = getattr(local, "header", None)
    if buffer is None:
        size = -(-header_len // mmap.PAGESIZE) * mmap.PAGESIZE
        buffer = memoryview(mmap.mmap(-1, size))[:header_len]
        local.header = buffer
    return buffer
