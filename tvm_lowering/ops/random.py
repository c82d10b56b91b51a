"""`ratex::random_bits`: 32 random bits per element from (seed input, element index); `ratex::dropout_keep`.

The bits come from `tvm_lowering.counter_rng.words`, the same function the
CPU implementation runs on torch tensors, so both give identical bits.
Everything random on the lazy device (uniform, normal, log_normal, cauchy,
geometric, bernoulli, randint, randperm, multinomial, rrelu) is ordinary ATen
arithmetic on these words, recorded by ratex/core/random.py; dropout's keep mask
is `ratex::dropout_keep`, the same arithmetic as one op (one traced call, not six).
The rule is a TE compute (a call_tir), which `relax.transform.Gradient`
refuses inside a function it differentiates: a `jit.script` forward
therefore takes each dropout's keep mask as an input,
drawn by the same ops in the step's program (see tvm_lowering/torchscript.py).
The index is computed from the loop variables inside the kernel, so no
full-size index tensor exists for constant folding to bake into the program.
"""
from tvm import te, tirx

from ..counter_rng import words
from .kit import emit_te, out_meta
from .registry import rule


def _bits_te(seed, out_shape):
    def at(*idx):
        flat = tirx.const(0, "int64")
        for i, n in zip(idx, out_shape):
            flat = flat * tirx.const(n, "int64") + i.astype("int64")
        return words(flat, seed[()], const=lambda v: tirx.const(v, "int64"))

    return te.compute(out_shape, at, name="random_bits")


@rule("random_bits.default")
def random_bits(imp, node):
    seed = imp.env[node.args[0]]
    out_shape, _ = out_meta(node)
    return emit_te(imp, _bits_te, seed, out_shape)


_UNIT24 = 1 << 24


@rule("dropout_keep.default")
def dropout_keep(imp, node):
    """Dropout's keep mask, as ratex/core/random.py computes it on CPU: not (u < p) for the
    uniform u = (bits & (2^24 - 1)) / 2^24 (exact in float32)."""
    seed, p = imp.env[node.args[0]], imp.env[node.args[2]]
    out_shape, _ = out_meta(node)

    def keep(seed, p):
        bits = _bits_te(seed, out_shape)
        mask = tirx.const(_UNIT24 - 1, "int64")
        scale = tirx.const(1.0 / _UNIT24, "float32")
        return te.compute(
            out_shape, lambda *i: tirx.Not((bits(*i) & mask).astype("float32") * scale < p[()].astype("float32")),
            name="dropout_keep",
        )

    return emit_te(imp, keep, seed, p)
