"""Compiled programs: lower a cut to Relax, compile it, run it on device data."""
from tvm import relax

import tvm_lowering
from . import metrics
from .device import backend
from .graph import Graph, to_fx


class Program:
    """One compiled graph: a Relax VM function taking leaves, returning roots."""

    __slots__ = ("fn", "vm", "mod")

    def __init__(self, executable, mod, device):
        self.vm = relax.VirtualMachine(executable, device)
        self.fn = self.vm["main"]
        self.mod = mod

    def run(self, inputs: list) -> list:
        """Run on device data `inputs`; return device data, one per root."""
        be = backend()
        outs = self.fn(*[be.to_tvm(x) for x in inputs])
        return [be.from_tvm(o) for o in outs]


def compile_graph(graph: Graph) -> Program:
    """Lower and compile `graph` for the configured target (raises LoweringError)."""
    be = backend()
    with metrics.timed("LowerTime"):
        mod = tvm_lowering.import_graph(to_fx(graph))
    with metrics.timed("CompileTime"):
        executable = tvm_lowering.build(mod, be.target)
    return Program(executable, mod, be.target.device())

