"""Pre-tune a benchmark model's training step (RATEX_TUNE), then compare step times.

    .venv/bin/python scripts/tune.py lenet-b64 --trials 8
    .venv/bin/python scripts/tune.py mlp-b128 --trials 8 --cache-dir /tmp/ratex-tune

First a few training steps of MODEL (scripts/bench_models.py) run with
RATEX_TUNE=--trials, once with RATEX_KERNELS=tvm and once with
RATEX_KERNELS=library: every TVM kernel of the step that has no record in the
cache dir's tuning database is tuned, and the compiled programs are stored in
the cache. Later training with the same RATEX_CACHE_DIR (RATEX_TUNE set or
not) uses those records.

Then the step is timed (as scripts/bench.py times a cell: fresh process per
configuration, median ms/step after --warmup steps) under:

  untuned         RATEX_KERNELS=tvm, no cache dir: every kernel TVM's, ratex's default schedules
  tuned           RATEX_KERNELS=tvm, the cache dir: the same kernels, tuned
  library         RATEX_KERNELS=library, no cache dir: matmul/conv by PyTorch's CPU kernels,
                  the rest TVM's with the default schedules
  library+tuned   RATEX_KERNELS=library, the cache dir: the rest tuned (what RATEX_TUNE
                  gives with the default RATEX_KERNELS=auto)
  eager           CPU PyTorch, for reference

Kernels that already have records are not tuned again: pass a fresh --cache-dir
to measure tuning from scratch. Timings on a shared machine are noisy.
"""
import argparse
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import bench  # noqa: E402  (runs the cells)
from bench_models import MODELS  # noqa: E402

_ENVIRON = dict(os.environ)  # as the user set it: importing ratex sets TVM's thread variables
from ratex import config  # noqa: E402  (RATEX_CACHE_DIR as ratex reads it)

CONFIGS = [  # name, system, RATEX_KERNELS, whether it uses the tuning records in --cache-dir
    ("untuned", "ratex_lazy", "tvm", False),
    ("tuned", "ratex_lazy", "tvm", True),
    ("library", "ratex_lazy", "library", False),
    ("library+tuned", "ratex_lazy", "library", True),
    ("eager", "eager", None, False),
]


def _env(args, **extra):
    env = dict(_ENVIRON)
    env.pop("RATEX_TUNE", None)
    if args.threads > 0:
        for var in ("OMP_NUM_THREADS", "MKL_NUM_THREADS", "TVM_NUM_THREADS"):
            env[var] = str(args.threads)
    env.update(extra)
    return env


def _cell(model, system, args, env, steps, warmup):
    result = bench.run_process(model, system, env, steps=steps, warmup=warmup, timeout=args.timeout,
                               verbose=args.verbose)
    if "error" in result:
        sys.exit(f"{model} / {system}: {result['error']}")
    return result


def _programs(counters):
    """How a configuration with the tuning records got its programs."""
    loaded = counters.get("PersistentCacheHit") or 0
    return f"{loaded} loaded" if loaded else f"compiled, {counters.get('TunedKernelsApplied') or 0} tuned kernels"


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter, epilog=__doc__)
    p.add_argument("model", choices=sorted(MODELS))
    p.add_argument("--trials", type=int, default=16, help="MetaSchedule trials per kernel (RATEX_TUNE)")
    p.add_argument("--cache-dir", default=config.CACHE_DIR,
                   help="compile cache and tuning records (default: ratex's, RATEX_CACHE_DIR or ~/.cache/ratex)")
    p.add_argument("--steps", type=int, default=20, help="train steps per timed configuration")
    p.add_argument("--warmup", type=int, default=3, help="first steps left out of the median")
    p.add_argument("--threads", type=int, default=1,
                   help="OMP/MKL/TVM threads while tuning and timing (0: library defaults); "
                        "kernels are tuned for this many threads")
    p.add_argument("--timeout", type=float, default=3600, help="seconds per process (tuning included)")
    p.add_argument("--verbose", action="store_true", help="print failing processes' stderr")
    args = p.parse_args()
    if args.trials <= 0:
        p.error(f"--trials must be a positive number of trials, not {args.trials}")
    if args.steps < args.warmup + 2:
        p.error(f"--steps must be at least --warmup + 2 = {args.warmup + 2}")
    if not args.cache_dir:
        p.error('RATEX_CACHE_DIR="" disables the cache that tuning records need: pass --cache-dir DIR')
    cache_dir = os.path.abspath(args.cache_dir)

    for kernels in ("tvm", "library"):
        print(f"{args.model}: pre-tuning with RATEX_TUNE={args.trials} RATEX_KERNELS={kernels}, cache {cache_dir}, "
              f"{args.threads if args.threads > 0 else 'default'} thread(s)", flush=True)
        # Three steps: an optimizer's first step traces a different graph than the later ones.
        env = _env(args, RATEX_KERNELS=kernels, RATEX_CACHE_DIR=cache_dir, RATEX_TUNE=str(args.trials))
        pre = _cell(args.model, "ratex_lazy", args, env, steps=3, warmup=1)
        tuned = pre["counters"].get("TunedKernels") or 0
        print(f"  tuning: {tuned} kernels tuned in {pre['tune_s']:.1f} s "
              f"({pre['wall_s']:.1f} s for the whole pre-tuning process, compiles included)"
              + ("" if tuned else "; every kernel already had records in this cache dir"), flush=True)

    rows = []
    results = {}
    for name, system, kernels, with_records in CONFIGS:
        env = _env(args)
        if kernels is not None:
            env.update(RATEX_KERNELS=kernels, RATEX_CACHE_DIR=cache_dir if with_records else "")
        r = results[name] = _cell(args.model, system, args, env, args.steps, args.warmup)
        counters = r.get("counters", {})
        if counters.get("TunedKernels"):
            sys.exit(f"the {name} configuration tuned kernels itself: pre-tuning missed part of the step")
        print(f"  {name}: {r['median_ms']:.2f} ms/step", file=sys.stderr, flush=True)
        base = results.get("untuned")
        rows.append([
            name, kernels or "-", f"{r['median_ms']:.2f}",
            f"{r['median_ms'] / base['median_ms']:.2f}x" if base else "-",
            f"{r['final_loss']:.4f}",
            _programs(counters) if with_records else "-",
        ])
    print()
    print(f"{args.model}, {args.trials} trials per kernel: median ms/step over steps "
          f"{args.warmup + 1}..{args.steps - 1}")
    print(bench.table(["config", "RATEX_KERNELS", "ms/step", "vs untuned", "final loss", "tuned programs"],
                      rows))


if __name__ == "__main__":
    main()
