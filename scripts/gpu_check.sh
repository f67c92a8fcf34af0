#!/usr/bin/env bash
# One prepared check for a CUDA machine (onnxruntime-gpu, no TensorRT, no internet), from a clean
# checkout plus the files scripts/gpu_wheels.sh collects (the onnxruntime-gpu wheel, the wheels
# the machine lacks, the default model's GGUF):
#   install  a venv OUT/venv on top of PYTHON's packages (torch, onnx, ...), and into it the carried
#            wheels, the onnxruntime-gpu wheel (the image's CPU onnxruntime stays, shadowed) and
#            specexport (editable, --no-deps --no-build-isolation); pip --no-index throughout
#   env      what the machine has (GPU, driver, python, torch, onnxruntime) and still lacks
#   recipe   the default recipe for the GPU (batch 1, fp16: scripts/gpu_check.py gpu_settings)
#   build    its engines
#   pytest   pytest -m gpu
#   prompts  a small subset of bench/prompts/dev.jsonl (grounded code, math, chat)
#   bench    specexport bench --device cuda: every drafter, transformers' fp16 generate (plain,
#            prompt lookup, assistant model) on the same GPU, the verify cost curve beside the CPU's
#   report   OUT/gpu_check.md and OUT/gpu_check.json: GPU, driver, onnxruntime-gpu version, the
#            command, each step's time, the issue's targets checked; written even when a step fails
# Each step is timed and bounded; all of them within TOTAL_S (default 470 s).
#
#   scripts/gpu_check.sh --wheel onnxruntime_gpu-1.31.1-cp312-cp312-manylinux_2_28_x86_64.whl [--out DIR]
#   scripts/gpu_check.sh --dry-run     # here, on the CPU: the CPU provider, the tiny recipe, few tokens
#
# Environment: ORT_GPU_WHEEL (= --wheel; else the one in GPU_CARRY), GPU_CARRY (default .gpu-carry:
# wheels/*.whl, NAME.part-* pieces joined here), GPU_CHECK_OUT (= --out), PYTHON, THREADS, NEW_TOKENS, REPEATS, TOTAL_S,
# RECIPE, CPU_CURVE, BUILD_S and BENCH_S (those steps' limits), DRY_RUN=1 (= --dry-run).
set -uo pipefail  # not -e: a failed step is recorded and the report still written

cd "$(dirname "$0")/.."
REPO=$(pwd)
DRY_RUN=${DRY_RUN:-0}
WHEEL=${ORT_GPU_WHEEL:-}
OUT=${GPU_CHECK_OUT:-/tmp/specexport-gpu-check}  # not $OUT: the device tool's folder
ARGS="$*"
while [ $# -gt 0 ]; do
  case "$1" in
    --dry-run) DRY_RUN=1 ;;
    --wheel) WHEEL=$2; shift ;;
    --out) OUT=$2; shift ;;
    -h|--help) sed -n '2,26p' "$0"; exit 0 ;;
    *) echo "gpu_check: unknown argument '$1' (--dry-run, --wheel FILE, --out DIR)" >&2; exit 2 ;;
  esac
  shift
done
PY=${PYTHON:-python3}
GPU_CARRY=${GPU_CARRY:-$REPO/.gpu-carry}
TOTAL_S=${TOTAL_S:-470}
if [ "$DRY_RUN" = 1 ]; then
  DEVICE=cpu; RECIPE=${RECIPE:-recipes/tiny-llama.yaml}; NEW_TOKENS=${NEW_TOKENS:-16}; REPEATS=${REPEATS:-1}
  THREADS=${THREADS:-2}; CPU_CURVE=${CPU_CURVE:-}
  # the CPU has no default peers: the GPU's, on the CPU in fp32
  PEERS="--peers transformers-greedy,transformers-prompt-lookup,transformers-assistant"
else
  DEVICE=cuda; RECIPE=${RECIPE:-recipes/smollm2-135m.yaml}; NEW_TOKENS=${NEW_TOKENS:-64}; REPEATS=${REPEATS:-2}
  THREADS=${THREADS:-8}; CPU_CURVE=${CPU_CURVE-bench/reports/2026-12-01-bench/bench.json}; PEERS=""
fi
rm -rf "$OUT/logs" "$OUT/steps.jsonl" "$OUT/bench" "$OUT/gpu_check.md" "$OUT/gpu_check.json"
mkdir -p "$OUT/logs"
OUT=$(cd "$OUT" && pwd)
VENV=$OUT/venv
STARTED=$(date +%s)
DRY_FLAG=$([ "$DRY_RUN" = 1 ] && echo --dry-run || true)
export OUT VENV PY GPU_CARRY WHEEL DRY_RUN REPO PYTHONUNBUFFERED=1  # for install (bash -c)
COMMAND="scripts/gpu_check.sh $ARGS"

# The report, whatever happened (also on Ctrl-C or a step past the total budget).
report() {
  timeout 60 "$PY" scripts/gpu_check.py report \
    --out "$OUT" --command "$COMMAND" $DRY_FLAG > "$OUT/logs/report.log" 2>&1
  local rc=$?
  cat "$OUT/logs/report.log"
  echo "gpu_check: report in $OUT/gpu_check.md and $OUT/gpu_check.json ($(( $(date +%s) - STARTED )) s)" >&2
  exit $rc
}
trap report EXIT

# step NAME LIMIT_S CMD...: run CMD bounded by LIMIT_S (and by what is left of TOTAL_S), its
# output in OUT/logs/NAME.log, one line in OUT/steps.jsonl. Returns CMD's status.
step() {
  local name=$1 limit=$2; shift 2
  local left=$(( TOTAL_S - ($(date +%s) - STARTED) ))
  [ "$left" -lt "$limit" ] && limit=$left
  if [ "$limit" -le 5 ]; then
    echo "{\"step\": \"$name\", \"status\": \"skipped\", \"rc\": null, \"seconds\": 0, \"limit\": 0, \"log\": \"out of time (TOTAL_S=$TOTAL_S)\"}" >> "$OUT/steps.jsonl"
    return 124
  fi
  echo "gpu_check: $name (at most ${limit} s)" >&2
  local t0; t0=$(date +%s%N)
  timeout --kill-after=10 "$limit" "$@" > "$OUT/logs/$name.log" 2>&1
  local rc=$?
  local ms=$(( ($(date +%s%N) - t0) / 1000000 ))
  local status=ok
  [ $rc -ne 0 ] && status=failed
  [ $rc -eq 124 ] || [ $rc -eq 137 ] && status=timeout
  echo "{\"step\": \"$name\", \"status\": \"$status\", \"rc\": $rc, \"seconds\": $((ms / 1000)).$(( ms % 1000 / 100 )), \"limit\": $limit, \"log\": \"logs/$name.log\"}" >> "$OUT/steps.jsonl"
  if [ $rc -ne 0 ]; then
    echo "gpu_check: $name $status (exit $rc); the end of logs/$name.log:" >&2
    tail -n 15 "$OUT/logs/$name.log" >&2
  fi
  return $rc
}

# The carried files: NAME.part-* joined into OUT/carry/NAME (checked against NAME.sha256 when
# there), wheels/*.whl installed into the venv; the onnxruntime-gpu wheel; specexport itself.
install() {
  set -e
  rm -rf "$VENV"
  mkdir -p "$OUT/carry"
  "$PY" -m venv --system-site-packages "$VENV"
  local vpy=$VENV/bin/python
  # PYTHON's own package folders too (where PYTHON is itself a venv), after the venv's own
  local purelib; purelib=$("$vpy" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')
  "$PY" -c "import sys; print('\n'.join(p for p in sys.path if p.endswith(('site-packages', 'dist-packages'))))" \
    > "$purelib/_gpu_check_base.pth"
  # a venv of python <= 3.11 brings its own old setuptools, which would shadow PYTHON's
  rm -rf "$purelib"/setuptools "$purelib"/setuptools-*.dist-info "$purelib"/pkg_resources \
    "$purelib"/_distutils_hack "$purelib"/distutils-precedence.pth
  if [ -d "$GPU_CARRY" ]; then
    find "$GPU_CARRY" -name '*.part-aa' | while read -r first; do
      name=$(basename "${first%.part-aa}")
      # the pieces in the order of their suffixes (-aa, -ab, ...), whichever call folder holds each
      cat $(find "$GPU_CARRY" -name "$name.part-*" -printf '%f\t%p\n' | sort | cut -f2) > "$OUT/carry/$name"
      sum=$(find "$GPU_CARRY" -name "$name.sha256" | head -1)
      if [ -n "$sum" ]; then
        (cd "$OUT/carry" && sha256sum -c "$sum")
      fi
      echo "joined $OUT/carry/$name ($(du -h "$OUT/carry/$name" | cut -f1))"
    done
    find "$GPU_CARRY" -maxdepth 3 -name '*.whl' -exec cp {} "$OUT/carry/" \;
  fi
  local pip=("$vpy" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir)
  local wheels; wheels=$(ls "$OUT"/carry/*.whl 2>/dev/null | grep -v -e onnxruntime_gpu -e setuptools- || true)
  local ort=${WHEEL:-$(ls "$OUT"/carry/onnxruntime_gpu-*.whl 2>/dev/null | head -1)}
  if [ "$DRY_RUN" = 1 ]; then
    # here the wheels are for the device's python (3.12): checked to install there, not installed
    if [ -n "$wheels$ort" ]; then
      "$PY" -m pip install -q --no-index --no-deps --no-compile --dry-run --ignore-installed --only-binary=:all: \
        --python-version 3.12 --implementation cp --platform manylinux_2_28_x86_64 --platform manylinux2014_x86_64 \
        --platform manylinux_2_17_x86_64 --target "$OUT/site-312-check" $wheels $ort
      echo "dry run: the carried wheels install for cp312 (not installed here); the CPU onnxruntime stays"
    else
      echo "dry run: no carried wheels in $GPU_CARRY (scripts/gpu_wheels.sh collects them); the CPU onnxruntime stays"
    fi
  else
    [ -n "$ort" ] || { echo "no onnxruntime-gpu wheel: give --wheel FILE or ORT_GPU_WHEEL, or carry it in $GPU_CARRY"; exit 2; }
    [ -z "$wheels" ] || "${pip[@]}" $wheels
    "${pip[@]}" "$ort"
  fi
  # specexport itself, editable as in development (the checkout's package folders map onto
  # specexport.*). Its pyproject's license string needs setuptools >= 77: a carried one, on the
  # build's path only, where older.
  local tools=$OUT/build-tools
  if ! "$vpy" -c "import setuptools, sys; sys.exit(int(setuptools.__version__.split('.')[0]) < 77)"; then
    local st; st=$(ls "$OUT"/carry/setuptools-*.whl 2>/dev/null | head -1)
    if [ -n "$st" ]; then
      "$vpy" -m pip install -q --no-index --no-deps --no-compile --upgrade --target "$tools" "$st"
    else  # a venv's own bundled setuptools (python 3.11) shadows PYTHON's newer one: that one's folder
      tools=$("$PY" -c "import importlib.metadata as m; print(next((d.locate_file('') for d in m.distributions()
          if (d.metadata['Name'] or '').lower() == 'setuptools' and int(d.version.split('.')[0]) >= 77), ''))")
      [ -n "$tools" ] || { echo "setuptools older than 77 and none carried (scripts/gpu_wheels.sh carries one)"; exit 2; }
    fi
  fi
  PYTHONPATH="$tools${PYTHONPATH:+:$PYTHONPATH}" "${pip[@]}" --no-build-isolation -e "$REPO"
  (cd / && "$vpy" -c "
import onnxruntime, specexport.runtime, specexport.exporter
print('specexport', specexport.__version__, specexport.__file__)
print('onnxruntime', onnxruntime.__version__, onnxruntime.__file__, onnxruntime.get_available_providers())
assert specexport.__file__.startswith('$REPO'), 'specexport is not this checkout'")
}
export -f install

# The CUDA 13 libraries onnxruntime-gpu loads (libcudart.so.13, cuBLAS, cuRAND, cuDNN 9) come with
# the image's nvidia-* wheels (torch cu130's): their lib folders on LD_LIBRARY_PATH.
cuda_libs() {
  "$PY" - <<'EOF'
import glob, os, sys
dirs = set()
for base in [p for p in sys.path if p.endswith(("site-packages", "dist-packages"))]:  # the .pth's too
    dirs.update(os.path.dirname(p) for p in glob.glob(os.path.join(base, "nvidia", "**", "lib*.so*"), recursive=True))
print(":".join(sorted(dirs)))
EOF
}

step install 150 bash -c install || exit
PY=$VENV/bin/python
if [ "$DRY_RUN" != 1 ]; then
  LIBS=$(cuda_libs)
  export LD_LIBRARY_PATH="$LIBS${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
fi
step env 60 "$PY" scripts/gpu_check.py env --out "$OUT" --device "$DEVICE" || true  # reported; the steps go on
GGUF=$(ls "$OUT"/carry/*.gguf 2>/dev/null | head -1)
step recipe 30 "$PY" scripts/gpu_check.py recipe --base "$RECIPE" --out "$OUT/gpu.yaml" $DRY_FLAG \
  ${GGUF:+--gguf "$GGUF"} || exit
step build "${BUILD_S:-240}" "$PY" -m specexport build "$OUT/gpu.yaml" -o "$OUT/engines" --threads "$THREADS" || exit
# gpu-marked tests (reported; the bench runs whatever they say). pytest's exit 5: none selected.
step pytest 90 bash -c "'$PY' -m pytest -q -m gpu -p no:cacheprovider tests; rc=\$?; [ \$rc -eq 5 ] && exit 0; exit \$rc" || true
step prompts 30 "$PY" scripts/gpu_check.py prompts --src bench/prompts/dev.jsonl --out "$OUT/prompts.jsonl" || exit
step bench "${BENCH_S:-300}" "$PY" -m specexport bench "$OUT/engines" --device "$DEVICE" --prompts "$OUT/prompts.jsonl" \
  --max-new-tokens "$NEW_TOKENS" --repeats "$REPEATS" --threads "$THREADS" --out "$OUT/bench" $PEERS \
  ${CPU_CURVE:+--cpu-curve "$CPU_CURVE"}
# CUDA graphs on and off: the target alone on one prompt, each way (the bench ran with them on)
GRAPH_PROMPT="Write a function that returns the n-th Fibonacci number, with a docstring."
step graphs 60 bash -c "'$PY' -m specexport generate '$OUT/engines' --device '$DEVICE' --cuda-graphs --drafter none \
  --max-new-tokens '$NEW_TOKENS' --prompt '$GRAPH_PROMPT' --json > '$OUT/graphs_on.json' && \
  '$PY' -m specexport generate '$OUT/engines' --device '$DEVICE' --drafter none --max-new-tokens '$NEW_TOKENS' \
  --prompt '$GRAPH_PROMPT' --json > '$OUT/graphs_off.json'" || true
