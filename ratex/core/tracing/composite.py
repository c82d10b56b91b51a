"""Composite ops re-expressed for lazy tensors above autograd.

PyTorch's own decompositions of these use in-place metadata changes
(`squeeze_`), which a recorded tensor can't honour; these equivalents use
only functional views, and autograd differentiates them op by op.
"""
import torch

_lib = torch.library.Library("aten", "IMPL", "AutogradLazy")


def _matmul(a, b):
    if a.dim() == 1 and b.dim() == 1:
        return (a * b).sum()
    if a.dim() == 1:
        return torch.matmul(a.unsqueeze(0), b).squeeze(-2)
    if b.dim() == 1:
        return torch.matmul(a, b.unsqueeze(-1)).squeeze(-1)
    if a.dim() == 2 and b.dim() == 2:
        return torch.mm(a, b)
    if b.dim() == 2:
        # Fold a's batch dims into its rows, as ATen does: one mm, instead of a bmm on b
        # broadcast to every batch entry (whose gradient then sums all those copies).
        # The row count is spelled out: -1 is ambiguous when a's inner dim is 0.
        return torch.mm(a.reshape(a.shape[:-1].numel(), a.shape[-1]), b).reshape(*a.shape[:-1], b.shape[-1])
    batch = torch.broadcast_shapes(a.shape[:-2], b.shape[:-2])
    n = batch.numel()  # not -1: ambiguous when a matrix dim is 0
    a3 = a.expand(*batch, *a.shape[-2:]).reshape(n, *a.shape[-2:])
    b3 = b.expand(*batch, *b.shape[-2:]).reshape(n, *b.shape[-2:])
    return torch.bmm(a3, b3).reshape(*batch, a.shape[-2], b.shape[-1])


_lib.impl("matmul", _matmul)


def _tensor_split(self, indices_or_sections, dim=0):
    # The split points are shapes, not data: read them, as PyTorch requires them on CPU anyway.
    points = indices_or_sections.cpu()
    if points.dim() == 0:
        return torch.tensor_split(self, int(points), dim)
    return torch.tensor_split(self, points.tolist(), dim)


_lib.impl("tensor_split.tensor_indices_or_sections", _tensor_split)
