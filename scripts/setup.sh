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
# The native kernel library (csrc/kernels.cc); ratex runs without it, on its Python kernels.
if command -v cmake >/dev/null && command -v c++ >/dev/null; then
    generator=()
    if command -v ninja >/dev/null; then generator=(-G Ninja); fi
    mkdir -p build
    if ! { cmake -S . -B build "${generator[@]}" -DPython_EXECUTABLE="$PWD/.venv/bin/python" >build/setup.log 2>&1 \
        && cmake --build build >>build/setup.log 2>&1; }; then
        echo "note: native kernels not built (see build/setup.log); ratex will use its Python kernels"
    fi
else
    echo "note: cmake or a C++ compiler is missing; ratex will use its Python kernels"
fi
