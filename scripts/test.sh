#!/usr/bin/env bash
# The CPU test suite (GPU tests are skipped without CUDA). Installs into .venv first if needed.
#
#   bash scripts/test.sh            # the fast tier: everything but the Triton interpreter and real-model tests
#   bash scripts/test.sh slow       # the slow tier: tests marked interpret (Triton's CPU interpreter) or slow
#   bash scripts/test.sh all        # both
#
# Further arguments go to pytest. pytest's exit status is this script's (5, no test collected, is a failure).
set -euo pipefail
cd "$(dirname "$0")/.."
tier=fast
case "${1:-}" in fast|slow|all) tier=$1; shift ;; esac
bash scripts/install.sh
VENV=${OSCARKV_VENV:-.venv}
case "$tier" in
  fast) marks="not gpu and not slow and not interpret" ;;
  slow) marks="not gpu and (slow or interpret)" ;;
  all) marks="not gpu" ;;
esac
"$VENV/bin/python" -m pytest -q -p no:cacheprovider -m "$marks" "$@"
