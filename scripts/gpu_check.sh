#!/usr/bin/env bash
# GPU test suite, then the same suite under compute-sanitizer memcheck and racecheck.
# Run from the repository root on a CUDA machine; prints each tool's summary line.
set -uo pipefail
bash scripts/gpu_env.sh
status=0
echo "== gpu tests"
python3 -m pytest -q -m gpu tests/ || status=1
echo "== memcheck (caching allocator off, so every out-of-bounds access hits a real bound)"
PYTORCH_NO_CUDA_MEMORY_CACHING=1 compute-sanitizer --tool memcheck --target-processes all \
  python3 -m pytest -q -m gpu tests/ 2>&1 | grep -E "passed|failed|ERROR SUMMARY|Error|error" | tail -n 20
echo "== memcheck (caching allocator on: the churn tests reuse freed blocks)"
compute-sanitizer --tool memcheck --target-processes all \
  python3 -m pytest -q -m gpu tests/test_controller_gpu.py tests/test_kernel_gpu.py 2>&1 \
  | grep -E "passed|failed|ERROR SUMMARY" | tail -n 5
echo "== racecheck"
compute-sanitizer --tool racecheck --target-processes all \
  python3 -m pytest -q -m gpu tests/ 2>&1 | grep -E "passed|failed|RACECHECK SUMMARY|hazard" | tail -n 10
exit $status
