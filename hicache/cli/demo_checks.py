"""``hicache demo``'s checks of its arguments against the config, before any work starts.

Each raises :class:`~hicache.cli.parser.UsageError` (exit code 2, one line naming the
option or the config key, the value and the fix): a device that is not one or is not on
this machine, a ``--json`` that would overwrite an input, a ``--storage`` that is no store
location or names a store that cannot be used from here (a server that does not answer, a
directory that cannot be written).
"""

from __future__ import annotations

import argparse
import re

from hicache.config import HiCacheConfig
from hicache.storage import probe_store
from hicache.storage.store_url import parse_location

from .device import device_form_problem, missing_device
from .output_path import check_not_input, check_output_path
from .parser import UsageError

_PASSWORD = re.compile(r"(://)[^@/]*@")  # the user information of a URL


def check_demo_args(args: argparse.Namespace, config: HiCacheConfig) -> None:
    """Every check of the module docstring, cheapest first; the store is asked last."""
    check_device(args.device, config)
    store_path = None if args.storage is None else _storage_path(args.storage)
    if args.json:
        check_not_input(args.json, "--json", {"--config": args.config, "--storage": store_path})
        check_output_path(args.json, "--json")
    if args.storage is not None and args.storage != "file":
        _probe(args.storage, config)


def check_device(option: str | None, config: HiCacheConfig) -> None:
    """``--device`` (when given) names a device; the one the demo uses is on this machine."""
    if option is not None:
        problem = device_form_problem(option)
        if problem is not None:
            raise UsageError(f"--device {option}: {problem}")
        missing = missing_device(option)
        if missing is not None:
            raise UsageError(f"--device {option}: {missing}; use --device cpu")
        return
    device = config.device_pool.device
    missing = missing_device(device)
    if missing is not None:
        raise UsageError(f"device_pool.device = {device!r}: {missing}; pass --device cpu or "
                         f"set device_pool.device: cpu")


def _storage_path(storage: str) -> str | None:
    """The directory ``--storage`` names (``None``: a temporary one, or a Redis store)."""
    if storage == "file":
        return None
    try:
        return parse_location(storage).path
    except ValueError as exc:
        hidden = _PASSWORD.sub(r"\1***@", storage)  # passwords are never printed
        raise UsageError(f"--storage {str(exc).replace(storage, hidden)}") from None


def _probe(storage: str, config: HiCacheConfig) -> None:
    """Ask the store whether it can be used from here, within ``storage.timeout_s``."""
    probe = probe_store(storage, timeout_s=config.storage.timeout_s)
    if not probe.ok:
        raise UsageError(f"--storage: {probe.report}; the demo cannot use this store from "
                         f"here (--storage file uses a temporary directory)")


__all__ = ["check_demo_args", "check_device"]
