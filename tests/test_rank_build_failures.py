"""A tensor-parallel build that fails on one rank fails on every rank, at once.

Only the store's opening was told to every rank; every other check raised on its rank
alone, and the others waited in their next collective until that process exited (or for
gloo's 30 minutes), then got "Connection closed by peer", or "the group cannot reduce CPU
tensors", which named the wrong cause: TP arguments other than the group's, a
``device_pool.device`` (a key each rank sets) naming a GPU the process does not see, a
machine whose RAM cannot hold the pools. And MLA ranks that passed ``tp_rank``/``tp_size``
in different forms (left out on one, the group's on another) made different collectives:
gloo aborted a process.

Each test spawns gloo ranks with a wall-clock limit; the cache group has a short gloo
timeout, so a rank left waiting in a collective fails rather than blocks."""

from __future__ import annotations

import contextlib
import datetime
import time
from pathlib import Path
from typing import Any

import pytest
import torch.distributed as dist
from rank_helpers import run_ranks_within

ALIVE_S = 6.0   # a failed rank's process stays up this long (an engine reporting its error)
PROMPT_S = 4.0  # a rank told at once answers well within this


def group() -> Any:
    return dist.new_group(backend="gloo", timeout=datetime.timedelta(seconds=10))


def cfg_dict(path: str, *, mla: bool = False, hybrid: bool = False, **over: Any) -> dict:
    from rank_helpers import config_dict
    mapping = config_dict("write_through", hybrid=hybrid)
    if mla:
        model = mapping["model"]
        del model["num_kv_heads"], model["head_dim"]
        model.update(attention="mla", latent_dim=3)
    mapping["storage"] = {"backend": "file", "path": path, "write_policy": "write_through",
                          "prefetch_policy": "wait_complete", "prefetch_threshold_tokens": 0,
                          "write_through_hits": 1}
    if hybrid:
        mapping["host"]["swa_history"] = "all"
    for key, value in over.items():
        section, name = key.split("__")
        mapping.setdefault(section, {})[name] = value
    return mapping


MODEL = {"model_id": "test/tp-model", "model_revision": "r1"}


def _build_fails_on_rank_1(rank: int, path: str, case: str) -> dict[str, Any]:
    from hicache.config import config_from_dict
    from hicache.factory import build_service

    over: dict[str, Any] = {}
    kwargs: dict[str, Any] = dict(MODEL)
    if rank == 1 and case == "smaller_machine":
        # rank 1 runs on a machine with 512 bytes of RAM in all (simulated: its pools do not
        # fit, so check_machine_memory refuses the config there and only there)
        import hicache.config.loading as loading
        loading.total_ram_bytes = lambda: 512
    if rank == 1 and case == "tp_rank":
        kwargs.update(tp_rank=0, tp_size=2)  # not the group's rank: refused on rank 1
    if rank == 1 and case == "device":
        # device_pool.device is a per-rank key: rank 1 names a GPU its process does not see
        over["device_pool__device"] = "cuda:1"
    out: dict[str, Any] = {}
    started = time.monotonic()
    try:
        service = build_service(config_from_dict(cfg_dict(path, **over)), tp_group=group(),
                                **kwargs)
        out["built"] = True
        try:
            service.step()
        finally:
            with contextlib.suppress(Exception):
                service.stop()
        out["error"] = None
    except Exception as exc:
        out["error"] = f"{type(exc).__name__}: {exc}"
    out["elapsed_s"] = time.monotonic() - started
    if rank == 1:
        time.sleep(ALIVE_S)
    return out


@pytest.mark.parametrize("case", ["tp_rank", "device", "smaller_machine"])
def test_a_build_that_fails_on_one_rank_fails_every_rank_at_build(tmp_path: Path, case: str
                                                                  ) -> None:
    """Rank 1's build_service raises (TP arguments other than the group's, a device its
    process does not see, a machine whose RAM cannot hold the pools): rank 0 must be told
    at build, as it is for a store that fails to open on one rank, instead of waiting in a
    collective for a rank that left the build."""
    first, second = run_ranks_within(_build_fails_on_rank_1, 2, tmp_path,
                                     str(tmp_path / "l3"), case)
    assert second["error"] is not None and "Error" in second["error"], second
    assert first["elapsed_s"] < PROMPT_S, (
        f"rank 0 blocked {first['elapsed_s']:.1f} s (built: {first.get('built', False)}) "
        f"and then: {str(first['error'])[:160]}")
    assert first["error"] is not None and "rank 1" in first["error"], first


def _mla_mixed_tp_args(rank: int, path: str) -> dict[str, Any]:
    from hicache.config import config_from_dict
    from hicache.factory import build_service

    # both forms are accepted on their own: left out (tp_size=1), or the group's own values
    tp = {} if rank == 0 else {"tp_rank": 1, "tp_size": 2}
    out: dict[str, Any] = {}
    started = time.monotonic()
    try:
        service = build_service(config_from_dict(cfg_dict(path, mla=True)), tp_group=group(),
                                **MODEL, **tp)
        out["built"] = True
        try:
            for _ in range(3):
                service.step()
        finally:
            with contextlib.suppress(Exception):
                service.stop()
        out["error"] = None
    except Exception as exc:
        out["error"] = f"{type(exc).__name__}: {exc}"
    out["elapsed_s"] = time.monotonic() - started
    return out


def test_mla_ranks_passing_different_tp_arguments_are_refused_on_every_rank(tmp_path: Path
                                                                          ) -> None:
    """Rank 0 leaves tp_rank/tp_size out, rank 1 passes the group's (1, 2): each is accepted
    alone, but rank 0 then probes for a shared store (two collectives) and rank 1 does not,
    so the ranks' collectives no longer pair up. The build should refuse it on every rank
    (ValueError naming tp_size), as it does for config keys that differ."""
    results = run_ranks_within(_mla_mixed_tp_args, 2, tmp_path, str(tmp_path / "l3"))
    for result in results:
        assert result["elapsed_s"] < PROMPT_S, results
        assert result["error"] is not None and "ValueError" in result["error"] \
            and "tp_" in result["error"], results
