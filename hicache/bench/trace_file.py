"""Reading a Mooncake request trace, validated line by line (no torch: the benchmarks read
their trace while checking their arguments, before anything is measured).

Trace format (one JSON object a line): ``input_length`` tokens (a whole number >= 1) and
``hash_ids``, one id (a whole number) per 512-token block, at least as many blocks as the
input needs; other keys (``timestamp``, ``output_length``) are ignored, as are blank lines.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import Any

BLOCK = 512


@dataclasses.dataclass(frozen=True)
class TraceRequest:
    input_length: int
    hash_ids: tuple[int, ...]

    def tokens(self) -> list[int]:
        out = [b * BLOCK + i for b in self.hash_ids for i in range(BLOCK)]
        return out[: self.input_length]


class TraceError(ValueError):
    """A trace that cannot be replayed; the message names the file (and the line)."""


def read_trace(path: Path, limit: int) -> list[TraceRequest]:
    """The first ``limit`` requests of the trace at ``path``.

    Raises:
        TraceError: the file cannot be read, is not UTF-8, a line is not a JSON object
            with a valid ``input_length`` and ``hash_ids``, or it holds no request.
    """
    requests: list[TraceRequest] = []
    try:
        with path.open(encoding="utf-8") as lines:
            for number, line in enumerate(lines, 1):
                if len(requests) >= limit:
                    break
                if line.strip():
                    requests.append(_request(line, f"{path} line {number}"))
    except OSError as exc:
        raise TraceError(f"{path}: cannot read it ({exc.strerror or exc}); name a JSONL "
                         f"trace file") from None
    except UnicodeDecodeError as exc:
        raise TraceError(f"{path}: not UTF-8 text ({exc.reason} at byte {exc.start}); "
                         f"name a JSONL trace file") from None
    if not requests:
        raise TraceError(f"{path}: holds no request; name a trace with at least one line")
    return requests


def _request(line: str, where: str) -> TraceRequest:
    """One line's request; :class:`TraceError` naming ``where`` and what is wrong."""
    try:
        record: Any = json.loads(line)
    except json.JSONDecodeError as exc:
        raise TraceError(f"{where}: not JSON ({exc.msg}); each line must be one JSON "
                         f"object") from None
    if not isinstance(record, dict):
        raise TraceError(f"{where}: not a JSON object; each line must be one")
    length, ids = record.get("input_length"), record.get("hash_ids")
    if not isinstance(length, int) or isinstance(length, bool) or length < 1:
        raise TraceError(f"{where}: input_length {length!r}: need a whole number >= 1")
    if not isinstance(ids, list) or not all(_whole(h) for h in ids):
        raise TraceError(f"{where}: hash_ids {_short(ids)}: need a list of whole numbers, "
                         f"one per {BLOCK}-token block")
    if len(ids) * BLOCK < length:
        raise TraceError(f"{where}: {len(ids)} hash_ids cover {len(ids) * BLOCK} tokens, "
                         f"fewer than input_length {length}; need one id per {BLOCK} tokens")
    return TraceRequest(length, tuple(ids))


def _whole(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _short(value: object) -> str:
    text = repr(value)
    return text if len(text) <= 40 else text[:37] + "..."
