"""Layer ids grouped into blocks of consecutive layers: a copy plan depends on the blocks'
shape (offsets and lengths in the moved layers), not on which layers they are, so plans are
made once per shape and shifted to each block's first layer."""

from __future__ import annotations

import functools

# ``(offset in the moved layers, count)`` of each run of consecutive layer ids: what a
# chunk's plan depends on (the runs' first layers only shift the host side).
BlockShape = tuple[tuple[int, int], ...]


@functools.lru_cache(maxsize=1024)
def layer_blocks(layers: tuple[int, ...]) -> tuple[BlockShape, tuple[int, ...]]:
    """``(offset in layers, count)`` of each run of consecutive layer ids, and the first
    layer id of each run."""
    shape: list[tuple[int, int]] = []
    begins: list[int] = []
    for offset, layer in enumerate(layers):
        if begins and begins[-1] + shape[-1][1] == layer:
            shape[-1] = (shape[-1][0], shape[-1][1] + 1)
        else:
            shape.append((offset, 1))
            begins.append(layer)
    return tuple(shape), tuple(begins)
