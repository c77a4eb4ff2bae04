"""The closed choices of the configuration: enums whose string values the YAML file spells.

:mod:`hicache.config.sections` uses them as field types; ``build_section`` turns a YAML
string into the member whose value it is (and suggests the right spelling for a choice
written in the wrong case).
"""

from __future__ import annotations

import enum

import torch


class DType(enum.Enum):
    """Element type of the KV rows."""

    BFLOAT16 = "bfloat16"
    FLOAT16 = "float16"
    FLOAT32 = "float32"

    @property
    def torch_dtype(self) -> torch.dtype:
        return {"bfloat16": torch.bfloat16, "float16": torch.float16,
                "float32": torch.float32}[self.value]


class IOBackend(enum.Enum):
    """How pages cross PCIe: index ops, the Triton UVA kernel, staged copies, copy-engine
    copies per run of slots, or picked."""

    TORCH = "torch"
    KERNEL = "kernel"
    STAGED = "staged"
    DIRECT = "direct"
    AUTO = "auto"


class WritePolicy(enum.Enum):
    """When pages are backed up to the tier below: device to host (``controller``), host to
    the shared store (``storage``)."""

    WRITE_THROUGH = "write_through"
    WRITE_THROUGH_SELECTIVE = "write_through_selective"
    WRITE_BACK = "write_back"


class SWAHistory(enum.Enum):
    """Which SWA rows of a hybrid model the host tier keeps."""

    ALL = "all"
    """Every page's SWA rows follow its full rows to the host: any cached prefix can be
    reused (its window tail is on some tier). The host SWA pool holds as many tokens as the
    host full pool."""
    WINDOW_TAILS = "window_tails"
    """Only the window tail of each inserted sequence: a prefix cut out of a longer sequence
    (a shared system prompt, an earlier turn) cannot be reused. The host SWA pool is sized
    like the device SWA pool (``host.ratio`` x its tokens)."""


class EvictionPolicy(enum.Enum):
    """Which cached prefix leaves a full tier first."""

    LRU = "lru"
    LFU = "lfu"
