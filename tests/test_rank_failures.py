"""Failures on one tensor-parallel rank that left the others waiting in a collective (until
the failed rank's process exited, then a bare gloo error), found by an audit:

- a rank whose background thread failed raised ``ServiceError`` from ``step()`` before the
  step's collective: now it makes the collective, every other rank raises
  ``RanksDivergedError`` at that step, and it raises the same with its error as the cause;
- a store that failed to open on one rank (its ``storage.path`` under a file): MLA ranks
  waited inside ``build_service`` (the shared-copy probe), MHA ranks at their first step;
  now every rank raises ``ValueError`` at build, naming the rank.

Each failed rank's process stays up a few seconds after its error (as an engine reporting
it would), so a rank left waiting shows as a step or build that takes that long.
"""

from __future__ import annotations

import contextlib
import threading
import time
from pathlib import Path
from typing import Any

import pytest
import torch.distributed as dist
from rank_helpers import run_ranks_within

ALIVE_S = 6.0  # how long a failed rank's process stays up after its error
PROMPT_S = 4.0  # a rank told at once answers well within this


def _plain_config() -> Any:
    from hicache.config import config_from_dict
    return config_from_dict({
        "page_size_tokens": 2,
        "model": {"num_layers": 2, "attention": "mha", "num_kv_heads": 1, "head_dim": 2,
                  "dtype": "float32"},
        "device_pool": {"num_tokens": 32, "device": "cpu"},
        "host": {"ratio": 1.0, "ram_reserve_gib": 0.0},
        "controller": {"io_backend": "torch", "write_policy": "write_through",
                       "load_back_threshold_tokens": 0},
        "service": {"metrics_enabled": False, "integrity_check_interval_s": 0.002},
    })


def _background_fails_on_rank_1(rank: int) -> dict[str, Any]:
    from hicache.factory import build_service
    from hicache.rank_agreement import RanksDivergedError

    group = dist.new_group(backend="gloo")
    service = build_service(_plain_config(), tp_group=group)
    out: dict[str, Any] = {}
    try:
        service.step()
        if rank == 1:  # inject: the background thread's next poll raises (once)
            controller = service.controller
            real = controller.poll_acks
            fired = threading.Event()

            def failing_poll() -> Any:
                if threading.current_thread() is not threading.main_thread() \
                        and not fired.is_set():
                    fired.set()
                    raise RuntimeError("device error seen by the background poll (injected)")
                return real()

            controller.poll_acks = failing_poll  # type: ignore[method-assign]
        service.start()
        slots = service.alloc_device(4)
        assert slots is not None
        service.insert([1, 2, 3, 4], slots)  # a queued backup: the thread polls
        if rank == 1:
            for _ in range(2000):
                if service.stats.background_errors:
                    break
                time.sleep(0.005)
            out["background_errors"] = service.stats.background_errors
        dist.barrier()
        started = time.monotonic()
        try:
            service.step()
            out["step"] = "returned"
        except RanksDivergedError as exc:
            out["step"] = f"RanksDivergedError: {exc}"
        except Exception as exc:
            out["step"] = f"{type(exc).__name__}: {exc}"
        out["step_s"] = time.monotonic() - started
    finally:
        with contextlib.suppress(Exception):
            service.stop()
    if rank == 1:
        time.sleep(ALIVE_S)  # the engine goes on (handles the error, restarts its cache...)
    return out


def test_a_rank_whose_background_thread_failed_does_not_leave_the_others_blocked(
        tmp_path: Path) -> None:
    first, second = run_ranks_within(_background_fails_on_rank_1, 2, tmp_path)
    assert second["background_errors"] == 1
    # the failed rank raises at once...
    assert second["step"].startswith(("ServiceError", "RanksDivergedError")), second
    # ...and the others must be told at the same step (documented: every rank raises
    # RanksDivergedError at the step that raised on one rank, "so none waits for it")
    assert first["step_s"] < PROMPT_S, (
        f"rank 0's step blocked {first['step_s']:.1f} s in the collective, until rank 1's "
        f"process exited; it then raised: {first['step'][:120]}")
    assert first["step"].startswith("RanksDivergedError"), first


def _store_config(path: str, mla: bool) -> Any:
    from hicache.config import config_from_dict
    model: dict[str, Any] = {"num_layers": 2, "dtype": "float32"}
    model.update({"attention": "mla", "latent_dim": 3} if mla else
                 {"attention": "mha", "num_kv_heads": 1, "head_dim": 2})
    return config_from_dict({
        "page_size_tokens": 2, "model": model,
        "device_pool": {"num_tokens": 32, "device": "cpu"},
        "host": {"ratio": 1.0, "ram_reserve_gib": 0.0},
        "controller": {"io_backend": "torch", "write_policy": "write_through"},
        "service": {"metrics_enabled": False},
        "storage": {"backend": "file", "path": path},
    })


def _store_path_on_rank(rank: int, paths: list[str], mla: bool) -> dict[str, Any]:
    from hicache.factory import build_service

    group = dist.new_group(backend="gloo")
    out: dict[str, Any] = {}
    started = time.monotonic()
    try:
        service = build_service(_store_config(paths[rank], mla), tp_group=group,
                                model_id="test/tp-model", model_revision="r1")
        out["built"] = True
        try:
            service.step()
        finally:
            service.stop()
        out["error"] = None
    except Exception as exc:
        out["error"] = f"{type(exc).__name__}: {exc}"
    out["elapsed_s"] = time.monotonic() - started
    if rank == 1:
        time.sleep(ALIVE_S)
    return out


@pytest.mark.parametrize("mla", [True, False], ids=["mla", "mha"])
def test_a_store_that_fails_to_open_on_one_rank_fails_every_rank_at_build(
        tmp_path: Path, mla: bool) -> None:
    blocker = tmp_path / "a-file"
    blocker.write_text("not a directory")
    paths = [str(tmp_path / "l3"), str(blocker / "l3")]
    first, second = run_ranks_within(_store_path_on_rank, 2, tmp_path, paths, mla)
    assert second["error"] is not None and "storage.path" in second["error"]
    assert first["elapsed_s"] < PROMPT_S, (
        f"rank 0 blocked {first['elapsed_s']:.1f} s (built: {first.get('built', False)}) "
        f"until rank 1's process exited, then: {str(first['error'])[:100]}")
    assert first["error"] is not None and "storage" in first["error"] and "rank 1" in \
        first["error"], first
