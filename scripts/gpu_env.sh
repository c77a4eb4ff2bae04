#!/usr/bin/env bash
# Make the checkout importable as `hicache` on a GPU machine that already has torch and triton:
# install it editable without touching dependencies.
set -euo pipefail
python3 -m pip install -q --no-deps --no-build-isolation -e . >/dev/null 2>&1 || \
  python3 -m pip install -q --no-deps -e .
python3 -c "import torch, triton, hicache.controller; print('torch', torch.__version__, 'triton', triton.__version__, 'cuda', torch.cuda.is_available())"
