"""The process that times tuning candidates (run as a script by tuning.py; imports only TVM).

Says {"ready": true} once started, then reads one JSON request per line on stdin -- {"lib": path of a compiled kernel,
"args": MetaSchedule argument infos, "number", "min_repeat_ms"} -- and answers
each with one JSON line on stdout: {"costs": [seconds, ...]} or {"error": text}.
A candidate that crashes ends this process, not the one compiling the model:
the parent sees the pipe close, records the candidate as failed and starts a
new worker.

Integer arguments (indices for gathers and scatters) are zero, not random:
random indices would read and write out of bounds.
"""
import json
import sys

import numpy as np
import tvm


def _alloc(args, dev, fill):
    out = []
    for kind, dtype, shape in args:
        if kind != "TENSOR":
            raise ValueError(f"cannot allocate a {kind} argument")
        arr = tvm.runtime.empty(shape, dtype=dtype, device=dev)
        if dtype.startswith(("float", "bfloat")):
            fill(arr)
        else:
            arr.copyfrom(np.zeros(shape, dtype=dtype))
        out.append(arr)
    return out


def main():
    dev = tvm.cpu()
    fill = tvm.get_global_func("tvm.contrib.random.random_fill_for_measure")
    out = sys.stdout
    sys.stdout = sys.stderr  # nothing but answers on the pipe
    out.write(json.dumps({"ready": True}) + "\n")
    out.flush()
    for line in sys.stdin:
        req = json.loads(line)
        try:
            mod = tvm.runtime.load_module(req["lib"])
            args = _alloc(req["args"], dev, fill)
            timer = mod.time_evaluator(mod.entry_name, dev, number=req["number"], repeat=1,
                                       min_repeat_ms=req["min_repeat_ms"])
            answer = {"costs": [float(c) for c in timer(*args).results]}
        except Exception as err:  # noqa: BLE001 - any failure is this candidate's failure
            answer = {"error": f"{type(err).__name__}: {str(err)[:500]}"}
        out.write(json.dumps(answer) + "\n")
        out.flush()


if __name__ == "__main__":
    main()
