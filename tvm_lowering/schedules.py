"""CPU schedules for the TVM-generated kernels (everything not sent to the kernel library).

TVM's default CPU pipeline leaves every kernel a serial loop nest. These rules
give sums of products (matmul, convolutions and their gradients) register tiles
of vector accumulators, give fused elementwise kernels a parallel outer loop and
a vectorized inner one (inlining each producer into its consumers unless it
costs more than 64 operations an element, like the random bits' hash or erfinv),
turn reductions over a non-contiguous axis (bias gradients: a sum over the
batch) into vector accumulations down the columns, keep vectors of partial
results along rows for reductions over the contiguous axis, and reuse dlight's
CPU rule for the other reductions (softmax, norms); its GEMV rule broke
native_batch_norm_backward's kernels, so it is left out. A rule that does not
fit a kernel leaves it as it was.
"""
import math

import tvm
import tvm_ffi
from tvm import s_tir, tirx
from tvm.s_tir import dlight
from tvm.s_tir.analysis import estimate_tir_flops
from tvm.s_tir.dlight.analysis import get_root_block, normalize_prim_func
from tvm.s_tir.dlight.base.utils import get_extent
from tvm.s_tir.dlight.cpu.base import CPUScheduleRule

_VECTOR = 16  # float32 lanes of one AVX-512 register; LLVM splits it for narrower ISAs
_MIN_PARALLEL = 4096  # below this a parallel region costs more than it saves
_INLINE_MAX_OPS = 64  # a producer above this many operations an element is not inlined
# A block annotation: never inline this block (its consumer reads each element many times,
# e.g. pool_grad's window winners; inlined, each would be recomputed per read).
MATERIALIZE = "ratex.materialize"
_TILE_ROWS = 8  # rows of a contraction's register tile: 8 vector accumulators
_LOAD = tvm.ir.TensorLoad  # the class of tirx.BufferLoad (a constructor function in TVM 0.27)


def _schedule(func):
    """A schedule of `func` whose refused primitives raise without rendering the IR: the rules
    try primitives that may not apply (_tried), and the rendering cost more than the tries."""
    return s_tir.Schedule(func, error_render_level="fast")


class Injective(CPUScheduleRule):
    """Fused elementwise kernels: inline producers, then parallel outer + vectorized inner loop."""

    def apply(self, func, target, _tunable):
        if not isinstance(func, tirx.PrimFunc) or not self.is_target_available(target):
            return None
        sch = _schedule(func)
        infos = normalize_prim_func(sch)
        if not infos or not all(_elementwise(sch, info) for info in infos):
            return None
        _fuse_elementwise(sch, infos)
        return sch


def _fuse_elementwise(sch, infos):
    """Inline elementwise blocks into each other, then vectorize what is left of them."""
    # Inlining copies a producer's expression into every load of it, and loads of loads
    # multiply: erfinv's backward (~2900 ops an element) inlined grows a kernel to hundreds of
    # KB of TIR that compiles far slower than left alone. Costly producers -- the random
    # bits' hash, special functions -- stay loops of their own; none of the benchmark
    # models' other kernels has a block above 6 ops an element.
    costly = [info for info in infos if _ops_per_element(sch, info.block_rv) > _INLINE_MAX_OPS
              or MATERIALIZE in sch.get(info.block_rv).annotations]
    for info in costly + _try_inline(sch, [info for info in infos if info not in costly]):
        _vectorize_block(sch, info.block_rv)


def _vectorize_block(sch, block_rv):
    """Parallel outer and vectorized inner loop for a block of fixed, large enough extents; tiles
    of a transposing block (`_transposing_loop`)."""
    loops = sch.get_loops(block_rv)
    extents = [get_extent(sch, loop) for loop in loops]
    if not loops or any(not isinstance(e, int) or e <= 0 for e in extents):
        return  # empty or symbolic: nothing worth scheduling
    # A small kernel is vectorized only where every intrinsic it calls has a vector form: TVM has
    # none for some (cosh, sinh), and a short row would then fail to compile. Large kernels are
    # vectorized regardless.
    if math.prod(extents) >= _MIN_PARALLEL or _vector_safe(sch.get(block_rv).body):
        # TVM's bfloat16 legalization fails on a vectorized store of a broadcast value (a zero fill,
        # an expand of one element: "buffer's dtype is uint16 ... RHS's dtype is bfloat16x16"):
        # a bfloat16 block runs its outer loops in parallel and leaves the innermost to LLVM.
        vector = not any(str(w.source.dtype) == "bfloat16" for w in sch.get(block_rv).writes)
        across = _transposing_loop(sch.get(block_rv), extents) if vector else None
        if across is not None:
            _tile_transpose(sch, loops, extents, across)
        else:
            _vectorize_innermost(sch, loops, extents, vector)


# Intrinsics that LLVM vectorizes inline (fastmath's exp and sigmoid call only these).
_VECTOR_INTRINSICS = {f"tirx.{name}" for name in (
    "floor", "ceil", "round", "nearbyint", "trunc", "fabs", "sqrt", "reinterpret", "shift_left", "shift_right",
    "isnan", "isinf", "isfinite", "bitwise_and", "bitwise_or", "bitwise_xor", "bitwise_not", "if_then_else",
    "likely", "copysign")}


def _vector_safe(node) -> bool:
    """Whether a block body (a store of arithmetic, selects and casts of loads) calls no
    intrinsic outside _VECTOR_INTRINSICS; anything else it holds (a let, a loop) counts as unsafe."""
    if isinstance(node, tirx.BufferStore):
        return _vector_safe(node.value) and all(_vector_safe(i) for i in node.indices)
    if isinstance(node, _LOAD):
        return all(_vector_safe(i) for i in node.indices)
    if isinstance(node, (tirx.IntImm, tirx.FloatImm, tirx.Var)):
        return True
    if isinstance(node, tvm.ir.Call):
        return (isinstance(node.op, tvm.ir.Op) and node.op.name in _VECTOR_INTRINSICS
                and all(_vector_safe(a) for a in node.args))
    if isinstance(node, tirx.Select):
        return all(_vector_safe(x) for x in (node.condition, node.true_value, node.false_value))
    if isinstance(node, tirx.Cast):
        return _vector_safe(node.value)
    if isinstance(node, tirx.Not):
        return _vector_safe(node.a)
    children = [getattr(node, name, None) for name in ("a", "b")]
    return all(isinstance(c, tvm.ir.Expr) for c in children) and all(_vector_safe(c) for c in children)


# A read whose address moves this many elements or more per step of the innermost loop reads
# each element of a vector from another cache line.
_STRIDED = _VECTOR


def _transposing_loop(block, extents):
    """The loop along which a read of the block runs contiguously where the innermost loop (the
    write's contiguous axis) strides through that read: a transposing copy, possibly fused
    with elementwise work; else None.

    Vectorized along the innermost loop alone, each vector of such a block gathers its lanes a
    row apart, and the loops outside walk whole columns of the read before coming back to the
    next element of each row: the attention heads' transposes (through reshapes the inliner
    leaves as div/mod chains) ran an order of magnitude slower than the plain copies they
    fused. Strides are measured by evaluating each read's address at a few points of the
    iteration space, which needs each loop to bind one block iterator, in order.
    """
    ivs = list(block.iter_vars)
    if len(ivs) != len(extents) or len(ivs) < 2 or extents[-1] < 4:
        return None
    if any(not isinstance(iv.dom.extent, tirx.IntImm) or iv.dom.extent.value != e for iv, e in zip(ivs, extents)):
        return None
    names = [iv.var for iv in ivs]
    points = [[(7 * j + 3 * k + 1) % max(e - 1, 1) for j, e in enumerate(extents)] for k in range(3)]
    for load in _loads(block.body):
        steps = [_address_step(load, names, points, k) for k in range(len(names))]
        inner = steps[-1]
        if inner is None or abs(inner) < _STRIDED:
            continue
        along = [k for k, step in enumerate(steps[:-1]) if step == 1 and extents[k] >= 4]
        if along:
            return along[-1]
    return None


def _tile_transpose(sch, loops, extents, across):
    """Square tiles of the innermost loop and loop `across`: each tile reads a few rows of the
    transposed input's cache lines and reuses them across its vector lanes (vectorized along the
    innermost loop; the loops outside the tiles run in parallel)."""
    lanes, height = _divisor(extents[-1], _VECTOR), _divisor(extents[across], _VECTOR)
    v_out, v_in = sch.split(loops[-1], [None, lanes])
    u_out, u_in = sch.split(loops[across], [None, height])
    outer = [loop for k, loop in enumerate(loops[:-1]) if k != across] + [u_out, v_out]
    sch.reorder(*outer, u_in, v_in)
    sch.vectorize(v_in)
    if math.prod(extents) >= _MIN_PARALLEL:
        sch.parallel(sch.fuse(*outer))


def _loads(expr):
    """The buffer loads in an expression or a store's value (not those inside load indices)."""
    if isinstance(expr, tirx.BufferStore):
        return _loads(expr.value)
    if isinstance(expr, _LOAD):
        return [expr]
    found = []
    for name in ("a", "b", "value", "condition", "true_value", "false_value", "body"):
        child = getattr(expr, name, None)
        if isinstance(child, tirx.Expr):
            found += _loads(child)
    for child in getattr(expr, "args", None) or ():
        if isinstance(child, tirx.Expr):
            found += _loads(child)
    return found


def _address_step(load, names, points, k):
    """How many elements the load's flat address moves when iterator k steps by one, the same at
    every point; None where it differs or the address is not plain integer arithmetic."""
    shape = [int(n) for n in load.source.shape] if all(isinstance(n, tirx.IntImm) for n in load.source.shape) else None
    if not shape:
        return None
    steps = set()
    for point in points:
        at = dict(zip(names, point))
        try:
            here = _flat(load.indices, shape, at)
            at[names[k]] += 1
            there = _flat(load.indices, shape, at)
        except _NotAffine:
            return None
        steps.add(there - here)
    return steps.pop() if len(steps) == 1 else None


class _NotAffine(Exception):
    """An index `_value` cannot evaluate."""


def _flat(indices, shape, at):
    address = 0
    for index, n in zip(indices, shape):
        address = address * n + _value(index, at)
    return address


_INT_OPS = {
    tirx.Add: lambda a, b: a + b, tirx.Sub: lambda a, b: a - b, tirx.Mul: lambda a, b: a * b,
    tirx.FloorDiv: lambda a, b: a // b, tirx.FloorMod: lambda a, b: a % b, tirx.Min: min, tirx.Max: max,
}


def _value(expr, at):
    """An integer index expression's value where the variables take the values `at`."""
    if isinstance(expr, tirx.IntImm):
        return int(expr.value)
    if isinstance(expr, tirx.Var):
        if expr in at:
            return at[expr]
        raise _NotAffine(expr)
    if isinstance(expr, tirx.Cast) and "int" in str(expr.dtype):
        return _value(expr.value, at)
    op = _INT_OPS.get(type(expr))
    if op is None:
        raise _NotAffine(expr)
    a, b = _value(expr.a, at), _value(expr.b, at)
    if b == 0 and op in (_INT_OPS[tirx.FloorDiv], _INT_OPS[tirx.FloorMod]):
        raise _NotAffine(expr)
    return op(a, b)


class Contraction(CPUScheduleRule):
    """A sum of products, C[...] += A[...] * B[...]: matmul, batch matmul, conv2d and the
    convolutions of its gradients (conv2d_transpose, the weight gradient as a conv).

    Unscheduled, each output element is one serial chain of scalar multiply-adds.
    Scheduled as a register-tiled
    outer product: the output's innermost axis is cut into a vector of up to 16
    lanes, and a spatial axis the vector operand does not read (matmul's rows,
    conv's output channels) into up to 8 rows, so each step of the reduction
    loads one vector, broadcasts 8 scalars and does 8 vector FMAs into
    accumulators held in registers (a "local" tile written back, with the
    kernel's elementwise epilogue -- bias, relu -- applied on the way out).
    Tiles run in parallel.
    Producers (padding, dilation, a flipped kernel) stay loops of their own.
    """

    def apply(self, func, target, _tunable):
        if not isinstance(func, tirx.PrimFunc) or not self.is_target_available(target):
            return None
        sch = _schedule(func)
        infos = normalize_prim_func(sch)
        reductions = [info for info in infos or () if info.is_reduction()]
        if len(reductions) != 1:
            return None
        main = reductions[0]
        if not all(info is main or _elementwise(sch, info) for info in infos):
            return None
        block = sch.get(main.block_rv)
        found = _multiply_add(block)
        if found is None or str(found[0].buffer.dtype) not in ("float32", "float64"):
            return None
        if any(str(w.source.dtype) == "bfloat16" for info in infos for w in sch.get(info.block_rv).writes):
            return None  # TVM's bfloat16 legalization fails on vectorized stores (see _reduction_block)
        store, operands = found
        kinds = [iv.iter_type for iv in block.iter_vars]
        spatial = [iv.var for iv in block.iter_vars if iv.iter_type == tirx.IterVar.DataPar]
        if not spatial or len(spatial) == len(kinds) or kinds != sorted(kinds):
            return None  # dlight's iterator order is spatial first, then reduced
        if len(main.iters) != len(kinds) or any(not isinstance(i, (tirx.Var, tirx.IntImm)) for i in store.indices):
            return None
        loops = [it.loop_rv for it in main.iters]
        extents = [get_extent(sch, loop) for loop in loops]
        if any(not isinstance(e, int) or e <= 0 for e in extents):
            return None
        # The vector axis: the output's innermost (contiguous) index.
        written = [i for i in store.indices if isinstance(i, tirx.Var)]
        v = next((k for k, var in enumerate(spatial) if written and var.same_as(written[-1])), None)
        if v is None:
            return None
        vector_ops = [op for op in operands if _reads(op, spatial[v])]
        # The row axis: a spatial axis no vector operand reads, so one vector load serves every row.
        rows = [k for k in range(len(spatial)) if k != v and not any(_reads(op, spatial[k]) for op in vector_ops)]
        u = max(rows, key=lambda k: (extents[k] > 1, k)) if rows else None
        lanes = _divisor(extents[v], _VECTOR)
        # A short tile of a long axis (a prime length) gains nothing from vectors.
        lanes = lanes if lanes >= 4 or extents[v] <= _VECTOR else 1
        height = _divisor(extents[u], _TILE_ROWS) if u is not None else 1

        try:  # a kernel of a shape these primitives refuse is left to the other rules
            s_loops, r_loops = loops[: len(spatial)], loops[len(spatial):]
            outer = list(s_loops)
            v_out, v_in = sch.split(s_loops[v], [None, lanes])
            outer[v] = v_out
            inner = [v_in]
            if u is not None:
                u_out, u_in = sch.split(s_loops[u], [None, height])
                outer[u] = u_out
                inner.insert(0, u_in)
            sch.reorder(*outer, *r_loops, *inner)
            tiles = sch.fuse(*outer) if len(outer) > 1 else outer[0]
            if math.prod(extents[: len(spatial)]) // (lanes * height) > 1:
                sch.parallel(tiles)
            # Parallel, vectorize and unroll go before decompose_reduction: TVM refuses them on the
            # update block once its init is split off.
            if lanes > 1:
                sch.vectorize(inner[-1])
            if u is not None:
                sch.unroll(inner[0])
            write_back = sch.cache_write(main.block_rv, 0, "local")
            sch.reverse_compute_at(write_back, tiles)
            _inline_epilogue(sch, infos[infos.index(main):], str(store.buffer.name))
            sch.decompose_reduction(main.block_rv, r_loops[0])
            back = sch.get_loops(write_back)
            if lanes > 1 and len(back) > 1 and get_extent(sch, back[-1]) == lanes:
                sch.vectorize(back[-1])
            for info in infos[: infos.index(main)]:
                _vectorize_block(sch, info.block_rv)
        except (s_tir.ScheduleError, tvm.error.InternalError):
            return None
        return sch


def _inline_epilogue(sch, infos, first):
    """Apply the elementwise blocks after the contraction (infos[0], writing buffer `first`) as
    its tile is written back, while they form a chain: each is the only reader of the block
    before it and reads nothing else the kernel computes. (TVM inlined t1 = tanh(h) with
    t2 = exp(h) + t1 still reading h, and left t2 a load of the removed h: the kernel failed
    to build.) The rest are fused among themselves as the Injective rule fuses a kernel."""
    blocks = [sch.get(info.block_rv) for info in infos[1:]]
    computed = {first} | {str(region.source.name) for block in blocks for region in block.writes}
    chain, inlined = first, []
    for info, block in zip(infos[1:], blocks):
        read = {str(region.source.name) for region in block.reads} & computed
        readers = sum(chain in {str(region.source.name) for region in other.reads} for other in blocks)
        if read != {chain} or readers != 1 or not _reads_as_written(block, chain):
            break
        try:
            sch.reverse_compute_inline(info.block_rv)
        except s_tir.ScheduleError:
            break
        chain = str(block.writes[0].source.name)
        inlined.append(info)
    _fuse_elementwise(sch, [info for info in infos[1:] if info not in inlined])


def _reads_as_written(block, name) -> bool:
    """Whether the block reads buffer `name` only at the point it writes, in a buffer of the
    written one's shape: an elementwise map, which reverse_compute_inline can fold into the
    block that computes `name`. TVM also reverse-inlines a slice, which reads a sub-region,
    and gets it wrong: the slice's iterators are dropped and every element of the
    producer is written to the slice's point, the last one winning (the weight gradient of a
    1x1 stride-2 conv on an even size, sliced from a 2x2 conv, came out as its corner)."""
    reads = [r for r in block.reads if str(r.source.name) == name]
    if len(reads) != 1 or len(block.writes) != 1:
        return False
    read, write = reads[0], block.writes[0]
    if not tvm_ffi.structural_equal(list(read.source.shape), list(write.source.shape)):
        return False
    return all(tvm_ffi.structural_equal(r.min, w.min) and tvm_ffi.structural_equal(r.extent, w.extent)
               for r, w in zip(read.region, write.region))


def _try_inline(sch, infos):
    """dlight's try_inline (inline each block into its consumers, or else its consumer into
    it, while any can be), returning the blocks left, except that a block is inlined into its
    producer only where it reads the producer's buffer as it writes its own (_reads_as_written)."""
    intermediates = {str(b.name) for b in sch.get(get_root_block(sch)).alloc_buffers}

    def reverse_inline(block_rv):
        block = sch.get(block_rv)
        read = {str(r.source.name) for r in block.reads} & intermediates
        if not all(_reads_as_written(block, name) for name in read):
            raise s_tir.ScheduleError("not an elementwise consumer")
        sch.reverse_compute_inline(block_rv)

    infos = list(infos)
    while True:
        for inline in (sch.compute_inline, reverse_inline):
            done = next((k for k, info in enumerate(infos) if _tried(inline, info.block_rv)), None)
            if done is not None:
                infos.pop(done)
                break
        else:
            return infos


def _tried(primitive, block_rv) -> bool:
    """Whether the schedule primitive applied to the block (a refusal leaves the schedule as it was)."""
    try:
        primitive(block_rv)
    except (s_tir.ScheduleError, tvm.error.InternalError):
        return False
    return True


def _multiply_add(block):
    """(store, [a, b]) when the block's body is C[..] = C[..] + a * b with a, b buffer loads
    (maybe cast), else None."""
    store = block.body
    if not isinstance(store, tirx.BufferStore) or not isinstance(store.value, tirx.Add):
        return None
    acc, product = store.value.a, store.value.b
    if not (isinstance(acc, _LOAD) and acc.source.same_as(store.buffer)):
        acc, product = product, acc
    if not (isinstance(acc, _LOAD) and acc.source.same_as(store.buffer)):
        return None
    product = _uncast(product)
    if not isinstance(product, tirx.Mul):
        return None
    operands = [_uncast(product.a), _uncast(product.b)]
    return (store, operands) if all(isinstance(op, _LOAD) for op in operands) else None


def _uncast(expr):
    while isinstance(expr, tirx.Cast):
        expr = expr.value
    return expr


def _reads(load, var) -> bool:
    """Whether the buffer load's indices use `var`."""
    return any(used.same_as(var) for index in load.indices for used in tirx.analysis.undefined_vars(index))


def _divisor(n: int, cap: int) -> int:
    """The largest divisor of n up to cap."""
    return max(d for d in range(1, min(n, cap) + 1) if n % d == 0)


class ColumnReduction(CPUScheduleRule):
    """A reduction whose inputs are contiguous along a kept (spatial) axis, e.g. sum(x, dim=0)
    or, with an inlined prologue, sum(a * b, dim=(0, 1)) (layer norm's weight gradient).

    Unscheduled, it walks each output's reduced axis with a stride of a whole
    row (far slower than torch for a 1024x1024 sum). Scheduled: loops become
    [kept outer (parallel), reduced, kept middle (up to 16 vectors), kept inner
    (16 lanes, or 8 or 4, vectorized)], so each step adds a contiguous run of a
    row into the accumulators.
    """

    def apply(self, func, target, _tunable):
        found = _reduction_block(self, func, target, contiguous="kept")
        if found is None:
            return None
        sch, block, spatial, _ = found
        loops = sch.get_loops(block)
        s_loops, r_loops = loops[: len(spatial)], loops[len(spatial):]
        extents = [get_extent(sch, loop) for loop in loops]
        if any(not isinstance(e, int) for e in extents):
            return None
        # Vectors of 16 lanes, or of 8 or 4 where the row is not a multiple of 16 (an LM head's
        # bias gradient: 1000 columns, left a serial column walk).
        lanes = next((w for w in (_VECTOR, 8, 4) if extents[len(spatial) - 1] % w == 0), None)
        if lanes is None:
            return None
        kept = sch.fuse(*s_loops) if len(s_loops) > 1 else s_loops[0]
        red = sch.fuse(*r_loops) if len(r_loops) > 1 else r_loops[0]
        # Each parallel task takes a chunk of up to 16 vectors of columns, so every row it adds
        # is a contiguous run of up to 1 KB (one 64-byte vector per row walks memory a row apart,
        # slower than torch's).
        width = math.prod(extents[: len(spatial)])
        vectors = _divisor(width // lanes, 16)
        outer, mid, inner = sch.split(kept, [None, vectors, lanes])
        sch.reorder(outer, red, mid, inner)
        sch.parallel(outer)
        sch.vectorize(inner)
        sch.decompose_reduction(block, red)  # the zero-fill goes before the reduced loop
        return sch


class RowReduction(CPUScheduleRule):
    """A reduction over the input's innermost (contiguous) axes, with nothing after it:
    max/sum along rows (attention scores' max, a loss's row sums).

    Unscheduled, each row is one serial chain of dependent adds or maxes.
    Scheduled: the reduced loop splits into 16-lane chunks and
    rfactor keeps 16 partial results per row in a vector, folded at the row's end;
    rows run in parallel. Sums are added in another order than the serial
    loop's, as PyTorch's vectorized sums are.
    """

    def apply(self, func, target, _tunable):
        found = _reduction_block(self, func, target, contiguous="reduced")
        if found is None:
            return None
        sch, block, spatial, reduce = found
        loops = sch.get_loops(block)
        extents = [get_extent(sch, loop) for loop in loops]
        if any(not isinstance(e, int) for e in extents) or math.prod(extents) < _MIN_PARALLEL:
            return None
        # Only the reduced axes that are the inputs' innermost indices make one contiguous run;
        # the others (the batch of a conv's bias gradient, sum over (0, 2, 3)) stay outer loops.
        # Fused in with the run, they would make each vector's lanes a div/mod of the fused index,
        # which LLVM gathers lane by lane: far slower than torch's for that bias gradient.
        run = _contiguous_run(sch.get(block), reduce)
        length = math.prod(extents[len(extents) - run:])  # of a row
        lanes = next((w for w in (16, 8, 4) if length % w == 0 and length >= 2 * w), None)
        if lanes is None:
            return None
        s_loops, r_loops = loops[: len(spatial)], loops[len(spatial):]
        if len(s_loops) > 1:
            sch.fuse(*s_loops)
        contiguous = r_loops[len(r_loops) - run:]
        red = sch.fuse(*contiguous) if len(contiguous) > 1 else contiguous[0]
        _, inner = sch.split(red, [None, lanes])
        try:
            partial = sch.rfactor(inner, factor_axis=0)
        except Exception:  # noqa: BLE001 - a reducer rfactor can't split (argmax's pair)
            return None
        rows_loop = sch.get_loops(partial)[0]  # the (fused) row loop, which rfactor gave the partials
        sch.reverse_compute_at(block, rows_loop)  # fold each row's partials right after computing them
        sch.parallel(rows_loop)
        sch.vectorize(sch.get_loops(partial)[-1])
        return sch


def _contiguous_run(block, reduce) -> int:
    """How many of the last reduced iterators every input reads as its last indices, in order."""
    reads = [r for r in block.reads if not any(r.source.same_as(w.source) for w in block.writes)]
    run = 0
    while run < len(reduce) and all(
        len(r.region) > run and r.region[-1 - run].min.same_as(reduce[-1 - run]) for r in reads
    ):
        run += 1
    return run


def _reduction_block(rule, func, target, contiguous):
    """(schedule, block, spatial vars, reduced vars) of a kernel that is one reduction, spatial
    iterators first, after elementwise producers that inline into it, whose inputs are contiguous
    along the last "kept" (spatial) or "reduced" axis; else None."""
    if not isinstance(func, tirx.PrimFunc) or not rule.is_target_available(target):
        return None
    sch = _schedule(func)
    infos = normalize_prim_func(sch)
    if not infos or not infos[-1].is_reduction():
        return None
    *prologue, last = infos
    if not all(_elementwise(sch, info) for info in prologue):
        return None
    try:
        for info in prologue:
            sch.compute_inline(info.block_rv)
    except Exception:  # noqa: BLE001 - not inlinable: not a kernel these rules take
        return None
    stmt = sch.get(last.block_rv)
    kinds = [iv.iter_type for iv in stmt.iter_vars]
    spatial = [iv.var for iv, k in zip(stmt.iter_vars, kinds) if k == tirx.IterVar.DataPar]
    reduce = [iv.var for iv, k in zip(stmt.iter_vars, kinds) if k == tirx.IterVar.CommReduce]
    if not spatial or not reduce or kinds != sorted(kinds):
        return None  # dlight's iterator order is spatial first, then reduced
    if any(str(w.source.dtype) == "bfloat16" for w in stmt.writes):
        return None  # TVM's bfloat16 legalization fails on the vectorized accumulator store
    axis = spatial[-1] if contiguous == "kept" else reduce[-1]
    read = [r for r in stmt.reads if not any(r.source.same_as(w.source) for w in stmt.writes)]
    if not read or any(not r.region or not r.region[-1].min.same_as(axis) for r in read):
        return None  # an input runs contiguously along another axis: the other rule's kernel
    return sch, last.block_rv, spatial, reduce


def _ops_per_element(sch, block_rv) -> float:
    """Operations one iteration of a block computes, counted as a tree (as the inliner copies
    them); unknown (a `let` inside, which TVM's counter does not take) counts as costly."""
    try:
        return estimate_tir_flops(sch.get(block_rv).body)
    except tvm.error.InternalError:
        return math.inf


def _vectorize_innermost(sch, loops, extents, vector=True):
    """Vectorize the innermost loop (split by the widest of 16/8/4/2 lanes that divides it) and
    run the loops outside it in parallel.

    Vectorizing the innermost loop keeps each vector's lanes on one contiguous row. Fusing
    every loop and splitting off 16 lanes instead makes each lane's
    indices a div/mod of the fused index wherever the row length isn't a multiple of 16
    (28, 10, 5: conv activations), and LLVM then gathers lane by lane: relu on a 64x6x28x28
    tensor runs far slower that way. Not `vector`: the innermost loop stays serial, left to LLVM.
    """
    *outer, last = loops
    width = next((w for w in (16, 8, 4, 2) if extents[-1] % w == 0 and extents[-1] > w), None)
    if vector and width is not None:
        rest, lanes = sch.split(last, [None, width])
        outer.append(rest)
        sch.vectorize(lanes)
    elif vector and extents[-1] <= _VECTOR:
        sch.vectorize(last)  # a short row (5, 7): one vector of its length
    elif vector:
        outer.append(last)  # a long row of prime length: left to LLVM
    total = 1
    for e in extents:
        total *= e
    if outer and total >= _MIN_PARALLEL:
        sch.parallel(sch.fuse(*outer) if len(outer) > 1 else outer[0])


def _elementwise(sch, info) -> bool:
    """Whether a block is elementwise: one output point per iteration, computed from inputs alone.

    dlight calls a block injective when its iterators are all spatial, which a reduction
    over an axis of extent 1 is too once normalized (a matmul with k = 1). Such a block
    keeps its T.init(), and its reads omit the output it accumulates into: inlined
    like an elementwise block, an epilogue rsqrt(c) became rsqrt(0) for the init and
    rsqrt(inf + a * b) = 0 for the update.
    """
    block = sch.get(info.block_rv)
    return bool(info.is_injective()) and block.init is None and _writes_own_point(block)


def _writes_own_point(block) -> bool:
    """Whether each iteration writes only the element its own iterators name.

    "Injective" in dlight's sense only means all block iterators are spatial;
    a scatter (embedding backward, index_put) is spatial too but writes where
    the data says, and running its iterations in parallel would race.
    """
    own = {iv.var for iv in block.iter_vars}
    # iterators that take more than one value: each must pick the written element
    varying = [iv.var for iv in block.iter_vars if not (isinstance(iv.dom.extent, tirx.IntImm) and iv.dom.extent.value == 1)]
    for region in block.writes:
        if any(not (isinstance(r.extent, tirx.IntImm) and r.extent.value == 1) for r in region.region):
            return False
        # an index is an iterator or a constant (expand_dims writes out[0, i, j])
        if any(not (isinstance(r.min, tirx.IntImm) or (isinstance(r.min, tirx.Var) and r.min in own))
               for r in region.region):
            return False
        named = {r.min for r in region.region if isinstance(r.min, tirx.Var)}
        if any(v not in named for v in varying):
            return False
        if any(read.source.same_as(region.source) for read in block.reads):
            return False
    return True


def _rules():
    return [Contraction(), Injective(), ColumnReduction(), RowReduction(), dlight.cpu.Reduction()]


def cpu_schedule():
    """The pass that applies ratex's CPU schedule rules to unscheduled kernels."""
    return dlight.ApplyDefaultSchedule(*_rules())


def default_schedule(func: tirx.PrimFunc, target):
    """The schedule cpu_schedule() gives `func` (its trace replays it), or None if no rule fits."""
    for rule in _rules():
        sch = rule.apply(func, target, False)
        if sch is not None:
            return sch
    return None
