"""What the demo measured: where prompt tokens came from, what moved, what was verified.

Transfer bandwidth needs durations. On a GPU each acknowledged op carries its duration
between two CUDA events; the first op of each direction is left out of the rate, as it
includes compiling the transfer kernel. On a CPU moves are synchronous, so
:class:`TransferTimer` takes the wall time of ``start_writing`` / ``start_loading``: the copy
plus its bookkeeping (reported as such; a lower bound of the bandwidth). Either way the
demo's ops move a few pages each, far too few to approach the link: ``hicache bench``
measures bandwidth.
"""

from __future__ import annotations

import json
import time
from collections import defaultdict
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from hicache.controller import Ack, Direction, TransferCore

DIRECTIONS = {Direction.DEVICE_TO_HOST.value: "device -> host",
              Direction.HOST_TO_DEVICE.value: "host -> device"}


class TransferTimer:
    """Seconds spent moving bytes, per direction (event time on a GPU, wall time on a CPU).

    Wraps the controller's ``start_writing``, ``start_loading`` and ``poll_acks`` (instance
    attributes; :meth:`close` restores them). Every acknowledgement goes through
    ``poll_acks``: the controller's ``poll`` and ``drain`` call it, and so do the service's
    ``step`` and its background thread, which never call ``poll``.
    """

    def __init__(self, controller: TransferCore) -> None:
        self.controller = controller
        self.on_gpu = controller.device.type == "cuda"
        self.seconds: dict[str, float] = defaultdict(float)
        self.timed_bytes: dict[str, int] = defaultdict(int)
        self._acks: dict[str, int] = defaultdict(int)
        self._start_writing = controller.start_writing
        self._start_loading = controller.start_loading
        self._poll_acks = controller.poll_acks
        controller.start_writing = self._timed(self._start_writing,  # type: ignore[method-assign]
                                               Direction.DEVICE_TO_HOST)
        controller.start_loading = self._timed(self._start_loading,  # type: ignore[method-assign]
                                               Direction.HOST_TO_DEVICE)
        controller.poll_acks = self._acknowledged  # type: ignore[method-assign]

    @property
    def method(self) -> str:
        if self.on_gpu:
            return "cuda events, first op per direction left out"
        return "wall time of synchronous CPU copies"

    def rate(self, direction: str) -> float | None:
        """GB/s of ``direction`` over the timed ops; ``None`` when none was timed."""
        seconds, size = self.seconds.get(direction, 0.0), self.timed_bytes.get(direction, 0)
        return size / seconds / 1e9 if seconds > 0 and size else None

    def close(self) -> None:
        for name in ("start_writing", "start_loading", "poll_acks"):
            self.controller.__dict__.pop(name, None)

    def _timed(self, method: Callable[[], Any], direction: Direction) -> Callable[[], Any]:
        def timed() -> Any:
            start = time.perf_counter()
            result = method()
            if not self.on_gpu:
                self.seconds[direction.value] += time.perf_counter() - start
            return result
        return timed

    def _acknowledged(self) -> list[Ack]:
        acks = self._poll_acks()
        for ack in acks:
            direction = ack.direction.value
            self._acks[direction] += 1
            if self.on_gpu and (ack.duration_s is None or self._acks[direction] == 1):
                continue  # untimed, or the warm-up op
            if ack.duration_s is not None:
                self.seconds[direction] += ack.duration_s
            self.timed_bytes[direction] += sum(ack.bytes_by_pool.values())
        return acks


@dataclass
class TransferLine:
    """One direction's totals; ``seconds`` and ``gb_per_s`` cover the timed ops only
    (``None`` when none was timed)."""

    direction: str
    tokens: int
    size_bytes: int
    seconds: float | None
    gb_per_s: float | None
    mean_host_run_tokens: float | None = None


@dataclass
class DemoReport:
    """Everything ``hicache demo`` prints and writes as JSON (token counts are prompt
    tokens unless named otherwise)."""

    config: str
    device: str
    seed: int
    requests: int
    conversations: int
    write_policy: str = ""
    prompt_tokens: int = 0
    device_hit_tokens: int = 0
    host_hit_tokens: int = 0
    recomputed_tokens: int = 0
    new_tokens: int = 0
    generated_tokens: int = 0
    retracted_requests: int = 0
    evicted_device_tokens: int = 0
    evicted_host_tokens: int = 0
    backed_up_tokens: int = 0
    loaded_back_tokens: int = 0
    swa: dict[str, int] | None = None
    """Hybrid models: SWA rows (tokens) copied to the host as they left a window, restored
    by load-backs, evicted from the device (and host copies evicted) on their own, and the
    host SWA pool in use."""
    refused_load_backs: dict[str, int] = field(default_factory=dict)
    transfers: list[TransferLine] = field(default_factory=list)
    timing_method: str = ""
    pages_checked: int = 0
    pages_from_store_checked: int = 0  # of them, pages that came from the shared store
    page_mismatches: list[str] = field(default_factory=list)
    token_mismatch: str | None = None
    corruption_requested: bool = False
    corrupted_host_slot: int | None = None
    metrics: str = "off"
    engine_s: float = 0.0
    baseline_s: float = 0.0
    l3_from_store_tokens: int = 0
    """Prompt tokens that came from the shared store (prefetched into the host tier)."""
    l3: dict[str, Any] | None = None
    """With ``--storage``: the store, pages stored, and the second instance's figures."""

    @property
    def saved_tokens(self) -> int:
        """Prefill tokens not computed thanks to the cache (device and host hits)."""
        return self.device_hit_tokens + self.host_hit_tokens

    @property
    def passed(self) -> bool:
        return self.failure() is None

    def failure(self) -> str | None:
        """The first reason verification failed, as one line; ``None`` when it passed."""
        if self.page_mismatches:
            more = len(self.page_mismatches) - 1
            return self.page_mismatches[0] + (f" (and {more} more pages)" if more else "")
        if self.token_mismatch is not None:
            return self.token_mismatch
        if self.corruption_requested and self.corrupted_host_slot is None:
            return "--corrupt-host-byte: no page was loaded back, so nothing was corrupted"
        return None

    def to_json(self) -> dict[str, Any]:
        data = asdict(self)
        data.update(saved_tokens=self.saved_tokens, passed=self.passed, failure=self.failure())
        return data

    def write_json(self, path: str | Path) -> None:
        Path(path).write_text(json.dumps(self.to_json(), indent=2) + "\n", encoding="utf-8")

    def format(self) -> str:
        """The human-readable report (several lines, no trailing newline)."""
        pct = 100.0 / max(self.prompt_tokens, 1)
        lines = [
            f"hicache demo: {self.requests} requests from {self.conversations} conversations "
            f"on {self.device} (config {self.config}, seed {self.seed}, write policy "
            f"{self.write_policy})",
            f"  prompt tokens      {self.prompt_tokens:>8}",
            f"    from device      {self.device_hit_tokens:>8}  "
            f"({self.device_hit_tokens * pct:.1f}%)",
            f"    from host        {self.host_hit_tokens:>8}  ({self.host_hit_tokens * pct:.1f}%)",
            f"    recomputed       {self.recomputed_tokens:>8}  "
            f"({self.recomputed_tokens * pct:.1f}%)  cached, but not reusable",
            f"    not cached       {self.new_tokens:>8}  ({self.new_tokens * pct:.1f}%)  "
            f"new, or evicted from both tiers",
            f"  prefill saved      {self.saved_tokens:>8} tokens",
            f"  generated tokens   {self.generated_tokens:>8}",
            f"  retracted          {self.retracted_requests:>8} requests (device pools full; "
            f"restarted later)",
            f"  evicted            {self.evicted_device_tokens:>8} device tokens, "
            f"{self.evicted_host_tokens} host tokens",
            f"  backed up          {self.backed_up_tokens:>8} tokens, loaded back "
            f"{self.loaded_back_tokens}",
        ]
        if self.swa is not None:
            swa = self.swa
            lines.append(
                f"  sliding window     {swa['window_backup_tokens']:>8} SWA rows backed up as "
                f"they left the window, {swa['restored_tokens']} restored, "
                f"{swa['evicted_tokens']} evicted (host copies: "
                f"{swa.get('host_evicted_tokens', 0)}); host SWA pool {swa['host_used_tokens']} "
                f"tokens in use ({swa['host_used_bytes']} bytes)")
        if self.l3 is not None:
            lines += _store_lines(self.l3, self.l3_from_store_tokens)
        if self.refused_load_backs:
            refused = ", ".join(f"{k} {v}" for k, v in sorted(self.refused_load_backs.items()))
            lines.append(f"  refused load-backs {refused}")
        lines += [_transfer_line(t) for t in self.transfers]
        lines += [
            f"  (durations: {self.timing_method}; a few pages per op: hicache bench "
            f"measures bandwidth)",
            f"  metrics            {self.metrics}",
            f"  time               engine {self.engine_s:.1f} s, baseline {self.baseline_s:.1f} s",
            f"  verified           {self.pages_checked} loaded pages against their backups, "
            f"{self.generated_tokens} tokens against the baseline",
        ]
        if self.corrupted_host_slot is not None:
            lines.append(f"  corrupted          one byte of host slot {self.corrupted_host_slot} "
                         f"(--corrupt-host-byte)")
        lines += [f"  MISMATCH page: {m}" for m in self.page_mismatches[:5]]
        if self.token_mismatch is not None:
            lines.append(f"  MISMATCH token: {self.token_mismatch}")
        lines.append("  result             " + ("PASS" if self.passed else "FAIL"))
        return "\n".join(lines)


def _store_lines(l3: dict[str, Any], first_from_store: int) -> list[str]:
    second = l3["second_prompt_tokens"]
    pct = 100.0 * l3["second_from_store_tokens"] / max(second, 1)
    return [
        f"  shared store       {l3['store']}: {l3['stored_pages']} pages stored; "
        f"{first_from_store} prompt tokens came back from it after host eviction",
        f"  second instance    empty device and host, same store, same requests: "
        f"{l3['second_from_store_tokens']} of {second} prompt tokens ({pct:.1f}%) from the "
        f"store; {l3['second_store_pages_checked']} loaded pages from the store verified "
        f"against the first instance's backups, {l3['second_pages_checked']} in all",
    ]


def transfer_lines(controller: TransferCore, timer: TransferTimer) -> list[TransferLine]:
    """Per-direction totals from the controller's ``TransferStats`` and the timer."""
    stats = controller.stats
    lines = []
    for direction in DIRECTIONS:
        tokens = sum(n for (d, pool), n in stats.tokens.items() if d == direction and
                     pool == controller.device_pool.name)
        size = sum(n for (d, _), n in stats.bytes.items() if d == direction)
        run = stats.mean_host_run_tokens(direction, controller.device_pool.name)
        lines.append(TransferLine(direction, tokens, size, timer.seconds.get(direction),
                                  timer.rate(direction), run))
    return lines


def _transfer_line(line: TransferLine) -> str:
    rate = f"{line.gb_per_s:.2f} GB/s" if line.gb_per_s is not None else "n/a GB/s"
    timed = f" over {line.seconds * 1e3:.1f} ms timed" if line.seconds else ""
    runs = (f", host runs {line.mean_host_run_tokens:.1f} tokens on average"
            if line.mean_host_run_tokens is not None else "")
    return (f"  {DIRECTIONS[line.direction]:<18} {line.size_bytes / 2**20:>8.2f} MiB "
            f"({line.tokens} tokens), {rate}{timed}{runs}")
