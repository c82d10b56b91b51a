"""Data-parallel training on the lazy device through torch.distributed.

Collectives run on computed data, between programs: a step with gradient
averaging is two programs, forward+backward, then the optimizer update, with
the gradients all-reduced in between (see docs/design.md, "Distributed"). A
collective inside a compiled program would have to call back into Python from
the program's worker thread while the tracing thread holds the GIL, and a rank
failing mid-program could not be told from a slow one; the cut keeps every
collective on the tracing thread, in program order on every rank.

The process group is torch.distributed's (gloo for CPU data, NCCL for CUDA data
where RATEX_DEVICE=GPU); ratex brings no transport of its own. The c10d ops
(`torch.distributed.all_reduce(lazy_tensor)`, ...) reach ratex's tracer like any
ATen op; the handler below runs them the same way, on computed data.
"""
import os

import torch
import torch.distributed as dist
from torch.utils._pytree import tree_flatten, tree_map

from . import config
from .core import metrics, sync
from .core.device import backend, stored_dtype
from .core.ir import Meta, Node
from .core.tensor import LazyTensor, is_lazy
from .core.tracing.registry import HANDLER, register

REDUCE_SUM, REDUCE_MUL, REDUCE_MIN, REDUCE_MAX = "sum", "mul", "min", "max"
REDUCE_AND, REDUCE_OR = "and", "or"
# Builds of torch without distributed support (some macOS and Windows wheels) have no ReduceOp:
# `import ratex` still works there, and the collectives say why they cannot run.
_REDUCE_OPS = {
    REDUCE_SUM: "SUM", REDUCE_MUL: "PRODUCT", REDUCE_MIN: "MIN", REDUCE_MAX: "MAX", REDUCE_AND: "BAND", REDUCE_OR: "BOR",
}
# Gradients travel in flat buckets of at most this many bytes, as DDP's buckets do: one
# collective per bucket, and a bucket's copy in and out stays small next to the step's memory.
BUCKET_BYTES = 25 * 1024 * 1024


# ---- the process group ----------------------------------------------------------------------
def is_distributed() -> bool:
    """Return whether a torch.distributed process group with more than one rank is running."""
    return dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1


def world_size() -> int:
    """Return the number of ranks of the default process group (1 where none is initialized)."""
    return dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1


def rank() -> int:
    """Return this process's rank in the default process group (0 where none is initialized)."""
    return dist.get_rank() if dist.is_available() and dist.is_initialized() else 0


def _require_group(what: str):
    if not dist.is_available():
        raise RuntimeError(f"{what} needs torch.distributed, which this build of torch {torch.__version__} lacks")
    if not dist.is_initialized():
        raise RuntimeError(
            f"{what} needs torch.distributed's default process group; call "
            "torch.distributed.init_process_group('gloo') first (torchrun sets the environment it reads)"
        )


def _single_process(what: str) -> bool:
    """Whether `what` runs in a world of one; a process torchrun started with no process group raises."""
    if dist.is_available() and dist.is_initialized():
        return dist.get_world_size() == 1
    if int(os.environ.get("WORLD_SIZE", "1")) > 1:
        _require_group(what)  # raises: several ranks were launched, but this one would train alone
    return True


_subgroups = {}  # tuple of rank tuples -> this rank's ProcessGroup


def _group(groups):
    """The ProcessGroup `groups` names: None (the default group), a ProcessGroup, or a list of
    rank lists partitioning the world (every rank must call with the same lists)."""
    if groups is None or isinstance(groups, dist.ProcessGroup):
        return groups
    try:
        key = tuple(tuple(int(r) for r in g) for g in groups)
    except TypeError:
        raise TypeError(f"groups={groups!r}: expected None, a ProcessGroup, or a list of lists of ranks") from None
    ranks = sorted(r for g in key for r in g)
    if ranks != list(range(dist.get_world_size())):
        raise ValueError(f"groups={groups!r} must name every rank of 0..{dist.get_world_size() - 1} exactly once")
    if key not in _subgroups:
        _subgroups[key], _ = dist.new_subgroups_by_enumeration([list(g) for g in key])
    return _subgroups[key]


def _reduce_op(reduce_type):
    name = _REDUCE_OPS.get(reduce_type) if isinstance(reduce_type, str) else None
    if name is None:
        raise ValueError(f"reduce_type={reduce_type!r} is not valid; use one of {sorted(_REDUCE_OPS)}")
    return getattr(dist.ReduceOp, name)


# ---- computed data, as torch tensors for the collective ------------------------------------
def _on_cuda() -> bool:
    """Whether collectives take CUDA tensors: NCCL, with the GPU target's data in torch's CUDA memory."""
    return config.DEVICE != "CPU" and dist.get_backend() == "nccl"


def _check_lazy(tensors, what: str):
    for t in tensors:
        if not is_lazy(t):
            raise TypeError(f"{what} takes lazy tensors; got a tensor on {t.device} (move it with .to('lazy'))")


def _materialize(tensors):
    """Compute everything pending (one program: what the step traced so far), then the values of
    `tensors` that are views of what it computed (a transposed weight's gradient), in one more."""
    values = [t._value() for t in tensors]
    if any(node.results[idx] is None for node, idx in values):
        sync.mark_step()
        views = [v for v in (t._value() for t in tensors) if v[0].results[v[1]] is None]
        if views:
            sync.execute(views)


def _comm_copy(t: LazyTensor, cuda: bool) -> torch.Tensor:
    """A torch tensor of `t`'s dtype holding its computed value, which a collective may overwrite
    (collectives run in the dtype the user sees, also where the device stores float32 as bfloat16)."""
    data = t._device_data()
    if cuda:
        return torch.from_dlpack(data).to(t.dtype, copy=True)
    return backend().download(data, t.dtype)


def _device_data(comm: torch.Tensor):
    if comm.is_cuda:  # the GPU target's device data are torch CUDA tensors (device.DLPackBackend)
        return comm.to(stored_dtype(comm.dtype)).contiguous()
    return backend().adopt(comm)


def _set(t: LazyTensor, comm: torch.Tensor):
    """Make the torch tensor `comm` the computed value of `t` (seen by all its views)."""
    t._write((Node.leaf(_device_data(comm), Meta(tuple(comm.shape), comm.dtype)), 0))


def _new(comm: torch.Tensor) -> LazyTensor:
    return LazyTensor.from_value((Node.leaf(_device_data(comm), Meta(tuple(comm.shape), comm.dtype)), 0))


def _timed_collective(fn, nbytes: int, what: str):
    """fn(), counted and timed; a failure names the collective, the rank and the usual cause."""
    metrics.counter_inc("CollectiveCall")
    metrics.counter_inc("CollectiveBytes", nbytes)
    with metrics.timed("CollectiveTime"):
        try:
            return fn()
        except RuntimeError as err:  # torch.distributed's DistError is one
            raise RuntimeError(
                f"ratex: {what} ({nbytes} bytes) failed on rank {dist.get_rank()} of {dist.get_world_size()} "
                f"({type(err).__name__}: {err}); where the error names a peer or a timeout, another rank failed "
                "or stopped calling collectives: its own error is the one to read"
            ) from err


# ---- the collectives -----------------------------------------------------------------------
def all_reduce(reduce_type, inputs, scale=1.0, groups=None):
    """Return `inputs` reduced across ranks and multiplied by `scale`: a new tensor for one tensor;
    for a list, its tensors are reduced in place (flat, one collective per bucket) and the list returned."""
    _require_group("all_reduce")
    op, group = _reduce_op(reduce_type), _group(groups)
    single = isinstance(inputs, torch.Tensor)
    tensors = [inputs] if single else list(inputs)
    _check_lazy(tensors, "all_reduce")
    _materialize(tensors)
    cuda = _on_cuda()
    results = []
    for bucket in _buckets(tensors):
        flat = _flat(bucket, cuda)
        _timed_collective(lambda: dist.all_reduce(flat, op=op, group=group), flat.numel() * flat.element_size(),
                          "all_reduce")
        if scale != 1.0:
            flat.mul_(scale)
        results.extend(zip(bucket, _unflat(flat, bucket)))
    if single:
        return _new(results[0][1])
    for t, comm in results:
        _set(t, comm)
    return inputs


def all_gather(value, dim=0, groups=None):
    """Return the concatenation along `dim` of `value` from every rank, in rank order."""
    _require_group("all_gather")
    _check_lazy([value], "all_gather")
    group = _group(groups)
    dim = dim + value.dim() if dim < 0 else dim
    if not 0 <= dim < max(value.dim(), 1):
        raise ValueError(f"dim={dim} is out of range for a {value.dim()}-d tensor")
    _materialize([value])
    comm = _comm_copy(value, _on_cuda())
    parts = [torch.empty_like(comm) for _ in range(dist.get_world_size(group))]
    _timed_collective(lambda: dist.all_gather(parts, comm, group=group), comm.numel() * comm.element_size(),
                      "all_gather")
    return _new(torch.cat(parts, dim) if comm.dim() else torch.stack(parts))


def reduce_scatter(reduce_type, input, scale=1.0, scatter_dim=0, shard_count=None, groups=None):
    """Return this rank's shard (along `scatter_dim`) of `input` reduced across ranks, times `scale`."""
    _require_group("reduce_scatter")
    _check_lazy([input], "reduce_scatter")
    op, group = _reduce_op(reduce_type), _group(groups)
    count = dist.get_world_size(group)
    if shard_count is not None and shard_count != count:
        raise ValueError(f"shard_count={shard_count} must equal the group's size, {count}")
    dim = scatter_dim + input.dim() if scatter_dim < 0 else scatter_dim
    if not 0 <= dim < input.dim() or input.shape[dim] % count:
        raise ValueError(
            f"scatter_dim={scatter_dim}: input of shape {tuple(input.shape)} must have a dimension there "
            f"divisible by the group's size, {count}"
        )
    _materialize([input])
    comm = _comm_copy(input, _on_cuda())
    whole = comm.movedim(dim, 0).contiguous()
    out = torch.empty((whole.shape[0] // count,) + tuple(whole.shape[1:]), dtype=whole.dtype, device=whole.device)
    _timed_collective(lambda: dist.reduce_scatter_tensor(out, whole, op=op, group=group),
                      whole.numel() * whole.element_size(), "reduce_scatter")
    if scale != 1.0:
        out.mul_(scale)
    return _new(out.movedim(0, dim).contiguous())


def _buckets(tensors):
    """Split `tensors` into lists of one dtype of at most BUCKET_BYTES each (a larger tensor alone)."""
    open_, out = {}, []
    for t in tensors:
        nbytes = t.numel() * t.element_size()
        bucket = open_.get(t.dtype)
        if bucket is None or bucket[1] + nbytes > BUCKET_BYTES:
            bucket = open_[t.dtype] = [[], 0]
            out.append(bucket[0])
        bucket[0].append(t)
        bucket[1] += nbytes
    return out


def _flat(bucket, cuda: bool) -> torch.Tensor:
    data = [t._device_data() for t in bucket]
    if cuda:
        views = [torch.from_dlpack(d).to(t.dtype) for d, t in zip(data, bucket)]
    else:
        views = [backend().view_cpu(d, t.dtype) for d, t in zip(data, bucket)]
    return torch.cat([v.reshape(-1) for v in views])


def _unflat(flat: torch.Tensor, bucket) -> list:
    """One tensor per bucket entry, each with a buffer of its own (device data is never a view)."""
    return [piece.view(t.shape).clone() for piece, t in zip(flat.split([t.numel() for t in bucket]), bucket)]


# ---- gradients and the optimizer step ------------------------------------------------------
def _grads(optimizer) -> list:
    grads = [p.grad for group in optimizer.param_groups for p in group["params"] if p.grad is not None]
    for g in grads:
        if g.is_sparse:
            raise TypeError("reduce_gradients: sparse gradients are not supported; use dense embeddings")
    _check_lazy(grads, "reduce_gradients (the optimizer's gradients)")
    return grads


def reduce_gradients(optimizer, groups=None):
    """Average the gradients of `optimizer`'s parameters across ranks, in place; return None.

    Computes what the step traced so far (one program: forward and backward), then
    all-reduces the gradients in flat buckets. In a world of one it does nothing.
    """
    if _single_process("reduce_gradients"):
        return
    grads = _grads(optimizer)
    if grads:
        all_reduce(REDUCE_SUM, grads, scale=1.0 / dist.get_world_size(_group(groups)), groups=groups)


# ---- torch.distributed's own calls on lazy tensors -----------------------------------------
def _c10d(func, args, kwargs):
    """Run a c10d collective whose tensors are lazy on copies of their computed values, wait for it,
    and write the copies back into the lazy tensors; return its result with the lazy tensors."""
    lazies = list({id(t): t for t in tree_flatten((args, kwargs))[0] if is_lazy(t)}.values())
    _materialize(lazies)
    cuda = _on_cuda()
    comm = {id(t): _comm_copy(t, cuda) for t in lazies}
    back = {id(c): t for t, c in zip(lazies, comm.values())}
    swap = lambda x: comm[id(x)] if is_lazy(x) else x  # noqa: E731
    nbytes = sum(c.numel() * c.element_size() for c in comm.values())
    out = _timed_collective(lambda: _run_and_wait(func, tree_map(swap, args), tree_map(swap, kwargs)), nbytes, str(func))
    # c10d schemas mark no argument as written (allgather_ writes its outputs, recv_ its only
    # tensors), so every lazy tensor takes the value its copy holds now: unchanged ones keep theirs.
    for t in lazies:
        _set(t, comm[id(t)])
    return tree_map(lambda x: back.get(id(x), x) if isinstance(x, torch.Tensor) else x, out)


def _run_and_wait(func, args, kwargs):
    out = func(*args, **kwargs)
    for item in tree_flatten(out)[0]:
        if hasattr(item, "wait") and not isinstance(item, torch.Tensor):
            item.wait()  # the lazy tensors must hold the result before anything reads them
    return out


def _c10d_ops():
    """Every c10d op overload that takes tensors."""
    ops = []
    for name in torch._C._dispatch_get_all_op_names():
        if not name.startswith("c10d::"):
            continue
        base, _, overload = name[len("c10d::"):].partition(".")
        packet = getattr(torch.ops.c10d, base, None)
        op = getattr(packet, overload or "default", None) if packet is not None else None
        if op is not None and any("Tensor" in str(a.type) for a in op._schema.arguments):
            ops.append(op)
    return ops


register(*_c10d_ops(), tier=HANDLER)(_c10d)

__all__ = [
    "REDUCE_SUM", "REDUCE_MUL", "REDUCE_MIN", "REDUCE_MAX", "REDUCE_AND", "REDUCE_OR", "BUCKET_BYTES",
    "all_reduce", "all_gather", "reduce_scatter", "reduce_gradients",
    "is_distributed", "world_size", "rank",
]
