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
#     - scripts/kernel_check.py on the GPU kernels of four steps (each kernel against its rule);
#     - each bench model's ratex_compile cell for 3 steps, which fills the compile cache
#       (RATEX_CACHE_DIR) that the quiet phase loads, then scripts/zoo.py's GPT-2, T5, BERT and
#       GPT-J in the lazy and script modes;
#  2. quiet, nothing else running, at most 200 s: scripts/bench.py --device gpu --warm-cache,
#     eager against ratex_compile on every bench model (first steps are cache loads here, not
#     compiles): the figures to report.
# The logs go to OUTDIR (at most 8 files: what a lent machine's call brings back), and a summary to
# stdout. Python's fault handler is on throughout: a crash prints every thread's Python stack.
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
(RATEX_DEVICE=GPU RATEX_CACHE_DIR= timeout "$limit" taskset -c 0-7 python3 -m pytest -v -n 8 -p no:cacheprovider \
    --timeout 150 -rfE --tb=short $tests >"$out/suite.log" 2>&1; echo "suite rc $?" >>"$out/suite.log") &
(RATEX_DEVICE=GPU RATEX_CACHE_DIR= timeout "$limit" taskset -c 8-11 bash -c '
    for m in "stack --mode script" "gpt2l-b8 --mode script" "lstm-b8 --mode lazy" "hf-bert-b4 --mode script"; do
      echo "== kernel_check $m"; python3 scripts/kernel_check.py $m 2>&1 | grep -E "^(program|  DIFFERS|  [a-z_0-9]+: its)|Error"
    done' >"$out/kernels.log" 2>&1) &
(timeout "$limit" taskset -c 12-15 bash -c '
    python3 scripts/bench.py --device gpu --warm-cache --systems ratex_compile --steps 3 --warmup 1 --timeout 90 \
        --models lenet-b1,lenet-b64,mnist-b64,mlp-b128,gpt2l-b8,lstm-b8,hf-gpt2-b4,hf-bert-b4 | grep -E "round|fails"
    RATEX_DEVICE=GPU RATEX_CACHE_DIR= python3 scripts/zoo.py --models gpt2,t5,bert,gptj --modes lazy,script --workers 2 \
        | sed -n "/^model /,\$p"' >"$out/warm_zoo.log" 2>&1) &
wait
echo "phase 1 done at $(($(date +%s) - start)) s"

timeout 200 python3 scripts/bench.py --device gpu --warm-cache --steps 30 --timeout 60 --systems eager,ratex_compile \
    --models lenet-b1,lenet-b64,mnist-b64,mlp-b128,gpt2l-b8,lstm-b8,hf-gpt2-b4,hf-bert-b4 >"$out/quiet.log" 2>&1
echo "done in $(($(date +%s) - start)) s"
echo "suite: $(grep -c ' PASSED' "$out/suite.log") passed, $(grep -cE ' (FAILED|ERROR)' "$out/suite.log") failed," \
     "$(grep -c ' SKIPPED' "$out/suite.log") skipped; $(tail -n 1 "$out/suite.log")"
grep -E '^(FAILED|ERROR) ' "$out/suite.log" | cut -c1-200 | head -n 30
cat "$out/kernels.log" "$out/warm_zoo.log"
grep -E 'round|^model |x  |fails' "$out/quiet.log"
