"""What a file store's namespace directory holds, read from the disk: its page files (for
the size cap's index) and the temporary files of writers that died mid-page.

Every process on a shared directory keeps its own index of the pages (:mod:`.file_lru`).
Files the others write or delete reach that index only through a scan, so a store with a
cap scans at its first call and again while it writes (:class:`Rescans`): each process
then counts the others' pages against the cap and evicts the oldest of them too, and the
directory stays near its cap however many processes share it (each may run over it by what
the others wrote since its last scan).
"""

from __future__ import annotations

import logging
import os
import time

logger = logging.getLogger(__name__)

# A temporary file this much older than the writers' deadline belongs to a writer that died
# mid-page (a live one finishes or gives up within its deadline).
STALE_TMP_DEADLINES = 10
STALE_TMP_MIN_S = 600.0


def scan_directory(directory: str, suffix: str, stale_tmp_s: float) -> list[tuple[str, int]]:
    """``(name, size)`` of every page file (``<directory>/<xx>/<name><suffix>``), oldest
    modification first, in one pass that also unlinks the temporary files
    (``.<page>....tmp``) not modified for ``stale_tmp_s``: what writers killed mid-page left
    (a live writer finishes or gives up within its deadline). Files that vanish while it
    looks are left out."""
    entries: list[tuple[float, str, int]] = []
    now, removed = time.time(), 0
    for sub in _subdirectories(directory):
        try:
            found = os.scandir(sub)
        except FileNotFoundError:
            continue  # removed since it was listed (a directory cleaned by hand, a clear())
        with found:
            for entry in found:
                name = entry.name
                try:
                    if name.startswith("."):
                        if name.endswith(".tmp") and now - entry.stat().st_mtime >= stale_tmp_s:
                            os.unlink(entry.path)
                            removed += 1
                    elif name.endswith(suffix):
                        stat = entry.stat()
                        entries.append((stat.st_mtime, name, stat.st_size))
                except FileNotFoundError:
                    continue  # published, evicted or removed meanwhile
                except OSError as exc:  # a read-only directory: left for a later scan
                    logger.debug("file store %s: cannot remove %s: %s", directory, name, exc)
    if removed:
        logger.info("file store %s: removed %d temporary files of writers that died", directory,
                    removed)
    entries.sort()
    return [(name, size) for _, name, size in entries]


def stale_tmp_age_s(timeout_s: float) -> float:
    """How old a temporary file of writers with deadlines of ``timeout_s`` must be to be a
    dead writer's."""
    return max(STALE_TMP_MIN_S, STALE_TMP_DEADLINES * timeout_s)


class Rescans:
    """When a store with a cap scans its directory again: once ``interval_s`` passed since
    the last scan and at least ``cost_ratio`` times as long as the last scan took (a
    directory of many pages is scanned less often: the scans cost at most about
    ``1 / cost_ratio`` of the writing threads' time). ``interval_s`` 0: before every
    ``put`` (a directory of a few pages, tests)."""

    def __init__(self, interval_s: float = 10.0, cost_ratio: float = 20.0) -> None:
        if not interval_s >= 0:
            raise ValueError(f"rescan_interval_s must be >= 0, got {interval_s}")
        self.interval_s, self.cost_ratio = interval_s, cost_ratio
        self._next = 0.0

    def due(self) -> bool:
        return not self.interval_s or time.monotonic() >= self._next

    def scanned(self, started: float) -> None:
        """A scan that began at ``started`` (``time.monotonic()``) just ended."""
        now = time.monotonic()
        self._next = now + max(self.interval_s, self.cost_ratio * (now - started))


def _subdirectories(directory: str) -> list[str]:
    try:
        with os.scandir(directory) as found:
            return [entry.path for entry in found if entry.is_dir(follow_symlinks=False)]
    except FileNotFoundError:
        return []  # removed by hand: nothing there
