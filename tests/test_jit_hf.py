"""ratex.jit.script on tiny Hugging Face GPT-2 and BERT models called with keyword arguments."""
import copy

import pytest
import torch

from ratex import jit
from ratex.lazy_tensor_core.core import lazy_model as lm
from ratex.lazy_tensor_core.debug import metrics

transformers = pytest.importorskip("transformers")

RTOL, ATOL = 1e-4, 1e-5
VOCAB, BATCH, SEQ = 100, 2, 8


def _gpt2(tied):
    # Dropout off: the CPU reference draws its masks with other ops than the lazy device.
    cfg = transformers.GPT2Config(n_layer=2, n_head=2, n_embd=32, vocab_size=VOCAB, n_positions=64,
                                  resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, tie_word_embeddings=tied,
                                  bos_token_id=0, eos_token_id=0)
    return transformers.GPT2LMHeadModel(cfg)


def _bert():
    cfg = transformers.BertConfig(hidden_size=32, num_hidden_layers=2, num_attention_heads=2, intermediate_size=64,
                                  vocab_size=VOCAB, hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0)
    return transformers.BertForSequenceClassification(cfg)


def _batch(step, lm_labels):
    """Keyword arguments of one step: the second sequence padded (mask 0, label -100 where padded)."""
    g = torch.Generator().manual_seed(step)
    ids = torch.randint(0, VOCAB, (BATCH, SEQ), generator=g)
    mask = torch.ones(BATCH, SEQ, dtype=torch.long)
    mask[1, SEQ - 2 :] = 0
    if lm_labels:
        labels = ids.clone()
        labels[1, SEQ - 2 :] = -100
    else:
        labels = torch.randint(0, 2, (BATCH,), generator=g)
    return {"input_ids": ids, "attention_mask": mask, "labels": labels}


def _train(build, dev, lm_labels, steps=3):
    """Train a scripted lazy copy and the CPU model on the same keyword batches; return both
    models' losses, and the lazy model (its outputs' type is checked on the way)."""
    torch.manual_seed(0)
    ref = build().train()
    model = copy.deepcopy(ref).to(dev)
    scripted = jit.script(model)
    opt = torch.optim.SGD(scripted.parameters(), lr=0.5)
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.5)
    losses, ref_losses = [], []
    for step in range(steps):
        batch = _batch(step, lm_labels)
        out = scripted(**{k: v.to(dev) for k, v in batch.items()})
        ref_out = ref(**batch)
        assert type(out) is type(ref_out) and list(out.keys()) == list(ref_out.keys())
        opt.zero_grad()
        out.loss.backward()
        opt.step()
        lm.mark_step()
        ref_opt.zero_grad()
        ref_out.loss.backward()
        ref_opt.step()
        losses.append(out.loss.detach().cpu())
        ref_losses.append(ref_out.loss.detach())
    return losses, ref_losses, model


def _assert_scripted(steps=3):
    assert metrics.counter_value("ratex::script_fwd.default") == steps
    assert metrics.counter_value("ratex::script_bwd.default") == steps
    fallbacks = [n for n in metrics.counter_names() if n.startswith("aten::")]
    assert not fallbacks, fallbacks


def test_gpt2_lm_with_keywords_trains_like_cpu(dev):
    losses, ref_losses, _ = _train(lambda: _gpt2(tied=False), dev, lm_labels=True)
    _assert_scripted()
    torch.testing.assert_close(torch.stack(losses), torch.stack(ref_losses), rtol=RTOL, atol=ATOL)


def test_gpt2_lm_with_tied_embeddings_trains_like_cpu(dev):
    losses, ref_losses, model = _train(lambda: _gpt2(tied=True), dev, lm_labels=True)
    _assert_scripted()
    torch.testing.assert_close(losses[0], ref_losses[0], rtol=RTOL, atol=ATOL)  # before any update
    if model.lm_head.weight is not model.transformer.wte.weight:
        pytest.xfail("moving the model to the lazy device unties lm_head.weight from wte.weight "
                     "(the tied-weights fix in ratex/core is another branch's)")
    torch.testing.assert_close(torch.stack(losses), torch.stack(ref_losses), rtol=RTOL, atol=ATOL)


def test_bert_classifier_with_keywords_trains_like_cpu(dev):
    losses, ref_losses, _ = _train(_bert, dev, lm_labels=False)
    _assert_scripted()
    torch.testing.assert_close(torch.stack(losses), torch.stack(ref_losses), rtol=RTOL, atol=ATOL)
