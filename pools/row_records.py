"""Record views of a CPU pool's rows: one numpy element per token row of one component of
one layer, so a transfer on a CPU copies rows by index in one numpy call per layer.

A torch index op on a CPU costs several microseconds of dispatch even for a handful of rows
(the rows the scheduler's bookkeeping moves on a CPU are tiny); a numpy fancy index of
fixed-size records is a plain memcpy per row. The views share the pool's memory (never a
copy), and any dtype works, ``bfloat16`` included: the rows are reinterpreted as bytes.
"""

from __future__ import annotations

import numpy as np
import torch


def row_records(rows: torch.Tensor) -> np.ndarray:
    """``[num_slots]`` records of ``rows`` (a CPU ``[num_slots, row_elems]`` view whose rows
    are contiguous, possibly strided between rows); writing a record writes the pool."""
    assert rows.device.type == "cpu" and rows.dim() == 2 and rows.stride(-1) == 1, (
        f"row records need CPU rows contiguous within a row, got {rows.device} "
        f"shape {tuple(rows.shape)} strides {rows.stride()}")
    raw = rows.view(torch.uint8).numpy()  # [num_slots, row_bytes], the pool's memory
    # the dtype from its string: the ``(np.void, n)`` form runs a Python helper of numpy's
    # that clears any exception raised inside it, so a Ctrl-C landing there was lost
    records = raw.view(np.dtype(f"V{raw.shape[1]}"))[:, 0]  # indexing: always a view
    assert np.may_share_memory(records, raw), "row records must alias the pool"
    return records


def layer_records(rows_of: list[list[torch.Tensor]]) -> list[list[np.ndarray]]:
    """:func:`row_records` of every ``rows_of[component][layer]``."""
    return [[row_records(rows) for rows in component] for component in rows_of]
