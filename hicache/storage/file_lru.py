"""Byte-capped LRU bookkeeping of the file store's page files (plain Python, no I/O).

Names are page file names; sizes are bytes on disk. A name being written, or found written by
a ``put``, is *pinned* from :meth:`reserve` (:meth:`pin_existing`) until :meth:`release`, so
a ``put`` never evicts a page it wrote or reported stored earlier in the same call (its
prefix would become unreadable while the call reports it stored). The store unlinks the
victims these return. One process's view: files written or deleted by another process on a
shared directory join or leave the index at the store's next scan (:meth:`sync`).
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Iterable


class FileLRU:
    """LRU order and byte count of the files of one namespace directory.

    Args:
        capacity_bytes: cap on the bytes indexed; ``None`` for no cap.
    """

    def __init__(self, capacity_bytes: int | None) -> None:
        if capacity_bytes is not None and capacity_bytes < 1:
            raise ValueError(f"capacity_bytes must be >= 1 or None, got {capacity_bytes}")
        self.capacity_bytes = capacity_bytes
        self._sizes: OrderedDict[str, int] = OrderedDict()
        self._pinned: dict[str, list[int]] = {}  # name -> [size, calls writing it]
        self._pinned_bytes = 0
        self._used = 0
        self._lock = threading.Lock()

    @property
    def used_bytes(self) -> int:
        return self._used

    def __len__(self) -> int:
        return len(self._sizes)

    def __contains__(self, name: str) -> bool:
        return name in self._sizes or name in self._pinned

    def load(self, entries: Iterable[tuple[str, int]]) -> list[tuple[str, int]]:
        """Seed from a directory scan, oldest first; returns what exceeds the cap (to unlink).
        A name a call has pinned is already counted (its ``release`` indexes it)."""
        with self._lock:
            for name, size in entries:
                if name not in self._sizes and name not in self._pinned:
                    self._sizes[name] = size
                    self._used += size
            return self._evict_for(0)

    def sync(self, entries: Iterable[tuple[str, int]]) -> list[tuple[str, int]]:
        """Bring the index in line with a new scan of the directory (``entries`` oldest
        first): files no longer there are forgotten, files it did not know (other
        processes') join as the least recently used, in the scan's order; returns what
        exceeds the cap (to unlink). Pinned names are left as they are."""
        with self._lock:
            on_disk = dict(entries)
            sizes = self._sizes
            for name in [name for name in sizes if name not in on_disk]:
                self._used -= sizes.pop(name)
            new = [(name, size) for name, size in on_disk.items()
                   if name not in sizes and name not in self._pinned]
            if new:
                self._sizes = OrderedDict(new)
                self._sizes.update(sizes)
                self._used += sum(size for _, size in new)
            return self._evict_for(0)

    def pin_existing(self, name: str, size: int) -> list[tuple[str, int]]:
        """Pin a file a call found already written (as :meth:`reserve` pins one it writes),
        so that call's later pages cannot evict it; returns victims to unlink (room made
        for it when the index did not know it). :meth:`release` unpins it."""
        with self._lock:
            entry = self._pinned.get(name)
            if entry is not None:
                entry[1] += 1
                return []
            known = self._sizes.pop(name, None)
            victims = [] if known is not None else self._evict_for(size)
            if known is None:
                self._used += size
            self._pinned[name] = [known if known is not None else size, 1]
            self._pinned_bytes += self._pinned[name][0]
            return victims

    def touch(self, name: str, size: int) -> list[tuple[str, int]]:
        """Mark ``name`` as just used (adding it if unknown); returns victims to unlink."""
        with self._lock:
            if name in self._pinned:
                return []
            if name in self._sizes:
                self._sizes.move_to_end(name)
                return []
            victims = self._evict_for(size)
            self._sizes[name] = size
            self._used += size
            return victims

    def reserve(self, name: str, size: int) -> list[tuple[str, int]] | None:
        """Make room for a new file and pin it; ``None`` when even evicting every unpinned
        file would not make room (the page is then not written). Returns victims to unlink."""
        with self._lock:
            if name in self._pinned:  # another call writes the same page right now
                self._pinned[name][1] += 1
                return []
            old = self._sizes.pop(name, None)  # a file another writer published meanwhile
            self._used -= old or 0
            cap = self.capacity_bytes
            if cap is not None and size > cap - self._pinned_bytes:
                return None
            victims = self._evict_for(size)
            self._pinned[name] = [size, 1]
            self._pinned_bytes += size
            self._used += size
            return victims

    def release(self, names: Iterable[str]) -> None:
        """Unpin files reserved by one call (the store calls :meth:`remove` first for those it
        failed to write). A released file becomes the most recently used."""
        with self._lock:
            for name in names:
                entry = self._pinned.get(name)
                if entry is None:
                    continue
                entry[1] -= 1
                if entry[1] == 0:
                    del self._pinned[name]
                    self._pinned_bytes -= entry[0]
                    self._sizes[name] = entry[0]

    def remove(self, name: str) -> bool:
        """Forget ``name`` (deleted, failed or corrupt); True if it was indexed."""
        with self._lock:
            size = self._sizes.pop(name, None)
            if size is None:
                entry = self._pinned.pop(name, None)
                if entry is None:
                    return False
                size = entry[0]
                self._pinned_bytes -= size
            self._used -= size
            return True

    def clear(self) -> None:
        with self._lock:
            self._sizes.clear()
            self._used = self._pinned_bytes

    def _evict_for(self, size: int) -> list[tuple[str, int]]:
        """Pop least recently used unpinned files until ``size`` more bytes fit."""
        victims: list[tuple[str, int]] = []
        if self.capacity_bytes is None:
            return victims
        while self._used + size > self.capacity_bytes and self._sizes:
            name, victim_size = self._sizes.popitem(last=False)
            self._used -= victim_size
            victims.append((name, victim_size))
        return victims
