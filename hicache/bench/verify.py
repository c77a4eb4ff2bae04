"""Bit-exact checks of the benchmark's moves, once per configuration.

Destinations are filled with a sentinel first; after one op every moved row must equal its
source row bit for bit and every other destination row must still hold the sentinel. On a
GPU the host pool is read and written through a device mirror (one contiguous copy each way),
so a check costs a fraction of a second even for gigabytes.
"""

from __future__ import annotations

import torch

from hicache.pools import DeviceKVPool, HostKVPool, HostLayout, as_layer_first

from .workload import BenchmarkError, Issued, Session

SENTINEL_BITS = -7  # int16 pattern of every unwritten bf16 element


def randomize(data: torch.Tensor) -> None:
    """Fill a bf16 buffer with random finite values (never time or check on zeros)."""
    data.view(torch.int16).random_(0, 0x4000)


class Verifier:
    """Checks writes and loads of sessions over one (device pool, host pool) pair."""

    def __init__(self, device_pool: DeviceKVPool, host_pool: HostKVPool) -> None:
        self.device_pool, self.host_pool = device_pool, host_pool
        on_cpu = device_pool.device.type == "cpu"
        self.mirror = host_pool.data if on_cpu else torch.empty_like(
            host_pool.data, device=device_pool.device)

    def check_write(self, session: Session, what: str) -> Issued:
        """Write the session's whole write source once and check the host rows; the written
        host slots become ``session.stored`` (the source of later loads)."""
        if session.stored is not None:
            session.close()
        self._sync()
        self.mirror.view(torch.int16).fill_(SENTINEL_BITS)
        self._push()
        issued = session.write_ops(1, session.tokens)
        session.finish(issued, keep=True)
        session.stored = issued[0].slots
        self._pull()
        host_rows = _canonical(self.mirror, self.host_pool.layout)
        self._compare(host_rows, issued[0].slots.tensor, self.device_pool.data,
                      session.slots.write_source, f"{what} write")
        return issued[0]

    def check_load(self, session: Session, what: str) -> Issued:
        """Load the stored rows once into a sentinel-filled device pool and check them; then
        refill the device pool with random rows."""
        if session.stored is None:
            raise BenchmarkError(f"{what}: check_write must run before check_load")
        self._sync()
        self._pull()
        self.device_pool.data.view(torch.int16).fill_(SENTINEL_BITS)
        issued = session.load_ops(1, session.tokens)
        session.finish(issued, keep=True)
        host_rows = _canonical(self.mirror, self.host_pool.layout)
        try:
            self._compare(self.device_pool.data, issued[0].slots.tensor, host_rows,
                          session.stored.tensor, f"{what} load")
        finally:
            session.ctrl.evict_device(issued[0].slots)
        randomize(self.device_pool.data)
        self._sync()
        return issued[0]

    def _compare(self, dst: torch.Tensor, dst_slots: torch.Tensor, src: torch.Tensor,
                 src_slots: torch.Tensor, what: str) -> None:
        """``dst[c, l, dst_slots] == src[c, l, src_slots]`` bit for bit for every component
        and layer, and every other ``dst`` row holds the sentinel. Both ``[C, L, S, R]``."""
        device = dst.device
        dst_index, src_index = dst_slots.to(device), src_slots.to(device)
        untouched = torch.ones(dst.shape[2], dtype=torch.bool, device=device)
        untouched[dst_index] = False
        for c in range(dst.shape[0]):
            for layer in range(dst.shape[1]):
                got = dst[c, layer].index_select(0, dst_index).view(torch.int16)
                want = src[c, layer].index_select(0, src_index).view(torch.int16)
                if not torch.equal(got, want):
                    bad = int((got != want).any(dim=1).nonzero()[0, 0])
                    raise BenchmarkError(
                        f"MISMATCH in {what}: component {c}, layer {layer}: destination slot "
                        f"{int(dst_slots[bad])} differs from source slot {int(src_slots[bad])}"
                    )
                clean = (dst[c, layer].view(torch.int16) == SENTINEL_BITS).all(dim=1)
                if not bool(clean[untouched].all()):
                    slot = int((~clean & untouched).nonzero()[0, 0])
                    raise BenchmarkError(
                        f"MISMATCH in {what}: component {c}, layer {layer}: slot {slot} is "
                        f"outside the transfer but was written"
                    )

    def _push(self) -> None:
        """mirror -> host pool."""
        if self.mirror is not self.host_pool.data:
            self.host_pool.data.copy_(self.mirror, non_blocking=True)
        self._sync()

    def _pull(self) -> None:
        """host pool -> mirror."""
        if self.mirror is not self.host_pool.data:
            self.mirror.copy_(self.host_pool.data, non_blocking=True)
        self._sync()

    def _sync(self) -> None:
        if self.device_pool.device.type == "cuda":
            torch.cuda.synchronize(self.device_pool.device)


def _canonical(data: torch.Tensor, layout: HostLayout) -> torch.Tensor:
    """``[C, L, S, R]`` rows of a host buffer (or its mirror) in any layout: a view, or for
    ``page_first_direct`` a copy (on the mirror's device; taken after the op it checks)."""
    return as_layer_first(data, layout)
