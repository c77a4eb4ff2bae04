"""Ranks of a tensor-parallel engine for the tests: real processes (spawned), a real
``torch.distributed`` gloo group over a file rendezvous, one service per rank.

:func:`run_ranks` runs ``target(rank, *args)`` on every rank and returns what each returned
(JSON). The workload functions live here, at module level, so the spawned processes can
import them."""

from __future__ import annotations

import json
import random
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from hicache.config import HiCacheConfig, config_from_dict
from hicache.factory import build_service
from hicache.pools import IndexSpace, Indices
from hicache.service import HiCacheService

PAGE = 2


def run_ranks(target: Callable[..., Any], size: int, tmp_path: Path, *args: Any) -> list[Any]:
    """``target(rank, *args)`` on ``size`` spawned ranks; their results, by rank."""
    torch.multiprocessing.spawn(_entry, args=(size, str(tmp_path), target, args), nprocs=size,
                                join=True)
    return [json.loads((tmp_path / f"rank{rank}.json").read_text()) for rank in range(size)]


def run_ranks_within(target: Callable[..., Any], size: int, tmp_path: Path, *args: Any,
                     timeout_s: float = 45.0) -> list[Any]:
    """:func:`run_ranks`, every rank killed and ``TimeoutError`` raised after ``timeout_s``
    (a rank left waiting in a collective fails the test rather than blocks it)."""
    ctx = torch.multiprocessing.spawn(_entry, args=(size, str(tmp_path), target, args),
                                      nprocs=size, join=False)
    deadline = time.monotonic() + timeout_s
    while not ctx.join(timeout=0.5):
        if time.monotonic() > deadline:
            for process in ctx.processes:
                if process.is_alive():
                    process.kill()
            raise TimeoutError(f"ranks still running after {timeout_s} s")
    return [json.loads((tmp_path / f"rank{rank}.json").read_text()) for rank in range(size)]


def _entry(rank: int, size: int, out: str, target: Callable[..., Any], args: tuple[Any, ...]
           ) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{out}/rendezvous", rank=rank,
                            world_size=size)
    try:
        result = target(rank, *args)
        Path(out, f"rank{rank}.json").write_text(json.dumps(result))
    finally:
        dist.destroy_process_group()


def make_config(policy: str, *, hybrid: bool = False, device: str = "cpu",
                device_tokens: int = 32, backend: str = "torch") -> HiCacheConfig:
    """A 2-layer model in pages of 2 tokens, small pools (eviction on both tiers)."""
    return config_from_dict(config_dict(policy, hybrid=hybrid, device=device,
                                        device_tokens=device_tokens, backend=backend))


def config_dict(policy: str, *, hybrid: bool = False, device: str = "cpu",
                device_tokens: int = 32, backend: str = "torch") -> dict[str, Any]:
    """:func:`make_config`'s mapping."""
    model: dict[str, Any] = {"num_layers": 2, "attention": "mha", "num_kv_heads": 1,
                             "head_dim": 2, "dtype": "float32"}
    pool: dict[str, Any] = {"num_tokens": device_tokens, "device": device}
    if hybrid:
        model.update(swa_layers=[1], window_tokens=3)
        pool["swa_num_tokens"] = device_tokens // 2
    return {
        "page_size_tokens": PAGE, "model": model, "device_pool": pool,
        "host": {"ratio": 1.0, "ram_reserve_gib": 0.0},
        "controller": {"io_backend": backend, "write_policy": policy,
                       "load_back_threshold_tokens": 0},
        "service": {"metrics_enabled": False, "integrity_check_interval_s": 0.002},
    }


def serve(service: HiCacheService, tokens: list[int]) -> list[int]:
    """One request: match, lock, load back a host hit, allocate, insert, free the partial
    page, release. Returns what the rank saw: device and host hit tokens, tokens loaded
    back, and 1 if the allocation found no room (then nothing is inserted)."""
    match = service.match(tokens)
    service.lock(match.last_host_node)
    prefix, loaded_tokens = match.device_indices, 0
    if match.host_hit_tokens:
        loaded = service.load_back(match, device_quota_tokens=len(tokens))
        if loaded.queued:
            prefix = _cat(prefix, loaded.device_indices)
            loaded_tokens = len(loaded.device_indices)
            service.start_loading()
    own = service.alloc_device(len(tokens) - len(prefix))
    if own is not None:
        slots = _cat(prefix, own)
        service.insert(tokens, slots)
        whole = len(tokens) // PAGE * PAGE
        if len(slots) > whole:
            service.free_device(Indices(slots.tensor[whole:], IndexSpace.DEVICE_FULL))
    service.release(match.last_host_node)
    return [match.device_hit_tokens, match.host_hit_tokens, loaded_tokens, int(own is None)]


def _cat(a: Indices, b: Indices) -> Indices:
    return Indices(torch.cat([a.tensor, b.tensor]), IndexSpace.DEVICE_FULL)


def random_traffic(rank: int, policy: str, hybrid: bool, seed: int, num_requests: int
                   ) -> dict[str, Any]:
    """The same requests on every rank (``seed``), with the background thread running and
    sleeps of up to 2 ms, different on each rank, between the calls; a step after about
    every other request. Returns every request's answers and the step and ack counts."""
    group = dist.new_group(backend="gloo")
    service = build_service(make_config(policy, hybrid=hybrid), tp_group=group)
    agreement = service._poller.agreement
    assert agreement is not None and agreement.size == dist.get_world_size()
    service.start()
    requests, skew = random.Random(seed), random.Random(1000 * seed + rank)
    systems = [[requests.randrange(1000) for _ in range(requests.choice([4, 6, 8]))]
               for _ in range(6)]
    answers, steps = [], 0
    try:
        for _ in range(num_requests):
            tokens = requests.choice(systems) + [
                requests.randrange(1000) for _ in range(requests.randrange(1, 8))]
            time.sleep(skew.random() * 0.002)
            answers.append(serve(service, tokens))
            time.sleep(skew.random() * 0.002)
            if requests.random() < 0.5:
                service.step()
                steps += 1
        service.step()
        steps += 1
    finally:
        service.stop()
    service.check_integrity()
    stats = service.tree.stats
    return {"answers": answers, "steps": steps, "agreements": agreement.agreements,
            "acks_applied": service.stats.acks_applied, "held": agreement.num_held,
            "evicted_device_tokens": stats.evicted_device_tokens,
            "evicted_host_tokens": stats.evicted_host_tokens,
            "engine_held_tokens": service.engine_held_tokens}


def late_copy(rank: int, agreed: bool, sleep_cycles: int) -> dict[str, Any]:
    """Two ranks on one GPU. After a first backup (the write path's buffers made), each
    caches a 4-token prefix (half its device pool) and steps,
    which issues its write-through backup; rank 1's backup waits behind a sleep on the
    stream its insert ran on, rank 0's has finished at the next step. Then each asks for
    the whole pool, which needs the prefix evicted, and a write-through node leaves the
    device only once its backup is acknowledged. Returns whether each allocation, the one
    right after that step and one after both copies finished, found no room."""
    group = dist.new_group(backend="gloo") if agreed else None
    # staged: its writes return once issued (the torch backend's wait for their copies)
    service = build_service(make_config("write_through", device="cuda", device_tokens=8,
                                        backend="staged"), tp_group=group)
    try:
        # a first backup, acknowledged and evicted, so that the write path's buffers exist
        # (their allocation would wait for the sleep below)
        warm = service.alloc_device(2)
        assert warm is not None
        service.insert([9, 9], warm)
        service.step()
        torch.cuda.synchronize()
        dist.barrier()
        service.step()
        assert service.evict(2) == 2
        dist.barrier()  # both ranks up, CUDA initialised, before the clock matters
        slots = service.alloc_device(4)
        assert slots is not None
        if rank == 1:
            torch.cuda._sleep(sleep_cycles)  # the backup's copy waits for this stream
        service.insert([1, 2, 3, 4], slots)
        service.step()  # issues the backup
        if rank == 0:
            torch.cuda.synchronize()
        dist.barrier()  # rank 0's copy is done, rank 1's still waits
        service.step()
        first = service.alloc_device(8)
        copy_still_running = not torch.cuda.current_stream().query() if rank == 1 else False
        if first is not None:
            service.free_device(first)
        torch.cuda.synchronize()
        dist.barrier()  # every copy done on both ranks
        service.step()
        second = service.alloc_device(8)
        if second is not None:
            service.free_device(second)
    finally:
        service.stop()
    service.check_integrity()
    return {"first_refused": first is None, "second_refused": second is None,
            "copy_still_running": copy_still_running}


def bounds_trip(rank: int) -> dict[str, Any]:
    """Two ranks on one GPU; rank 1 writes a row at a slot past its device pool (the CUDA
    bounds check sends it to the padding slot and trips). Each then steps. Returns the
    step's error and its cause, as ``"Type: message"``."""
    from hicache.rank_agreement import RanksDivergedError

    group = dist.new_group(backend="gloo")
    service = build_service(make_config("write_through", device="cuda"), tp_group=group)
    error = cause = None
    try:
        service.step()
        if rank == 1:
            pool = service.device_pool
            bad = Indices(torch.tensor([pool.num_slots + 3], device="cuda"),
                          IndexSpace.DEVICE_FULL)
            row = torch.ones(1, 1, 2, device="cuda")
            pool.set_kv(0, bad, row, row)
            torch.cuda.synchronize()
        service.step()
    except RanksDivergedError as exc:
        error = str(exc)
        if exc.__cause__ is not None:
            cause = f"{type(exc.__cause__).__name__}: {exc.__cause__}"
    finally:
        service.stop()
    return {"error": error, "cause": cause}
