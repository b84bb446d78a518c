#!/usr/bin/env bash
# Download the wheels the GPU box lacks into .whl/ (it has no internet; `run` carries .whl there and
# benchmarks/run_on_gpu.sh installs them). Python 3.12 / x86-64 manylinux to match the box's python3.
# Only packages the box does not already have (KINDS.md lists its pip set); --no-deps so nothing it has
# (torch, triton, ...) is fetched twice. Usage: scripts/fetch_wheels.sh [NAME==VERSION ...]
set -euo pipefail
cd "$(dirname "$0")/.."
PY="${PYTHON:-python3}"
[ -x .venv/bin/python ] && PY=.venv/bin/python

# sageattention 1.0.6 (pure-Python Triton kernels): anchors. CCE and Liger: the linear-cross-entropy work.
PKGS=("$@")
[ ${#PKGS[@]} -eq 0 ] && PKGS=(sageattention==1.0.6 cut-cross-entropy==25.1.1 liger-kernel==0.8.5)

# .whl/ must never be committed (it is in .gitignore; also keep it out of `git status` locally).
mkdir -p .git/info .whl
grep -qx '/.whl/' .git/info/exclude 2>/dev/null || echo '/.whl/' >> .git/info/exclude

"$PY" -m pip download --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
  --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 --platform manylinux_2_17_x86_64 \
  --platform manylinux2014_x86_64 --platform manylinux1_x86_64 -d .whl "${PKGS[@]}"

# Two versions of one package make the box's install fail: warn.
dups=$(ls .whl/*.whl | xargs -n1 basename | cut -d- -f1 | sort | uniq -d)
[ -n "$dups" ] && echo "WARNING: several versions in .whl/ of: $dups (remove all but one)" >&2
du -sh .whl
