#!/usr/bin/env bash
# Create .venv (when missing), install ratex into it (editable, with its pinned dependencies), and
# build the native library (CMakeLists.txt) into this checkout's ratex/_lib/, rebuilding what changed.
set -euo pipefail
cd "$(dirname "$0")/.."
if [ ! -x .venv/bin/python ]; then
    python3 -m venv .venv
fi
mkdir -p build
log=build/setup.log
: >"$log"
if ! .venv/bin/python -c "import ratex, pytest, xdist" 2>/dev/null; then
    .venv/bin/pip install --quiet --upgrade pip
    # The native library is compiled against the venv's own torch and tvm-ffi, so the build
    # requirements (pyproject.toml pins them to the versions ratex runs with) come first and
    # the build is not isolated.
    read -ra requires < <(.venv/bin/python -c '
try:
    import tomllib
except ImportError:  # Python 3.10
    from pip._vendor import tomli as tomllib
with open("pyproject.toml", "rb") as f:
    print(" ".join(tomllib.load(f)["build-system"]["requires"]))')
    .venv/bin/pip install --quiet "${requires[@]}"
    if ! .venv/bin/pip install -v --no-build-isolation -e ".[test]" >>"$log" 2>&1; then
        tail -n 30 "$log"
        echo "installing ratex failed (the whole log: $log)" >&2
        exit 1
    fi
fi
# After an install this finds nothing to do; it recompiles csrc/ edits, and builds the library of
# a checkout whose .venv was installed from another one.
if ! native=$(.venv/bin/python setup.py --quiet build_native --inplace 2>&1); then
    echo "$native" | tail -n 30
    echo "building the native library failed unexpectedly" >&2
    exit 1
fi
echo "$native" >>"$log"
if grep "^note: native kernels not built" <<<"$native"; then
    echo "  (the build's output: $log)"
fi
