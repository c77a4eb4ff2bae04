"""``hicache bench e2e``: time to first token of a host hit, loaded layer by layer through
the service while the new tokens' prefill runs, against recomputing the prefix.

- :mod:`~hicache.bench.e2e.model`: the decoder stack (an 8B model's shapes, random weights);
- :mod:`~hicache.bench.e2e.kv`: where its forward finds cached rows (a buffer, the pool);
- :mod:`~hicache.bench.e2e.setup`: the service, the buffers, a prefix made a host hit;
- :mod:`~hicache.bench.e2e.measure`: the timed paths and the checks of one run;
- :mod:`~hicache.bench.e2e.report`: the rows, their speedups and the table;
- :mod:`~hicache.bench.e2e.cli`: the command.

Importing this package loads no torch; a run does.
"""

from __future__ import annotations

from .cli import add_arguments, main, run

__all__ = ["add_arguments", "main", "run"]
