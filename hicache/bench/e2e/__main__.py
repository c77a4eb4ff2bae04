"""``python -m hicache.bench.e2e``: the same as ``hicache bench e2e``."""

from __future__ import annotations

import sys

from .cli import main

if __name__ == "__main__":
    sys.exit(main())
