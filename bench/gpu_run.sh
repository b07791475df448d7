#!/usr/bin/env bash
# On a CUDA machine with no network: install the wheels from .whl/ (bench/gpu_wheels.sh) into
# /tmp/site and run `python -m bench gpu` (extra arguments go to it).  With $OUT set (a lent GPU
# machine's folder of files that come back), the JSON and the log are written there as the run
# goes, so a run cut short still returns what it measured; else under bench/results.
set -uo pipefail
cd "$(dirname "$0")/.."
export PYTHONPATH="$PWD" PYTHONUNBUFFERED=1
if [ -d .whl ]; then
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
        --target /tmp/site .whl/*.whl || exit 1
    export PYTHONPATH="/tmp/site:$PWD"
fi
results="${OUT:-$PWD/bench/results}"
mkdir -p "$results"
export BENCH_RESULTS="$results"
python3 -m bench gpu "$@" 2>&1 | tee "$results/gpu.log"
exit "${PIPESTATUS[0]}"
