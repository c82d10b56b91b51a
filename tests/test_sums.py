"""join_sums: a gradient's sum of small products over an RNN's steps becomes one product."""
import numpy as np
import tvm
from tvm import relax

from tvm_lowering import build, resolve_target
from tvm_lowering.sums import join_sums

STEPS, BATCH, GATES, HIDDEN = 6, 3, 20, 5


def _rnn_like_grads():
    """What relax Gradient emits for a weight and a bias used once per step: chains of adds of
    matmul(permute_dims(dg_t), h_t) and of collapse_sum_to(dg_t), plus sums the pass must leave
    as they are (a partial sum read elsewhere, products of a large K, a term read twice)."""
    bb = relax.BlockBuilder()
    dgs = [relax.Var(f"dg{t}", relax.TensorType((BATCH, GATES), "float32")) for t in range(STEPS)]
    hs = [relax.Var(f"h{t}", relax.TensorType((BATCH, HIDDEN), "float32")) for t in range(STEPS)]
    big = [relax.Var(f"big{t}", relax.TensorType((HIDDEN, HIDDEN), "float32")) for t in range(2)]
    with bb.function("main", [*dgs, *hs, *big]):
        with bb.dataflow():
            dw = db = None
            for dg, h in zip(dgs, hs):
                term = bb.emit(relax.op.matmul(relax.op.permute_dims(dg), h))
                dw = term if dw is None else bb.emit(relax.op.add(dw, term))
                bias = bb.emit(relax.op.collapse_sum_to(dg, relax.ShapeExpr([GATES])))
                db = bias if db is None else bb.emit(relax.op.add(db, bias))
            # a partial sum that is an output too
            part = bb.emit(relax.op.matmul(relax.op.permute_dims(dgs[0]), hs[0]))
            part = bb.emit(relax.op.add(part, bb.emit(relax.op.matmul(relax.op.permute_dims(dgs[1]), hs[1]))))
            whole = bb.emit(relax.op.add(part, bb.emit(relax.op.matmul(relax.op.permute_dims(dgs[2]), hs[2]))))
            # products whose operands are as large as their result: left alone
            square = bb.emit(relax.op.add(bb.emit(relax.op.matmul(big[0], big[1])), bb.emit(relax.op.matmul(big[1], big[0]))))
            # a term read twice stays; the other two still join
            shared = bb.emit(relax.op.matmul(relax.op.permute_dims(dgs[3]), hs[3]))
            mixed = bb.emit(relax.op.add(shared, bb.emit(relax.op.matmul(relax.op.permute_dims(dgs[4]), hs[4]))))
            mixed = bb.emit(relax.op.add(mixed, bb.emit(relax.op.matmul(relax.op.permute_dims(dgs[5]), hs[5]))))
            mixed = bb.emit(relax.op.add(mixed, shared))
            out = bb.emit_output(relax.Tuple([dw, db, part, whole, square, mixed]))
        bb.emit_func_output(out)
    return bb.get()


def _expected(dgs, hs, big):
    dw = sum(dg.T @ h for dg, h in zip(dgs, hs))
    db = sum(dg.sum(0) for dg in dgs)
    part = dgs[0].T @ hs[0] + dgs[1].T @ hs[1]
    shared = dgs[3].T @ hs[3]
    mixed = shared + dgs[4].T @ hs[4] + dgs[5].T @ hs[5] + shared
    return [dw, db, part, part + dgs[2].T @ hs[2], big[0] @ big[1] + big[1] @ big[0], mixed]


def _calls(mod, op):
    return mod.script().count(f"R.{op}(")


def test_sums_of_small_products_and_bias_sums_join_into_one_each():
    mod = _rnn_like_grads()
    joined = tvm.transform.Sequential([join_sums, relax.transform.DeadCodeElimination()])(mod)
    # dw: 1; part, read elsewhere, a sum of its own: 1; whole: part + its own product: 1; square: 2;
    # mixed: shared + one joined product of the other two
    assert _calls(mod, "matmul") == STEPS + 3 + 2 + 3 and _calls(joined, "matmul") == 1 + 1 + 1 + 2 + 2
    assert _calls(joined, "collapse_sum_to") == 1
    rng = np.random.default_rng(0)
    dgs = [rng.standard_normal((BATCH, GATES)).astype("float32") for _ in range(STEPS)]
    hs = [rng.standard_normal((BATCH, HIDDEN)).astype("float32") for _ in range(STEPS)]
    big = [rng.standard_normal((HIDDEN, HIDDEN)).astype("float32") for _ in range(2)]
    vm = relax.VirtualMachine(build(joined, resolve_target("CPU")), tvm.cpu())
    got = vm["main"](*[tvm.runtime.tensor(a) for a in dgs + hs + big])
    for g, w in zip(got, _expected(dgs, hs, big)):
        np.testing.assert_allclose(g.numpy(), w, rtol=1e-5, atol=1e-5)


def _sliced_grads():
    """What relax Gradient emits for tensors read in slices: sums of zero pads. `steps`: unit
    slices of a (STEPS, BATCH, GATES) tensor, each a reshape of a (BATCH, GATES) gradient
    (an RNN's input projection); `gates`: four column blocks of a (BATCH, GATES) tensor, one
    left out (zeros there); `overlap`: two pads whose slices overlap, left as they are."""
    bb = relax.BlockBuilder()
    gs = [relax.Var(f"g{t}", relax.TensorType((BATCH, GATES), "float32")) for t in range(STEPS)]
    quarter = GATES // 4
    qs = [relax.Var(f"q{k}", relax.TensorType((BATCH, quarter), "float32")) for k in range(3)]
    with bb.function("main", [*gs, *qs]):
        with bb.dataflow():
            steps = None
            for t, g in enumerate(gs):
                unit = bb.emit(relax.op.reshape(g, (1, BATCH, GATES)))
                term = bb.emit(relax.op.nn.pad(unit, [t, STEPS - 1 - t, 0, 0, 0, 0]))
                steps = term if steps is None else bb.emit(relax.op.add(steps, term))
            gates = None
            for k, q in zip((0, 1, 3), qs):  # the third block has no gradient
                term = bb.emit(relax.op.nn.pad(q, [0, 0, k * quarter, GATES - (k + 1) * quarter]))
                gates = term if gates is None else bb.emit(relax.op.add(gates, term))
            a = bb.emit(relax.op.nn.pad(qs[0], [0, 0, 0, GATES - quarter]))
            b = bb.emit(relax.op.nn.pad(qs[1], [0, 0, 1, GATES - quarter - 1]))  # overlaps a
            overlap = bb.emit(relax.op.add(a, b))
            out = bb.emit_output(relax.Tuple([steps, gates, overlap]))
        bb.emit_func_output(out)
    return bb.get()


def test_sums_of_disjoint_zero_pads_become_a_stack_and_a_concatenation():
    mod = _sliced_grads()
    joined = tvm.transform.Sequential([join_sums, relax.transform.DeadCodeElimination()])(mod)
    assert _calls(mod, "nn.pad") == STEPS + 3 + 2 and _calls(joined, "nn.pad") == 2  # the overlapping pair
    assert _calls(joined, "stack") == 1 and _calls(joined, "concat") == 1
    rng = np.random.default_rng(0)
    gs = [rng.standard_normal((BATCH, GATES)).astype("float32") for _ in range(STEPS)]
    qs = [rng.standard_normal((BATCH, GATES // 4)).astype("float32") for _ in range(3)]
    zeros = np.zeros_like(qs[0])
    shifted = np.zeros((BATCH, GATES), "float32")
    shifted[:, 1:1 + GATES // 4] = qs[1]
    shifted[:, :GATES // 4] += qs[0]
    want = [np.stack(gs), np.concatenate([qs[0], qs[1], zeros, qs[2]], axis=1), shifted]
    vm = relax.VirtualMachine(build(joined, resolve_target("CPU")), tvm.cpu())
    got = vm["main"](*[tvm.runtime.tensor(a) for a in gs + qs])
    for g, w in zip(got, want):
        np.testing.assert_array_equal(g.numpy(), w)
