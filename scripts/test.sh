#!/usr/bin/env bash
# The test suite on CPU (GPU tests are skipped without CUDA). Installs into .venv first if needed.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/install.sh
VENV=${OSCARKV_VENV:-.venv}
"$VENV/bin/python" -m pytest -q -m "not gpu" "$@"
