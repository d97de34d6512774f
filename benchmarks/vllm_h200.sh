#!/usr/bin/env bash
# Run benchmarks/bench_vllm.py on the lent H200 with a slim vLLM 0.26.0 carried in two calls (docs/vllm.md).
#
# Prepare here (once):   bash benchmarks/vllm_h200.sh prepare     (downloads into .carry/, ignored by git)
# Device call 1:         bash benchmarks/vllm_h200.sh stage1      carry: .carry/vllm-so           (~55 MB)
# Device call 2 (warm):  OSCARKV_GIT_SHA=<sha> bash benchmarks/vllm_h200.sh stage2   carry: .carry/vllm-rest (~35 MB)
# (within the 30 s the machine stays warm: stage1 leaves the library in /tmp/slim on that machine).
# When the tracked tree plus 55 MB exceeds a call's 64 MiB, send the library in two halves instead of stage1:
#   bash benchmarks/vllm_h200.sh stage1a   carry: .carry/vllm-so1   then (warm)   ... stage1b   carry: .carry/vllm-so2
# Tensor parallelism (issue 8, kind nvidia-h200-x2): stage1, then `bash benchmarks/vllm_h200.sh tp1` and
# `... tp2` (carry .carry/vllm-rest each; the second finds the model written by the first if the machine is warm),
# then locally: python benchmarks/bench_vllm_tp.py --merge tp1.json tp2.json --out docs/results/vllm_tp2_h200.json
set -euo pipefail
cd "$(dirname "$0")/.."
case "${1:-}" in
prepare)
  tmp=$(mktemp -d)
  mkdir -p .carry/vllm-so .carry/vllm-rest/whl
  pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
    --platform manylinux_2_28_x86_64 -d "$tmp" vllm==0.26.0
  # Keep FlashAttention 3 (vLLM refuses to import its attention layers without an FA binary; 11 MB in xz).
  (cd "$tmp" && unzip -q vllm-0.26.0-*.whl && rm -rf vllm/vllm_flash_attn/_vllm_fa2_C.abi3.so \
    vllm/_moe_C_stable_libtorch.abi3.so vllm/vllm-rs vllm/_flashmla* vllm/_qutlass* \
    vllm/third_party/fmha_sm100 vllm/third_party/deep_gemm)
  xz -9 -c "$tmp/vllm/_C_stable_libtorch.abi3.so" > .carry/vllm-so/C.so.xz
  mkdir -p .carry/vllm-so1 .carry/vllm-so2 && split -n 2 -d .carry/vllm-so/C.so.xz "$tmp/Cpart" \
    && mv "$tmp/Cpart00" .carry/vllm-so1/C.so.xz.00 && mv "$tmp/Cpart01" .carry/vllm-so2/C.so.xz.01
  rm "$tmp/vllm/_C_stable_libtorch.abi3.so"
  tar cf - -C "$tmp" vllm vllm-0.26.0.dist-info | xz -6 > .carry/vllm-rest/vllm.tar.xz
  # The pure-Python (and a few binary) dependencies the engine imports, at versions vllm 0.26.0 accepts.
  for p in annotated-types==0.8.0 apache-tvm-ffi==0.1.15.post2 cachetools==8.0.2 cbor2==6.3.0 fastapi==0.136.3 \
      httpcore2==2.16.2 httpx2==2.16.2 jiter==0.19.0 jmespath==1.1.0 llguidance==1.7.6 \
      model-hosting-container-standards==0.1.16 msgspec==0.23.0 openai==3.57.0 openai-harmony==0.0.8 \
      opentelemetry-api==1.45.2 partial-json-parser==0.2.1.1.post7 pybase64==1.5.1 pydantic==2.14.4 \
      pydantic_core==2.50.5 pyzmq==27.3.0 sniffio==1.3.1 starlette==1.10.0 supervisor==4.3.0 truststore==0.10.5 \
      typing-inspection==0.4.5 uvicorn==0.54.0 watchfiles==1.3.0 xgrammar==0.2.9; do
    pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
      --platform manylinux_2_28_x86_64 --platform manylinux_2_31_x86_64 --platform manylinux_2_17_x86_64 \
      --platform manylinux2014_x86_64 -d .carry/vllm-rest/whl "$p"
  done
  rm -rf "$tmp"
  du -sh .carry/vllm-so .carry/vllm-rest ;;
stage1)
  mkdir -p /tmp/slim && xz -dc .carry/vllm-so/C.so.xz > /tmp/slim/_C_stable_libtorch.abi3.so
  ls -la /tmp/slim; nvidia-smi --query-gpu=name,memory.used,memory.total --format=csv ;;
stage1a)
  mkdir -p /tmp/slim && cp .carry/vllm-so1/C.so.xz.00 /tmp/slim/ && ls -la /tmp/slim ;;
stage1b)
  [ -f /tmp/slim/C.so.xz.00 ] || { echo "stage1a's half is gone (a fresh machine): run stage1a again"; exit 3; }
  cat /tmp/slim/C.so.xz.00 .carry/vllm-so2/C.so.xz.01 | xz -dc > /tmp/slim/_C_stable_libtorch.abi3.so
  ls -la /tmp/slim; nvidia-smi --query-gpu=name,memory.used,memory.total --format=csv ;;
stage2|tp1|tp2)
  [ -f /tmp/slim/_C_stable_libtorch.abi3.so ] || { echo "stage1's files are gone (a fresh machine): run stage1 again"; exit 3; }
  export HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 VLLM_NO_USAGE_STATS=1 DO_NOT_TRACK=1 \
    VLLM_USE_FLASHINFER_SAMPLER=0 PYTHONUNBUFFERED=1
  mkdir -p /tmp/site
  export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1  # device KINDS.md
  if [ ! -f /tmp/site/vllm/_C_stable_libtorch.abi3.so ]; then
    python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .carry/vllm-rest/whl/*.whl
    tar xJf .carry/vllm-rest/vllm.tar.xz -C /tmp/site
    cp /tmp/slim/_C_stable_libtorch.abi3.so /tmp/site/vllm/
  fi
  rm -rf /tmp/site/oscarkv /tmp/site/oscar_kv*  # always this checkout's package
  python3 -m pip install -q --no-index --no-deps --no-build-isolation --target /tmp/site . >/dev/null
  export PYTHONPATH=/tmp/site
  if [ "$1" = stage2 ]; then
    python3 benchmarks/bench_vllm.py --out "${OUT:-.}/vllm_h200.json" --deadline "${DEADLINE:-400}"
  else
    python3 benchmarks/bench_vllm_tp.py --phase "$1" --out "${OUT:-.}/$1.json" --deadline "${DEADLINE:-500}" ${TP_ARGS:-}
  fi ;;
*)
  echo "usage: $0 prepare|stage1|stage1a|stage1b|stage2|tp1|tp2"; exit 2 ;;
esac
