"""Concatenations and stacks of many tensors as one copy loop per tensor (the CPU target's).

TVM's concatenate and stack compute each output element through a chain of if_then_else over
the inputs: for the time-step stack of an unrolled RNN (32 inputs), a 32-deep branch at every
element, about 150 ms of LLVM code generation a kernel, built under the target's LLVM options
(codegen.py) where branching kernels wait for each other. From `MANY` inputs on, the output is
written instead by one loop nest per input, straight copies that LLVM vectorizes. Such a kernel
is opaque to fusion: what produces or reads its inputs and output is a kernel of its own. Fewer
inputs (the halves of a rotary embedding, a cache's append) keep TVM's kernels, which fuse.
"""
import math

from tvm import relax, te, tirx

MANY = 8
_PARALLEL_MIN = 1 << 16  # elements of an input from which its copy runs on parallel tasks


def _static_fields(call):
    """The input tensors of a concat or stack call when they are a literal tuple of static
    shapes of one dtype, else None."""
    fields = call.args[0]
    if not isinstance(fields, relax.Tuple) or len(fields.fields) < MANY:
        return None
    types = [f.ty for f in fields.fields]
    if not all(isinstance(t, relax.TensorType) and t.shape is not None for t in types):
        return None
    if not all(isinstance(v, tirx.IntImm) for t in types for v in getattr(t.shape, "values", [None])):
        return None
    if len({str(t.dtype) for t in types}) != 1 or len({len(t.shape.values) for t in types}) != 1:
        return None
    return list(fields.fields)


def _copies(inputs, out_shape, place, name):
    """A TE op writing each of `inputs` into the output of `out_shape` at `place(k, index)` (the
    output index of element `index` of input k), by one loop nest per input."""

    def gen(ins, outs):
        nests = []
        for k, x in enumerate(ins):
            shape = [int(s) for s in x.shape]
            if 0 in shape:
                continue
            index = [tirx.Var(f"i{d}", "int64") for d in range(len(shape))]
            body = tirx.BufferStore(outs[0], tirx.BufferLoad(x, index), place(k, index))
            for d in reversed(range(len(shape))):
                kind = tirx.ForKind.PARALLEL if d == 0 and math.prod(shape) >= _PARALLEL_MIN else tirx.ForKind.SERIAL
                body = tirx.For(index[d], tirx.const(0, "int64"), tirx.const(shape[d], "int64"), kind, body)
            nests.append(body)
        return tirx.SeqStmt(nests) if len(nests) > 1 else nests[0]

    return te.extern([out_shape], list(inputs), gen, dtype=str(inputs[0].dtype), name=name)


def _concat(bb, call):
    fields = _static_fields(call)
    axis = call.attrs.axis
    if fields is None or axis is None:
        return call.op.get_attr("FLegalize")(bb, call)
    rank = len(fields[0].ty.shape.values)
    axis = int(axis) % rank
    starts = [0]
    for f in fields:
        starts.append(starts[-1] + int(f.ty.shape.values[axis]))

    def place(k, index):
        return [i + starts[k] if d == axis else i for d, i in enumerate(index)]

    out_shape = [int(v) for v in call.ty.shape.values]
    return bb.call_te(lambda *xs: _copies(xs, out_shape, place, "concat_copies"), *fields,
                      primfunc_name_hint="concat_copies")


def _stack(bb, call):
    fields = _static_fields(call)
    if fields is None or call.attrs.axis is None:
        return call.op.get_attr("FLegalize")(bb, call)
    axis = int(call.attrs.axis) % (len(fields[0].ty.shape.values) + 1)

    def place(k, index):
        return [*index[:axis], tirx.const(k, "int64"), *index[axis:]]

    out_shape = [int(v) for v in call.ty.shape.values]
    return bb.call_te(lambda *xs: _copies(xs, out_shape, place, "stack_copies"), *fields,
                      primfunc_name_hint="stack_copies")


LEGALIZE = {"relax.concat": _concat, "relax.stack": _stack}
