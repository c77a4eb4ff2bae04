"""Loading a configuration: a YAML file or a parsed mapping -> a validated HiCacheConfig.

Loading is strict: an unknown key, a missing required key, a wrong type (``true`` is not an
integer; an integer is a fine float), a bad choice or an impossible size raises
:class:`~hicache.config.parse.ConfigError`, whose one-line message names the dotted key, the
value and the fix. :func:`config_from_dict` and :func:`load_config` then check that the
pools in RAM (the host pools, and a ``cpu`` device pool) fit in the RAM available now, minus
``host.ram_reserve_gib``.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import math
import os
import stat
from importlib import resources
from pathlib import Path

import yaml

from .hicache import HiCacheConfig, check_store_swa_history
from .parse import ConfigError, StrictLoader, build_section, fail, yaml_reason
from .sizing import GIB, pool_sizes

logger = logging.getLogger(__name__)


DEFAULT_CONFIG_NAME = "built-in default"
"""How messages and reports name the config that ships inside the package."""


def default_config_text() -> str:
    """The commented YAML of the built-in default config (what ``hicache init`` writes)."""
    return resources.files("hicache.config").joinpath("default.yaml").read_text(encoding="utf-8")


def load_default_config(*, check_ram: bool = True) -> HiCacheConfig:
    """The built-in default config (:func:`default_config_text`), validated; errors as for
    :func:`load_config`, naming it :data:`DEFAULT_CONFIG_NAME`."""
    return config_from_yaml(default_config_text(), DEFAULT_CONFIG_NAME, check_ram=check_ram)


def load_config(path: str | os.PathLike[str], *, check_ram: bool = True) -> HiCacheConfig:
    """Read and validate a YAML config file.

    Args:
        path: the YAML file.
        check_ram: also check that the pools in RAM fit in the RAM available now.
    Raises:
        ConfigError: an empty path, an unreadable file, invalid YAML, or any invalid setting;
            the message is one line starting with ``path``; a missing file's says how to get
            one.
        TypeError: ``path`` is not a path (for a mapping, call ``config_from_dict``).
    """
    if not isinstance(path, (str, os.PathLike)):
        raise TypeError(f"load_config: path must be a str or os.PathLike naming a YAML file, "
                        f"got {type(path).__name__}; for a mapping call config_from_dict")
    if not os.fspath(path).strip():
        raise ConfigError(f"load_config: the config path {os.fspath(path)!r} is empty; give "
                          f"the path of a YAML file, or leave it out to use the built-in "
                          f"default")
    try:
        _check_file(path)
        text = Path(path).read_text(encoding="utf-8")
    except FileNotFoundError:
        raise ConfigError(f"{path}: no such config file; write one to start from with "
                          f"'hicache init {path}', or leave the path out to use the "
                          f"built-in default") from None
    except (OSError, UnicodeDecodeError) as exc:
        reason = exc.strerror if isinstance(exc, OSError) else "not UTF-8 text"
        raise ConfigError(f"{path}: cannot read the config file ({reason})") from None
    return config_from_yaml(text, str(path), check_ram=check_ram)


MAX_CONFIG_BYTES = 16 * 2**20
"""The largest config file read (one is a few KiB): a bigger one is the wrong file."""


def _check_file(path: str | os.PathLike[str]) -> None:
    """Refuse what is neither a regular file nor a directory (which the read names) before
    reading it: a device such as ``/dev/zero`` would be read until memory runs out, and a
    pipe would block forever; and a file past :data:`MAX_CONFIG_BYTES`."""
    info = os.stat(path)
    if not (stat.S_ISREG(info.st_mode) or stat.S_ISDIR(info.st_mode)):
        raise ConfigError(f"{path}: not a regular file (a device, a pipe or a socket); give "
                          f"the path of a YAML config file")
    if info.st_size > MAX_CONFIG_BYTES:
        raise ConfigError(f"{path}: {info.st_size} bytes, more than a config file holds "
                          f"(at most {MAX_CONFIG_BYTES} bytes); give the path of a YAML "
                          f"config file")


def config_from_yaml(text: str, source: str, *, check_ram: bool = True) -> HiCacheConfig:
    """Parse and validate YAML ``text``; errors start with ``source`` (a path or a name)."""
    try:
        data = yaml.load(text, Loader=StrictLoader)
    except yaml.YAMLError as exc:
        raise ConfigError(f"{source}: invalid YAML{yaml_reason(exc)}") from None
    try:
        return config_from_dict(data, check_ram=check_ram)
    except ConfigError as exc:
        raise ConfigError(f"{source}: {exc}", key=exc.key) from None


def config_from_dict(data: object, *, check_ram: bool = True) -> HiCacheConfig:
    """Build and validate a config from a parsed YAML mapping (see the module docstring).

    Raises:
        ConfigError: the message names the dotted key, the value and the fix.
    """
    if data is None:
        raise ConfigError("the config is empty; it needs at least the sections model, "
                          "device_pool, host and the key page_size_tokens")
    config: HiCacheConfig = build_section(HiCacheConfig, data, "")
    check_store_swa_history(config)
    if check_ram:
        check_host_memory(config)
    return config


def available_ram_bytes() -> int | None:
    """RAM available to new allocations now, in bytes (``MemAvailable``); ``None`` if unknown."""
    return _ram_bytes("MemAvailable:", "SC_AVPHYS_PAGES")


def total_ram_bytes() -> int | None:
    """This machine's RAM in bytes (``MemTotal``); ``None`` if unknown."""
    return _ram_bytes("MemTotal:", "SC_PHYS_PAGES")


def _ram_bytes(meminfo_field: str, sysconf_name: str) -> int | None:
    with (
        contextlib.suppress(OSError, ValueError, IndexError),
        open("/proc/meminfo", encoding="ascii") as meminfo,
    ):
        for line in meminfo:
            if line.startswith(meminfo_field):
                return int(line.split()[1]) * 1024
    try:
        return os.sysconf(sysconf_name) * os.sysconf("SC_PAGE_SIZE")
    except (AttributeError, ValueError, OSError):
        return None


def check_host_memory(config: HiCacheConfig) -> None:
    """Raise ``ConfigError`` unless the pools that live in RAM (the host pools, and the
    device pools too when ``device_pool.device`` is ``cpu``) fit in available RAM minus the
    reserve. The fix offered names the pool to shrink: the host's size key while shrinking
    it can make room, else ``device_pool.num_tokens``."""
    available = available_ram_bytes()
    reserve = int(config.host.ram_reserve_gib * GIB)
    _check_ram(config, "available", available, reserve,
               f"{_gib(available)} GiB of RAM is available and host.ram_reserve_gib keeps "
               f"{_gib(reserve)} GiB of it",
               "lower host.ram_reserve_gib, or free memory")


def check_machine_memory(config: HiCacheConfig) -> None:
    """Raise ``ConfigError`` unless the pools in RAM fit in this machine's RAM at all
    (``MemTotal``, no reserve). ``build_service`` checks it before it allocates anything,
    also for a config made with ``check_ram=False``, so that a size no machine here can
    hold is refused naming its key rather than failing part-way with a ``MemoryError``."""
    total = total_ram_bytes()
    _check_ram(config, "total", total, 0, f"this machine has {_gib(total)} GiB of RAM in all",
               "or run on a machine with more RAM")


def _check_ram(config: HiCacheConfig, what: str, ram: int | None, reserve: int,
               have: str, other_fix: str) -> None:
    """Refuse ``config`` unless its pools in RAM fit in ``ram - reserve`` bytes (``what``
    RAM); ``have`` says what RAM there is, ``other_fix`` ends the message's fix."""
    sizes = pool_sizes(config)
    host = sum(size.size_bytes for size in sizes if size.tier == "host")
    on_cpu = config.device_pool.device == "cpu"
    device = sum(size.size_bytes for size in sizes if size.tier == "device") if on_cpu else 0
    need = host + device
    if ram is None:
        logger.warning("cannot read %s RAM; pools of %.2f GiB in RAM are not checked", what,
                       need / GIB)
        return
    budget = ram - reserve
    if need <= budget:
        return
    pools = "host pools" if not device else "host and CPU device pools"
    problem = f"{pools} need {_gib(need)} GiB but {have}"
    key, value = config.host.size_key
    most = _most_that_fits(config, budget, math.floor(value * max(budget - device, 0) / host
                                                      * 100) / 100)
    if most > 0:
        raise fail(key, value, problem, f"lower {key} to at most {most}, {other_fix}")
    if budget <= 0 < ram:  # no pool size can fix it: the reserve takes all the RAM there is
        raise fail("host.ram_reserve_gib", config.host.ram_reserve_gib, problem,
                   f"it leaves no RAM for any pool: lower host.ram_reserve_gib below "
                   f"{_gib(ram)}, or free memory")
    if device:
        raise fail("device_pool.num_tokens", config.device_pool.num_tokens, problem,
                   f"the device pool on the cpu alone leaves no room for a host pool: lower "
                   f"device_pool.num_tokens, {other_fix}")
    raise fail(key, value, problem, f"the RAM left holds no host pool of any size: {other_fix}")


def _most_that_fits(config: HiCacheConfig, budget: int, estimate: float) -> float:
    """The largest host size (``host.ratio`` or ``host.size_gib``, in hundredths) at or below
    ``estimate`` whose pools fit in ``budget`` bytes, or 0. The estimate scales the size
    linearly, which each host pool's reserved page and its rounding to whole pages make a
    page too big at times: the value offered must be one that is then taken (a binary
    search over hundredths, a few dozen size computations)."""
    by_ratio = config.host.ratio is not None
    on_cpu = config.device_pool.device == "cpu"

    def fits(hundredths: int) -> bool | None:
        """None: smaller than a page (below every size that fits: the search goes up)."""
        size = hundredths / 100
        try:
            host = (dataclasses.replace(config.host, ratio=size) if by_ratio
                    else dataclasses.replace(config.host, size_gib=size))
            smaller = dataclasses.replace(config, host=host)
        except ConfigError:  # smaller than a page
            return None
        return sum(size.size_bytes for size in pool_sizes(smaller)
                   if size.tier == "host" or on_cpu) <= budget

    low, high = 0, round(estimate * 100)  # fits(low) is taken as true: 0 means none
    if high > 0 and fits(high):
        return high / 100
    while high - low > 1:
        middle = (low + high) // 2
        low, high = (middle, high) if fits(middle) is not False else (low, middle)
    return low / 100 if low and fits(low) else 0.0


def _gib(size_bytes: int | None) -> str:
    return f"{(size_bytes or 0) / GIB:.2f}"
