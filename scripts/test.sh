#!/usr/bin/env bash
# Set up, then run the test suite (GPU-only tests skip themselves where no GPU exists).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
# One worker per core; a test module's tests stay in one worker, which compiles its programs once.
.venv/bin/python -m pytest -q -n auto --dist loadfile "$@"
