"""Launches of the row kernel that skip Triton's per-call argument binding on the GPU.

Triton's JIT entry point binds and specialises every argument on every call: 20 arguments,
about 25-40 us of Python per launch on an H100 host, where the compiled kernel's own
launcher takes 10-14 us (measured in one process, medians). A layer-wise load launches the
kernel once per layer group (up to 16 launches) with the same buffers and indices, so most
of that binding repeats work whose answer is known.

A compiled kernel is picked by Triton's specialisation of each argument (integers by width,
equality to 1 and divisibility by 16; tensors by dtype and 16-byte alignment) and by the
launch options. :class:`FastLaunch` asks Triton's own specialisation function for those
properties, once per prepared copy for the arguments it fixes and twice per launch for the
layer range, and keeps the compiled kernel under a key made of them: the same key as
Triton's own cache, so a hit runs exactly the binary Triton's entry point would have run,
launched on the current stream as it would be. A miss goes through the entry point (which
compiles on first use) and keeps what it returns.

The fast path needs Triton internals (the kernel's per-device binder cache, the native
specialisation function, a compiled kernel's launcher). Where any of them is missing or
behaves differently (another Triton version), it turns itself off for the process and
every launch goes through the entry point, as before; the CPU interpreter never uses it.
"""

from __future__ import annotations

import functools
import logging
from typing import Any

import torch

logger = logging.getLogger(__name__)

_MAX_KERNELS = 256  # compiled kernels kept (a handful per pool geometry in practice)


class FastLaunch:
    """The compiled row kernels launched so far, by Triton's specialisation key.

    Args:
        jit_kernel: the ``triton.jit`` kernel (``compiled_kernel()``).
    """

    def __init__(self, jit_kernel: Any) -> None:
        self._jit = jit_kernel
        self._kernels: dict[tuple[object, ...], Any] = {}
        self._specialize: Any = None
        self.enabled = True
        self.fast_launches = 0  # read by tests: the fast path ran
        self.entry_launches = 0

    def fixed_key(self, device_index: int, args: tuple[object, ...],
                  options: tuple[object, ...]) -> tuple[object, ...] | None:
        """The part of the key that a prepared copy fixes: its arguments other than the
        layer range, on ``device_index``, with ``options`` (the constexprs and launch
        options, hashable). ``None`` when the fast path is off."""
        if not self.enabled:
            return None
        specialize = self._specialize
        if specialize is None:
            return None  # the first launch (through the entry point) finds it
        try:
            return (device_index, options, *map(specialize, args))
        except Exception:  # any change of Triton's internals: the entry point only
            self._turn_off("specialising the arguments failed")
            return None

    def launch(self, fixed: tuple[object, ...] | None, grid: tuple[int, int, int],
               head: tuple[object, ...], layer_begin: int, num_layers: int,
               tail: tuple[object, ...], constexprs: tuple[object, ...],
               meta: dict[str, Any]) -> None:
        """Launch on the current stream: through a kept compiled kernel when ``fixed`` (from
        :meth:`fixed_key`) and the layer range's specialisation find one, else through the
        entry point, keeping what it compiled. Errors of the launch itself (a host buffer
        the GPU cannot address) propagate as the entry point raises them."""
        args = (*head, layer_begin, num_layers, *tail)
        key = None
        if fixed is not None and self.enabled:
            specialize = self._specialize
            key = (fixed, grid, specialize(layer_begin), specialize(num_layers))
            runner = self._kernels.get(key)
            if runner is not None:
                runner(*args, *constexprs)
                self.fast_launches += 1
                return
        compiled = self._jit[grid](*args, **meta)
        self.entry_launches += 1
        if not self.enabled:
            return
        if self._specialize is None:
            self._find_specialize()
        elif key is not None and _is_compiled(compiled):
            if len(self._kernels) >= _MAX_KERNELS:
                self._kernels.clear()
            self._kernels[key] = compiled[grid]  # its launcher, bound to the grid

    def _find_specialize(self) -> None:
        """Bind Triton's specialisation of one argument, as the entry point's binder calls
        it for this kernel's runtime arguments (found after the first launch on a device)."""
        try:
            from triton._C.libtriton import native_specialize_impl

            caches = self._jit.device_caches[torch.cuda.current_device()]
            backend = caches[3]
            native_specialize_impl(backend, 1, False, True, True)  # the call works here
        except Exception as exc:  # another Triton: the entry point only
            self._turn_off(f"Triton's specialisation is not reachable ({exc!r})")
            return

        def specialize(arg: object) -> object:
            return native_specialize_impl(backend, arg, False, True, True)

        self._specialize = specialize

    def _turn_off(self, why: str) -> None:
        self.enabled = False
        self._kernels.clear()
        logger.debug("row kernel: launching through Triton's entry point only: %s", why)


def _is_compiled(kernel: Any) -> bool:
    """True for a compiled kernel launched as ``kernel[grid](*args)`` (not the interpreter's
    return value, not ``None``)."""
    return callable(getattr(kernel, "__getitem__", None)) and hasattr(kernel, "run")


@functools.cache
def fast_launch() -> FastLaunch:
    """The process's compiled row kernels (imports Triton: call only to launch on a GPU)."""
    from .copy_rows_kernel import compiled_kernel

    return FastLaunch(compiled_kernel())
