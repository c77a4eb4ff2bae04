"""``hicache check-config`` on the storage section: the store's line, its policies, and the
exit code when the store cannot be used (against real directories and redis-server)."""

from __future__ import annotations

import socket
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from storage_helpers import needs_redis

from hicache.bench.redis_local import RedisCluster, RedisServer, free_port
from hicache.cli import main


def write_config(tmp_path: Path, storage: str) -> str:
    """The default config with ``storage`` (indented YAML lines) as its storage section."""
    text = (Path(__file__).resolve().parents[1] / "config.yaml").read_text(encoding="utf-8")
    head, section, _ = text.partition("\nstorage:\n")
    assert section, "the default config ends with its storage section"
    path = tmp_path / "config.yaml"
    path.write_text(head + section + storage, encoding="utf-8")
    return str(path)


def check(capsys: pytest.CaptureFixture[str], path: str, *options: str
          ) -> tuple[int, list[str], str]:
    """check-config's exit code, its storage lines (the last two) and its stderr."""
    code = main(["check-config", *options, path])
    captured = capsys.readouterr()
    return code, captured.out.splitlines()[-2:], captured.err


@pytest.fixture
def silent_port() -> Iterator[int]:
    """A loopback port that accepts connections and never answers."""
    with socket.socket() as listener:
        listener.bind(("127.0.0.1", 0))
        listener.listen(8)
        yield listener.getsockname()[1]


def test_default_config_has_no_store(capsys: pytest.CaptureFixture[str]) -> None:
    """The built-in default has no L3: one line says so, and the command succeeds."""
    assert main(["check-config"]) == 0
    assert capsys.readouterr().out.splitlines()[-1] == "storage (L3): none"


def test_file_store_reports_its_directory_cap_and_policies(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """A writable directory: its path, its cap beside the free space, then the policies."""
    (tmp_path / "pages").mkdir()
    path = write_config(tmp_path, f"  backend: file\n  path: {tmp_path / 'pages'}\n"
                                  f"  size_cap_gib: 0.5\n")
    code, lines, err = check(capsys, path)
    assert code == 0 and err == ""
    assert lines[0].startswith(f"storage (L3): file store {tmp_path / 'pages'}: exists, "
                               f"writable; cap 0.50 GiB, ")
    assert lines[0].endswith(" GiB free on its file system")
    assert lines[1] == ("storage policies: prefetch timeout (2 s + 0.1 s per 1024 tokens, at "
                        "most 30 s), backups write_through, checksum on, 2 s per store call")
    assert list((tmp_path / "pages").iterdir()) == []  # the probe file is gone


def test_missing_directory_is_made_by_the_store_not_by_the_check(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """A directory that does not exist yet is fine when its parent is writable; check-config
    leaves it unmade, and says when there is no cap."""
    path = write_config(tmp_path, f"  backend: file\n  path: {tmp_path / 'a' / 'b'}\n"
                                  f"  prefetch_policy: best_effort\n"
                                  f"  write_policy: write_through_selective\n"
                                  f"  checksum: false\n")
    code, lines, _ = check(capsys, path)
    assert code == 0
    assert lines[0].startswith(f"storage (L3): file store {tmp_path / 'a' / 'b'}: does not "
                               f"exist yet, the store makes it (in {tmp_path}, writable); no "
                               f"cap, ")
    assert lines[1] == ("storage policies: prefetch best_effort, backups write_through_selective "
                        "(after 2 hits), checksum off, 2 s per store call")
    assert not (tmp_path / "a").exists()


def test_a_file_in_the_way_fails_with_one_line(tmp_path: Path,
                                               capsys: pytest.CaptureFixture[str]) -> None:
    """A path below a regular file cannot be made: reported, exit 1, one line on stderr."""
    (tmp_path / "file").write_text("x")
    path = write_config(tmp_path, f"  backend: file\n  path: {tmp_path / 'file' / 'pages'}\n")
    code, lines, err = check(capsys, path)
    assert code == 1
    assert lines[0] == (f"storage (L3): file store {tmp_path / 'file' / 'pages'}: does not "
                        f"exist and cannot be made ({tmp_path / 'file'}: not a directory); "
                        f"make it or give another path")
    assert err.startswith("hicache: error: file store ") and err.count("\n") == 1
    assert "--skip-storage-check" in err


@needs_redis
def test_a_live_server_answers(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """A real redis-server answers PING; its maxmemory policy is reported."""
    server = RedisServer(tmp_path / "redis", maxmemory="64mb").start()
    try:
        path = write_config(tmp_path, f"  backend: redis\n  url: redis://127.0.0.1:"
                                      f"{server.port}\n")
        code, lines, err = check(capsys, path)
    finally:
        server.stop()
    assert code == 0 and err == ""
    assert lines[0].startswith(f"storage (L3): redis 127.0.0.1:{server.port}: answers PING in ")
    assert lines[0].endswith(" ms; maxmemory 0.06 GiB, allkeys-lru")


def test_nothing_listening_is_a_clear_line_not_a_crash(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """A port where nothing listens: 'does not answer', exit 1; the password is not shown."""
    port = free_port()
    path = write_config(tmp_path, f"  backend: redis\n  url: redis://:s3cret@127.0.0.1:{port}\n")
    code, lines, err = check(capsys, path)
    assert code == 1
    assert lines[0] == (f"storage (L3): redis 127.0.0.1:{port}: does not answer (Connection "
                        f"refused)")
    assert err == (f"hicache: error: redis 127.0.0.1:{port}: does not answer (Connection "
                   f"refused); an engine started with this config here would find nothing in "
                   f"its L3 (--skip-storage-check skips this check)\n")
    assert "s3cret" not in " ".join(lines) + err


def test_a_silent_server_times_out_within_the_deadline(
        tmp_path: Path, silent_port: int, capsys: pytest.CaptureFixture[str]) -> None:
    """A server that accepts but never answers costs storage.timeout_s, then is reported."""
    path = write_config(tmp_path, f"  backend: redis\n  url: redis://127.0.0.1:{silent_port}\n"
                                  f"  timeout_s: 0.3\n")
    started = time.monotonic()
    code, lines, _ = check(capsys, path)
    assert time.monotonic() - started < 2.0
    assert code == 1
    assert lines[0] == (f"storage (L3): redis 127.0.0.1:{silent_port}: does not answer within "
                        f"0.3 s (storage.timeout_s)")


def test_the_store_check_can_be_skipped(tmp_path: Path,
                                        capsys: pytest.CaptureFixture[str]) -> None:
    """--skip-storage-check validates the section without asking the store."""
    path = write_config(tmp_path, f"  backend: redis\n  nodes: [127.0.0.1:{free_port()}, "
                                  f"127.0.0.1:{free_port()}]\n")
    code, lines, err = check(capsys, path, "--skip-storage-check")
    assert code == 0 and err == ""
    assert lines[0].startswith("storage (L3): redis cluster via 127.0.0.1:")
    assert lines[0].endswith(": not checked (--skip-storage-check)")


@needs_redis
def test_a_cluster_reports_its_masters_and_slots(tmp_path: Path,
                                                 capsys: pytest.CaptureFixture[str]) -> None:
    """nodes: a dead seed is skipped; every master answers and every slot is served."""
    cluster = RedisCluster(tmp_path / "cluster").start()
    try:
        seed = cluster.addresses[1][1]
        dead = free_port()
        path = write_config(tmp_path, f"  backend: redis\n  nodes: [127.0.0.1:{dead}, "
                                      f"127.0.0.1:{seed}]\n")
        code, lines, err = check(capsys, path)
    finally:
        cluster.stop()
    assert code == 0 and err == ""
    assert lines[0].startswith(f"storage (L3): redis cluster via 127.0.0.1:{dead}, "
                               f"127.0.0.1:{seed}: 3 of 3 masters answer PING (slowest ")
    assert (f"ms), 16384 of 16384 slots served; 127.0.0.1:{dead} does not answer (Connection "
            f"refused); no maxmemory: ") in lines[0]


@needs_redis
def test_a_standalone_server_is_not_a_cluster(tmp_path: Path,
                                              capsys: pytest.CaptureFixture[str]) -> None:
    """nodes naming a server without cluster mode: no slot map, the fix, exit 1."""
    server = RedisServer(tmp_path / "redis").start()
    try:
        path = write_config(tmp_path, f"  backend: redis\n  nodes: [127.0.0.1:{server.port}]\n")
        code, lines, _ = check(capsys, path)
    finally:
        server.stop()
    assert code == 1
    assert lines[0] == (f"storage (L3): redis cluster via 127.0.0.1:{server.port}: no slot map: "
                        f"127.0.0.1:{server.port} gives no slot map (ERR This instance has "
                        f"cluster support disabled); for one server use redis://")
