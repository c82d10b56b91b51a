"""The one definition of ratex's counter-based random bit generator.

`words(index, seed)` maps an element's flat index and a 64-bit seed to 32
random bits. It is written with operators only (`+ * & ^ >> <<`), so the same
code runs on torch int64 tensors (the CPU implementation of
`ratex::random_bits`, in ratex/core/random.py) and on TIR int64 expressions
(its lowering rule, in ops/random.py): the compiled program and the CPU
implementation cannot drift apart. `const` makes the integer constants
(TIR needs them typed int64: an untyped 0xFFFFFFFF would become int32 -1).

Every intermediate stays below 2**49, so nothing relies on signed int64
overflow (undefined in the code LLVM generates for TIR). The mixer is
MurmurHash3's 32-bit finalizer, a bijection on 32-bit words, applied to a
Weyl sequence of the index and keyed by both halves of the seed; for a fixed
seed, indices below 2**32 get distinct words.
"""
M32 = 0xFFFFFFFF
_WEYL = 0x9E3779B9


def _same(v):
    return v


def words(index, seed, const=_same):
    """Return 32 random bits (as a non-negative int64 below 2**32) for element `index` under `seed`."""
    m32, low16 = const(M32), const(0xFFFF)

    def mul32(h, c):  # (h * c) mod 2**32 for 32-bit h and constant c, from two 16-bit partial products
        return (h * const(c & 0xFFFF) + (((h * const(c >> 16)) & low16) << const(16))) & m32

    def fmix32(h):
        h = h ^ (h >> const(16))
        h = mul32(h, 0x85EBCA6B)
        h = h ^ (h >> const(13))
        h = mul32(h, 0xC2B2AE35)
        return h ^ (h >> const(16))

    h = fmix32(mul32(index & m32, _WEYL) ^ (seed & m32))
    return fmix32(h ^ ((seed >> const(32)) & m32))
