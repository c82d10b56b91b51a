#!/usr/bin/env bash
# Set up, then train LeNet-5 with ratex.jit.script on the lazy device, printing the profiling table.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
ENABLE_PARAM_ALIASING=true RATEX_DEVICE="${RATEX_DEVICE:-CPU}" RATEX_PROFILE=1 .venv/bin/python tutorials/lenet.py "$@"
