"""torch.optim optimizers on the lazy device match CPU, with one compile for every step (SGD with
momentum: one for the first, one for the rest)."""
import copy

import pytest
import torch
import torch.nn.functional as F

import ratex.debug
import ratex.lazy_tensor_core.core.lazy_model as lm
from ratex.lazy_tensor_core.debug import metrics
from rule_check import train_side_by_side

OPTIMIZERS = {
    "sgd-nesterov-wd": lambda p: torch.optim.SGD(p, lr=0.1, momentum=0.9, nesterov=True, weight_decay=1e-4),
    "adam": lambda p: torch.optim.Adam(p, lr=1e-2),
    "adamw": lambda p: torch.optim.AdamW(p, lr=1e-2),
    "adadelta": lambda p: torch.optim.Adadelta(p, lr=1.0),
    "rmsprop": lambda p: torch.optim.RMSprop(p, lr=1e-2),
    "adagrad": lambda p: torch.optim.Adagrad(p, lr=1e-2),
}


@pytest.mark.parametrize("name", OPTIMIZERS)
def test_optimizer_matches_cpu(dev, name):
    torch.manual_seed(0)
    ref = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 4))
    model = copy.deepcopy(ref).to(dev)
    opt, ref_opt = OPTIMIZERS[name](model.parameters()), OPTIMIZERS[name](ref.parameters())
    g = torch.Generator().manual_seed(1)
    compiles = []
    for _ in range(5):
        x, y = torch.randn(5, 8, generator=g), torch.randint(0, 4, (5,), generator=g)
        opt.zero_grad()
        loss = F.cross_entropy(model(x.to(dev)), y.to(dev))
        loss.backward()
        opt.step()
        lm.mark_step()
        ref_opt.zero_grad()
        ref_loss = F.cross_entropy(ref(x), y)
        ref_loss.backward()
        ref_opt.step()
        torch.testing.assert_close(loss.item(), ref_loss.item(), rtol=1e-4, atol=1e-5)
        compiles.append(metrics.counter_value("UncachedCompile"))
    for p, q in zip(model.parameters(), ref.parameters()):
        torch.testing.assert_close(p.cpu(), q, rtol=1e-4, atol=1e-5)
    assert len(set(compiles[1:])) == 1, f"recompiled after the first step: {compiles}"
    if name != "sgd-nesterov-wd":  # SGD's first step makes its momentum with clone(grad), later ones don't
        # state that starts as zeros_like / full_like is data, an input of every step's program
        assert compiles[0] == compiles[-1], f"the first step compiled a program of its own: {compiles}"
    assert not [c for c in metrics.counter_names() if c.startswith("aten::")]


# Each runs on three lists (a, b, c) of tensors of different shapes; in-place ones return None.
FOREACH_CALLS = {
    "add_ list alpha": lambda a, b, c: torch._foreach_add_(a, b, alpha=-0.3),
    "sub_ scalar": lambda a, b, c: torch._foreach_sub_(a, 0.25),
    "mul_ scalarlist": lambda a, b, c: torch._foreach_mul_(a, [0.5, 2.0, -1.5]),
    "div_ list": lambda a, b, c: torch._foreach_div_(a, c),
    "addcmul_ scalar": lambda a, b, c: torch._foreach_addcmul_(a, b, c, value=0.1),
    "addcdiv_ scalarlist": lambda a, b, c: torch._foreach_addcdiv_(a, b, c, [0.1, 0.2, 0.3]),
    "lerp_ scalar": lambda a, b, c: torch._foreach_lerp_(a, b, 0.3),
    "lerp_ list": lambda a, b, c: torch._foreach_lerp_(a, b, c),
    "sqrt": lambda a, b, c: torch._foreach_sqrt(c),
    "neg_ then add": lambda a, b, c: (torch._foreach_neg_(a), torch._foreach_add(a, b))[1],
    "reciprocal_ zero_": lambda a, b, c: (torch._foreach_reciprocal_(c), torch._foreach_zero_(b)),
    "maximum (generic path)": lambda a, b, c: torch._foreach_maximum(a, b),
}


@pytest.mark.parametrize("name", FOREACH_CALLS)
def test_foreach_ops_match_cpu(dev, name):
    """Foreach ops on lazy lists equal CPU PyTorch's, results and in-place targets, all recorded."""
    g = torch.Generator().manual_seed(2)
    shapes = [(3, 4), (5,), (2, 2, 3)]
    cpu = [[torch.randn(s, generator=g) for s in shapes] for _ in range(2)]
    cpu.append([torch.rand(s, generator=g) + 0.5 for s in shapes])  # positive: sqrt, division
    lazy = [[t.to(dev) for t in ts] for ts in cpu]
    metrics.reset()
    got, want = FOREACH_CALLS[name](*lazy), FOREACH_CALLS[name](*cpu)
    lm.mark_step()
    torch.testing.assert_close(got, want, check_device=False)
    for lazy_list, cpu_list in zip(lazy, cpu):
        torch.testing.assert_close([t.cpu() for t in lazy_list], cpu_list)
    assert not [c for c in metrics.counter_names() if c.startswith("aten::")]


def test_inplace_alpha_is_one_node_with_the_lr_an_input(dev):
    """p.add_(buf, alpha=-lr) and p.sub_(buf, alpha=lr) each record one addcmul node whose alpha
    is an input: they match CPU, and a new learning rate runs the same program."""
    g = torch.Generator().manual_seed(3)
    p, buf = torch.randn(4, 5, generator=g), torch.randn(4, 5, generator=g)
    lazy_p, lazy_buf = p.to(dev), buf.to(dev)
    lm.mark_step()
    for step, lr in enumerate((0.1, 0.037)):
        metrics.reset()
        for t, b in ((lazy_p, lazy_buf), (p, buf)):
            t.add_(b, alpha=-lr)
            t.sub_(b, alpha=3 * lr)
        lm.mark_step()
        torch.testing.assert_close(lazy_p.cpu(), p)
        assert metrics.counter_value("ratex::addcmul.default") == 2
        assert not metrics.counter_value("ratex::mul.Tensor")
        assert bool(metrics.counter_value("UncachedCompile")) == (step == 0), "a new lr recompiled"


INPLACE_CASES = {  # name: (target maker, op); each runs on lazy and CPU copies of the same data
    "mul_ float": (lambda x, y: x, lambda t, o: t.mul_(0.9)),
    "mul_ zero keeps nan and inf": (lambda x, y: x.masked_fill(x > 1, float("inf")).masked_fill(x < -1, float("nan")),
                                    lambda t, o: t.mul_(0.0)),
    "mul_ one": (lambda x, y: x, lambda t, o: t.mul_(1.0)),
    "mul_ int": (lambda x, y: x, lambda t, o: t.mul_(3)),
    "add_ tensor": (lambda x, y: x, lambda t, o: t.add_(o)),
    "add_ int alpha": (lambda x, y: x, lambda t, o: t.add_(o, alpha=2)),
    "add_ float alpha": (lambda x, y: x, lambda t, o: t.add_(o, alpha=-0.3)),
    "add_ float": (lambda x, y: x, lambda t, o: t.add_(0.25)),
    "sub_ float alpha": (lambda x, y: x, lambda t, o: t.sub_(o, alpha=0.7)),
    "sub_ float": (lambda x, y: x, lambda t, o: t.sub_(1.5)),
    "div_ tensor": (lambda x, y: x, lambda t, o: t.div_(o.abs() + 1)),
    "div_ float": (lambda x, y: x, lambda t, o: t.div_(3.5)),
    "add_ broadcast row": (lambda x, y: x, lambda t, o: t.add_(o[0], alpha=0.5)),
    "add_ double other": (lambda x, y: x, lambda t, o: t.add_(o.double(), alpha=0.5)),
    "mul_ into a row view": (lambda x, y: x, lambda t, o: t[1].mul_(2.5)),
    "add_ into a transposed view": (lambda x, y: x, lambda t, o: t.t().add_(o.t(), alpha=-0.1)),
    "mul_ double": (lambda x, y: x.double(), lambda t, o: t.mul_(0.3)),
    "add_ int target": (lambda x, y: (x * 10).long(), lambda t, o: t.add_((o * 10).long(), alpha=3)),
    # Muon: a bfloat16 update, transposed back, added to a float32 parameter with alpha = -lr
    "add_ transposed bfloat16 other": (lambda x, y: x, lambda t, o: t.add_(o.t().contiguous().t().bfloat16(), alpha=-0.3)),
}


@pytest.mark.parametrize("name", INPLACE_CASES)
def test_inplace_arith_matches_cpu(dev, name):
    """The in-place arithmetic an optimizer does, on ratex's written-out path for same-meta float
    operands and on every case that path leaves to the general one, writes what CPU writes."""
    make, op = INPLACE_CASES[name]
    g = torch.Generator().manual_seed(5)
    x, y = make(torch.randn(3, 4, generator=g), None), torch.randn(3, 4, generator=g)
    lazy_x, lazy_y = x.to(dev), y.to(dev)
    with torch.no_grad():
        op(x, y)
        op(lazy_x, lazy_y)
    lm.mark_step()
    torch.testing.assert_close(lazy_x.cpu(), x, equal_nan=True)


LERP_CALLS = {  # each on (start, end) lists of float32 and float64 tensors; in-place ones return None
    "lerp": lambda a, b, w: [x.lerp(y, w) for x, y in zip(a, b)],
    "lerp_": lambda a, b, w: [x.lerp_(y, w) for x, y in zip(a, b)] and None,
    "_foreach_lerp_ scalar": lambda a, b, w: torch._foreach_lerp_(a, b, w),
    "_foreach_lerp_ scalarlist": lambda a, b, w: torch._foreach_lerp_(a, b, [w, w / 2]),
}


@pytest.mark.parametrize("weight", [0.1, 0.5, 0.95, -0.7, 1.0])
@pytest.mark.parametrize("name", LERP_CALLS)
def test_lerp_with_a_number_matches_cpu_to_the_bit(dev, name, weight):
    """torch's lerp takes start + w * (end - start) for |w| < 0.5 and end - (end - start) * (1 - w)
    otherwise, 1 - w in the tensor's precision (Muon's nesterov update is grad.lerp(buf, 0.95)):
    the lazy device computes the same formula, to the bit."""
    g = torch.Generator().manual_seed(4)
    cpu = [[torch.randn(67, 33, generator=g, dtype=dt) for dt in (torch.float32, torch.float64)] for _ in range(2)]
    lazy = [[t.to(dev) for t in ts] for ts in cpu]
    got, want = LERP_CALLS[name](*lazy, weight), LERP_CALLS[name](*cpu, weight)
    lm.mark_step()
    for g_, w_ in zip(got or lazy[0], want or cpu[0]):
        assert torch.equal(g_.cpu(), w_), (g_.cpu() - w_).abs().max()


def test_inplace_arith_errors_match_cpu(dev):
    """In-place ops PyTorch refuses are refused alike: a float result into an int tensor, a write
    into an expanded tensor; the target keeps its value."""
    x = torch.arange(6).view(2, 3)
    lazy_x = x.to(dev)
    with pytest.raises(RuntimeError, match="can't be cast"):
        lazy_x.mul_(0.5)
    e = torch.randn(1, 3).to(dev).expand(2, 3)
    with pytest.raises(RuntimeError, match="single memory location"):
        e.mul_(0.5)
    torch.testing.assert_close(lazy_x.cpu(), x)


@pytest.mark.parametrize("foreach", [False, True])
def test_adafactor_matches_cpu(dev, foreach):
    """Adafactor's factored second moment is an outer product of a column by a row (a matmul with
    a reduction of extent 1) under an rsqrt; the rsqrt inlined into the product's kernel gives
    zeros, and the loss grows to 4e20 in three steps."""
    torch.manual_seed(0)
    ref = torch.nn.Linear(8, 4)
    model = copy.deepcopy(ref).to(dev)
    g = torch.Generator().manual_seed(1)
    batches = [(torch.randn(5, 8, generator=g),) for _ in range(3)]
    history = train_side_by_side(model, ref, lambda p: torch.optim.Adafactor(p, foreach=foreach), batches,
                                 lambda m, x: m(x).pow(2).mean(), dev)
    for losses in history:
        torch.testing.assert_close(*losses, rtol=1e-4, atol=1e-5)
    for p, q in zip(model.parameters(), ref.parameters()):
        torch.testing.assert_close(p.cpu(), q, rtol=1e-4, atol=1e-5)
    assert not [c for c in metrics.counter_names() if c.startswith("aten::")]


MUON_CONFIGS = {  # OptimInfo's Muon configs, and the two options they leave at their defaults
    "default": {}, "lr": {"lr": 0.01}, "weight_decay": {"weight_decay": 0.2}, "momentum": {"momentum": 0.8},
    "ns_steps": {"ns_steps": 6}, "ns_coefficients": {"ns_coefficients": (3.4, -4.7, 2.0)},
    "no nesterov, adamw lr": {"nesterov": False, "adjust_lr_fn": "match_rms_adamw"},
}


def _muon_matches_cpu(dev, config):
    """Five steps of Muon on nn.Linear(8, 6): its Newton-Schulz iterations run in bfloat16
    (norm, clamp, division, mm and addmm with alpha and beta), its update is a bfloat16 tensor
    added to a float32 parameter with alpha = -lr. Each rounds where PyTorch's CPU kernels round."""
    torch.manual_seed(0)
    ref = torch.nn.Linear(8, 6, bias=False)
    model = copy.deepcopy(ref).to(dev)
    g = torch.Generator().manual_seed(1)
    batches = [(torch.randn(4, 8, generator=g),) for _ in range(5)]

    def same_weights():
        torch.testing.assert_close(model.weight.detach().cpu(), ref.weight.detach(), rtol=1e-6, atol=1e-7)

    train_side_by_side(model, ref, lambda p: torch.optim.Muon(p, **MUON_CONFIGS[config]), batches,
                       lambda m, x: m(x).pow(2).mean(), dev, on_step=same_weights)
    assert not [c for c in metrics.counter_names() if c.startswith("aten::")]


@pytest.mark.cpu_only("rounds where PyTorch's CPU kernels round: on an H100 the bfloat16 products are cuBLAS's, "
                     "and five steps drift up to 1e-3 relative from CPU's")
@pytest.mark.parametrize("config", MUON_CONFIGS)
def test_muon_matches_cpu(dev, config):
    _muon_matches_cpu(dev, config)


@pytest.mark.usefixtures("tvm_kernels")
@pytest.mark.parametrize("config", ["default", "ns_steps"])
def test_muon_matches_cpu_in_tvm_kernels(dev, config):
    """The same with its products as TVM code rather than PyTorch's kernels."""
    _muon_matches_cpu(dev, config)


def _lbfgs_against_cpu(dev, dtype, steps, fresh_batches=False, **kwargs):
    """Train a small MLP with LBFGS(**kwargs) on CPU and on `dev` from the same init and data (one
    batch, or a new one each step); return (CPU losses, lazy losses, the two models' parameters,
    programs compiled per lazy step)."""
    torch.manual_seed(0)
    ref = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Tanh(), torch.nn.Linear(8, 1)).to(dtype)
    model = copy.deepcopy(ref).to(dev)
    x, y = torch.randn(16, 4).to(dtype), torch.randn(16, 1).to(dtype)

    def train(m, to):
        opt = torch.optim.LBFGS(m.parameters(), **kwargs)
        g = torch.Generator().manual_seed(1)
        xs, ys = x.to(to), y.to(to)
        losses, compiles = [], []
        for step in range(steps):
            if fresh_batches:
                xs, ys = (torch.randn(16, n, generator=g).to(dtype).to(to) for n in (4, 1))

            def closure():
                opt.zero_grad()
                loss = F.mse_loss(m(xs), ys)
                loss.backward()
                return loss

            before = metrics.counter_value("UncachedCompile") or 0
            losses.append(opt.step(closure).item())
            if to == dev:
                lm.mark_step()
            compiles.append((metrics.counter_value("UncachedCompile") or 0) - before)
        return losses, compiles

    want, _ = train(ref, "cpu")
    got, compiles = train(model, dev)
    params = [(p.detach().cpu(), q.detach()) for p, q in zip(model.parameters(), ref.parameters())]
    return want, got, params, compiles


def test_lbfgs_matches_cpu_and_its_reads_do_not_grow_the_graph(dev):
    """LBFGS evaluates its closure several times a step and reads values (the loss, alpha=tensor,
    its line-search conditions) between writes of the parameters: each read computes what the
    writes since the last one left pending, so the graph a read compiles does not grow with every
    evaluation, the steps compile the same programs again, and the results match CPU."""
    want, got, params, compiles = _lbfgs_against_cpu(dev, torch.float32, 5, lr=0.5, max_iter=4, history_size=3)
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-6)
    for p, q in params:
        torch.testing.assert_close(p, q, rtol=1e-4, atol=1e-5)
    assert compiles[2:] == [0, 0, 0], compiles  # once the history is full, the same programs again
    assert not [c for c in metrics.counter_names() if c.startswith("aten::")]


def test_lbfgs_strong_wolfe_matches_cpu_and_stops_compiling(dev):
    """LBFGS's strong_wolfe line search compares tensors with values it has just read into
    Python (`f_new > f + c1 * t * gtd`): those are graph inputs, so once its paths have been
    taken a step compiles nothing (a constant of each program, they compiled four programs a
    step for ever). In float64 the lazy device follows CPU to rounding: LBFGS amplifies float32
    rounding, here as on CPU, where float32 and float64 part after a few steps."""
    want, got, params, compiles = _lbfgs_against_cpu(dev, torch.float64, 6, lr=1, max_iter=4, history_size=3,
                                                     line_search_fn="strong_wolfe")
    torch.testing.assert_close(got, want, rtol=1e-10, atol=1e-12)
    for p, q in params:
        torch.testing.assert_close(p, q, rtol=1e-10, atol=1e-12)
    assert compiles[3:] == [0, 0, 0], compiles
    assert not [c for c in metrics.counter_names() if c.startswith("aten::")]


def test_lbfgs_with_a_history_that_grows_compiles_few_small_programs(dev):
    """With its defaults (20 iterations a step, a history of 100 that 5 steps never fill) and a new
    batch each step, LBFGS derives tensors (its flat gradient, the gradient differences and steps
    of its history), reads scalars from them and goes on from them. Each read computes and keeps
    them, so no later read or mark_step computes them again: no program is larger than one
    evaluation of the closure (29 ops), and the same few programs serve every step. Kept only where
    written in place, the history's new entries would be computed again by every read that needs
    them and all at once by mark_step, in programs of hundreds of ops that change every step.
    In float64 the lazy device follows CPU to rounding."""
    before = max((r.number for r in ratex.debug.explain()), default=0)
    want, got, params, compiles = _lbfgs_against_cpu(dev, torch.float64, 5, fresh_batches=True, lr=0.03)
    torch.testing.assert_close(got, want, rtol=1e-9, atol=1e-12)
    for p, q in params:
        torch.testing.assert_close(p, q, rtol=1e-9, atol=1e-12)
    sizes = [r.ops for r in ratex.debug.explain() if r.number > before]
    assert max(sizes) <= 40 and sum(compiles) <= 20, (sizes, compiles)
    assert not [c for c in metrics.counter_names() if c.startswith("aten::")]


def test_reads_between_writes_keep_the_pending_list_to_what_is_pending(dev):
    """Each read drops what it computed from the list of pending storages, so a loop that writes
    and reads (LBFGS reads a scalar a few hundred times a step) scans at each read what is pending,
    not every write since mark_step."""
    from ratex.core import storage

    p = torch.zeros(10).to(dev)
    lm.mark_step()
    for _ in range(50):
        p.add_(1.5)
        p.sum().item()
    assert len(storage._pending) <= 2, len(storage._pending)
    torch.testing.assert_close(p.cpu(), torch.full((10,), 75.0))


def test_a_read_keeps_every_live_tensor_it_computes(dev):
    """A read before mark_step computes the live tensors its value is computed from, written in
    place or not, and keeps them: the next read's graph starts from them."""
    x = torch.randn(6, 4)
    lx = x.to(dev)
    lm.mark_step()
    y = lx.exp() * 2
    assert bool((y.sum() > 0).cpu()) == bool((x.exp() * 2).sum() > 0)
    assert "exp" not in ratex.debug.graph_text([y * 3])
    torch.testing.assert_close((y * 3).cpu(), x.exp() * 6)


# Lists the recorded foreach route takes only in part: each element that doesn't fit (another
# dtype, a broadcast operand, an int tensor, a non-contiguous operand of an out-of-place op)
# takes the per-element route, in list order, and every element still equals CPU's.
def _mixed(g):
    a = [torch.randn(3, 4, generator=g), torch.randn(5, generator=g).double(), torch.randn(2, 3, generator=g),
         (torch.randn(4, generator=g) * 10).long()]
    b = [torch.randn(3, 4, generator=g), torch.randn(5, generator=g).double(), torch.randn(3, generator=g),
         (torch.randn(4, generator=g) * 10).long()]
    return a, b


FOREACH_MIXED = {
    "add_ list alpha": lambda a, b: torch._foreach_add_(a, b, alpha=2),
    "mul list": lambda a, b: torch._foreach_mul(a, b),
    "addcmul_ scalarlist": lambda a, b: torch._foreach_addcmul_(a, b, b, [0.5, 0.25, 2.0, 3]),
    "sub_ scalar": lambda a, b: torch._foreach_sub_(a, 3),
    "add transposed operand": lambda a, b: torch._foreach_add([a[0].t(), a[2]], [b[0].t(), b[2]]),
    "div_ by itself": lambda a, b: torch._foreach_div_(a[:3], a[:3]),
}


@pytest.mark.parametrize("name", FOREACH_MIXED)
def test_foreach_mixed_lists_match_cpu(dev, name):
    """Mixed dtypes, broadcasting, int tensors, strided operands and a target that is its own
    operand, in one list: results, their strides and the targets equal CPU's."""
    cpu = _mixed(torch.Generator().manual_seed(7))
    lazy = [[t.to(dev) for t in ts] for ts in cpu]
    got, want = FOREACH_MIXED[name](*lazy), FOREACH_MIXED[name](*cpu)
    lm.mark_step()
    if want is not None:
        torch.testing.assert_close(got, want, check_device=False)
        assert [t.stride() for t in got] == [t.stride() for t in want]
    for lazy_list, cpu_list in zip(lazy, cpu):
        torch.testing.assert_close([t.cpu() for t in lazy_list], cpu_list)


def test_foreach_inplace_through_views_matches_cpu(dev):
    """Targets that are views of one base (two rows, a column, the transpose of the whole, which
    overlaps both) are written through in list order: a later element reads an earlier write."""
    g = torch.Generator().manual_seed(8)
    base = torch.randn(3, 4, generator=g)
    lazy_base = base.to(dev)
    for b in (base, lazy_base):
        targets = [b[0], b[2], b[:, 1], b.t()]
        others = [torch.ones(4).to(b.device), b[1], b[:, 3], b.t().clone()]
        torch._foreach_add_(targets, others, alpha=0.5)
        torch._foreach_mul_(targets, [2.0, 0.5, -1.0, 0.3])
    lm.mark_step()
    torch.testing.assert_close(lazy_base.cpu(), base)


def test_foreach_inplace_into_expanded_is_refused(dev):
    """PyTorch refuses a foreach write into an expanded tensor; so does ratex, on its per-element route."""
    e = torch.randn(1, 3).to(dev).expand(2, 3)
    with pytest.raises(RuntimeError, match="single memory location"):
        torch._foreach_mul_([e], 0.5)


def test_foreach_list_lengths_are_checked(dev):
    """Lists of different lengths are refused with the lengths named, as PyTorch refuses them."""
    a = [torch.randn(2).to(dev) for _ in range(3)]
    with pytest.raises(RuntimeError, match="3 and 2|3 elements"):
        torch._foreach_add_(a, a[:2])
    with pytest.raises(RuntimeError, match="3 elements|same number of elements"):  # ratex's words or PyTorch's
        torch._foreach_mul_(a, [0.5, 2.0])


def test_foreach_new_scalar_shape_or_dtype_is_never_stale(dev):
    """A recorded foreach update run again with a new lr (a lifted input: same program), an int
    scalar, a new shape and a new dtype gives CPU's values each time."""
    g = torch.Generator().manual_seed(9)
    compiles = []
    for scalar, shape, dtype in ((0.1, (3, 4), torch.float32), (0.37, (3, 4), torch.float32),
                                 (3, (3, 4), torch.float32), (0.37, (2, 5), torch.float32),
                                 (0.37, (3, 4), torch.float64), (0.0, (3, 4), torch.float32)):
        cpu = [torch.randn(shape, generator=g, dtype=dtype) for _ in range(2)]
        cpu[0][0, 0] = float("nan")
        lazy = [t.to(dev) for t in cpu]
        metrics.reset()
        for a, b in (lazy, cpu):
            torch._foreach_addcmul_([a], [b], [b], value=scalar)
            torch._foreach_mul_([a], scalar)
        lm.mark_step()
        torch.testing.assert_close(lazy[0].cpu(), cpu[0], equal_nan=True)
        compiles.append(metrics.counter_value("UncachedCompile"))
    assert not compiles[1], "a new lr recompiled"


def test_optimizers_of_lazy_parameters_step_with_foreach(dev):
    """An optimizer that leaves foreach to torch steps lazy parameters with foreach (as torch
    does on CUDA) and reads foreach=None again after the step; one that chose foreach=False, or
    whose parameters aren't all lazy, is left as it is."""
    seen = []

    def spy(opt, args, kwargs):
        seen.append([group["foreach"] for group in opt.param_groups])

    lazy = [torch.nn.Parameter(torch.randn(3).to(dev))]
    cpu = [torch.nn.Parameter(torch.randn(3))]
    opts = [torch.optim.AdamW(lazy, lr=0.1), torch.optim.AdamW(lazy, lr=0.1, foreach=False),
            torch.optim.SGD([{"params": lazy}, {"params": cpu}], lr=0.1)]
    for opt in opts:
        opt.register_step_pre_hook(spy)
        for p in lazy + cpu:
            p.grad = torch.ones_like(p)
        opt.step()
    lm.mark_step()
    assert seen == [[True], [False], [True, None]]
    assert [[g["foreach"] for g in opt.param_groups] for opt in opts] == [[None], [False], [None, None]]


@pytest.mark.parametrize("set_to_none", [True, False])
def test_zero_grad_records_nothing_or_zeros(dev, set_to_none):
    """zero_grad(set_to_none=True) records no node and creates no tensor; set_to_none=False
    (foreach zero_ on lazy parameters) zeros the grads in place. Either way the next backward's
    grads equal CPU's."""
    torch.manual_seed(0)
    ref = torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.Tanh(), torch.nn.Linear(3, 2))
    model = copy.deepcopy(ref).to(dev)
    opt, ref_opt = torch.optim.AdamW(model.parameters()), torch.optim.AdamW(ref.parameters())
    x = torch.randn(5, 4)
    for step in range(2):
        for m, o, inp in ((model, opt, x.to(dev)), (ref, ref_opt, x)):
            m(inp * (step + 1)).pow(2).sum().backward()
        lm.mark_step()
        grads = [p.grad for p in model.parameters()]
        metrics.reset()
        opt.zero_grad(set_to_none=set_to_none)
        ref_opt.zero_grad(set_to_none=set_to_none)
        if set_to_none:
            assert not any(metrics.counter_value(n) for n in metrics.counter_names())
            assert all(p.grad is None for p in model.parameters())
        else:
            assert not [c for c in metrics.counter_names() if c.startswith("aten::")]
            assert all(p.grad is g for p, g in zip(model.parameters(), grads))  # the same tensors, zeroed
            torch.testing.assert_close([g.cpu() for g in grads], [torch.zeros_like(p) for p in ref.parameters()])
    for m, inp in ((model, x.to(dev)), (ref, x)):
        m(inp).pow(2).sum().backward()
    lm.mark_step()
    torch.testing.assert_close([p.grad.cpu() for p in model.parameters()], [p.grad for p in ref.parameters()])


@pytest.mark.parametrize("make", [lambda p: torch.optim.Adam(p, lr=1e-2, amsgrad=True),
                                  lambda p: torch.optim.Adamax(p, lr=1e-2)], ids=["adam-amsgrad", "adamax"])
def test_default_foreach_with_maximum_matches_cpu(dev, make):
    """Optimizers whose foreach step calls _foreach_maximum_ (no per-tensor maximum_ exists) run
    by default on lazy parameters and match CPU."""
    torch.manual_seed(0)
    ref = torch.nn.Linear(4, 3)
    model = copy.deepcopy(ref).to(dev)
    g = torch.Generator().manual_seed(1)
    batches = [(torch.randn(5, 4, generator=g),) for _ in range(3)]
    train_side_by_side(model, ref, make, batches, lambda m, x: m(x).pow(2).mean(), dev)
    for p, q in zip(model.parameters(), ref.parameters()):
        torch.testing.assert_close(p.cpu(), q, rtol=1e-4, atol=1e-5)
