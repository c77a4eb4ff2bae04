"""The transfer benchmark: ``hicache bench`` and ``python -m hicache.bench``.

- :mod:`~hicache.bench.cli`: arguments and the command's handler;
- :mod:`~hicache.bench.transfer`: the GPU run (imported only when a run needs it), one
  :mod:`~hicache.bench.case` (backend, page size, host layout) after another;
- :mod:`~hicache.bench.workload`, :mod:`~hicache.bench.timing`,
  :mod:`~hicache.bench.verify`: what one configuration issues, how it is timed and checked;
- :mod:`~hicache.bench.results`, :mod:`~hicache.bench.report`, :mod:`~hicache.bench.plot`:
  the result, its table and its chart, all without a GPU;
- :mod:`~hicache.bench.auto`: the ``auto`` backend's table chosen from the measurements;
- :mod:`~hicache.bench.checks`: what the always-on bounds checks cost
  (``python -m hicache.bench.checks``).

Importing this package loads neither torch nor the controller: ``--from-json`` re-renders a
saved result on any machine.
"""

from __future__ import annotations

from .cli import add_bench_parser, main, parse_args, run_bench
from .results import BenchResult, Ceiling, Measurement, load_json, save_json

__all__ = [
    "BenchResult",
    "Ceiling",
    "Measurement",
    "add_bench_parser",
    "load_json",
    "main",
    "parse_args",
    "run_bench",
    "save_json",
]
