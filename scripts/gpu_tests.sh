#!/usr/bin/env bash
# Runs the whole test suite on the GPU box (CUDA tests included), e.g. through the device tool:
#   run(command="bash scripts/gpu_tests.sh", carry=[".whl"])
# The box has torch/triton/transformers preinstalled and no internet; pytest and any missing wheels come
# from .whl/ (scripts/fetch_wheels.sh; the box already has pytest).
set -uo pipefail
cd "$(dirname "$0")/.."
if ls .whl/*.whl >/dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
    && export PYTHONPATH=/tmp/site:${PYTHONPATH:-}
fi
export PYTHONPATH=$PWD/src:${PYTHONPATH:-}
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
python3 -c "import torch, triton, transformers; print('torch', torch.__version__, 'triton', triton.__version__, 'transformers', transformers.__version__)"
out=${OUT:-/tmp}
# pytest-xdist (on the box): Triton compiles dominate the suite's time, and they run on the CPU cores in
# parallel; GPU_TEST_WORKERS=0 runs serially.
workers=()
if python3 -c "import xdist" 2>/dev/null && [ "${GPU_TEST_WORKERS:-6}" != 0 ]; then workers=(-n "${GPU_TEST_WORKERS:-6}"); fi
python3 -m pytest -q -m "${MARKS:-cuda}" "${workers[@]}" --durations=10 "$@" 2>&1 | tee "$out/gpu_tests.log"
exit "${PIPESTATUS[0]}"
