"""Transfer ops, acknowledgements and the backend interface of the cache controller.

A :class:`TransferOp` is one asynchronous move between host and device pools. It carries a
list of :class:`PoolTransfer` (the primary full-attention transfer first, then side pools
such as SWA) and owns every tensor a side stream reads for it (``keep_alive``) until its
finish event has fired and :meth:`CacheController.poll` has acknowledged it.
"""

from __future__ import annotations

import enum
from abc import ABC, abstractmethod
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, NamedTuple

import numpy as np
import torch

from hicache.pools import DeviceKVPool, HostKVPool, HostLayout, Indices
from hicache.pools.page_ids import is_run

from .events import Event

if TYPE_CHECKING:
    from .direct import DirectMove
    from .inflight import HeldCall
    from .row_copy import RowCopy
    from .staged_chunk import StagedMove


class Direction(enum.Enum):
    """``DEVICE_TO_HOST`` backs pages up (write); ``HOST_TO_DEVICE`` loads them back."""

    DEVICE_TO_HOST = "device_to_host"
    HOST_TO_DEVICE = "host_to_device"

    __hash__ = object.__hash__  # singletons: identity hash, in C (as IndexSpace)


@dataclass(eq=False)
class PoolTransfer:
    """The part of an op that moves rows of one pool pair.

    Args:
        name: pool name (``full``, ``swa``): labels metrics and errors.
        host_pool, device_pool: the two pools; their index spaces must match the indices.
        host_indices, device_indices: aligned ``[n]`` CPU slot indices (bookkeeping form).
        layers: model layer ids this pool stores, in its local layer order
            (``layers[i]`` is the model id of local layer ``i``).
    """

    name: str
    host_pool: HostKVPool
    device_pool: DeviceKVPool
    host_indices: Indices
    device_indices: Indices
    layers: tuple[int, ...]

    @property
    def num_tokens(self) -> int:
        return len(self.host_indices)

    @property
    def token_bytes(self) -> int:
        """Bytes one token moves: every component of every layer of this pool."""
        return self.device_pool.geometry.token_bytes(len(self.layers))

    @property
    def size_bytes(self) -> int:
        return self.num_tokens * self.token_bytes


BLOCK_MIN_ROWS = 256  # moves shorter than this copy row by row: no run is looked for


class SlotPages(NamedTuple):
    """The page ids of a transfer's host and device slots (whole pages, in slot order, from
    its entry checks and allocations) and the slots per page of each: a backend learns
    from them, without reading the slots, whether each side is one run.
    ``host_ascending``: the host pages are an allocation's (ascending, distinct)."""

    host_pages: np.ndarray
    host_page_size: int
    device_pages: np.ndarray
    device_page_size: int
    host_ascending: bool

    def runs(self) -> tuple[slice | None, slice | None]:
        """The host and device slots each as a slice when they are one ascending run, else
        ``None``: an allocation's ascending host pages by their first and last."""
        host, device = self.host_pages, self.device_pages
        if not host.size:
            return None, None
        host_run = (host.item(-1) - host.item(0) == host.size - 1 if self.host_ascending
                    else is_run(host))
        return (_slots(host, self.host_page_size) if host_run else None,
                _slots(device, self.device_page_size) if is_run(device) else None)


def _slots(pages: np.ndarray, page_size: int) -> slice:
    """The slots of a run of ``pages`` (non-empty, ascending, consecutive) as a slice."""
    return slice(pages.item(0) * page_size, (pages.item(-1) + 1) * page_size)


@dataclass(eq=False)
class MovedTransfer:
    """A :class:`PoolTransfer` with its indices where the backend reads them.

    ``host_index`` / ``device_index`` are raw int64 tensors on the devices the backend asked
    for, with padding pairs removed. They are recorded on the stream that reads them. A move
    with a ``device_page_index`` (below) keeps ``device_index`` on the CPU: the backend reads
    the pages, and the slots only where it cannot (uploading them then).
    ``row_selectors``, ``staged_move``, ``row_copy`` and ``direct_move``: what a backend
    derived from them once and reuses for every layer group of a load (the CPU copy's numpy
    selectors; the staged backend's chunks with their host runs and planned copies; the
    kernel's checked launch; the direct backend's runs and copies), made at its first use.
    ``pages``: the page ids of the two index tensors, when the op moves them as they are
    (``None``: not known; a backend reads the slots). ``device_page_index``: for a backend
    that :meth:`~TransferBackend.reads_device_pages`, ``pages.device_pages`` where the device
    index is, uploaded with it (``None``: not known; the backend finds them).
    """

    source: PoolTransfer
    host_index: torch.Tensor
    device_index: torch.Tensor
    row_selectors: tuple[slice | np.ndarray, slice | np.ndarray] | None = None
    pages: SlotPages | None = None
    staged_move: StagedMove | None = None  # the staged backend's plans of this move
    row_copy: RowCopy | None = None  # the kernel backend's prepared launch
    direct_move: DirectMove | None = None  # the direct backend's runs and planned copies
    device_page_index: torch.Tensor | None = None


@dataclass(eq=False, init=False)
class TransferOp:
    """One submitted move. Owns its tensors until acknowledged.

    ``layer_events`` (loads only) has one event per model layer; ``finish_event`` is the
    last one for loads and a dedicated event for writes (on a CPU, where a move is done
    when issued, one completed event the controller shares between ops). ``held`` lists
    the pages of every queued call this op carries (one call's, or every merged call's), and
    ``after`` the events its writes wait on, recorded where those calls were queued:
    the in-flight counts are taken and given back per entry, where no page repeats,
    whereas the merged ``transfers`` may name a host slot twice (two loads of one page).
    ``tokens_by_pool`` / ``bytes_by_pool`` are what its :class:`Ack` reports, counted when
    the op is merged.
    """

    op_id: int
    direction: Direction
    transfers: list[PoolTransfer]
    tags: list[object]
    backend: str = ""
    executor: TransferBackend | None = None
    moved: list[MovedTransfer] = field(default_factory=list)
    keep_alive: list[torch.Tensor] = field(default_factory=list)
    start_event: Event | None = None
    finish_event: Event | None = None
    layer_events: list[Event] = field(default_factory=list)
    event_set: int | None = None
    event_ticket: int = 0  # the ring's ticket for event_set (LayerEventRing.release)
    held: list[HeldCall] = field(default_factory=list)
    after: list[Event] = field(default_factory=list)  # marks of the queuing callers' streams
    tokens_by_pool: dict[str, int] = field(default_factory=dict)
    bytes_by_pool: dict[str, int] = field(default_factory=dict)
    calls: Sequence[object] = ()  # the queued calls merged into it, until it is issued

    def __init__(self, op_id: int, direction: Direction, transfers: list[PoolTransfer],
                 tags: list[object], backend: str = "", executor: TransferBackend | None = None,
                 held: list[HeldCall] | None = None, after: list[Event] | None = None,
                 tokens_by_pool: dict[str, int] | None = None,
                 bytes_by_pool: dict[str, int] | None = None) -> None:
        # Written by hand (one op per merge): the generated one tests a sentinel per
        # defaulted field and calls eight factories, about a third more.
        self.op_id, self.direction, self.transfers, self.tags = op_id, direction, transfers, tags
        self.backend, self.executor = backend, executor
        self.moved, self.keep_alive, self.layer_events = [], [], []
        self.start_event = self.finish_event = None
        self.event_set, self.event_ticket = None, 0
        self.held = [] if held is None else held
        self.after = [] if after is None else after
        self.tokens_by_pool = {} if tokens_by_pool is None else tokens_by_pool
        self.bytes_by_pool = {} if bytes_by_pool is None else bytes_by_pool
        self.calls = ()

    @property
    def primary(self) -> PoolTransfer:
        return self.transfers[0]

    @property
    def num_tokens(self) -> int:
        return self.primary.num_tokens

    def is_done(self) -> bool:
        """Non-blocking: has the finish event fired? (``query()`` only)."""
        assert self.finish_event is not None, f"op {self.op_id} was never submitted"
        return self.finish_event.query()


class Ack(NamedTuple):
    """A finished op as :meth:`CacheController.poll` reports it.

    ``duration_s`` is the transfer time measured between the op's start and finish events
    (``None`` on CPU, where moves are synchronous).
    """

    op_id: int
    direction: Direction
    tags: list[object]
    tokens_by_pool: dict[str, int]
    bytes_by_pool: dict[str, int]
    duration_s: float | None
    backend: str


class HybridSlots(NamedTuple):
    """Slots of a hybrid (full + SWA) op, aligned token by token.

    ``full``: ``[n]`` full-pool slots. ``swa``: ``[n]`` SWA-pool slots of the same space
    family (host or device), 0 where a token has no SWA slot (outside the window).
    """

    full: Indices
    swa: Indices


class TransferBackend(ABC):
    """How rows cross between a host pool and a device pool.

    A backend is stateless apart from configuration. It is called on the side stream that
    the op runs on (the caller has made that stream current) and must not synchronise
    except where documented (the ``torch`` backend on a GPU).
    """

    name: str = "abstract"
    # A copy call costs a few microseconds of CPU (no kernel launch, no staging chunk):
    # layer-wise loads then issue a big load layer by layer (see :mod:`.load_groups`).
    cheap_copies: bool = False
    # CPU seconds one copy call of a layer-wise load takes to issue, for the plan of its
    # layer groups (:mod:`.load_groups`); figures measured on H100/H200 hosts
    copy_s: float = 50e-6
    # Moves a layer-wise load's layers in one launch that counts each layer's rows in place
    # (:meth:`copy_counted`, :mod:`.layer_counters`): ``kernel`` only.
    counts_layers: bool = False

    @abstractmethod
    def index_devices(
        self, host_pool: HostKVPool, device_pool: DeviceKVPool
    ) -> tuple[torch.device, torch.device]:
        """Where this backend wants (host indices, device indices)."""

    def check_device(self, device: torch.device) -> None:
        """Raise ``ValueError`` (naming the backend, ``device`` and the fix) when this backend
        cannot move rows of pools on ``device``. The controller calls it when it is built;
        the default accepts every device."""
        return None

    def select(self, direction: Direction, layout: HostLayout, num_tokens: int,
               layer_wise: bool, pairs: PoolTransfer | None = None) -> TransferBackend:
        """The backend that executes one op (``auto`` chooses per op; others are themselves).
        ``pairs``: the op's primary transfer, whose slots ``auto`` may read (its runs)."""
        return self

    def reads_device_pages(self, host_pool: HostKVPool, device_pool: DeviceKVPool) -> bool:
        """True when this backend reads, where the device index is, the device page of
        every host page of pairs of an op of whole pages (``MovedTransfer.device_page_index``,
        uploaded with the device index from the pages the op's checks found). Default:
        no."""
        return False

    def order_pairs(
        self, host_index: torch.Tensor, device_index: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Reorder aligned CPU int64 index pairs before they are moved (default: as given).
        Called by ``move_indices``; a backend that copies host runs sorts here."""
        return host_index, device_index

    @abstractmethod
    def copy(
        self,
        moved: MovedTransfer,
        local_layers: Sequence[int],
        direction: Direction,
        keep_alive: list[torch.Tensor],
    ) -> None:
        """Move rows of ``local_layers`` for every index pair of ``moved``.

        Temporaries that a stream reads after this returns go into ``keep_alive``; the op
        records them on the stream and keeps them until acknowledged.
        """

    def copy_counted(self, moved: MovedTransfer, layers: range, counters: torch.Tensor
                     ) -> int:
        """Load local ``layers`` of ``moved`` (host to device) in one launch, in layer order,
        adding to ``counters[layer]`` as each layer's rows land; returns what the launch adds
        to each layer's counter, 0 when it launches nothing (no pairs). Only where
        :attr:`counts_layers`."""
        raise NotImplementedError(f"the {self.name} backend does not count layers")
