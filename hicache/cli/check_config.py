"""``hicache check-config [PATH]``: validate a config, print every pool's size, and ask the
store of its ``storage`` section whether it can be used from here.

A store that cannot be used (a directory that cannot be written, a server that does not
answer within ``storage.timeout_s``) ends the command with exit code 1 after the report: the
config is valid, but an engine started with it here would find nothing in its L3 (every
lookup a miss, no backup kept), which an operator checking a deployment wants to know before
starting it. ``--skip-storage-check`` skips the question, for a config meant for another
machine, as ``--skip-ram-check`` skips the RAM check. A ``device_pool.device`` this machine
lacks (``cuda`` without CUDA, ``cuda:N`` past its last GPU) ends it the same way, for the same
reason; ``--skip-device-check`` skips that question. Both failures share one stderr line.
"""

from __future__ import annotations

import argparse
import dataclasses
import sys

from hicache.config import (
    DEFAULT_CONFIG_NAME,
    GIB,
    HiCacheConfig,
    PrefetchPolicy,
    StorageConfig,
    SWAHistory,
    WritePolicy,
    available_ram_bytes,
    load_config,
    load_default_config,
)
from hicache.config.sizing import PoolSize, pool_layers, pool_sizes, staging_bytes
from hicache.pools import HostLayout
from hicache.storage import describe_location, probe_store

from .device import missing_device
from .parser import FAILED, one_line


def add_check_config(commands: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    parser = commands.add_parser(
        "check-config",
        help="validate a YAML config and print every pool's size",
        description="Validate a YAML config and print the size of every device and host pool "
        "(tokens, pages, bytes, GiB) with totals per tier. Allocates nothing.",
    )
    parser.add_argument("path", metavar="PATH", nargs="?", default=None,
                        help="the YAML config file, e.g. config.yaml (default: the built-in "
                        "default config; 'hicache init' writes a copy of it)")
    parser.add_argument(
        "--skip-ram-check", action="store_true",
        help="do not check the host pools against the RAM available on this machine "
        "(for a config meant for another machine)",
    )
    parser.add_argument(
        "--skip-storage-check", action="store_true",
        help="do not ask the store of the storage section whether it can be used from here "
        "(for a config meant for another machine); otherwise a store that cannot be used "
        "ends the command with exit code 1 after the report",
    )
    parser.add_argument(
        "--skip-device-check", action="store_true",
        help="do not check that device_pool.device is on this machine (for a config meant "
        "for another machine); otherwise a device this machine lacks ends the command with "
        "exit code 1 after the report",
    )
    parser.set_defaults(run=_check_config)


def _check_config(args: argparse.Namespace) -> int:
    check_ram = not args.skip_ram_check
    if args.path is None:
        config, name = load_default_config(check_ram=check_ram), DEFAULT_CONFIG_NAME
    else:
        config, name = load_config(args.path, check_ram=check_ram), str(args.path)
    sizes = pool_sizes(config)
    print(f"{name}: {_geometry(config)}")
    print(_pool_table(config, sizes))
    if config.is_hybrid:
        print(_swa_history_line(config))
    print(_ram_line(config, sizes, checked=not args.skip_ram_check))
    staging = staging_bytes(config)
    if staging:
        print(f"device staging ({config.controller.io_backend.value} backend, "
              f"{config.controller.staging_tokens} tokens per chunk): up to {staging} bytes, "
              f"{staging / GIB:.4f} GiB")
    problems = [_device_problem(config.device_pool.device, checked=not args.skip_device_check),
                _check_storage(config.storage, checked=not args.skip_storage_check)]
    found = [problem for problem in problems if problem is not None]
    if not found:
        return 0
    print(f"hicache: error: {one_line('; and '.join(found))}", file=sys.stderr)
    return FAILED


def _device_problem(device: str, *, checked: bool) -> str | None:
    """What to say when ``device`` (a well-formed config value) is not on this machine."""
    missing = missing_device(device) if checked else None
    if missing is None:
        return None
    return (f"device_pool.device = {device!r}: {missing}; an engine started with this config "
            f"here could not allocate its pools (--skip-device-check skips this check)")


def _check_storage(storage: StorageConfig, *, checked: bool) -> str | None:
    """Print the store and its policies; what to say on stderr when the store cannot be
    used from here, else ``None``."""
    if storage.location is None:
        print("storage (L3): none")
        return None
    if checked:
        probe = probe_store(storage.location, timeout_s=storage.timeout_s,
                            capacity_bytes=storage.capacity_bytes)
        ok, report = probe.ok, probe.report
    else:
        ok, report = True, (f"{describe_location(storage.location)}: not checked "
                            f"(--skip-storage-check)")
    print(f"storage (L3): {report}")
    print(f"storage policies: {_storage_policies(storage)}")
    if not ok:
        return (f"{report}; an engine started with this config here would find nothing in "
                f"its L3 (--skip-storage-check skips this check)")
    return None


def _storage_policies(storage: StorageConfig) -> str:
    prefetch = f"prefetch {storage.prefetch_policy.value}"
    if storage.prefetch_policy is PrefetchPolicy.TIMEOUT:
        prefetch += (f" ({storage.prefetch_timeout_s:g} s + "
                     f"{storage.prefetch_timeout_per_1024_tokens_s:g} s per 1024 tokens, at most "
                     f"{storage.prefetch_timeout_max_s:g} s)")
    backups = f"backups {storage.write_policy.value}"
    if storage.write_policy is WritePolicy.WRITE_THROUGH_SELECTIVE:
        backups += f" (after {storage.write_through_hits} hits)"
    checksum = "on" if storage.checksum else "off"
    return (f"{prefetch}, {backups}, checksum {checksum}, {storage.timeout_s:g} s per "
            f"store call")


def _swa_history_line(config: HiCacheConfig) -> str:
    """What each ``host.swa_history`` choice costs in host memory for this model."""
    costs = []
    for choice in SWAHistory:
        variant = dataclasses.replace(
            config, host=dataclasses.replace(config.host, swa_history=choice))
        swa = next(s for s in pool_sizes(variant) if s.tier == "host" and s.pool == "swa")
        full = next(s for s in pool_sizes(variant) if s.tier == "host" and s.pool == "full")
        mark = " (chosen)" if choice is config.host.swa_history else ""
        costs.append(f"{choice.value}{mark}: SWA pool {swa.num_tokens} tokens, "
                     f"{swa.size_bytes / GIB:.4f} GiB (full pool {full.num_tokens} tokens)")
    return "host.swa_history: " + "; ".join(costs)


def _geometry(config: HiCacheConfig) -> str:
    model = config.model
    geometry = model.row_geometry
    if model.latent_dim is not None:
        rows = f"mla latent row of {model.latent_dim}"
    else:
        rows = f"mha {model.num_kv_heads} KV heads x {model.head_dim} dims"
    layers = f"{model.num_layers} layers"
    if model.is_hybrid:
        swa = ", ".join(str(i) for i in model.swa_layer_ids)
        layers += f" (sliding-window {swa}, window {model.window_tokens} tokens)"
    return (
        f"{layers}, {rows}, {model.dtype.value}, {geometry.row_bytes} bytes per row x "
        f"{geometry.num_components}; page {config.page_size_tokens} tokens; device "
        f"{config.device_pool.device}; host layout {config.host.layout.value}"
        f"{_layout_note(config)}"
    )


def _layout_note(config: HiCacheConfig) -> str:
    """What a ``page_first_direct`` host copies per layer and page, or that with 1-token
    pages it is ``page_first``."""
    if config.host.layout is not HostLayout.PAGE_FIRST_DIRECT:
        return ""
    page = config.page_size_tokens
    if page == 1:
        return " (1-token pages: the same bytes as page_first)"
    block = page * config.model.row_geometry.row_bytes
    return f" ({block} bytes per layer, component and page, one block each)"


def _pool_table(config: HiCacheConfig, sizes: list[PoolSize]) -> str:
    rows = [["tier", "pool", "layers", "tokens", "pages", "bytes", "GiB"]]
    for tier in ("device", "host"):
        in_tier = [size for size in sizes if size.tier == tier]
        for size in in_tier:
            rows.append([tier, size.pool, str(len(pool_layers(config, size.pool))),
                         *_amounts(size.num_tokens, size.num_pages, size.size_bytes)])
        rows.append([tier, "total", "", *_amounts(sum(s.num_tokens for s in in_tier),
                                                  sum(s.num_pages for s in in_tier),
                                                  sum(s.size_bytes for s in in_tier))])
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]
    lines = []
    for row in rows:
        cells = [cell.ljust(w) if i < 2 else cell.rjust(w)
                 for i, (cell, w) in enumerate(zip(row, widths, strict=True))]
        lines.append("  ".join(cells).rstrip())
    return "\n".join(lines)


def _amounts(num_tokens: int, num_pages: int, size_bytes: int) -> list[str]:
    return [str(num_tokens), str(num_pages), str(size_bytes), f"{size_bytes / GIB:.4f}"]


def _ram_line(config: HiCacheConfig, sizes: list[PoolSize], *, checked: bool) -> str:
    need = sum(size.size_bytes for size in sizes if size.tier == "host")
    line = f"host RAM: pools take {need / GIB:.4f} GiB"
    if not checked:
        return f"{line}; not checked against this machine (--skip-ram-check)"
    available = available_ram_bytes()
    if available is None:
        return f"{line}; available RAM unknown, not checked"
    return (f"{line}, {available / GIB:.2f} GiB available, "
            f"{config.host.ram_reserve_gib:.2f} GiB kept in reserve: fits")
