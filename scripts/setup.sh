#!/usr/bin/env bash
# Create .venv (when missing) and install ratex with its pinned dependencies into it.
set -euo pipefail
cd "$(dirname "$0")/.."
if [ ! -x .venv/bin/python ]; then
    python3 -m venv .venv
fi
if ! .venv/bin/python -c "import ratex, pytest" 2>/dev/null; then
    .venv/bin/pip install --quiet --upgrade pip
    .venv/bin/pip install --quiet -e ".[test]"
fi
