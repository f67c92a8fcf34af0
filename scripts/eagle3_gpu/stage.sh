#!/usr/bin/env bash
# Device call 1: keep the first half of the GGUF outside the repo copy (a later call's carry
# may replace .device/), and say what the machine has. Takes seconds.
set -euo pipefail
cd "$(dirname "$0")/../.."
STAGE=${STAGE:-/tmp/eagle3_stage}
mkdir -p "$STAGE"
cp .device/a/gguf.part1 "$STAGE/gguf.part1"
ls -l "$STAGE"
${PY:-python3} -c "import sys, torch, numpy; print('python', sys.version.split()[0], 'torch', torch.__version__, 'numpy', numpy.__version__, 'cuda', torch.cuda.is_available(), torch.cuda.get_device_name(0) if torch.cuda.is_available() else '')"
nvidia-smi --query-gpu=name,memory.used,memory.total --format=csv,noheader 2>/dev/null || true
echo "staged: run scripts/eagle3_gpu/run.sh next (carry .device/b) while this machine is warm"
