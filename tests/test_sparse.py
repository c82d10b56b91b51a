"""Sparse COO gradients on the lazy device: nn.Embedding(sparse=True)'s gradient and the optimizers
that take sparse gradients (SparseAdam, SGD, Adagrad) match CPU PyTorch."""
import copy

import pytest
import torch
import torch.nn.functional as F

import ratex.lazy_tensor_core.core.lazy_model as lm
from ratex.lazy_tensor_core.debug import metrics


def _embedding_grads(dev, padding_idx=None):
    torch.manual_seed(0)
    ref = torch.nn.Embedding(10, 3, sparse=True, padding_idx=padding_idx)
    emb = copy.deepcopy(ref).to(dev)
    x = torch.tensor([[1, 4, 4, 9], [0, 4, 1, 2]])  # repeated rows, and row 0 (the padding row below)
    y = torch.randn(2, 4, 3, generator=torch.Generator().manual_seed(1))
    for m, d in ((ref, "cpu"), (emb, dev)):
        F.mse_loss(m(x.to(d)), y.to(d)).backward()
    return ref.weight.grad, emb.weight.grad


@pytest.mark.parametrize("padding_idx", [None, 0])
def test_sparse_embedding_gradient_matches_cpu(dev, padding_idx):
    """The gradient is a sparse COO tensor on the lazy device with CPU's entries; coalesced, CPU's
    distinct indices and summed values; dense, CPU's dense gradient."""
    want, got = _embedding_grads(dev, padding_idx)
    assert got.is_sparse and got.layout is torch.sparse_coo and got.device == dev and got.shape == want.shape
    assert got._nnz() == want._nnz() and not got.is_coalesced()
    cpu = got.cpu()
    assert cpu.is_sparse and cpu.device.type == "cpu"
    torch.testing.assert_close(cpu._indices(), want._indices())
    torch.testing.assert_close(cpu._values(), want._values())
    coalesced, reference = got.coalesce(), want.coalesce()
    assert coalesced.is_coalesced()
    torch.testing.assert_close(coalesced.indices().cpu(), reference.indices())
    torch.testing.assert_close(coalesced.values().cpu(), reference.values())
    torch.testing.assert_close(got.to_dense().cpu(), want.to_dense())
    lm.mark_step()
    # Leaving out the padding row is a boolean mask, whose result's size depends on the data: CPU runs it.
    expected = ["aten::index.Tensor"] if padding_idx is not None else []
    assert [c for c in metrics.counter_names() if c.startswith("aten::")] == expected


def test_coalesce_adds_duplicates_up_as_cpu_does(dev):
    """Many entries at each index: coalesced, the values are CPU's to the bit (CPU adds duplicates
    up in the order of its sort of the indices, which is not their order), and so is a dense
    tensor plus the uncoalesced gradient (entry order there)."""
    g = torch.Generator().manual_seed(3)
    x, y = torch.randint(0, 5, (64,), generator=g), torch.randn(64, 7, generator=g)
    w, base = torch.randn(5, 7, generator=g), torch.randn(5, 7, generator=g)
    ref = torch.nn.Embedding.from_pretrained(w.clone(), freeze=False, sparse=True)
    emb = torch.nn.Embedding.from_pretrained(w.clone(), freeze=False, sparse=True).to(dev)
    for m, d in ((ref, "cpu"), (emb, dev)):
        (m(x.to(d)) * y.to(d)).sum().backward()
    want, got = ref.weight.grad, emb.weight.grad
    assert torch.equal(got.coalesce().values().cpu(), want.coalesce().values())
    assert torch.equal((base.to(dev) + got).cpu(), base + want)


OPTIMIZERS = {
    "SparseAdam": lambda p: torch.optim.SparseAdam(p),
    "SparseAdam maximize": lambda p: torch.optim.SparseAdam(p, lr=0.01, maximize=True),
    "SparseAdam Tensor lr": lambda p: torch.optim.SparseAdam(p, lr=torch.tensor(0.001)),
    "SGD": lambda p: torch.optim.SGD(p, lr=0.1),
    "Adagrad": lambda p: torch.optim.Adagrad(p, lr=0.1),
}


@pytest.mark.parametrize("name", OPTIMIZERS)
def test_optimizer_with_sparse_gradients_matches_cpu(dev, name):
    """Five steps of an embedding with sparse gradients: the same losses and weights as CPU, all
    lowered. Coalescing reads the indices, so a step compiles where its count of distinct indices
    is new, and only there."""
    torch.manual_seed(0)
    ref = torch.nn.Embedding(12, 4, sparse=True)
    emb = copy.deepcopy(ref).to(dev)
    opts = OPTIMIZERS[name](ref.parameters()), OPTIMIZERS[name](emb.parameters())
    g = torch.Generator().manual_seed(1)
    counts, compiles = set(), []
    for _ in range(5):
        x, y = torch.randint(0, 12, (6,), generator=g), torch.randn(6, 4, generator=g)
        losses = []
        for m, opt, d in ((ref, opts[0], "cpu"), (emb, opts[1], dev)):
            opt.zero_grad()
            loss = F.mse_loss(m(x.to(d)), y.to(d))
            loss.backward()
            opt.step()
            losses.append(loss)
        before = metrics.counter_value("UncachedCompile") or 0
        lm.mark_step()
        torch.testing.assert_close(losses[1].cpu(), losses[0])
        new_count = len(set(x.tolist())) not in counts
        counts.add(len(set(x.tolist())))
        compiles.append(((metrics.counter_value("UncachedCompile") or 0) > before, new_count))
    torch.testing.assert_close(emb.weight.cpu(), ref.weight.detach(), rtol=1e-5, atol=1e-6)
    assert all(new or not compiled for compiled, new in compiles[1:]), compiles
    assert not [c for c in metrics.counter_names() if c.startswith("aten::")]


def test_sparse_gradients_accumulate_and_zero(dev):
    """Two backward passes add their sparse gradients (entries concatenated, as on CPU);
    zero_grad(set_to_none=False) leaves an empty sparse gradient that the next backward adds to."""
    torch.manual_seed(0)
    ref = torch.nn.Embedding(8, 2, sparse=True)
    emb = copy.deepcopy(ref).to(dev)
    batches = [torch.tensor([1, 3, 3]), torch.tensor([3, 7])]
    for m, d in ((ref, "cpu"), (emb, dev)):
        for x in batches:
            m(x.to(d)).sum().backward()
    got = emb.weight.grad
    assert got.is_sparse and got._nnz() == ref.weight.grad._nnz() == 5
    torch.testing.assert_close(got.to_dense().cpu(), ref.weight.grad.to_dense())
    for m, d in ((ref, "cpu"), (emb, dev)):
        torch.optim.SGD(m.parameters(), lr=0.1).zero_grad(set_to_none=False)
        assert m.weight.grad.is_sparse and m.weight.grad._nnz() == 0
        m(batches[1].to(d)).sum().backward()
    torch.testing.assert_close(emb.weight.grad.to_dense().cpu(), ref.weight.grad.to_dense())


def test_unsupported_sparse_ops_raise_clearly(dev):
    """An op ratex does not run on a sparse lazy tensor raises NotImplementedError naming it; a
    sparse CPU tensor does not move to the lazy device, and the error says what to do."""
    _, grad = _embedding_grads(dev)
    with pytest.raises(NotImplementedError, match="log1p.*sparse lazy tensor.*to_dense"):
        torch.log1p(grad)
    with pytest.raises(NotImplementedError, match="sparse_coo.*to_dense"):
        torch.sparse_coo_tensor(torch.tensor([[0, 2]]), torch.ones(2), (4,)).to(dev)
