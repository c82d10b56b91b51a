"""A script's forward as an fx graph of ATen ops, built call by call, and the `Script` it converts to.

Two producers build forwards here: the TorchScript converter (torchscript.py) and the
torch.export converter (exported.py). `Builder`
gives them one graph shape, the one `Script` promises: placeholders in the order inputs,
attributes (parameters and buffers, by dotted path), constants, dropout keep-masks; outputs
the model's own, then the new values of the buffers the forward writes. Each call gets its
`meta["val"]` from running the op on meta tensors, as `import_graph` checks rules against it.

`Builder.call` also rewrites what Relax's Gradient cannot differentiate as written:
- training dropout becomes `x * keep * 1/(1-p)` with `keep` a new bool input, which the caller
  draws with the lazy device's own dropout ops (so a scripted model draws the masks the
  unscripted one does, and the random bits stay outside the differentiated function);
- scaled_dot_product_attention with a mask or dropout becomes matmul, softmax, matmul, the
  way PyTorch's math kernel computes it (a fully masked row gives 0, not NaN);
  grouped-query attention (enable_gqa) repeats each key/value head for its query heads first;
- repeat_interleave with an int count is unsqueeze, expand and reshape;
- an op with no lowering rule is recorded as PyTorch's decomposition of it (torch._decomp's, else
  its CompositeImplicitAutograd kernel: aliases such as aten::multiply, unfold's im2col), the ops
  the lazy device records for it;
- `aten::to` is a cast or nothing (a program's tensors share one device);
- export's functional writes through views: `fill.Tensor` and `copy` are the value broadcast
  to the shape, `select_scatter` and `slice_scatter` the slices around the source, concatenated;
- LSTM, GRU and RNN calls are unrolled over their (static) time steps into the cell's ATen ops.
"""
import operator
import threading

import torch
import torch._decomp
import tvm
from torch import fx
from torch.utils import _pytree as pytree
from tvm import relax

from . import autodiff
from .importer import has_rule, import_graph
from .ops import SCRIPT_RULES
from .ops.bounds import SITE

aten = torch.ops.aten


class ConversionError(RuntimeError):
    """The captured graph uses something the converter cannot express."""


class Script:
    """A converted forward, its metas, and its (lazily built) backward."""

    def __init__(self, fwd, n_inputs, attr_paths, consts, dropouts, out_metas, out_spec, writes, diff, graph=None,
                 checks=(), sites=None):
        self.fwd = fwd  # relax.Function
        self.graph = graph  # the fx graph fwd was lowered from: the same computation in ATen ops
        self.n_inputs = n_inputs
        self.attr_paths = attr_paths  # module attribute path of each attr input, in order
        self.consts = consts  # CPU tensors baked into the graph, passed after the attrs
        self.dropouts = dropouts  # [(shape, p)] of the training dropouts, whose keep masks are the last inputs
        self.out_metas = out_metas  # [(shape, dtype)] of the flat outputs, new buffers included
        self.out_spec = out_spec  # pytree spec rebuilding the graph's output structure
        self.writes = writes  # attr paths of the buffers the forward writes: the last outputs
        self.n_outs = len(out_metas) - len(writes)  # the model's own outputs
        self.diff = diff  # indices (into inputs+attrs+consts) that get gradients
        self.checks = list(checks)  # headers of the index checks in fwd's last output (ops/bounds.py)
        self.sites = sites or {}  # site of a check -> (the captured op, its source: TorchScript's range or a stack)
        self._bwd = None
        self._lock = threading.Lock()

    @property
    def bwd(self):
        """relax.Function: (inputs..., attrs..., consts..., masks..., grad_outs...) -> (loss, (grads...)).

        grad_outs are those of the model's own outputs; new buffer values get none.
        """
        with self._lock:
            if self._bwd is None:
                self._bwd = autodiff.vjp(self.fwd, self.diff, self.n_outs)
            return self._bwd


_DROPOUTS = {
    aten.dropout.default, aten.native_dropout.default, aten.feature_dropout.default,
    aten.alpha_dropout.default, aten.feature_alpha_dropout.default,
}
_MASKED_DROPOUTS = {aten.dropout.default, aten.native_dropout.default}  # elementwise masks
_RNNS = {aten.lstm.input, aten.gru.input, aten.rnn_tanh.input, aten.rnn_relu.input}


def _meta(shape, dtype):
    return torch.empty(tuple(shape), dtype=dtype, device="meta")


def _val(x):
    return x.meta["val"] if isinstance(x, fx.Node) else x


# Decompositions that compute something else than their ATen op (ratex/core/tracing/torch_decomp.py
# runs these eagerly on the lazy device): a script refuses them.
_WRONG_DECOMPOSITIONS = frozenset((aten.multilabel_margin_loss_forward.default,))


def _decomposition(op):
    """PyTorch's decomposition of `op` where it has no lowering rule (None where it has one, or no
    decomposition): torch._decomp's, else its CompositeImplicitAutograd kernel (an alias such as
    aten::multiply, which only a captured graph holds). The lazy device records the same ops."""
    name = op.__name__
    if op in (aten.size.int, aten.size.default) or name in SCRIPT_RULES or has_rule(name):
        return None
    if torch.Tag.nondeterministic_seeded in op.tags or op in _WRONG_DECOMPOSITIONS:
        return None
    found = torch._decomp.decomposition_table.get(op)
    if found is None and op.has_kernel_for_dispatch_key(torch._C.DispatchKey.CompositeImplicitAutograd):
        found = op.decompose
    return found


def bind(op, args, kwargs) -> dict:
    """{argument name: value} of a call of `op`, defaults filled in."""
    out = {}
    for i, a in enumerate(op._schema.arguments):
        if i < len(args):
            out[a.name] = args[i]
        elif a.name in kwargs:
            out[a.name] = kwargs[a.name]
        elif a.has_default_value():
            out[a.name] = a.default_value
    return out


def _tir_kernels(fn) -> list:
    """Names of the PrimFuncs that Relax function `fn` calls with call_tir."""
    call_tir = tvm.ir.Op.get("relax.call_tir")
    names = []

    def visit(expr):
        if isinstance(expr, relax.Call) and expr.op.same_as(call_tir):
            names.append(expr.args[0].name_hint)

    relax.analysis.post_order_visit(fn.body, visit)
    return sorted(set(names))


class Builder:
    """An fx graph under construction in `Script` form (see the module doc)."""

    def __init__(self):
        self.g = fx.Graph()
        self._last_ph = None
        self.inputs = []
        self.attr_paths, self.attr_nodes = [], {}
        self.consts, self.const_nodes = [], {}
        self.masks, self.dropouts = [], []  # keep-mask placeholders; (shape, p) of each
        self.writes = {}  # attr path -> fx node of the value the forward wrote there
        # (op name, source) of the captured node being converted, set by the converter; that of each call
        self.origin, self.origins = ("an indexing op", ""), []

    # ---- placeholders ---------------------------------------------------------------
    def _placeholder(self, name, val):
        if self._last_ph is not None:
            ctx = self.g.inserting_after(self._last_ph)  # placeholders stay in front, in creation order
        else:
            ctx = self.g.inserting_before(next(iter(self.g.nodes), None))
        with ctx:
            p = self.g.placeholder(name)
        p.meta["val"] = val
        self._last_ph = p
        return p

    def input(self, shape, dtype) -> fx.Node:
        """A new input of the forward."""
        node = self._placeholder(f"in{len(self.inputs)}", _meta(shape, dtype))
        self.inputs.append(node)
        return node

    def attr(self, path, shape, dtype) -> fx.Node:
        """The module attribute `path`'s current value: its input, or what the forward wrote there."""
        if path in self.writes:
            return self.writes[path]
        node = self.attr_nodes.get(path)
        if node is None:
            node = self._placeholder(f"attr{len(self.attr_paths)}", _meta(shape, dtype))
            self.attr_paths.append(path)
            self.attr_nodes[path] = node
        return node

    def const(self, t: torch.Tensor) -> fx.Node:
        """The input that carries the CPU tensor `t` baked into the graph."""
        node = self.const_nodes.get(id(t))
        if node is None:
            node = self._placeholder(f"const{len(self.consts)}", _meta(t.shape, t.dtype))
            self.consts.append(t)
            self.const_nodes[id(t)] = node
        return node

    def path_of(self, x):
        """The attr path whose current value is fx node `x` (None: not a parameter or buffer)."""
        for path, node in list(self.writes.items()) + list(self.attr_nodes.items()):
            if node is x:
                return path
        return None

    # ---- calls ------------------------------------------------------------------------
    def call(self, op, args, kwargs=None):
        """Record `op(*args, **kwargs)`; return its node, or a tuple/list of nodes for several outputs."""
        kwargs = dict(kwargs or {})
        if op in _DROPOUTS:
            return self._dropout_call(op, args, kwargs)
        if op._schema.name == "aten::to":
            return self._to(op, args, kwargs)
        if op is aten.scaled_dot_product_attention.default:
            return self._attention(**bind(op, args, kwargs))
        if op in _RNNS:
            return self._rnn(op, args, kwargs)
        if op in (aten.fill.Tensor, aten.copy.default):
            return self._broadcast_to_self(op, args, kwargs)
        if op in (aten.select_scatter.default, aten.slice_scatter.default):
            return self._scatter(op, args, kwargs)
        if op is aten.repeat_interleave.self_int:
            a = bind(op, args, kwargs)
            return self._repeat_interleave(a["self"], a["repeats"], a["dim"])
        decomposition = _decomposition(op)
        if decomposition is not None:
            return self._decompose(op, decomposition, args, kwargs)
        return self.emit(op, args, kwargs)

    def _decompose(self, op, decomposition, args, kwargs):
        """`op` as PyTorch's `decomposition` of it, traced on the arguments' metas and recorded
        call by call; its outputs must have the shapes and dtypes of the op's."""
        from torch.fx.experimental.proxy_tensor import make_fx  # noqa: PLC0415

        args, kwargs = pytree.tree_map(lambda x: self.const(x) if isinstance(x, torch.Tensor) else x,
                                       (list(args), kwargs))
        leaves, spec = pytree.tree_flatten((args, kwargs))
        at = [i for i, x in enumerate(leaves) if isinstance(x, fx.Node)]

        def run(*tensors):
            values = list(leaves)
            for i, t in zip(at, tensors):
                values[i] = t
            a, k = pytree.tree_unflatten(values, spec)
            return decomposition(*a, **k)

        meta_args, meta_kwargs = pytree.tree_map(_val, (args, kwargs))
        try:
            gm = make_fx(run)(*[leaves[i].meta["val"] for i in at])
            want = op(*meta_args, **meta_kwargs)
        except Exception as exc:
            raise ConversionError(f"{op} has no lowering rule, and its decomposition does not trace: {exc}") from exc
        got = [n.meta.get("val") for n in pytree.tree_leaves(list(gm.graph.nodes)[-1].args[0]) if isinstance(n, fx.Node)]
        want = [t for t in pytree.tree_leaves(want) if isinstance(t, torch.Tensor)]
        if [(tuple(t.shape), t.dtype) for t in got] != [(tuple(t.shape), t.dtype) for t in want]:
            raise ConversionError(f"{op}'s decomposition computes other shapes or dtypes than the op")
        env, nodes = {}, iter(leaves[i] for i in at)
        for n in gm.graph.nodes:
            if n.op == "placeholder":
                env[n] = next(nodes)
            elif n.op == "get_attr":  # a tensor the decomposition made
                env[n] = self.const(getattr(gm, n.target))
            elif n.op == "call_function":
                a, k = fx.map_arg((n.args, n.kwargs), lambda m: env[m])
                if n.target is operator.getitem:
                    env[n] = a[0][a[1]]
                elif isinstance(n.target, torch._ops.OpOverload) and n.target is not op:
                    env[n] = self.call(n.target, list(a), dict(k))
                else:
                    raise ConversionError(f"{op}'s decomposition calls {n.target}")
            elif n.op == "output":
                return pytree.tree_map(lambda m: env[m] if isinstance(m, fx.Node) else m, n.args[0])
        raise ConversionError(f"{op}'s decomposition returns nothing")

    def _repeat_interleave(self, x, repeats, dim):
        """repeat_interleave with an int count: each element `repeats` times in a row along `dim`
        (the flattened input where dim is None), as unsqueeze, expand and reshape, which Relax's
        Gradient differentiates (it has no rule for repeat)."""
        if isinstance(x, torch.Tensor):
            x = self.const(x)
        if not isinstance(repeats, int) or repeats < 0:
            raise ConversionError(f"repeat_interleave with repeats={repeats!r} (a count >= 0 is supported)")
        if dim is None:
            x, dim = self.emit(aten.reshape.default, [x, [-1]]), 0
        shape = list(_val(x).shape)
        if not shape:
            x, shape = self.emit(aten.reshape.default, [x, [1]]), [1]
        dim %= len(shape)
        wide = shape[: dim + 1] + [repeats] + shape[dim + 1:]
        spread = self.emit(aten.expand.default, [self.emit(aten.unsqueeze.default, [x, dim + 1]), wide])
        return self.emit(aten.reshape.default, [spread, shape[:dim] + [shape[dim] * repeats] + shape[dim + 1:]])

    def _broadcast_to_self(self, op, args, kwargs):
        """fill(x, v) and copy(x, src), functional: the value in x's dtype, broadcast to x's shape."""
        a = bind(op, args, kwargs)
        x = _val(a["self"])
        value = self._to(aten.to.dtype, [a["value" if op is aten.fill.Tensor else "src"], x.dtype], {})
        if tuple(_val(value).shape) == tuple(x.shape):
            return value
        return self.emit(aten.expand.default, [value, list(x.shape)])

    def _scatter(self, op, args, kwargs):
        """select_scatter / slice_scatter with step 1 as the slices around `src`, concatenated.

        TVM has no Relax op for them with a gradient (ratex's rules are TIR kernels).
        """
        a = bind(op, args, kwargs)
        x, src, dim = a["self"], a["src"], a["dim"]
        shape = _val(x).shape
        dim = dim % len(shape)
        n = shape[dim]
        if op is aten.select_scatter.default:
            start = a["index"] + n if a["index"] < 0 else a["index"]
            end, src = start + 1, self.emit(aten.unsqueeze.default, [src, dim])
        else:
            if a["step"] != 1:
                return self.emit(op, args, kwargs)
            start, end = a["start"], a["end"]
            start = 0 if start is None else (start + n if start < 0 else min(start, n))
            end = n if end is None else (end + n if end < 0 else min(end, n))
            end = max(end, start)
        if isinstance(src, torch.Tensor):
            src = self.const(src)
        parts = []
        if start > 0:
            parts.append(self.emit(aten.slice.Tensor, [x, dim, 0, start]))
        parts.append(self._to(aten.to.dtype, [src, _val(x).dtype], {}))
        if end < n:
            parts.append(self.emit(aten.slice.Tensor, [x, dim, end, n]))
        return parts[0] if len(parts) == 1 else self.emit(aten.cat.default, [parts, dim])

    def emit(self, op, args, kwargs=None):
        """Record `op(*args, **kwargs)` as it is, with its metas; tensors in the arguments become constants."""
        kwargs = dict(kwargs or {})
        args, kwargs = pytree.tree_map(lambda x: self.const(x) if isinstance(x, torch.Tensor) else x, (list(args), kwargs))
        if op is aten.size.int:  # static shapes: a size is a constant
            return int(args[0].meta["val"].shape[args[1]])
        if op is aten.size.default:
            return [int(s) for s in args[0].meta["val"].shape]
        if "device" in kwargs:
            kwargs["device"] = None
        meta_args, meta_kwargs = pytree.tree_map(_val, (args, kwargs))
        names = [a.name for a in op._schema.arguments]
        if "device" in names:  # positional (aten::to.device) or keyword (factories)
            i = names.index("device")
            if i < len(meta_args):
                meta_args[i] = "meta"
            else:
                meta_kwargs["device"] = "meta"
        # Strides don't exist in Relax, and metas inferred here may have other strides than the
        # captured model's tensors had (attention's math gives another layout than its kernel):
        # a view's shape is all that matters.
        meta_op = aten.reshape.default if op in (aten.view.default, aten._unsafe_view.default) else op
        try:
            val = meta_op(*meta_args, **meta_kwargs)
        except Exception as exc:
            raise ConversionError(f"{op}: {exc}") from exc
        call = self.g.call_function(op, tuple(args), kwargs)
        call.meta[SITE] = len(self.origins)
        self.origins.append(self.origin)
        if isinstance(val, torch.Tensor):
            call.meta["val"] = val
            return call
        if isinstance(val, (tuple, list)) and all(isinstance(v, torch.Tensor) for v in val):
            call.meta["val"] = tuple(val)
            items = []
            for i, v in enumerate(val):
                item = self.g.call_function(operator.getitem, (call, i))
                item.meta["val"] = v
                items.append(item)
            return items if isinstance(val, list) or op._schema.returns[0].type.kind() == "ListType" else tuple(items)
        raise ConversionError(f"{op} returns {type(val).__name__}")

    def _dropout_call(self, op, args, kwargs):
        a = bind(op, args, kwargs)
        x, p, train = a["input"], a["p"], a["train"]
        if op is aten.native_dropout.default:
            if not train or p == 0:
                return x, self.emit(aten.ones_like.default, [x], {"dtype": torch.bool})
            if not 0 < p < 1:
                raise ConversionError(f"{op} with p={p} in training mode")
            return self.dropout(x, float(p), with_mask=True)
        if p == 0 or not train:  # identity
            return x
        if op not in _MASKED_DROPOUTS or not 0 < p < 1:
            raise ConversionError(f"{op} with p={p} in training mode")
        return self.dropout(x, float(p))

    def dropout(self, x, p, with_mask=False):
        """x * keep * (1 / (1 - p)) with `keep` a new bool input: ratex.core.random.apply_dropout's ops."""
        if isinstance(x, torch.Tensor):  # a constant baked into the graph
            x = self.const(x)
        shape = tuple(x.meta["val"].shape)
        keep = self._placeholder(f"mask{len(self.masks)}", _meta(shape, torch.bool))
        self.masks.append(keep)
        self.dropouts.append((shape, p))
        out = self.emit(aten.mul.Tensor, [self.emit(aten.mul.Tensor, [x, keep]), 1.0 / (1.0 - p)])
        return (out, keep) if with_mask else out

    def _to(self, op, args, kwargs):
        a = bind(op, args, kwargs)
        x, dtype = a["self"], a.get("dtype")
        if "other" in a:
            dtype = _val(a["other"]).dtype
        if isinstance(dtype, int):  # TorchScript's ScalarType number
            raise ConversionError(f"{op} with dtype given as the number {dtype}")
        if dtype is None or dtype == _val(x).dtype:
            return x
        if isinstance(x, torch.Tensor):
            return x.to(dtype)
        return self.emit(aten._to_copy.default, [x], {"dtype": dtype})

    def _attention(self, query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None,
                   enable_gqa=False):
        """SDPA as its math: softmax(q k^T * scale + mask) v, a fully masked row 0, dropout on the probabilities."""
        if enable_gqa:
            key, value = self._repeat_heads(query, key), self._repeat_heads(query, value)
        if attn_mask is None and dropout_p == 0:
            kwargs = {"is_causal": True} if is_causal else {}
            if scale is not None:
                kwargs["scale"] = scale
            return self.emit(aten.scaled_dot_product_attention.default, [query, key, value], kwargs)
        q, k = _val(query), _val(key)
        sq, sk = q.shape[-2], k.shape[-2]
        if scale is None:
            scale = 1.0 / float(q.shape[-1]) ** 0.5
        e = self.emit
        scores = e(aten.mul.Tensor, [e(aten.matmul.default, [query, e(aten.transpose.int, [key, -2, -1])]), scale])
        if is_causal:
            keep = e(aten.ones.default, [[sq, sk]], {"dtype": torch.bool})
            attn_mask = e(aten.tril.default, [keep])
        if attn_mask is not None:
            if isinstance(attn_mask, torch.Tensor):
                attn_mask = self.const(attn_mask)
            dtype = q.dtype
            if _val(attn_mask).dtype == torch.bool:
                scores = e(aten.where.self, [attn_mask, scores, self._scalar(float("-inf"), dtype)])
            else:
                scores = e(aten.add.Tensor, [scores, attn_mask])
            # PyTorch's kernels give 0 for a row with no key left; softmax alone would give NaN,
            # and so would its gradient: such rows are softmaxed as zeros, then zeroed.
            dead = e(aten.logical_not.default, [e(aten.any.dim, [e(aten.ne.Scalar, [scores, float("-inf")]), -1, True])])
            zero = self._scalar(0.0, dtype)
            scores = e(aten.where.self, [dead, zero, scores])
            probs = e(aten.where.self, [dead, zero, e(aten._softmax.default, [scores, -1, False])])
        else:
            probs = e(aten._softmax.default, [scores, -1, False])
        if dropout_p > 0:
            probs = self.dropout(probs, float(dropout_p))
        return e(aten.matmul.default, [probs, value])

    def _repeat_heads(self, query, kv):
        """Grouped-query attention's key or value with each head repeated for the query heads that
        share it (SDPA's enable_gqa: repeat_interleave over dim -3)."""
        if isinstance(kv, torch.Tensor):
            kv = self.const(kv)
        q, x = _val(query), _val(kv)
        if q.dim() < 3 or x.dim() != q.dim():
            raise ConversionError(f"scaled_dot_product_attention with enable_gqa: query {list(q.shape)}, "
                                  f"key/value {list(x.shape)} (both need a head dim -3)")
        hq, hkv = q.shape[-3], x.shape[-3]
        if hq == hkv:
            return kv
        if hkv == 0 or hq % hkv:
            raise ConversionError(f"scaled_dot_product_attention with enable_gqa: {hq} query heads are not a "
                                  f"multiple of {hkv} key/value heads")
        return self._repeat_interleave(kv, hq // hkv, -3)

    def _scalar(self, value, dtype):
        return self.emit(aten.scalar_tensor.default, [value], {"dtype": dtype})

    def _rnn(self, op, args, kwargs):
        """An RNN (LSTM, GRU, tanh/relu RNN) unrolled over its time steps into ATen ops that Relax
        differentiates: per layer and direction one input projection for all steps, then per step
        the hidden projection and the cell's gates. Dropout between layers in training as `dropout`.
        """
        a = bind(op, args, kwargs)
        lstm = op is aten.lstm.input
        layers, p, train, bidir = a["num_layers"], float(a["dropout"]), a["train"], a["bidirectional"]
        dirs = 2 if bidir else 1
        params = list(a["params"])
        per = 4 if a["has_biases"] else 2
        if len(params) != layers * dirs * per:
            raise ConversionError(f"{op} with {len(params)} weights for {layers} layers (proj_size is not supported)")
        e = self.emit
        x = a["input"]
        if isinstance(x, torch.Tensor):
            x = self.const(x)
        batched = _val(x).dim() == 3
        if not batched:
            x = e(aten.unsqueeze.default, [x, 0 if a["batch_first"] else 1])
        if a["batch_first"]:
            x = e(aten.transpose.int, [x, 0, 1])  # time-major inside
        hx = list(a["hx"]) if lstm else [a["hx"]]
        hx = [self.const(h) if isinstance(h, torch.Tensor) else h for h in hx]
        if not batched:
            hx = [e(aten.unsqueeze.default, [h, 1]) for h in hx]
        steps = _val(x).shape[0]
        finals = [[] for _ in hx]
        for layer in range(layers):
            if layer and train and p > 0:
                x = self.dropout(x, p)
            outs = []
            for d in range(dirs):
                k = layer * dirs + d
                w_ih, w_hh = params[k * per], params[k * per + 1]
                b_ih, b_hh = (params[k * per + 2], params[k * per + 3]) if per == 4 else (None, None)
                state = [e(aten.select.int, [h, 0, k]) for h in hx]
                xw = e(aten.linear.default, [x, w_ih, b_ih])
                ys = [None] * steps
                for t in (reversed(range(steps)) if d else range(steps)):
                    gi = e(aten.select.int, [xw, 0, t])
                    gh = e(aten.linear.default, [state[0], w_hh, b_hh])
                    state = self._cell(op, gi, gh, state)
                    ys[t] = state[0]
                outs.append(self._stack(ys))
                for f, h in zip(finals, state):
                    f.append(h)
            x = outs[0] if dirs == 1 else e(aten.cat.default, [outs, -1])
        if a["batch_first"]:
            x = e(aten.transpose.int, [x, 0, 1])
        finals = [self._stack(f) for f in finals]
        if not batched:
            x = e(aten.squeeze.dim, [x, 0 if a["batch_first"] else 1])
            finals = [e(aten.squeeze.dim, [h, 1]) for h in finals]
        return (x, *finals)

    def _stack(self, xs):
        """stack(xs, 0) as unsqueeze and cat: Relax's Gradient has no rule for stack."""
        return self.emit(aten.cat.default, [[self.emit(aten.unsqueeze.default, [x, 0]) for x in xs], 0])

    def _cell(self, op, gi, gh, state):
        """One time step of `op`'s cell: the new state ([h] or [h, c]) from the gates' input and
        hidden projections, PyTorch's formulas and gate order."""
        e = self.emit

        def gate(g, k, n):
            size = _val(g).shape[-1] // n
            return e(aten.slice.Tensor, [g, -1, k * size, (k + 1) * size])

        if op is aten.lstm.input:
            gates = e(aten.add.Tensor, [gi, gh])
            i, f, o = (e(aten.sigmoid.default, [gate(gates, k, 4)]) for k in (0, 1, 3))
            g = e(aten.tanh.default, [gate(gates, 2, 4)])
            c = e(aten.add.Tensor, [e(aten.mul.Tensor, [f, state[1]]), e(aten.mul.Tensor, [i, g])])
            return [e(aten.mul.Tensor, [o, e(aten.tanh.default, [c])]), c]
        if op is aten.gru.input:
            r, z = (e(aten.sigmoid.default, [e(aten.add.Tensor, [gate(gi, k, 3), gate(gh, k, 3)])]) for k in (0, 1))
            n = e(aten.tanh.default, [e(aten.add.Tensor, [gate(gi, 2, 3), e(aten.mul.Tensor, [r, gate(gh, 2, 3)])])])
            # (1 - z) * n + z * h
            return [e(aten.add.Tensor, [n, e(aten.mul.Tensor, [z, e(aten.sub.Tensor, [state[0], n])])])]
        act = aten.tanh.default if op is aten.rnn_tanh.input else aten.relu.default
        return [e(act, [e(aten.add.Tensor, [gi, gh])])]

    # ---- the Script ---------------------------------------------------------------------
    def finish(self, outputs, out_spec, attr_metas, diff_inputs=(), diff_attrs=None) -> Script:
        """Lower the graph to the Relax `fwd` and return the Script.

        outputs: the model's own output values (fx nodes, or CPU tensors baked into the graph);
        the written buffers follow them. diff_inputs: indices of the inputs that get gradients;
        diff_attrs: paths of the attributes that do (None: every floating-point one).
        Attributes the forward never reads are dropped (PyTorch leaves their .grad alone).
        """
        fx_outs = []
        for x in outputs:
            if isinstance(x, torch.Tensor):
                x = self.const(x)
            if not isinstance(x, fx.Node):
                raise ConversionError(f"the model returns a non-tensor ({type(x).__name__})")
            fx_outs.append(x)
        fx_outs += list(self.writes.values())
        self.g.output(tuple(fx_outs))
        for path in list(self.attr_paths):
            node = self.attr_nodes[path]
            if not node.users:
                self.g.erase_node(node)
                self.attr_paths.remove(path)
                del self.attr_nodes[path]
        self._order_placeholders()
        self.g.lint()
        checks = []
        fwd = import_graph(self.g, name="fwd", differentiable=True, checks=checks)["fwd"]
        kernels = _tir_kernels(fwd)
        if kernels:  # neither differentiable nor callable once fwd is inlined without the module's PrimFuncs
            raise ConversionError(f"a rule emitted TIR kernels {kernels} where Relax ops are needed")
        n_in = len(self.inputs)
        diff = [i for i in diff_inputs if self.inputs[i].meta["val"].dtype.is_floating_point]
        for j, path in enumerate(self.attr_paths):
            if (diff_attrs is None or path in diff_attrs) and attr_metas[path][1].is_floating_point:
                diff.append(n_in + j)
        metas = [(tuple(n.meta["val"].shape), n.meta["val"].dtype) for n in fx_outs]
        sites = {site: self.origins[site] for site, *_ in checks}
        return Script(fwd, n_in, list(self.attr_paths), list(self.consts), list(self.dropouts), metas, out_spec,
                      list(self.writes), diff, self.g, checks, sites)

    def _order_placeholders(self):
        """Parameters in the order Script promises: inputs, attrs, consts, masks."""
        order = self.inputs + [self.attr_nodes[p] for p in self.attr_paths]
        order += [self.const_nodes[id(t)] for t in self.consts] + self.masks
        anchor = next(n for n in self.g.nodes if n.op != "placeholder")
        for n in order:
            anchor.prepend(n)
