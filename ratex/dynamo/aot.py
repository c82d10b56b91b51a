"""The dynamo backend: AOTAutograd splits each captured graph into forward and backward.

Decompositions are chosen against the lowering table: torch's core-ATen
decompositions only of ops that `tvm_lowering` has no rule for (convolution
backward, layer norm, log-softmax stay whole, as ratex lowers them whole).
Training-mode dropout has no core decomposition and gets the lazy path's
seeded mask instead (graphs.draw_seeds); a random op that a decomposition
produces runs eagerly.

Attention is captured with PyTorch's math backend: its matmuls and softmax are
what autograd differentiates and ratex lowers (as the lazy device records
them). The fused CPU/CUDA attention kernels would leave a forward and a
backward op without lowering rules, and torch's decomposition of the CPU one
returns attention weights where its backward expects log-sum-exps. Input mutations of graphs without autograd (optimizer steps)
stay in the graph (`keep_inference_input_mutations`), so ratex writes them back
itself, in place where buffer donation allows.
"""
import functools
import time

import torch

import tvm_lowering
from . import adapter
from .program import CompiledGraph


@functools.lru_cache(maxsize=None)
def decompositions() -> dict:
    """Return the decomposition table: core ATen decompositions of ops without a lowering rule."""
    from torch._decomp import core_aten_decompositions  # noqa: PLC0415

    return {
        op: fn for op, fn in core_aten_decompositions().items()
        if isinstance(op, torch._ops.OpOverload) and not tvm_lowering.has_rule(op.__name__)
        and op not in _UNFIT
    }


_UNFIT = {torch.ops.aten._scaled_dot_product_flash_attention_for_cpu.default}  # see the module doc


def _compiler(role: str, compile_graph):
    def compiler(gm, example_inputs):
        return compile_graph(gm, role)

    compiler.__name__ = f"ratex_{role}_compiler"
    return compiler


def capture(gm: torch.fx.GraphModule, example_inputs: list, compile_graph=CompiledGraph):
    """Split a dynamo graph with AOTAutograd as ratex does; return the callable dynamo runs.

    Each graph AOTAutograd produces goes to `compile_graph(graph_module, role)`, role being
    'forward', 'backward' or 'inference'; it returns what AOTAutograd calls for that graph.
    The seconds AOTAutograd takes are kept as the metric CaptureTime.
    """
    from torch._dynamo.backends.common import aot_autograd  # noqa: PLC0415
    from torch._functorch.partitioners import min_cut_rematerialization_partition  # noqa: PLC0415
    from torch.nn.attention import SDPBackend, sdpa_kernel  # noqa: PLC0415

    start = time.perf_counter()
    with sdpa_kernel([SDPBackend.MATH]):  # AOTAutograd traces forward and backward inside this call
        compiled = aot_autograd(
            fw_compiler=_compiler("forward", compile_graph),
            bw_compiler=_compiler("backward", compile_graph),
            inference_compiler=_compiler("inference", compile_graph),
            decompositions=decompositions(),
            # The backward recomputes what is cheap to recompute (views, pointwise ops) instead of
            # the forward returning it (a saved weight transpose would be a copy in the forward program).
            partition_fn=min_cut_rematerialization_partition,
            keep_inference_input_mutations=True,
        )(gm, example_inputs)
    adapter.add_sample("CaptureTime", time.perf_counter() - start)
    return compiled


def backend(gm: torch.fx.GraphModule, example_inputs: list, **options):
    """Return the compiled callable of a dynamo graph (the `torch.compile(backend="ratex")` entry point)."""
    if options:
        raise ValueError(f"torch.compile(backend='ratex') takes no options; got {sorted(options)}")
    return capture(gm, example_inputs)
