"""Plot of a benchmark result (matplotlib, optional): percent of ceiling and matmul slowdown
per backend and configuration. Runs without a GPU, from a saved JSON."""

from __future__ import annotations

import importlib
import importlib.util
from pathlib import Path

from .results import BOTH, LOAD, WRITE, BenchResult

PANELS = [
    ("write (d2h, all layers): % of ceiling", WRITE, "pct_of_ceiling"),
    ("load (h2d, layer-wise): % of ceiling", LOAD, "pct_of_ceiling"),
    ("write + load at once: % of bidir ceiling", BOTH, "pct_of_ceiling"),
    ("matmul slowdown during write / load (%)", "", "slowdown_pct"),
]


def have_matplotlib() -> bool:
    return importlib.util.find_spec("matplotlib") is not None


def plot(result: BenchResult, path: Path) -> None:
    """Write a 2x2 bar chart of ``result``'s main-size measurements to ``path`` (PNG).

    Raises ``RuntimeError`` when matplotlib is not installed.
    """
    if not have_matplotlib():
        raise RuntimeError("--plot needs matplotlib (pip install matplotlib)")
    importlib.import_module("matplotlib").use("Agg")
    plt = importlib.import_module("matplotlib.pyplot")

    rows = result.main_rows()
    backends = list(dict.fromkeys(m.backend for m in rows))
    configs = list(dict.fromkeys((m.page_size, m.layout) for m in rows))
    labels = [f"page {page}\n{layout}" for page, layout in configs]
    fig, axes = plt.subplots(2, 2, figsize=(13, 8), constrained_layout=True)
    width = 0.8 / max(1, len(backends))
    for ax, (title, kind, field) in zip(axes.flat, PANELS, strict=True):
        for i, backend in enumerate(backends):
            kinds = [kind] if kind else [WRITE, LOAD]
            for j, k in enumerate(kinds):
                values = []
                for page, layout in configs:
                    m = result.find(backend, k, page, layout)
                    value = getattr(m, field) if m is not None else None
                    values.append(value if value is not None else 0.0)
                share = width / len(kinds)
                shift = (i - (len(backends) - 1) / 2) * width + (j - (len(kinds) - 1) / 2) * share
                ax.bar([x + shift for x in range(len(configs))], values, share,
                       hatch="//" if j else None, label=backend if j == 0 else None,
                       color=f"C{i}")
        ax.set_title(title)
        ax.set_xticks(range(len(configs)), labels)
        ax.grid(axis="y", alpha=0.3)
        if field == "pct_of_ceiling":
            ax.axhline(100.0, color="black", linewidth=0.8)
    axes.flat[0].legend()
    fig.suptitle(f"{result.meta['device']}: {result.meta['tokens']} tokens, "
                 f"{result.meta['transfer_bytes'] / 2**30:.2f} GiB per transfer "
                 f"(hatched: load)")
    fig.savefig(path, dpi=110)
    plt.close(fig)
