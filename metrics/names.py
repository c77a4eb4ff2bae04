"""The metrics hicache exports: one table that the collector, the docs and the tests share.

Every name has the ``hicache_`` prefix and ends in its base unit (``_tokens``, ``_bytes``,
``_seconds``, ``_ops``); counters end in ``_total`` as they appear in the exposition. Label
values that are known in advance (directions, tiers, reasons) are exported as zeros before
their first increment, so dashboards and alerts see every series from the first scrape. The
shared store's (L3) families too: they are zeros while the service has no store.
"""

from __future__ import annotations

from typing import Literal, NamedTuple

from hicache.l3.stats import BACKUP_OUTCOMES, PREFETCH_OUTCOMES
from hicache.radix.node import BACKUP_REFUSALS
from hicache.storage.base import TIMED_OPS

MetricType = Literal["counter", "gauge", "histogram"]

# Label values known in advance. Directions are ``hicache.controller.Direction`` values.
DIRECTIONS: tuple[str, ...] = ("device_to_host", "host_to_device")
DROP_REASONS: tuple[str, ...] = ("no_backup", "host_full", "orphaned")
LOAD_BACK_REFUSAL_REASONS: tuple[str, ...] = (
    "below_threshold", "over_quota", "device_full", "swa_tail_missing",
)
BACKUP_REFUSAL_REASONS: tuple[str, ...] = BACKUP_REFUSALS  # the tree's, where it counts them

# The shared store (L3): the tier's outcomes (``hicache.l3.stats``), the store's page
# statuses and byte counts (``hicache.storage.StorageStats``), its calls and the queues.
L3_PAGE_STATUSES: tuple[str, ...] = (
    "found", "hit", "missed", "corrupt", "timeout", "error", "written", "skipped", "deleted",
    "evicted",
)
L3_BYTE_KINDS: tuple[str, ...] = ("read", "written", "evicted")
L3_OPS: tuple[str, ...] = (*TIMED_OPS, "delete")
L3_QUEUES: tuple[str, ...] = ("prefetch", "backup")
TP_HELD_KINDS: tuple[str, ...] = ("write", "load", "put", "prefetch")

# Upper bounds of the transfer duration histogram, in seconds: 100 us .. 10 s.
DURATION_BUCKETS_S: tuple[float, ...] = (
    0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05,
    0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0,
)


class MetricSpec(NamedTuple):
    """One exported metric: its exposed name, type, label names and meaning (with unit)."""

    name: str
    type: MetricType
    labels: tuple[str, ...]
    description: str


TRANSFER_TOKENS = "hicache_transfer_tokens_total"
TRANSFER_BYTES = "hicache_transfer_bytes_total"
TRANSFER_OPS = "hicache_transfer_ops_total"
TRANSFER_COMPLETED_OPS = "hicache_transfer_completed_ops_total"
TRANSFER_DURATION = "hicache_transfer_duration_seconds"
IN_FLIGHT_OPS = "hicache_transfer_in_flight_ops"
POOL_USED = "hicache_pool_used_tokens"
POOL_CAPACITY = "hicache_pool_capacity_tokens"
LOOKUP_TOKENS = "hicache_lookup_tokens_total"
HIT_TOKENS = "hicache_hit_tokens_total"
INSERTED_TOKENS = "hicache_inserted_tokens_total"
DUPLICATE_TOKENS = "hicache_duplicate_tokens_total"
EVICTED_TOKENS = "hicache_evicted_tokens_total"
DROPPED_TOKENS = "hicache_dropped_tokens_total"
LOAD_BACK_TOKENS = "hicache_load_back_tokens_total"
BACKUP_TOKENS = "hicache_backup_tokens_total"
REFUSED_LOAD_BACK_TOKENS = "hicache_refused_load_back_tokens_total"
REFUSED_BACKUP_TOKENS = "hicache_refused_backup_tokens_total"
BACKGROUND_ERRORS = "hicache_background_errors_total"
BUILD_INFO = "hicache_build_info"
TP_AGREEMENTS = "hicache_tp_agreements_total"
TP_HELD_OPS = "hicache_tp_held_ops"
L3_ENABLED = "hicache_l3_enabled"
L3_PREFETCHES = "hicache_l3_prefetches_total"
L3_QUERIED_TOKENS = "hicache_l3_queried_tokens_total"
L3_FOUND_TOKENS = "hicache_l3_found_tokens_total"
L3_PREFETCH_TOKENS = "hicache_l3_prefetch_tokens_total"
L3_BACKUP_PAGES = "hicache_l3_backup_pages_total"
L3_WRITTEN_BACK_NODES = "hicache_l3_written_back_nodes_total"
L3_STORE_PAGES = "hicache_l3_store_pages_total"
L3_STORE_BYTES = "hicache_l3_store_bytes_total"
L3_STORE_OPS = "hicache_l3_store_ops_total"
L3_STORE_DURATION = "hicache_l3_store_op_duration_seconds"
L3_QUEUED_JOBS = "hicache_l3_queued_jobs"
L3_OPEN_CIRCUITS = "hicache_l3_open_circuits"
L3_CIRCUIT_OPENS = "hicache_l3_circuit_opens_total"
L3_WORKER_ERRORS = "hicache_l3_worker_errors_total"
L3_WRITE_SHARE_RANKS = "hicache_l3_write_share_ranks"


def _reasons(values: tuple[str, ...]) -> str:
    return ", ".join(f"`{value}`" for value in values)


# Every L3 family is exported from the first scrape, with zeros when the service has no
# shared store (or no longer has one, after stop); `hicache_l3_enabled` tells the two apart.
_L3_METRICS: tuple[MetricSpec, ...] = (
    MetricSpec(L3_ENABLED, "gauge", (),
               "1 while the service has a shared store (L3), else 0 (every other "
               "`hicache_l3_*` family is then all zeros)."),
    MetricSpec(L3_PREFETCHES, "counter", (),
               "Prefetches started: requests whose uncached tail reached "
               "`storage.prefetch_threshold_tokens` (prefetches)."),
    MetricSpec(L3_QUERIED_TOKENS, "counter", (),
               "Tokens prefetches asked the store about, whole pages (tokens)."),
    MetricSpec(L3_FOUND_TOKENS, "counter", (),
               "Queried tokens the store had, in a run from the first page asked about "
               "(tokens)."),
    MetricSpec(L3_PREFETCH_TOKENS, "counter", ("outcome",),
               f"Prefetched tokens by how their page ended: {_reasons(PREFETCH_OUTCOMES)}; "
               "`used` / all is the share of prefetched tokens the cache used (tokens)."),
    MetricSpec(L3_BACKUP_PAGES, "counter", ("outcome",),
               f"Pages backed up to the store, by outcome: {_reasons(BACKUP_OUTCOMES)} "
               "(`dropped`: the backup queue was full) (pages)."),
    MetricSpec(L3_WRITTEN_BACK_NODES, "counter", (),
               "Host nodes written to the store before their host copy was evicted "
               "(`storage.write_policy: write_back`) (nodes)."),
    MetricSpec(L3_STORE_PAGES, "counter", ("status",),
               f"Pages of the store's calls by status: {_reasons(L3_PAGE_STATUSES)}; `found` "
               "by exists, `hit`/`missed` by get, `written`/`skipped` (already stored) by "
               "put, `corrupt` (failed verification, deleted), `timeout` and `error` by any "
               "call but delete, `evicted` by the file store's size cap (pages)."),
    MetricSpec(L3_STORE_BYTES, "counter", ("kind",),
               f"Page bytes of the store, by kind: {_reasons(L3_BYTE_KINDS)} (the pages' rows, "
               f"without an object's header; bytes)."),
    MetricSpec(L3_STORE_OPS, "counter", ("op",),
               f"Calls to the store, by op: {_reasons(L3_OPS)} (ops)."),
    MetricSpec(L3_STORE_DURATION, "histogram", ("op",),
               f"Time of one store call, by op: {_reasons(TIMED_OPS)} (seconds; buckets "
               "50 us .. 10 s)."),
    MetricSpec(L3_QUEUED_JOBS, "gauge", ("queue",),
               f"Jobs waiting for a storage worker, by queue: {_reasons(L3_QUEUES)} (jobs)."),
    MetricSpec(L3_OPEN_CIRCUITS, "gauge", (),
               "Store servers whose circuit is open now: calls to them miss at once until "
               "a retry succeeds (Redis; servers)."),
    MetricSpec(L3_CIRCUIT_OPENS, "counter", (),
               "Times a store server's circuit opened after a failure (Redis; opens)."),
    MetricSpec(L3_WORKER_ERRORS, "counter", (),
               "Exceptions a storage worker caught; the job ended as `error` (errors)."),
    MetricSpec(L3_WRITE_SHARE_RANKS, "gauge", (),
               "Ranks that split the writing of one copy in the store, this one writing the "
               "pages whose hash falls to it (tensor-parallel ranks of an MLA model that see "
               "one store); 0 when this rank writes every page it backs up (ranks)."),
)

METRICS: tuple[MetricSpec, ...] = (
    MetricSpec(TRANSFER_TOKENS, "counter", ("direction", "pool"),
               "Tokens moved by acknowledged transfers, per direction and pool (tokens)."),
    MetricSpec(TRANSFER_BYTES, "counter", ("direction", "pool"),
               "Bytes moved by acknowledged transfers, per direction and pool (bytes); "
               "rate() of it is the achieved bandwidth."),
    MetricSpec(TRANSFER_OPS, "counter", ("direction", "backend"),
               "Transfer ops submitted, by the backend chosen for each op; a (direction, backend) "
               "series appears with its first op, as `auto` picks per op (ops)."),
    MetricSpec(TRANSFER_COMPLETED_OPS, "counter", ("direction",),
               "Transfer ops acknowledged (ops)."),
    MetricSpec(TRANSFER_DURATION, "histogram", ("direction",),
               "Time of one transfer op between its start and finish device events "
               "(seconds; buckets 100 us .. 10 s); only ops timed with CUDA events."),
    MetricSpec(IN_FLIGHT_OPS, "gauge", ("direction",),
               "Transfer ops submitted and not yet acknowledged (ops)."),
    MetricSpec(POOL_USED, "gauge", ("tier", "pool"),
               "Allocated slots of a pool, per tier (`device`, `host`) and pool "
               "(`full`, `swa`) (tokens)."),
    MetricSpec(POOL_CAPACITY, "gauge", ("tier", "pool"),
               "Usable capacity of a pool, per tier and pool (tokens)."),
    MetricSpec(LOOKUP_TOKENS, "counter", (),
               "Tokens looked up by prefix matches, whole pages (tokens)."),
    MetricSpec(HIT_TOKENS, "counter", ("tier",),
               "Looked-up tokens found in the cache, by the tier that held them: `device`, "
               "or `host` only (tokens)."),
    MetricSpec(INSERTED_TOKENS, "counter", (),
               "Tokens newly cached by inserts (tokens)."),
    MetricSpec(DUPLICATE_TOKENS, "counter", (),
               "Inserted tokens the cache already held in other slots; those slots were "
               "freed (tokens)."),
    MetricSpec(EVICTED_TOKENS, "counter", ("tier",),
               "Tokens evicted from a tier to make room: `device` frees device slots (a "
               "backed-up prefix keeps its host copy, the rest are also counted as dropped), "
               "`host` removes host-only prefixes (tokens)."),
    MetricSpec(DROPPED_TOKENS, "counter", ("reason",),
               "Tokens removed from the cache without a host copy, by reason: "
               f"{_reasons(DROP_REASONS)} (tokens)."),
    MetricSpec(LOAD_BACK_TOKENS, "counter", (),
               "Tokens queued for load-back from host to device (tokens)."),
    MetricSpec(BACKUP_TOKENS, "counter", (),
               "Tokens whose device-to-host backup was acknowledged (tokens)."),
    MetricSpec(REFUSED_LOAD_BACK_TOKENS, "counter", ("reason",),
               "Host hits not loaded back, by reason: "
               f"{_reasons(LOAD_BACK_REFUSAL_REASONS)} (tokens)."),
    MetricSpec(REFUSED_BACKUP_TOKENS, "counter", ("reason",),
               f"Backups not made, by reason: {_reasons(BACKUP_REFUSAL_REASONS)} (tokens)."),
    MetricSpec(BACKGROUND_ERRORS, "counter", (),
               "Exceptions raised in the service's background thread (errors)."),
    MetricSpec(BUILD_INFO, "gauge", ("version",),
               "Always 1; `version` is the hicache package version of the process."),
    MetricSpec(TP_AGREEMENTS, "counter", (),
               "Steps this tensor-parallel rank agreed with the others of its group "
               "(`build_service(..., tp_group=...)`; 0 without a group) (steps)."),
    MetricSpec(TP_HELD_OPS, "gauge", ("kind",),
               "What this tensor-parallel rank held after its last step, by kind: "
               "`write` and `load` transfers finished here and not yet on every rank, "
               "`put` and `prefetch` store jobs not yet agreed back on every rank; a rank "
               "that holds more than the others waits for a slower one (ops)."),
    *_L3_METRICS,
)

_BY_NAME = {spec.name: spec for spec in METRICS}


def spec_of(name: str) -> MetricSpec:
    """The :class:`MetricSpec` named ``name`` (raises ``KeyError`` for an unknown name)."""
    return _BY_NAME[name]


def sample_names() -> frozenset[str]:
    """Every sample name a scrape can contain (histograms add ``_bucket``/``_sum``/``_count``)."""
    names: set[str] = set()
    for spec in METRICS:
        if spec.type == "histogram":
            names.update(spec.name + suffix for suffix in ("_bucket", "_sum", "_count"))
        else:
            names.add(spec.name)
    return frozenset(names)


def markdown_table() -> str:
    """A Markdown table of :data:`METRICS` (name, type, labels, meaning), for the README."""
    rows = ["| metric | type | labels | meaning |", "|---|---|---|---|"]
    for spec in METRICS:
        labels = ", ".join(f"`{label}`" for label in spec.labels) or "-"
        name = f"`{spec.name}`"
        if spec.type == "histogram":
            name += " (`_bucket`, `_sum`, `_count`)"
        rows.append(f"| {name} | {spec.type} | {labels} | {spec.description} |")
    return "\n".join(rows) + "\n"
