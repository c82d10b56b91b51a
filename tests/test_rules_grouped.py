"""Rules of tvm_lowering/ops/grouped.py against CPU PyTorch: aten::_grouped_mm in its four layouts
and its gradients on the lazy device, its shape checks, and transformers' grouped-matmul ops
under torch.compile (what transformers' mixture-of-experts layers call there)."""
import pytest
import torch

import ratex.lazy_tensor_core.core.lazy_model as lm
from ratex.lazy_tensor_core.debug import metrics
from rule_check import check, rnd

pytestmark = pytest.mark.usefixtures("seeded")

# Cumulative ends of 3 groups over 10 positions: group 1 is empty, positions 7..9 in none.
OFFS = torch.tensor([3, 3, 7], dtype=torch.int32)
# ... and ends that cover every position (a MoE layer's: every row goes to some expert)
OFFS_ALL = torch.tensor([4, 4, 10], dtype=torch.int32)


def _eager_fallbacks():
    return [n for n in metrics.counter_names() if n.startswith("aten::")]


def test_grouped_mm_layouts_forward():
    """2D x 3D (rows by group), 3D x 2D (columns by group), 2D x 2D (contraction steps by group:
    out[e] = a[:, steps of e] @ b[steps of e]) and 3D x 3D (batched), in one program. Positions past
    the last end are zero where PyTorch leaves them unspecified, so the ends cover every position
    except in 2D x 2D, where positions past the end only do not count."""
    def fn(a, b, a3, b2, am, bm, a33, b33, offs, offs_all, offs_cols):
        return (torch._grouped_mm(a, b, offs=offs_all), torch._grouped_mm(a3, b2, offs=offs_cols),
                torch._grouped_mm(am, bm, offs=offs), torch._grouped_mm(a33, b33))

    # (PyTorch's CPU kernel wants strides of 16 bytes: 4 float32 columns)
    check(fn, rnd(10, 8), rnd(3, 8, 4), rnd(3, 4, 8), rnd(8, 12), rnd(10, 8).t(), rnd(10, 4), rnd(3, 5, 8),
          rnd(3, 8, 4), OFFS, OFFS_ALL, torch.tensor([4, 4, 12], dtype=torch.int32), ops=["_grouped_mm.default"])


def test_grouped_mm_rows_past_the_last_end_are_zero(dev):
    a, b = rnd(10, 8), rnd(3, 8, 4)
    got = torch._grouped_mm(a.to(dev), b.to(dev), offs=OFFS.to(dev)).cpu()
    torch.testing.assert_close(got[:7], torch._grouped_mm(a, b, offs=OFFS)[:7], rtol=1e-4, atol=1e-5)
    assert torch.equal(got[7:], torch.zeros(3, 4))
    assert _eager_fallbacks() == []


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_grouped_mm_gradients(dev, dtype):
    """Autograd's backward of the 2D x 3D layout is _grouped_mm again: 2D x 3D for the input's
    gradient, 2D x 2D for the weights' (an empty group's is zero). Half precision accumulates
    in float32 and rounds once, as PyTorch's CPU kernel."""
    a, w, g = rnd(10, 8, dtype=dtype), rnd(3, 8, 8, dtype=dtype), rnd(10, 8, dtype=dtype)

    def grads(a, w, g, offs):
        a, w = a.detach().requires_grad_(), w.detach().requires_grad_()
        out = torch._grouped_mm(a, w.transpose(-2, -1), offs=offs)  # transformers' transposed experts
        out.backward(g)
        return out, a.grad, w.grad

    want = grads(a, w, g, OFFS_ALL)
    metrics.reset()
    got = [t.cpu() for t in grads(a.to(dev), w.to(dev), g.to(dev), OFFS_ALL.to(dev))]
    lm.mark_step()
    tol = dict(rtol=1e-4, atol=1e-5) if dtype == torch.float32 else dict(rtol=1.6e-2, atol=1e-2)
    torch.testing.assert_close(got, list(want), **tol)
    assert torch.equal(got[2][1], torch.zeros(8, 8, dtype=dtype))
    assert metrics.counter_value("ratex::_grouped_mm.default") == 3 and _eager_fallbacks() == []


@pytest.mark.parametrize("call,match", [
    (lambda a, b, o: torch._grouped_mm(a, b.double(), offs=o), "one float dtype, got torch.float32 and torch.float64"),
    (lambda a, b, o: torch._grouped_mm(a, b, offs=o.long()), "offs must be a 1D int32 tensor, got a 1D torch.int64"),
    (lambda a, b, o: torch._grouped_mm(a, b, offs=o, bias=b[:, 0]), "a bias is not supported"),
    (lambda a, b, o: torch._grouped_mm(a[:, :6], b, offs=o), r"contraction dims of mat_a \(10, 6\) and mat_b"),
    (lambda a, b, o: torch._grouped_mm(a, b), "offs is needed for 2D x 3D"),
    (lambda a, b, o: torch._grouped_mm(a[0], b, offs=o), "must be 2D or 3D, got 1D and 3D"),
    (lambda a, b, o: torch._grouped_mm(a, b[:2], offs=o), "offs has 3 groups and the 3D operand 2 matrices"),
], ids=["dtypes", "offs_dtype", "bias", "contraction", "no_offs", "dims", "groups"])
def test_grouped_mm_bad_input_fails_at_the_call(dev, call, match):
    """Shape inference raises at the call that made the mistake, naming the values (float32 passes:
    PyTorch's meta function would want bfloat16, its CPU kernel takes float32)."""
    a, b, offs = rnd(10, 8).to(dev), rnd(3, 8, 4).to(dev), OFFS.to(dev)
    with pytest.raises(RuntimeError, match=match):
        call(a, b, offs)
    assert _eager_fallbacks() == []


def test_transformers_grouped_mm_ops_compile_without_fallbacks():
    """transformers' grouped_mm_fallback and its backward op (what its MoE layers call under
    torch.compile for float32), int32 and int64 ends: lowered, nothing run eagerly."""
    pytest.importorskip("transformers.integrations.moe")
    import torch._dynamo

    def step(x, w, g, offs):
        out = torch.ops.transformers.grouped_mm_fallback(x, w, offs)
        out.backward(g)
        return out

    def run(fn, offs):
        x, w = X.clone().requires_grad_(), W.clone().requires_grad_()
        return [fn(x, w, G, offs).detach(), x.grad, w.grad]

    X, W, G = rnd(10, 8), rnd(3, 8, 4), rnd(10, 4)
    torch._dynamo.reset()
    metrics.reset()
    compiled = torch.compile(step, backend="ratex")
    for offs in (OFFS, OFFS.long()):
        torch.testing.assert_close(run(compiled, offs), run(step, offs), rtol=1e-4, atol=1e-5)
    assert metrics.counter_value("UncachedCompile") and _eager_fallbacks() == []
    torch._dynamo.reset()
