"""Peak memory of saving a state dict from the lazy device: lazy_model.save vs serialization.save.

    .venv/bin/python scripts/save_memory.py                 # 1 GB in 32 tensors
    .venv/bin/python scripts/save_memory.py --size-mb 256 --tensors 8 --json out.json

Each way of saving runs in a fresh process that puts --size-mb of float32 tensors on the lazy
device (a state dict), measures its resident set (the baseline: the device's copy is host
memory on CPU), saves to a temporary directory, and reads the peak resident set of the save
(VmHWM, reset just before it through /proc/self/clear_refs; Linux only). The table gives what
saving added above the baseline, and that as a fraction of the state dict's size.
"""
import argparse
import json
import os
import re
import subprocess
import sys
import tempfile

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
MB = 1 << 20
WAYS = ("lazy_model.save", "serialization.save")


def _status(field: str) -> int:
    """A VmXXX figure of this process from /proc/self/status, in bytes."""
    with open("/proc/self/status") as f:
        return int(re.search(rf"{field}:\s+(\d+) kB", f.read()).group(1)) * 1024


def _child(args):
    import gc

    import torch

    import ratex  # noqa: F401
    import ratex.lazy_tensor_core.core.lazy_model as lm
    from ratex.lazy_tensor_core.utils import serialization

    numel = args.size_mb * MB // 4 // args.tensors
    # Made on the device (a fill is device data at once): no CPU temporaries in the baseline.
    state = {f"layer{k}.weight": torch.full((numel,), float(k), device="lazy") for k in range(args.tensors)}
    lm.wait_device_ops()
    gc.collect()
    baseline = _status("VmRSS")
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")  # the peak starts again from here
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "ckpt.pt")
        if args.child == "lazy_model.save":
            lm.save(state, path)
        else:
            serialization.save(state, path)
        peak = _status("VmHWM")
    print(json.dumps({"way": args.child, "size_mb": args.size_mb, "baseline_mb": baseline / MB,
                      "peak_mb": peak / MB, "extra_mb": (peak - baseline) / MB}))


def measure(way: str, size_mb: int, tensors: int) -> dict:
    """Run one way of saving in a fresh process; return its figures (MB)."""
    env = dict(os.environ, PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""), RATEX_CACHE_DIR="")
    cmd = [sys.executable, os.path.abspath(__file__), "--child", way, "--size-mb", str(size_mb),
           "--tensors", str(tensors)]
    out = subprocess.run(cmd, env=env, check=True, capture_output=True, text=True).stdout
    return json.loads(out.strip().splitlines()[-1])


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0], epilog=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--size-mb", type=int, default=1024, help="size of the state dict (MB of float32)")
    parser.add_argument("--tensors", type=int, default=32, help="tensors it is split into")
    parser.add_argument("--json", metavar="PATH", help="write the figures here too")
    parser.add_argument("--child", choices=WAYS, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.size_mb < 1 or args.tensors < 1:
        parser.error(f"--size-mb {args.size_mb} and --tensors {args.tensors} must be at least 1")
    if args.child:
        return _child(args)
    rows = [measure(way, args.size_mb, args.tensors) for way in WAYS]
    print(f"state dict: {args.size_mb} MB in {args.tensors} tensors")
    print(f"{'way':20} {'baseline MB':>12} {'peak MB':>10} {'extra MB':>10} {'extra/size':>11}")
    for r in rows:
        print(f"{r['way']:20} {r['baseline_mb']:12.1f} {r['peak_mb']:10.1f} {r['extra_mb']:10.1f} "
              f"{r['extra_mb'] / args.size_mb:11.2f}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()
