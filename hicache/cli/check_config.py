"""``hicache check-config [PATH]``: validate a config and print every pool's size."""

from __future__ import annotations

import argparse
import dataclasses

from hicache.config import (
    DEFAULT_CONFIG_NAME,
    GIB,
    HiCacheConfig,
    SWAHistory,
    available_ram_bytes,
    load_config,
    load_default_config,
)
from hicache.config.sizing import PoolSize, pool_layers, pool_sizes, staging_bytes


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
    return 0


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
    )


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
