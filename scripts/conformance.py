#!/usr/bin/env python
"""Conformance of the lazy device against CPU PyTorch, swept over PyTorch's own test databases.

Three sweeps, one status per entry and phase:

  ops (default)  every float32 entry of OpInfo's `op_db`:
            forward   every sample's outputs (torch.testing.assert_close, rtol 1e-4,
                      atol 1e-5, equal_nan)
            backward  (entries with op.supports_autograd) the gradients of the sum of all
                      differentiable float outputs w.r.t. every float input that requires grad
            --dtype bfloat16 / float16 sweeps the entries CPU PyTorch supports in that dtype
            instead, against CPU's result in that dtype (rtol/atol 1.6e-2/1e-2 for bfloat16,
            2e-3/1e-3 for float16: a rounding or two of the result's dtype), or where that
            fails, at least as near as CPU's to CPU's float64 result rounded to that dtype
            (counted and listed apart: ratex rounds at stores, not between fused ops, and a
            cancellation can make that more than a rounding). --nonfinite puts
            NaN, +inf and -inf at three fixed positions of every float sample tensor (inputs
            and arguments) first. Index outputs of ops that may order equal values either way
            (sort without stable=True, topk, kthvalue, ...) pass where they pick equal values.
  --modules every float32 entry of ModuleInfo's `module_db`, in train mode, and in eval mode
            where the module behaves differently: per sample, one lazy step with the forward,
            a backward with random output cotangents and one SGD step, compared stage by stage
            (outputs; input and parameter gradients, atol 1e-4; buffers such as running
            statistics; parameters after the step). A failure names its stage.
  --optims  every config of OptimizerInfo's `optim_db` for CPU, for-loop and foreach (where the
            optimizer has one): 5 training steps of a small model, losses and final parameters
            compared; the compiles after each step are in --details. LBFGS, which amplifies
            rounding, trains on one batch and is compared in float64 (tightly) and in float32
            (within CPU float32's own spread): see ROUNDING_AMPLIFIERS.

  pass      every sample matched and nothing ran eagerly on CPU
  fallback  every sample matched, but some `aten::<op>` counter moved (an op
            ran on CPU PyTorch instead of being lowered to TVM)
  fail      a mismatch, an exception, a crash or a timeout
  skip      no sample could be checked (every sample failed on CPU itself, or
            produced nothing differentiable); not counted in the figures

Samples that raise on CPU are skipped. Op samples whose CPU result is not
reproducible (random ops: two CPU runs differ, or a random ATen op ran, even
one OpInfo reseeds) and ops that return uninitialized memory (`empty*`) are
compared by structure, shape and dtype only; so are module samples whose two
CPU runs differ.

Each entry runs in a worker subprocess (a pool of --workers, recycled after
--max-tasks tasks), so a crash, a hang (--timeout) or a memory blow-up
(--max-rss-gb) costs that entry only: it counts as `fail`.

    python scripts/conformance.py                    # all op entries, print the figures
    python scripts/conformance.py --write            # ... and update tests/conformance_expectations.json
    python scripts/conformance.py --ops add,cumsum --verbose
    python scripts/conformance.py --dtype bfloat16 --write   # into tests/conformance_ops_bfloat16.json
    python scripts/conformance.py --nonfinite --write        # into tests/conformance_ops_float32_nonfinite.json
    python scripts/conformance.py --details out.json # per-entry messages and fallback counters
    python scripts/conformance.py --modules --write  # module_db into tests/conformance_modules.json
    python scripts/conformance.py --modules nn.LSTM,nn.GRU -v
    python scripts/conformance.py --optims --write   # optim_db into tests/conformance_optims.json
    python scripts/conformance.py --optims Adam,SGD/momentum -v

`entries` and `check_entry` (ops) and the Sweep objects in SWEEPS (entries, phases and
check function of each sweep) are also used in-process by tests/test_conformance.py and
tests/test_conformance_sweeps.py.
"""
import argparse
import collections
import copy
import json
import os
import re
import signal
import sys
import time
import traceback
import warnings

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# ratex from this checkout, not from wherever an editable install points (another worktree): the
# sweep checks, and --write records, what this tree computes. Spawned workers run this too.
sys.path.insert(0, ROOT)
EXPECTATIONS = os.path.join(ROOT, "tests", "conformance_expectations.json")
RTOL, ATOL = 1e-4, 1e-5
# Per dtype of the op sweep: (rtol, atol) against CPU's result in that dtype. Half-precision
# results may differ from CPU's by a rounding or two (an intermediate kept in float32, another
# summation order), and a value near 0 from a cancellation by a rounding of its operands.
OP_TOLERANCES = {"float32": (RTOL, ATOL), "bfloat16": (1.6e-2, 1e-2), "float16": (2e-3, 1e-3)}
OP_DTYPES = tuple(OP_TOLERANCES)
DEFAULT_MAX_SAMPLES = 8
PHASES = ("forward", "backward")

# Ops whose outputs are uninitialized memory: only metadata can be compared.
UNINITIALIZED = re.compile(r"(^|\.|_)empty")


# --------------------------------------------------------------------------- #
# checking one entry (runs in a worker, or in-process from the tests)
# --------------------------------------------------------------------------- #

def entry_key(op):
    return op.name + ("." + op.variant_test_name if op.variant_test_name else "")


def entries(names=None, dtype="float32"):
    """{key: OpInfo} for the op_db entries CPU PyTorch runs in `dtype` (all, or those in `names`)."""
    import torch
    from torch.testing._internal.common_methods_invocations import op_db

    dtype = getattr(torch, dtype)
    out = {}
    for op in op_db:
        key = entry_key(op)
        if key in out:
            continue
        if names is not None and key not in names and op.name not in names:
            continue
        try:
            if dtype not in op.supported_dtypes("cpu"):
                continue
        except Exception:
            continue
        out[key] = op
    return out


def op_phases(op, dtype="float32"):
    """forward, and backward where the entry has autograd in `dtype` on CPU."""
    import torch

    if not op.supports_autograd or dtype == "float32":  # float32: as the recorded sweep always ran
        return PHASES if op.supports_autograd else PHASES[:1]
    try:
        return PHASES if getattr(torch, dtype) in op.supported_backward_dtypes("cpu") else PHASES[:1]
    except Exception:
        return PHASES[:1]


def _short(exc, limit=300):
    msg = str(exc).strip().splitlines()
    first = msg[0] if msg else ""
    return f"{type(exc).__name__}: {first}"[:limit]


def _mismatch_message(exc, limit=300):
    lines = [ln.strip() for ln in str(exc).strip().splitlines() if ln.strip()]
    # assert_close: "Tensor-likes are not close!", "Mismatched elements: ...", "Greatest absolute ..."
    return ("mismatch: " + " | ".join(lines[:3]))[:limit]


class _CpuFailed(Exception):
    pass


class _Skip(Exception):
    pass


def _tensors(tree):
    import torch
    from torch.utils._pytree import tree_leaves

    return [x for x in tree_leaves(tree) if isinstance(x, torch.Tensor)]


def _copy_parts(parts):
    """A copy of (input, args, kwargs) with the same layouts and requires_grad, sharing nothing."""
    import torch
    from torch.utils._pytree import tree_map

    try:
        return copy.deepcopy(parts)
    except Exception:
        pass

    def one(x):
        if not isinstance(x, torch.Tensor):
            return copy.copy(x)
        y = x.detach().clone()
        return y.requires_grad_(x.requires_grad) if (y.is_floating_point() or y.is_complex()) else y

    return tree_map(one, parts)


def _own_storage(parts):
    """The inputs as `.to(device)` delivers them: a view into a larger storage gets its own.

    The device copy of a view holds only the view's elements (as on CUDA), so ops that
    address storage directly (as_strided with a storage_offset) must see the same on CPU.
    """
    import torch
    from torch.utils._pytree import tree_map

    def one(x):
        if not isinstance(x, torch.Tensor) or x.layout != torch.strided:
            return x
        if x.storage_offset() == 0 and x.is_contiguous() and \
                x.untyped_storage().nbytes() == x.numel() * x.element_size():
            return x
        y = x.detach().clone(memory_format=torch.contiguous_format)
        return y.requires_grad_(True) if x.requires_grad else y

    return tree_map(one, parts)


def _to_lazy(parts, device):
    import torch
    from torch.utils._pytree import tree_map

    def one(x):
        if not isinstance(x, torch.Tensor):
            return x
        y = x.detach().to(device)
        return y.requires_grad_(True) if x.requires_grad else y

    return tree_map(one, parts)


def _to_device_aliased(parts, device):
    """The tensors of `parts` on `device`, one copy per distinct tensor: a tensor passed twice
    (attention's query, key and value) stays one leaf, so its gradients add up as on CPU."""
    import torch
    from torch.utils._pytree import tree_map

    memo = {}

    def one(x):
        if not isinstance(x, torch.Tensor):
            return x
        if id(x) not in memo:
            y = x.detach().to(device)
            memo[id(x)] = (x, y.requires_grad_(True) if x.requires_grad else y)
        return memo[id(x)][1]

    return tree_map(one, parts)


def _to_cpu(tree):
    import torch
    from torch.utils._pytree import tree_map

    return tree_map(lambda x: x.detach().cpu() if isinstance(x, torch.Tensor) else x, tree)


def _same_metadata(got, want):
    import torch
    from torch.utils._pytree import tree_flatten

    gl, gs = tree_flatten(got)
    wl, ws = tree_flatten(want)
    if gs != ws:
        raise AssertionError(f"output structure differs: {gs} vs {ws}")
    for g, w in zip(gl, wl):
        if isinstance(w, torch.Tensor):
            if not isinstance(g, torch.Tensor) or g.shape != w.shape or g.dtype != w.dtype:
                raise AssertionError(
                    f"output metadata differs: {getattr(g, 'shape', type(g))}/{getattr(g, 'dtype', '')}"
                    f" vs {tuple(w.shape)}/{w.dtype}")


def _close(a, b, tol=(RTOL, ATOL)):
    import torch

    try:
        torch.testing.assert_close(a, b, rtol=tol[0], atol=tol[1], equal_nan=True)
        return True
    except Exception:
        return False


def _forward_fn(op):
    def run(parts):
        inp, args, kwargs = parts
        return op(inp, *args, **kwargs)
    return run


def _backward_fn(op, sample):
    """parts -> (grads, forward outputs) of the sum of all differentiable float outputs."""
    import torch

    process = sample.output_process_fn_grad or (lambda x: x)

    def run(parts):
        inp, args, kwargs = parts
        leaves = [t for t in _tensors(parts) if t.requires_grad and t.is_floating_point()]
        if not leaves:
            raise _Skip("no float input requires grad")
        out = process(op.gradcheck_wrapper(op.get_op(), inp, *args, **kwargs))
        outs = [t for t in _tensors(out) if t.is_floating_point() and t.requires_grad]
        if not outs:
            raise _Skip("no differentiable float output")
        loss = outs[0].sum()
        for t in outs[1:]:
            loss = loss + t.sum()
        grads = torch.autograd.grad(loss, leaves, allow_unused=True, materialize_grads=True)
        return list(grads)
    return run


def _SeededOpsSeen():
    """A dispatch mode noting whether any random (`nondeterministic_seeded`) ATen op ran."""
    import torch
    from torch.utils._python_dispatch import TorchDispatchMode

    class Mode(TorchDispatchMode):
        any = False

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            if torch.Tag.nondeterministic_seeded in func.tags:
                self.any = True
            return func(*args, **(kwargs or {}))

    return Mode()


NONFINITE = (float("nan"), float("inf"), float("-inf"))


def _inject_nonfinite(parts, seed):
    """A copy of `parts` whose float tensors hold NaN, +inf and -inf at three positions each
    (fewer in smaller tensors), drawn from `seed` and the tensor's order; a tensor passed twice
    stays one tensor."""
    import torch
    from torch.utils._pytree import tree_map

    memo = {}

    def one(x):
        if not isinstance(x, torch.Tensor) or not x.is_floating_point() or x.layout != torch.strided \
                or x.numel() == 0:
            return x
        if id(x) not in memo:
            g = torch.Generator().manual_seed(seed * 1009 + len(memo))
            where = torch.randperm(x.numel(), generator=g)[:len(NONFINITE)]
            y = x.detach().clone(memory_format=torch.contiguous_format)
            y.view(-1)[where] = torch.tensor(NONFINITE[:len(where)], dtype=y.dtype)
            memo[id(x)] = (x, y.requires_grad_(True) if x.requires_grad else y)
        return memo[id(x)][1]

    return tree_map(one, parts)


# Ops whose index output may order equal values either way: PyTorch's CPU sort is not stable
# unless asked to be, topk, kthvalue, mode and median pick any of equal candidates. name ->
# (position of `dim` in the call, its default, position of `keepdim` or None, the index output).
_TIE_ORDER = {"sort": (1, -1, None, 1), "argsort": (1, -1, None, 0), "topk": (2, -1, None, 1),
              "kthvalue": (2, -1, 3, 1), "mode": (1, -1, 2, 1), "median": (1, None, 2, 1),
              "nanmedian": (1, None, 2, 1)}


def _picks_equal_values(op, parts, got, want, tol):
    """Whether `got` matches `want` but for an index output of a _TIE_ORDER op that picks
    elements equal to the ones `want`'s picks (for sort and argsort: a permutation too)."""
    import torch
    from torch.utils._pytree import tree_leaves

    spec = _TIE_ORDER.get(op.name)
    inp, args, kwargs = parts
    if spec is None or not isinstance(inp, torch.Tensor) or inp.dim() == 0:
        return False
    dim_at, dim_default, keep_at, index_out = spec
    stable = kwargs.get("stable", False)
    dim = args[dim_at - 1] if len(args) >= dim_at else kwargs.get("dim", dim_default)
    keepdim = keep_at is not None and (args[keep_at - 1] if len(args) >= keep_at else kwargs.get("keepdim", False))
    gl, wl = tree_leaves(got), tree_leaves(want)
    if stable or dim is None or len(gl) != len(wl) or index_out >= len(wl):
        return False
    for i, (g, w) in enumerate(zip(gl, wl)):
        if i != index_out:
            try:
                torch.testing.assert_close(g, w, rtol=tol[0], atol=tol[1], equal_nan=True)
            except AssertionError:
                return False
    g, w = gl[index_out], wl[index_out]
    if not isinstance(g, torch.Tensor) or g.shape != w.shape or g.dtype != w.dtype:
        return False
    dim = dim % inp.dim()
    if not keepdim and op.name not in ("sort", "argsort", "topk"):
        g, w = g.unsqueeze(dim), w.unsqueeze(dim)
    data = inp.detach()
    if (g < 0).any() or (g >= data.shape[dim]).any():
        return False
    if op.name in ("sort", "argsort") and not torch.equal(g.sort(dim).values, w.sort(dim).values):
        return False
    picked, wanted = data.gather(dim, g), data.gather(dim, w)
    return bool(((picked == wanted) | (picked.isnan() & wanted.isnan())).all())


def _in_float64(fn, parts, like):
    """fn of `parts` with their float tensors in float64, each result rounded to the dtype of the
    same result in `like` (None where the float64 run fails or returns another structure)."""
    import torch
    from torch.utils._pytree import tree_flatten, tree_map, tree_unflatten

    memo = {}

    def wide(x):
        if not isinstance(x, torch.Tensor) or not x.is_floating_point():
            return x
        if id(x) not in memo:
            y = x.detach().to(torch.float64)
            memo[id(x)] = (x, y.requires_grad_(True) if x.requires_grad else y)
        return memo[id(x)][1]

    try:
        out = fn(tree_map(wide, parts))
    except Exception:
        return None
    ol, spec = tree_flatten(out)
    ll, lspec = tree_flatten(like)
    if spec != lspec:
        return None
    return tree_unflatten([o.detach().to(w.dtype) if isinstance(o, torch.Tensor) and isinstance(w, torch.Tensor)
                           and o.is_floating_point() else o for o, w in zip(ol, ll)], spec)


def _no_less_accurate(got, want, ref, tol):
    """Whether every element of `got` is as near CPU's float64 result `ref` as CPU's own `want`
    is (twice its error, plus the tolerance), with CPU's NaN and infinities where CPU has them."""
    import torch
    from torch.utils._pytree import tree_flatten

    gl, gs = tree_flatten(got)
    wl, ws = tree_flatten(want)
    rl, rs = tree_flatten(ref) if ref is not None else (None, None)
    if ref is None or gs != ws or ws != rs:
        return False
    for g, w, r in zip(gl, wl, rl):
        if not isinstance(w, torch.Tensor):
            if g != w:
                return False
            continue
        if not isinstance(g, torch.Tensor) or g.shape != w.shape or g.dtype != w.dtype:
            return False
        if not w.is_floating_point():
            if not torch.equal(g, w):
                return False
            continue
        g, w, r = (t.detach().to(torch.float64) for t in (g, w, r))
        err = ((g - r).abs() <= 2 * (w - r).abs() + tol[1] + tol[0] * r.abs())
        same = (g == w) | (g.isnan() & w.isnan())
        if not ((err & w.isfinite()) | same).all():
            return False
    return True


def _check_sample(op, sample, phase, device, metadata_only, tol=(RTOL, ATOL), nonfinite_seed=None, wide=False):
    """Return ("pass"|"fallback"|"skip", info) or raise for a failure on the lazy side.

    With a `nonfinite_seed`, the sample's float tensors first get NaN and infinities (see
    _inject_nonfinite). With `wide` (half-precision samples), a result that misses CPU's but is
    as near CPU's float64 result (rounded to the sample's dtype) as CPU's is passes, noted as
    "float64_reference": ratex and CPU round at different points (ratex keeps float32 between
    fused ops, CPU rounds after each op of a composite), which a cancellation can blow up into
    more than a rounding: a batch norm's weight gradient sums terms that cancel to near 0."""
    import ratex.lazy_tensor_core.core.lazy_model as lm
    from ratex.lazy_tensor_core.debug import metrics

    parts = _own_storage((sample.input, sample.args, sample.kwargs))
    if nonfinite_seed is not None:
        parts = _inject_nonfinite(parts, nonfinite_seed)
    lazy_parts = _to_lazy(_copy_parts(parts), device)   # before any CPU run can mutate `parts`
    fn = _forward_fn(op) if phase == "forward" else _backward_fn(op, sample)

    try:
        with _SeededOpsSeen() as seen:
            want = fn(_copy_parts(parts))
        again = fn(_copy_parts(parts))
    except _Skip:
        raise
    except Exception as e:
        raise _CpuFailed(_short(e))
    # A random op reseeded by OpInfo's wrapper repeats on CPU, but the lazy device
    # draws from its own stream (as CUDA does): compare such samples by structure.
    random = metadata_only or seen.any or not _close(again, want, tol)

    metrics.reset()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        got = fn(lazy_parts)
        lm.mark_step()
        got = _to_cpu(got)
    fallbacks = sorted(c for c in metrics.counter_names() if c.startswith("aten::"))
    notes = sorted({str(w.message).splitlines()[0][:300] for w in caught if "ratex" in str(w.message)})

    reference = None
    if random:
        _same_metadata(got, want)
    else:
        try:
            import torch
            torch.testing.assert_close(got, want, rtol=tol[0], atol=tol[1], equal_nan=True)
        except AssertionError as e:
            if phase == "forward" and _picks_equal_values(op, parts, got, want, tol):
                pass
            elif wide and _no_less_accurate(got, want, _in_float64(fn, _copy_parts(parts), want), tol):
                reference = "float64"
            else:
                raise AssertionError(_mismatch_message(e)) from None
    return ("fallback" if fallbacks else "pass"), {"fallbacks": fallbacks, "notes": notes,
                                                   "metadata_only": random, "reference": reference}


def _flush():
    """Drop whatever a failed sample left pending on the lazy device."""
    import gc

    import ratex.lazy_tensor_core.core.lazy_model as lm
    gc.collect()
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            lm.mark_step()
    except Exception:
        pass


def check_entry(op, phase, max_samples=DEFAULT_MAX_SAMPLES, device=None, seed=0, dtype="float32",
                nonfinite=False):
    """Check one OpInfo entry in one direction, on samples in `dtype` (with NaN and infinities
    put in where `nonfinite`). Return a dict with "status" and details."""
    import random as _random

    import numpy as np
    import torch

    device = device or torch.device("lazy", 0)
    metadata_only = bool(UNINITIALIZED.search(op.name))
    torch.manual_seed(seed)
    _random.seed(seed)
    np.random.seed(seed)
    result = {"status": "skip", "samples": 0, "cpu_failed": 0, "fallbacks": [], "notes": [],
              "metadata_only": False}
    try:
        samples = op.sample_inputs("cpu", getattr(torch, dtype), requires_grad=(phase == "backward"))
        checked = tried = 0
        fallbacks, notes = set(), set()
        for sample in samples:
            if max_samples and tried >= max_samples:
                break
            tried += 1
            try:
                status, info = _check_sample(op, sample, phase, device, metadata_only, OP_TOLERANCES[dtype],
                                             seed + tried if nonfinite else None, wide=dtype != "float32")
            except _CpuFailed as e:
                result["cpu_failed"] += 1
                result.setdefault("cpu_error", str(e))
                continue
            except _Skip as e:
                result.setdefault("skip_reason", str(e))
                continue
            except AssertionError as e:
                result.update(status="fail", error=str(e)[:300] if str(e).startswith(("mismatch", "output"))
                              else _short(e), sample=checked)
                break
            except Exception as e:
                result.update(status="fail", error=_short(e), sample=checked,
                              where=_where(e))
                break
            checked += 1
            _count_sample(result, status, info, fallbacks, notes)
        result["samples"] = checked
        result["fallbacks"] = sorted(fallbacks)
        result["notes"] = sorted(notes)[:5]
        if result["status"] == "fail":
            _flush()
    except Exception as e:  # sample generation itself failed
        result.update(status="skip", skip_reason="sample_inputs: " + _short(e))
        _flush()
    return result


def _count_sample(result, status, info, fallbacks, notes):
    """Fold one checked sample (its status, fallback counters and notes) into its entry's result."""
    fallbacks.update(info["fallbacks"])
    notes.update(info["notes"])
    result["metadata_only"] |= info["metadata_only"]
    if info.get("reference"):
        result["float64_reference"] = result.get("float64_reference", 0) + 1
    if status == "fallback" and result["status"] != "fail":
        result["status"] = "fallback"
    elif result["status"] == "skip":
        result["status"] = "pass"


def _where(exc):
    """The innermost frame of the traceback inside ratex or tvm_lowering, for grouping failures."""
    frames = traceback.extract_tb(exc.__traceback__)
    for fr in reversed(frames):
        if "/ratex/" in fr.filename or "/tvm_lowering/" in fr.filename:
            return f"{os.path.relpath(fr.filename, ROOT)}:{fr.lineno} {fr.name}"
    return ""


# --------------------------------------------------------------------------- #
# nn modules (--modules): ModuleInfo's module_db
# --------------------------------------------------------------------------- #

MODULE_EXPECTATIONS = os.path.join(ROOT, "tests", "conformance_modules.json")
MODULE_PHASES = ("train", "eval")
MODULE_SGD_LR = 0.1
GRAD_ATOL = 1e-4  # gradients sum over a batch: float32 reduction order moves them more than outputs


def module_entries(names=None):
    """{name: ModuleInfo} for the float32 module_db entries (all, or those in `names`)."""
    import torch
    from torch.testing._internal.common_modules import module_db

    return {m.name: m for m in module_db
            if torch.float32 in m.dtypes and (names is None or m.name in names)}


def module_phases(info):
    """The modes an entry is checked in: train, and eval where the module behaves differently."""
    return MODULE_PHASES if info.train_and_eval_differ else MODULE_PHASES[:1]


def _spread(items, k):
    """At most k items, evenly spaced over the list (samples come grouped by variant)."""
    n = len(items)
    if not k or n <= k:
        return list(items)
    return [items[round(i * (n - 1) / (k - 1))] for i in range(k)] if k > 1 else items[:1]


def _build_module(info, cargs, ckwargs, seed):
    """The entry's module, its floating-point parameters and buffers in float32.

    As PyTorch's own TestModule does (`m.to(device).to(dtype)`): a constructor input may come in
    another dtype (FractionalMaxPool's `_random_samples` are float64, a buffer the float32 input
    must match).
    """
    import torch

    torch.manual_seed(seed)
    return info.module_cls(*cargs, **ckwargs).to(torch.float32)


def _grads_of(tensors):
    return [t.grad for t in tensors]


def _named_grads(parts, module):
    """{"input i" / parameter name: its .grad}, for the forward inputs and the module's parameters."""
    out = {f"input {i}": t.grad for i, t in enumerate(_tensors(parts)) if t.requires_grad}
    out.update((k, p.grad) for k, p in module.named_parameters())
    return out


class _Mismatch(AssertionError):
    """A lazy result differs from CPU's (the message names which tensor and by how much)."""


class _Stage:
    """Names the stage of a module check an exception came from (forward, backward, step, sync)."""

    def __init__(self):
        self.name = "construct"


def _module_sample(info, sample, training, device, seed, stage):
    """Check one ModuleInput; return ("pass"|"fallback", info) or raise for a failure on the lazy side.

    One lazy step holds the sample's forward, its backward with random output cotangents, and one
    SGD step; it is compared with CPU's stage by stage: outputs, input and parameter gradients,
    buffers (running statistics), parameters after the step.
    """
    import torch

    import ratex.lazy_tensor_core.core.lazy_model as lm
    from ratex.lazy_tensor_core.debug import metrics

    cons, fwd = sample.constructor_input, sample.forward_input
    cpu_fwd = _own_storage((fwd.args, fwd.kwargs))
    lazy_cons = _to_device_aliased(_copy_parts((cons.args, cons.kwargs)), device)
    lazy_fwd = _to_device_aliased(_copy_parts(cpu_fwd), device)

    def forward(module, parts):
        module.train(training)
        args, kwargs = parts
        return module(*args, **kwargs)

    def backward(out, make_grad):
        outs = [t for t in _tensors(out) if t.is_floating_point() and t.requires_grad]
        if outs:
            torch.autograd.backward(outs, [make_grad(t) for t in outs])

    def run(module, parts, make_grad):
        out = forward(module, parts)
        backward(out, make_grad)
        return out

    def cotangents(dev):
        g = torch.Generator().manual_seed(seed + 1)
        return lambda t: torch.randn(t.shape, generator=g, dtype=t.dtype).to(dev)

    def step(module):
        params = [p for p in module.parameters() if p.grad is not None]
        if params:
            torch.optim.SGD(params, lr=MODULE_SGD_LR).step()

    try:
        parts = _copy_parts(cpu_fwd)
        ref = _build_module(info, *_copy_parts((cons.args, cons.kwargs)), seed)
        if info.is_lazy:
            with torch.no_grad():
                forward(ref, _copy_parts(cpu_fwd))
        init = copy.deepcopy(ref)
        again = copy.deepcopy(ref)
        want = forward(ref, parts)
        backward(want, cotangents("cpu"))
        want_grads = _named_grads(parts, ref)
        step(ref)
        again_parts = _copy_parts(cpu_fwd)
        again_out = run(again, again_parts, cotangents("cpu"))
    except Exception as e:
        raise _CpuFailed(_short(e))
    # A second CPU run tells random modules (they draw again, so they differ) from the rest; a
    # random op that cannot change the result (dropout with p=0) leaves the module comparable.
    random = not _close(again_out, want) or \
        not _close(_grads_of(_tensors(again_parts)), _grads_of(_tensors(parts)))

    metrics.reset()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        stage.name = "construct"
        lazy = _build_module(info, *lazy_cons, seed).to(device)
        if info.is_lazy:  # materialize on the device, then take CPU's values (init draws differ)
            with torch.no_grad():
                forward(lazy, _copy_parts(lazy_fwd))
            lm.mark_step()
            with torch.no_grad():
                for p, q in zip(list(lazy.parameters()) + list(lazy.buffers()),
                                list(init.parameters()) + list(init.buffers())):
                    p.copy_(q.detach().to(device))
        stage.name = "forward"
        got = forward(lazy, lazy_fwd)
        stage.name = "backward"
        backward(got, cotangents(device))
        stage.name = "step"
        got_grads = _named_grads(lazy_fwd, lazy)
        step(lazy)
        stage.name = "sync"
        lm.mark_step()
        got = _to_cpu(got)
        got_grads = {k: None if g is None else g.cpu() for k, g in got_grads.items()}
    fallbacks = sorted(c for c in metrics.counter_names() if c.startswith("aten::"))
    notes = sorted({str(w.message).splitlines()[0][:300] for w in caught if "ratex" in str(w.message)})

    checks = [("forward", "output", got, want, ATOL)]
    if not random:
        checks += [("backward", f"grad of {k}", got_grads[k], want_grads[k], GRAD_ATOL) for k in want_grads]
        checks += [("buffers", f"buffer {k}", b.cpu(), dict(ref.named_buffers())[k], ATOL)
                   for k, b in lazy.named_buffers()]
        checks += [("step", f"{k} after SGD", p.detach().cpu(), dict(ref.named_parameters())[k].detach(), GRAD_ATOL)
                   for k, p in lazy.named_parameters()]
    for name, label, a, b, atol in checks:
        stage.name = name
        if random:
            _same_metadata(a, b)
            continue
        try:
            torch.testing.assert_close(a, b, rtol=RTOL, atol=atol, equal_nan=True)
        except AssertionError as e:
            raise _Mismatch(f"{label}: " + _mismatch_message(e)) from None
    return ("fallback" if fallbacks else "pass"), {"fallbacks": fallbacks, "notes": notes, "metadata_only": random}


def check_module(info, phase, max_samples=DEFAULT_MAX_SAMPLES, device=None, seed=0):
    """Check one module_db entry in one mode ("train" or "eval"). Return a dict with "status" and details."""
    import random as _random

    import numpy as np
    import torch

    from ratex.lazy_tensor_core.debug import metrics

    device = device or torch.device("lazy", 0)
    torch.manual_seed(seed)
    _random.seed(seed)
    np.random.seed(seed)
    result = {"status": "skip", "samples": 0, "cpu_failed": 0, "fallbacks": [], "notes": [],
              "metadata_only": False, "compiles": 0}
    training = phase == "train"
    try:
        samples = list(info.module_inputs_func(info, device="cpu", dtype=torch.float32,
                                               requires_grad=True, training=training))
    except Exception as e:
        result.update(skip_reason="module_inputs_func: " + _short(e))
        return result
    chosen = _spread(samples, max_samples)
    result["of"] = len(samples)
    fallbacks, notes = set(), set()
    for i, sample in enumerate(chosen):
        stage = _Stage()
        try:
            status, found = _module_sample(info, sample, training, device, seed + i, stage)
            result["compiles"] += metrics.counter_value("UncachedCompile") or 0
        except _CpuFailed as e:
            result["cpu_failed"] += 1
            result.setdefault("cpu_error", str(e))
            continue
        except _Mismatch as e:
            result.update(status="fail", stage=stage.name, sample=sample.desc or str(i), error=str(e)[:300])
            _flush()
            break
        except Exception as e:
            result.update(status="fail", stage=stage.name, sample=sample.desc or str(i),
                          error=_short(e), where=_where(e))
            _flush()
            break
        result["samples"] += 1
        _count_sample(result, status, found, fallbacks, notes)
    result["fallbacks"] = sorted(fallbacks)
    result["notes"] = sorted(notes)[:5]
    return result


# --------------------------------------------------------------------------- #
# optimizers (--optims): OptimizerInfo's optim_db
# --------------------------------------------------------------------------- #

OPTIM_EXPECTATIONS = os.path.join(ROOT, "tests", "conformance_optims.json")
OPTIM_PHASES = ("forloop", "foreach")
OPTIM_STEPS = 5


def optim_entries(names=None):
    """{"<Optimizer>/<config>": (OptimizerInfo, OptimizerInput)} for every CPU config of optim_db
    (all, or those whose key or optimizer name is in `names`)."""
    import torch
    from torch.testing._internal.common_optimizers import optim_db

    out = {}
    for info in optim_db:
        name = info.optim_cls.__name__
        for config in info.optim_inputs_func(device="cpu", dtype=torch.float32):
            key = f"{name}/{config.desc}"
            if names is None or key in names or name in names:
                out[key] = (info, config)
    return out


def optim_phases(entry):
    """for-loop always; foreach where the optimizer has a foreach implementation."""
    info, _ = entry
    return OPTIM_PHASES if "foreach" in info.supported_impls else OPTIM_PHASES[:1]


def _optim_problem(name, seed):
    """(model, batch(generator) -> (x, y), loss(model, x, y)): a small model each optimizer accepts."""
    import torch
    import torch.nn.functional as F
    from torch import nn

    torch.manual_seed(seed)
    if name == "SparseAdam":  # sparse gradients only
        model = nn.Embedding(12, 4, sparse=True)
        return (model, lambda g: (torch.randint(0, 12, (6,), generator=g), torch.randn(6, 4, generator=g)),
                lambda m, x, y: F.mse_loss(m(x), y))
    bias = name != "Muon"  # Muon takes 2-d parameters only
    model = nn.Sequential(nn.Linear(8, 16, bias=bias), nn.Tanh(), nn.Linear(16, 4, bias=bias))
    return (model, lambda g: (torch.randn(5, 8, generator=g), torch.randint(0, 4, (5,), generator=g)),
            lambda m, x, y: F.cross_entropy(m(x), y))


# LBFGS amplifies rounding: each step it runs up to 20 iterations, each a line of dot products,
# float reads and branches (`ys > 1e-10`, the line search's comparisons) on a history of
# gradient differences, so one float32 ulp early on moves the final parameters by far more than
# RTOL/ATOL; CPU PyTorch itself lands as far from its own float64 result, or from a float32 run
# started one ulp away. Its configs are therefore checked twice, on one fixed batch (LBFGS is a
# full-batch method: with a new batch each step its curvature pairs mix two batches' gradients,
# and at lr=1 it diverges, on CPU too, in float64 as in float32, where no two runs that round
# differently can agree):
#   float64  the lazy device matches CPU float64 tightly (FLOAT64_RTOL/ATOL): this is where a
#            wrong op, scalar or branch shows;
#   float32  the lazy device is no further from CPU float32 than SPREAD_FACTOR times CPU
#            float32's own spread (max over the losses, and over the final parameters), on top
#            of RTOL/ATOL. The spread is the larger of CPU float32's distance from CPU float64
#            and from CPU float32 started with every parameter one ulp up: how far two float32
#            runs that round differently (another summation order in a dot product) land apart
#            is of that order, and a CPU run started one ulp away passes by construction.
# Every other optimizer is compared in float32 at RTOL/ATOL.
ROUNDING_AMPLIFIERS = ("LBFGS",)
FLOAT64_RTOL, FLOAT64_ATOL = 1e-9, 1e-10
SPREAD_FACTOR = 2.0


def check_optim(entry, phase, max_samples=None, device=None, seed=0, steps=OPTIM_STEPS):
    """Train a small model `steps` steps with one optim_db config on CPU and on the lazy device.

    Returns a dict with "status" (pass / fallback / fail, as for ops), the first step whose loss
    differs, the compile count and seconds after each step, and where it fails, the stage:
    "step" (an exception while tracing or running a step), "loss" (a loss differs) or "params"
    (the final parameters differ). Optimizers in ROUNDING_AMPLIFIERS run in float64 and float32
    (see there); "float64" holds the float64 run's compiles and seconds, "float32_spread" CPU
    float32's own spread that the float32 comparison allows for, "distance" how far each lazy
    run landed from CPU's.
    """
    import torch

    import ratex.lazy_tensor_core.core.lazy_model as lm
    from ratex.lazy_tensor_core.debug import metrics

    info, config = entry
    name = info.optim_cls.__name__
    device = device or torch.device("lazy", 0)
    kwargs = dict(config.kwargs)
    if "foreach" in info.supported_impls:
        kwargs["foreach"] = phase == "foreach"
    amplifies = name in ROUNDING_AMPLIFIERS
    result = {"status": "skip", "samples": 0, "fallbacks": [], "notes": [], "compiles": [],
              "step_seconds": []}

    def train(model, dev, dtype, record):
        opt = info.optim_cls(model.parameters(), **copy.deepcopy(kwargs))
        g = torch.Generator().manual_seed(seed + 1)
        batch = data(g) if amplifies else None
        losses = []
        for _ in range(steps):
            x, y = (t.to(dtype) if t.is_floating_point() else t for t in batch or data(g))
            x, y = x.to(dev), y.to(dev)
            t0 = time.time()

            def closure():
                opt.zero_grad()
                loss = loss_fn(model, x, y)
                loss.backward()
                return loss

            if info.step_requires_closure:
                loss = opt.step(closure)
            else:
                loss = closure()
                opt.step()
            if record is not None:
                lm.mark_step()
            losses.append(loss.detach().cpu())
            if record is not None:
                record["compiles"].append(metrics.counter_value("UncachedCompile") or 0)
                record["step_seconds"].append(round(time.time() - t0, 3))
        return losses, [p.detach().cpu() for p in model.parameters()]

    base, data, loss_fn = _optim_problem(name, seed)
    runs, fallbacks = {}, set()
    for dtype in (torch.float64, torch.float32) if amplifies else (torch.float32,):
        ref = copy.deepcopy(base).to(dtype)
        lazy = copy.deepcopy(ref).to(device)
        try:
            want = train(ref, "cpu", dtype, None)
        except Exception as e:
            result.update(skip_reason="cpu: " + _short(e))
            return result
        label = "float64: " if dtype is torch.float64 else ""
        record = result if not label else result.setdefault("float64", {"compiles": [], "step_seconds": []})
        metrics.reset()
        try:
            with warnings.catch_warnings(record=True) as caught:
                warnings.simplefilter("always")
                got = train(lazy, device, dtype, record)
                result["notes"] = sorted(set(result["notes"]) | {str(w.message).splitlines()[0][:300]
                                                                 for w in caught if "ratex" in str(w.message)})[:5]
        except Exception as e:
            result.update(status="fail", stage="step", error=label + _short(e), where=_where(e))
            _flush()
            return result
        fallbacks.update(c for c in metrics.counter_names() if c.startswith("aten::"))
        runs[dtype] = got, want
    if amplifies:  # CPU float32 from every parameter one ulp up: part of CPU's own spread
        moved = copy.deepcopy(base)
        with torch.no_grad():
            for p in moved.parameters():
                p.copy_(torch.nextafter(p, torch.full_like(p, float("inf"))))
        nudged = train(moved, "cpu", torch.float32, None)
    result["fallbacks"] = sorted(fallbacks)
    result["samples"] = steps
    result.update(compare_optim_runs(runs, nudged if amplifies else None))
    if result.get("status") != "fail":
        result["status"] = "fallback" if result["fallbacks"] else "pass"
    return result


def compare_optim_runs(runs, nudged=None):
    """Compare one optimizer config's lazy runs with CPU's.

    `runs` maps a dtype to ((losses, params), (cpu_losses, cpu_params)), lists of CPU tensors:
    float32 alone, compared at RTOL/ATOL, or float64 and float32 for ROUNDING_AMPLIFIERS, with
    `nudged` CPU float32's (losses, params) from every parameter one ulp up (see there). Returns
    the fields check_optim adds to its result: for an amplifier, how far each run landed from
    CPU's ("distance") and CPU float32's own spread ("float32_spread"); for the first mismatch,
    status "fail", its stage ("loss", which explains the parameters, or "params"), the message,
    the first step whose loss differs and both runs' losses.
    """
    import torch

    amplifies = torch.float64 in runs
    out = {}
    for dtype, ((losses, params), (cpu_losses, cpu_params)) in runs.items():
        rtol, atol, label = RTOL, {"loss": ATOL, "params": ATOL}, ""
        if amplifies:  # in --details: how far each run landed from CPU's
            out.setdefault("distance", {})[str(dtype).replace("torch.", "")] = {
                "loss": float(f"{_max_distance(losses, cpu_losses):.3g}"),
                "params": float(f"{_max_distance(params, cpu_params):.3g}")}
        if amplifies and dtype is torch.float64:
            rtol, atol, label = FLOAT64_RTOL, {"loss": FLOAT64_ATOL, "params": FLOAT64_ATOL}, "float64: "
        elif amplifies:
            (exact_losses, exact_params), (nudged_losses, nudged_params) = runs[torch.float64][1], nudged
            spread = {"loss": max(_max_distance(cpu_losses, exact_losses), _max_distance(cpu_losses, nudged_losses)),
                      "params": max(_max_distance(cpu_params, exact_params), _max_distance(cpu_params, nudged_params))}
            out["float32_spread"] = {k: float(f"{v:.3g}") for k, v in spread.items()}
            atol = {k: ATOL + SPREAD_FACTOR * v for k, v in spread.items()}
            label = "float32, beyond {:g}x CPU's own float32 spread: ".format(SPREAD_FACTOR)
        bad = next((i for i, (a, b) in enumerate(zip(losses, cpu_losses))
                    if not _close(a, b, (rtol, atol["loss"]))), None)
        stage = "loss" if bad is not None else "params"
        a, b = (losses, cpu_losses) if bad is not None else (params, cpu_params)
        try:
            torch.testing.assert_close(a, b, rtol=rtol, atol=atol[stage])
        except AssertionError as e:
            out.update(status="fail", stage=stage, error=label + _mismatch_message(e), first_bad_step=bad,
                       losses=[float(f"{float(x):.7g}") for x in losses],
                       cpu_losses=[float(f"{float(x):.7g}") for x in cpu_losses])
            return out
    return out


def _max_distance(a, b) -> float:
    """The largest absolute difference between two lists of tensors, in float64."""
    return max((x.double() - y.double()).abs().max().item() for x, y in zip(a, b))


# --------------------------------------------------------------------------- #
# the three sweeps
# --------------------------------------------------------------------------- #

class Sweep:
    """One database swept against CPU: its entries, the phases of an entry, its checker, its file."""

    def __init__(self, name, entries, phases, check, expectations, all_phases, timeout):
        self.name, self.entries, self.phases, self.check = name, entries, phases, check
        self.expectations, self.all_phases, self.timeout = expectations, all_phases, timeout


def ops_sweep_name(dtype="float32", nonfinite=False):
    """The SWEEPS key of the op sweep in `dtype`, with NaN and infinities put in where `nonfinite`."""
    return "ops" + ("" if dtype == "float32" else "-" + dtype) + ("-nonfinite" if nonfinite else "")


def _ops_sweep(dtype, nonfinite):
    """The op sweep in `dtype` (with NaN and infinities put in where `nonfinite`) and its file:
    float32's is conformance_expectations.json, the others' conformance_ops_<dtype>[_nonfinite].json."""
    name = ops_sweep_name(dtype, nonfinite)
    path = EXPECTATIONS if name == "ops" else \
        os.path.join(ROOT, "tests", f"conformance_ops_{dtype}{'_nonfinite' if nonfinite else ''}.json")
    return Sweep(name, lambda names=None: entries(names, dtype), lambda op: op_phases(op, dtype),
                 lambda op, phase, **kw: check_entry(op, phase, dtype=dtype, nonfinite=nonfinite, **kw),
                 path, PHASES, 120.0)


SWEEPS = {
    **{ops_sweep_name(dt, nf): _ops_sweep(dt, nf) for dt in OP_DTYPES for nf in (False, True)},
    # Transformer entries spend a minute finding the node that fails to compile (masked_fill),
    # LBFGS a score of small programs in each of its two dtypes, on a machine other sweeps share:
    # a timeout there would hide what they compute.
    "modules": Sweep("modules", module_entries, module_phases, check_module, MODULE_EXPECTATIONS, MODULE_PHASES,
                     300.0),
    "optims": Sweep("optims", optim_entries, optim_phases, check_optim, OPTIM_EXPECTATIONS, OPTIM_PHASES, 600.0),
}


# --------------------------------------------------------------------------- #
# worker processes
# --------------------------------------------------------------------------- #

def _worker_main(conn, max_samples, sweep="ops"):
    os.environ.setdefault("RATEX_CACHE_DIR", "")
    warnings.simplefilter("ignore")
    import torch

    torch.set_num_threads(1)
    import ratex  # noqa: F401
    sweep = SWEEPS[sweep]
    all_entries = sweep.entries()
    conn.send(("ready", None))
    while True:
        try:
            msg = conn.recv()
        except EOFError:
            return
        if msg is None:
            return
        key, phase = msg
        t0 = time.time()
        try:
            res = sweep.check(all_entries[key], phase, max_samples=max_samples)
        except BaseException as e:  # noqa: BLE001
            res = {"status": "fail", "error": "harness: " + _short(e)}
        res["seconds"] = round(time.time() - t0, 2)
        conn.send(("done", res))


class _Worker:
    def __init__(self, ctx, max_samples, sweep):
        self.parent, child = ctx.Pipe()
        self.proc = ctx.Process(target=_worker_main, args=(child, max_samples, sweep), daemon=True)
        self.proc.start()
        child.close()
        self.ready = False
        self.task = None
        self.started = None
        self.done = 0

    def kill(self):
        if self.proc.is_alive():
            self.proc.kill()
        self.proc.join(5)
        self.parent.close()

    def rss_gb(self):
        try:
            with open(f"/proc/{self.proc.pid}/status") as f:
                for line in f:
                    if line.startswith("VmRSS:"):
                        return int(line.split()[1]) / 2**20
        except OSError:
            pass
        return 0.0


def run_all(tasks, workers=2, max_samples=DEFAULT_MAX_SAMPLES, timeout=120.0, max_tasks=25,
            max_rss_gb=6.0, on_result=None, startup_timeout=180.0, sweep="ops"):
    """Run (key, phase) tasks of a sweep in worker subprocesses; return {(key, phase): result}."""
    import multiprocessing as mp

    ctx = mp.get_context("spawn")
    env_backup = {k: os.environ.get(k) for k in ("OMP_NUM_THREADS", "TVM_NUM_THREADS", "MKL_NUM_THREADS")}
    for k in env_backup:
        os.environ[k] = "1"
    pending = collections.deque(tasks)
    results = {}
    pool = []
    try:
        while pending or any(w.task for w in pool):
            # keep the pool full
            pool = [w for w in pool if w.proc.is_alive() or w.task]
            while len(pool) < workers and pending:
                w = _Worker(ctx, max_samples, sweep)
                w.started = time.time()
                pool.append(w)
            progressed = False
            for w in list(pool):
                now = time.time()
                if not w.ready:
                    if w.parent.poll():
                        try:
                            w.parent.recv()
                            w.ready = True
                        except EOFError:
                            w.kill()
                            pool.remove(w)
                            continue
                    elif not w.proc.is_alive() or now - w.started > startup_timeout:
                        w.kill()
                        pool.remove(w)
                        raise RuntimeError("a conformance worker failed to start")
                    else:
                        continue
                if w.task is None:
                    if not pending or w.done >= max_tasks:
                        w.parent.send(None)
                        w.kill()
                        pool.remove(w)
                        continue
                    w.task = pending.popleft()
                    w.started = now
                    w.parent.send(w.task)
                    progressed = True
                    continue
                res = None
                if w.parent.poll():
                    try:
                        _, res = w.parent.recv()
                    except (EOFError, OSError):
                        res = None
                if res is None:
                    if not w.proc.is_alive():
                        code = w.proc.exitcode
                        res = {"status": "fail",
                               "error": f"crash: worker died (exit code {code}"
                                        f"{', signal ' + str(-code) if code and code < 0 else ''})"}
                    elif now - w.started > timeout:
                        res = {"status": "fail", "error": f"timeout: more than {timeout:.0f} s"}
                    elif w.rss_gb() > max_rss_gb:
                        res = {"status": "fail", "error": f"memory: worker over {max_rss_gb} GB"}
                    if res is None:
                        continue
                    res["seconds"] = round(now - w.started, 2)
                    w.kill()
                    pool.remove(w)
                results[w.task] = res
                if on_result:
                    on_result(w.task, res)
                w.task = None
                w.done += 1
                progressed = True
            if not progressed:
                time.sleep(0.05)
    finally:
        for w in pool:
            w.kill()
        for k, v in env_backup.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
    return results


# --------------------------------------------------------------------------- #
# reporting
# --------------------------------------------------------------------------- #

def figures(table, phases=PHASES):
    """table: {phase: {key: status}} -> per phase, counts and percentages over non-skipped entries."""
    out = {}
    for phase in phases:
        st = [s for s in table.get(phase, {}).values() if s != "skip"]
        n = len(st) or 1
        c = collections.Counter(st)
        out[phase] = {"entries": len(st), "pass": c["pass"], "fallback": c["fallback"], "fail": c["fail"],
                      "skip": sum(1 for s in table.get(phase, {}).values() if s == "skip"),
                      "matching_pct": 100.0 * (c["pass"] + c["fallback"]) / n,
                      "lowered_pct": 100.0 * c["pass"] / n}
    return out


def _group_key(msg):
    msg = re.sub(r"0x[0-9a-f]+", "0x?", msg or "")
    msg = re.sub(r"\d+", "N", msg)
    msg = re.sub(r"'[^']*'", "'?'", msg) if msg.startswith("mismatch") else msg
    return msg[:90]


def print_report(table, details, top=20, phases=PHASES):
    fig = figures(table, phases)
    print()
    for phase in phases:
        f = fig[phase]
        print(f"{phase:8s}: {f['entries']} entries ({f['skip']} skipped): pass {f['pass']}, "
              f"fallback {f['fallback']}, fail {f['fail']}")
    print()
    for phase in phases:
        print(f"{phase:8s} matching (fallback allowed): {fig[phase]['matching_pct']:5.1f} %")
    for phase in phases:
        print(f"{phase:8s} lowered, no fallback:        {fig[phase]['lowered_pct']:5.1f} %")
    for phase in phases:
        groups = collections.defaultdict(list)
        for key, res in details.get(phase, {}).items():
            if res.get("status") == "fail":
                where = f"[{res['stage']}] " if res.get("stage") else ""
                groups[where + _group_key(res.get("error", ""))].append(key)
        if not groups:
            continue
        print(f"\ntop {phase} failure causes:")
        for msg, keys in sorted(groups.items(), key=lambda kv: -len(kv[1]))[:top]:
            ex = ", ".join(sorted(keys)[:6]) + (", ..." if len(keys) > 6 else "")
            print(f"  {len(keys):4d}  {msg}\n        {ex}")
    for phase in phases:
        fb = collections.Counter()
        for res in details.get(phase, {}).values():
            if res.get("status") == "fallback":
                fb.update(res.get("fallbacks", []))
        if fb:
            print(f"\nmost common {phase} fallbacks (entries): "
                  + ", ".join(f"{k} {v}" for k, v in fb.most_common(15)))
    for phase in phases:
        wide = sorted(k for k, r in details.get(phase, {}).items() if r.get("float64_reference") and r["status"] != "fail")
        if wide:
            print(f"\n{phase}: {len(wide)} entries miss CPU's rounding in some sample but match its float64 result: "
                  + ", ".join(wide[:20]) + (", ..." if len(wide) > 20 else ""))
    slow = sorted(((res.get("seconds", 0), phase, key) for phase in phases
                   for key, res in details.get(phase, {}).items()), reverse=True)[:10]
    if slow:
        print("\nslowest: " + ", ".join(f"{phase} {key} {sec:.0f} s" for sec, phase, key in slow))


def expectation(res):
    """What a module or optimizer expectations file records of a result: the status; a fallback's
    counters; a failure's stage and message; why an entry was skipped."""
    rec = {"status": res["status"]}
    if res["status"] == "fallback":
        rec["fallbacks"] = res.get("fallbacks", [])
    elif res["status"] == "fail":
        rec["stage"] = res.get("stage", "")
        rec["error"] = res.get("error", "")
    elif res["status"] == "skip":
        rec["reason"] = res.get("skip_reason") or res.get("cpu_error", "")
    return rec


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--ops", help="comma-separated entry keys or op names (default: all float32 entries)")
    p.add_argument("--modules", nargs="?", const="", metavar="NAMES",
                   help="sweep module_db instead (all entries, or these comma-separated names: nn.LSTM,...)")
    p.add_argument("--optims", nargs="?", const="", metavar="NAMES",
                   help="sweep optim_db instead (all configs, or these optimizers or Optimizer/config keys)")
    p.add_argument("--dtype", default="float32", choices=OP_DTYPES,
                   help="ops: sweep the entries CPU PyTorch runs in this dtype, in it (default %(default)s)")
    p.add_argument("--nonfinite", action="store_true",
                   help="ops: put NaN, +inf and -inf into every float sample tensor first")
    p.add_argument("--phase", default="all",
                   help="one phase of the sweep (ops: forward, backward; modules: train, eval; "
                        "optims: forloop, foreach) or all (default)")
    p.add_argument("--max-samples", type=int, default=DEFAULT_MAX_SAMPLES,
                   help="samples tried per entry and direction, 0 = all (default %(default)s)")
    p.add_argument("--workers", type=int, default=2)
    p.add_argument("--timeout", type=float,
                   help="seconds per entry and phase (default: ops 120, modules 300, optims 600)")
    p.add_argument("--max-tasks", type=int, default=25, help="tasks per worker before it is replaced")
    p.add_argument("--max-rss-gb", type=float, default=6.0)
    p.add_argument("--write", action="store_true", help="write the sweep's expectations file under tests/"
                   " (merged into the existing file when names are given)")
    p.add_argument("--expectations", help="the expectations file to write instead")
    p.add_argument("--details", help="write per-entry results (errors, fallback counters, times) here")
    p.add_argument("--verbose", "-v", action="store_true", help="print each result as it comes")
    p.add_argument("--from-details", metavar="PATH",
                   help="run nothing: report on (and with --write, record) a --details file of an earlier run")
    a = p.parse_args(argv)
    if a.modules is not None and a.optims is not None:
        p.error("--modules and --optims are two sweeps: run one at a time")
    if (a.modules is not None or a.optims is not None) and (a.dtype != "float32" or a.nonfinite):
        p.error("--dtype and --nonfinite are options of the ops sweep")
    sweep, chosen = ((SWEEPS["modules"], a.modules) if a.modules is not None else
                     (SWEEPS["optims"], a.optims) if a.optims is not None else
                     (SWEEPS[ops_sweep_name(a.dtype, a.nonfinite)], a.ops))
    if a.phase in ("all", "both"):
        phases = sweep.all_phases
    elif a.phase in sweep.all_phases:
        phases = (a.phase,)
    else:
        p.error(f"--phase {a.phase!r}: the {sweep.name} sweep has phases {', '.join(sweep.all_phases)} (or all)")
    expectations = a.expectations or sweep.expectations

    if a.from_details:
        with open(a.from_details) as f:
            details = json.load(f)
        table = {ph: {k: r["status"] for k, r in sorted(details.get(ph, {}).items())} for ph in sweep.all_phases}
        print_report(table, details, phases=sweep.all_phases)
        if a.write:
            _write(expectations, details, None, sweep)
        return 0

    os.environ.setdefault("RATEX_CACHE_DIR", "")
    warnings.simplefilter("ignore")
    # `kill` must reach run_all's cleanup too, or the workers outlive the sweep.
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    names = set(chosen.split(",")) if chosen else None
    ents = sweep.entries(names)
    if names:
        found = set(ents) | {getattr(e, "name", None) for e in ents.values()} | \
            {k.split("/")[0] for k in ents}
        missing = [n for n in names if n not in found]
        if missing:
            print(f"no {sweep.name} entry named:", ", ".join(sorted(missing)), file=sys.stderr)
    tasks = [(key, phase) for key, e in ents.items() for phase in sweep.phases(e) if phase in phases]
    print(f"{len(ents)} entries, {len(tasks)} tasks, {a.workers} workers", flush=True)

    details = {ph: {} for ph in sweep.all_phases}
    t0 = time.time()
    count = [0]

    def on_result(task, res):
        key, phase = task
        details[phase][key] = res
        count[0] += 1
        if a.verbose:
            extra = ((f"[{res['stage']}] " if res.get("stage") else "") + res["error"] if res.get("error")
                     else ", ".join(res.get("fallbacks", [])))
            print(f"[{count[0]}/{len(tasks)} {time.time() - t0:6.0f}s] {phase:8s} {key:45s} "
                  f"{res['status']:8s} {res.get('seconds', 0):6.1f}s  {extra[:150]}", flush=True)
        elif count[0] % 50 == 0:
            print(f"  {count[0]}/{len(tasks)} done, {time.time() - t0:.0f} s", flush=True)
        if a.details and count[0] % 10 == 0:
            _dump(a.details, details)

    run_all(tasks, workers=a.workers, max_samples=a.max_samples, timeout=a.timeout or sweep.timeout,
            max_tasks=a.max_tasks, max_rss_gb=a.max_rss_gb, on_result=on_result, sweep=sweep.name)
    table = {ph: {k: details[ph][k]["status"] for k in sorted(details[ph])} for ph in sweep.all_phases}
    print(f"done in {time.time() - t0:.0f} s")
    print_report(table, details, phases=sweep.all_phases)

    if a.details:
        _dump(a.details, details)
    if a.write:
        _write(expectations, details, names, sweep)
    return 0


def _write(path, details, names, sweep):
    """Write the expectations file; with a subset of `names`, merge into the existing one.

    The OpInfo file records a status per entry; the module and optimizer files record
    `expectation(result)`, so a failure's stage and message are in the file.
    """
    old = {}
    if names and os.path.exists(path):
        with open(path) as f:
            old = json.load(f)
    out = {}
    for ph in sweep.all_phases:
        merged = dict(old.get(ph, {}))
        for key, res in details.get(ph, {}).items():
            merged[key] = res["status"] if sweep.name.startswith("ops") else expectation(res)
        out[ph] = dict(sorted(merged.items()))
    with open(path, "w") as f:
        json.dump(out, f, indent=1, sort_keys=True)
        f.write("\n")
    print(f"wrote {path}")


def _dump(path, details):
    with open(path, "w") as f:
        json.dump(details, f, indent=1, sort_keys=True)


if __name__ == "__main__":
    sys.exit(main())
