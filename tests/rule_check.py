"""`check`: ops on lazy tensors against the same ops on CPU, for the lowering-rule tests
(tests/test_rules_*.py, one per family of tvm_lowering/ops).

Every check also asserts the op was lowered (counter `ratex::<op>`) and did not
fall back to CPU (no counter `aten::<op>`).
"""
import warnings

import torch

import ratex  # noqa: F401  (registers the lazy device)
from ratex.lazy_tensor_core.debug import metrics


def _lazy(x):
    return x.to("lazy") if isinstance(x, torch.Tensor) else x


def _cpu(x):
    if isinstance(x, (list, tuple)):
        return type(x)(_cpu(y) for y in x)
    return x.cpu() if isinstance(x, torch.Tensor) else x


def check(fn, *args, ops=(), rtol=1e-4, atol=1e-5, expected_warning=None):
    """Run fn(*args) on lazy copies and on CPU; compare; assert each op in `ops` was lowered.

    `expected_warning`: a message regex PyTorch itself warns with for these inputs (allowed).
    """
    expected = fn(*args)
    metrics.reset()
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # a rule failing while lowering warns: make it fail the test
        if expected_warning:
            warnings.filterwarnings("ignore", message=expected_warning)
        got = _cpu(fn(*[_lazy(a) for a in args]))
    torch.testing.assert_close(got, expected, rtol=rtol, atol=atol, equal_nan=True)
    eager = [n for n in metrics.counter_names() if n.startswith("aten::")]
    assert not eager, f"ran eagerly: {eager}"
    for name in ops:
        assert metrics.counter_value(f"aten::{name}") is None, f"{name} ran eagerly"
        if _decomposes(name):  # CompositeImplicit: the lazy device sees its parts, not the op
            continue
        assert (metrics.counter_value(f"ratex::{name}") or 0) > 0, f"{name} was not traced"
    return got


def _decomposes(name):
    base, _, overload = name.partition(".")
    qualified = f"aten::{base}" if overload in ("", "default") else f"aten::{base}.{overload}"
    return torch._C._dispatch_has_kernel_for_dispatch_key(qualified, "CompositeImplicitAutograd")


def in_backward(fn, x):
    """fn(g) run inside autograd's backward, g = ones like `x`: there creation ops (zeros_like,
    new_full, ...) are traced as graph nodes; outside it they are device data at once."""
    out = []

    class Probe(torch.autograd.Function):
        @staticmethod
        def forward(ctx, t):
            return t.clone()

        @staticmethod
        def backward(ctx, g):
            out.append(fn(g))
            return g

    Probe.apply(x.detach().clone().requires_grad_()).sum().backward()
    return out[0]


def rnd(*shape, dtype=torch.float32):
    return torch.randn(*shape, dtype=dtype)


def train_side_by_side(lazy, ref, make_opt, batches, loss_fn, dev, on_step=None):
    """Step `lazy` (on device `dev`) and `ref` (on CPU) through `batches`, each with an optimizer
    `make_opt(params)`, one mark_step a step; return [(lazy loss, CPU loss)] step by step.

    `loss_fn(model, *batch)` computes a step's loss, the batch's tensors on the model's device;
    `on_step()`, if given, runs after each step."""
    import ratex.lazy_tensor_core.core.lazy_model as lm

    opts = [make_opt(m.parameters()) for m in (lazy, ref)]
    history = []
    for batch in batches:
        losses = []
        for model, opt, device in zip((lazy, ref), opts, (dev, "cpu")):
            opt.zero_grad()
            loss = loss_fn(model, *[t.to(device) for t in batch])
            loss.backward()
            opt.step()
            lm.mark_step()
            losses.append(loss.item())
        history.append(tuple(losses))
        if on_step is not None:
            on_step()
    return history
