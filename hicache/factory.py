"""Build a :class:`~hicache.service.HiCacheService`, and the shared store, from a config.

Assembly order: backend, device pool(s), host pool(s) sized by :mod:`hicache.config.sizing`, the
controller (registered as the device pool's layer waiter, so every attention accessor waits
for layer-wise loads by construction), the radix tree, the service. Nothing starts a thread
or opens a socket here; ``service.start()`` (or ``with build_service(config) as service``)
does.

With a ``storage`` section, the store (:func:`open_configured_store`) becomes the service's
shared-store tier (:class:`~hicache.l3.StorageTier`). Its pages are named inside the
:class:`Namespace` of :func:`storage_namespace`, which covers the config's KV geometry and
the weights the engine says it runs.
"""

from __future__ import annotations

import logging

import torch

from hicache.pools import (
    AttentionKind,
)

from .cache_parts import CacheParts, build_cache_parts
from .config import (
    ConfigError,
    HiCacheConfig,
    StorageKind,
)
from .config.hicache import check_store_swa_history
from .config.sizing import (
    pool_layers,
    pool_names,
    token_bytes,
)
from .l3 import StorageTier
from .l3.shared_copy import probe_shared_store
from .rank_agreement import RankAgreement
from .rank_settings import check_same_settings, on_every_rank
from .service import HiCacheService
from .storage import Namespace, StorageBackend, open_store

logger = logging.getLogger(__name__)

def build_service(config: HiCacheConfig, *, model_id: str | None = None,
                  model_revision: str | None = None, tp_rank: int = 0, tp_size: int = 1,
                  salt: str = "", tp_group: object = None) -> HiCacheService:
    """Pools, backend, controller, tree, shared-store tier and service for ``config``; no
    thread started (the store's worker threads start with their first job).

    Args:
        config: the configuration.
        model_id, model_revision, tp_rank, tp_size, salt: what names the pages in a shared
            store (see :func:`storage_namespace`); ``model_id`` and ``model_revision`` are
            required when ``storage.backend`` is not ``none``.
        tp_group: for an engine that runs one scheduler and one service per tensor-parallel
            rank, a ``torch.distributed`` group of those ranks with a CPU backend (gloo):
            every rank then applies finished transfers at the same step, so that their trees
            give the same answers (:mod:`hicache.rank_agreement`; one collective a ``step``,
            two with a store, and four here, made by every rank: the group's check, this
            call's arguments, the ranks' configs (:mod:`hicache.rank_settings`), the pools;
            a step that fails on a rank fails on every rank). ``None``: a service of its
            own. With a store and ``tp_size`` left at 1, each rank's pages are named by the
            group's rank and size (an MHA shard); an MLA model's ranks share one copy, each
            rank writing part of its pages if every rank sees one store
            (:mod:`hicache.l3.shared_copy`; two more collectives here). Pass ``tp_rank`` and
            ``tp_size`` alike on every rank: the group's, or left out.

    Raises:
        ValueError: the io backend is not usable here (e.g. ``kernel`` without Triton); a
            store without ``model_id``/``model_revision``; a store with a hybrid model whose
            host keeps SWA rows for windows only; a ``tp_group`` with ``tp_size``/``tp_rank``
            other than the group's or given on some ranks only, that cannot reduce CPU
            tensors, whose ranks' configs differ (on every rank, naming the keys); with a
            group, any error below on one rank is this ``ValueError`` on every rank, naming
            the rank and (there) its error.
        ConfigError: pools in RAM larger than this machine's RAM (naming the size key,
            checked before anything is allocated); a ``storage.path`` that cannot be a
            writable directory.
    """
    if not isinstance(config, HiCacheConfig):
        raise TypeError(f"build_service: config must be a HiCacheConfig (load_config(path) or "
                        f"config_from_dict(mapping) makes one), got {type(config).__name__}")
    agreement = None if tp_group is None else RankAgreement(tp_group)

    def check_arguments() -> bool:
        check_device_present(config.device_pool.device)
        if config.storage.is_enabled and (not model_id or not model_revision):
            raise ValueError(
                f"build_service: storage.backend is {config.storage.backend.value}: pass "
                f"model_id and model_revision (a commit or weights digest), which name the "
                f"pages in the shared store so that no other weights ever read them")
        check_store_swa_history(config)  # loading checks it too; one made by hand may not
        if agreement is not None:
            _check_tp_arguments(agreement, tp_rank, tp_size)
        return True

    # With a group, a step that fails on one rank fails on every rank (on_every_rank), so
    # that none waits at a collective for a rank that left the build.
    if agreement is None:
        check_arguments()
        parts = build_cache_parts(config)
    else:
        on_every_rank(agreement, "checking build_service's arguments", check_arguments,
                      lambda _: None)
        check_same_settings(agreement, config, tp_arguments_given=tp_size != 1)
        parts = on_every_rank(agreement, "building the pools",
                              lambda: build_cache_parts(config), CacheParts.close)
        if tp_size == 1 and config.model.attention is AttentionKind.MHA:
            tp_rank, tp_size = agreement.rank, agreement.size  # each rank stores its heads
    tree = parts.tree
    service_config = config.service
    metrics = ((service_config.metrics_host, service_config.metrics_port)
               if service_config.metrics_enabled else None)
    storage = None
    if config.storage.is_enabled:
        assert model_id is not None and model_revision is not None
        namespace = storage_namespace(config, model_id=model_id, model_revision=model_revision,
                                      tp_rank=tp_rank, tp_size=tp_size, salt=salt)
        store = (open_configured_store(config, namespace) if agreement is None else
                 on_every_rank(agreement, "opening the store of the storage section",
                               lambda: open_configured_store(config, namespace),
                               lambda opened: opened.close() if opened is not None else None))
        assert store is not None
        # ranks that name their pages alike (MLA) write one copy if they see one store
        share = (probe_shared_store(store, agreement)
                 if agreement is not None and agreement.size > 1 and tp_size == 1 else None)
        storage = StorageTier(tree, store, config.storage, agreed=agreement is not None,
                              share=share)
    return HiCacheService(
        tree=tree, device_pool=parts.device_pool, host_pools=parts.host_pools,
        integrity_check_interval_s=service_config.integrity_check_interval_s,
        metrics_address=metrics, storage=storage, agreement=agreement,
    )


def _check_tp_arguments(agreement: RankAgreement, tp_rank: int, tp_size: int) -> None:
    """The TP arguments are left out or are the group's, else ``ValueError``."""
    if (tp_size, tp_rank) not in ((1, 0), (agreement.size, agreement.rank)):
        raise ValueError(f"build_service: tp_size={tp_size}, tp_rank={tp_rank}, but tp_group "
                         f"has {agreement.size} ranks and this is rank {agreement.rank}: pass "
                         f"the group's, or leave them out")


def check_device_present(name: str) -> None:
    """Refuse a CUDA ``device_pool.device`` this process has no GPU for (``ValueError``
    naming the key; a config stays valid on a machine without the GPU it was written for)."""
    device = torch.device(name)
    if device.type != "cuda":
        return
    count = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if (device.index or 0) >= count:
        raise ValueError(f"build_service: device_pool.device is {name}, but this process sees "
                         f"{count} CUDA device(s) (torch {torch.__version__}); set "
                         f"device_pool.device to cpu or to a GPU it has")


def storage_namespace(config: HiCacheConfig, *, model_id: str, model_revision: str,
                      tp_rank: int = 0, tp_size: int = 1, salt: str = "") -> Namespace:
    """The namespace of the pages that ``config``'s host pools back up to the store.

    The config gives the bytes' shape: dtype, the full pool's layers and rows, page size,
    host layout, and one payload segment per host pool (a page's full rows, then its SWA rows
    for a hybrid model). The engine gives what the config cannot know: which weights made
    the KV (``model_revision`` must change with every weight update, or the store serves
    pages of the old weights), its tensor-parallel shard, and an optional tenant ``salt``.

    Raises:
        ValueError: an empty ``model_id``/``model_revision``, a bad shard.
    """
    geometry = config.model.row_geometry
    page = config.page_size_tokens
    return Namespace(
        model_id=model_id, model_revision=model_revision, dtype=config.model.dtype.value,
        num_layers=len(pool_layers(config, "full")), num_components=geometry.num_components,
        row_elems=geometry.row_elems, page_size=page, layout=config.host.layout.value,
        segment_bytes=tuple(page * token_bytes(config, name) for name in pool_names(config)),
        tp_rank=tp_rank, tp_size=tp_size, salt=salt,
    )


def open_configured_store(config: HiCacheConfig, namespace: Namespace) -> StorageBackend | None:
    """The store of ``config.storage`` for ``namespace``; ``None`` for ``backend: none``.

    Opens no connection (a Redis store connects on its first call); a file store makes its
    directory (its worker threads start with its first call). Close it (``with`` or
    ``close()``) when done.

    Raises:
        ValueError: ``namespace`` does not describe this config's pages (make it with
            :func:`storage_namespace`).
        ConfigError: the file store's directory cannot be made or written (naming
            ``storage.path``).
    """
    storage = config.storage
    if storage.location is None:
        return None
    expected = storage_namespace(config, model_id=namespace.model_id,
                                 model_revision=namespace.model_revision,
                                 tp_rank=namespace.tp_rank, tp_size=namespace.tp_size,
                                 salt=namespace.salt)
    if namespace != expected:
        differ = [name for name in ("dtype", "num_layers", "num_components", "row_elems",
                                    "page_size", "layout", "segment_bytes")
                  if getattr(namespace, name) != getattr(expected, name)]
        raise ValueError(f"namespace does not describe this config's pages ({', '.join(differ)} "
                         f"differ: {[getattr(namespace, n) for n in differ]} given, "
                         f"{[getattr(expected, n) for n in differ]} from the config); make it "
                         f"with storage_namespace(config, ...)")
    options: dict[str, object] = {"timeout_s": storage.timeout_s, "checksum": storage.checksum}
    if storage.capacity_bytes is not None:
        options["capacity_bytes"] = storage.capacity_bytes
    try:
        return open_store(storage.location, namespace, **options)
    except ValueError as exc:
        if storage.backend is not StorageKind.FILE:
            raise
        # the config checked every other option: what the store refuses is the directory
        raise ConfigError(f"storage.path = {storage.path!r}: {exc}", key="storage.path"
                          ) from None
