#!/usr/bin/env bash
# On a CUDA machine with no network: install the wheels from .whl/ (bench/gpu_wheels.sh) into
# /tmp/site, run `python -m bench gpu`, and copy its JSON and log into $OUT when that is set.
set -uo pipefail
cd "$(dirname "$0")/.."
export PYTHONPATH="$PWD" PYTHONUNBUFFERED=1
if [ -d .whl ]; then
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
        --target /tmp/site .whl/*.whl || exit 1
    export PYTHONPATH="/tmp/site:$PWD"
fi
log="${OUT:-bench/results}/gpu.log"
mkdir -p "$(dirname "$log")" bench/results
python3 -m bench gpu 2>&1 | tee "$log"
status=${PIPESTATUS[0]}
if [ -n "${OUT:-}" ]; then
    cp bench/results/gpu.json bench/results/summary.json "$OUT"/ 2>/dev/null
fi
exit "$status"
