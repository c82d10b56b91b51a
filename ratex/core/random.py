"""Random ops whose randomness is a graph input: a seed drawn from torch's CPU generator.

Each call draws a fresh int64 seed (so `torch.manual_seed` makes runs repeat)
and passes it as a 0-dim input; the compiled program derives its random bits
from (seed, element index) with a counter-based hash, so a cached program
gives new numbers every step. The CPU implementation below computes the very
same bits, so a fallback and the compiled code agree exactly.
"""
import torch

_M32 = 0xFFFFFFFF
_lib = torch.library.Library("ratex", "DEF")
_lib.define("seeded_dropout(Tensor input, Tensor seed, float p) -> (Tensor, Tensor)")


def hash_uniform(seed: torch.Tensor, shape) -> torch.Tensor:
    """Return float32 uniforms in [0, 1) from (seed, flat index), the hash the TVM rule uses."""
    n = 1
    for s in shape:
        n *= s
    h = torch.arange(n, dtype=torch.int64)
    h = (h * 0x9E3779B1 + (seed & _M32)) & _M32
    h = h ^ (h >> 16)
    h = (h * 0x85EBCA6B) & _M32
    h = h ^ (h >> 13)
    h = (h * 0xC2B2AE35) & _M32
    h = h ^ (h >> 16)
    return ((h >> 8).to(torch.float32) * (1.0 / (1 << 24))).reshape(shape)


def seeded_dropout(x: torch.Tensor, seed: torch.Tensor, p: float):
    """(output, keep mask) of dropout with the mask drawn from `seed`; plain, differentiable torch ops."""
    mask = hash_uniform(seed, x.shape) >= p
    return x * mask * (1.0 / (1.0 - p)), mask


@torch.library.impl(_lib, "seeded_dropout", "CPU")
def _seeded_dropout_cpu(x, seed, p):
    return seeded_dropout(x, seed, p)


@torch.library.register_fake("ratex::seeded_dropout")
def _seeded_dropout_meta(x, seed, p):
    return torch.empty_like(x), torch.empty(x.shape, dtype=torch.bool, device=x.device)


def new_seed() -> torch.Tensor:
    """Return a 0-dim int64 seed drawn from torch's default CPU generator."""
    return torch.randint(0, 2**62, (), dtype=torch.int64)
