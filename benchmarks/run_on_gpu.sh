#!/usr/bin/env bash
# Runs one benchmark on the GPU box (through the device tool's `run`, from the repository root):
#   THRIFTY_COMMIT=<sha> bash benchmarks/run_on_gpu.sh benchmarks/anchors.py [args...]
# Installs carried wheels (.whl/, from scripts/fetch_wheels.sh) into /tmp/site, installs thrifty in place,
# runs the benchmark unbuffered, and copies the result files it wrote plus a log to $OUT (they come back).
# THRIFTY_NO_INSTALL=1 skips the editable install (PYTHONPATH=src instead), for trying this script elsewhere.
set -uo pipefail
cd "$(dirname "$0")/.."
[ $# -ge 1 ] || { echo "usage: $0 BENCHMARK.py [ARGS...]" >&2; exit 2; }
BENCH=$1; shift
[ -f "$BENCH" ] || { echo "no such benchmark: $BENCH" >&2; exit 2; }
OUT=${OUT:-/tmp/thrifty-out}
mkdir -p "$OUT"
PY=${PYTHON:-python3}   # on the box: /opt/torch/.venv/bin/python3 (torch, triton, transformers there)

run() {
  echo "== $(date -u +%FT%TZ) $BENCH $* on $(hostname)"
  nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem,temperature.gpu,power.draw --format=csv,noheader || true
  # The tree copied to the box normally has no .git: then the commit must come from the caller.
  # THRIFTY_COMMIT first: the box's tree can carry a stale .git (seen at 2fcb084 while main was 3 commits on).
  if [ -n "${THRIFTY_COMMIT:-}" ]; then echo "commit: THRIFTY_COMMIT=$THRIFTY_COMMIT"
  elif git rev-parse HEAD >/dev/null 2>&1; then echo "git: $(git rev-parse HEAD) (may be stale on the box: set THRIFTY_COMMIT)"
  else echo "git: no .git here; THRIFTY_COMMIT unset: results get commit null"; fi

  if compgen -G ".whl/*.whl" >/dev/null; then
    "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
      || { echo "wheel install failed"; return 1; }
    export PYTHONPATH=/tmp/site${PYTHONPATH:+:$PYTHONPATH}
    echo "wheels: $(ls .whl | tr '\n' ' ')"
  fi
  # No internet on the box, so no build isolation (setuptools is preinstalled). Should the editable install
  # fail anyway, the src layout still imports through PYTHONPATH.
  if [ "${THRIFTY_NO_INSTALL:-0}" = 1 ] || ! "$PY" -m pip install -q --no-deps --no-build-isolation --no-cache-dir -e . ; then
    echo "no editable install; using PYTHONPATH=src"
    export PYTHONPATH=$PWD/src${PYTHONPATH:+:$PYTHONPATH}
  fi
  "$PY" -c "import torch, triton, thrifty; print('torch', torch.__version__, 'triton', triton.__version__, 'cuda', torch.cuda.is_available())" \
    || return 1

  local stamp; stamp=$(mktemp); sleep 1   # result files newer than this are the ones this run wrote
  PYTHONUNBUFFERED=1 "$PY" "$BENCH" "$@"
  local rc=$?
  find benchmarks/results -maxdepth 1 -type f \( -name '*.json' -o -name '*.png' \) -newer "$stamp" -exec cp -v {} "$OUT"/ \;
  echo "== exit $rc"
  return $rc
}

run "$@" 2>&1 | tee "$OUT/$(basename "$BENCH" .py).log"
exit "${PIPESTATUS[0]}"
