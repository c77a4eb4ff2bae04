"""``hicache demo``'s checks of its arguments against the config, before any work starts.

Each raises :class:`~hicache.cli.parser.UsageError` (exit code 2, one line naming the
option or the config key, the value and the fix): a device that is not one, is not on this
machine or cannot run the config's ``io_backend``, a ``--json`` that would overwrite an
input, a ``--storage`` that is no store location, names a store that cannot be used from
here (a server that does not answer, a directory that cannot be written) or that a hybrid
model keeping SWA rows for windows only cannot use.
"""

from __future__ import annotations

import argparse

import torch

from hicache.config import HiCacheConfig, SWAHistory
from hicache.config.hicache import CUDA_ONLY_BACKENDS
from hicache.storage import hide_password, probe_store
from hicache.storage.store_url import parse_location

from .device import device_form_problem, missing_device
from .output_path import check_not_input, check_output_path
from .parser import UsageError


def check_demo_args(args: argparse.Namespace, config: HiCacheConfig) -> None:
    """Every check of the module docstring, cheapest first; the store is asked last."""
    check_device(args.device, config)
    store_path = None if args.storage is None else _storage_path(args.storage)
    if args.json is not None:
        check_not_input(args.json, "--json", {"--config": args.config, "--storage": store_path})
        check_output_path(args.json, "--json")
    if args.storage is not None and config.is_hybrid and (
            config.host.swa_history is not SWAHistory.ALL):
        raise UsageError(f"--storage {hide_password(args.storage)}: a hybrid model's pages go "
                         f"to the store with their SWA rows, which host.swa_history: "
                         f"{config.host.swa_history.value} keeps for windows only; set "
                         f"host.swa_history: all in the config, or drop --storage")
    if args.storage is not None and args.storage != "file":
        _probe(args.storage, config)


def check_device(option: str | None, config: HiCacheConfig) -> None:
    """``--device`` (when given) names a device; the one the demo uses is on this machine,
    and the config's ``controller.io_backend`` can run on it (advice that leads to another
    refusal is no advice)."""
    backend = config.controller.io_backend
    needs_gpu = backend in CUDA_ONLY_BACKENDS
    if option is not None:
        problem = device_form_problem(option)
        if problem is not None:
            raise UsageError(f"--device {option}: {problem}")
        missing = missing_device(option)
        if missing is not None:
            raise UsageError(f"--device {option}: {missing}; use --device cpu")
        if needs_gpu and torch.device(option).type == "cpu":
            raise UsageError(f"--device {option}: controller.io_backend = {backend.value!r} "
                             f"needs a GPU; set controller.io_backend: auto (or torch) in the "
                             f"config to run the demo on the CPU")
        return
    device = config.device_pool.device
    missing = missing_device(device)
    if missing is not None:
        fix = (f"set device_pool.device: cpu and controller.io_backend: auto ({backend.value} "
               f"needs a GPU)" if needs_gpu else
               "pass --device cpu or set device_pool.device: cpu")
        raise UsageError(f"device_pool.device = {device!r}: {missing}; {fix}")


def _storage_path(storage: str) -> str | None:
    """The directory ``--storage`` names (``None``: a temporary one, or a Redis store)."""
    if storage == "file":
        return None
    try:
        return parse_location(storage).path
    except ValueError as exc:
        hidden = hide_password(storage)  # passwords are never printed
        raise UsageError(f"--storage {hide_password(str(exc).replace(storage, hidden), storage)}"
                         ) from None


def _probe(storage: str, config: HiCacheConfig) -> None:
    """Ask the store whether it can be used from here, within ``storage.timeout_s``."""
    probe = probe_store(storage, timeout_s=config.storage.timeout_s)
    if not probe.ok:
        raise UsageError(f"--storage: {probe.report}; the demo cannot use this store from "
                         f"here (--storage file uses a temporary directory)")


__all__ = ["check_demo_args", "check_device"]
