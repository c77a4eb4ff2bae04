"""Local ``redis-server`` processes for ``hicache bench storage`` and the storage tests: a
standalone server or a 3-master cluster (made with ``redis-cli --cluster create``) on free
loopback ports, in a given directory, without persistence. Whoever starts one stops it."""

from __future__ import annotations

import random
import shutil
import signal
import socket
import subprocess
import time
from pathlib import Path


def have_redis() -> bool:
    """True when ``redis-server`` and ``redis-cli`` are on the PATH."""
    return shutil.which("redis-server") is not None and shutil.which("redis-cli") is not None


def free_port() -> int:
    """A free loopback port whose cluster bus port (+10000) is free too, both below the
    kernel's ephemeral range, so no client connection can take either between this pick
    and the server's bind."""
    low = _ephemeral_low() - 10000
    first = 10000 if low > 12000 else 20000
    last = low if low > 12000 else 50000
    for _ in range(200):
        port = random.randrange(first, last)
        if _is_free(port) and _is_free(port + 10000):
            return port
    raise RuntimeError("no free loopback port pair found")


def _ephemeral_low() -> int:
    """The first port the kernel hands to outgoing connections (32768 if unknown)."""
    try:
        return int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return 32768


def _is_free(port: int) -> bool:
    with socket.socket() as sock:
        try:
            sock.bind(("127.0.0.1", port))
        except OSError:
            return False
        return True


def ping(port: int, timeout_s: float = 0.2) -> bytes:
    """The server's reply to ``PING`` (raises ``OSError`` if it does not answer)."""
    with socket.create_connection(("127.0.0.1", port), timeout=timeout_s) as sock:
        sock.sendall(b"PING\r\n")
        return sock.recv(64)


class RedisServer:
    """One ``redis-server`` process on ``port`` with its files in ``directory``."""

    def __init__(self, directory: Path, *, port: int | None = None, cluster: bool = False,
                 maxmemory: str | None = None) -> None:
        self.port = port or free_port()
        self.may_repick_port = port is None
        self.directory = directory
        self.cluster = cluster
        self.maxmemory = maxmemory
        self.process: subprocess.Popen[bytes] | None = None

    @property
    def address(self) -> tuple[str, int]:
        return ("127.0.0.1", self.port)

    def start(self) -> RedisServer:
        """Start the server and wait for its PONG. A server on a port picked here that exits
        at once (the port was taken after the pick) is retried on a fresh port, twice; once
        it has answered, its port is kept, so a restart after ``kill`` comes back where its
        clients and cluster peers look for it."""
        for attempt in range(3):
            if self._start_once():
                self.may_repick_port = False
                return self
            if not self.may_repick_port or attempt == 2:
                break
            self.port = free_port()
        raise RuntimeError(f"redis-server on port {self.port} did not start "
                           f"(see {self.directory}): {self._log_tail()}")

    def _log_tail(self) -> str:
        log = self.directory / f"redis-{self.port}.log"
        try:
            lines = log.read_text(errors="replace").strip().splitlines()
        except OSError:
            return "no log written"
        return " | ".join(lines[-3:]) or "empty log"

    def _start_once(self) -> bool:
        """True once the server answers; False (the process killed) if it exited or did not
        answer within 10 s."""
        self.directory.mkdir(parents=True, exist_ok=True)
        args = ["redis-server", "--port", str(self.port), "--bind", "127.0.0.1",
                "--save", "", "--appendonly", "no", "--dir", str(self.directory),
                "--logfile", f"redis-{self.port}.log", "--enable-debug-command", "local"]
        if self.maxmemory:
            args += ["--maxmemory", self.maxmemory, "--maxmemory-policy", "allkeys-lru"]
        if self.cluster:
            args += ["--cluster-enabled", "yes", "--cluster-config-file",
                     f"nodes-{self.port}.conf", "--cluster-node-timeout", "1000",
                     "--cluster-require-full-coverage", "no"]
        self.process = subprocess.Popen(args, stdout=subprocess.DEVNULL,
                                        stderr=subprocess.DEVNULL)
        deadline = time.monotonic() + 10
        while True:
            try:
                if ping(self.port).startswith(b"+PONG"):
                    return True
            except OSError:
                pass
            if time.monotonic() > deadline or self.process.poll() is not None:
                self.kill()
                return False
            time.sleep(0.02)

    def kill(self) -> None:
        """SIGKILL, as a crash would."""
        if self.process is not None:
            self.process.kill()
            self.process.wait()
            self.process = None

    def pause(self) -> None:
        assert self.process is not None, "not running"
        self.process.send_signal(signal.SIGSTOP)

    def resume(self) -> None:
        assert self.process is not None, "not running"
        self.process.send_signal(signal.SIGCONT)

    def stop(self) -> None:
        if self.process is not None:
            self.process.send_signal(signal.SIGCONT)
            self.process.terminate()
            try:
                self.process.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()
            self.process = None


class RedisCluster:
    """Three masters, no replicas, every slot assigned."""

    def __init__(self, directory: Path, masters: int = 3) -> None:
        self.servers: list[RedisServer] = []
        for i in range(masters):
            server = RedisServer(directory / f"node{i}", cluster=True)
            while server.port in [s.port for s in self.servers]:
                server.port = free_port()
            self.servers.append(server)

    @property
    def addresses(self) -> list[tuple[str, int]]:
        return [server.address for server in self.servers]

    @property
    def url(self) -> str:
        return "redis+cluster://" + ",".join(f"{h}:{p}" for h, p in self.addresses)

    def start(self) -> RedisCluster:
        """Start every node and create the cluster; on any failure stop what started."""
        try:
            for server in self.servers:
                server.start()
            nodes = [f"127.0.0.1:{server.port}" for server in self.servers]
            subprocess.run(["redis-cli", "--cluster", "create", *nodes, "--cluster-replicas",
                            "0", "--cluster-yes"], check=True, stdout=subprocess.DEVNULL,
                           stderr=subprocess.DEVNULL, timeout=60)
            self.wait_ok()
        except BaseException:
            self.stop()
            raise
        return self

    def wait_ok(self, timeout_s: float = 30.0) -> None:
        """Until every running node reports ``cluster_state:ok`` and knows every slot."""
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if all(_cluster_ok(s.port) for s in self.servers if s.process is not None):
                return
            time.sleep(0.05)
        raise RuntimeError("the cluster did not reach cluster_state:ok")

    def stop(self) -> None:
        for server in self.servers:
            server.stop()


def _cluster_ok(port: int) -> bool:
    try:
        out = subprocess.run(["redis-cli", "-p", str(port), "cluster", "info"],
                             capture_output=True, timeout=5, check=True).stdout
    except (subprocess.SubprocessError, OSError):
        return False
    return b"cluster_state:ok" in out and b"cluster_slots_ok:16384" in out
