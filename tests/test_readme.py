"""The README's promises that a run can check: the sample ``hicache demo --quick`` output is
what the command prints today, and ``examples/embed.py`` runs."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

# What differs between two runs of the same command: wall times and the rates over them,
# and the metrics port when the configured one is taken.
VARYING = [
    (re.compile(r"[0-9.]+ GB/s over [0-9.]+ ms timed"), "R GB/s over T ms timed"),
    (re.compile(r"engine [0-9.]+ s, baseline [0-9.]+ s"), "engine T s, baseline T s"),
    (re.compile(r"http://127\.0\.0\.1:\d+/metrics( \(port \d+ was taken\))?"),
     "http://127.0.0.1:PORT/metrics"),
]


def normalized(lines: list[str]) -> list[str]:
    for pattern, replacement in VARYING:
        lines = [pattern.sub(replacement, line) for line in lines]
    return lines


def readme_block(readme: str, command: str) -> list[str]:
    """The lines after ``$ command`` in the README's code block that starts with it."""
    match = re.search(rf"```\n\$ {re.escape(command)}\n(.*?)```", readme, re.DOTALL)
    assert match is not None, f"no block for '$ {command}' in README.md"
    return match.group(1).rstrip("\n").split("\n")


def test_readme_demo_output_is_current(repo_root: Path, tmp_path: Path) -> None:
    """The README's ``hicache demo --quick`` output matches a run, line for line."""
    readme = (repo_root / "README.md").read_text(encoding="utf-8")
    expected = readme_block(readme, "hicache demo --quick")
    result = subprocess.run([sys.executable, "-m", "hicache.cli", "demo", "--quick"],
                            cwd=tmp_path, capture_output=True, text=True, timeout=120,
                            check=False)
    assert result.returncode == 0, result.stderr
    assert normalized(result.stdout.rstrip("\n").split("\n")) == normalized(expected)


def test_embedding_example_runs(repo_root: Path, tmp_path: Path) -> None:
    """examples/embed.py runs from another directory: every request after the first reuses
    at least the shared system prompt, and later ones load pages back from the host."""
    result = subprocess.run([sys.executable, str(repo_root / "examples" / "embed.py")],
                            cwd=tmp_path, capture_output=True, text=True, timeout=120,
                            check=False)
    assert result.returncode == 0, result.stderr
    rows = [re.fullmatch(r"request (\d+): (\d+) tokens, (\d+) from the device, (\d+) loaded "
                         r"back from the host", line) for line in result.stdout.splitlines()]
    assert all(rows) and len(rows) == 12, result.stdout
    counts = [tuple(int(x) for x in row.groups()) for row in rows if row is not None]
    assert counts[0] == (0, 160, 0, 0)
    assert all(device + host >= 128 for _, _, device, host in counts[1:])
    assert sum(host for *_, host in counts) > 0


def test_readme_names_the_ci_command(repo_root: Path) -> None:
    """The README's test command is the one CI runs, and CI runs pytest."""
    readme = (repo_root / "README.md").read_text(encoding="utf-8")
    assert "```bash\nbash .ci/run\n```" in readme
    assert "python3 -m pytest -q" in (repo_root / ".ci" / "run").read_text()


RANKS_RUNNER = '''
import os, socket, sys
import torch.distributed as dist
import torch.multiprocessing as mp

SNIPPET = open("snippet.py").read()


def rank_main(rank, world, port):
    os.environ["MASTER_ADDR"] = "127.0.0.1"
    os.environ["MASTER_PORT"] = str(port)
    dist.init_process_group("gloo", rank=rank, world_size=world)  # the model's own group
    scope = {}
    try:
        exec(SNIPPET, scope)  # the README's lines, as written
        scope["service"].step()
        scope["service"].stop()
    except Exception as exc:
        print(f"rank {rank}: {type(exc).__name__}: {exc}", flush=True)
        os._exit(1)
    print(f"rank {rank}: ok", flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    s = socket.socket(); s.bind(("127.0.0.1", 0)); port = s.getsockname()[1]; s.close()
    mp.spawn(rank_main, args=(2, port), nprocs=2)
'''


def test_the_tensor_parallel_snippet_runs_on_two_ranks_of_one_host(repo_root: Path,
                                                                    tmp_path: Path) -> None:
    """The README's per-rank snippet, with the config ``hicache init`` writes, on two ranks
    of one host (it bound one metrics port on both ranks until it gave each its own)."""
    readme = (repo_root / "README.md").read_text(encoding="utf-8")
    match = re.search(r"On each rank, after the model's own process group:\n\n```python\n"
                      r"(.*?)```", readme, re.DOTALL)
    assert match is not None, "no tensor-parallel snippet in README.md"
    subprocess.run([sys.executable, "-m", "hicache.cli", "init"], cwd=tmp_path, check=True,
                   capture_output=True, timeout=120)
    (tmp_path / "snippet.py").write_text(match.group(1))
    (tmp_path / "ranks.py").write_text(RANKS_RUNNER)
    result = subprocess.run([sys.executable, "ranks.py"], cwd=tmp_path, capture_output=True,
                            text=True, timeout=300, check=False)
    # the two ranks print at once: their lines may run together, so count, not split
    assert result.returncode == 0 and all(result.stdout.count(f"rank {rank}: ok") == 1
                                          for rank in (0, 1)), \
        result.stdout + result.stderr[-2000:]
