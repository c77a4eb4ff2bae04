"""Whether a store can be used from this machine now: what ``hicache check-config`` reports.

- A file store: its directory exists and takes a new file (a probe file, removed at once), or
  its nearest existing parent is writable so the store can make it; the free space of its
  file system beside the cap.
- A Redis server: a connection, ``PING`` and ``INFO memory`` through the store's own client
  (:mod:`hicache.storage.resp`), and whether the server's memory policy can evict pages.
- A Redis Cluster: the slot map from the first given node that answers, then every master as
  a server, and how many of the 16384 slots have a master.

Each server gets ``timeout_s``, the store's per-call deadline; nothing waits past it. The
report names servers by address and never prints a password.
"""

from __future__ import annotations

import os
import shutil
import tempfile
import time
from pathlib import Path
from typing import NamedTuple

from .base import Deadline
from .redis_nodes import NUM_SLOTS, Address, slot_map
from .resp import Reply, RespConnection, RespError, command
from .store_url import StoreLocation, parse_location

_GIB = 2**30


class StoreProbe(NamedTuple):
    """What a probe found."""

    ok: bool
    """The store can be used from here now (a note such as a missing cap does not change it)."""
    report: str
    """One line: the store, what was found and, when something is wrong, what to do."""


def describe_location(location: str) -> str:
    """The store ``location`` names, for a report: the absolute directory, or the servers'
    addresses (never the password)."""
    parsed = parse_location(location)
    if parsed.path is not None:
        return f"file store {os.path.abspath(parsed.path)}"
    addresses = ", ".join(_show(seed) for seed in parsed.seeds)
    return f"redis cluster via {addresses}" if parsed.cluster else f"redis {addresses}"


def probe_store(location: str, *, timeout_s: float, capacity_bytes: int | None = None
                ) -> StoreProbe:
    """Check the store at ``location`` (``open_store``'s form) as the module docstring says.

    Args:
        location: a directory, ``redis://...`` or ``redis+cluster://...``.
        timeout_s: deadline of each server's questions (> 0).
        capacity_bytes: the file store's cap, reported beside the free space.
    Raises:
        ValueError: a malformed location (the config refuses those before).
    """
    parsed = parse_location(location)
    name = describe_location(location)
    if parsed.path is not None:
        ok, text = _probe_directory(Path(parsed.path), capacity_bytes)
    elif parsed.cluster:
        ok, text = _probe_cluster(parsed, timeout_s)
    else:
        ok, text = _probe_server(parsed.seeds[0], parsed.password, timeout_s)
    return StoreProbe(ok, f"{name}: {text}")


# ---- file ------------------------------------------------------------------------------------


def _probe_directory(root: Path, capacity_bytes: int | None) -> tuple[bool, str]:
    if root.exists() and not root.is_dir():
        return False, "exists and is not a directory; give a directory"
    if root.is_dir():
        problem = _write_problem(root, directory=False)
        if problem:
            return False, f"not writable ({problem}); give a directory this user can write"
        state, existing = "exists, writable", root
    else:
        existing = next(p for p in root.absolute().parents if p.exists())
        problem = _write_problem(existing, directory=True)
        if problem:
            return False, (f"does not exist and cannot be made ({existing}: {problem}); make "
                           f"it or give another path")
        state = f"does not exist yet, the store makes it (in {existing}, writable)"
    free = shutil.disk_usage(existing).free
    if capacity_bytes is None:
        return True, (f"{state}; no cap, {free / _GIB:.2f} GiB free on its file system "
                      f"(pages pile up until it is full; storage.size_cap_gib caps them)")
    text = (f"{state}; cap {capacity_bytes / _GIB:.2f} GiB, {free / _GIB:.2f} GiB free on its "
            f"file system")
    if capacity_bytes > free:
        text += " (the file system fills before the cap unless it holds pages already)"
    return True, text


def _write_problem(parent: Path, *, directory: bool) -> str | None:
    """Why a file (or a directory) cannot be made in ``parent`` (one is made and removed at
    once: permission bits do not tell, for root or on a read-only mount); ``None`` if it can."""
    if not parent.is_dir():
        return "not a directory"
    try:
        if directory:
            os.rmdir(tempfile.mkdtemp(prefix=".hicache-probe-", dir=parent))
        else:
            fd, name = tempfile.mkstemp(prefix=".hicache-probe-", dir=parent)
            os.close(fd)
            os.unlink(name)
    except OSError as exc:
        return exc.strerror or str(exc)
    return None


# ---- redis -----------------------------------------------------------------------------------


def _probe_server(address: Address, password: str | None, timeout_s: float
                  ) -> tuple[bool, str]:
    try:
        ping_ms, (info,) = _ask(address, password, timeout_s, command(b"INFO", b"memory"))
    except (OSError, RespError) as exc:
        return False, _failure(exc, timeout_s)
    return True, f"answers PING in {ping_ms:.2f} ms; {_memory_note(info)}"


def _probe_cluster(parsed: StoreLocation, timeout_s: float) -> tuple[bool, str]:
    owners: list[Address | None] | None = None
    problems = []
    for seed in parsed.seeds:
        try:
            _, (reply,) = _ask(seed, parsed.password, timeout_s, command(b"CLUSTER", b"SLOTS"))
        except (OSError, RespError) as exc:
            problems.append(f"{_show(seed)} {_failure(exc, timeout_s)}")
            continue
        if isinstance(reply, RespError):
            problems.append(f"{_show(seed)} gives no slot map ({reply}); for one server use "
                            f"redis://")
            continue
        owners = slot_map(reply, seed[0])
        break
    if owners is None:
        return False, "no slot map: " + "; ".join(problems)
    masters = sorted({owner for owner in owners if owner is not None})
    served = sum(1 for owner in owners if owner is not None)
    slowest_ms, notes, dead = 0.0, set(), []
    for master in masters:
        try:
            ping_ms, (info,) = _ask(master, parsed.password, timeout_s,
                                    command(b"INFO", b"memory"))
        except (OSError, RespError) as exc:
            dead.append(f"master {_show(master)} {_failure(exc, timeout_s)}")
            continue
        slowest_ms = max(slowest_ms, ping_ms)
        notes.add(_memory_note(info))
    text = (f"{len(masters) - len(dead)} of {len(masters)} masters answer PING (slowest "
            f"{slowest_ms:.2f} ms), {served} of {NUM_SLOTS} slots served")
    if served < NUM_SLOTS:
        text += " (pages in the others are misses; assign them with redis-cli --cluster fix)"
    text = "; ".join([text, *dead, *problems, *sorted(notes)])
    return not dead and served == NUM_SLOTS, text


def _ask(address: Address, password: str | None, timeout_s: float, *commands: bytes
         ) -> tuple[float, list[Reply | RespError]]:
    """Connect, ``PING``, then send ``commands``: the PING's round trip in ms and each
    command's reply (an error reply as its :class:`RespError`). Raises ``OSError`` when the
    server does not answer, ``RespError`` when it refuses the connection or the PING."""
    deadline = Deadline(timeout_s)
    connection = RespConnection(*address, deadline, password)
    try:
        started = time.perf_counter()
        connection.send([command(b"PING")], deadline)
        connection.read_reply(deadline)
        ping_ms = (time.perf_counter() - started) * 1e3
        connection.send(list(commands), deadline)
        replies: list[Reply | RespError] = []
        for _ in commands:
            try:
                replies.append(connection.read_reply(deadline))
            except RespError as exc:
                replies.append(exc)
        return ping_ms, replies
    finally:
        connection.close()


def _failure(exc: OSError | RespError, timeout_s: float) -> str:
    if isinstance(exc, TimeoutError):
        return f"does not answer within {timeout_s:g} s (storage.timeout_s)"
    if isinstance(exc, RespError):
        return f"refuses the connection ({exc}); check the password in storage.url"
    if exc.strerror:  # an errno: refused, unreachable, an unknown host
        return f"does not answer ({exc.strerror})"
    return f"does not answer as a Redis server ({exc})"  # closed, or not speaking RESP


def _memory_note(info: Reply | RespError) -> str:
    """What ``INFO memory`` says about room for pages."""
    if not isinstance(info, bytes):
        return "memory policy unknown (INFO refused)"
    fields = dict(line.split(":", 1) for line in info.decode("utf-8", "replace").splitlines()
                  if ":" in line)
    maxmemory, policy = int(fields.get("maxmemory", "0")), fields.get("maxmemory_policy", "?")
    if maxmemory == 0:
        return ("no maxmemory: pages pile up until the server runs out of memory (set "
                "maxmemory and maxmemory-policy allkeys-lru)")
    text = f"maxmemory {maxmemory / _GIB:.2f} GiB, {policy}"
    if not policy.startswith("allkeys-"):
        text += " (pages have no TTL, so puts fail once it is full; use allkeys-lru)"
    return text


def _show(address: Address) -> str:
    host, port = address
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"
