"""fx.Graph of ATen OpOverloads -> Relax IRModule.

TVM's `ExportedProgramImporter` keeps ~300 maintained ATen->Relax rules keyed
by overload name; `Importer` reuses them and overlays the ratex table
(`tvm_lowering.ops.RULES`). Every rule's result is checked against the shape
and dtype that PyTorch's own shape inference recorded on the node, so a rule
that would compute something else fails loudly (and the caller falls back)
instead of returning wrong numbers.
"""
import functools

from torch import fx
from tvm import IRModule, relax
from tvm.relax.frontend.torch.exported_program_translator import ExportedProgramImporter

from . import dtypes
from .ops import RULES, SCRIPT_RULES, TIR_RULES, bounds


class LoweringError(RuntimeError):
    """A node of the graph could not be lowered; `node` is the fx node that failed."""

    def __init__(self, node: fx.Node, reason: str):
        super().__init__(f"cannot lower {node.format_node()}: {reason}")
        self.node = node


class Importer(ExportedProgramImporter):
    """TVM's ATen importer with ratex's rules layered on top."""

    library = False  # dispatch heavy ops to the kernel library (see ops/library.py)
    library_min_macs = 0  # ... those of at least this many multiply-adds
    # The module is built for the CPU: rules may emit TIR loops that run on the host (the serial scatters
    # of ops/kit.py and scans of ops/reductions.py), which a CUDA build would leave on the host, reading
    # device memory.
    host_kernels = False
    # Index checks being collected (ops/bounds.py): None where the caller did not ask for them.
    checks = None
    site = -1  # the number the caller gave the node being lowered (meta[bounds.SITE]), for its checks

    def __init__(self, differentiable=False):
        # The graph is a jit.script forward that Relax's Gradient will differentiate:
        # TVM's Relax-op rules win over ratex's TIR-kernel ones (ops.TIR_RULES).
        self.differentiable = differentiable
        super().__init__()

    def create_convert_map(self):
        table = super().create_convert_map()
        self.tvm_rules = dict(table)
        for name, fn in RULES.items():
            if fn is None:
                table.pop(name, None)
            elif not (self.differentiable and name in TIR_RULES and name in self.tvm_rules):
                table[name] = functools.partial(fn, self)
        if self.differentiable:
            table.update({name: functools.partial(fn, self) for name, fn in SCRIPT_RULES.items()})
        return table


@functools.lru_cache(maxsize=None)
def _rule_names() -> frozenset:
    return frozenset(Importer().convert_map)


def has_rule(overload_name: str) -> bool:
    """Return whether an ATen overload name ('add.Tensor') has a lowering rule."""
    return overload_name in _rule_names()


def _expected(val):
    """(shape, tvm dtype) pairs that a node's meta value promises."""
    if isinstance(val, (tuple, list)):
        return [_expected(v) for v in val]
    if val is None:
        return None
    return (tuple(int(s) for s in val.shape), dtypes.to_tvm(val.dtype))


def _actual(ty):
    if isinstance(ty, relax.TupleType):
        return [_actual(f) for f in ty.fields]
    if isinstance(ty, relax.TensorType) and ty.shape is not None:
        return (tuple(int(s) for s in ty.shape.values), str(ty.dtype))
    return None


def _check(node: fx.Node, expr: relax.Expr):
    want = _expected(node.meta.get("val"))
    if want is None:
        return
    got = _actual(expr.ty)
    if isinstance(want, list):
        if not isinstance(got, list) or len(got) < len(want):
            raise LoweringError(node, f"rule returned {got}, expected {want}")
        pairs = [(w, g) for w, g in zip(want, got) if w is not None]
    else:
        pairs = [(want, got)]
    for w, g in pairs:
        if w != g:
            raise LoweringError(node, f"rule produced {g}, PyTorch says {w}")


def import_graph(graph: fx.Graph, name: str = "main", library: bool = False, host_kernels: bool = False,
                 differentiable: bool = False, library_min_macs: int = 0, checks: list = None) -> IRModule:
    """Return an IRModule whose `name` function computes `graph`'s outputs as a tuple.

    Indices read from tensors never reach memory out of bounds. Given a list `checks`, the
    function also checks them: where some op indexes, it returns one more output, the
    check rows of ops/bounds.py, and `checks` receives each row's header
    (site, sub, dim, low, high); a node's site is its meta[bounds.SITE].

    With `library`, matmul and convolution become calls to the `ratex.lib.*`
    kernel library instead of TVM-generated code (those of fewer than
    `library_min_macs` multiply-adds excepted). `host_kernels` says the module
    will be built for the CPU (see Importer.host_kernels); `differentiable`, that
    Relax's Gradient will differentiate it (see Importer.__init__).
    """
    imp = Importer(differentiable)
    imp.library = library
    imp.library_min_macs = library_min_macs
    imp.host_kernels = host_kernels
    imp.checks = [] if checks is not None else None
    bb = relax.BlockBuilder()
    imp.block_builder = bb
    placeholders = [n for n in graph.nodes if n.op == "placeholder"]
    params = []
    for n in placeholders:
        shape, dtype = _expected(n.meta["val"])
        params.append(relax.Var(n.name, relax.TensorType(shape, dtype)))
    with bb.function(name, params=params):
        with bb.dataflow():
            for p, n in zip(params, placeholders):
                imp.env[n] = p
            outputs = None
            for node in graph.nodes:
                if node.op == "call_function":
                    fn = imp.convert_map.get(node.target.__name__)
                    if fn is None:
                        raise LoweringError(node, "no lowering rule")
                    imp.site = node.meta.get(bounds.SITE, -1)
                    try:
                        expr = fn(node)
                    except LoweringError:
                        raise
                    except Exception as exc:  # any failure inside a rule means: fall back
                        raise LoweringError(node, f"{type(exc).__name__}: {exc}") from exc
                    _check(node, expr)
                    imp.env[node] = expr
                elif node.op == "output":
                    outputs = [imp.env[a] for a in node.args[0]]
            if imp.checks:
                outputs.append(bounds.output(imp, checks))
            result = bb.emit_output(relax.Tuple(outputs))
        bb.emit_func_output(result)
    return bb.get()
