"""Copy streams that take turns, so a big op never holds the copy engine against another
stream's copy.

The copy engine serves the copies queued on it in order, and it goes on with one stream's
queued copies for as long as that stream has more: a 32k-token load (4 GiB, 77 ms on an
H200's link) issued as copies on one stream made any copy that an engine issued meanwhile on
another stream (a step's input upload, sampled tokens back to the host) wait for the whole
load. Feeding the load's copies from the CPU a few at a time did not help; what does is a
copy that the GPU itself holds back: each copy of the op runs on the other of two streams
than the copy before it and waits on that copy's event, so at most one copy of the op is
queued on the engine, and when it finishes the engine takes whatever another stream queued
before the next one starts. Measured (H200, 4 GiB in chunks, an engine's 64 KiB copy 20 ms
in): one stream made it wait 50-57 ms at 16-128 MiB chunks; taking turns, 0.4-0.75 ms, at
54.4-55.2 GB/s against 54.8-55.3 on one stream (both directions alike).

A turn costs a gap on the link between two copies (a few microseconds: about 3% of a 4 MiB
copy, under 1% of a 16 MiB one), so only a copy of at least :data:`TURN_BYTES` makes the next
one wait: a small op's copies queue together as before (the op itself is short).
"""

from __future__ import annotations

import torch

# A copy of at least this many bytes (0.08 ms on a 50 GB/s link) makes the op's next copy
# wait until it has finished, so another stream's copy never waits behind more than about
# one such copy and what the op queued in the meantime.
TURN_BYTES = 4 << 20


def copy_streams(side: torch.cuda.Stream | None) -> tuple[torch.cuda.Stream | None,
                                                          torch.cuda.Stream | None]:
    """Two new streams on ``side``'s device that take turns for its copies (``None``
    twice on a CPU)."""
    if side is None:
        return None, None
    return torch.cuda.Stream(side.device), torch.cuda.Stream(side.device)


def takes_turns(previous_bytes: int) -> bool:
    """True when the copy after one of ``previous_bytes`` must wait until it has finished."""
    return previous_bytes >= TURN_BYTES
