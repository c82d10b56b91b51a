#!/usr/bin/env bash
# The GPU checks in one run of about 7 minutes, for a machine with a CUDA GPU and 16 cores and
# ratex's dependencies installed (PYTHONPATH may point at this checkout and a TVM built for that
# Python):
#
#   bash scripts/gpu_check.sh OUTDIR [SECONDS] [TESTS...]
#
# Builds the native library against that machine's torch (about 20 s), then:
#  1. at once, each on cores of its own (taskset), for at most SECONDS (default 170):
#     - TESTS (default: the test modules that run GPU programs or build for CUDA) with
#       RATEX_DEVICE=GPU on 8 workers, each test's result logged as it ends;
#     - scripts/kernel_check.py on the GPU kernels of five steps (each kernel against its rule);
#     - each bench model's ratex_compile cell for 3 steps, in two streams, which fills the compile
#       cache (RATEX_CACHE_DIR) that the quiet phase loads;
#  2. quiet, nothing else running, at most 200 s: scripts/bench.py --device gpu --warm-cache,
#     eager against ratex_compile on every bench model (first steps are cache loads here, not
#     compiles): the figures to report.
# The logs go to OUTDIR (at most 8 files: what a lent machine's call brings back), and a summary to
# stdout. Python's fault handler is on throughout: a crash prints every thread's Python stack.
# (scripts/zoo.py with RATEX_DEVICE=GPU is the longer check of real models, for a call of its own.)
set -u
out=${1:?usage: gpu_check.sh OUTDIR [SECONDS] [TESTS...]}
limit=${2:-170}
shift $(($# < 2 ? $# : 2))
tests=${*:-tests/test_gpu.py tests/test_bounds.py tests/test_fused_indices.py tests/test_jit.py tests/test_dtypes.py tests/test_compile.py tests/test_optimizers.py tests/test_jit_hf.py}
cd "$(dirname "$0")/.."
mkdir -p "$out"
export PYTHONFAULTHANDLER=1 PYTHONUNBUFFERED=1 RATEX_CACHE_DIR=/tmp/ratex_gpu_cache
python3 -c "import torch; assert torch.cuda.is_available(), 'no CUDA device visible to torch'" || exit 1
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader
start=$(date +%s)
python3 setup.py --quiet build_native --inplace >"$out/build.log" 2>&1
echo "native build rc $? in $(($(date +%s) - start)) s"; tail -n 2 "$out/build.log"; rm -f "$out/build.log"

# shellcheck disable=SC2086  # $tests is a list of paths
# (SIGINT at the limit: pytest stops and still prints its summary of the failures so far)
(RATEX_DEVICE=GPU RATEX_CACHE_DIR= timeout -s INT -k 20 "$limit" taskset -c 0-7 python3 -m pytest -v -n 8 -p no:cacheprovider \
    --timeout 150 -rfE --tb=short $tests >"$out/suite.log" 2>&1; echo "suite rc $?" >>"$out/suite.log") &
(RATEX_DEVICE=GPU RATEX_CACHE_DIR= timeout "$limit" taskset -c 8-11 bash -c '
    for m in "stack --mode script" "zoo:gptj --mode script" "gpt2l-b8 --mode script" "lstm-b8 --mode lazy" "hf-bert-b4 --mode script"; do
      echo "== kernel_check $m"; python3 scripts/kernel_check.py $m 2>&1 | grep -E "^(program|  DIFFERS|  [a-z_0-9]+: its)|Error"
    done' >"$out/kernels.log" 2>&1) &
for half in "12-13 lenet-b1,lenet-b64,mnist-b64,mlp-b128" "14-15 gpt2l-b8,lstm-b8,hf-gpt2-b4,hf-bert-b4"; do
  set -- $half
  (timeout "$limit" taskset -c "$1" python3 scripts/bench.py --device gpu --warm-cache --systems ratex_compile --steps 3 \
      --warmup 1 --timeout 90 --models "$2" | grep -E "fails|timed out" >>"$out/warm.log" 2>&1) &
done
wait
# `timeout` ends each stream's first process, not what it started (pytest's workers, bench's
# cells): end every Python process of this run, so that the quiet phase is quiet.
pkill -9 -s 0 python3; pkill -9 -f 'scripts/(zoo|bench|kernel_check)\.py'; sleep 2
echo "phase 1 done at $(($(date +%s) - start)) s; load average $(cut -d' ' -f1 /proc/loadavg)"

timeout 200 python3 scripts/bench.py --device gpu --warm-cache --steps 30 --timeout 60 --systems eager,ratex_compile \
    --models lenet-b1,lenet-b64,mnist-b64,mlp-b128,gpt2l-b8,lstm-b8,hf-gpt2-b4,hf-bert-b4 >"$out/quiet.log" 2>&1
echo "done in $(($(date +%s) - start)) s"
echo "suite: $(grep -c ' PASSED' "$out/suite.log") passed, $(grep -cE ' (FAILED|ERROR)' "$out/suite.log") failed," \
     "$(grep -c ' SKIPPED' "$out/suite.log") skipped; $(tail -n 1 "$out/suite.log")"
grep -E '^(FAILED|ERROR) ' "$out/suite.log" | cut -c1-200 | head -n 30
cat "$out/kernels.log" "$out/warm.log"
grep -E 'round|^model |x  |fails' "$out/quiet.log"
