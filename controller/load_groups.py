"""Layer groups of a layer-wise load: which consecutive model layers one copy moves.

A layer-wise load makes each model layer ready on its own, so the forward can compute layer
``i`` while later layers still cross the link. Issuing one copy per layer costs CPU time per
layer (a kernel launch with its argument handling, or a staged chunk), and for small ops that
time was longer than the transfer itself: measured on an H100, 2.9-8.3 ms of CPU to issue a
256-token load of 32 layers (32 MiB, about 0.6 ms on the link), so such loads reached 23% of
the link. A group of consecutive layers is moved by one copy per pool, and the event of
every layer in it is recorded after that copy: events keep their meaning ("this layer's rows
are in place"), the layers of one group become ready together.

The rule (:func:`plan_load_groups`):

- **Layer 0 alone.** The forward's first layer waits on it; it is ready after one layer's
  transfer, as with per-layer copies.
- **A group is no larger than all the layers before it** (:data:`RAMP_FACTOR` 1: sizes 1, 1,
  2, 4, 8, ...). A layer is then ready at most about twice as late as per-layer copies would
  make it ready, and the ramp costs only about ``log2(num_layers)`` copies. Where one copy's
  CPU cost exceeds its transfer (small ops), each ramp copy is on the critical path; a larger
  factor (3: sizes 1, 3, 12, ...) reaches the bounds below in fewer copies, at the price of
  coarser readiness early in the forward.
- **At most** :data:`GROUP_BYTES` **per group**, unless one layer alone is more. 16 MiB take
  about 300 us at the 55 GB/s host-to-device ceiling, longer than the most CPU time one copy
  was measured to cost (the slowest backend and layout: 8.3 ms for 32 copies, about 260 us
  each; the fastest about 90 us).
  Once groups reach that size the CPU issues the next copy before the link has finished the
  current one, so larger groups would only delay readiness. The same bound keeps big ops
  per layer: when two layers together exceed it (more than 8 MiB per layer: above 2048
  tokens of K and V rows of 2 KiB), every layer is its own copy, with the finest overlap
  (down to the copy count bound below).
- **At most about** :data:`MAX_COPIES` **copies per op**: groups may always grow (by the
  ramp) to ``ceil((num_layers - 1) / (MAX_COPIES - 1))`` layers, whatever the byte bound
  says (the ramp adds a few copies: 13 for a big load of 32 layers). Each
  copy costs about 100 us of CPU on an H100 host (a kernel launch through Triton's launcher),
  so 32 per-layer copies of a 32k-token load took 3.7-5.7 ms to issue; 16 keep a load's issue
  near 2 ms. A big op's groups of 2-3 layers each take milliseconds on the link, so the
  forward's wait grows by a layer or two at most, while the CPU issues the op sooner.
- **At most** :data:`MAX_GROUP_SHARE` **of the layers per group.** The last group's layers
  become ready together at the end of the op; a forward that has caught up with the load
  computes them after it. A quarter of the model bounds that tail; at 32 layers a
  256-token load is 7 copies (1, 1, 2, 4, 8, 8, 8 layers) instead of 32.

A backend whose copy call is cheap (``direct``: a copy-engine call of a few microseconds,
:attr:`~hicache.controller.base.TransferBackend.cheap_copies`) has no copy-count bound: a
big load's layers are then copied and made ready one by one (the finest overlap), and the
byte, share and ramp rules still group a small load's layers.

A ``kernel`` load of one pool holding every model layer, where the driver can make a stream
wait on a counter, is not grouped: it is layer 0 and then one counted launch of the rest,
each layer ready on its own (:mod:`.layer_counters`).

Every backend moves a multi-layer local list in one call: ``torch`` in one stack, ``kernel``
in one launch per contiguous range of local layers, ``staged`` in chunks sized by its staging
budget for the layers moved (``chunk_tokens``). A hybrid pool that holds only some model
layers gets, per group, the local layers of the group's model layers that it holds, in order
(:func:`local_groups`).
"""

from __future__ import annotations

import bisect
import functools

GROUP_BYTES = 16 * 2**20
MAX_COPIES = 16
MAX_GROUP_SHARE = 0.25
RAMP_FACTOR = 1


def plan_load_groups(num_layers: int, layer_bytes: int, cheap_copies: bool = False
                     ) -> tuple[range, ...]:
    """The groups of consecutive model layers a layer-wise load issues as one copy each.

    Args:
        num_layers: model layers of the load (>= 1).
        layer_bytes: bytes the load moves per model layer (every pool, K and V), >= 0.
        cheap_copies: the backend's copy call costs a few microseconds of CPU (``direct``:
            no kernel launch, no staging chunk), so the copy-count bound is dropped and a
            big load's layers become ready one by one, as a bare per-layer copy makes them.
    Returns:
        ``range`` s of model layer ids covering ``0 .. num_layers - 1`` once, in order; the
        first is ``range(0, 1)``.
    Raises:
        ValueError: ``num_layers < 1`` or ``layer_bytes < 0``.
    """
    if num_layers < 1:
        raise ValueError(f"plan_load_groups: num_layers must be >= 1, got {num_layers}")
    if layer_bytes < 0:
        raise ValueError(f"plan_load_groups: layer_bytes must be >= 0, got {layer_bytes}")
    by_bytes = GROUP_BYTES // layer_bytes if layer_bytes else num_layers
    by_share = int(num_layers * MAX_GROUP_SHARE)
    for_copies = 1 if cheap_copies else copy_bound_layers(num_layers)
    return _groups(num_layers, max(1, for_copies, min(by_bytes, by_share)), RAMP_FACTOR)


def copy_bound_layers(num_layers: int) -> int:
    """The group size the copy-count bound allows at least: ``(num_layers - 1)`` layers
    after layer 0 in ``MAX_COPIES - 1`` groups."""
    return -(-(num_layers - 1) // max(1, MAX_COPIES - 1))


@functools.lru_cache(maxsize=256)
def _groups(num_layers: int, max_layers: int, ramp: int) -> tuple[range, ...]:
    groups = [range(0, 1)]
    begin = 1
    while begin < num_layers:
        end = min(begin + min(ramp * begin, max_layers), num_layers)
        groups.append(range(begin, end))
        begin = end
    return tuple(groups)


@functools.lru_cache(maxsize=256)
def local_groups(pool_layers: tuple[int, ...],
                 groups: tuple[range, ...]) -> tuple[tuple[int, ...], ...]:
    """Per group, the local layer ids of a pool holding model layers ``pool_layers``
    (``pool_layers[i]`` is the model id of local layer ``i``) that fall in the group, in
    local order; empty where the pool holds none of the group's layers."""
    first_of = [group.start for group in groups]
    found: list[list[int]] = [[] for _ in groups]
    for local, model in enumerate(pool_layers):
        assert 0 <= model < groups[-1].stop, (
            f"pool layer {local} is model layer {model}, outside the load's "
            f"{groups[-1].stop} layers")
        found[bisect.bisect_right(first_of, model) - 1].append(local)
    return tuple(tuple(layers) for layers in found)
