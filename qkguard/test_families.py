"""qkguard's Hugging Face families (families.py, and hooks.py's hf-llama relatives): each one's reading
against that model's own attention.

Every model is built from a tiny config (no download) with eager attention, and a spy on
F.softmax records what the model feeds its softmax: its logits, with its own mask (causal, sliding
window), softcap and ALiBi applied. The reference max logit of a head is the max of that over the
pairs the mask allows, for the sequences the guard sampled. ALiBi's bias is taken back out (the
guard reads q.k alone, as families.py says), and the softcap is put on the guard's reading (it
reports the logit before the cap). Skipped without transformers.
"""
import copy as copy_module
import math
import sys
from contextlib import contextmanager

import pytest
import torch
import torch.nn.functional as F

import qkguard

transformers = pytest.importorskip("transformers")

VOCAB, T, BATCH, STEPS = 64, 24, 2, 3
WINDOW = 6                             # a sliding window well inside T, so it masks pairs


def _config(name, **kw):
    """A tiny config of transformers' `name`Config: 2 layers, hidden 64, 4 heads, T positions."""
    common = dict(vocab_size=VOCAB, bos_token_id=0, eos_token_id=0, pad_token_id=0)
    return getattr(transformers, f"{name}Config")(**{**common, **kw})


LLAMA_LIKE = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=2, max_position_embeddings=T)
GPT2_LIKE = dict(n_embd=64, n_layer=2, n_head=4, n_positions=T)

# name -> (config, the adapter "auto" must choose)
FAMILIES = {
    "phi3-window": (lambda: _config("Phi3", **LLAMA_LIKE, sliding_window=WINDOW, rope_parameters=dict(
        rope_type="default", rope_theta=10000.0, partial_rotary_factor=0.5)), "hf-phi3"),
    "gpt-neox": (lambda: _config("GPTNeoX", hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                 num_attention_heads=4, max_position_embeddings=T), "hf-gpt-neox"),
    "gptj": (lambda: _config("GPTJ", **GPT2_LIKE, rotary_dim=8), "hf-gptj"),
    "codegen": (lambda: _config("CodeGen", **{**GPT2_LIKE, "n_head": 8}, n_ctx=T, rotary_dim=4), "hf-codegen"),
    "opt": (lambda: _config("OPT", hidden_size=64, ffn_dim=128, num_hidden_layers=2, num_attention_heads=4,
                            max_position_embeddings=T, word_embed_proj_dim=64), "hf-opt"),
    "falcon-mqa": (lambda: _config("Falcon", hidden_size=64, num_hidden_layers=2, num_attention_heads=4), "hf-falcon"),
    "falcon-gqa": (lambda: _config("Falcon", hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
                                   new_decoder_architecture=True, num_kv_heads=2), "hf-falcon"),
    "falcon-mha": (lambda: _config("Falcon", hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
                                   multi_query=False), "hf-falcon"),
    "falcon-alibi": (lambda: _config("Falcon", hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
                                     multi_query=False, alibi=True), "hf-falcon"),
    "bloom": (lambda: _config("Bloom", hidden_size=64, n_layer=2, n_head=4), "hf-bloom"),
    "gpt-bigcode-mqa": (lambda: _config("GPTBigCode", **GPT2_LIKE, multi_query=True), "hf-gpt-bigcode"),
    "gpt-bigcode-mha": (lambda: _config("GPTBigCode", **GPT2_LIKE, multi_query=False), "hf-gpt-bigcode"),
    "phi": (lambda: _config("Phi", **LLAMA_LIKE), "hf-phi"),
    "stablelm": (lambda: _config("StableLm", **LLAMA_LIKE), "hf-stablelm"),
    # hf-llama's relatives, read as they attend
    "mistral-window": (lambda: _config("Mistral", **LLAMA_LIKE, sliding_window=WINDOW), "hf-llama"),
    "qwen2-window": (lambda: _config("Qwen2", **LLAMA_LIKE, use_sliding_window=True, sliding_window=WINDOW,
                                     max_window_layers=1), "hf-llama"),     # layer 0 full, layer 1 windowed
    "gemma2": (lambda: _config("Gemma2", **LLAMA_LIKE, head_dim=16, query_pre_attn_scalar=16,
                               sliding_window=WINDOW), "hf-llama"),          # softcap 50; layer 0 windowed
    "mixtral": (lambda: _config("Mixtral", **LLAMA_LIKE, num_local_experts=2), "hf-llama"),
    "qwen2-moe": (lambda: _config("Qwen2Moe", **LLAMA_LIKE, num_experts=2, num_experts_per_tok=2,
                                  moe_intermediate_size=32, shared_expert_intermediate_size=32), "hf-llama"),
    "gemma": (lambda: _config("Gemma", **LLAMA_LIKE, head_dim=16), "hf-llama"),
    "starcoder2": (lambda: _config("Starcoder2", **LLAMA_LIKE, sliding_window=WINDOW), "hf-llama"),
    "cohere": (lambda: _config("Cohere", **LLAMA_LIKE), "hf-llama"),
    "olmo-clip": (lambda: _config("Olmo", **LLAMA_LIKE, clip_qkv=2.0), "hf-llama"),    # the clamp bites: |q| to 4.5
    # layers without rotary: SmolLM3's no_rope_layers (1: rotary), Cohere2's full-attention layers
    "smollm3": (lambda: _config("SmolLM3", **LLAMA_LIKE, no_rope_layers=[1, 0]), "hf-llama"),
    "cohere2": (lambda: _config("Cohere2", **LLAMA_LIKE, sliding_window=WINDOW,
                                layer_types=["sliding_attention", "full_attention"]), "hf-llama"),
    # attention sinks (a learned logit per head, joined to each row before the softmax: not q.k, so not
    # read, as ALiBi's bias is not), whole-head rotary from a half-width table, a windowed layer
    "gpt-oss": (lambda: _config("GptOss", **LLAMA_LIKE, head_dim=16, num_local_experts=2, num_experts_per_tok=1,
                                sliding_window=WINDOW, layer_types=["sliding_attention", "full_attention"]),
                "hf-llama"),
}


def build(name, seed=0):
    torch.manual_seed(seed)
    config, _ = FAMILIES[name]
    model = transformers.AutoModelForCausalLM.from_config(config(), attn_implementation="eager")
    return model.eval()     # dropout off (GPT-BigCode's config has it on): two forwards of a batch are alike


def tokens(step):
    return torch.randint(0, VOCAB, (BATCH, T), generator=torch.Generator().manual_seed(step))


@contextmanager
def spied_softmax(monkeypatch):
    """Record each attention's softmax input, (B, H, T, T) as float64: its logits, masked as it masks them."""
    calls, real = [], F.softmax

    def spy(x, *args, **kwargs):
        if x.dim() == 4 and x.shape[-2:] == (T, T):
            calls.append(x.detach().double())
        return real(x, *args, **kwargs)
    monkeypatch.setattr(torch.nn.functional, "softmax", spy)
    yield calls
    monkeypatch.setattr(torch.nn.functional, "softmax", real)


@contextmanager
def spied_logits(model, monkeypatch):
    """What the model feeds its softmax (spied_softmax); for a model with attention sinks (gpt-oss), its
    logits before the sinks join them as one more column (the softmax then sees them shifted by their
    max): scale * q.k plus the mask, of the rotated q and k its eager attention is handed."""
    sinks = next((m for m in model.modules() if isinstance(getattr(m, "sinks", None), torch.nn.Parameter)), None)
    if sinks is None:
        with spied_softmax(monkeypatch) as calls:
            yield calls
        return
    modeling, calls = _module(sinks), []
    real = modeling.eager_attention_forward

    def spy(m, query, key, value, attention_mask, scaling, *args, **kwargs):
        k = modeling.repeat_kv(key, m.num_key_value_groups).double()
        logits = torch.matmul(query.double(), k.transpose(2, 3)) * scaling
        if attention_mask is not None:
            logits = logits + attention_mask[..., : k.shape[-2]].double()
        calls.append(logits.detach())
        return real(m, query, key, value, attention_mask, scaling, *args, **kwargs)
    monkeypatch.setattr(modeling, "eager_attention_forward", spy)
    yield calls
    monkeypatch.setattr(modeling, "eager_attention_forward", real)


def alibi(model):
    """Per layer, the (B, H, T, T) bias the model adds to q.k before its softmax where it has ALiBi,
    masked pairs at -inf; None without ALiBi. Measured, not computed: the softmax input of a copy whose
    q is zeroed (W_q's rows and bias, by the adapter's columns), so q.k = 0 and what is left is the
    bias and the mask, as the installed release adds them (5.23's Falcon adds its ALiBi twice)."""
    if not getattr(model.config, "alibi", model.config.model_type == "bloom"):
        return None
    copy = copy_module.deepcopy(model)
    for layer in qkguard.find_layers(copy):
        layer.scale_rows("q", torch.zeros(layer.n_head * layer.head_dim))
    calls = []
    with torch.no_grad(), pytest.MonkeyPatch.context() as monkeypatch, spied_softmax(monkeypatch) as calls:
        copy(input_ids=tokens(0))
    return [x.masked_fill(x < -1e30, -math.inf) for x in calls]


def _module(m):
    """The modeling file m's class is defined in."""
    return sys.modules[type(m).__module__]


def softcap(model):
    return getattr(model.config, "attn_logit_softcapping", None)


def guarded_steps(model, guard, optimizer, monkeypatch):
    """STEPS training steps of the model under its guard, each yielding (step, the softmax calls the spy
    saw, the rows the guard sampled), after the optimizer's step and the guard's."""
    for step in range(STEPS):
        x = tokens(step)
        with spied_logits(model, monkeypatch) as calls:
            model(input_ids=x, labels=x).loss.backward()
        sampled = guard._sample[0]
        optimizer.step()
        optimizer.zero_grad()
        guard.step()
        yield step, calls, sampled


def reference(model, calls, seqs):
    """(n_layer, n_head): the max of each layer's softmax input over the sequences `seqs` (None: all), all
    query rows and the keys its mask allows (the masked ones sit near -3.4e38), ALiBi taken out."""
    biases = alibi(model)
    out = []
    for i, x in enumerate(calls):
        if biases is not None:
            x = torch.where(biases[i].isfinite(), x - biases[i], -math.inf)
        out.append((x if seqs is None else x[seqs]).amax(dim=(0, 2, 3)))
    return torch.stack(out)


def as_the_model_reports(model, reading):
    """The guard's reading as the model's softmax sees it: Gemma 2's softcap on top (the guard reports the
    logit before it)."""
    cap = softcap(model)
    return reading.double() if cap is None else cap * torch.tanh(reading.double() / cap)


def inflate(guard, factor=8.0):
    """Each layer's q and k projection weights times `factor` (a fused one once), so the logits are
    well away from 0 and a head whose reading is wrong shows it."""
    with torch.no_grad():
        for module in {m for layer in guard.layers for m in (layer.q, layer.k)}:
            module.weight.mul_(factor)


# --------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("seqs", [1, None], ids=["one-sequence", "every-sequence"])
@pytest.mark.parametrize("name", FAMILIES)
def test_the_max_logit_is_the_models_own_at_every_step(name, seqs, monkeypatch):
    """attach() finds the family's adapter, and its reading is the model's own max logit over the pairs
    its mask allows, at every step of a short training run (the weights move between steps)."""
    model = build(name)
    expected = FAMILIES[name][1]
    key = lambda layers: [(l.attn, l.q, l.k, str(l.q_cols), str(l.k_cols), l.n_kv_head, l.window) for l in layers]
    assert key(qkguard.find_layers(model)) == key(qkguard.ADAPTERS[expected](model)), f"auto did not choose {expected}"
    guard = qkguard.attach(model, seqs=seqs)
    assert len(guard.layers) == 2
    inflate(guard)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    for step, calls, sampled in guarded_steps(model, guard, optimizer, monkeypatch):
        assert len(calls) == 2, f"{len(calls)} softmax calls: the spy needs the model's eager attention"
        want = reference(model, calls, sampled)
        assert want.min() > 1.0, "the check needs logits of a visible size"
        torch.testing.assert_close(as_the_model_reports(model, guard.max_logit), want, rtol=1e-5, atol=1e-4,
                                   msg=lambda m: f"{name}, step {step}: {m}")


def _without_window(layer):
    layer.window = None


def _without_clamp(layer):
    layer.rotary = qkguard.hooks._hf_rotary(_module(layer.attn).apply_rotary_pos_emb)


@pytest.mark.parametrize("name, drop", [("mistral-window", _without_window), ("qwen2-window", _without_window),
                                        ("phi3-window", _without_window), ("gemma2", _without_window),
                                        ("olmo-clip", _without_clamp)])
def test_the_window_and_the_clamp_are_part_of_the_reading(name, drop, monkeypatch):
    """Read without the model's sliding window (or OLMo's clamp of q and k), the max logit is not the
    model's: the check above can fail. seqs=1, the default, where the clamp was missed (the sampled
    sequence is copied out before the model clamps q and k in place)."""
    model = build(name)
    guard = qkguard.attach(model)
    inflate(guard)
    for layer in guard.layers:
        drop(layer)
    x = tokens(0)
    with spied_logits(model, monkeypatch) as calls:
        model(input_ids=x, labels=x).loss.backward()
    sampled = guard._sample[0]
    guard.step()
    assert not torch.allclose(as_the_model_reports(model, guard.max_logit), reference(model, calls, sampled), rtol=1e-3)


@pytest.mark.parametrize("name", FAMILIES)
def test_qknorm_bounds_every_logit_once_the_guard_fires(name, monkeypatch):
    """The action where each family forms q and k (fused, interleaved columns included): after the
    trigger every logit the model computes is within scale * head_dim (ALiBi's bias aside), times the
    square of the rotary's attention_scaling where its table carries one (gpt-oss's YaRN: 1.35)."""
    model = build(name)
    guard = qkguard.attach(model, threshold=1.0)
    inflate(guard, 30.0)
    layer = guard.layers[0]
    yarn = next((m.attention_scaling for m in model.modules() if hasattr(m, "attention_scaling")), 1.0)
    bound = layer.scale * layer.head_dim * yarn ** 2
    for step in range(2):                           # step 0's crossing acts at step 1
        x = tokens(step)
        with spied_logits(model, monkeypatch) as calls:
            model(input_ids=x, labels=x).loss.backward()
        guard.step()
    assert guard.triggered and reference(model, calls, None).max() > 2 * bound, "the test needs logits past the bound"
    with spied_logits(model, monkeypatch) as calls:
        model(input_ids=x, labels=x).loss.backward()
    assert reference(model, calls, None).max() <= bound * (1 + 1e-5)


@pytest.mark.parametrize("name", [n for n in FAMILIES if n != "olmo-clip"])
def test_qkclip_brings_every_heads_max_to_tau(name, monkeypatch):
    """QK-Clip through each family's columns (index columns are scaled in the live weight): with tau
    under every head's max, layer 0 (whose input the clip leaves as it was) has every head's max at
    tau after the first clip. Not OLMo with clip_qkv: a clamped q does not shrink with W_q."""
    model = build(name)
    guard = qkguard.attach(model, threshold=1.0, action="qkclip", seqs=None)
    inflate(guard)
    x = tokens(0)
    with spied_logits(model, monkeypatch) as calls:
        model(input_ids=x, labels=x).loss.backward()
    guard.step()
    tau = float(guard.max_logit.min()) / 2
    guard.qkguard.tau = tau
    model(input_ids=x, labels=x).loss.backward()
    assert guard.step()["event"] == "guard_trigger"                # the trigger, and the first clip
    with torch.no_grad(), spied_logits(model, monkeypatch) as calls:
        model(input_ids=x)
    after = reference(model, calls, None)[0]
    torch.testing.assert_close(after, as_the_model_reports(model, torch.full_like(after, tau)), rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("name, config", [
    ("Llama4", lambda: _config("Llama4Text", **LLAMA_LIKE, head_dim=16, intermediate_size_mlp=128,
                               num_local_experts=2)),
    ("Phi", lambda: _config("Phi", **LLAMA_LIKE, qk_layernorm=True)),
    ("StableLm", lambda: _config("StableLm", **LLAMA_LIKE, qk_layernorm=True)),
    ("Cohere", lambda: _config("Cohere", **LLAMA_LIKE, use_qk_norm=True)),
])
def test_a_model_that_normalizes_q_and_k_itself_is_refused_in_one_line(name, config):
    """By "auto" and by hf-llama named (whose layout these share): neither reads q and k before the norm."""
    model = transformers.AutoModelForCausalLM.from_config(config())
    for adapter in ("auto", "hf-llama"):
        with pytest.raises(ValueError, match=rf"^attach: {name}(Text)?Attention .*normalizes q and k itself.*already "
                                             rf"has QK-norm"):
            qkguard.attach(model, adapter)


# --------------------------------------------------------------------------------------------------
# LoRA (peft) on q_proj, k_proj, v_proj: the guard reads q and k as the adapted model forms them

def lora_llama():
    """A tiny Llama under peft's LoRA on q, k and v, its B matrices random (peft's default B = 0 would
    make the adapted logits the base's, and a reading that missed the adapter would pass)."""
    peft = pytest.importorskip("peft")
    model = build("mistral-window")       # Llama's layout, with a sliding window
    config = peft.LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "k_proj", "v_proj"],
                             init_lora_weights=False)
    return peft.get_peft_model(model, config)


@pytest.mark.parametrize("merged", [False, True], ids=["adapters", "merged"])
def test_lora_on_q_and_k_is_read_as_the_adapted_model_forms_them(merged, monkeypatch):
    model = lora_llama()
    with torch.no_grad():            # logits of a visible size: the base weights, not the adapters, inflated
        for name, p in model.named_parameters():
            if name.endswith(("q_proj.base_layer.weight", "k_proj.base_layer.weight")):
                p.mul_(8.0)
    if merged:
        model.merge_adapter()         # the deltas inside the base weights, the wrappers kept; then trained whole
        for p in model.parameters():
            p.requires_grad_(True)
    guard = qkguard.attach(model)
    assert len(guard.layers) == 2 and guard.layers[0].n_kv_head == 2
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-3)
    for step, calls, sampled in guarded_steps(model, guard, optimizer, monkeypatch):
        want = reference(model, calls, sampled)
        torch.testing.assert_close(guard.max_logit.double(), want, rtol=1e-5, atol=1e-4,
                                   msg=lambda m: f"step {step}: {m}")
    # the sigmas are of the weight that forms q: the base plus the unmerged deltas
    attn = model.base_model.model.model.layers[0].self_attn
    w_q = guard.layers[0].weight("q").clone()
    if not merged:
        assert not torch.allclose(w_q, attn.q_proj.base_layer.weight)
        model.merge_adapter()
    torch.testing.assert_close(w_q, attn.q_proj.base_layer.weight)
    with torch.no_grad(), model.disable_adapter(), spied_logits(model, monkeypatch) as calls:   # (unmerges them)
        model(input_ids=tokens(step))   # the base alone: other logits, so a reading that missed LoRA would fail
    assert not torch.allclose(reference(model, calls, sampled), want, rtol=1e-3)


def test_qkclip_on_lora_is_refused_in_one_line_and_qknorm_acts(monkeypatch):
    model = lora_llama()
    with pytest.raises(ValueError, match=r"^attach: QK-Clip scales W_q and W_k, and under LoRA .*merge_and_unload"):
        qkguard.attach(model, action="qkclip")
    guard = qkguard.attach(model, threshold=1.0)
    inflate(guard, 30.0)                 # the base weights (a LoRA wrapper's weight is its base layer's)
    for step in range(2):
        model(input_ids=tokens(step), labels=tokens(step)).loss.backward()
        guard.step()
    layer = guard.layers[0]
    bound = layer.scale * layer.head_dim
    with torch.no_grad(), spied_logits(model, monkeypatch) as calls:
        model(input_ids=tokens(0))
    assert guard.triggered and reference(model, calls, None).max() <= bound * (1 + 1e-5)
    merged = model.merge_and_unload()    # plain Linears again: QK-Clip's weights are the model's own
    guard.detach()
    assert qkguard.attach(merged, action="qkclip").qkguard.action == "qkclip"


@pytest.mark.parametrize("name, config", [
    ("DeepseekV3", lambda: _config("DeepseekV3", hidden_size=64, intermediate_size=128, moe_intermediate_size=32,
                                   num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=4,
                                   n_routed_experts=4, num_experts_per_tok=2, first_k_dense_replace=2,
                                   q_lora_rank=32, kv_lora_rank=16, qk_nope_head_dim=8, qk_rope_head_dim=8,
                                   v_head_dim=8)),
    ("DeepseekV2", lambda: _config("DeepseekV2", hidden_size=64, intermediate_size=128, moe_intermediate_size=32,
                                   num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=4,
                                   q_lora_rank=None, kv_lora_rank=16, qk_nope_head_dim=8, qk_rope_head_dim=8,
                                   v_head_dim=8, first_k_dense_replace=2)),
])
def test_multi_head_latent_attention_is_refused_in_one_line(name, config):
    """MLA's k is two parts from two projections (one shared by every head): not read by a built-in adapter,
    refused naming why (DeepSeek-V2 without q_lora_rank has a q_proj, and is not taken for Llama's layout)."""
    model = transformers.AutoModelForCausalLM.from_config(config())
    with pytest.raises(ValueError, match=rf"^attach: {name}Attention is multi-head latent attention .*kv_a_proj_with_mqa"):
        qkguard.attach(model)
