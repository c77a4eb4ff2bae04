"""Layer groups of a layer-wise load: which consecutive model layers one copy moves.

A layer-wise load makes each model layer ready on its own, so the forward can compute layer
``i`` while later layers still cross the link. Issuing one copy per layer costs CPU time per
layer (a kernel launch with its argument handling, or a staged chunk), and for small ops that
time was longer than the transfer itself: measured on an H100, 2.9-8.3 ms of CPU to issue a
256-token load of 32 layers (32 MiB, about 0.6 ms on the link), so such loads reached 23% of
the link. A group of consecutive layers is moved by one copy per pool, and the event of
every layer in it is recorded after that copy: events keep their meaning ("this layer's rows
are in place"), the layers of one group become ready together.

The rule (:func:`plan_load_groups`) models the op as its copies' CPU issue, one after the
other (``copy_s`` each, the backend's :attr:`~hicache.controller.base.TransferBackend.copy_s`),
and the link moving each copy once it is issued and the copies before it are done
(:data:`LINK_BYTES_PER_S`):

- **Layer 0 alone.** The forward's first layer waits on it; it is ready after one copy's
  issue and one layer's transfer, as with per-layer copies.
- **No layer later than** :data:`LATENESS` **times per-layer copies would make it ready.**
  Each group takes as many layers as keep its first layer within that bound. Where copies
  cost more CPU than their layers take on the link (small ops), per-layer copies make a
  layer ready when the CPU reaches it, so groups grow as fast as the CPU falls behind: a
  256-token load of 32 layers (1 MiB a layer, 21 us on the link, 70 us a staged chunk) is 4
  copies (1, 8, 16, 7 layers): in the model its last layer is ready after 0.79 ms, against
  2.26 ms with 32 copies and 0.87 ms with the fixed ramp used before (1, 1, 2, 4, 8, 8, 8),
  and the CPU issues 3 copies fewer than that ramp. Where the link is the slower (big ops),
  groups grow about as fast as the layers before them: a layer is ready at most about
  twice as late as per-layer copies would make it ready, and the ramp costs only about
  ``log2(num_layers)`` copies.
- **At most** :data:`GROUP_BYTES` **per group**, unless one layer alone is more. 16 MiB take
  about 300 us at the 55 GB/s host-to-device ceiling, longer than the most CPU time one copy
  was measured to cost (the slowest backend and layout: 8.3 ms for 32 copies, about 260 us
  each; the fastest about 90 us). Once groups reach that size the CPU issues the next copy
  before the link has finished the current one, so larger groups would only delay
  readiness, and the layers that become ready together at the end of the op take at most
  that long to arrive after the ones before them (a forward that has caught up with the
  load waits that long). A last group whose transfer is shorter than one copy's issue is
  merged into the one before it (its copy would cost more CPU than it saves the forward).
- **At most about** :data:`MAX_COPIES` **copies per op**: groups may always grow to
  ``ceil((num_layers - 1) / (MAX_COPIES - 1))`` layers, whatever the byte bound says. Each
  copy costs about 100 us of CPU on an H100 host (a kernel launch through Triton's
  launcher), so 32 per-layer copies of a 32k-token load took 3.7-5.7 ms to issue; 16 keep a
  load's issue near 2 ms. A big op's groups of 2-3 layers each take milliseconds on the
  link, so the forward's wait grows by a layer or two at most, while the CPU issues the op
  sooner.

A backend whose copy call is cheap (``direct``: a copy-engine call of a few microseconds,
:attr:`~hicache.controller.base.TransferBackend.cheap_copies`) has no copy-count bound: a
big load's layers are then copied and made ready one by one (the finest overlap), and the
lateness and byte rules still group a small load's layers.

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
LATENESS = 2.0
# The host-to-device rate the plan assumes (a PCIe 5 x16 link moves 50-55 GB/s); a slower
# link only makes groups grow as for bigger layers
LINK_BYTES_PER_S = 50e9
COPY_S = 50e-6  # CPU per copy where the backend does not say
MAX_PLANS = 256  # plans kept by their arguments (plan_load_groups)
_PLANS: dict[tuple[object, ...], tuple[range, ...]] = {}


def plan_load_groups(num_layers: int, layer_bytes: int, cheap_copies: bool = False,
                     copy_s: float = COPY_S) -> tuple[range, ...]:
    """The groups of consecutive model layers a layer-wise load issues as one copy each.

    Args:
        num_layers: model layers of the load (>= 1).
        layer_bytes: bytes the load moves per model layer (every pool, K and V), >= 0.
        cheap_copies: the backend's copy call costs a few microseconds of CPU (``direct``:
            no kernel launch, no staging chunk), so the copy-count bound is dropped and a
            big load's layers become ready one by one, as a bare per-layer copy makes them.
        copy_s: CPU seconds one copy takes to issue (>= 0): the backend's ``copy_s``.
    Returns:
        ``range`` s of model layer ids covering ``0 .. num_layers - 1`` once, in order; the
        first is ``range(0, 1)``.
    Raises:
        ValueError: ``num_layers < 1``, ``layer_bytes < 0`` or ``copy_s < 0``.
    """
    # a load's issue asks once per op: found by its arguments and this module's bounds
    # (which tests change) in about a microsecond, where deriving it took 10-16 us
    key = (num_layers, layer_bytes, cheap_copies, copy_s, GROUP_BYTES, MAX_COPIES,
           LINK_BYTES_PER_S, LATENESS)
    found = _PLANS.get(key)
    if found is None:
        if len(_PLANS) >= MAX_PLANS:
            _PLANS.clear()
        found = _PLANS[key] = _plan(num_layers, layer_bytes, cheap_copies, copy_s)
    return found


def _plan(num_layers: int, layer_bytes: int, cheap_copies: bool, copy_s: float
          ) -> tuple[range, ...]:
    if num_layers < 1:
        raise ValueError(f"plan_load_groups: num_layers must be >= 1, got {num_layers}")
    if layer_bytes < 0:
        raise ValueError(f"plan_load_groups: layer_bytes must be >= 0, got {layer_bytes}")
    if not copy_s >= 0:
        raise ValueError(f"plan_load_groups: copy_s must be >= 0, got {copy_s}")
    by_bytes = GROUP_BYTES // layer_bytes if layer_bytes else num_layers
    for_copies = 1 if cheap_copies else copy_bound_layers(num_layers)
    max_layers = min(num_layers, max(1, for_copies, by_bytes))
    # plans are cached by their arguments: times in microseconds to two significant digits
    # (a plan moves with its times by tens of percent, not by one), so loads of nearby
    # sizes share one plan and a load's issue seldom computes one (about 10 us)
    return _groups(num_layers, max_layers, _two_digits(layer_bytes / LINK_BYTES_PER_S * 1e6),
                   _two_digits(copy_s * 1e6))


def _two_digits(value: float) -> float:
    return float(f"{value:.2g}")


def copy_bound_layers(num_layers: int) -> int:
    """The group size the copy-count bound allows at least: ``(num_layers - 1)`` layers
    after layer 0 in ``MAX_COPIES - 1`` groups."""
    return -(-(num_layers - 1) // max(1, MAX_COPIES - 1))


def per_layer_ready(layer: int, link: float, copy: float) -> float:
    """When ``layer`` is in place if every layer is its own copy: copies issued one after
    the other (``copy`` each), each moved once issued and the one before it is done
    (``link`` each); the later of the CPU's and the link's bound."""
    return max((layer + 1) * copy + link, copy + (layer + 1) * link)


@functools.lru_cache(maxsize=256)
def _groups(num_layers: int, max_layers: int, link: float, copy: float
            ) -> tuple[range, ...]:
    """Layer 0, then groups as large as keep each group's first layer ready within
    ``LATENESS`` times :func:`per_layer_ready` and within ``max_layers``; a last group that
    moves in less than one copy's issue joins the one before. ``link``: one layer's time on
    the link, ``copy``: one copy's issue, both in microseconds."""
    groups = [range(0, 1)]
    issued, done = copy, copy + link  # the CPU's and the link's time after each copy
    begin = 1
    while begin < num_layers:
        issued += copy
        start = max(issued, done)
        bound = LATENESS * per_layer_ready(begin, link, copy)
        fit = int((bound - start) // link) if link > 0 else num_layers
        size = min(max(1, fit), max_layers, num_layers - begin)
        left = num_layers - begin - size
        if left > 0 and left * link < copy:
            size += left
        groups.append(range(begin, begin + size))
        done = start + size * link
        begin += size
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
