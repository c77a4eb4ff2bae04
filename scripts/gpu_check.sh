#!/usr/bin/env bash
# The GPU-marked tests at full shapes, then at small shapes (HICACHE_SANITIZER=1, see
# tests/gpu_shapes.py) under compute-sanitizer memcheck (caching allocator off, so every
# out-of-bounds access hits a real allocation bound), racecheck and synccheck.
#
# Usage, from the repository root on a CUDA machine with torch, triton and pytest:
#   bash scripts/gpu_check.sh [OUT_DIR]
# OUT_DIR (the argument, else the OUT_DIR variable, else a new temporary directory) receives
# each run's full log (plain.log, memcheck.log, racecheck.log, synccheck.log); only the pytest
# result line and the sanitizer summary lines are printed.
# Variables: GPU_CHECK_RUNS picks the runs, in order (default "plain memcheck racecheck
# synccheck"); GPU_CHECK_FILES names the test files (default: every file with GPU-marked
# tests); SANITIZER_TIMEOUT_S bounds each sanitizer run (default 1200 s; a run killed
# there fails); COMPUTE_SANITIZER names the sanitizer binary when it is not on PATH.
# Exit status 0 only if every run passed (tests passed, none failed) and every sanitizer
# summary counts 0 errors and 0 hazards.
set -uo pipefail

ALL_RUNS="plain memcheck racecheck synccheck"

# The sanitizer's summary lines in LOG (each distinct line once, "(xN)" when N processes
# printed it); returns 0 if there is at least one and every count in them is 0, 1 if a count
# is not 0, 2 if there is none (the sanitizer did not finish).
check_summary() {
  local tool=$1 log=$2 pattern='ERROR SUMMARY: [0-9]+ errors?'
  if [[ $tool == racecheck ]]; then
    pattern="RACECHECK SUMMARY: .*|$pattern"
  fi
  local found
  found=$(grep -aoE "$pattern" "$log" | sed -E 's/[[:space:]]+$//')
  if [[ -z $found ]]; then
    echo "   no sanitizer summary line in the log: the run did not finish"
    return 2
  fi
  sort <<<"$found" | uniq -c | while read -r count line; do
    if ((count > 1)); then
      echo "   $line (x$count)"
    else
      echo "   $line"
    fi
  done
  if grep -q '[1-9]' <<<"$found"; then
    return 1
  fi
  return 0
}

# The last pytest result line of LOG ("3 passed, 2 deselected in 4.20s"), or nothing.
pytest_result() {
  grep -aE '([0-9]+ (passed|failed|errors?|skipped|deselected|xfailed|xpassed)|no tests ran).* in [0-9.]+s' \
    "$1" | tail -n 1 | sed -E 's/^=+ //; s/ =+$//'
}

# Prints the pytest result of LOG and returns non-zero if the run failed: a non-zero exit
# status RC, no result line, nothing passed, a failure or error (skips are reported: CUDA
# graph capture needs the caching allocator, which memcheck turns off).
check_pytest() {
  local log=$1 rc=$2 result
  result=$(pytest_result "$log")
  echo "   pytest: ${result:-no result line (crashed or killed?)}"
  if ((rc != 0)) || [[ -z $result ]]; then
    return 1
  fi
  if grep -qE '[0-9]+ (failed|errors?)' <<<"$result" || ! grep -qE '[0-9]+ passed' <<<"$result"
  then
    return 1
  fi
  if grep -qE '[0-9]+ skipped' <<<"$result"; then
    echo "   some GPU tests skipped: the reasons are in the log's short test summary"
  fi
  return 0
}

find_sanitizer() {
  if [[ -n ${COMPUTE_SANITIZER:-} ]]; then
    echo "$COMPUTE_SANITIZER"
    return 0
  fi
  if command -v compute-sanitizer; then
    return 0
  fi
  local home
  for home in "${CUDA_HOME:-}" "${CUDA_PATH:-}" /usr/local/cuda; do
    if [[ -n $home && -x $home/bin/compute-sanitizer ]]; then
      echo "$home/bin/compute-sanitizer"
      return 0
    fi
  done
  return 1
}

run_plain() {
  local log=$out_dir/plain.log start=$SECONDS rc
  echo "== plain: full shapes (log: $log)"
  env -u HICACHE_SANITIZER "${pytest_cmd[@]}" >"$log" 2>&1
  rc=$?
  if check_pytest "$log" "$rc"; then
    echo "   plain: PASS ($((SECONDS - start)) s)"
    return 0
  fi
  echo "   plain: FAIL (exit status $rc, $((SECONDS - start)) s)"
  return 1
}

run_tool() {
  local tool=$1 log=$out_dir/$1.log start=$SECONDS rc ok=1
  local -a env_vars=(HICACHE_SANITIZER=1)
  local note="small shapes"
  if [[ $tool == memcheck ]]; then
    env_vars+=(PYTORCH_NO_CUDA_MEMORY_CACHING=1)
    note+=", caching allocator off"
  fi
  echo "== $tool: $note, limit ${limit_s} s (log: $log)"
  if [[ -z $sanitizer ]]; then
    echo "   $tool: FAIL (compute-sanitizer not found: put it on PATH or set COMPUTE_SANITIZER)"
    return 1
  fi
  env "${env_vars[@]}" timeout --kill-after=30 "$limit_s" \
    "$sanitizer" --tool "$tool" --target-processes all "${pytest_cmd[@]}" >"$log" 2>&1
  rc=$?
  check_pytest "$log" "$rc" || ok=0
  check_summary "$tool" "$log" || ok=0
  if ((rc == 124 || rc == 137)); then
    echo "   $tool: FAIL (TIMEOUT: killed after ${limit_s} s)"
    return 1
  fi
  if ((ok)); then
    echo "   $tool: PASS ($((SECONDS - start)) s)"
    return 0
  fi
  echo "   $tool: FAIL (exit status $rc, $((SECONDS - start)) s)"
  return 1
}

main() {
  runs=${GPU_CHECK_RUNS:-$ALL_RUNS}
  limit_s=${SANITIZER_TIMEOUT_S:-1200}
  out_dir=${1:-${OUT_DIR:-}}
  local run
  for run in $runs; do
    if [[ " $ALL_RUNS " != *" $run "* ]]; then
      echo "gpu_check: unknown run '$run' in GPU_CHECK_RUNS (known: $ALL_RUNS)" >&2
      return 2
    fi
  done
  if [[ -z $out_dir ]]; then
    out_dir=$(mktemp -d -t hicache-gpu-check.XXXXXX) || return 1
  fi
  mkdir -p "$out_dir" || return 1
  bash scripts/gpu_env.sh || { echo "gpu_check: scripts/gpu_env.sh failed" >&2; return 1; }
  # Only the files that hold GPU-marked tests: the same tests as -m gpu over tests/, without
  # importing the CPU-only modules (and their test-only dependencies) under the sanitizer.
  local -a gpu_files
  if [[ -n ${GPU_CHECK_FILES:-} ]]; then
    read -r -a gpu_files <<<"$GPU_CHECK_FILES"
  else
    mapfile -t gpu_files < <(grep -l 'mark\.gpu' tests/test_*.py)
  fi
  if ((${#gpu_files[@]} == 0)); then
    echo "gpu_check: no GPU-marked tests found under tests/" >&2
    return 1
  fi
  # -v: every finished test is a line of the log, so a run killed at its limit still shows
  # where the time went; --durations lists the slowest at the end.
  pytest_cmd=(python3 -m pytest -v --durations=15 -m gpu -p no:cacheprovider "${gpu_files[@]}")
  sanitizer=$(find_sanitizer) || sanitizer=""
  local status=0
  for run in $runs; do
    if [[ $run == plain ]]; then
      run_plain || status=1
    else
      run_tool "$run" || status=1
    fi
  done
  if ((status == 0)); then
    echo "== all runs passed; logs in $out_dir"
  else
    echo "== FAILED; logs in $out_dir"
  fi
  return "$status"
}

# Sourcing the script (for its functions) runs nothing.
if [[ ${BASH_SOURCE[0]} == "$0" ]]; then
  main "$@"
  exit $?
fi
