"""``hicache demo``: the reference engine on a config, checked against a dense baseline.

:func:`run_demo` draws the workload, computes the baseline (every conversation alone over a
dense KV buffer), serves the workload through a real :class:`HiCacheService` built from the
config, and returns a :class:`DemoReport` whose ``passed`` says whether every loaded page
matched its backup and every generated token matched the baseline.
"""

from __future__ import annotations

import dataclasses
import time
import uuid
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass

import torch

from hicache.config import HiCacheConfig, WritePolicy
from hicache.controller import HybridCacheController
from hicache.factory import build_service
from hicache.metrics.exporter import host_port, port_is_free
from hicache.radix import CacheStats
from hicache.service import HiCacheService
from hicache.storage.probe import describe_location

from .limits import EngineError, check_at_least_one, check_demo_fields
from .model import ModelSpec, TinyDecoder
from .reference import TurnKey, reference_tokens
from .report import DemoReport, TransferTimer, transfer_lines
from .runner import DemoEngine
from .store_pages import StorePageAudit, store_config
from .verify import TransferAudit, first_token_mismatch
from .workload import Workload, WorkloadSpec, make_workload

# phase ("baseline" or "engine"), requests done, requests in all, a note (metrics URL)
PhaseProgress = Callable[[str, int, int, str], None]

QUICK = WorkloadSpec(num_conversations=6, num_turns=3)


@dataclass(frozen=True)
class DemoOptions:
    """What ``hicache demo`` runs; ``None`` keeps the config's (or the workload's) value.

    ``write_policy``: overrides the config's policy; ``None`` keeps it (``config.yaml``
    uses ``write_through`` so that evicted history can come back from the host).
    ``corrupt_host_byte``: flip one host byte before the first load-back (testing aid).
    """

    seed: int = 0
    device: str | None = None
    conversations: int | None = None
    turns: int | None = None
    quick: bool = False
    write_policy: WritePolicy | None = None
    corrupt_host_byte: bool = False
    max_running: int = 4
    prefill_chunk_tokens: int = 16
    new_tokens: tuple[int, int] | None = None  # generated tokens per turn (low, high)
    storage: str | None = None  # "file" (a temporary directory), a directory, or redis://...

    def __post_init__(self) -> None:  # a bad count is refused here, naming it (0 is not None)
        for name in ("max_running", "prefill_chunk_tokens", "conversations", "turns"):
            if getattr(self, name) is not None:
                check_at_least_one(f"DemoOptions.{name}", getattr(self, name))
        check_demo_fields(self)  # and the others' types, naming the field

    def workload_spec(self) -> WorkloadSpec:
        base = QUICK if self.quick else WorkloadSpec()
        return dataclasses.replace(
            base, seed=self.seed,
            num_conversations=base.num_conversations if self.conversations is None
            else self.conversations,
            num_turns=base.num_turns if self.turns is None else self.turns,
            new_tokens=self.new_tokens or base.new_tokens,
        )


def demo_config(config: HiCacheConfig, options: DemoOptions) -> HiCacheConfig:
    """``config`` with the demo's overrides: device, write policy, and a free metrics port
    when the configured one is taken (reported as such).

    Raises:
        MetricsBindError: ``service.metrics_host`` cannot be bound (no address of this
            machine, or a name that does not resolve).
    """
    pool = config.device_pool
    if options.device is not None:
        pool = dataclasses.replace(pool, device=options.device)
    controller = config.controller
    if options.write_policy is not None:
        controller = dataclasses.replace(controller, write_policy=options.write_policy)
    config = dataclasses.replace(config, device_pool=pool, controller=controller)
    return _with_free_metrics_port(config)


def _with_free_metrics_port(config: HiCacheConfig) -> HiCacheConfig:
    """``config`` with ``service.metrics_port`` 0 (a free one) when the port is taken."""
    service = config.service
    if service.metrics_enabled and not port_is_free(service.metrics_host,
                                                     service.metrics_port):
        service = dataclasses.replace(service, metrics_port=0)
    return dataclasses.replace(config, service=service)


def run_demo(
    config: HiCacheConfig, options: DemoOptions, config_name: str = "config.yaml",
    on_progress: PhaseProgress | None = None,
) -> DemoReport:
    """Serve the demo workload and verify it (see the module docstring).

    Raises:
        ValueError: the device or the model is not usable (one line, names the fix).
        MetricsBindError: ``service.metrics_host`` cannot be bound (one line, names it).
        EngineError: the pools cannot hold one request of the workload.
    """
    wanted_port = config.service.metrics_port
    config = demo_config(config, options)
    device = torch.device(config.device_pool.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        raise ValueError(f"device {device}: CUDA is not available here; use --device cpu")
    spec = ModelSpec.from_config(config)
    workload = make_workload(options.workload_spec(), config.page_size_tokens, spec.vocab_size)
    report = DemoReport(config=config_name, device=str(device), seed=options.seed,
                        requests=workload.num_turns, conversations=len(workload.conversations),
                        write_policy=config.controller.write_policy.value,
                        corruption_requested=options.corrupt_host_byte)
    with _cpu_threads(device):
        model = TinyDecoder(spec, options.seed, device)
        start = time.perf_counter()

        def baseline_progress(done: int, total: int) -> None:
            if on_progress is not None:
                on_progress("baseline", done, total, "")

        baseline_progress(0, workload.num_turns)
        expected = reference_tokens(model, workload, baseline_progress)
        report.baseline_s = time.perf_counter() - start
        location = config.storage.location
        if options.storage is not None:
            with store_config(config, options.storage) as (config, where):
                engine = serve_twice(config, options, model, workload, report, where,
                                     expected, wanted_port, on_progress)
        elif location is not None:  # the config's own store, used as --storage's is
            where = f"the config's store, {describe_location(location)}"
            engine = serve_twice(config, options, model, workload, report, where, expected,
                                 wanted_port, on_progress)
        else:
            engine = serve(config, options, model, workload, report, wanted_port=wanted_port,
                           on_progress=on_progress)
    mismatch = first_token_mismatch(engine.generated, expected)
    report.token_mismatch = report.token_mismatch or mismatch
    return report


def serve_twice(
    config: HiCacheConfig, options: DemoOptions, model: TinyDecoder, workload: Workload,
    report: DemoReport, where: str, expected: dict[TurnKey, list[int]], wanted_port: int,
    on_progress: PhaseProgress | None,
) -> DemoEngine:
    """With a shared store: serve the workload, then serve it again through a second,
    empty instance on the same store; its tokens and every page it took from the store are
    verified too (against the first instance's backups)."""
    pages = StorePageAudit()
    run = uuid.uuid4().hex[:12]  # this run's pages only: each is verifiable
    first = serve(config, options, model, workload, report, wanted_port=wanted_port,
                  on_progress=on_progress, store=(pages, run))
    second_report = dataclasses.replace(report, transfers=[], page_mismatches=[])
    second = serve(config, options, model, workload, second_report, wanted_port=wanted_port,
                   on_progress=on_progress, store=(pages, run), phase="second instance")
    report.page_mismatches += [f"second instance: {m}" for m in second_report.page_mismatches]
    mismatch = first_token_mismatch(second.generated, expected)
    report.token_mismatch = None if mismatch is None else f"second instance: {mismatch}"
    report.l3 = {
        "store": where, "stored_pages": pages.stored_pages, "failed_pages": pages.failed_pages,
        "first_from_store_tokens": report.l3_from_store_tokens,
        "second_prompt_tokens": second_report.prompt_tokens,
        "second_from_store_tokens": second_report.l3_from_store_tokens,
        "second_device_hit_tokens": second_report.device_hit_tokens,
        "second_host_hit_tokens": second_report.host_hit_tokens,
        "second_pages_checked": second_report.pages_checked,
        "second_store_pages_checked": second_report.pages_from_store_checked,
        "arrived_pages": pages.arrived_pages, "unknown_pages": pages.unknown_pages,
    }
    return first


def serve(
    config: HiCacheConfig, options: DemoOptions, model: TinyDecoder, workload: Workload,
    report: DemoReport, *, wanted_port: int = 0, on_progress: PhaseProgress | None = None,
    store: tuple[StorePageAudit, str] | None = None, phase: str = "engine",
) -> DemoEngine:
    """Serve ``workload`` through a service built from ``config`` (no baseline): fills the
    cache, transfer and page-check parts of ``report`` and returns the engine, whose
    ``generated`` holds every turn's tokens. ``wanted_port``: the configured metrics port
    (to say so when another was used). ``store``: the audit of stored pages shared by the
    instances of this run, and the run's id (a salt of the store's namespace)."""
    config = _with_free_metrics_port(config)  # again: another may have taken it since
    service = (build_service(config) if store is None else
               build_service(config, model_id="hicache-demo-decoder",
                             model_revision=f"seed-{options.seed}", salt=store[1]))
    controller = service.controller
    stream = None
    if model.device.type == "cuda":
        stream = torch.cuda.Stream(model.device)
        controller.register_producer_stream(stream)
    tier = service.storage  # kept: stop() lets go of it
    audit = TransferAudit(controller, corrupt_host_byte=options.corrupt_host_byte)
    if store is not None:
        store[0].watch(service, audit)
    timer = TransferTimer(controller)
    engine = DemoEngine(
        service, model, max_running=options.max_running,
        prefill_chunk_tokens=options.prefill_chunk_tokens, max_tokens=workload.max_tokens(),
        audit=audit, stream=stream,
    )
    start = time.perf_counter()
    try:
        with service:
            report.metrics = _metrics_line(service, config, wanted_port)
            note = f"metrics {report.metrics}"

            def progress(done: int, total: int) -> None:
                if on_progress is not None:
                    on_progress(phase, done, total, note)

            progress(0, workload.num_turns)
            engine.serve(workload, progress)
    finally:
        audit.close()
        timer.close()
    report.engine_s = time.perf_counter() - start
    _fill(report, engine, service.tree.stats, audit)
    if tier is not None:
        report.l3_from_store_tokens = sum(r.store_tokens for r in engine.finished)
    report.transfers = transfer_lines(controller, timer)
    report.timing_method = timer.method
    return engine


def _fill(
    report: DemoReport, engine: DemoEngine, stats: CacheStats, audit: TransferAudit
) -> None:
    finished = engine.finished
    report.prompt_tokens = sum(len(r.prompt) for r in finished)
    report.device_hit_tokens = sum(r.device_tokens for r in finished)
    report.host_hit_tokens = sum(r.host_tokens for r in finished)
    report.recomputed_tokens = sum(r.recomputed_tokens for r in finished)
    report.new_tokens = sum(r.new_tokens for r in finished)
    report.generated_tokens = sum(len(r.generated) for r in finished)
    report.retracted_requests = engine.num_retracted
    report.evicted_device_tokens = stats.evicted_device_tokens
    report.evicted_host_tokens = stats.evicted_host_tokens
    report.backed_up_tokens = stats.backed_up_tokens
    report.loaded_back_tokens = stats.loaded_back_tokens
    report.refused_load_backs = dict(stats.refused_load_backs)
    controller = engine.service.controller
    if isinstance(controller, HybridCacheController):
        host_swa = controller.host_swa
        used = host_swa.allocator.num_used_tokens
        report.swa = {"window_backup_tokens": stats.window_backup_tokens,
                      "restored_tokens": stats.restored_swa_tokens,
                      "evicted_tokens": stats.evicted_swa_tokens,
                      "host_evicted_tokens": stats.evicted_host_swa_tokens,
                      "host_used_tokens": used,
                      "host_used_bytes": used * host_swa.geometry.token_bytes(
                          len(controller.swa_layers))}
    report.pages_checked = audit.checked_pages
    report.pages_from_store_checked = audit.checked_from_store
    report.page_mismatches = list(audit.mismatches)
    report.corrupted_host_slot = audit.corrupted_slot


def _metrics_line(service: HiCacheService, config: HiCacheConfig, wanted_port: int) -> str:
    exporter = service.exporter
    if exporter is None or exporter.port is None:
        return "off (service.metrics_enabled is false)"
    url = f"http://{host_port(config.service.metrics_host, exporter.port)}/metrics"
    if wanted_port and exporter.port != wanted_port:
        url += f" (port {wanted_port} was taken)"
    return url


@contextmanager
def _cpu_threads(device: torch.device) -> Iterator[None]:
    """One intra-op thread on a CPU: the model's ops are tiny, and extra threads only add
    wake-up latency (and contention on a small machine)."""
    threads = torch.get_num_threads()
    if device.type == "cpu":
        torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(threads)


__all__ = ["DemoOptions", "EngineError", "demo_config", "run_demo", "serve"]
