"""Models, synthetic data and optimizers for scripts/bench.py.

Every model is built on CPU under a fixed seed; its data is a small pool of
synthetic CPU batches (fixed seed too), so every system trains on the same
numbers. `MODELS[name]` gives a spec: build() -> model, batches(seed) -> list of
(x, y), loss(out, y), optimizer(params), and whether it has dropout.
LeNet-5 and the MNIST Net are the tutorials' own (tutorials/mnist_models.py).
"""
import os
import sys

import torch
import torch.nn as nn
import torch.nn.functional as F

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "tutorials"))
from mnist_models import LeNet5, MnistNet  # noqa: E402  (torch only: eager cells never load ratex)

POOL = 4  # distinct synthetic batches, cycled over the steps


class MLP(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc1 = nn.Linear(784, 1024)
        self.fc2 = nn.Linear(1024, 1024)
        self.fc3 = nn.Linear(1024, 10)

    def forward(self, x):
        x = torch.flatten(x, 1)
        x = F.relu(self.fc1(x))
        x = F.relu(self.fc2(x))
        return self.fc3(x)


class GPT(nn.Module):
    """A small GPT-style decoder: token + position embeddings, pre-norm
    nn.TransformerEncoderLayer blocks with a causal mask (GELU MLP, no dropout),
    final LayerNorm, linear LM head."""

    def __init__(self, vocab=1000, d_model=256, nhead=4, layers=2, seq=128):
        super().__init__()
        self.tok = nn.Embedding(vocab, d_model)
        self.pos = nn.Parameter(torch.randn(1, seq, d_model) * 0.02)
        self.blocks = nn.ModuleList(
            nn.TransformerEncoderLayer(
                d_model, nhead, dim_feedforward=4 * d_model, dropout=0.0,
                activation="gelu", batch_first=True, norm_first=True,
            )
            for _ in range(layers)
        )
        self.norm = nn.LayerNorm(d_model)
        self.head = nn.Linear(d_model, vocab)
        # a buffer, so it moves to the device with the model
        self.register_buffer("mask", nn.Transformer.generate_square_subsequent_mask(seq), persistent=False)

    def forward(self, idx):
        x = self.tok(idx) + self.pos
        for block in self.blocks:
            x = block(x, src_mask=self.mask, is_causal=True)
        return self.head(self.norm(x))


def _images(batch, seed):
    g = torch.Generator().manual_seed(seed)
    return [
        (torch.randn(batch, 1, 28, 28, generator=g), torch.randint(0, 10, (batch,), generator=g))
        for _ in range(POOL)
    ]


def _tokens(batch, seed, vocab=1000, seq=128):
    g = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(POOL):
        ids = torch.randint(0, vocab, (batch, seq + 1), generator=g)
        out.append((ids[:, :-1].contiguous(), ids[:, 1:].contiguous()))
    return out


def _nll(out, y):
    return F.nll_loss(out, y)


def _ce(out, y):
    return F.cross_entropy(out, y)


def _lm_ce(out, y):
    return F.cross_entropy(out.reshape(-1, out.shape[-1]), y.reshape(-1))


def _sgd(params):
    return torch.optim.SGD(params, lr=0.01, momentum=0.9)


def _adamw(params):
    return torch.optim.AdamW(params, lr=1e-3)


class Spec:
    def __init__(self, build, batches, loss, optimizer, dropout=False):
        self.build, self.batches, self.loss, self.optimizer, self.dropout = build, batches, loss, optimizer, dropout


class _HF:
    """A tiny randomly initialised `transformers` model (2 layers, width 64) returning logits:
    models nobody here wrote. `transformers` is imported only when one is built."""

    def __init__(self, kind):
        self.kind = kind

    def __call__(self):
        import transformers

        if self.kind == "gpt2":
            config = transformers.GPT2Config(vocab_size=1000, n_positions=64, n_embd=64, n_layer=2, n_head=4,
                                             resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)
            return _Logits(transformers.GPT2LMHeadModel(config))
        config = transformers.BertConfig(vocab_size=1000, hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
                                         intermediate_size=256, max_position_embeddings=64,
                                         hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0)
        return _Logits(transformers.BertForMaskedLM(config))


class _Logits(nn.Module):
    """A Hugging Face model called as users call it (keyword arguments), its logits out."""

    def __init__(self, model):
        super().__init__()
        self.model = model

    def forward(self, ids):
        return self.model(input_ids=ids).logits


class LSTMLM(nn.Module):
    """An LSTM language model: embedding, 2-layer LSTM (batch_first), linear head."""

    def __init__(self, vocab=1000, width=128):
        super().__init__()
        self.emb = nn.Embedding(vocab, width)
        self.lstm = nn.LSTM(width, width, num_layers=2, batch_first=True)
        self.head = nn.Linear(width, vocab)

    def forward(self, ids):
        return self.head(self.lstm(self.emb(ids))[0])


MODELS = {
    "lenet-b1": Spec(LeNet5, lambda s: _images(1, s), _nll, _sgd),
    "lenet-b64": Spec(LeNet5, lambda s: _images(64, s), _nll, _sgd),
    "mnist-b64": Spec(MnistNet, lambda s: _images(64, s), _nll, _sgd, dropout=True),
    "mlp-b128": Spec(MLP, lambda s: _images(128, s), _ce, _sgd),
    "gpt2l-b8": Spec(GPT, lambda s: _tokens(8, s), _lm_ce, _adamw),
    # models nobody here wrote or tuned for (not in bench.py's default set)
    "hf-gpt2-b4": Spec(_HF("gpt2"), lambda s: _tokens(4, s, seq=32), _lm_ce, _adamw),
    "hf-bert-b4": Spec(_HF("bert"), lambda s: _tokens(4, s, seq=32), _lm_ce, _adamw),
    "lstm-b8": Spec(LSTMLM, lambda s: _tokens(8, s, seq=32), _lm_ce, _adamw),
}
