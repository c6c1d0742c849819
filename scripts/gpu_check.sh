#!/usr/bin/env bash
# The GPU check in one command: the README's test command over every case (`--exhaustive`: the
# default run samples the parametrized sweeps; CPU and GPU tests together), then a quick bench of
# the three seed workloads (cupynorm checked against torch eager, then timed beside torch eager
# and torch.compile; TIMING_ARGS adds bench options, e.g. --no-compile).
# Runs from the source tree with the machine's python3 (torch + cupy already installed there, and
# the `test` extra: the packaging test builds the wheel with hatchling and no network).
# With pytest-random-order installed, the suite runs a second time in random order (test
# isolation: a test that leaks global state fails another one).
# Logs go to $OUT when set (the device machine's output folder), else to ./gpu_check_logs.
set -uo pipefail
cd "$(dirname "$0")/.."
out="${OUT:-gpu_check_logs}"
mkdir -p "$out"
export PYTHONUNBUFFERED=1 PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
export CUPY_CACHE_DIR="${CUPY_CACHE_DIR:-/tmp/cupynorm-kernel-cache}"
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader | tee "$out/gpu.txt"
python3 -c "import torch, cupy; print('torch', torch.__version__, 'cupy', cupy.__version__)" | tee -a "$out/gpu.txt"
python3 -m pytest -q --exhaustive ${PYTEST_ARGS:-} 2>&1 | tee "$out/pytest.log"
tests_rc=${PIPESTATUS[0]}
if python3 -c "import random_order" 2>/dev/null; then
    python3 -m pytest -q --exhaustive -p random_order --random-order ${PYTEST_ARGS:-} 2>&1 | tee "$out/pytest_random.log"
    tests_rc=$(( tests_rc != 0 || PIPESTATUS[0] != 0 ))
fi
python3 -m cupynorm bench --quick --only instancenorm2d_fp32,groupnorm8_fp32,batchnorm2d_train_fp32 \
    --json "$out/timing.json" ${TIMING_ARGS:-} 2>&1 | tee "$out/timing.log"
timing_rc=${PIPESTATUS[0]}
echo "gpu tests exit $tests_rc, timing exit $timing_rc"
exit $(( tests_rc != 0 || timing_rc != 0 ))
