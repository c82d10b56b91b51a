"""Peak memory of a training step with ENABLE_PARAM_ALIASING on and off.

    .venv/bin/python scripts/memory.py                    # MLP 4 x 2048^2 (~67 MB of fp32 weights), Adam
    .venv/bin/python scripts/memory.py --width 1024 --layers 4 --optimizer sgd

Two figures, each with aliasing on and off:

1. The compiled step program's own allocations (tvm_lowering.pipeline.memory_plan):
   storage that memory planning reserves for intermediates, plus tensors
   allocated for outputs. Donated outputs are written into their inputs'
   buffers, so they drop out. Inputs, and what library kernels (matmul) allocate
   inside PyTorch, are not in this figure.
2. The peak resident set (ru_maxrss) of a fresh process that trains --steps
   steps. A first process per setting compiles into a private RATEX_CACHE_DIR;
   the measured one loads the programs from it, so compiling does not set the peak.
"""
import argparse
import json
import os
import resource
import subprocess
import sys
import tempfile

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
MB = 1 << 20


def _train(args):
    """Train the MLP on the lazy device; return (model, optimizer)."""
    import torch
    import torch.nn.functional as F

    import ratex.lazy_tensor_core.core.lazy_model as lm

    dev = torch.device("lazy", 0)
    torch.manual_seed(0)
    layers = []
    for _ in range(args.layers):
        layers += [torch.nn.Linear(args.width, args.width), torch.nn.ReLU()]
    model = torch.nn.Sequential(*layers[:-1]).to(dev)
    if args.optimizer == "adam":
        opt = torch.optim.Adam(model.parameters(), lr=1e-4, foreach=True)
    else:
        opt = torch.optim.SGD(model.parameters(), lr=1e-3, momentum=0.9, foreach=True)
    for _ in range(args.steps):
        x, y = torch.randn(args.batch, args.width), torch.randn(args.batch, args.width)
        opt.zero_grad()
        loss = F.mse_loss(model(x.to(dev)), y.to(dev))
        loss.backward()
        opt.step()
        lm.mark_step()
    lm.wait_device_ops()
    loss.item()
    return model, opt


def _child(args):
    _train(args)
    print(json.dumps({"maxrss_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024}))


def _maxrss(args, aliasing: bool, cache: str) -> float:
    env = dict(os.environ, ENABLE_PARAM_ALIASING=str(aliasing).lower(), RATEX_CACHE_DIR=cache,
               PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))
    cmd = [sys.executable, os.path.abspath(__file__), "--child", *sys.argv[1:]]
    for _ in range(2):  # the first run fills the cache, the second is measured
        out = subprocess.run(cmd, env=env, check=True, capture_output=True, text=True).stdout
    return json.loads(out.strip().splitlines()[-1])["maxrss_mb"]


def _program_figures(args):
    """Planned bytes of the largest step program, compiled with and without its donations."""
    os.environ["RATEX_CACHE_DIR"] = ""
    from ratex import config

    config.PARAM_ALIASING = True
    model, opt = _train(args)
    import tvm_lowering
    from ratex.core import executor
    from ratex.core.device import backend

    keyed = [(key, prog) for key, prog in executor.CACHE.entries() if prog.mod is not None]
    key, program = max(keyed, key=lambda kp: len(kp[1].mod["main"].params))
    donate = tuple(sorted(program.donate))
    target, options = backend().target, executor.compile_options()
    on = tvm_lowering.pipeline.memory_plan(program.mod, target, options, donate)
    off = tvm_lowering.pipeline.memory_plan(program.mod, target, options, ())
    weights = sum(p.numel() * p.element_size() for p in model.parameters())
    state = sum(v.numel() * v.element_size() for s in opt.state.values() for v in s.values()
                if hasattr(v, "device") and v.device.type == "lazy")
    return on, off, len(donate), weights, state


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--width", type=int, default=2048)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--optimizer", choices=("adam", "sgd"), default="adam")
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        return _child(args)
    with tempfile.TemporaryDirectory() as on_dir, tempfile.TemporaryDirectory() as off_dir:
        rss_on, rss_off = _maxrss(args, True, on_dir), _maxrss(args, False, off_dir)
    on, off, donated, weights, state = _program_figures(args)
    print(f"MLP {args.layers} x {args.width}^2, batch {args.batch}, {args.optimizer}: "
          f"parameters {weights / MB:.1f} MB, optimizer state {state / MB:.1f} MB, {donated} buffers donated")
    print(f"{'':28} {'aliasing off':>14} {'aliasing on':>14} {'saved':>10}")
    rows = [
        ("program: planned storage", off["planned"] / MB, on["planned"] / MB),
        ("program: output tensors", off["outputs"] / MB, on["outputs"] / MB),
        ("program: total", (off["planned"] + off["outputs"]) / MB, (on["planned"] + on["outputs"]) / MB),
        ("process: peak RSS", rss_off, rss_on),
    ]
    for name, a, b in rows:
        print(f"{name:28} {a:11.1f} MB {b:11.1f} MB {a - b:7.1f} MB")


if __name__ == "__main__":
    main()
