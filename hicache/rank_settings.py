"""The settings tensor-parallel ranks must share, compared when their services are built, and
the build steps every rank must pass alike (opening the shared store).

Ranks that agree on every step (:mod:`hicache.rank_agreement`) must take the same decisions
from the same calls, and make collectives of the same lengths: a rank with another prefetch
policy sends a value per open prefetch that the others do not (gloo then aborts a process),
a rank with a store makes collectives at build that a rank without one never joins, and
ranks with other pool sizes, page sizes, policies or models answer differently. So every
config key must be alike on every rank except those that only say where a rank's own
things are or how its bytes move (:data:`PER_RANK`); ``build_service`` compares the rest
on every rank and raises ``ValueError`` naming the keys that differ, on every rank.
"""

from __future__ import annotations

import dataclasses
import enum
import hashlib
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, TypeVar

if TYPE_CHECKING:
    from .config import HiCacheConfig
    from .rank_agreement import RankAgreement

T = TypeVar("T")
TP_ARGUMENTS = "build_service(tp_rank=, tp_size=)"  # compared with the config's keys

# keys a rank may set its own way: its device, its metrics endpoint, its RAM, how its copies
# run, where its store is and how long its calls wait
PER_RANK = frozenset({
    "device_pool.device", "host.ram_reserve_gib", "host.layout", "controller.io_backend",
    "controller.kernel_programs", "controller.staging_tokens", "service.metrics_enabled",
    "service.metrics_host", "service.metrics_port", "service.integrity_check_interval_s",
    "storage.path", "storage.url", "storage.nodes", "storage.timeout_s", "storage.checksum",
})


def shared_settings(config: HiCacheConfig) -> list[tuple[str, str]]:
    """``(key, value)`` of every config key the ranks must share, sorted by key."""
    found: list[tuple[str, str]] = []
    _collect(config, "", found)
    return sorted((key, value) for key, value in found if key not in PER_RANK)


def check_same_settings(agreement: RankAgreement, config: HiCacheConfig, *,
                        tp_arguments_given: bool = False) -> None:
    """Compare :func:`shared_settings` across the ranks of ``agreement`` (one collective,
    a second one when they differ, on every rank alike); ``ValueError`` on every rank naming
    the keys that differ and this rank's values of them.

    ``tp_arguments_given``: whether this rank passed ``build_service`` its ``tp_rank`` and
    ``tp_size`` (the group's) or left them out, compared as a setting: an MLA model's ranks
    that leave them out share one copy in the store and probe for it (two collectives the
    others would not join: gloo aborted a process)."""
    items = shared_settings(config)
    items.append((TP_ARGUMENTS, "given" if tp_arguments_given else "left out"))
    keys = _digest("\n".join(key for key, _ in items))
    rows = agreement.gather([len(items), keys, _digest(repr(items))])
    if len({tuple(row) for row in rows}) == 1:
        return
    if len({tuple(row[:2]) for row in rows}) > 1:
        raise ValueError("tp_group: the ranks' configs have different keys (ranks running "
                         "different hicache versions?); run one version on every rank")
    by_rank = agreement.gather([_digest(f"{key}={value}") for key, value in items])
    differ = [(key, value) for i, (key, value) in enumerate(items)
              if len({row[i] for row in by_rank}) > 1]
    mine = ", ".join(f"{key}={value}" for key, value in differ)
    if [key for key, _ in differ] == [TP_ARGUMENTS]:
        raise ValueError(f"tp_group: some ranks passed build_service their tp_rank and "
                         f"tp_size and others left them out (rank {agreement.rank}: "
                         f"{differ[0][1]}); pass them alike on every rank")
    raise ValueError(
        f"tp_group: the ranks' configs differ in {', '.join(key for key, _ in differ)} (rank "
        f"{agreement.rank} has {mine}); every rank must load the same config, but for "
        f"{', '.join(sorted(PER_RANK))}")


def on_every_rank(agreement: RankAgreement, what: str, make: Callable[[], T],
                  close: Callable[[T], object]) -> T:
    """``make()`` on this rank, then one collective: if it raised on any rank, every rank
    raises ``ValueError`` naming those ranks (the failed one from its own error; what this
    rank made is closed with ``close``), instead of the others waiting at their next
    collective for a rank that left the build."""
    made: T | None = None
    failure: Exception | None = None
    try:
        made = make()
    except Exception as error:  # told to every rank first
        failure = error
    failed = [rank for rank, (bad,) in enumerate(agreement.gather([int(failure is not None)]))
              if bad]
    if not failed:
        assert made is not None
        return made
    if made is not None:
        close(made)
    raise ValueError(f"tp_group: {what} failed on rank {', '.join(map(str, failed))}"
                     f"{f' ({failure})' if failure is not None else ''}; fix it there and "
                     f"build every rank again") from failure


def _collect(section: Any, prefix: str, found: list[tuple[str, str]]) -> None:
    for field in dataclasses.fields(section):
        value = getattr(section, field.name)
        key = f"{prefix}{field.name}"
        if dataclasses.is_dataclass(value):
            _collect(value, f"{key}.", found)
        else:
            found.append((key, str(value.value) if isinstance(value, enum.Enum) else repr(value)))


def _digest(text: str) -> int:
    """A signed 64-bit digest of ``text`` (a collective's int64 value)."""
    digest = hashlib.blake2b(text.encode(), digest_size=8, person=b"hicache.ranks").digest()
    return int.from_bytes(digest, "little", signed=True)
