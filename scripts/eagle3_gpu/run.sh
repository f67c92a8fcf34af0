#!/usr/bin/env bash
# Device call 2 (also runs on CPU for the dry run): reassemble the GGUF from the staged first
# half and .device/b's second half, check its sha256, then train. Everything is an env var:
#   OUT (results, default /tmp/eagle3_out), JOB_MINUTES (7.5 wall for the python job),
#   DEVICE (cuda|cpu), and job.py's own settings (MAX_PROMPTS, MAX_NEW, TRAIN_STEPS, ...).
set -euo pipefail
cd "$(dirname "$0")/../.."
export PYTHONUNBUFFERED=1
export OUT=${OUT:-/tmp/eagle3_out}
STAGE=${STAGE:-/tmp/eagle3_stage}
PY=${PY:-python3}
mkdir -p "$OUT"
part1=""
for p in "$STAGE/gguf.part1" .device/a/gguf.part1; do [ -f "$p" ] && { part1=$p; break; }; done
[ -n "$part1" ] || { echo "run: the first GGUF half is gone (machine restarted?): run stage.sh again first" | tee "$OUT/train_log.txt" >&2; exit 3; }
export GGUF=${GGUF_OUT:-/tmp/eagle3_model.gguf}
cat "$part1" .device/b/gguf.part2 > "$GGUF"
want=$(cat .device/b/gguf.sha256); got=$(sha256sum "$GGUF" | cut -d' ' -f1)
[ "$want" = "$got" ] || { echo "run: reassembled GGUF sha256 $got != $want" | tee "$OUT/train_log.txt" >&2; exit 3; }
echo "run: GGUF reassembled ($(stat -c %s "$GGUF") bytes, sha256 ok)"
export PROMPTS=${PROMPTS:-.device/b/prompts.npz}
exec "$PY" scripts/eagle3_gpu/job.py
