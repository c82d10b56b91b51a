"""Real models train on the lazy device as on CPU: Hugging Face GPT-2 and BERT built from tiny
configs (random init, no downloads), on the plain lazy path and under `ratex.jit.script`.

Each test trains 3 steps with SGD on CPU and on the lazy device, from the same init on the
same batches, called as a Hugging Face user calls the model
(`model(input_ids=..., attention_mask=..., labels=...).loss`), and asserts that the losses and
final parameters match CPU's, how many programs each step runs (a value read into Python in the
middle of a step cuts it in two), that only the first step compiles, and that no op falls back
to CPU (`aten::` counters).

Also T5 and BART, and models built from torch.nn alone: `nn.TransformerEncoder` with a padding
mask, an LSTM language model, a ResNet with BatchNorm.
"""
import copy

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import ratex
import ratex.lazy_tensor_core.core.lazy_model as lm
from ratex.core import sync
from ratex.lazy_tensor_core.debug import metrics

transformers = pytest.importorskip("transformers")

STEPS = 3
VOCAB, SEQ, BATCH = 64, 8, 2



def _gpt2(tied=True):
    cfg = transformers.GPT2Config(vocab_size=VOCAB, n_positions=32, n_embd=32, n_layer=2, n_head=2,
                                  resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, bos_token_id=0,
                                  eos_token_id=0, tie_word_embeddings=tied)
    return transformers.GPT2LMHeadModel(cfg)


def _bert(tied=True):
    cfg = transformers.BertConfig(vocab_size=VOCAB, hidden_size=32, num_hidden_layers=2, num_attention_heads=2,
                                  intermediate_size=64, max_position_embeddings=32, hidden_dropout_prob=0.0,
                                  attention_probs_dropout_prob=0.0, pad_token_id=0, tie_word_embeddings=tied)
    return transformers.BertForMaskedLM(cfg)


def _llama(tied=True):
    """Rotary embeddings, grouped-query attention, RMSNorm and a SiLU-gated MLP."""
    cfg = transformers.LlamaConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                   num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=32,
                                   bos_token_id=0, eos_token_id=0, pad_token_id=0, tie_word_embeddings=tied)
    return transformers.LlamaForCausalLM(cfg)


HF = {"gpt2": _gpt2, "bert": _bert, "llama": _llama}


def _hf_batches():
    """Token ids, a padding mask (the second sequence is 3 tokens shorter) and labels (-100 on padding)."""
    g = torch.Generator().manual_seed(1)
    out = []
    for _ in range(STEPS):
        ids = torch.randint(1, VOCAB, (BATCH, SEQ), generator=g)
        mask = torch.ones_like(ids)
        mask[1, SEQ - 3:] = 0
        out.append((ids, mask, ids.masked_fill(mask == 0, -100)))
    return out


def _hf_loss(model, ids, mask, labels):
    return model(input_ids=ids, attention_mask=mask, labels=labels).loss


def _hf_loss_unmasked(model, ids, mask, labels):
    """The loss of the batch without its padding mask (every token a label)."""
    return model(input_ids=ids, labels=ids).loss


class _Logits(nn.Module):
    """A Hugging Face model called with token ids alone, returning its logits."""

    def __init__(self, hf):
        super().__init__()
        self.hf = hf

    def forward(self, ids):
        return self.hf(ids).logits


def _logits_loss(model, ids, mask, labels):
    logits = model(ids)
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), labels.reshape(-1))


def _train(model, batches, loss_fn, device):
    """Train with SGD; return the losses, and on lazy the programs run and compiled at each step.

    SGD, not Adam: Adam's step is about lr whatever the gradient's size, so on a weight whose
    gradient is float noise (attention's key bias) CPU and lazy would part by up to lr a step."""
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    losses, runs, compiles = [], [], []
    for batch in batches:
        before = [metrics.counter_value(c) or 0 for c in ("UncachedCompile", "CachedCompile")]
        opt.zero_grad()
        loss = loss_fn(model, *(t.to(device) for t in batch))
        loss.backward()
        opt.step()
        if device.type == "lazy":
            lm.mark_step()
        losses.append(loss.item())
        miss, hit = (metrics.counter_value(c) or 0 for c in ("UncachedCompile", "CachedCompile"))
        runs.append(miss + hit - sum(before))
        compiles.append(miss - before[0])
    return losses, runs, compiles


def _check(make, batches, loss_fn, dev, script=False, runs=1, first_compiles=1):
    """Train `make()` on CPU and on `dev` (scripted or not) and assert they agree, each step runs
    `runs` programs, the first step compiles `first_compiles` of them (the compile cache is
    emptied first, so no earlier test decides it) and later steps none, and nothing falls back
    to CPU."""
    torch.manual_seed(0)
    ref = make()
    model = copy.deepcopy(ref).to(dev)
    if script:
        model = ratex.jit.script(model)
    want, _, _ = _train(ref, batches, loss_fn, torch.device("cpu"))
    sync.reset_cache()
    metrics.reset()
    got, ran, compiled = _train(model, batches, loss_fn, dev)
    fallbacks = [c for c in metrics.counter_names() if c.startswith("aten::")]
    if script:
        assert metrics.counter_value("ratex::script_fwd.default"), "the model was not scripted"
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-5)
    want_params = dict(ref.named_parameters(remove_duplicate=False))
    for name, p in model.named_parameters():
        torch.testing.assert_close(p.detach().cpu(), want_params[name].detach(), rtol=1e-4, atol=1e-5,
                                   msg=lambda m: f"{name}: {m}")
    want_buffers = dict(ref.named_buffers(remove_duplicate=False))
    for name, b in model.named_buffers():
        torch.testing.assert_close(b.cpu(), want_buffers[name], rtol=1e-4, atol=1e-4, msg=lambda m: f"{name}: {m}")
    assert not fallbacks, f"ran on CPU: {fallbacks}"
    assert ran == [runs] * STEPS, f"programs run per step: {ran}"
    assert compiled == [first_compiles] + [0] * (STEPS - 1), f"programs compiled per step: {compiled}"


# transformers' masking_utils reads the padding mask into Python to decide whether SDPA may
# skip it (`padding_mask.all()`: once in BERT, twice in GPT-2), and each read runs the step so far.
RUNS = {"gpt2": 3, "bert": 2, "llama": 3}
# GPT-2's and Llama's two reads read the same mask, but a read keeps every live tensor it computes
# (sync.py): the first also returns the mask's view that is still alive, the second reads it, so
# they are two programs.
COMPILES = {"gpt2": 3, "bert": 2, "llama": 3}


@pytest.mark.parametrize("name", HF)
def test_hf_untied_trains_like_cpu(dev, name):
    """With untied embeddings, the model as a user trains it matches CPU on the plain lazy path."""
    _check(lambda: HF[name](tied=False), _hf_batches(), _hf_loss, dev, runs=RUNS[name], first_compiles=COMPILES[name])


@pytest.mark.parametrize("name", HF)
def test_hf_tied_trains_like_cpu(dev, name):
    """As configured (the LM head's weight is the word embedding), the model matches CPU."""
    _check(HF[name], _hf_batches(), _hf_loss, dev, runs=RUNS[name], first_compiles=COMPILES[name])


def test_hf_tied_weights_stay_one_parameter(dev):
    """`.to('lazy')` keeps GPT-2's lm_head.weight the same tensor as transformer.wte.weight, as `.to('cuda')` does."""
    model = _gpt2().to(dev)
    assert model.lm_head.weight is model.transformer.wte.weight
    assert len(list(model.parameters())) == len(list(_gpt2().parameters()))


@pytest.mark.parametrize("name", HF)
def test_hf_scripted_with_keywords_trains_like_cpu(dev, name):
    """`ratex.jit.script(model)` called as Hugging Face models are called (keywords; no padding
    mask, which the forward reads into Python) is scripted, one program a step, and matches CPU."""
    _check(lambda: HF[name](tied=False), _hf_batches(), _hf_loss_unmasked, dev, script=True)


@pytest.mark.parametrize("name", HF)
def test_hf_scripted_logits_train_like_cpu(dev, name):
    """A scripted wrapper that calls the model with token ids alone and returns its logits is one
    program a step, compiled once, and matches CPU."""
    _check(lambda: _Logits(HF[name](tied=False)), _hf_batches(), _logits_loss, dev, script=True)


class _TinyLM(nn.Module):
    """Embedding, linear head and the cross-entropy loss in one forward, as a Hugging Face LM with labels."""

    def __init__(self):
        super().__init__()
        self.emb = nn.Embedding(VOCAB, 16)
        self.head = nn.Linear(16, VOCAB)

    def forward(self, ids, labels):
        logits = self.head(self.emb(ids))
        return F.cross_entropy(logits.reshape(-1, VOCAB), labels.reshape(-1))


def test_scripted_model_with_its_loss(dev):
    """A scripted model that returns its own loss trains like CPU, its backward lowered to TVM."""
    _check(_TinyLM, _hf_batches(), lambda m, ids, mask, labels: m(ids, labels), dev, script=True)


# --------------------------------------------------------------------------- #
# more models
# --------------------------------------------------------------------------- #

def _t5(tied=True):
    cfg = transformers.T5Config(vocab_size=VOCAB, d_model=32, d_kv=8, d_ff=64, num_layers=2, num_decoder_layers=2,
                                num_heads=4, dropout_rate=0.0, pad_token_id=0, eos_token_id=1,
                                decoder_start_token_id=0, tie_word_embeddings=tied)
    return transformers.T5ForConditionalGeneration(cfg)


def _bart(tied=True):
    cfg = transformers.BartConfig(vocab_size=VOCAB, d_model=32, encoder_layers=2, decoder_layers=2,
                                  encoder_attention_heads=2, decoder_attention_heads=2, encoder_ffn_dim=64,
                                  decoder_ffn_dim=64, max_position_embeddings=32, dropout=0.0, attention_dropout=0.0,
                                  activation_dropout=0.0, pad_token_id=1, bos_token_id=0, eos_token_id=2,
                                  decoder_start_token_id=2, tie_word_embeddings=tied)
    return transformers.BartForConditionalGeneration(cfg)


SEQ2SEQ = {"t5": _t5, "bart": _bart}
# The padding mask read into Python (masking_utils, as for GPT-2 and BERT): twice a step in T5,
# three times in BART, so each step runs one program more than that. Two of the reads are the
# same graph in each, so the first step compiles one program fewer than it runs.
SEQ2SEQ_RUNS = {"t5": 3, "bart": 4}
SEQ2SEQ_COMPILES = {"t5": 2, "bart": 3}


@pytest.mark.parametrize("name", SEQ2SEQ)
def test_seq2seq_untied_trains_like_cpu(dev, name):
    """T5 and BART with an untied LM head, trained as a user trains them, match CPU."""
    _check(lambda: SEQ2SEQ[name](tied=False), _hf_batches(), _hf_loss, dev, runs=SEQ2SEQ_RUNS[name],
           first_compiles=SEQ2SEQ_COMPILES[name])


@pytest.mark.parametrize("name", SEQ2SEQ)
def test_seq2seq_tied_trains_like_cpu(dev, name):
    """T5 and BART as configured (LM head tied to the shared embedding) match CPU."""
    _check(SEQ2SEQ[name], _hf_batches(), _hf_loss, dev, runs=SEQ2SEQ_RUNS[name], first_compiles=SEQ2SEQ_COMPILES[name])


class _EncoderLM(nn.Module):
    """nn.TransformerEncoder over token embeddings, with a padding mask."""

    def __init__(self):
        super().__init__()
        self.emb = nn.Embedding(VOCAB, 32)
        layer = nn.TransformerEncoderLayer(32, 2, 64, dropout=0.0, batch_first=True)
        self.encoder = nn.TransformerEncoder(layer, 2, enable_nested_tensor=False)
        self.head = nn.Linear(32, VOCAB)

    def forward(self, ids, padding):
        return self.head(self.encoder(self.emb(ids), src_key_padding_mask=padding))


class _LSTMLM(nn.Module):
    def __init__(self):
        super().__init__()
        self.emb = nn.Embedding(VOCAB, 16)
        self.lstm = nn.LSTM(16, 32, batch_first=True)
        self.head = nn.Linear(32, VOCAB)

    def forward(self, ids):
        return self.head(self.lstm(self.emb(ids))[0])


def _lm_loss(model, ids, mask, labels):
    logits = model(ids, mask == 0) if isinstance(_unwrap(model), _EncoderLM) else model(ids)
    return F.cross_entropy(logits.reshape(-1, VOCAB), labels.reshape(-1))


def _unwrap(model):
    return getattr(model, "original_module", model)


class _Block(nn.Module):
    def __init__(self, cin, cout, stride):
        super().__init__()
        self.conv1 = nn.Conv2d(cin, cout, 3, stride, 1, bias=False)
        self.bn1 = nn.BatchNorm2d(cout)
        self.conv2 = nn.Conv2d(cout, cout, 3, 1, 1, bias=False)
        self.bn2 = nn.BatchNorm2d(cout)
        self.down = None if stride == 1 and cin == cout else nn.Sequential(
            nn.Conv2d(cin, cout, 1, stride, bias=False), nn.BatchNorm2d(cout))

    def forward(self, x):
        y = F.relu(self.bn1(self.conv1(x)))
        y = self.bn2(self.conv2(y))
        return F.relu(y + (x if self.down is None else self.down(x)))


class _ResNet(nn.Module):
    """A small ResNet: stem, two basic blocks (one strided), global average pool, linear."""

    def __init__(self):
        super().__init__()
        self.stem = nn.Sequential(nn.Conv2d(3, 8, 3, 1, 1, bias=False), nn.BatchNorm2d(8), nn.ReLU())
        self.blocks = nn.Sequential(_Block(8, 8, 1), _Block(8, 16, 2))
        self.pool = nn.AdaptiveAvgPool2d(1)
        self.fc = nn.Linear(16, 10)

    def forward(self, x):
        return self.fc(self.pool(self.blocks(self.stem(x))).flatten(1))


def _image_batches():
    g = torch.Generator().manual_seed(2)
    return [(torch.randn(4, 3, 12, 12, generator=g), torch.randint(0, 10, (4,), generator=g)) for _ in range(STEPS)]


def _image_loss(model, x, y):
    return F.cross_entropy(model(x), y)


OWN = {"encoder-padding-mask": (_EncoderLM, _hf_batches, _lm_loss), "lstm-lm": (_LSTMLM, _hf_batches, _lm_loss),
       "resnet-bn": (_ResNet, _image_batches, _image_loss)}


@pytest.mark.parametrize("name,script", [pytest.param(name, script, id=f"{name}-{'script' if script else 'lazy'}")
                                         for name in OWN for script in (False, True)])
def test_model_trains_like_cpu(dev, name, script):
    """Models built from torch.nn alone train like CPU, on the plain lazy path and scripted, one
    program a step."""
    make, batches, loss_fn = OWN[name]
    _check(make, batches(), loss_fn, dev, script=script)


@pytest.mark.parametrize("native_runner", [True, False], ids=["native-runner", "python-runner"])
def test_hf_in_place_updates_keep_no_old_tensor_objects(dev, monkeypatch, native_runner):
    """With ENABLE_PARAM_ALIASING a step writes each parameter and momentum into its own buffer;
    the tensor objects on that buffer must not grow by one a step (each a DLPack view keeping
    the step before's alive: a leak, and a chain whose final free recurses once per step)."""
    import gc

    from ratex import config

    monkeypatch.setattr(config, "PARAM_ALIASING", True)
    monkeypatch.setattr(config, "NATIVE_RUNNER", native_runner)
    monkeypatch.setattr(config, "GC_FREEZE", False)  # gc.get_objects() does not list frozen objects
    torch.manual_seed(0)
    model = _gpt2().to(dev)
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    weight = model.transformer.h[0].ln_1.weight

    def on_buffer(ptr):
        gc.collect()
        return sum(type(o) is torch.Tensor and o.data_ptr() == ptr for o in gc.get_objects())

    batches, counts, ptrs = _hf_batches(), [], []
    for step in range(10):
        opt.zero_grad()
        loss = _hf_loss(model, *(t.to(dev) for t in batches[step % len(batches)]))
        loss.backward()
        opt.step()
        lm.mark_step()
        loss.item()
        if step in (3, 9):
            ptrs.append(weight._device_data().data_ptr())
            counts.append(on_buffer(ptrs[-1]))
    assert ptrs[0] == ptrs[1], "the weight was not updated in place"
    assert counts[1] == counts[0], f"tensor objects on the weight's buffer grew from {counts[0]} to {counts[1]}"
