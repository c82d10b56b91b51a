#!/usr/bin/env bash
# Set up, then run the test suite (GPU-only tests skip themselves where no GPU exists).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
.venv/bin/python -m pytest -q "$@"
