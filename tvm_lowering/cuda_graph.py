"""CUDA graphs: a program's kernels replayed as captured graphs (Options.cuda_graph).

TVM's RewriteCUDAGraph (pass config `relax.backend.use_cuda_graph`) lifts runs of kernel
launches whose arguments are all static into functions that the VM runs once, captures as a
CUDA graph, and replays on later calls (`vm.builtin.cuda_graph.run_or_capture`). Static:
constants, intermediates in storage planned at constant sizes (which the VM keeps from call to
call), and the parameters of a function from its `num_input` attribute on, whose buffers the
graph reads and writes at the addresses it was captured with.

ratex passes every tensor of a step as an input of `main`. Those the step updates in place
(buffer donation: parameters, optimizer state) keep their buffers from one step to the next:
`passes` moves them last, into an inner function with `num_input` set, so that the kernels
reading only them and intermediates are captured; `main` keeps its signature. The function
`GRAPH_INPUTS` of the executable lists those inputs (main's positions); the runtime checks they
come at the addresses of the capture and makes a fresh VM, which captures anew, where they don't.

The kernel library (ratex.lib.*) calls PyTorch, whose allocator and streams know nothing of a
capture on TVM's stream: a program whose captured functions would call it, or any other packed
function outside TVM's VM builtins, is built without graphs.
"""
import tvm
from tvm import relax

GRAPH_INPUTS = "ratex_graph_inputs"  # () -> Shape: main's inputs that the captured graphs hold at fixed addresses
_INNER = "main_graph"
_CAPTURE = "vm.builtin.cuda_graph.run_or_capture"


def passes(donated: list) -> tuple:
    """Return (place, capture): `place` moves main's donated inputs (the (input, output) pairs in
    `donated`, filled by the donation pass before it runs) after the others, for after donation;
    `capture` applies TVM's rewrite where it is safe, for right after StaticPlanBlockMemory."""
    placed = []  # main's inputs that `place` made static

    @tvm.transform.module_pass(opt_level=0, name="RatexCudaGraphInputs")
    def place(mod, _ctx):
        static = sorted({i for i, _ in donated})
        placed[:] = static
        return _static_last(mod, static) if static else mod

    @tvm.transform.module_pass(opt_level=0, name="RatexCudaGraph")
    def capture(mod, _ctx):
        with tvm.transform.PassContext(config={"relax.backend.use_cuda_graph": True}):
            rewritten = relax.transform.RewriteCUDAGraph()(mod)
        added = [gv for gv in rewritten.get_global_vars() if gv.name_hint not in {g.name_hint for g in mod.get_global_vars()}]
        if not added or any(_calls_outside_tvm(rewritten[gv]) for gv in added):
            return mod
        inputs = relax.Function([], relax.ShapeExpr(list(placed)), relax.ShapeType(ndim=len(placed)), is_pure=True)
        rewritten[GRAPH_INPUTS] = inputs.with_attr("global_symbol", GRAPH_INPUTS)
        return rewritten

    return place, capture


def _static_last(mod, static: list):
    """`mod` with main's body moved into `_INNER`, whose parameters are main's with those at
    positions `static` last and `num_input` set before them; main calls it."""
    gv = mod.get_global_var("main")
    main = mod[gv]
    order = [k for k in range(len(main.params)) if k not in set(static)] + list(static)
    attrs = {k: v for k, v in (main.attrs or {}).items() if k != "global_symbol"}
    attrs["num_input"] = len(main.params) - len(static)
    inner = relax.Function([main.params[k] for k in order], main.body, main.ret_ty, main.is_pure,
                           tvm.ir.make_node("ir.DictAttrs", **attrs))
    builder = relax.BlockBuilder(mod)
    inner_gv = builder.add_func(inner, _INNER)
    params = [relax.Var(p.name, p.ty) for p in main.params]
    out = relax.Var("out", main.ret_ty)
    body = relax.SeqExpr([relax.BindingBlock([relax.VarBinding(out, relax.Call(inner_gv, [params[k] for k in order]))])], out)
    builder.update_func(gv, relax.Function(params, body, main.ret_ty, main.is_pure, main.attrs, main.span))
    return builder.get()


def _calls_outside_tvm(func) -> bool:
    """Whether `func` calls a packed function other than the VM's builtins (ratex.lib.*, ...)."""
    found = []

    def visit(expr):
        if isinstance(expr, relax.ExternFunc) and not str(expr.global_symbol).startswith("vm.builtin."):
            found.append(expr)

    relax.analysis.post_order_visit(func, visit)
    return bool(found)


def captured(mod) -> bool:
    """Whether a built module's `main` replays CUDA graphs (a test's view of the rewrite)."""
    found = []

    def visit(expr):
        if isinstance(expr, relax.ExternFunc) and str(expr.global_symbol) == _CAPTURE:
            found.append(expr)

    for gv in mod.get_global_vars():
        if isinstance(mod[gv], relax.Function):
            relax.analysis.post_order_visit(mod[gv], visit)
    return bool(found)
