#!/usr/bin/env python
"""The model zoo: tiny Hugging Face models trained on ratex in each mode, against CPU PyTorch.

Each zoo model is built from a tiny config (random init, nothing downloaded) and trained
3 SGD steps, called as a Hugging Face user calls it (`model(**batch).loss`), on CPU and in
each mode:

  lazy     the model on the lazy device, `mark_step()` after each step
  script   `ratex.jit.script(model)` on the lazy device, called with the same keywords
  compile  the training step (forward, backward, SGD update) under
           `torch.compile(backend="ratex")`, on CPU tensors

SGD, not Adam: Adam's step is about lr whatever a gradient's size, so a gradient that is
float noise (an attention key bias) would part CPU and ratex by lr a step.

One row per model and mode:

  status    pass      losses, final parameters and buffers (BatchNorm's running statistics)
                      match CPU (rtol 1e-4, atol 1e-5), nothing ran on CPU PyTorch
            fallback  they match, but some `aten::<op>` counter moved (an op ran on CPU)
            fail      a mismatch or an exception (`error` says which)
  fallbacks the `aten::<op>` counters that moved
  compiles  programs compiled at each step (the compile caches start empty)
  runs      programs run at each step (lazy and script: a value read into Python in the
            middle of a step, as transformers' masking code does, cuts the step in two)
  capture   script: how the forward was captured (`trace`, `export`), or `none` where
            `ratex.jit.script` warned and ran the model on the plain lazy device;
            compile: the graphs dynamo captured and the graph breaks it took

    python scripts/zoo.py                       # every model in every mode: the table
    python scripts/zoo.py --models llama,vit --modes script -v
    python scripts/zoo.py --write               # ... and record tests/zoo_expectations.json
    python scripts/zoo.py --one llama script    # one model and mode in this process (JSON)

Each model and mode runs in a subprocess of its own (`--workers` at a time), so a crash or
a hang (`--timeout`) costs that row only. With RATEX_DEVICE=GPU the lazy and script modes run
on the GPU and are still compared with CPU PyTorch.
"""
import argparse
import copy
import json
import os
import subprocess
import sys
import time
import warnings
from concurrent.futures import ThreadPoolExecutor

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
EXPECTATIONS = os.path.join(ROOT, "tests", "zoo_expectations.json")
MODES = ("lazy", "script", "compile")
STEPS = 3
LR = 0.1
RTOL, ATOL = 1e-4, 1e-5
VOCAB, SEQ, BATCH = 64, 8, 2


# --------------------------------------------------------------------------- #
# the models (tiny configs: 2 layers, width 32)
# --------------------------------------------------------------------------- #

def _tf():
    import transformers  # noqa: PLC0415  (imported where a model is built: the table needs none)

    return transformers


def gpt2():
    t = _tf()
    return t.GPT2LMHeadModel(t.GPT2Config(vocab_size=VOCAB, n_positions=32, n_embd=32, n_layer=2, n_head=2,
                                          resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, bos_token_id=0,
                                          eos_token_id=0))


def bert():
    t = _tf()
    return t.BertForMaskedLM(t.BertConfig(vocab_size=VOCAB, hidden_size=32, num_hidden_layers=2,
                                          num_attention_heads=2, intermediate_size=64, max_position_embeddings=32,
                                          hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0, pad_token_id=0))


def llama():
    t = _tf()
    return t.LlamaForCausalLM(t.LlamaConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=64,
                                            num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                                            max_position_embeddings=32, bos_token_id=0, eos_token_id=0,
                                            pad_token_id=0, tie_word_embeddings=False))


def mistral():
    t = _tf()
    return t.MistralForCausalLM(t.MistralConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=64,
                                                num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                                                max_position_embeddings=32, sliding_window=4, pad_token_id=0))


def qwen2():
    t = _tf()
    return t.Qwen2ForCausalLM(t.Qwen2Config(vocab_size=VOCAB, hidden_size=32, intermediate_size=64,
                                            num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                                            max_position_embeddings=32, tie_word_embeddings=True, pad_token_id=0))


def gemma():
    t = _tf()
    return t.GemmaForCausalLM(t.GemmaConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=64,
                                            num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=1,
                                            head_dim=8, max_position_embeddings=32, pad_token_id=0))


def phi():
    t = _tf()
    return t.PhiForCausalLM(t.PhiConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                        num_attention_heads=4, max_position_embeddings=32, resid_pdrop=0.0,
                                        embd_pdrop=0.0, attention_dropout=0.0, partial_rotary_factor=0.5,
                                        pad_token_id=0))


def gptneo():
    t = _tf()
    return t.GPTNeoForCausalLM(t.GPTNeoConfig(vocab_size=VOCAB, hidden_size=32, num_layers=2, num_heads=2,
                                              attention_types=[[["global", "local"], 1]], max_position_embeddings=32,
                                              window_size=4, embed_dropout=0.0, attention_dropout=0.0,
                                              resid_dropout=0.0, pad_token_id=0))


def opt():
    t = _tf()
    return t.OPTForCausalLM(t.OPTConfig(vocab_size=VOCAB, hidden_size=32, num_hidden_layers=2, ffn_dim=64,
                                        num_attention_heads=2, max_position_embeddings=32, dropout=0.0,
                                        attention_dropout=0.0, word_embed_proj_dim=32, pad_token_id=1))


def distilbert():
    t = _tf()
    return t.DistilBertForMaskedLM(t.DistilBertConfig(vocab_size=VOCAB, dim=32, n_layers=2, n_heads=2, hidden_dim=64,
                                                      max_position_embeddings=32, dropout=0.0,
                                                      attention_dropout=0.0))


def roberta():
    t = _tf()
    return t.RobertaForMaskedLM(t.RobertaConfig(vocab_size=VOCAB, hidden_size=32, num_hidden_layers=2,
                                                num_attention_heads=2, intermediate_size=64,
                                                max_position_embeddings=40, hidden_dropout_prob=0.0,
                                                attention_probs_dropout_prob=0.0, pad_token_id=1))


def electra():
    t = _tf()
    return t.ElectraForMaskedLM(t.ElectraConfig(vocab_size=VOCAB, embedding_size=16, hidden_size=32,
                                                num_hidden_layers=2, num_attention_heads=2, intermediate_size=64,
                                                max_position_embeddings=32, hidden_dropout_prob=0.0,
                                                attention_probs_dropout_prob=0.0))


def albert():
    t = _tf()
    return t.AlbertForMaskedLM(t.AlbertConfig(vocab_size=VOCAB, embedding_size=16, hidden_size=32,
                                              num_hidden_layers=2, num_attention_heads=2, intermediate_size=64,
                                              max_position_embeddings=32, hidden_dropout_prob=0.0,
                                              attention_probs_dropout_prob=0.0))


def t5():
    t = _tf()
    return t.T5ForConditionalGeneration(t.T5Config(vocab_size=VOCAB, d_model=32, d_kv=8, d_ff=64, num_layers=2,
                                                   num_decoder_layers=2, num_heads=4, dropout_rate=0.0,
                                                   pad_token_id=0, eos_token_id=1, decoder_start_token_id=0))


def bart():
    t = _tf()
    return t.BartForConditionalGeneration(t.BartConfig(
        vocab_size=VOCAB, d_model=32, encoder_layers=2, decoder_layers=2, encoder_attention_heads=2,
        decoder_attention_heads=2, encoder_ffn_dim=64, decoder_ffn_dim=64, max_position_embeddings=32, dropout=0.0,
        attention_dropout=0.0, activation_dropout=0.0, pad_token_id=1, bos_token_id=0, eos_token_id=2,
        decoder_start_token_id=2))


def bloom():
    """ALiBi position biases, baddbmm attention."""
    t = _tf()
    return t.BloomForCausalLM(t.BloomConfig(vocab_size=VOCAB, hidden_size=32, n_layer=2, n_head=4, hidden_dropout=0.0,
                                            attention_dropout=0.0, pad_token_id=0))


def falcon():
    """Multi-query attention, parallel attention and MLP."""
    t = _tf()
    return t.FalconForCausalLM(t.FalconConfig(vocab_size=VOCAB, hidden_size=32, num_hidden_layers=2,
                                              num_attention_heads=4, hidden_dropout=0.0, attention_dropout=0.0,
                                              pad_token_id=0))


def gptneox():
    """Rotary embeddings on part of each head, parallel residual."""
    t = _tf()
    return t.GPTNeoXForCausalLM(t.GPTNeoXConfig(vocab_size=VOCAB, hidden_size=32, num_hidden_layers=2,
                                                num_attention_heads=4, intermediate_size=64, max_position_embeddings=32,
                                                rotary_pct=0.5, hidden_dropout=0.0, attention_dropout=0.0,
                                                pad_token_id=0))


def gptj():
    """Interleaved rotary embeddings (rotate every two)."""
    t = _tf()
    return t.GPTJForCausalLM(t.GPTJConfig(vocab_size=VOCAB, n_embd=32, n_layer=2, n_head=4, n_positions=32,
                                          rotary_dim=4, resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0,
                                          pad_token_id=0))


def mixtral():
    """A mixture of experts: top-2 routing over 4 experts."""
    t = _tf()
    return t.MixtralForCausalLM(t.MixtralConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=64,
                                                num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                                                num_local_experts=4, num_experts_per_tok=2, max_position_embeddings=32,
                                                pad_token_id=0))


def gemma2():
    """Logit soft-capping, alternating sliding-window layers, norms after each block."""
    t = _tf()
    return t.Gemma2ForCausalLM(t.Gemma2Config(vocab_size=VOCAB, hidden_size=32, intermediate_size=64,
                                              num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                                              head_dim=8, max_position_embeddings=32, sliding_window=4,
                                              pad_token_id=0))


def qwen3():
    """RMSNorm on each query and key head."""
    t = _tf()
    return t.Qwen3ForCausalLM(t.Qwen3Config(vocab_size=VOCAB, hidden_size=32, intermediate_size=64,
                                            num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                                            head_dim=8, max_position_embeddings=32, pad_token_id=0))


def debertav2():
    """Disentangled attention: relative positions in log buckets, gathered per query and key."""
    t = _tf()
    return t.DebertaV2ForMaskedLM(t.DebertaV2Config(vocab_size=VOCAB, hidden_size=32, num_hidden_layers=2,
                                                    num_attention_heads=2, intermediate_size=64,
                                                    max_position_embeddings=32, relative_attention=True,
                                                    position_buckets=8, pos_att_type=["p2c", "c2p"],
                                                    hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0,
                                                    pad_token_id=0))


def mobilebert():
    """Bottlenecks, stacked feed-forwards, NoNorm (an elementwise affine in place of LayerNorm)."""
    t = _tf()
    return t.MobileBertForMaskedLM(t.MobileBertConfig(vocab_size=VOCAB, hidden_size=32, embedding_size=16,
                                                      num_hidden_layers=2, num_attention_heads=2, intermediate_size=32,
                                                      intra_bottleneck_size=16, true_hidden_size=16,
                                                      num_feedforward_networks=2, max_position_embeddings=32,
                                                      hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0,
                                                      pad_token_id=0))


def convbert():
    """Span-based dynamic convolution: a separable conv1d and unfold beside attention."""
    t = _tf()
    return t.ConvBertForMaskedLM(t.ConvBertConfig(vocab_size=VOCAB, hidden_size=32, embedding_size=32,
                                                  num_hidden_layers=2, num_attention_heads=2, intermediate_size=64,
                                                  conv_kernel_size=3, head_ratio=2, max_position_embeddings=32,
                                                  hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0,
                                                  pad_token_id=0))


IMAGE, PATCH, CLASSES = 16, 4, 5


def vit():
    t = _tf()
    return t.ViTForImageClassification(t.ViTConfig(image_size=IMAGE, patch_size=PATCH, num_channels=3, hidden_size=32,
                                                   num_hidden_layers=2, num_attention_heads=2, intermediate_size=64,
                                                   hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0,
                                                   num_labels=CLASSES))


def swin():
    """Shifted windows (roll), window partitions, a relative position bias table."""
    t = _tf()
    return t.SwinForImageClassification(t.SwinConfig(image_size=IMAGE, patch_size=2, num_channels=3, embed_dim=16,
                                                     depths=[1, 1], num_heads=[2, 2], window_size=4,
                                                     num_labels=CLASSES, hidden_dropout_prob=0.0,
                                                     attention_probs_dropout_prob=0.0, drop_path_rate=0.0))


def convnext():
    """Depthwise 7x7 convolutions, channels-last LayerNorm, layer scale."""
    t = _tf()
    return t.ConvNextForImageClassification(t.ConvNextConfig(num_channels=3, patch_size=2, num_stages=2,
                                                             hidden_sizes=[8, 16], depths=[1, 1], num_labels=CLASSES,
                                                             image_size=IMAGE, drop_path_rate=0.0))


def resnet():
    """Bottleneck blocks with BatchNorm (running statistics updated in training)."""
    t = _tf()
    return t.ResNetForImageClassification(t.ResNetConfig(num_channels=3, embedding_size=8, hidden_sizes=[8, 16],
                                                         depths=[1, 1], layer_type="bottleneck", num_labels=CLASSES))


MELS, FRAMES = 8, 16  # Whisper's two conv1d layers halve the frames: 8 encoder positions


def whisper():
    t = _tf()
    return t.WhisperForConditionalGeneration(t.WhisperConfig(
        vocab_size=VOCAB, num_mel_bins=MELS, d_model=32, encoder_layers=2, decoder_layers=2,
        encoder_attention_heads=2, decoder_attention_heads=2, encoder_ffn_dim=64, decoder_ffn_dim=64,
        max_source_positions=FRAMES // 2, max_target_positions=32, dropout=0.0, attention_dropout=0.0,
        activation_dropout=0.0, pad_token_id=1, bos_token_id=0, eos_token_id=2, decoder_start_token_id=0,
        suppress_tokens=None, begin_suppress_tokens=None))


SAMPLES = 400  # raw audio: Wav2Vec2's convolutions (kernel 10 stride 5, kernel 3 stride 2) make 39 frames


def wav2vec2():
    """A conv1d feature encoder with GroupNorm, a grouped convolutional position embedding."""
    t = _tf()
    return t.Wav2Vec2ForSequenceClassification(t.Wav2Vec2Config(
        vocab_size=VOCAB, hidden_size=32, num_hidden_layers=2, num_attention_heads=2, intermediate_size=64,
        conv_dim=(16, 16), conv_stride=(5, 2), conv_kernel=(10, 3), num_conv_pos_embeddings=8,
        num_conv_pos_embedding_groups=4, num_labels=CLASSES, hidden_dropout=0.0, attention_dropout=0.0,
        activation_dropout=0.0, feat_proj_dropout=0.0, layerdrop=0.0, mask_time_prob=0.0, final_dropout=0.0,
        feat_extract_norm="group"))


def _text_batches():
    """Token ids, a padding mask (the second sequence 3 tokens shorter) and labels (-100 on padding)."""
    import torch  # noqa: PLC0415

    g = torch.Generator().manual_seed(1)
    out = []
    for _ in range(STEPS):
        ids = torch.randint(2, VOCAB, (BATCH, SEQ), generator=g)
        mask = torch.ones_like(ids)
        mask[1, SEQ - 3:] = 0
        out.append({"input_ids": ids, "attention_mask": mask, "labels": ids.masked_fill(mask == 0, -100)})
    return out


def _image_batches():
    import torch  # noqa: PLC0415

    g = torch.Generator().manual_seed(2)
    return [{"pixel_values": torch.randn(BATCH, 3, IMAGE, IMAGE, generator=g),
             "labels": torch.randint(0, CLASSES, (BATCH,), generator=g)} for _ in range(STEPS)]


def _speech_batches():
    """Log-mel frames and decoder labels (-100 on the second sequence's last 2)."""
    import torch  # noqa: PLC0415

    g = torch.Generator().manual_seed(3)
    out = []
    for _ in range(STEPS):
        labels = torch.randint(3, VOCAB, (BATCH, SEQ), generator=g)
        labels[1, SEQ - 2:] = -100
        out.append({"input_features": torch.randn(BATCH, MELS, FRAMES, generator=g), "labels": labels})
    return out


def _audio_batches():
    import torch  # noqa: PLC0415

    g = torch.Generator().manual_seed(4)
    return [{"input_values": torch.randn(BATCH, SAMPLES, generator=g),
             "labels": torch.randint(0, CLASSES, (BATCH,), generator=g)} for _ in range(STEPS)]


# name -> (build, batches)
MODELS = {
    "gpt2": (gpt2, _text_batches), "bert": (bert, _text_batches), "llama": (llama, _text_batches),
    "mistral": (mistral, _text_batches), "qwen2": (qwen2, _text_batches), "gemma": (gemma, _text_batches),
    "phi": (phi, _text_batches), "gptneo": (gptneo, _text_batches), "opt": (opt, _text_batches),
    "distilbert": (distilbert, _text_batches), "roberta": (roberta, _text_batches),
    "electra": (electra, _text_batches), "albert": (albert, _text_batches), "t5": (t5, _text_batches),
    "bart": (bart, _text_batches), "vit": (vit, _image_batches), "whisper": (whisper, _speech_batches),
    "bloom": (bloom, _text_batches), "falcon": (falcon, _text_batches), "gptneox": (gptneox, _text_batches),
    "gptj": (gptj, _text_batches), "mixtral": (mixtral, _text_batches), "gemma2": (gemma2, _text_batches),
    "qwen3": (qwen3, _text_batches), "debertav2": (debertav2, _text_batches),
    "mobilebert": (mobilebert, _text_batches), "convbert": (convbert, _text_batches),
    "swin": (swin, _image_batches), "convnext": (convnext, _image_batches),
    "wav2vec2": (wav2vec2, _audio_batches), "resnet": (resnet, _image_batches),
}


# --------------------------------------------------------------------------- #
# one model in one mode (in this process)
# --------------------------------------------------------------------------- #

def _train(model, batches, device, mode):
    """Train 3 SGD steps; return (losses, compiles per step, runs per step, the model trained)."""
    import torch  # noqa: PLC0415

    import ratex  # noqa: PLC0415
    import ratex.lazy_tensor_core.core.lazy_model as lm  # noqa: PLC0415
    from ratex.lazy_tensor_core.debug import metrics  # noqa: PLC0415

    if mode == "script":
        model = ratex.jit.script(model)
    opt = torch.optim.SGD(model.parameters(), lr=LR)

    def step(batch):
        opt.zero_grad()
        loss = model(**batch).loss
        loss.backward()
        opt.step()
        return loss

    if mode == "compile":
        step = torch.compile(step, backend="ratex")
    losses, compiles, runs = [], [], []
    for batch in batches:
        before = [metrics.counter_value(c) or 0 for c in ("UncachedCompile", "CachedCompile")]
        loss = step({k: v.to(device) for k, v in batch.items()})
        if device.type == "lazy":
            lm.mark_step()
        losses.append(loss.item())
        miss, hit = (metrics.counter_value(c) or 0 for c in ("UncachedCompile", "CachedCompile"))
        compiles.append(miss - before[0])
        runs.append(miss + hit - sum(before))
    return losses, compiles, runs, model


def _worst(got, want):
    """(how far past the tolerance, name) of the worst tensor: <= 1 is within it."""
    import torch  # noqa: PLC0415

    worst = (0.0, "")
    for name, w in want.items():
        g = got[name].detach().cpu().double()
        w = w.detach().double()
        excess = ((g - w).abs() / (ATOL + RTOL * w.abs())).max().item() if w.numel() else 0.0
        if not torch.isfinite(g).all() and torch.isfinite(w).all():
            excess = float("inf")
        worst = max(worst, (excess, name))
    return worst


def check(name, mode) -> dict:
    """Train zoo model `name` in `mode` and on CPU; return the row (see the module doc)."""
    import torch  # noqa: PLC0415

    import ratex  # noqa: PLC0415,F401
    from ratex.core import sync  # noqa: PLC0415
    from ratex.lazy_tensor_core.debug import metrics  # noqa: PLC0415

    if mode not in MODES:
        raise ValueError(f"mode {mode!r}: the zoo's modes are {', '.join(MODES)}")
    build, make_batches = MODELS[name]
    torch.manual_seed(0)
    ref = build().train()
    model = copy.deepcopy(ref)
    batches = make_batches()
    want, _, _, _ = _train(ref, batches, torch.device("cpu"), "eager")
    device = torch.device("cpu") if mode == "compile" else torch.device("lazy", 0)
    model.to(device)
    sync.reset_cache()
    metrics.reset()
    row = {"status": "fail"}
    if mode == "compile":
        import torch._dynamo  # noqa: PLC0415

        torch._dynamo.reset()
        torch._dynamo.utils.counters.clear()
    t0 = time.time()
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            got, compiles, runs, trained = _train(model, batches, device, mode)
    except Exception as exc:  # noqa: BLE001  (a row that raised is a row that failed)
        row["error"] = _short(exc)
        row["seconds"] = round(time.time() - t0, 1)
        return row
    row["seconds"] = round(time.time() - t0, 1)
    row["fallbacks"] = sorted(c for c in metrics.counter_names() if c.startswith("aten::"))
    row["compiles"] = compiles
    if mode != "compile":
        row["runs"] = runs
    row["capture"] = _capture(mode, trained)
    notes = sorted({_clip(str(w.message)) for w in caught if "ratex" in str(w.message)})
    if notes:
        row["warnings"] = notes
    loss_excess = max(abs(g - w) / (ATOL + RTOL * abs(w)) for g, w in zip(got, want))
    # parameters and buffers (BatchNorm's running statistics, its batch count)
    trained = getattr(trained, "original_module", trained)
    want_state = {**dict(ref.named_parameters(remove_duplicate=False)), **dict(ref.named_buffers(remove_duplicate=False))}
    got_state = {**dict(trained.named_parameters(remove_duplicate=False)),
                 **dict(trained.named_buffers(remove_duplicate=False))}
    excess, where = _worst(got_state, want_state)
    row["losses"] = [round(x, 6) for x in got]
    row["worst"] = f"{excess:.3g} x tolerance ({where})"
    if not loss_excess <= 1:
        row["error"] = f"losses {row['losses']}, CPU's {[round(x, 6) for x in want]}"
    elif not excess <= 1:
        row["error"] = f"{where} off by {excess:.3g} x the tolerance after {STEPS} steps"
    else:
        row["status"] = "fallback" if row["fallbacks"] else "pass"
    return row


def _capture(mode, model) -> str:
    """How the mode captured the model (see the module doc); '' for the lazy mode."""
    if mode == "script":
        hows = sorted({getattr(e, "capture", "script" if e.key else None) or "none" for e in model._entries.values()})
        return ",".join(hows) or "none"
    if mode == "compile":
        from torch._dynamo.utils import counters  # noqa: PLC0415

        graphs = counters["stats"]["unique_graphs"]
        breaks = sum(counters["graph_break"].values())
        return f"{graphs} graphs, {breaks} breaks"
    return ""


def _clip(text, head=200, tail=600) -> str:
    """`text` on one line, its middle elided where long (a lowering error's node lists every input)."""
    text = " ".join(text.split())
    return text if len(text) <= head + tail else text[:head] + " ... " + text[-tail:]


def _short(exc, limit=300) -> str:
    lines = str(exc).strip().splitlines()
    return f"{type(exc).__name__}: {lines[0] if lines else ''}"[:limit]


def expectation(row) -> dict:
    """What the expectations file records of a row: status, fallbacks, compiles, runs, capture."""
    rec = {"status": row["status"]}
    for k in ("fallbacks", "compiles", "runs", "capture"):
        if k in row:
            rec[k] = row[k]
    if row["status"] == "fail":
        rec["error"] = row.get("error", "")
    return rec


# --------------------------------------------------------------------------- #
# the sweep
# --------------------------------------------------------------------------- #

def _run_one(name, mode, timeout):
    env = dict(os.environ, RATEX_CACHE_DIR="", RATEX_WARN_COMPILES="0", PYTHONWARNINGS="ignore")
    cmd = [sys.executable, os.path.abspath(__file__), "--one", name, mode]
    try:
        proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired:
        return {"status": "fail", "error": f"timeout: more than {timeout:.0f} s"}
    for line in reversed(proc.stdout.splitlines()):
        if line.startswith("{"):
            return json.loads(line)
    tail = (proc.stderr.strip().splitlines() or [""])[-1]
    return {"status": "fail", "error": f"crash: exit code {proc.returncode}: {tail[:250]}"}


def _cell(row) -> str:
    return " ".join(str(x) for x in row) if isinstance(row, list) else str(row)


def print_table(results, models, modes):
    """One line per model and mode."""
    head = f"{'model':10s} {'mode':8s} {'status':8s} {'compiles':9s} {'runs':7s} {'capture':22s} fallbacks / error"
    print(head)
    print("-" * len(head))
    for name in models:
        for mode in modes:
            r = results.get((name, mode))
            if r is None:
                continue
            extra = r.get("error") or ", ".join(r.get("fallbacks", []))
            print(f"{name:10s} {mode:8s} {r['status']:8s} {_cell(r.get('compiles', '-')):9s} "
                  f"{_cell(r.get('runs', '-')):7s} {r.get('capture', '') or '-':22s} {extra}")
    print()
    for mode in modes:
        rows = [results[(n, mode)] for n in models if (n, mode) in results]
        counts = {s: sum(r["status"] == s for r in rows) for s in ("pass", "fallback", "fail")}
        print(f"{mode:8s}: {len(rows)} models: pass {counts['pass']}, fallback {counts['fallback']}, "
              f"fail {counts['fail']}")


def _write(path, results):
    old = {}
    if os.path.exists(path):
        with open(path) as f:
            old = json.load(f)
    for (name, mode), row in results.items():
        old.setdefault(mode, {})[name] = expectation(row)
    out = {mode: dict(sorted(old[mode].items())) for mode in MODES if mode in old}
    with open(path, "w") as f:
        json.dump(out, f, indent=1, sort_keys=True)
        f.write("\n")
    print(f"wrote {path}")


def _names(text, known, what):
    if not text:
        return list(known)
    names = text.split(",")
    unknown = [n for n in names if n not in known]
    if unknown:
        raise SystemExit(f"no zoo {what} named {', '.join(unknown)}; the zoo has {', '.join(known)}")
    return names


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--models", help="comma-separated zoo models (default: all)")
    p.add_argument("--modes", help="comma-separated modes among lazy, script, compile (default: all)")
    p.add_argument("--workers", type=int, default=2, help="models trained at a time, each in a subprocess")
    p.add_argument("--timeout", type=float, default=900.0, help="seconds per model and mode")
    p.add_argument("--write", action="store_true",
                   help="record the rows in tests/zoo_expectations.json (merged into what it holds)")
    p.add_argument("--details", help="write every row, losses and warnings included, to this JSON file")
    p.add_argument("--verbose", "-v", action="store_true", help="print each row as it comes")
    p.add_argument("--one", nargs=2, metavar=("MODEL", "MODE"), help="run one model and mode here; print its row")
    a = p.parse_args(argv)
    if a.one:
        name, mode = a.one
        _names(name, MODELS, "model")
        _names(mode, MODES, "mode")
        print(json.dumps(check(name, mode)))
        return 0
    models, modes = _names(a.models, MODELS, "model"), _names(a.modes, MODES, "mode")
    tasks = [(n, m) for n in models for m in modes]
    print(f"{len(tasks)} rows, {a.workers} workers", flush=True)
    results, t0 = {}, time.time()

    def run(task):
        row = _run_one(*task, a.timeout)
        results[task] = row
        if a.verbose:
            extra = row.get("error") or ", ".join(row.get("fallbacks", []))
            print(f"[{len(results)}/{len(tasks)} {time.time() - t0:5.0f}s] {task[0]:10s} {task[1]:8s} "
                  f"{row['status']:8s} {row.get('seconds', 0):5.1f}s {row.get('capture', '')} {extra[:150]}",
                  flush=True)

    with ThreadPoolExecutor(a.workers) as pool:
        list(pool.map(run, tasks))
    print(f"done in {time.time() - t0:.0f} s\n")
    print_table(results, models, modes)
    if a.details:
        with open(a.details, "w") as f:
            json.dump({f"{n} {m}": r for (n, m), r in sorted(results.items())}, f, indent=1)
    if a.write:
        _write(EXPECTATIONS, results)
    return 0


if __name__ == "__main__":
    sys.exit(main())
