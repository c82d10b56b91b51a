"""CPU schedule rules of tvm_lowering/schedules.py: which kernels each rule takes and leaves,
and that what they schedule still matches CPU PyTorch (through `check`, with the TVM rules
rather than the kernel library)."""
import pytest
import torch
import torch.nn.functional as F

from rule_check import check, rnd

pytestmark = [pytest.mark.usefixtures("seeded", "tvm_kernels"), pytest.mark.cpu_only("ratex's CPU schedules")]


@pytest.mark.parametrize("shape,dims", [((64, 48), [0]), ((5, 3, 32), [0, 1]), ((4, 7, 16, 3), [0, 3]), ((33, 10), [1]),
                                        ((64, 128), [1]), ((8, 16, 48), [1, 2]), ((16, 6, 28, 28), [0, 2, 3]),
                                        ((9, 5, 6, 6), [0, 2, 3]), ((64, 1000), [0]), ((5, 3, 40), [0, 1])])
def test_reductions_over_leading_and_trailing_dims(shape, dims):
    # sum over a non-contiguous axis has its own CPU schedule (ColumnReduction in schedules.py),
    # and so has one over the contiguous axes of a large enough input (RowReduction)
    check(lambda x: (x.sum(dims), x.mean(dims, keepdim=True), x.amax(dims)), rnd(*shape), ops=["sum.dim_IntList"])


def test_column_reduction_of_a_product():
    """layer_norm's weight gradient, sum(g * xhat, dims=(0, 1)), reads two inputs: the column
    schedule takes it (unscheduled, it is a serial loop nest, far slower than torch's kernel)."""
    from tvm import te
    from tvm_lowering.pipeline import resolve_target
    from tvm_lowering.schedules import ColumnReduction

    a, b = te.placeholder((4, 8, 32), name="a"), te.placeholder((4, 8, 32), name="b")
    prod = te.compute(a.shape, lambda i, j, k: a[i, j, k] * b[i, j, k], name="prod")
    i, j = te.reduce_axis((0, 4)), te.reduce_axis((0, 8))
    out = te.compute((32,), lambda k: te.sum(prod[i, j, k], axis=[i, j]), name="out")
    assert ColumnReduction().apply(te.create_prim_func([a, b, out]), resolve_target("CPU").tvm, False) is not None
    # rows of 1000 (an LM head's bias gradient): vectors of 8 lanes
    wide = te.placeholder((64, 1000), name="wide")
    r = te.reduce_axis((0, 64))
    bias = te.compute((1000,), lambda k: te.sum(wide[r, k], axis=r), name="bias")
    sch = ColumnReduction().apply(te.create_prim_func([wide, bias]), resolve_target("CPU").tvm, False)
    assert sch is not None and "T.vectorized(8)" in sch.mod["main"].script()
    check(lambda x, y: ((x * y).sum([0, 1]), (x * y).sum(0)), rnd(4, 8, 32), rnd(4, 8, 32), ops=["sum.dim_IntList"])


def test_row_reduction_schedule():
    """max/sum along rows keep 16 partial results per row (rfactor); argmax's (index, value)
    reducer can't be split that way and is left alone."""
    from tvm import te, tirx
    from tvm_lowering.pipeline import resolve_target
    from tvm_lowering.schedules import RowReduction

    target = resolve_target("CPU").tvm
    x = te.placeholder((64, 4, 128), name="x")
    k = te.reduce_axis((0, 128))
    row_max = te.compute((64, 4), lambda i, j: te.max(x[i, j, k], axis=k), name="row_max")
    assert RowReduction().apply(te.create_prim_func([x, row_max]), target, False) is not None
    k = te.reduce_axis((0, 128))
    argmax = te.comm_reducer(lambda a, b: (tirx.Select(a[1] >= b[1], a[0], b[0]), tirx.max(a[1], b[1])),
                             lambda t0, t1: (tirx.const(-1, t0), tirx.min_value(t1)), name="argmax")
    idx, val = te.compute((64, 4), lambda i, j: argmax((k.var, x[i, j, k]), axis=k), name="am")
    assert RowReduction().apply(te.create_prim_func([x, idx, val]), target, False) is None
    check(lambda t: (t.amax(-1), t.sum(-1), (t * t).sum(-1, keepdim=True), t.argmax(-1)), rnd(64, 4, 128),
          ops=["amax.default"])


def test_row_reduction_keeps_a_leading_reduced_axis_outside_the_vectors():
    """A conv's bias gradient sums NCHW over (0, 2, 3): only H and W are contiguous, so the
    batch stays a loop of its own outside the 16-lane chunks of each H*W plane (fused into
    the chunks, the lanes would be gathered one by one across planes)."""
    from tvm import te
    from tvm_lowering.pipeline import resolve_target
    from tvm_lowering.schedules import RowReduction

    x = te.placeholder((64, 6, 28, 28), name="x")
    n, h, w = te.reduce_axis((0, 64)), te.reduce_axis((0, 28)), te.reduce_axis((0, 28))
    out = te.compute((6,), lambda c: te.sum(x[n, c, h, w], axis=[n, h, w]), name="out")
    sch = RowReduction().apply(te.create_prim_func([x, out]), resolve_target("CPU").tvm, False)
    assert sch is not None
    text = sch.mod["main"].script()
    assert "T.grid(64, 49)" in text and "T.vectorized(16)" in text, text  # batch, then 49 chunks of a plane


def test_elementwise_schedule_takes_constant_indices_but_not_races():
    """expand_dims writes out[0, i, j]: one element per iteration, so a fused kernel with it is
    inlined and vectorized (MHA's in-projection gradient has such a kernel).
    A block whose iterator picks no written index writes one element many times: left alone."""
    from tvm import s_tir, te
    from tvm.script import tirx as T
    from tvm_lowering.pipeline import resolve_target
    from tvm_lowering.schedules import Injective, _writes_own_point

    x = te.placeholder((64, 128), name="x")
    y = te.compute((64, 128), lambda i, j: x[i, j] * 2.0, name="y")
    z = te.compute((1, 64, 128), lambda a, i, j: y[i, j] + 1.0, name="z")
    func = te.create_prim_func([x, z])
    assert Injective().apply(func, resolve_target("CPU").tvm, False) is not None

    @T.prim_func(s_tir=True)
    def last_wins(a: T.Buffer((4,), "float32"), b: T.Buffer((1,), "float32")):
        for i in range(4):
            with T.sblock("b"):
                vi = T.axis.spatial(4, i)
                b[0] = a[vi]

    sch = s_tir.Schedule(last_wins)
    assert not _writes_own_point(sch.get(sch.get_sblock("b")))
    check(lambda t: (t.unsqueeze(0) * 2 + 1, torch.stack([t, t * 2, t * 3])), rnd(8, 32), ops=["mul.Tensor"])


def test_elementwise_schedule_keeps_costly_producers_loops_of_their_own():
    """A producer above 64 operations an element (here the random bits' int64 hash) is not
    substituted into its consumers: copies of copies made erfinv's backward kernel take 96 s
    to compile. The kernel is still scheduled; what it computes is checked against the CPU
    reference in test_random, and erfinv's gradients in test_rules_special."""
    from tvm import te
    from tvm_lowering.ops.random import _bits_te
    from tvm_lowering.pipeline import resolve_target
    from tvm_lowering.schedules import Injective

    seed = te.placeholder((), dtype="int64", name="seed")
    bits = _bits_te(seed, (64, 128))
    half = te.compute((1, 64, 128), lambda a, i, j: (bits[i, j] & 1).astype("float32") * 0.5, name="half")
    sch = Injective().apply(te.create_prim_func([seed, half]), resolve_target("CPU").tvm, False)
    assert sch is not None
    assert sch.get_sblock("random_bits") is not None  # raises if it was inlined away


def test_transposing_copies_are_tiled():
    """A copy whose read runs contiguously along another loop than the write's (attention's head
    transposes, behind reshapes that inlining turns into div/mod chains) is cut into square
    tiles, vectorized along the write; a plain elementwise kernel keeps its one vector loop.
    Transposes through reshapes, of odd sizes too, still compute what CPU PyTorch does."""
    from tvm import te, tirx
    from tvm_lowering.pipeline import resolve_target
    from tvm_lowering.schedules import Injective

    target = resolve_target("CPU").tvm
    x = te.placeholder((3, 128, 8, 256), name="x")
    heads = te.compute((128, 32, 64), lambda t, h, d: x[1, t, h // 4, (h % 4) * 64 + d], name="heads")
    keys = te.compute((32, 64, 128), lambda h, d, t: heads[t, h, d] * 0.125, name="keys")
    sch = Injective().apply(te.create_prim_func([x, keys]), target, False)
    loops = [sch.get(loop) for loop in sch.get_loops(sch.get_sblock("keys"))]
    assert [int(loop.extent) for loop in loops[-2:]] == [16, 16]
    assert loops[-1].kind == tirx.ForKind.VECTORIZED and loops[0].kind == tirx.ForKind.PARALLEL
    plain = te.compute((128, 32, 64), lambda t, h, d: heads[t, h, d] + 1.0, name="plain")
    sch = Injective().apply(te.create_prim_func([x, plain]), target, False)
    assert [int(sch.get(loop).extent) for loop in sch.get_loops(sch.get_sblock("plain"))][-1] == 16
    check(lambda a, b: (a.view(48, 4, 32).transpose(0, 2) * 0.5, b.t() + 1),
          rnd(8, 3, 256), rnd(60, 90), ops=["transpose.int", "t.default"])


def test_contraction_schedule_tiles_products_and_leaves_the_rest():
    """Matmul and convolutions (sums of products) get register tiles: a vectorized output axis,
    unrolled rows, a local accumulator, tiles in parallel, and the epilogue (here relu) applied
    on write-back. A sum of one operand, or of a square, is not theirs."""
    from tvm import te, topi
    from tvm_lowering.pipeline import resolve_target
    from tvm_lowering.schedules import Contraction

    target = resolve_target("CPU").tvm
    a, b = te.placeholder((64, 48), name="a"), te.placeholder((48, 32), name="b")
    k = te.reduce_axis((0, 48))
    mm = te.compute((64, 32), lambda i, j: te.sum(a[i, k] * b[k, j], axis=k), name="mm")
    relu = te.compute(mm.shape, lambda i, j: te.max(mm[i, j], 0.0), name="relu")
    sch = Contraction().apply(te.create_prim_func([a, b, relu]), target, False)
    assert sch is not None
    text = sch.mod["main"].script()
    for piece in ("T.vectorized(16)", "T.unroll(8)", 'scope="local"', "T.parallel(16)", "T.max(mm_local"):
        assert piece in text, piece
    x, w = te.placeholder((2, 4, 9, 9), name="x"), te.placeholder((6, 4, 3, 3), name="w")
    conv = topi.nn.conv2d_nchw(x, w, stride=2, padding=1, dilation=1)
    assert Contraction().apply(te.create_prim_func([x, w, conv]), target, False) is not None
    total = te.compute((64,), lambda i: te.sum(a[i, k], axis=k), name="total")
    square = te.compute((64,), lambda i: te.sum(a[i, k] * a[i, k] + 1.0, axis=k), name="square")
    for func in (te.create_prim_func([a, total]), te.create_prim_func([a, square])):
        assert Contraction().apply(func, target, False) is None


@pytest.mark.parametrize("m,k,n", [(7, 13, 11), (37, 5, 53), (1, 400, 120), (64, 3, 32)])
def test_contraction_schedule_matches_cpu_on_odd_shapes(m, k, n):
    """Tiles cut each axis by a divisor of its length (no remainder loops): prime lengths,
    a prime output row longer than a vector (53: no vector), one row."""
    check(lambda x, y, z, bias: (torch.mm(x, y), torch.addmm(bias, x, y).relu(), torch.bmm(z, z.transpose(1, 2))),
          rnd(m, k), rnd(k, n), rnd(3, m, k), rnd(n), ops=["mm.default", "bmm.default"])
    # an epilogue that reads the bias-added product twice: not a chain to write back through
    check(lambda x, y, bias: (lambda h: torch.exp(h * 0.1) + torch.tanh(h))(torch.addmm(bias, x, y)),
          rnd(m, k), rnd(k, n), rnd(n), ops=["addmm.default"])
    x, w = rnd(2, 4, 11, 13), rnd(6, 2, 3, 5)
    check(lambda x, w: F.conv2d(x, w, stride=(2, 1), padding=(1, 2), dilation=(1, 2), groups=2), x, w,
          ops=["convolution.default"])


def test_contraction_over_one_element_keeps_its_epilogue_outside():
    """A matmul whose reduction has extent 1 normalizes to a block of spatial iterators only,
    but with a T.init(): it is a reduction, not an elementwise block to inline an epilogue into
    (rsqrt inlined into it gave zeros: Adafactor's row x column factored second moment)."""
    from tvm import te
    from tvm_lowering.pipeline import resolve_target
    from tvm_lowering.schedules import Injective

    a, b = te.placeholder((4, 1), name="a"), te.placeholder((1, 8), name="b")
    k = te.reduce_axis((0, 1))
    mm = te.compute((4, 8), lambda i, j: te.sum(a[i, k] * b[k, j], axis=k), name="mm")
    rsqrt = te.compute(mm.shape, lambda i, j: 1.0 / te.sqrt(mm[i, j]), name="rsqrt")
    assert Injective().apply(te.create_prim_func([a, b, rsqrt]), resolve_target("CPU").tvm, False) is None
    r, c = torch.rand(4, 1) + 0.5, torch.rand(1, 8) + 0.5
    check(lambda r, c: ((r @ c).rsqrt(), (r @ c).sqrt(), (r @ c).reciprocal(), (r @ c * 2 - 1).relu(),
                        torch.bmm(r[None], c[None]).rsqrt()), r, c, ops=["mm.default", "rsqrt.default"])


def test_large_bfloat16_fills_and_expands_compile():
    """TVM's bfloat16 legalization failed on a vectorized store of a broadcast value (a zero fill,
    an expand of one element), so these kernels, above the size the schedules parallelize, ran on
    CPU PyTorch: a bfloat16 block keeps its innermost loop serial."""
    grad = rnd(8, 64, 32).bfloat16()
    ids = torch.randint(0, 100, (8, 64))
    check(lambda g, i: torch.ops.aten.embedding_dense_backward(g, i, 100, -1, False), grad, ids,
          ops=["embedding_dense_backward.default"], rtol=2 ** -7, atol=1e-2)
    check(lambda x: x.sum().expand(64, 128).contiguous(), rnd(64, 128).bfloat16(), rtol=2 ** -7, atol=0.5)
