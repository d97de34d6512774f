#!/usr/bin/env bash
# The main job on the embedded default: calibrate SmolLM2-135M on the default calibration mix (per-layer formats) and print a summary.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/install.sh
VENV=${OSCARKV_VENV:-.venv}
"$VENV/bin/oscarkv" calibrate "$@"
