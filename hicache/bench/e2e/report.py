"""One row per prefix length of ``hicache bench e2e``, its derived speedups, the table.

Times are milliseconds, medians of the repeats (the contiguous copy: the best, a ceiling):

- ``recompute_prefix_ms``: the prefill of the ``N`` cached tokens alone (the issue's anchor
  compares it with the copy of their KV);
- ``recompute_ms``: the time to first token without a cache, the prefill of all ``N + M``;
- ``copy_ms``: one contiguous pinned host-to-device copy of the ``N`` tokens' KV bytes;
- ``resident_ms``: the forward of the ``M`` new tokens with the prefix's KV on the device;
- ``bare_ms``: the same forward overlapped with a bare layer-wise copy of the prefix's KV
  bytes from the host pool's own pages (two ``copy_`` per layer on a side stream, one
  event per layer; :mod:`.bare`);
- ``hit_ms``: the time to first token of the host hit through hicache: match, load-back,
  ``start_loading``, the forward waiting for each layer in the pool's accessors;
- ``device_hit_ms``: the same request with the prefix already in hicache's device pool: match,
  lock, pages for the new tokens, the forward through the pool (no load). The host hit over
  it is what the load costs an engine that keeps its KV in the pool; the device hit over
  ``resident`` is what the pool's path costs over the dense buffers.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any

# The measured anchor on an H100: recomputing N tokens over copying their KV at the
# ceiling, per layer.
ANCHOR_X = {512: 8.2, 2048: 8.8, 8192: 10.3, 32768: 12.1}


@dataclass(frozen=True)
class E2ERow:
    """One prefix length; see the module docstring for each time. ``outputs_equal``: the
    host hit's output equals the resident forward's bit for bit (``hit_max_diff`` is their
    largest difference); ``recompute_rel_diff``: the largest difference from the recompute's
    last ``M`` outputs over their largest magnitude; ``gathered_layers``: layers whose pool
    rows were not one run of slots and were gathered (0 on a fresh pool)."""

    cached_tokens: int
    new_tokens: int
    recompute_prefix_ms: float
    recompute_ms: float
    copy_ms: float
    resident_ms: float
    bare_ms: float
    hit_ms: float
    device_hit_ms: float
    outputs_equal: bool
    hit_max_diff: float
    recompute_rel_diff: float
    gathered_layers: int

    @property
    def anchor_x(self) -> float | None:
        return ANCHOR_X.get(self.cached_tokens)

    @property
    def recompute_over_copy_x(self) -> float:
        """The anchor's ratio measured in this run."""
        return self.recompute_prefix_ms / self.copy_ms

    @property
    def ideal_x(self) -> float:
        """The best speedup a host hit can give: no forward of the new tokens ends before
        they are computed with the KV resident, nor before the KV arrived at the ceiling."""
        return self.recompute_ms / max(self.copy_ms, self.resident_ms)

    @property
    def hit_x(self) -> float:
        return self.recompute_ms / self.hit_ms

    @property
    def of_ideal_pct(self) -> float:
        return 100.0 * self.hit_x / self.ideal_x

    @property
    def over_bare_pct(self) -> float:
        """What the load path adds to the time to first token over the bare copy's."""
        return 100.0 * (self.hit_ms / self.bare_ms - 1.0)

    @property
    def over_device_hit_pct(self) -> float:
        """What the load adds to the time to first token over a device hit's."""
        return 100.0 * (self.hit_ms / self.device_hit_ms - 1.0)

    def as_dict(self) -> dict[str, Any]:
        derived = ("anchor_x", "recompute_over_copy_x", "ideal_x", "hit_x", "of_ideal_pct",
                   "over_bare_pct", "over_device_hit_pct")
        return {**asdict(self), **{name: getattr(self, name) for name in derived}}


COLUMNS = (("cached", 7), ("recompute", 10), ("copy", 8), ("resident", 9), ("bare", 8),
           ("dev hit", 8), ("hicache", 8), ("anchor", 7), ("rec/copy", 9), ("ideal", 7),
           ("hicache", 8), ("of ideal", 9), ("vs bare", 8), ("vs dev hit", 11), ("output", 8),
           ("vs recompute", 13))


def render(rows: list[E2ERow], title: str) -> str:
    """The title, a header, one line per row and a legend."""
    header = " ".join(f"{name:>{width}}" for name, width in COLUMNS)
    lines = [title, header, "-" * len(header)]
    for row in rows:
        anchor = "" if row.anchor_x is None else f"{row.anchor_x:.1f}x"
        output = "bitwise" if row.outputs_equal else f"{row.hit_max_diff:.1e}"
        cells = (str(row.cached_tokens), f"{row.recompute_ms:.2f}", f"{row.copy_ms:.2f}",
                 f"{row.resident_ms:.2f}", f"{row.bare_ms:.2f}", f"{row.device_hit_ms:.2f}",
                 f"{row.hit_ms:.2f}", anchor, f"{row.recompute_over_copy_x:.1f}x",
                 f"{row.ideal_x:.2f}x", f"{row.hit_x:.2f}x", f"{row.of_ideal_pct:.1f}%",
                 f"{row.over_bare_pct:+.1f}%", f"{row.over_device_hit_pct:+.1f}%", output,
                 f"{row.recompute_rel_diff:.1e}")
        lines.append(" ".join(f"{c:>{w}}" for c, (_, w) in zip(cells, COLUMNS, strict=True)))
    lines.append(
        "(ms, medians: recompute = prefill of cached + new tokens; copy = one contiguous "
        "pinned copy of the cached tokens' KV (best); resident = the new tokens' forward with "
        "that KV on the device; bare = that forward overlapped with a bare layer-wise copy; "
        "dev hit = the request as a device hit through hicache's pool (no load); "
        "hicache = match + load-back + that forward waiting per layer. anchor: the issue's "
        "recompute/copy on an H100; rec/copy: the same here (prefill of the cached tokens "
        "alone over copy); ideal = recompute / max(copy, resident); hicache = recompute / "
        "hicache; vs bare: hicache over bare; vs dev hit: hicache over dev hit (the load's "
        "cost); output: host hit vs resident; vs recompute: "
        "largest difference over largest value)")
    return "\n".join(lines)
