"""Feeding the lazy device: ratex.data.DeviceLoader against moving each batch with `.to()`.

    .venv/bin/python scripts/loader_bench.py                      # LeNet-5, batch 64
    .venv/bin/python scripts/loader_bench.py --model mlp-b128 --steps 40 --rounds 5

Both ways train the same model (scripts/bench_models.py) on the same CPU batches in one
process: 'to' moves each batch in the training loop and calls mark_step after the optimizer
step; 'loader' iterates a DeviceLoader, whose background thread moves the next batches while
the current step is traced and run, and which marks the step. The first steps compile (shared
by both: the same graph); then the ways take turns for --rounds rounds of --steps steps, and
the table gives the median over its rounds of each way's ms/step, and the last loss.
"""
import argparse
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
WAYS = ("to", "loader")


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0], epilog=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="lenet-b64", help="a model of scripts/bench_models.py")
    parser.add_argument("--steps", type=int, default=30, help="steps per round")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--threads", type=int, default=1, help="torch and TVM threads")
    args = parser.parse_args()
    os.environ.setdefault("TVM_NUM_THREADS", str(args.threads))

    import torch

    import ratex
    import ratex.lazy_tensor_core.core.lazy_model as lm
    from bench_models import MODELS

    if args.model not in MODELS:
        parser.error(f"--model {args.model}: use one of {', '.join(MODELS)}")
    if args.steps < 2 or args.rounds < 1:
        parser.error(f"--steps {args.steps} (at least 2) and --rounds {args.rounds} (at least 1)")
    torch.set_num_threads(args.threads)
    spec = MODELS[args.model]
    torch.manual_seed(0)
    model = spec.build().to("lazy")
    opt = spec.optimizer(model.parameters())
    pool = spec.batches(1)
    dev = lm.lazy_device()

    def step(x, y):
        opt.zero_grad()
        loss = spec.loss(model(x), y)
        loss.backward()
        return loss

    def by_hand(batches):
        for x, y in batches:
            loss = step(x.to(dev), y.to(dev))
            lm.optimizer_step(opt, barrier=True)
        return loss

    def with_loader(batches):
        for x, y in ratex.data.DeviceLoader(batches, dev):
            loss = step(x, y)
            lm.optimizer_step(opt)
        return loss

    run = {"to": by_hand, "loader": with_loader}
    batches = [pool[k % len(pool)] for k in range(args.steps)]
    for way in WAYS:  # compile, and let both ways start warm
        run[way](batches[:3])
        lm.wait_device_ops()
    times = {way: [] for way in WAYS}
    losses = {}
    for r in range(args.rounds):
        for way in WAYS if r % 2 == 0 else WAYS[::-1]:
            t0 = time.perf_counter()
            loss = run[way](batches)
            losses[way] = loss.item()  # waits for the last step
            times[way].append((time.perf_counter() - t0) / args.steps)
    print(f"{args.model}: {args.rounds} rounds of {args.steps} steps, {args.threads} thread(s)")
    print(f"{'way':8} {'ms/step':>10} {'vs to':>7} {'last loss':>10}")
    base = statistics.median(times["to"])
    for way in WAYS:
        ms = statistics.median(times[way])
        print(f"{way:8} {ms * 1e3:10.2f} {ms / base:7.2f} {losses[way]:10.4f}")


if __name__ == "__main__":
    main()
