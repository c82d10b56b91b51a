#!/usr/bin/env bash
# The GPU checks in one run, for a machine with a CUDA GPU and 16 cores, ratex's dependencies
# installed (PYTHONPATH may point at this checkout and a TVM built for that Python):
#
#   bash scripts/gpu_check.sh OUTDIR [SECONDS]
#
# Builds the native library against that machine's torch, then:
#  1. quiet: scripts/bench.py --device gpu, eager against ratex_compile, one cell at a time with
#     nothing else running (at most 160 s): the figures to report;
#  2. at once, each on cores of its own (taskset), for at most SECONDS (default 330): the suite
#     with RATEX_DEVICE=GPU on 8 workers; every bench model in three streams (eager, ratex_compile,
#     ratex_script, ratex_lazy: first figures, run beside the suite); the scripted GPT on TVM's
#     kernels alone; scripts/kernel_check.py on three steps' GPU kernels; and scripts/zoo.py's
#     GPT-2, T5, BERT and GPT-J in the lazy and script modes.
# The logs (suite.log lists each test's result as it ends, so a stopped suite still counts; a
# bench log lists each cell as it ends) go to OUTDIR. Python's fault handler is on throughout:
# a crash prints the Python stack of every thread.
set -u
out=${1:?usage: gpu_check.sh OUTDIR [SECONDS]}
limit=${2:-330}
cd "$(dirname "$0")/.."
mkdir -p "$out"
export PYTHONFAULTHANDLER=1 PYTHONUNBUFFERED=1
python3 -c "import torch; assert torch.cuda.is_available(), 'no CUDA device visible to torch'" || exit 1
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader
start=$(date +%s)
python3 setup.py --quiet build_native --inplace >"$out/build.log" 2>&1
echo "native build rc $? in $(($(date +%s) - start)) s"; tail -n 2 "$out/build.log"; rm -f "$out/build.log"

timeout 160 python3 scripts/bench.py --device gpu --models lenet-b1,mnist-b64,mlp-b128,gpt2l-b8,hf-gpt2-b4 \
    --systems eager,ratex_compile --steps 30 --timeout 60 --json "$out/bench_quiet.json" >"$out/bench_quiet.log" 2>&1
echo "quiet bench done at $(($(date +%s) - start)) s"

systems=eager,ratex_compile,ratex_script,ratex_lazy
(RATEX_DEVICE=GPU timeout "$limit" taskset -c 0-7 python3 -m pytest -v -n 8 -p no:cacheprovider --timeout 180 \
    -rfE tests >"$out/suite.log" 2>&1; echo "suite rc $?" >>"$out/suite.log") &
(timeout "$limit" taskset -c 8-9 python3 scripts/bench.py --device gpu --models lenet-b1,lenet-b64,mnist-b64 \
    --systems $systems --steps 20 --timeout 90 >"$out/bench_a.log" 2>&1) &
(timeout "$limit" taskset -c 10-11 python3 scripts/bench.py --device gpu --models mlp-b128,gpt2l-b8,lstm-b8 \
    --systems $systems --steps 20 --timeout 90 >"$out/bench_b.log" 2>&1) &
(timeout "$limit" taskset -c 12-13 python3 scripts/bench.py --device gpu --models hf-gpt2-b4,hf-bert-b4 \
    --systems $systems --steps 20 --timeout 90 >"$out/bench_c.log" 2>&1) &
(RATEX_DEVICE=GPU timeout "$limit" taskset -c 14-15 bash -c '
    for kernels in TVM auto; do
      echo "== RATEX_KERNELS=$kernels: scripted GPT, 3 steps"
      RATEX_KERNELS=$kernels timeout 90 python3 scripts/bench.py --cell gpt2l-b8 ratex_script --steps 3 --warmup 1 \
          --device gpu 2>&1 | tail -n 15
    done >'"$out/probe.log"' 2>&1
    for m in "stack --mode script" "gpt2l-b8 --mode script" "lstm-b8 --mode lazy"; do
      echo "== kernel_check $m"; RATEX_CACHE_DIR= timeout 90 python3 scripts/kernel_check.py $m 2>&1 | tail -n 6
    done >>'"$out/probe.log"' 2>&1
    python3 scripts/zoo.py --models gpt2,t5,bert,gptj --modes lazy,script --workers 2 >'"$out/zoo.log"' 2>&1') &
wait
echo "done in $(($(date +%s) - start)) s"
echo "suite: $(grep -c ' PASSED ' "$out/suite.log") passed, $(grep -cE ' (FAILED|ERROR) ' "$out/suite.log") failed," \
     "$(grep -c ' SKIPPED ' "$out/suite.log") skipped; $(tail -n 1 "$out/suite.log")"
sed -n '/^model /,/^$/p' "$out/bench_quiet.log"
for f in bench_a bench_b bench_c; do grep -E '^  \S+ / \S+ \(round' "$out/$f.log"; done
cat "$out/probe.log"; sed -n '/^model /,$p' "$out/zoo.log"
