"""Always-on bounds checks of slot and page indices that never synchronise and never crash.

A :class:`BoundsGuard` belongs to one device pool. Every public entry that takes indices of
that pool (``set_kv``, translations, page tables, decode-buffer fills) passes them through
:meth:`BoundsGuard.check` once, where they enter:

- **CPU tensors** are checked at once: a negative value or one ``>= bound`` raises
  :class:`BoundsError` before anything is written.
- **CUDA tensors** are checked on the GPU, asynchronously, on the caller's stream, by one
  Triton launch (:mod:`hicache.pools.bounds_kernel`; a few torch ops without Triton, for very
  large tensors and inside CUDA-graph capture): offending entries are redirected to the
  padding slot (slot or page 0, whose rows are cleared after every write, so nothing live is
  written) and the check's smallest and largest excess land, without blocking, in a pinned
  host record. :meth:`BoundsGuard.raise_if_tripped` reads those records on the CPU
  (no synchronisation); the controller's ``poll()`` and the service's ``step()`` call it, so
  the error surfaces at the first of those calls after the GPU ran the check, naming the op,
  the pool, the value and the bound. Nothing raises a device-side assert.

A check's record is one row ``(min(0, min excess), max(0, max excess))`` of a ring of pinned
rows, where ``excess = value - clamp(value, 0, bound - 1)``: zero for a value in range, the
value itself for a negative one and ``value - (bound - 1)`` for one past the end. The CPU
marks a row pending (words no check can produce) before the copy is queued; a row with a
word still pending has not been written by the GPU yet. The ring is read in order; if an
engine made ``RING_ROWS`` checks without a poll, the next check waits for the oldest one
(the only case in which a check blocks).
"""

from __future__ import annotations

import numpy as np
import torch

from .base import PADDING_SLOT, BoundsError, bounds_message, check_now, debug_checks_enabled
from .bounds_kernel import check_with_kernel, kernel_check_available

RING_ROWS = 4096
_PENDING = (1, -1)  # impossible words: a record's first is never > 0, its second never < 0


class BoundsGuard:
    """The bounds checks of one pool and, on CUDA, their pending records.

    Args:
        pool_name: named in every error.
        device: where the pool's indices live.
        deferred: check on the device and report later (default: on CUDA only). ``True`` on
            a CPU runs the same deferred protocol there, which is how it is tested without
            a GPU.
    """

    def __init__(self, pool_name: str, device: torch.device, deferred: bool | None = None
                 ) -> None:
        self.pool_name = pool_name
        self.device = device
        self.deferred = device.type == "cuda" if deferred is None else deferred
        self._records: np.ndarray | None = None  # [RING_ROWS, 2] int64 view of pinned rows
        self._pinned: torch.Tensor | None = None  # the pinned rows themselves
        self._device_rows: torch.Tensor | None = None  # [RING_ROWS, 2] int64 on the device
        self._record_low = self._record_high = torch.empty(0)
        # [2] sticky record of graph replays, made here, outside any capture: made inside
        # one, its zero fill was part of the graph and every replay cleared what the replays
        # before it had found
        self._captured: torch.Tensor | None = None
        self._captured_pinned = torch.empty(0, dtype=torch.int64)
        if device.type == "cuda":
            self._captured = torch.zeros(2, dtype=torch.int64, device=device)
            self._captured_pinned = torch.zeros(2, dtype=torch.int64, pin_memory=True)
        self._captured_ops: list[str] = []  # what was captured (none: nothing to read)
        self._what: list[tuple[str, str, int]] = [("", "", 0)] * RING_ROWS
        self._next = 0  # sequence number of the next check
        self._read = 0  # checks before this one have been read

    def check(self, tensor: torch.Tensor, *, bound: int, op: str, unit: str = "slot"
              ) -> torch.Tensor:
        """Refuse values outside ``[0, bound)``.

        Args:
            tensor: int32/int64 indices of any shape, on the CPU or the pool's CUDA device.
            bound: one past the largest valid value.
            op: the caller, as the error names it (``set_kv(layer=3)``).
            unit: what a value counts (``slot`` or ``page``).
        Returns:
            Checked at once (CPU): ``tensor`` itself. Deferred (CUDA): a new int64 tensor of
            the same shape with offending entries replaced by the padding index 0.
        Raises:
            BoundsError: (CPU) a value is out of range; nothing was changed.
        """
        if tensor.numel() == 0:
            return tensor
        if not self.deferred or debug_checks_enabled():
            check_now(tensor, pool_name=self.pool_name, bound=bound, op=op, unit=unit)
            return tensor
        return self._check_on_device(tensor, bound, op, unit)

    def raise_if_tripped(self) -> None:
        """Raise :class:`BoundsError` for the oldest finished CUDA check that found an
        offending value (each such check is reported once). Reads pinned host memory only:
        checks the GPU has not run yet are left for a later call."""
        if self._records is None and not self._captured_ops:
            return  # no deferred check was ever made (every CPU pool): nothing to read
        self._raise_if_captured_tripped()
        if self._records is None or self._read == self._next:
            return
        first, last = self._read, self._next
        seen = self._records[np.arange(first, last) % RING_ROWS]
        # Each word is pending until the copy wrote it (the two may land in either order).
        pending = np.flatnonzero((seen[:, 0] > 0) | (seen[:, 1] < 0))
        done = int(pending[0]) if pending.size else last - first
        bad = np.flatnonzero(seen[:done].any(axis=1))
        if bad.size == 0:
            self._read = first + done
            return
        index = int(bad[0])
        self._read = first + index + 1
        low, high = (int(v) for v in seen[index])
        op, unit, bound = self._what[(first + index) % RING_ROWS]
        value = low if low < 0 else high + bound - 1
        raise BoundsError(
            bounds_message(op, self.pool_name, unit, value, bound)
            + "; on CUDA the offending entries were redirected to the padding "
            f"{unit} 0, so nothing live was written, but that op's result is wrong"
        )

    @property
    def num_unread(self) -> int:
        """CUDA checks issued and not yet read back (0 on a CPU)."""
        return self._next - self._read

    def _check_on_device(self, tensor: torch.Tensor, bound: int, op: str, unit: str
                         ) -> torch.Tensor:
        if tensor.is_cuda and torch.cuda.is_current_stream_capturing():
            return self._check_captured(tensor, bound, op, unit)
        pinned, device_rows = self._ring(tensor.device)
        if self._next - self._read >= RING_ROWS:
            self._wait_for_oldest()
        assert self._records is not None
        row = self._next % RING_ROWS
        self._records[row] = _PENDING
        self._what[row] = (op, unit, bound)
        self._next += 1
        if kernel_check_available(tensor):
            return check_with_kernel(tensor, bound, pinned[row])
        safe, excess = _clean(tensor, bound)
        record = device_rows[row]
        torch.aminmax(excess, out=(record[0], record[1]))
        # (min(low, 0), max(high, 0)): the words pending marks can never occur
        torch.clamp(record, min=self._record_low, max=self._record_high, out=record)
        pinned[row].copy_(record, non_blocking=True)
        return safe

    def _check_captured(self, tensor: torch.Tensor, bound: int, op: str, unit: str
                        ) -> torch.Tensor:
        """A check recorded into a CUDA graph: every replay folds its excess into one sticky
        device record, copied to pinned memory after each replay's check (a ring row would
        be overwritten by replays long after the CPU read it)."""
        # every caller checked the tensor's device against the pool's first
        assert self._captured is not None and tensor.device == self._captured.device, \
            f"{op}: a captured check of pool '{self.pool_name}' on {tensor.device}"
        safe, excess = _clean(tensor, bound)
        low, high = torch.aminmax(excess)
        torch.minimum(self._captured[0], low, out=self._captured[0])
        torch.maximum(self._captured[1], high, out=self._captured[1])
        self._captured_pinned.copy_(self._captured, non_blocking=True)
        self._captured_ops.append(f"{op} ({unit}s 0..{bound - 1})")
        return safe

    def _raise_if_captured_tripped(self) -> None:
        if self._captured is None or not self._captured_ops:
            return
        low, high = (int(v) for v in self._captured_pinned.numpy())
        if low == 0 and high == 0:
            return
        self._captured.zero_()  # queued on the current stream: later replays start clean
        self._captured_pinned.zero_()
        found = f"a value {low}" if low < 0 else f"a value {high} past its bound"
        raise BoundsError(
            f"a bounds check captured in a CUDA graph found {found} in pool "
            f"'{self.pool_name}' (captured checks: {', '.join(self._captured_ops)}); the "
            f"offending entries were redirected to the padding index 0, so nothing live was "
            f"written, but that replay's result is wrong"
        )

    def _ring(self, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
        if self._pinned is None or self._device_rows is None:
            self._pinned = torch.zeros(RING_ROWS, 2, dtype=torch.int64,
                                       pin_memory=device.type == "cuda")
            self._records = self._pinned.numpy()
            self._device_rows = torch.zeros(RING_ROWS, 2, dtype=torch.int64, device=device)
            limits = torch.iinfo(torch.int64)
            self._record_low = torch.tensor([limits.min, 0], device=device)
            self._record_high = torch.tensor([0, limits.max], device=device)
        return self._pinned, self._device_rows

    def _wait_for_oldest(self) -> None:
        """The ring is full of unread checks: wait until the oldest has run (rare: an engine
        that never polls), then read what is finished."""
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        self.raise_if_tripped()


def _clean(tensor: torch.Tensor, bound: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(int64 ``tensor`` with values outside ``[0, bound)`` set to the padding index,
    ``value - clamp(value, 0, bound - 1)``), in torch ops on the tensor's device."""
    values = tensor.to(torch.int64)
    safe = values.clamp(0, bound - 1)
    excess = values - safe
    safe.masked_fill_(excess != 0, PADDING_SLOT)
    return safe, excess
