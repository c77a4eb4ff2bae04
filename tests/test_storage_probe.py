"""What the store probe (``hicache check-config``'s storage line) finds where things are
wrong, against real directories and redis-server: an existing directory nothing can be
written to, a cap beyond the free space, a server whose memory policy never evicts, a
cluster with unserved slots and one with a dead master; the PING time it reports."""

from __future__ import annotations

import os
import re
import tempfile
from pathlib import Path

import pytest
import redis
from storage_helpers import needs_redis

from hicache.bench.redis_local import RedisCluster, RedisServer
from hicache.storage.probe import probe_store

UNWRITABLE = Path("/sys")  # sysfs: no file can be made there, not even by root


def _unwritable() -> bool:
    try:
        fd, name = tempfile.mkstemp(dir=UNWRITABLE)
    except OSError:
        return True
    os.close(fd)
    os.unlink(name)
    return False


@pytest.mark.skipif(not UNWRITABLE.is_dir() or not _unwritable(),
                    reason="needs a directory no file can be made in (Linux sysfs)")
def test_an_existing_directory_that_takes_no_file_is_refused() -> None:
    probe = probe_store(str(UNWRITABLE), timeout_s=1.0)
    assert not probe.ok
    assert re.fullmatch(r"file store /sys: not writable \([A-Z][a-z ]+\); give a directory "
                        r"this user can write", probe.report), probe.report
    inside = probe_store(str(UNWRITABLE / "hicache" / "pages"), timeout_s=1.0)
    assert not inside.ok
    assert inside.report.startswith("file store /sys/hicache/pages: does not exist and "
                                    "cannot be made (/sys: ")


def test_a_file_where_the_directory_should_be_is_refused(tmp_path: Path) -> None:
    (tmp_path / "pages").write_text("x")
    probe = probe_store(str(tmp_path / "pages"), timeout_s=1.0)
    assert not probe.ok
    assert probe.report == (f"file store {tmp_path / 'pages'}: exists and is not a directory; "
                            f"give a directory")


def test_a_cap_beyond_the_free_space_is_noted(tmp_path: Path) -> None:
    note = "the file system fills before the cap"
    beyond = probe_store(str(tmp_path), timeout_s=1.0, capacity_bytes=2**62)
    assert beyond.ok and note in beyond.report
    within = probe_store(str(tmp_path), timeout_s=1.0, capacity_bytes=2**20)
    assert within.ok and note not in within.report
    assert within.report.startswith(f"file store {tmp_path}: exists, writable; cap 0.00 GiB, ")


@needs_redis
def test_a_server_that_never_evicts_is_noted_and_its_ping_time_is_real(tmp_path: Path
                                                                       ) -> None:
    server = RedisServer(tmp_path / "redis", maxmemory="64mb").start()
    try:
        redis.Redis(port=server.port).config_set("maxmemory-policy", "noeviction")
        probe = probe_store(f"redis://127.0.0.1:{server.port}", timeout_s=2.0)
    finally:
        server.stop()
    assert probe.ok
    found = re.fullmatch(r"redis 127\.0\.0\.1:\d+: answers PING in (\d+\.\d\d) ms; maxmemory "
                         r"0\.06 GiB, noeviction \(pages have no TTL, so puts fail once it is "
                         r"full; use allkeys-lru\)", probe.report)
    assert found, probe.report
    assert 0.0 < float(found.group(1)) < 2000.0


@needs_redis
def test_a_cluster_with_unserved_slots_or_a_dead_master_is_not_usable(tmp_path: Path) -> None:
    cluster = RedisCluster(tmp_path / "cluster").start()
    try:
        url = "redis+cluster://" + ",".join(f"127.0.0.1:{p}" for _, p in cluster.addresses)
        assert probe_store(url, timeout_s=2.0).ok
        first = redis.Redis(port=cluster.servers[0].port)
        first.execute_command("CLUSTER", "DELSLOTS", 0, 1, 2)
        unserved = probe_store(f"redis+cluster://127.0.0.1:{cluster.servers[0].port}",
                               timeout_s=2.0)
        assert not unserved.ok
        assert ("16381 of 16384 slots served (pages in the others are misses; assign them "
                "with redis-cli --cluster fix)") in unserved.report
        first.execute_command("CLUSTER", "ADDSLOTS", 0, 1, 2)
        victim = cluster.servers[2]
        victim.kill()
        dead = probe_store(f"redis+cluster://127.0.0.1:{cluster.servers[0].port}",
                           timeout_s=2.0)
        assert not dead.ok
        assert "2 of 3 masters answer PING" in dead.report
        assert f"master 127.0.0.1:{victim.port} does not answer" in dead.report
    finally:
        cluster.stop()
