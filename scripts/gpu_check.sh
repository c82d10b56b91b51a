#!/usr/bin/env bash
# The GPU checks in one run, for a machine with a CUDA GPU and 16 cores, ratex's dependencies
# installed (PYTHONPATH may point at this checkout and a TVM built for that Python):
#
#   bash scripts/gpu_check.sh OUTDIR [SECONDS]
#
# Builds the native library against that machine's torch, then runs at once, each on cores of its
# own (taskset): the suite with RATEX_DEVICE=GPU on 7 workers, scripts/bench.py --device gpu in
# two streams, and scripts/zoo.py's GPT-2, T5 and BERT in the lazy and script modes on the GPU.
# Every part stops after SECONDS (default 420); the logs (suite.log lists each test's result as
# it ends, so a stopped suite still counts) and the bench JSON go to OUTDIR. The bench cells run
# beside the suite: their figures are first figures, not a quiet-machine table.
set -u
out=${1:?usage: gpu_check.sh OUTDIR [SECONDS]}
limit=${2:-420}
cd "$(dirname "$0")/.."
mkdir -p "$out"
python3 -c "import torch; assert torch.cuda.is_available(), 'no CUDA device visible to torch'" || exit 1
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader
start=$(date +%s)
python3 setup.py --quiet build_native --inplace >"$out/build.log" 2>&1
echo "native build rc $? in $(($(date +%s) - start)) s"
(RATEX_DEVICE=GPU timeout "$limit" taskset -c 0-6 python3 -m pytest -v -n 7 -p no:cacheprovider --timeout 180 \
    -rfE tests >"$out/suite.log" 2>&1; echo "suite rc $?" >>"$out/suite.log") &
(timeout "$limit" taskset -c 7-10 python3 scripts/bench.py --device gpu --models lenet-b1,lenet-b64,mnist-b64,mlp-b128 \
    --steps 20 --timeout 90 --json "$out/bench_a.json" >"$out/bench_a.log" 2>&1) &
(timeout "$limit" taskset -c 11-13 python3 scripts/bench.py --device gpu --models gpt2l-b8,hf-gpt2-b4 \
    --steps 20 --timeout 90 --json "$out/bench_b.json" >"$out/bench_b.log" 2>&1) &
(RATEX_DEVICE=GPU timeout "$limit" taskset -c 14-15 python3 scripts/zoo.py --models gpt2,t5,bert --modes lazy,script \
    --workers 2 >"$out/zoo.log" 2>&1) &
wait
echo "done in $(($(date +%s) - start)) s"
echo "suite: $(grep -c ' PASSED ' "$out/suite.log") passed, $(grep -cE ' (FAILED|ERROR) ' "$out/suite.log") failed," \
     "$(grep -c ' SKIPPED ' "$out/suite.log") skipped; $(tail -n 1 "$out/suite.log")"
for f in bench_a bench_b zoo; do sed -n '/^model /,/^$/p' "$out/$f.log"; done
