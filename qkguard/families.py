"""
QK-Guard's adapters for the Hugging Face families whose attention is not Llama's or GPT-2's layout
(hooks.py has those two): each a function model -> [Layer], found by "auto" before hf-llama.

    family        adapter          q and k where they are formed                 rotation after them
    Phi3          hf-phi3          qkv_proj: q, then k, then v (GQA)             rotary, partial if set
    GPT-NeoX      hf-gpt-neox      query_key_value: q, k, v interleaved per head  rotary, partial (rotary_pct)
    GPT-J         hf-gptj          q_proj, k_proj                                GPT-J's pairwise rotary, partial
    CodeGen       hf-codegen       qkv_proj: 4 shards of q, v, k                 GPT-J's pairwise rotary, partial
    OPT           hf-opt           q_proj, k_proj                                none (learned positions)
    Falcon        hf-falcon        query_key_value: 3 layouts, below             rotary, or ALiBi
    BLOOM         hf-bloom         query_key_value: q, k, v interleaved per head  ALiBi
    GPT-BigCode   hf-gpt-bigcode   c_attn: q, k, v (MQA), or per head (MHA)      none (learned positions)
    Phi, StableLM hf-phi, hf-stablelm  q_proj, k_proj (GQA)                      rotary, partial
    Llama 4       refused: its attention normalizes q and k itself (qk_norm) and scales q by position

Each adapter knows its attention by class name (a subclass, as GPTJFlashAttention2, counts), reads
no weights and imports no transformers: the modeling file's own rotation is taken from the module
the attention class lives in, so the reading follows the installed release (tested on 5.23 and
5.25, whose GPT-J, CodeGen and Falcon attentions differ in how positions reach them).

ALiBi (BLOOM, Falcon with alibi=True) adds a bias by head and distance to each logit: the guard
reads scale * q.k alone, the part the weights W_q, W_k make and the actions bound; the bias (a
fixed slope times the distance, at most slope * context) is not in the reading.
"""
import sys

import torch
import torch.nn as nn

from qkguard.hooks import Layer, _hf_rotary, head_columns, hf_window, refuse_own_qk_norm


def _attentions(model, *names):
    """The model's modules whose class, or a class it derives from, has one of these names."""
    return [m for m in model.modules() if any(c.__name__ in names for c in type(m).__mro__)]


def _module_function(m, name):
    """A function of the modeling file m's class is defined in (its own rotation)."""
    return getattr(sys.modules[type(m).__module__], name)


def _interleaved(n_head, head_dim, parts=3):
    """q and k columns of a projection laid out (heads, parts, head_dim): q, k, v of each head in turn."""
    return (head_columns([h * parts * head_dim for h in range(n_head)], head_dim),
            head_columns([h * parts * head_dim + head_dim for h in range(n_head)], head_dim))


# ----------------------------------------------------------------------------------------- rotary

def _gptj_rotary(m):
    """GPT-J's and CodeGen's rotation: pairs of adjacent features (rotate_every_two) of the first
    rotary_dim of each head, by (sin, cos) from the attention's position_embeddings (5.25) or from
    its own sinusoid table at position_ids (5.23). Their apply_rotary_pos_emb takes (B, T, heads, D)."""
    rotate = _module_function(m, "apply_rotary_pos_emb")

    def rotary(q, k, args, kwargs, seqs):
        if kwargs.get("position_embeddings") is not None:
            sin, cos = kwargs["position_embeddings"]
        else:
            sincos = m.embed_positions[kwargs["position_ids"]]
            sin, cos = sincos.split(sincos.shape[-1] // 2, dim=-1)
        if seqs is not None and sin.shape[0] > 1:
            sin, cos = sin[seqs], cos[seqs]
        n = m.rotary_dim or q.shape[-1]
        turn = lambda x: rotate(x[..., :n].transpose(1, 2), sin, cos).transpose(1, 2).to(x.dtype)
        return torch.cat([turn(q), q[..., n:]], dim=-1), torch.cat([turn(k), k[..., n:]], dim=-1)
    return rotary


# ----------------------------------------------------------------------------------------- the families

def hf_phi3(model):
    """Phi3: one qkv_proj, q's heads then k's (fewer under GQA) then v's; rotary (partial where
    partial_rotary_factor < 1); a sliding window where the config sets one."""
    layers = []
    for m in _attentions(model, "Phi3Attention"):
        h, kv, d = m.config.num_attention_heads, m.config.num_key_value_heads, m.head_dim
        layers.append(Layer(attn=m, q=m.qkv_proj, k=m.qkv_proj, n_head=h, head_dim=d, n_kv_head=kv,
                            q_cols=slice(0, h * d), k_cols=slice(h * d, (h + kv) * d), scale=m.scaling,
                            window=hf_window(m), rotary=_hf_rotary(_module_function(m, "apply_rotary_pos_emb"))))
    return layers


def hf_gpt_neox(model):
    """GPT-NeoX (Pythia): query_key_value viewed (heads, 3, head_dim), each head's q, k, v in turn;
    rotary on the first rotary_pct of each head."""
    layers = []
    for m in _attentions(model, "GPTNeoXAttention"):
        h, d = m.config.num_attention_heads, m.head_size
        q_cols, k_cols = _interleaved(h, d)
        layers.append(Layer(attn=m, q=m.query_key_value, k=m.query_key_value, n_head=h, head_dim=d,
                            q_cols=q_cols, k_cols=k_cols, scale=m.scaling, window=hf_window(m),
                            rotary=_hf_rotary(_module_function(m, "apply_rotary_pos_emb"))))
    return layers


def hf_gptj(model):
    """GPT-J: q_proj and k_proj; GPT-J's pairwise rotary on the first rotary_dim of each head."""
    return [Layer(attn=m, q=m.q_proj, k=m.k_proj, n_head=m.num_attention_heads, head_dim=m.head_dim,
                  scale=getattr(m, "scaling", None) or 1.0 / m.scale_attn, window=hf_window(m), rotary=_gptj_rotary(m))
            for m in _attentions(model, "GPTJAttention")]


def hf_codegen(model):
    """CodeGen: one qkv_proj in 4 shards (the TPU cores it was trained on), each shard its heads' q,
    then v, then k; GPT-J's pairwise rotary."""
    layers = []
    for m in _attentions(model, "CodeGenAttention"):
        h, d, shards = m.num_attention_heads, m.head_dim, getattr(m, "mp_num", 4)
        local = h * d // shards                                   # one shard's q (or v, or k) columns
        start = lambda s, j, part: s * 3 * local + part * local + j * d        # part 0: q, 1: v, 2: k
        heads = [(s, j) for s in range(shards) for j in range(h // shards)]
        layers.append(Layer(attn=m, q=m.qkv_proj, k=m.qkv_proj, n_head=h, head_dim=d,
                            q_cols=head_columns([start(s, j, 0) for s, j in heads], d),
                            k_cols=head_columns([start(s, j, 2) for s, j in heads], d),
                            scale=getattr(m, "scaling", None) or 1.0 / m.scale_attn, window=hf_window(m),
                            rotary=_gptj_rotary(m)))
    return layers


def hf_opt(model):
    """OPT: q_proj and k_proj (the model scales q_proj's output by 1/sqrt(head_dim) itself: the guard
    reads the output before that and applies the same scale); learned positions, no rotation."""
    return [Layer(attn=m, q=m.q_proj, k=m.k_proj, n_head=m.num_heads, head_dim=m.head_dim, scale=m.scaling,
                  window=hf_window(m)) for m in _attentions(model, "OPTAttention")]


def hf_falcon(model):
    """Falcon's query_key_value, in the layout its config says: new_decoder_architecture (Falcon 40B,
    180B) groups each key head's queries, then its k and v, (kv heads, group + 2, head_dim);
    multi_query (7B) has every q head, then one k, one v; otherwise q, k, v interleave per head.
    Rotary, or ALiBi (alibi=True): then q.k alone is read (this file's docstring)."""
    layers = []
    for m in _attentions(model, "FalconAttention"):
        h, d = m.num_heads, m.head_dim
        if m.config.new_decoder_architecture:
            kv = m.config.num_kv_heads
            group = h // kv
            q_cols = head_columns([(g * (group + 2) + i) * d for g in range(kv) for i in range(group)], d)
            k_cols = head_columns([(g * (group + 2) + group) * d for g in range(kv)], d)
        elif m.config.multi_query:
            kv, q_cols, k_cols = 1, slice(0, h * d), slice(h * d, (h + 1) * d)
        else:
            kv, (q_cols, k_cols) = h, _interleaved(h, d)
        rotary = None if m.config.alibi else _hf_rotary(_module_function(m, "apply_rotary_pos_emb"))
        layers.append(Layer(attn=m, q=m.query_key_value, k=m.query_key_value, n_head=h, head_dim=d, n_kv_head=kv,
                            q_cols=q_cols, k_cols=k_cols, scale=m.inv_norm_factor, window=hf_window(m),
                            rotary=rotary))
    return layers


def hf_bloom(model):
    """BLOOM: query_key_value viewed (heads, 3, head_dim), as GPT-NeoX's; ALiBi, so q.k alone is read."""
    layers = []
    for m in _attentions(model, "BloomAttention"):
        q_cols, k_cols = _interleaved(m.num_heads, m.head_dim)
        layers.append(Layer(attn=m, q=m.query_key_value, k=m.query_key_value, n_head=m.num_heads, head_dim=m.head_dim,
                            q_cols=q_cols, k_cols=k_cols, scale=m.inv_norm_factor, window=hf_window(m)))
    return layers


def hf_gpt_bigcode(model):
    """GPT-BigCode (SantaCoder, StarCoder 1): c_attn, an nn.Linear; multi_query: every q head, then one
    k and one v; else (heads, 3, head_dim) as GPT-NeoX. Cross-attention layers are not guarded."""
    layers = []
    for m in _attentions(model, "GPTBigCodeAttention"):
        if m.is_cross_attention:
            continue
        h, d = m.num_heads, m.head_dim
        if m.multi_query:
            kv, q_cols, k_cols = 1, slice(0, h * d), slice(h * d, (h + 1) * d)
        else:
            kv, (q_cols, k_cols) = h, _interleaved(h, d)
        layers.append(Layer(attn=m, q=m.c_attn, k=m.c_attn, n_head=h, head_dim=d, n_kv_head=kv, q_cols=q_cols,
                            k_cols=k_cols, scale=m.scaling, window=hf_window(m)))
    return layers


def _partial_llama(model, names, adapter):
    """Phi and StableLM: Llama's q_proj and k_proj (GQA), rotary on the first rotary_ndims of each head;
    with qk_layernorm=True they normalize q and k themselves, and are refused."""
    layers = []
    for m in _attentions(model, *names):
        refuse_own_qk_norm(m, adapter, "after the projections: qk_layernorm=True")
        layers.append(Layer(attn=m, q=m.q_proj, k=m.k_proj, n_head=m.q_proj.out_features // m.head_dim,
                            head_dim=m.head_dim, n_kv_head=m.k_proj.out_features // m.head_dim, scale=m.scaling,
                            window=hf_window(m), rotary=_hf_rotary(_module_function(m, "apply_rotary_pos_emb"))))
    return layers


def hf_phi(model):
    """Phi (1, 1.5, 2): as Llama, with rotary on part of each head (partial_rotary_factor)."""
    return _partial_llama(model, ("PhiAttention",), "hf-phi")


def hf_stablelm(model):
    """StableLM: as Llama, with rotary on part of each head (partial_rotary_factor)."""
    return _partial_llama(model, ("StableLmAttention",), "hf-stablelm")


def refuse_llama4(model):
    """Llama 4 is refused: where its attention rotates q and k it also normalizes them itself (qk_norm),
    so it has QK-norm already; where it does not, it scales q by position (temperature tuning) and
    attends in chunks. Neither reading would be the model's logit."""
    for m in _attentions(model, "Llama4TextAttention"):
        raise ValueError(f"attach: {type(m).__name__} (Llama 4) normalizes q and k itself (qk_norm) on its rotary "
                         f"layers and scales q by position on the others, so no adapter here reads its logits: it "
                         f"already has QK-norm on those layers; to watch its logits anyway, write an adapter whose q "
                         f"and k are read where the model forms them (qkguard/README.md: Another model's adapter)")
    return []


# Tried by attach(adapter="auto") in this order, before hf-llama: each claims only its own classes.
FAMILY_ADAPTERS = {"hf-phi3": hf_phi3, "hf-gpt-neox": hf_gpt_neox, "hf-gptj": hf_gptj, "hf-codegen": hf_codegen,
                   "hf-opt": hf_opt, "hf-falcon": hf_falcon, "hf-bloom": hf_bloom, "hf-gpt-bigcode": hf_gpt_bigcode,
                   "hf-phi": hf_phi, "hf-stablelm": hf_stablelm, "hf-llama4": refuse_llama4}
