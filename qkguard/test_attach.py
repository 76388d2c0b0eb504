"""qkguard (hooks.py, example.py): QK-Guard on models it does not own, one adapter at a time.

Each adapter's signal is checked against the logits the model itself computes: a spy on
F.scaled_dot_product_attention, through which every model here attends, records the q and k that
reach it, and the max logit follows in float64. The Hugging Face adapters' tests need transformers
and skip without it; everything else runs without it.
"""
import copy
import math
import os
import re
import subprocess
import sys
import types
from contextlib import contextmanager

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import model as model_lib
import qkguard                            # the public API: qkguard.attach(...), qkguard.Layer, ...
from qkguard import example, hooks        # hooks: the signals' internals (sample_rows, sampled_max_logit)
from qkguard import serve
from qkguard.example import NanoGPT
from qkguard._loop import GuardLoop

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
README = os.path.join(HERE, "README.md")
VOCAB, T, BATCH = example.VOCAB, example.BLOCK, 2


# --------------------------------------------------------------------------------------------------
# The models under test: name -> (model, loss(model, x, y)), built from a config, no download

def build(name, dropout=0.0, seed=0):
    torch.manual_seed(seed)
    if name.startswith("qkguard-gpt"):
        cfg = model_lib.GPTConfig(arch="llama" if name.endswith("llama") else "gpt2", n_layer=2, n_head=4, n_embd=64,
                                  block_size=T, vocab_size=VOCAB, dropout=dropout, attn_impl="sdpa",
                                  attn_dtype="native", max_logit=False)
        return model_lib.GPT(cfg), lambda m, x, y: m(x, y)[1]
    if name == "nanogpt":
        return NanoGPT(dropout=dropout), lambda m, x, y: m(x, y)[1]
    transformers = pytest.importorskip("transformers")
    hf_loss = lambda m, x, y: m(input_ids=x, labels=x).loss           # Hugging Face shifts the labels itself
    if name == "hf-gpt2":
        cfg = transformers.GPT2Config(n_layer=2, n_head=4, n_embd=64, n_positions=T, vocab_size=VOCAB,
                                      resid_pdrop=dropout, embd_pdrop=dropout, attn_pdrop=dropout,
                                      bos_token_id=0, eos_token_id=0)
        return transformers.GPT2LMHeadModel(cfg), hf_loss
    cfg = transformers.LlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                                   num_key_value_heads=2, vocab_size=VOCAB, max_position_embeddings=T,
                                   attention_dropout=dropout, bos_token_id=0, eos_token_id=0, pad_token_id=0)
    return transformers.LlamaForCausalLM(cfg), hf_loss


MODELS = ["qkguard-gpt", "qkguard-gpt-llama", "nanogpt", "hf-gpt2", "hf-llama"]
ADAPTER = {"qkguard-gpt": "qkguard-gpt", "qkguard-gpt-llama": "qkguard-gpt", "nanogpt": "nanogpt",
           "hf-gpt2": "hf-gpt2", "hf-llama": "hf-llama"}


def batch(seed=1):
    tokens = torch.randint(0, VOCAB, (BATCH, T + 1), generator=torch.Generator().manual_seed(seed))
    return tokens[:, :-1], tokens[:, 1:]


@contextmanager
def spied_attention(monkeypatch):
    """Record each attention's q, k (as float64) and scale as they reach F.scaled_dot_product_attention."""
    calls, real = [], F.scaled_dot_product_attention

    def spy(q, k, v, *args, scale=None, enable_gqa=False, **kwargs):
        k64 = k.detach().double()
        if k.shape[1] != q.shape[1]:          # GQA inside SDPA: query head h reads key head h // group
            k64 = k64.repeat_interleave(q.shape[1] // k.shape[1], dim=1)
        calls.append((q.detach().double(), k64, 1 / math.sqrt(q.shape[-1]) if scale is None else scale))
        return real(q, k, v, *args, scale=scale, enable_gqa=enable_gqa, **kwargs)
    monkeypatch.setattr(torch.nn.functional, "scaled_dot_product_attention", spy)
    yield calls
    monkeypatch.setattr(torch.nn.functional, "scaled_dot_product_attention", real)


def dense_logits(q, k, scale):
    """(B, H, T, T) float64 logits, -inf above the diagonal (the causal mask)."""
    s = q @ k.mT * scale
    return s.masked_fill(~torch.ones(s.shape[-2:], dtype=torch.bool).tril(), -math.inf)


def dense_max_logit(calls):
    """(n_layer, n_head): each call's max over the batch, all query rows and the keys they see."""
    return torch.stack([dense_logits(q, k, s).amax(dim=(0, 2, 3)) for q, k, s in calls])


def inflate_qk(model, factor=30.0):
    """W_q and W_k times `factor`, found by name as each model spells them (not through the adapter)."""
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith(("q_proj.weight", "k_proj.weight", "c_attn.weight")):
                p.mul_(factor)


def train_steps(model, loss_of, guard, steps, lr=1e-3):
    """`steps` AdamW updates on fixed batches; guard.step() after each if a guard is given."""
    optimizer = torch.optim.AdamW(model.parameters(), lr=lr)
    losses = []
    for step in range(steps):
        loss = loss_of(model, *batch(seed=step))
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item())
        if guard is not None:
            guard.step()
    return losses, optimizer


# --------------------------------------------------------------------------------------------------
# The signals

@pytest.mark.parametrize("name", MODELS)
def test_the_max_logit_over_all_rows_is_the_models_own(name, monkeypatch):
    model, loss_of = build(name)
    inflate_qk(model, 10.0)                          # logits well away from 0, so relative error means something
    guard = qkguard.attach(model, ADAPTER[name], seqs=None)
    assert len(guard.layers) == 2
    with spied_attention(monkeypatch) as calls:
        loss_of(model, *batch()).backward()
    guard.step()
    dense = dense_max_logit(calls).float()
    assert dense.shape == guard.max_logit.shape == (2, 4)
    assert dense.min() > 1.0, "the check needs logits of a visible size"
    torch.testing.assert_close(guard.max_logit, dense, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("name", ["qkguard-gpt-llama", "hf-llama"])
def test_the_rotation_is_part_of_the_signal(name, monkeypatch):
    """Without the rotary step the measured logits differ from the model's: the check above can fail."""
    model, loss_of = build(name)
    inflate_qk(model, 10.0)
    guard = qkguard.attach(model, ADAPTER[name], seqs=None)
    for layer in guard.layers:
        layer.rotary = None
    with spied_attention(monkeypatch) as calls:
        loss_of(model, *batch()).backward()
    guard.step()
    assert not torch.allclose(guard.max_logit, dense_max_logit(calls).float(), rtol=1e-3)


def test_a_sampled_sequence_is_rotated_by_its_own_positions(monkeypatch):
    """Positions given per sequence (position_ids of shape (B, T)): the one sampled is rotated by its own
    (a stride, not a shift: rotary logits see only the positions' differences). Steps go on until each
    sequence has been the sampled one: sequence 0's positions are the ordinary ones, so a rotary that
    took sequence 0's positions for every sequence would pass on it alone."""
    model, _ = build("hf-llama")
    inflate_qk(model, 10.0)
    guard = qkguard.attach(model, "hf-llama", seqs=1)
    x = batch()[0]
    positions = torch.arange(T)[None] * torch.tensor([[1], [3]])        # the second sequence's positions 0, 3, 6, ...
    drawn = []
    while set(drawn) != {0, 1} and len(drawn) < 10:
        with spied_attention(monkeypatch) as calls:
            model(input_ids=x, position_ids=positions, labels=x).loss.backward()
        (seq,) = guard._sample[0].tolist()
        guard.step()
        dense = torch.stack([dense_logits(q[seq:seq + 1], k[seq:seq + 1], s).amax(dim=(0, 2, 3)) for q, k, s in calls])
        torch.testing.assert_close(guard.max_logit, dense.float(), rtol=1e-5, atol=1e-5, msg=f"sequence {seq}")
        drawn.append(seq)
    assert set(drawn) == {0, 1}, f"the guard's draws {drawn} never reached both sequences"


@pytest.mark.parametrize("name", MODELS)
def test_a_model_in_eval_mode_is_measured_on_its_forwards_with_gradients(name, monkeypatch):
    """As from_pretrained leaves it: eval() mode, trained all the same."""
    model, loss_of = build(name)
    inflate_qk(model, 10.0)
    model.eval()
    guard = qkguard.attach(model, ADAPTER[name], seqs=None)
    with spied_attention(monkeypatch) as calls:
        loss_of(model, *batch()).backward()
    guard.step()
    torch.testing.assert_close(guard.max_logit, dense_max_logit(calls).float(), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("name", ["nanogpt", "hf-llama"])
def test_a_forward_under_no_grad_is_not_part_of_the_steps_signal(name, monkeypatch):
    """A validation loss between the update and guard.step(), the model left in train() mode."""
    model, loss_of = build(name)
    inflate_qk(model, 10.0)
    model.train()
    guard = qkguard.attach(model, ADAPTER[name], seqs=None)
    with spied_attention(monkeypatch) as calls:
        loss_of(model, *batch(seed=1)).backward()
    with torch.no_grad(), spied_attention(monkeypatch) as val_calls:
        loss_of(model, *batch(seed=7))
    trained, val = dense_max_logit(calls).float(), dense_max_logit(val_calls).float()
    assert (val > trained * 1.01).any(), "the check needs a validation forward that would raise the signal"
    guard.step()
    torch.testing.assert_close(guard.max_logit, trained, rtol=1e-5, atol=1e-5)


def test_a_sampled_max_logit_is_the_dense_max_over_the_rows_it_drew():
    torch.manual_seed(0)
    q, k = torch.randn(5, 4, 40, 8), torch.randn(5, 2, 40, 8)          # GQA: 4 query heads, 2 key heads
    dense = dense_logits(q.double(), k.double().repeat_interleave(2, dim=1), 0.3)    # (B, H, T, T)
    for seqs, rows in ((2, 7), (2, None), (None, 7)):
        sample = hooks.sample_rows(5, 40, seqs, rows, seed=5)
        seq, pos = (torch.arange(n) if i is None else i for n, i in zip((5, 40), sample))
        assert len(set(seq.tolist())) == (seqs or 5) and len(set(pos.tolist())) == (rows or 40)
        sampled = hooks.sampled_max_logit(q, k, 0.3, sample)
        torch.testing.assert_close(sampled.double(), dense[seq][:, :, pos].amax(dim=(0, 2, 3)), rtol=1e-6, atol=1e-6)
        assert (sampled.double() <= dense.amax(dim=(0, 2, 3)) + 1e-6).all()
    full = hooks.sampled_max_logit(q, k, 0.3)
    torch.testing.assert_close(full.double(), dense.amax(dim=(0, 2, 3)), rtol=1e-6, atol=1e-6)
    assert hooks.sample_rows(5, 40, 9, 40, seed=5) == (None, None), "a sample of everything is all rows"


def test_the_max_logit_goes_a_chunk_of_rows_at_a_time_to_the_same_value(monkeypatch):
    """Bounded memory at any context: no product holds more than `chunk` logits (or one row's, where a
    row alone has more), and the chunked max is the one over the rows all at once."""
    torch.manual_seed(0)
    q, k = torch.randn(3, 4, 50, 8), torch.randn(3, 2, 50, 8)          # GQA: 4 query heads, 2 key heads
    dense = dense_logits(q.double(), k.double().repeat_interleave(2, dim=1), 0.3)
    real, sizes = torch.matmul, []

    def spy(a, b):
        out = real(a, b)
        sizes.append(out.numel())
        return out
    for seqs, rows in ((None, None), (2, 13)):
        sample = hooks.sample_rows(3, 50, seqs, rows, seed=5)
        seq, pos = (torch.arange(n) if i is None else i for n, i in zip((3, 50), sample))
        whole = hooks.sampled_max_logit(q, k, 0.3, sample, chunk=1 << 30)
        torch.testing.assert_close(whole.double(), dense[seq][:, :, pos].amax(dim=(0, 2, 3)), rtol=1e-6, atol=1e-6)
        one_row = len(seq) * 4 * 50                                        # a query row's logits, all heads and keys
        monkeypatch.setattr(torch, "matmul", spy)
        for chunk in (1, 3 * one_row, 3 * one_row + 7, 7 * one_row):
            sizes.clear()
            chunked = hooks.sampled_max_logit(q, k, 0.3, sample, chunk=chunk)
            assert len(sizes) == math.ceil(len(pos) / max(1, chunk // one_row)) > 1, (chunk, len(sizes))
            assert max(sizes) <= max(chunk, one_row), (chunk, max(sizes))
            torch.testing.assert_close(chunked, whole, rtol=1e-6, atol=1e-6)
        monkeypatch.undo()


@pytest.mark.parametrize("name", MODELS)
def test_sigma_per_head_is_the_top_singular_value_of_each_heads_rows(name):
    model, _ = build(name)
    guard = qkguard.attach(model, ADAPTER[name])
    sigma_head = guard._measure_sigma(iters=300)
    for i, layer in enumerate(guard.layers):
        for which, role in enumerate(("q", "k")):
            # the weight as the module stores it (Conv1D: (in, out)), sliced here, not by the adapter
            module = layer.q if role == "q" else layer.k
            w = module.weight.detach().T if layer.transposed else module.weight.detach()
            w = w[layer.cols(role)].unflatten(0, (layer.heads(role), layer.head_dim))
            exact = torch.linalg.svdvals(w)[:, 0].repeat_interleave(layer.n_head // layer.heads(role))
            torch.testing.assert_close(sigma_head[i, which], exact, rtol=1e-3, atol=0)
    record = guard.record(iters=300)
    exact_q = [torch.linalg.svdvals(layer.weight("q").detach())[0].item() for layer in guard.layers]
    assert record["sigma_q"] == pytest.approx(exact_q, rel=1e-3)


# --------------------------------------------------------------------------------------------------
# The guard's step: deferred, latched, acting

@pytest.mark.parametrize("name", MODELS)
def test_qknorm_bounds_every_logit_once_the_guard_fires_one_step_late(name, monkeypatch):
    model, loss_of = build(name)
    inflate_qk(model)
    guard = qkguard.attach(model, ADAPTER[name], threshold=1.0)
    with spied_attention(monkeypatch) as calls:
        loss_of(model, *batch()).backward()
    bound = max(s for _, _, s in calls) * guard.layers[0].head_dim
    assert dense_max_logit(calls).max() > 2 * bound, "the test needs logits past the bound before the action"
    assert guard.step() is None and not guard.triggered, "step 0's crossing is checked at step 1"
    loss_of(model, *batch()).backward()
    event = guard.step()
    assert event["event"] == "guard_trigger" and event["step"] == 0 and event["active_from"] == 2
    assert event["layers"] == [0, 1] and event["value"] > 1.0 and guard.triggered
    with spied_attention(monkeypatch) as calls:
        loss = loss_of(model, *batch())
    for q, k, scale in calls:
        logits = dense_logits(q, k, scale)
        assert logits[logits.isfinite()].abs().max() <= scale * q.shape[-1] * (1 + 1e-5)
    loss.backward()                                 # and it trains: the gradient reaches W_q and W_k
    assert all(p.grad is not None and p.grad.abs().sum() > 0 for n, p in model.named_parameters()
               if n.endswith(("q_proj.weight", "c_attn.weight")))


def qk_rows(layer):
    """Per role, each head's rows of W_q or W_k and of its bias, sliced from the module's own weight."""
    out = {}
    for role in ("q", "k"):
        module = layer.q if role == "q" else layer.k
        w = (module.weight.detach().T if layer.transposed else module.weight.detach())[layer.cols(role)]
        b = module.bias.detach()[layer.cols(role)] if getattr(module, "bias", None) is not None else None
        out[role] = [t.unflatten(0, (layer.heads(role), layer.head_dim)).clone() for t in (w, b) if t is not None]
    return out


@pytest.mark.parametrize("name", MODELS)
def test_qkclip_caps_the_offending_heads_at_tau_and_keeps_the_others(name, monkeypatch):
    model, loss_of = build(name)
    inflate_qk(model, 12.0)
    with torch.no_grad():       # biases away from 0 (Hugging Face starts them at 0), so their scaling shows
        for n, p in model.named_parameters():
            if n.endswith(("c_attn.bias", "q_proj.bias", "k_proj.bias")):
                p.normal_(0.0, 0.1, generator=torch.Generator().manual_seed(2))
    guard = qkguard.attach(model, ADAPTER[name], threshold=1.0, action="qkclip")
    for _ in range(2):                              # the crossing at step 0 acts at step 1
        loss_of(model, *batch()).backward()
        guard.step()
    assert guard.triggered
    with spied_attention(monkeypatch) as calls:     # the max logit the clip will use: this batch's
        loss_of(model, *batch()).backward()
    before, rows_before = dense_max_logit(calls), [qk_rows(layer) for layer in guard.layers]
    tau = float(before[0].median())                 # layer 0: some heads above, some below
    guard.qkguard.tau = tau
    guard.step()
    # Layer 0 sees the same input: its logits are min(S, tau). Deeper layers see a changed input, so
    # there the check is the weights': head h's logit factor f_h = tau / S_h (or 1) split over W_q, W_k.
    with spied_attention(monkeypatch) as calls:
        loss_of(model, *batch())
    over = before[0] > tau
    assert over.any() and (~over).any()
    torch.testing.assert_close(dense_max_logit(calls)[0], before[0].clamp(max=tau), rtol=1e-4, atol=1e-6)
    for i, layer in enumerate(guard.layers):
        f = torch.where(before[i] > tau, tau / before[i], torch.ones_like(before[i]))
        scale = {}
        for role, tensors in qk_rows(layer).items():
            ratios = [after / prior for after, prior in zip(tensors, rows_before[i][role])]
            per_head = ratios[0].flatten(1).median(dim=1).values
            for ratio in ratios:   # each head's rows (and bias) scaled by one factor
                torch.testing.assert_close(ratio.flatten(1), per_head[:, None].expand_as(ratio.flatten(1)),
                                           rtol=1e-4, atol=1e-6)
            scale[role] = per_head
        group = layer.n_head // layer.n_kv_head
        torch.testing.assert_close(scale["q"] * scale["k"].repeat_interleave(group), f.float(), rtol=1e-4, atol=1e-6)


@pytest.mark.parametrize("name", MODELS)
def test_the_first_qkclip_step_brings_every_heads_max_over_all_rows_to_tau(name, monkeypatch):
    """The trigger step's clip already uses the max over every row of the batch, not the sample's
    (a lower bound, which would clip too little): replayed on the inputs it was measured on, each
    layer's attention with the clipped weights has every head's max logit at tau at most."""
    model, loss_of = build(name)
    inflate_qk(model, 12.0)
    guard = qkguard.attach(model, ADAPTER[name], threshold=1.0, action="qkclip")   # seqs=1: one of 2 sampled
    with spied_attention(monkeypatch) as calls:
        loss_of(model, *batch()).backward()
    full = dense_max_logit(calls)
    guard.qkguard.tau = tau = float(full.min()) / 2               # every head over it
    sample = torch.stack([dense_logits(q[:1], k[:1], s).amax(dim=(0, 2, 3)) for q, k, s in calls])
    assert (torch.stack([dense_logits(q[1:], k[1:], s).amax(dim=(0, 2, 3)) for q, k, s in calls]) > sample).any(), \
        "the check needs heads whose max is in the sequence the sample left out"
    assert guard.step() is None                                   # step 0: its crossing is acted on at step 1
    inputs = {}

    def keep(i):
        def hook(module, args, kwargs):
            inputs[i] = (args, dict(kwargs))         # the layer's own input, replayed after the clip
        return hook
    handles = [layer.attn.register_forward_pre_hook(keep(i), with_kwargs=True) for i, layer in enumerate(guard.layers)]
    loss_of(model, *batch()).backward()
    for handle in handles:
        handle.remove()
    event = guard.step()                                          # the trigger, and the first clip
    assert event["event"] == "guard_trigger" and event["active_from"] == 2
    for i, layer in enumerate(guard.layers):
        args, kwargs = inputs[i]
        for cache in ("past_key_values", "cache"):                # no cache: this forward's keys alone (the
            if cache in kwargs:                                   # one the measured forward filled would add
                kwargs[cache] = None                              # its unclipped keys; 5.25 renamed it cache)
        with torch.no_grad(), spied_attention(monkeypatch) as calls:
            layer.attn(*args, **kwargs)
        after = dense_max_logit(calls)[0]
        assert (after <= tau * (1 + 1e-4)).all(), f"layer {i}: max logits {after.tolist()} past tau {tau}"


@pytest.mark.parametrize("name", MODELS)
def test_the_latch_survives_a_checkpoint_and_the_resumed_guard_still_acts(name, tmp_path, monkeypatch):
    model, loss_of = build(name)
    inflate_qk(model)
    guard = qkguard.attach(model, ADAPTER[name], threshold=1.0)
    _, optimizer = train_steps(model, loss_of, guard, 2)
    assert guard.triggered
    path = tmp_path / "ckpt.pt"
    torch.save({"model": model.state_dict(), "optimizer": optimizer.state_dict(), "guard": guard.state_dict()}, path)
    state = torch.load(path, weights_only=True)     # plain tensors and lists: no pickled code
    resumed, _ = build(name, seed=1)
    resumed.load_state_dict(state["model"])
    fresh = qkguard.attach(resumed, ADAPTER[name], threshold=1.0)
    fresh.load_state_dict(state["guard"])
    assert fresh.triggered and fresh.qkguard.trigger == guard.qkguard.trigger and fresh.steps == 2
    optimizer = torch.optim.AdamW(resumed.parameters(), lr=1e-3)
    optimizer.load_state_dict(state["optimizer"])
    with spied_attention(monkeypatch) as calls:      # the next update, acted on from its forward
        loss = loss_of(resumed, *batch())
    loss.backward()
    optimizer.step()
    assert fresh.step() is None and math.isfinite(loss.item())
    for q, k, scale in calls:
        logits = dense_logits(q, k, scale)
        assert logits[logits.isfinite()].abs().max() <= scale * q.shape[-1] * (1 + 1e-5)


def test_a_queued_crossing_travels_in_the_checkpoint():
    """A crossing at the last step before a save acts at the first step after the resume."""
    model, loss_of = build("nanogpt")
    inflate_qk(model)
    guard = qkguard.attach(model, "nanogpt", threshold=1.0)
    train_steps(model, loss_of, guard, 1)
    assert not guard.triggered and guard.qkguard.pending_crossing() == 0
    resumed, _ = build("nanogpt")
    resumed.load_state_dict(model.state_dict())
    fresh = qkguard.attach(resumed, "nanogpt", threshold=1.0)
    fresh.load_state_dict(guard.state_dict())
    loss_of(resumed, *batch()).backward()
    assert fresh.step()["step"] == 0 and fresh.triggered


def test_a_second_guard_on_a_model_is_refused_and_the_resume_in_one_process_works():
    """One guard per model: a second would stack its hooks on the first's (q and k normalized twice, each
    guard reading the other's output). Detached, the first leaves the model to a resumed one."""
    model, loss_of = build("nanogpt")
    inflate_qk(model)
    guard = qkguard.attach(model, "nanogpt", threshold=1.0)
    train_steps(model, loss_of, guard, 2)
    assert guard.triggered
    for kwargs in ({"threshold": 1.0}, {"enabled": False}):
        with pytest.raises(ValueError, match=r"NanoGPT already has a QK-Guard attached.*call the first one's detach\(\)"):
            qkguard.attach(model, "nanogpt", **kwargs)
    c_attn = model.transformer.h[0].attn.c_attn
    assert len(c_attn._forward_hooks) == 1
    state = guard.state_dict()
    guard.detach()
    resumed = qkguard.attach(model, "nanogpt", threshold=1.0)
    resumed.load_state_dict(state)
    assert len(c_attn._forward_hooks) == 1 and resumed.triggered
    _, loss = model(*batch())
    loss.backward()
    assert resumed.step() is None and math.isfinite(loss.item())
    # watchers (enabled=False) never act, so two of them may share a model, as the example's unguarded run does
    other, _ = build("nanogpt")
    watchers = [qkguard.attach(other, "nanogpt", enabled=False),
                qkguard.attach(other, "nanogpt", enabled=False, seqs=None)]
    _, loss = other(*batch())
    loss.backward()
    assert all(w.step() is None and w.max_logit is not None for w in watchers)


@pytest.mark.parametrize("changed", [{"action": "qkclip"}, {"signal": "sigma-product", "threshold": 1.0},
                                     {"threshold": 2.0}, {"scope": "crossed"}])
def test_a_resume_under_other_settings_is_refused_in_one_line(changed):
    model, _ = build("nanogpt")
    state = qkguard.attach(model, "nanogpt", threshold=1.0).state_dict()
    other, _ = build("nanogpt")
    resumed = qkguard.attach(other, "nanogpt", **{"threshold": 1.0, **changed})
    key = next(iter(changed))                 # the setting that differs (sigma-product keeps threshold 1.0)
    with pytest.raises(ValueError, match=rf"this state was saved by a guard with .*{key}=.*: attach with the saved run's "
                                         rf"settings"):
        resumed.load_state_dict(state)


@pytest.mark.parametrize("name", MODELS)
def test_a_dormant_guard_leaves_training_bit_for_bit_as_without_it(name):
    """With dropout on, so a guard that drew from the global RNG, in attach() or in its hooks, would fail
    this: the global RNG is seeded before the guard is built."""
    runs = []
    for guarded in (False, True):
        model, loss_of = build(name, dropout=0.1)
        model.train()
        torch.manual_seed(123)
        guard = qkguard.attach(model, ADAPTER[name], threshold=1e9, seqs=1, rows=8) if guarded else None
        losses, _ = train_steps(model, loss_of, guard, 3)
        runs.append((losses, [p.detach().clone() for p in model.parameters()]))
        if guarded:
            assert guard.steps == 3 and not guard.triggered and guard.max_logit is not None
    (losses_a, params_a), (losses_b, params_b) = runs
    assert losses_a == losses_b
    assert all(torch.equal(a, b) for a, b in zip(params_a, params_b))


def test_the_sigma_product_signal_fires_on_the_weights():
    model, loss_of = build("hf-llama" if _has("transformers") else "qkguard-gpt-llama")
    guard = qkguard.attach(model, signal="sigma-product", threshold=1e9)
    product = guard.sigma_head[:, 0] * guard.sigma_head[:, 1]
    guard.qkguard.threshold = float(product.max()) * 0.999          # the top head crosses, no other
    train_steps(model, loss_of, guard, 2, lr=1e-9)                   # weights (and so sigma) held still
    event = guard.events[0]
    assert event["signal"] == "sigma-product" and event["step"] == 0
    layer, head = divmod(int(product.argmax()), product.shape[1])
    assert (event["layer"], event["head"]) == (layer, head)
    assert event["value"] == pytest.approx(float(product.max()), rel=1e-3)


def test_an_unguarded_watch_measures_and_never_acts():
    model, loss_of = build("nanogpt")
    inflate_qk(model)
    guard = qkguard.attach(model, "nanogpt", threshold=1.0, enabled=False)
    train_steps(model, loss_of, guard, 3)
    assert not guard.triggered and guard.record()["guard"] == "off" and guard.max_logit.max() > 1.0


def test_a_monitor_interval_measures_only_every_nth_update():
    model, loss_of = build("nanogpt")
    guard = qkguard.attach(model, "nanogpt", interval=3)
    seen = []
    for step in range(5):
        loss_of(model, *batch()).backward()
        seen.append(guard._running[0] is not None)
        guard.step()
    assert seen == [True, False, False, True, False]


def _two_ranks(rank, port, out):
    import torch.distributed as dist
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
    torch.set_num_threads(1)
    model, loss_of = build("nanogpt")
    guard = qkguard.attach(model, "nanogpt", seqs=None)
    loss_of(model, *batch(seed=rank)).backward()            # each rank its own batch, so its own max logit
    local = torch.stack([v.clone() for v in guard._running])
    guard.step()
    torch.save({"local": local, "guard": guard.max_logit}, os.path.join(out, f"rank{rank}.pt"))
    dist.destroy_process_group()


def test_under_data_parallel_every_rank_sees_the_max_over_ranks(tmp_path):
    """The max logit is all-reduced, so every rank's guard decides alike (and acts at one step)."""
    import socket
    import torch.multiprocessing as mp
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    mp.spawn(_two_ranks, args=(port, str(tmp_path)), nprocs=2)
    ranks = [torch.load(tmp_path / f"rank{r}.pt") for r in range(2)]
    assert not torch.equal(ranks[0]["local"], ranks[1]["local"])
    expected = torch.maximum(ranks[0]["local"], ranks[1]["local"])
    assert all(torch.equal(r["guard"], expected) for r in ranks)


# --------------------------------------------------------------------------------------------------
# Bad input, optional packages

def test_bad_input_ends_in_one_clear_line():
    with pytest.raises(ValueError, match="found no attention layer in Sequential"):
        qkguard.attach(nn.Sequential(nn.Linear(4, 4)))
    model, loss_of = build("nanogpt")
    with pytest.raises(ValueError, match="choose one of qknorm, qkclip"):
        qkguard.attach(model, action="softcap")
    with pytest.raises(ValueError, match="unknown adapter 'llama'"):
        qkguard.attach(model, "llama")
    guard = qkguard.attach(model)
    with torch.no_grad():
        model.eval()
        model(batch()[0])
    with pytest.raises(RuntimeError, match="no forward with gradients enabled reached attention layer 0"):
        guard.step()
    guard.detach()
    with pytest.raises(ValueError, match="2 attention layers, not 4"):
        qkguard.attach(NanoGPT(n_layer=4)).load_state_dict(guard.state_dict())
    wrong = lambda m: [qkguard.Layer(attn=b.attn, q=b.attn.c_attn, k=b.attn.c_attn, n_head=3, head_dim=16,
                                     q_cols=slice(0, 64), k_cols=slice(64, 128)) for b in m.transformer.h]
    with pytest.raises(ValueError, match="W_q has 64 rows, not 3 heads x 16: fix the adapter's head count"):
        qkguard.attach(model, wrong)


class SelfNormedAttention(nn.Module):
    """Hugging Face's Llama layout, with q and k normalized after their projections (as Qwen3 and OLMo 2 do)."""

    def __init__(self):
        super().__init__()
        self.config, self.head_dim = types.SimpleNamespace(num_key_value_heads=2), 8
        self.q_proj, self.k_proj = nn.Linear(16, 16), nn.Linear(16, 16)
        self.q_norm, self.k_norm = nn.RMSNorm(8), nn.RMSNorm(8)


@pytest.mark.parametrize("which", ["synthetic", "Qwen3", "Olmo2"])
def test_a_model_that_normalizes_q_and_k_itself_is_refused_in_one_line(which):
    """Read before the model's own norm, its q and k would give a max logit that is not the model's."""
    if which == "synthetic":
        model, attention = nn.Sequential(SelfNormedAttention()), "SelfNormedAttention"
    else:
        transformers = pytest.importorskip("transformers")
        config = getattr(transformers, f"{which}Config")(hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                                         num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                                                         vocab_size=VOCAB)
        model, attention = getattr(transformers, f"{which}ForCausalLM")(config), f"{which}Attention"
    for adapter in ("auto", "hf-llama"):
        with pytest.raises(ValueError, match=rf"^attach: {attention} normalizes q and k itself \(q_norm, k_norm, after "
                                             rf"q_proj and k_proj\).*already has QK-norm.*write an adapter whose q and k "
                                             rf"are read after the model's own norm"):
            qkguard.attach(model, adapter)


def test_auto_finds_each_models_adapter():
    for name in MODELS:
        if name.startswith("hf-") and not _has("transformers"):
            continue
        model, _ = build(name)
        layers, named = qkguard.find_layers(model), qkguard.ADAPTERS[ADAPTER[name]](model)
        key = lambda ls: [(l.attn, l.q, l.k, l.cols("q"), l.cols("k"), l.transposed, l.n_kv_head) for l in ls]
        assert len(layers) == 2 and key(layers) == key(named), name
        assert layers[0].transposed == (name == "hf-gpt2") and layers[0].n_kv_head == (2 if name == "hf-llama" else 4)


def test_a_user_adapter_is_a_few_lines():
    """The README's example adapter, on a model attach knows nothing of: q and k from separate Linears."""
    class Attn(nn.Module):
        def __init__(self):
            super().__init__()
            self.wq, self.wk, self.wv = nn.Linear(16, 16), nn.Linear(16, 16), nn.Linear(16, 16)

        def forward(self, x):
            q, k, v = (w(x).unflatten(-1, (2, 8)).transpose(1, 2) for w in (self.wq, self.wk, self.wv))
            return F.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(1, 2).flatten(-2)

    model = nn.Sequential(Attn(), Attn())
    guard = qkguard.attach(model, lambda m: [qkguard.Layer(attn=a, q=a.wq, k=a.wk, n_head=2, head_dim=8) for a in m])
    model(torch.randn(2, 5, 16)).sum().backward()
    guard.step()
    assert guard.max_logit.shape == (2, 2)


def _has(package):
    try:
        __import__(package)
        return True
    except ImportError:
        return False


def test_attach_imports_and_guards_without_transformers():
    """transformers hidden (an import of it fails): qkguard, the project's GPT and a nanoGPT-style one work."""
    code = ("import sys; sys.modules['transformers'] = None\n"
            "import torch, qkguard, qkguard.test_attach as t\n"
            "for name in ('qkguard-gpt', 'nanogpt'):\n"
            "    model, loss_of = t.build(name)\n"
            "    guard = qkguard.attach(model)\n"
            "    loss_of(model, *t.batch()).backward(); guard.step()\n"
            "    assert guard.max_logit.shape == (2, 4)\n"
            "assert sys.modules['transformers'] is None\n"
            "print('ok')\n")
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    result = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=env, capture_output=True, text=True, timeout=120)
    assert result.returncode == 0 and result.stdout.strip() == "ok", result.stderr[-2000:]


def test_tensorboard_logging_writes_the_signals(tmp_path):
    pytest.importorskip("tensorboard")
    model, loss_of = build("nanogpt")
    guard = qkguard.attach(model, "nanogpt", tensorboard=str(tmp_path / "tb"), log_every=1)
    train_steps(model, loss_of, guard, 2)
    guard.detach()
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
    events = EventAccumulator(str(tmp_path / "tb"))
    events.Reload()
    scalars = events.Tags()["scalars"]
    assert {"qkguard/max_logit/layer0", "qkguard/sigma_product/layer1", "qkguard/on"} <= set(scalars)
    logged = [e.value for e in events.Scalars("qkguard/max_logit/layer0")]
    assert len(logged) == 2 and logged[-1] == pytest.approx(guard.max_logit[0].max().item())


def test_tensorboard_logs_each_signal_only_at_the_steps_it_was_measured(tmp_path):
    """interval=2 and log_every=1: the max logit (and a watched sigma product) at steps 0 and 2 alone;
    a sigma product refreshed for the log at every step."""
    pytest.importorskip("tensorboard")
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
    logged = {}
    for signal in ("max-logit", "sigma-product"):
        model, loss_of = build("nanogpt")
        guard = qkguard.attach(model, "nanogpt", signal=signal, threshold=1e9, interval=2, log_every=1,
                               tensorboard=str(tmp_path / signal))
        maxes = []
        for step in range(4):
            loss_of(model, *batch(seed=step)).backward()
            guard.step()
            maxes.append(guard.max_logit[0].max().item())
        guard.detach()
        events = EventAccumulator(str(tmp_path / signal))
        events.Reload()
        logged[signal] = {tag: [(e.step, e.value) for e in events.Scalars(f"qkguard/{tag}/layer0")]
                          for tag in ("max_logit", "sigma_product")}
        assert [s for s, _ in logged[signal]["max_logit"]] == [0, 2]
        assert [v for _, v in logged[signal]["max_logit"]] == pytest.approx([maxes[0], maxes[2]])
    assert [s for s, _ in logged["max-logit"]["sigma_product"]] == [0, 1, 2, 3]
    assert [s for s, _ in logged["sigma-product"]["sigma_product"]] == [0, 2]


def test_tensorboard_missing_is_one_clear_line(monkeypatch):
    monkeypatch.setitem(sys.modules, "torch.utils.tensorboard", None)
    model, _ = build("nanogpt")
    with pytest.raises(ImportError, match="needs the tensorboard package: pip install tensorboard"):
        qkguard.attach(model, tensorboard="runs/tb")


# --------------------------------------------------------------------------------------------------
# The example and the documentation

def test_the_example_guard_fires_once_and_bounds_the_logits_it_would_have_let_run_away():
    """qkguard/example.py, guarded and watched only, from one init: the same run until the guard acts,
    then every logit within QK-norm's bound, where the watched run's pass the threshold."""
    runs = {guarded: example.train(steps=60, guarded=guarded, report=lambda line: None) for guarded in (True, False)}
    (guard, on), (watcher, off) = runs[True], runs[False]
    assert len(guard.events) == 1 and watcher.events == [] and not watcher.triggered
    event = guard.events[0]
    assert event["threshold"] == 200.0 and event["value"] > 200.0            # the default threshold, crossed
    start = event["active_from"]
    assert on[:start] == off[:start], "the dormant guard changed the run before it acted"
    bound = guard.layers[0].scale * guard.layers[0].head_dim
    assert max(m for _, m in on[start:]) <= bound * (1 + 1e-5) < 200.0 < max(m for _, m in off[start:])


def test_the_example_refuses_bad_flags_in_one_line(capsys):
    with pytest.raises(SystemExit):
        example.main(["--steps", "0"])
    assert "--steps must be >= 1, --lr and --threshold > 0" in capsys.readouterr().err


def _readme_blocks():
    with open(README) as f:
        return re.findall(r"```python\n(.*?)```", f.read(), re.S)


# What a README block needs beyond torch and qkguard, by what it uses: (a mark in its code, the package)
OPTIONAL = (("transformers", "transformers"), ("transformers.Trainer(", "accelerate"),
            ("import torch, lightning", "lightning"),
            ("tensorboard=", "tensorboard"), ("peft", "peft"))


def test_the_readme_has_its_examples():
    assert len(_readme_blocks()) >= 3, "the README's examples: a Hugging Face model, a nanoGPT-style one, an adapter"


@pytest.mark.parametrize("i", range(len(_readme_blocks())))
def test_the_readme_snippets_run_as_written(tmp_path, i):
    """Each python block of qkguard/README.md, run on its own, as a reader would paste it (at toy size, a
    few steps), with the repository root on the path. A block that needs a package not installed (the
    Trainer's accelerate, Lightning, ...) is skipped, naming it."""
    code = _readme_blocks()[i]
    missing = sorted({package for mark, package in OPTIONAL if mark in code and not _has(package)})
    if missing:
        pytest.skip(f"README block {i} needs {', '.join(missing)}, not installed")
    env = {**os.environ, "OMP_NUM_THREADS": "1",
           "PYTHONPATH": os.pathsep.join(p for p in (ROOT, os.environ.get("PYTHONPATH")) if p)}
    result = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, env=env, capture_output=True, text=True,
                            timeout=300)
    assert result.returncode == 0, f"README block {i} fails:\n{code}\n{result.stderr[-3000:]}"


def test_a_state_from_before_the_trigger_switches_the_fired_action_off_again():
    """load_state_dict of an earlier, unfired state into a guard that fired since (a resume in one process):
    QK-norm goes off with the latch, so the model computes what it did then (it stayed on)."""
    model, loss_of = build("nanogpt")
    guard = qkguard.attach(model, threshold=1e-30)
    early = copy.deepcopy(guard.state_dict())
    train_steps(model, loss_of, guard, 2)
    assert guard.triggered and all(switch.qk_norm for switch in guard.attentions)
    guard.load_state_dict(early)
    assert not guard.triggered and not any(switch.qk_norm for switch in guard.attentions)
    x, _ = batch()
    with torch.no_grad():
        guarded = model(x)[0]
        guard.detach()
        assert torch.equal(guarded, model(x)[0]), "a dormant guard changes nothing"


def test_always_on_clipping_is_no_watcher_and_a_state_missing_a_part_changes_nothing(tmp_path):
    model, loss_of = build("nanogpt")
    with pytest.raises(ValueError, match=r"always=True clips every update, and enabled=False is a watcher"):
        qkguard.attach(model, action="qkclip", always=True, enabled=False)
    guard = qkguard.attach(model, action="qkclip", always=True)
    train_steps(model, loss_of, guard, 1)
    assert GuardLoop(guard).signals()["qkguard/on"] == 1.0, "the callbacks' log says what record() says: on"
    serve.save_guard(guard, tmp_path)
    guard.detach()
    guard = serve.load_guard(model, tmp_path)          # an always-on guard's file attaches again
    assert guard.always and guard.steps == 1
    state = guard.state_dict()
    del state["generator"]
    with pytest.raises(ValueError, match=r"this state has no generator: it is not a guard's state_dict"):
        guard.load_state_dict(state)
    assert guard.steps == 1
    saved = torch.load(tmp_path / serve.GUARD_FILE, weights_only=True)
    del saved["state"]["steps"]
    torch.save(saved, tmp_path / serve.GUARD_FILE)
    guard.detach()
    with pytest.raises(ValueError, match=r"this state has no steps"):
        serve.load_guard(model, tmp_path)
    qkguard.attach(model).detach()    # load_guard left no guard attached: a new one is not refused


def test_a_resumed_guard_logs_the_last_max_logit_as_the_uninterrupted_one_does():
    """interval=2: a log after an unmonitored step shows the last max logit read. A guard resumed between
    the two (its state loaded into a new attach) had none to show."""
    model, loss_of = build("nanogpt")
    guard = qkguard.attach(model, interval=2)
    train_steps(model, loss_of, guard, 1)            # step 0: monitored, the max logit read
    state, logged = copy.deepcopy(guard.state_dict()), GuardLoop(guard).signals()
    guard.detach()
    resumed = qkguard.attach(model, interval=2)
    resumed.load_state_dict(state)
    assert "qkguard/max_logit" in logged and GuardLoop(resumed).signals() == logged
    assert resumed.record()["max_logit"] == guard.record()["max_logit"]
