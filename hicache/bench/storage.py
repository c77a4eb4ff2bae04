"""What ``hicache bench storage`` measures: put/get/exists of whole pages through a store,
each beside the raw store doing the same work in the same run.

- Redis: redis-py + hiredis on one connection, plain ``SET``/``GET`` of values of the same
  size (``GET`` returns a new ``bytes``: the copy into a host slot is not even counted), and a
  pipeline of 128 ``EXISTS``; a Redis Cluster through ``redis.cluster.RedisCluster``.
- File: the page files the store wrote, read back whole with ``readinto`` into one buffer
  (sequential, through the page cache) and with O_DIRECT into an aligned buffer.

Every figure is the median of ``repeats`` timed batches; every store ``get`` is checked bit
for bit against what was put, once per configuration.
"""

from __future__ import annotations

import mmap
import os
import statistics
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

import torch

from ..storage import (
    FileStore,
    Namespace,
    PageStatus,
    StorageBackend,
    byte_view,
    chain_page_hashes,
)

EXISTS_KEYS = 128
LAYERS, HEADS, HEAD_DIM = 32, 8, 128


@dataclass
class Row:
    """One figure: the store's value beside the raw store's, same run, same bytes."""

    store: str
    page_kib: int
    figure: str
    value: float
    reference: float | None
    reference_name: str

    @property
    def ratio(self) -> float | None:
        if self.reference in (None, 0.0):
            return None
        assert self.reference is not None
        higher_is_better = "GB/s" in self.figure
        return self.value / self.reference if higher_is_better else self.reference / self.value


class Batch:
    """``num_pages`` pages of ``page_tokens`` tokens of the 32 x 8 x 128 bf16 model (K and V,
    page_first) with random contents, and as many pages to read them back into; both in one
    page-aligned anonymous mapping, like a pinned host pool."""

    def __init__(self, page_tokens: int, num_pages: int, seed: int = 0) -> None:
        page_bytes = page_tokens * 2 * LAYERS * HEADS * HEAD_DIM * 2
        self._mapping = mmap.mmap(-1, 2 * num_pages * page_bytes)
        data = torch.frombuffer(self._mapping, dtype=torch.uint8).view(2 * num_pages, -1)
        generator = torch.Generator().manual_seed(seed)
        data[:num_pages].view(torch.int16).copy_(torch.randint(
            -2**15, 2**15, (num_pages, page_bytes // 2), dtype=torch.int16, generator=generator))
        self.num_pages = num_pages
        self.namespace = Namespace(
            model_id="bench/model", model_revision=f"seed{seed}", dtype="bfloat16",
            num_layers=LAYERS, num_components=2, row_elems=HEADS * HEAD_DIM,
            page_size=page_tokens, layout="page_first", segment_bytes=(page_bytes,))
        tokens = torch.randint(0, 100_000, ((num_pages + EXISTS_KEYS) * page_tokens,),
                               generator=generator)
        self.keys = chain_page_hashes(tokens, page_tokens)
        self.source = [[byte_view(data[i])] for i in range(num_pages)]
        self.target = [[byte_view(data[num_pages + i])] for i in range(num_pages)]

    @property
    def page_bytes(self) -> int:
        return self.namespace.page_bytes

    @property
    def batch_bytes(self) -> int:
        return self.page_bytes * self.num_pages

    def source_bytes(self, i: int) -> bytes:
        return bytes(self.source[i][0])

    def same(self) -> bool:
        return all(s[0] == t[0] for s, t in zip(self.source, self.target, strict=True))

    def scramble_target(self) -> None:
        for page in self.target:
            page[0][:64] = bytes(64)


def median_s(run: Callable[[], object], repeats: int, before: Callable[[], object] | None = None
             ) -> float:
    """Median wall time of ``run`` over ``repeats`` calls (``before`` runs untimed first)."""
    times = []
    for _ in range(repeats):
        if before is not None:
            before()
        started = time.perf_counter()
        run()
        times.append(time.perf_counter() - started)
    return statistics.median(times)


def measure_store(name: str, store: StorageBackend, unchecked: StorageBackend, batch: Batch,
                  repeats: int) -> dict[str, float]:
    """put GB/s (into an empty namespace), get GB/s with checksums verified and, through
    ``unchecked`` (the same store without checksums), not verified; exists of 128 keys (ms).
    Raises ``RuntimeError`` if a page does not round-trip bit for bit."""
    keys, gb = batch.keys[:batch.num_pages], batch.batch_bytes / 1e9

    def put() -> None:
        _expect_ok(name, "put", store.put(keys, batch.source, timeout_s=60).statuses)

    put_s = median_s(put, repeats, before=store.clear)

    def get(through: StorageBackend) -> Callable[[], None]:
        return lambda: _expect_ok(name, "get", through.get(keys, batch.target,
                                                           timeout_s=60).statuses)

    batch.scramble_target()
    get(store)()
    if not batch.same():
        raise RuntimeError(f"{name}: pages read back differ from the pages stored")
    get_s = median_s(get(store), repeats)
    unchecked_s = median_s(get(unchecked), repeats)
    probe = batch.keys[:EXISTS_KEYS]
    exists_s = median_s(lambda: store.exists(probe, timeout_s=10), max(repeats, 20))
    return {"put": gb / put_s, "get": gb / get_s, "get_unchecked": gb / unchecked_s,
            "exists_ms": exists_s * 1e3,
            "checksum_pct": max(0.0, 100 * (get_s - unchecked_s) / get_s)}


def measure_redis_py(client: object, batch: Batch, repeats: int) -> dict[str, float]:
    """Plain SET/GET of values of the page object's size, and 128 pipelined EXISTS, through
    redis-py + hiredis (``client``: ``redis.Redis`` or ``redis.cluster.RedisCluster``)."""
    import redis

    assert isinstance(client, redis.Redis | redis.cluster.RedisCluster)
    values = [batch.source_bytes(i) for i in range(batch.num_pages)]
    keys = [b"bench:{%d}" % i for i in range(batch.num_pages)]
    gb = batch.batch_bytes / 1e9

    def set_all() -> None:
        for key, value in zip(keys, values, strict=True):
            client.set(key, value)

    def get_all() -> None:
        for key in keys:
            client.get(key)

    # every key deleted before each timed repeat: fresh keys, as hicache's put gets
    put_s = median_s(set_all, repeats, before=lambda: client.delete(*keys))
    get_s = median_s(get_all, repeats)
    probe = [b"bench:{%d}" % i for i in range(EXISTS_KEYS)]

    def exists() -> None:
        pipe = client.pipeline(transaction=False)
        for key in probe:
            pipe.exists(key)
        pipe.execute()

    exists_s = median_s(exists, max(repeats, 20))
    for key in keys:
        client.delete(key)
    return {"put": gb / put_s, "get": gb / get_s, "exists_ms": exists_s * 1e3}


def file_paths(store: FileStore, keys: Sequence[bytes]) -> list[Path]:
    return [store.directory / k.hex()[:2] / (k.hex() + ".kv") for k in keys]


def measure_sequential_read(paths: Sequence[Path], header_len: int, batch: Batch,
                            repeats: int, *, direct: bool) -> float:
    """GB/s of reading each whole file (header into a scratch buffer, payload into the same
    destination page the store reads into), through the page cache or with O_DIRECT."""
    header = memoryview(mmap.mmap(-1, -(-header_len // mmap.PAGESIZE) * mmap.PAGESIZE))
    header = header[:header_len]
    flags = os.O_RDONLY | (getattr(os, "O_DIRECT", 0) if direct else 0)
    expected = header_len + batch.page_bytes

    def read_all() -> None:
        for path, page in zip(paths, batch.target, strict=True):
            fd = os.open(path, flags)
            try:
                if os.readv(fd, [header, *page]) != expected:
                    raise RuntimeError(f"short read of {path}")
            finally:
                os.close(fd)

    return batch.batch_bytes / 1e9 / median_s(read_all, repeats)


def _expect_ok(name: str, op: str, statuses: Sequence[PageStatus]) -> None:
    bad = [s for s in statuses if s is not PageStatus.OK]
    if bad:
        raise RuntimeError(f"{name}: {op} failed for {len(bad)} of {len(statuses)} pages "
                           f"({bad[0].value})")
