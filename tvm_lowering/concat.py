"""Concatenations, stacks and splits of many tensors as copies (the CPU target's).

TVM's concatenate and stack compute each output element through a chain of if_then_else over
the inputs: for the time-step stack of an unrolled RNN (32 inputs), a 32-deep branch at every
element, about 150 ms of LLVM code generation a kernel, built under the target's LLVM options
(codegen.py) where branching kernels wait for each other. Its split (the gradient of such a
stack) writes each part in a block of its own, with whatever fused in front of it repeated in
every block: 400 ms of code generation for the LSTM's. From `MANY` tensors on, each is copied
instead, one memcpy of a constant size per contiguous run, which LLVM turns into vector moves
or a call. Such a kernel is opaque to fusion: what produces or reads its inputs and outputs is a
kernel of its own. Fewer tensors (the halves of a rotary embedding, a cache's append, q/k/v)
keep TVM's kernels, which fuse.
"""
import math

import tvm
from tvm import relax, te, tirx

from .simplify import static_shape

MANY = 8
_PARALLEL_MIN = 1 << 16  # elements of an input from which its copy runs on parallel tasks


def _static_fields(call):
    """The input tensors of a concat or stack call when they are a literal tuple of static
    shapes of one dtype, else None."""
    fields = call.args[0]
    if not isinstance(fields, relax.Tuple) or len(fields.fields) < MANY:
        return None
    types = [f.ty for f in fields.fields]
    shapes = [static_shape(t) for t in types]
    if any(shape is None for shape in shapes):
        return None
    if len({str(t.dtype) for t in types}) != 1 or len({len(shape) for shape in shapes}) != 1:
        return None
    return list(fields.fields) if _copyable(types[0].dtype) else None


# dtypes whose buffers keep their type through TVM's CPU lowering (bfloat16 and the float8s are
# stored as integers there, which a typed pointer to them then contradicts) and are whole bytes
_COPYABLE = {"bool", "float16", "float32", "float64", *(f"{s}int{b}" for s in ("", "u") for b in (8, 16, 32, 64))}


def _copyable(dtype) -> bool:
    """Whether `dtype`'s tensors are copied (else TVM's kernel is kept)."""
    return str(dtype) in _COPYABLE


def _rows(dst, dst_start, dst_stride, src, src_start, src_stride, rows, width, dtype):
    """A loop copying `rows` runs of `width` elements from flat `src` (the row at `src_start +
    row * src_stride`) into flat `dst` (at `dst_start + row * dst_stride`): a memcpy of a
    constant size per row, which LLVM turns into moves where the row is short."""
    row = tirx.Var("row", "int64")
    size = tirx.const(width * (tvm.runtime.DataType(dtype).bits // 8), "int64")
    copy = tirx.call_extern("handle", "memcpy", dst.access_ptr("w", offset=dst_start + row * dst_stride),
                            src.access_ptr("r", offset=src_start + row * src_stride), size)
    kind = tirx.ForKind.PARALLEL if rows > 1 and rows * width >= _PARALLEL_MIN else tirx.ForKind.SERIAL
    return tirx.For(row, tirx.const(0, "int64"), tirx.const(rows, "int64"), kind, tirx.Evaluate(copy))


def _copies(inputs, out_shape, runs, name):
    """A TE op writing each of `inputs` into the output of `out_shape`: input k, seen flat as
    `rows` rows of `width` contiguous elements, goes to the flat output at `start + row * stride`
    for each row, (rows, width, start, stride) = runs[k]."""
    dtype = str(inputs[0].dtype)

    def gen(ins, outs):
        nests = []
        for x, (rows, width, start, stride) in zip(ins, runs):
            if rows * width:
                nests.append(_rows(outs[0], start, stride, x, 0, width, rows, width, dtype))
        return tirx.SeqStmt(nests) if len(nests) > 1 else (nests[0] if nests else tirx.Evaluate(0))

    return te.extern([out_shape], list(inputs), gen, dtype=dtype, name=name)


def _concat(bb, call):
    fields = _static_fields(call)
    axis = call.attrs.axis
    if fields is None or axis is None:
        return call.op.get_attr("FLegalize")(bb, call)
    rank = len(static_shape(fields[0].ty))
    axis = int(axis) % rank
    shapes = [static_shape(f.ty) for f in fields]
    out_shape = static_shape(call.ty)
    rows, inner = math.prod(out_shape[:axis]), math.prod(out_shape[axis + 1:])
    runs, start = [], 0
    for shape in shapes:  # input k: rows of shape[axis] * inner elements, at its offset in each output row
        runs.append((rows, shape[axis] * inner, start, out_shape[axis] * inner))
        start += shape[axis] * inner
    return bb.call_te(lambda *xs: _copies(xs, out_shape, runs, "concat_copies"), *fields,
                      primfunc_name_hint="concat_copies")


def _stack(bb, call):
    fields = _static_fields(call)
    if fields is None or call.attrs.axis is None:
        return call.op.get_attr("FLegalize")(bb, call)
    axis = int(call.attrs.axis) % (len(static_shape(fields[0].ty)) + 1)
    out_shape = static_shape(call.ty)
    rows, inner = math.prod(out_shape[:axis]), math.prod(out_shape[axis + 1:])
    runs = [(rows, inner, k * inner, len(fields) * inner) for k in range(len(fields))]
    return bb.call_te(lambda *xs: _copies(xs, out_shape, runs, "stack_copies"), *fields,
                      primfunc_name_hint="stack_copies")


def _split(bb, call):
    """A split into `MANY` or more parts (the gradient of a time-step stack) as copies out of
    the input: TVM's kernel writes each part in a block of its own, with the parts' producers
    fused in front of every one."""
    x, out_types = call.args[0], call.ty.fields if isinstance(call.ty, relax.TupleType) else []
    shapes, in_shape = [static_shape(t) for t in out_types], static_shape(x.ty)
    if len(shapes) < MANY or in_shape is None or any(s is None for s in shapes) or not _copyable(x.ty.dtype):
        return call.op.get_attr("FLegalize")(bb, call)
    axis = int(call.attrs.axis) % len(in_shape)
    rows, inner = math.prod(in_shape[:axis]), math.prod(in_shape[axis + 1:])
    runs, start = [], 0
    for shape in shapes:  # part k: rows of shape[axis] * inner elements, from its offset in each input row
        runs.append((rows, shape[axis] * inner, start, in_shape[axis] * inner))
        start += shape[axis] * inner
    dtype = str(x.ty.dtype)

    def parts(data):
        def gen(ins, outs):
            nests = []
            for out, (count, width, begin, stride) in zip(outs, runs):
                if count * width:
                    nests.append(_rows(out, 0, width, ins[0], begin, stride, count, width, dtype))
            return tirx.SeqStmt(nests) if len(nests) > 1 else (nests[0] if nests else tirx.Evaluate(0))

        return te.extern(shapes, [data], gen, dtype=[dtype] * len(shapes), name="split_copies")

    return bb.call_te(parts, x, primfunc_name_hint="split_copies")


LEGALIZE = {"relax.concat": _concat, "relax.stack": _stack, "relax.split": _split}
