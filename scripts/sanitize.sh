#!/usr/bin/env bash
# Run every kernel once under compute-sanitizer: memcheck (out-of-bounds and misaligned accesses),
# racecheck (shared-memory hazards), synccheck (barrier misuse). Needs a GPU machine whose
# runtime lets the sanitizer attach (bare metal or a VM; not gVisor). Logs to $OUT or ./sanitize_logs.
set -uo pipefail
cd "$(dirname "$0")/.."
out="${OUT:-sanitize_logs}"
mkdir -p "$out"
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" CUPY_CACHE_DIR="${CUPY_CACHE_DIR:-/tmp/cupynorm-kernel-cache}"
status=0
for tool in memcheck racecheck synccheck; do
  compute-sanitizer --tool "$tool" --error-exitcode 3 --print-limit 20 \
    python3 scripts/sanitize_cases.py > "$out/sanitize_$tool.log" 2>&1
  rc=$?
  echo "$tool: exit $rc; $(grep -E 'ERROR SUMMARY|RACECHECK SUMMARY' "$out/sanitize_$tool.log" | tail -1)"
  [ "$rc" -eq 0 ] || status=1
done
exit $status
