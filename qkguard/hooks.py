"""
QK-Guard for anyone's model: guard.py's dormant controller attached to a PyTorch model by hooks.
`from qkguard import attach` gives attach() below (qkguard/README.md documents it; qkguard/example.py runs it).

    guard = attach(model)                        # the adapter is found from the model's structure
    for step in range(max_steps):
        loss = model(x, labels=y).loss           # the hooks measure forwards with gradients on monitored steps
        loss.backward(); optimizer.step(); optimizer.zero_grad()
        guard.step()                             # after each update: check, act, QK-Clip
    torch.save({"model": model.state_dict(), "guard": guard.state_dict()}, path)   # the latch travels

Four parts, one screen each:
  Layer       what an adapter says of one attention layer: where q and k are formed (which module's
              output, which columns), the heads, the logit scale, the rotation applied after them
  adapters    this project's GPT, a nanoGPT-style GPT, Hugging Face GPT2LMHeadModel and LlamaForCausalLM
              and its relatives (not the Llama-like models that normalize q and k themselves: Qwen3,
              OLMo 2, Gemma 3); the other Hugging Face families are in families.py
  signals     the max logit over a sample of query rows of the layer's own q and k, a chunk of rows at a
              time; sigma(W_q,h) and sigma(W_k,h) by power iteration
  AttachedGuard  the hooks and the step. guard.QKGuard decides, unchanged: threshold, deferred check,
              latch, events. The hooks measure, and carry its action out in the model.

transformers is never imported: the Hugging Face adapters know its modules by their structure, so
this file works, and its tests pass, without it. Nor are triton and the training code (model.py,
attention_kernel.py): only guard.py, which needs torch alone.

Where peft's LoRA wraps q_proj or k_proj, the hooks read the wrapper (q as the adapted model forms
it); under FSDP2 the weights are gathered for the sigmas and QK-Clip scales each rank's shard (the
sections LoRA and sharded weights below).

What the monitor assumes: causal self-attention over whole sequences, within a sliding window where
the adapter gives one (a padding or document mask is not read, so pairs it hides count too),
projection outputs laid out (batch, time, features), and layers of one shape, one guard per model
(watchers, enabled=False, may share one). Under torch.compile the hooks trace into the model's graph
with no break of their own (no clock read unless timing=True, no generator in a hook).
"""
import itertools
import json
import math
import sys
import time
import weakref
from dataclasses import dataclass, field
from typing import Callable, Optional

import torch
import torch.nn as nn

from qkguard.guard import DEFAULT_THRESHOLD, QKGuard, SpectralMonitor   # the decisions: torch alone

# What an attached guard can do in a model it does not own. guard.py's other attention actions
# (softcap, fp32-accum) act inside this project's kernel; lr-drop and clip act in train.py's loop.
ATTACH_ACTIONS = ("qknorm", "qkclip")


def _rms_norm(x, eps=1e-6):
    """The QK-norm: parameter-free RMS norm over head_dim in fp32 (float64 stays), cast back. The same
    expression as attention_kernel._rms_norm (test_attach checks them equal bit for bit), written here
    because that file imports triton, and qkguard must import where triton does not install. It is also
    Qwen3's q_norm and k_norm with weight 1 and eps 1e-6, which qkguard/serve.py's export relies on."""
    xf = x.to(torch.promote_types(x.dtype, torch.float32))
    return (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype)


# ----------------------------------------------------------------------------------------- Layer

@dataclass(eq=False)
class Layer:
    """One attention layer, as an adapter describes it. q and k are read from the outputs of the
    modules `q` and `k` (batch, time, features), at columns q_cols and k_cols, head h at
    h*head_dim:(h+1)*head_dim of those; the weights that make them are the same rows of those
    modules' weights (columns, for a transposed Conv1D). The columns are a slice where q's are one
    block, or a 1-D tensor of column indices where a fused projection interleaves q, k and v per
    head (GPT-NeoX, BLOOM) or per group of heads (Falcon, CodeGen): head_columns() builds them."""
    attn: nn.Module                 # its forward holds one attention: its hook sees q and k complete
    q: nn.Module                    # the module whose output holds q ...
    k: nn.Module                    # ... and k (the same module for a fused q, k, v projection)
    n_head: int
    head_dim: int
    n_kv_head: Optional[int] = None          # k's heads, fewer under GQA; None: n_head
    q_cols: Optional[slice | torch.Tensor] = None   # None: all the module's output columns
    k_cols: Optional[slice | torch.Tensor] = None
    scale: Optional[float] = None            # the logit scale; None: 1 / sqrt(head_dim)
    transposed: bool = False                 # weight stored (in, out), as Hugging Face's Conv1D does
    # rotary(q, k, args, kwargs, seqs) -> (q, k): the rotation the model applies after the projections,
    # from the arguments attn was called with; q, k are (sequences, heads, time, head_dim), the
    # sequences `seqs` of the batch (an index tensor; None: all of them) the monitor samples
    # (or any elementwise step the model takes between the projections and q.k, as OLMo's clamp)
    rotary: Optional[Callable] = None
    # the model's sliding window: query i sees keys i - window + 1 .. i only; None: every key up to i
    window: Optional[int] = None
    # an object with a qk_norm attribute that the model reads itself (this project's GPT);
    # None: the hooks normalize q and k where they are formed
    switch: Optional[object] = None
    _moved: dict = field(default_factory=dict, init=False, repr=False)   # index columns per device: cols()

    def __post_init__(self):
        self.n_kv_head = self.n_kv_head or self.n_head
        self.scale = self.scale or 1.0 / math.sqrt(self.head_dim)
        if self.n_head % self.n_kv_head:
            raise ValueError(f"attach: {self.n_head} query heads cannot share {self.n_kv_head} key heads evenly")

    def heads(self, role):
        return self.n_head if role == "q" else self.n_kv_head

    def cols(self, role, like=None):
        """q's or k's columns; index columns on the device of the tensor `like`, moved there once (a move
        at every forward would wait for the device)."""
        cols = self.q_cols if role == "q" else self.k_cols
        if cols is None or isinstance(cols, slice) or like is None or cols.device == like.device:
            return slice(None) if cols is None else cols
        if (role, like.device) not in self._moved:
            self._moved[role, like.device] = cols.to(like.device)
        return self._moved[role, like.device]

    def weight(self, role):
        """W_q or W_k as (heads * head_dim, in): a view of the live weight where the columns are a slice,
        a copy where they are indices (QK-Clip scales the live one through scale_rows)."""
        module = self.q if role == "q" else self.k
        full = gathered(effective_weight(module), f"W_{role}")
        cols = self.cols(role, full)
        w = full[:, cols].T if self.transposed else full[cols]
        if w.shape[0] != self.heads(role) * self.head_dim:
            raise ValueError(f"attach: W_{role} has {w.shape[0]} rows, not {self.heads(role)} heads x "
                             f"{self.head_dim}: fix the adapter's head count or columns")
        return w

    def in_features(self):
        """W_q's input width, from its (global) shape: no gather of a sharded weight."""
        return self.q.weight.shape[0 if self.transposed else 1]

    @torch.no_grad()
    def scale_rows(self, role, per_row):
        """W_q's or W_k's rows (and bias) times per_row (heads * head_dim,), in the live weight: QK-Clip."""
        module = self.q if role == "q" else self.k
        if is_sharded(module.weight):
            return _scale_sharded_rows(module, self.cols(role, module.weight), per_row, self.transposed)
        cols = self.cols(role, module.weight)
        if self.transposed:
            module.weight[:, cols] *= per_row.to(module.weight.dtype)
        else:
            module.weight[cols] *= per_row.to(module.weight.dtype)[:, None]
        if getattr(module, "bias", None) is not None:
            module.bias[cols] *= per_row.to(module.bias.dtype)


# ----------------------------------------------------------------------------------------- LoRA
# peft's LoRA wraps a projection (q_proj, k_proj, v_proj) in a module of its own: `base_layer` is the
# model's nn.Linear, and the wrapper's output is base_layer(x) + scaling * B(A(x)) for each active
# adapter not merged into base_layer. That output is the q (or k) the model forms, so the hooks read
# the wrapper; the weight that forms it is the base weight plus the adapters' deltas. Known by its
# structure: peft is never imported.

def as_linear(module):
    """The nn.Linear `module` is, or the one peft's LoRA wraps (its base_layer); else None."""
    if isinstance(module, nn.Linear):
        return module
    base = getattr(module, "base_layer", None)
    return base if isinstance(base, nn.Linear) and hasattr(module, "get_delta_weight") else None


def lora_adapters(module):
    """The LoRA adapters that add to `module`'s output now: active, not merged into its base weight, and
    not switched off (peft's disable_adapter()); [] for a module LoRA does not wrap."""
    if not hasattr(module, "get_delta_weight") or getattr(module, "disable_adapters", False):
        return []
    merged = set(getattr(module, "merged_adapters", ()))
    return [a for a in module.active_adapters if a in getattr(module, "lora_A", {}) and a not in merged]


@torch.no_grad()
def effective_weight(module):
    """The weight that forms `module`'s output: its own, or under LoRA the base weight plus each unmerged
    active adapter's delta (peft's get_delta_weight: scaling * B @ A, laid out as the base weight)."""
    weight = module.weight            # a LoRA wrapper's weight is its base layer's
    adapters = lora_adapters(module)
    return weight if not adapters else weight + sum(module.get_delta_weight(a) for a in adapters)


# ----------------------------------------------------------------------------------------- sharded weights
# FSDP2 (fully_shard) keeps each parameter as a DTensor whose rows are split across the ranks, and
# gathers it whole only inside its module's forward. The hooks read q and k (activations, whole on
# every rank) as before, and the max logit is all-reduced; what needs the weights themselves is
# done on every rank at once, in step(): the sigmas gather W_q and W_k (full_tensor, a collective),
# and QK-Clip scales each rank's own rows. DeepSpeed ZeRO-3 leaves an empty tensor in place of a
# partitioned weight outside a forward: nothing to read or scale there, so it is refused.

def is_sharded(weight):
    """Whether `weight` is a DTensor (FSDP2's sharded parameter; tensor parallelism's too). Looked up, not
    imported: a model holds DTensors only once torch.distributed.tensor was imported by whoever made them."""
    DTensor = getattr(getattr(torch.distributed, "tensor", None), "DTensor", None)
    return DTensor is not None and isinstance(weight, DTensor)


def gathered(weight, name):
    """`weight` whole: a sharded one gathered from every rank (a collective: every rank must call it
    at once), a ZeRO-3 one refused in one line."""
    if hasattr(weight, "ds_shape") or hasattr(weight, "ds_id"):
        raise ValueError(f"attach: {name} is partitioned by DeepSpeed ZeRO-3 (an empty tensor outside the forward), "
                         f"so the guard can neither read its sigmas nor scale it: use ZeRO stage 1 or 2, or FSDP2 "
                         f"(torch.distributed.fsdp.fully_shard), which qkguard supports")
    return weight.full_tensor() if is_sharded(weight) else weight


@torch.no_grad()
def _scale_sharded_rows(module, cols, per_row, transposed):
    """QK-Clip on a DTensor weight: the factor for every output row (1 outside `cols`), split as the
    weight's rows are (every rank computed the same factors from the all-reduced max logit, so no data
    moves), each rank scaling its own shard in place."""
    from torch.distributed.tensor import distribute_tensor
    weight = module.weight
    rows = weight.shape[1 if transposed else 0]
    factor = torch.ones(rows, device=weight.to_local().device, dtype=weight.dtype)
    factor[cols] = per_row.to(factor)
    if transposed:                     # a Conv1D's outputs are its columns: the shards split its inputs
        weight.to_local().mul_(factor[None, :])
    else:
        local = distribute_tensor(factor, weight.device_mesh, weight.placements, src_data_rank=None).to_local()
        weight.to_local().mul_(local[:, None])
    if getattr(module, "bias", None) is not None:   # (out,), sharded as any 1-d parameter, Conv1D's too
        bias = module.bias
        shard = distribute_tensor(factor, bias.device_mesh, bias.placements, src_data_rank=None).to_local()
        bias.to_local().mul_(shard.to(bias.dtype))


def head_columns(starts, head_dim):
    """The column indices of heads of head_dim columns each, head h's from column starts[h]: q or k of a
    fused projection whose heads interleave with the others' (a Layer's q_cols, k_cols)."""
    starts = torch.as_tensor(starts)
    return (starts[:, None] + torch.arange(head_dim)).flatten()


class Switch:
    """The per-layer switch QKGuard.apply_to_model() flips, for a model that has none of its own."""
    qk_norm = False


# ----------------------------------------------------------------------------------------- adapters
# An adapter is a function: model -> [Layer], one per attention layer, in order; [] if it does not
# recognise the model. "auto" tries the built-in ones in this order.

def qkguard_gpt(model):
    """This project's GPT (model.py): q_proj and k_proj, rotary after them (arch llama), and its own
    qk_norm switch, which the kernel applies."""
    model_py = sys.modules.get("model")      # not imported here: a model of it was built, so it is loaded
    if model_py is None or not isinstance(model, getattr(model_py, "GPT", ())):
        return []
    apply_rotary = model_py.apply_rotary

    def rotary(q, k, args, kwargs, seqs):   # forward(x, rotary): (cos, sin) by position, or None (gpt2)
        tables = args[1] if len(args) > 1 else kwargs.get("rotary")
        return (q, k) if tables is None else (apply_rotary(q, *tables), apply_rotary(k, *tables))
    return [Layer(attn=a, q=a.q_proj, k=a.k_proj, n_head=a.n_head, head_dim=a.head_dim, scale=a.scale,
                  rotary=rotary, switch=a) for a in model.attentions]


def nanogpt(model):
    """A nanoGPT-style GPT: each attention a module with n_head and one fused nn.Linear c_attn whose
    output is q, k, v in that order; scaled_dot_product_attention with its default scale."""
    layers = []
    for m in model.modules():
        c_attn = getattr(m, "c_attn", None)
        if isinstance(c_attn, nn.Linear) and isinstance(getattr(m, "n_head", None), int):
            width = c_attn.out_features // 3
            layers.append(Layer(attn=m, q=c_attn, k=c_attn, n_head=m.n_head, head_dim=width // m.n_head,
                                q_cols=slice(0, width), k_cols=slice(width, 2 * width)))
    return layers


def hf_gpt2(model):
    """Hugging Face GPT2LMHeadModel: c_attn is a Conv1D (weight stored (in, out), so W_q is the
    transpose of its first columns); the scale is the module's own (it can divide by the layer index)."""
    layers = []
    for m in model.modules():
        c_attn = getattr(m, "c_attn", None)
        if type(c_attn).__name__ == "Conv1D" and hasattr(m, "num_heads") and not getattr(m, "is_cross_attention", False):
            width = m.embed_dim
            layers.append(Layer(attn=m, q=c_attn, k=c_attn, n_head=m.num_heads, head_dim=m.head_dim,
                                q_cols=slice(0, width), k_cols=slice(width, 2 * width),
                                scale=getattr(m, "scaling", None), transposed=True))
    return layers


# Where a Hugging Face attention normalizes q and k itself, after q_proj and k_proj (Qwen3, OLMo 2,
# Gemma 3, Cohere: q_norm, k_norm; StableLM, Persimmon, Phi: q_layernorm, k_layernorm; Llama 4: qk_norm;
# Hunyuan: query_layernorm, key_layernorm).
OWN_QK_NORMS = ("q_norm", "k_norm", "q_layernorm", "k_layernorm", "qk_norm", "query_layernorm", "key_layernorm")


def refuse_own_qk_norm(m, adapter, where):
    """Refuse an attention module m that normalizes q and k itself (`where`: after which projections)."""
    norms = [n for n in OWN_QK_NORMS if isinstance(getattr(m, n, None), nn.Module)]
    if norms:
        raise ValueError(f"attach: {type(m).__name__} normalizes q and k itself ({', '.join(norms)}, {where}), so "
                         f"the {adapter} adapter would measure them before that norm: this model already has "
                         f"QK-norm; to watch its logits anyway, write an adapter whose q and k are read after the "
                         f"model's own norm (qkguard/README.md: Another model's adapter)")


def hf_llama(model):
    """Hugging Face LlamaForCausalLM: q_proj and k_proj Linears (k with fewer heads under GQA), then the
    rotary embedding, by the modeling file's own apply_rotary_pos_emb and the position_embeddings
    (cos, sin) the attention is called with. QK-norm acts on the projections, before the rotation:
    a rotation keeps each head's norm, so the bound holds after it. The same layout's relatives are
    read as they attend: a sliding window (Mistral, Qwen2, Gemma 2: hf_window), OLMo's clamp of q and
    k at clip_qkv. A model of this layout that normalizes q and k itself after the projections is
    refused: the hooks would read q and k before that norm, and the logits they measure would not be
    the model's."""
    layers = []
    for m in model.modules():
        q_proj, k_proj = getattr(m, "q_proj", None), getattr(m, "k_proj", None)
        if not (as_linear(q_proj) is not None and as_linear(k_proj) is not None     # or LoRA's wrappers of them
                and hasattr(getattr(m, "config", None), "num_key_value_heads")):
            continue
        refuse_own_qk_norm(m, "hf-llama", "after q_proj and k_proj")
        rotate = getattr(sys.modules[type(m).__module__], "apply_rotary_pos_emb", None)
        if rotate is None:
            raise ValueError(f"attach: {type(m).__name__}'s module has no apply_rotary_pos_emb: write an adapter "
                             f"whose rotary applies this model's rotation (qkguard/README.md: Another model's adapter)")
        # gpt-oss rotates the whole head by cos, sin of half its width (each feature of the first half
        # with its partner in the second), where a table of half the width elsewhere means half the head
        whole = type(m).__name__.startswith("GptOss")
        rotary = _hf_rotary(rotate, clamp=getattr(m.config, "clip_qkv", None), whole=whole) if _rotates(m) else None
        layers.append(Layer(attn=m, q=q_proj, k=k_proj, n_head=as_linear(q_proj).out_features // m.head_dim,
                            head_dim=m.head_dim, n_kv_head=as_linear(k_proj).out_features // m.head_dim,
                            scale=getattr(m, "scaling", None), window=hf_window(m), rotary=rotary))
    return layers


def _rotates(m):
    """Whether the attention m rotates q and k: not on SmolLM3's layers listed 0 in no_rope_layers
    (use_rope), nor on Cohere2's full-attention layers (rotary on its sliding layers only, unless
    force_rope). Read with a rotation those layers never apply, their logits would be wrong."""
    if not getattr(m, "use_rope", True):
        return False
    if type(m).__name__.startswith("Cohere2"):
        return m.sliding_window is not None or getattr(m, "force_rope", False)
    return True


def _hf_rotary(rotate, clamp=None, whole=False):
    """The rotation by position_embeddings (cos, sin), of the first cos.shape[-1] features of each head
    (all of them in Llama; a part in Phi, StableLM, GPT-NeoX), after a clamp of q and k to [-clamp,
    clamp] where the model clamps them (OLMo's clip_qkv: in place, after the hooks copied them out)."""
    def rotary(q, k, args, kwargs, seqs):
        cos, sin = kwargs["position_embeddings"]          # (batch or 1, time, rotated features)
        if seqs is not None and cos.shape[0] > 1:         # positions given per sequence: the sampled ones
            cos, sin = cos[seqs], sin[seqs]
        if clamp is not None:
            q, k = q.clamp(-clamp, clamp), k.clamp(-clamp, clamp)
        n = cos.shape[-1]
        if whole or n == q.shape[-1]:
            return rotate(q, k, cos, sin)
        q_rot, k_rot = rotate(q[..., :n], k[..., :n], cos, sin)
        return torch.cat([q_rot, q[..., n:]], dim=-1), torch.cat([k_rot, k[..., n:]], dim=-1)
    return rotary


def hf_window(m):
    """The sliding window a Hugging Face attention m attends within, as its model builds the mask: the
    layer's own sliding_window where it has one (Qwen2, Gemma 2: None on full-attention layers), else
    by the config's layer_types, else the config's sliding_window for every layer (Mistral, Phi3)."""
    if hasattr(m, "sliding_window"):
        return m.sliding_window
    config = getattr(m, "config", None)
    window, types = getattr(config, "sliding_window", None), getattr(config, "layer_types", None)
    if window is not None and types is not None and getattr(m, "layer_idx", None) is not None:
        return window if types[m.layer_idx] == "sliding_attention" else None
    return window


# The other Hugging Face families (qkguard/families.py, which builds its Layers from this file's, so it
# is imported here, below them): each knows its attention by class name, so "auto" tries them first.
from qkguard.families import FAMILY_ADAPTERS  # noqa: E402

ADAPTERS = {"qkguard-gpt": qkguard_gpt, **FAMILY_ADAPTERS, "hf-llama": hf_llama, "hf-gpt2": hf_gpt2,
            "nanogpt": nanogpt}


def find_layers(model, adapter="auto"):
    """The model's attention layers, by the named (or given) adapter; "auto" takes the first built-in
    one that recognises the model."""
    if callable(adapter):
        layers, name = adapter(model), getattr(adapter, "__name__", "the adapter")
    elif adapter == "auto":
        layers, name = next(((ls, n) for n, a in ADAPTERS.items() for ls in [a(model)] if ls), ([], "auto"))
    elif adapter in ADAPTERS:
        layers, name = ADAPTERS[adapter](model), adapter
    else:
        raise ValueError(f"attach: unknown adapter {adapter!r}: choose one of auto, {', '.join(ADAPTERS)}, or pass "
                         f"a function model -> [Layer]")
    mla = next((m for m in model.modules() if hasattr(m, "kv_a_proj_with_mqa")), None)
    if not layers and mla is not None:
        raise ValueError(f"attach: {type(mla).__name__} is multi-head latent attention (DeepSeek-V2/V3's MLA): each "
                         f"head's k joins a part from kv_b_proj with a rotary part shared by all heads from "
                         f"kv_a_proj_with_mqa, which no built-in adapter reads yet: write an adapter for it "
                         f"(qkguard/README.md: Another model's adapter)")
    if not layers:
        raise ValueError(f"attach: {name} found no attention layer in {type(model).__name__}: pass adapter= one of "
                         f"{', '.join(ADAPTERS)}, or write one (qkguard/README.md: Another model's adapter)")
    return layers


# ----------------------------------------------------------------------------------------- signals

def sample_rows(b, t, seqs, rows, seed, device=None):
    """The query rows a monitored step reads: `seqs` of the batch's b sequences and `rows` of the t
    positions (the same in each), drawn without replacement: the indices ordered by a hash of each
    index and `seed`, the first ones taken. The guard draws `seed` from its own generator in step(),
    outside the forward (the global RNG, and so dropout, stays untouched); the draw itself is tensor
    arithmetic on `device`, so under torch.compile the hooks trace without a graph break (a generator
    cannot be traced) and nothing waits on a host copy. Returns (sequence indices, positions), sorted;
    None where the count is None or covers them all."""
    def draw(n, k, salt):
        if k is None or k >= n:
            return None
        return _hash31(torch.arange(n, device=device), seed ^ salt).argsort()[:k].sort().values
    return draw(b, seqs, 0x5EC5), draw(t, rows, 0x2085)


def _hash31(x, seed):
    """A 31-bit integer hash of each x (< 2^31) and seed: multiply-xorshift rounds, in int64 without overflow."""
    x = (x * 0x9E3779B1 + seed) & 0x7FFFFFFF
    for multiplier in (0x2C1B3C6D, 0x297A2D39):
        x = ((x ^ (x >> 16)) * multiplier) & 0x7FFFFFFF
    return x ^ (x >> 16)


# Logits held at once by sampled_max_logit (fp32: 128 MiB): it walks the query rows in chunks of this
# many logits, so its memory stays this whatever the context (a whole (S, H, T, T) at T = 32k is GiBs).
MAX_LOGIT_CHUNK = 1 << 25


@torch.no_grad()
def sampled_max_logit(q, k, scale, sample=(None, None), chunk=MAX_LOGIT_CHUNK, window=None):
    """Per query head, the max of scale * q.k over the sampled query rows (sample_rows) and the keys
    each sees (causal; under a sliding `window`, the last `window` of them), in fp32: a lower bound on
    the max over all rows, equal without a sample.
    q (B, H, T, D), k (B, H_kv, T, D): query head h reads key head h // (H / H_kv), as GQA repeats them.
    Whole sequences keep the products large (T x D times D x T): one of a batch of 8 costs 1/8 of a
    dense QK^T, where single rows scattered over the batch would each be a product of its own. The rows
    go a chunk at a time, `chunk` logits at most (one row's, if a row alone has more)."""
    seqs, pos = sample
    if seqs is not None:
        q, k = q.index_select(0, seqs), k.index_select(0, seqs)
    n_seq, n_head, t = q.shape[:3]
    if pos is not None:
        q = q.index_select(2, pos)
    q = (q.float() * scale).unflatten(1, (k.shape[1], -1))                    # (S, H_kv, group, R, D)
    k = k.float()[:, :, None]                                                 # (S, H_kv, 1, T, D)
    step, best = max(1, chunk // (n_seq * n_head * t)), None
    for start in range(0, q.shape[3], step):
        if pos is None:    # query rows start..end-1: they see no key past end - 1, so those are not multiplied
            end = min(start + step, t)
            rows, keys = torch.arange(start, end, device=q.device), k[:, :, :, :end]
        else:              # sampled positions: their last is on the device, so every key (no host sync)
            rows, keys = pos[start:start + step], k
        logits = torch.matmul(q[:, :, :, start:start + step], keys.mT)      # (S, H_kv, group, rows, keys)
        key = torch.arange(keys.shape[3], device=q.device)
        unseen = key > rows[:, None]                                             # key j > query i: masked
        if window is not None:
            unseen |= key <= rows[:, None] - window                              # and j <= i - window
        value = logits.masked_fill_(unseen, -math.inf).amax(dim=(0, 3, 4))
        best = value if best is None else torch.maximum(best, value)
    return best.flatten()


class QKSigma:
    """sigma(W_q,h) and sigma(W_k,h) of every layer, and of the whole W_q and W_k (for the log), by power
    iteration carried across calls, as guard.SpectralMonitor does for this project's GPT (its
    _power_step, reused): the weights move little per step, so one iteration keeps up. The layers are
    stacked (one product for all of them: adapters give layers of one shape)."""

    def __init__(self, layers, generator):
        self.layers = layers
        n_in, device = layers[0].weight("q").shape[1], layers[0].weight("q").device
        self.v = {f"{role}_{which}": torch.randn(len(layers), layers[0].heads(role) if which == "head" else 1, n_in,
                                                 generator=generator).to(device)
                  for role in ("q", "k") for which in ("head", "all")}

    @torch.no_grad()
    def measure(self, iters=1, which="head"):
        """(sigma of W_q, of W_k) per layer: per head (n_layer, n_head) and (n_layer, n_kv_head) if which is
        "head"; of the whole matrix, (n_layer, 1) each, if "all"."""
        out = []
        for role in ("q", "k"):
            heads = self.layers[0].heads(role) if which == "head" else 1
            w = torch.stack([layer.weight(role) for layer in self.layers]).float().unflatten(1, (heads, -1))
            v = self.v[f"{role}_{which}"]                                     # w: (layer, heads, rows, in)
            for _ in range(iters):
                v = SpectralMonitor._power_step(w, v)
            self.v[f"{role}_{which}"] = v
            out.append(torch.einsum("lhoi,lhi->lho", w, v).norm(dim=-1))
        return tuple(out)


# ----------------------------------------------------------------------------------------- the guard

# module -> the guards hooked on it (weak both ways: a model dropped with its guard still goes), so that
# a second attach does not stack its hooks on the first's unnoticed, and a guard whose name was lost
# (a notebook cell run again) can be found from its model
_ATTACHED = weakref.WeakKeyDictionary()


def attached(model):
    """The guards attached to `model` (to any of its modules), oldest first: one whose variable was lost
    or overwritten still hooks the model, and is found here."""
    modules = set(model.modules())
    guards = {g for m in modules for g in _ATTACHED.get(m, ())}
    return sorted(guards, key=lambda g: g.serial)


def detach(model):
    """Detach every guard attached to `model` (attached()); returns how many. For a guard that was
    lost: `attach(model)` run again refuses to stack a second guard, and this frees the model."""
    guards = attached(model)
    for guard in guards:
        guard.detach()
    return len(guards)


class AttachedGuard:
    """QK-Guard on a model through hooks: one on each module that forms q or k, one on each attention.

    Dormant, the hooks return nothing. On a monitored step they copy q and k out, detached, and pick the
    sampled rows by a seed step() drew from the guard's own generator: the model's outputs, gradients
    and RNG are those of a run without the guard, so its training is bit for bit the same. The forwards measured are those run
    with gradients enabled, in train() or eval() mode alike (a from_pretrained model is in eval mode):
    a forward under torch.no_grad or inference_mode, as a validation loss, is not part of the step's signal.
    The monitored steps are one update in `interval`: with interval N the guard sees updates 0, N, 2N, ...
    only, and a spike on the updates between them is not seen (train.py's kernel measures every update
    for free and checks the max since the last check; here the measurement is the cost that N saves).
    QKGuard (guard.py) decides when to act, and this class acts:
      qknorm  each head's q and k RMS-normalized over head_dim where they are formed, as this project's
              kernel does (attention_kernel._rms_norm, scale unchanged): |q| = |k| = sqrt(head_dim) at most
              (in fp32; a bf16 model rounds it), so |logit| <= scale * head_dim (sqrt(head_dim) at the usual scale)
      qkclip  after each update, the rows of W_q and W_k (and their biases) of each covered head whose max
              logit S passed tau, so that its logits shrink by tau / S (Kimi K2's QK-Clip). A sampled S is a
              lower bound and would under-clip, so every step that may clip reads every row of the batch:
              from the trigger on, and, while dormant, each monitored step that acts on a queued check (its
              crossing reaches the host only then): an enabled qkclip guard's seqs and rows set step 0's only
    """

    serials = itertools.count()        # attach order, for attached()

    def __init__(self, model, layers, qkguard, *, interval=1, seqs=1, rows=None, seed=0, tensorboard=None,
                 log_every=10, timing=False, always=False, alpha=0.5):
        if len({(layer.n_head, layer.n_kv_head, layer.head_dim, layer.weight("q").shape) for layer in layers}) > 1:
            raise ValueError("attach: the layers differ in heads or width; QK-Guard's signal is one (layer, head) "
                             "table: guard layers of one shape (an adapter may return a subset)")
        modules = {m for layer in layers for m in (layer.attn, layer.q, layer.k)}
        others = {g for m in modules for g in _ATTACHED.get(m, ())}
        if others and (qkguard.enabled or always or any(g.acts for g in others)):
            raise ValueError(f"attach: {type(model).__name__} already has a QK-Guard attached, and a second one would "
                             f"stack its hooks on the first's: call the first one's detach() before attaching again, or "
                             f"qkguard.detach(model) if you no longer hold it (only watchers, enabled=False, may share "
                             f"a model)")
        self.model, self.layers, self.qkguard = model, layers, qkguard
        # always: QK-Clip at every update from the first, as Megatron-LM's --qk-clip and torchtitan's do (no
        # trigger: qkguard then only watches); alpha: the share of each head's factor W_q takes (W_k: 1 - alpha)
        self.always, self.alpha = always, alpha
        self.interval, self.seqs, self.rows, self.log_every = interval, seqs, rows, log_every
        self.serial, self.timing = next(AttachedGuard.serials), timing
        # what QKGuard.apply_to_model flips: the model's own switch where it has one
        self.attentions = [Switch() if layer.switch is None else layer.switch for layer in layers]
        self.generator = torch.Generator().manual_seed(seed)
        self.sigma = QKSigma(layers, self.generator)
        self.sigma_head = self._measure_sigma(iters=30)   # converged before step 0, as in train.py
        self._sigma_whole = self.sigma.measure(iters=30, which="all")     # (sigma_q, sigma_k) of whole matrices
        self.steps, self.max_logit, self.events = 0, None, []
        self.max_logit_step = None        # the update self.max_logit was measured at
        # timing=True: host time in the guard's hooks and step() (CPU: its whole cost; CUDA: launches). Off
        # by default: a clock read inside a hook is a graph break under torch.compile
        self.seconds = 0.0
        self._seen = [{} for _ in layers]          # this forward's q and k, per layer, until its attention ends
        self._running = [None] * len(layers)       # this step's max logit per layer (micro-batches: the max)
        self._plan()
        self._draw()
        self.writer = _tensorboard_writer(tensorboard) if tensorboard else None
        feeds = {}   # module -> [(layer, "q" or "k")]: one hook per module, as a fused c_attn forms both
        for i, layer in enumerate(layers):
            for role, module in (("q", layer.q), ("k", layer.k)):
                feeds.setdefault(module, []).append((i, role))
        self.handles = [module.register_forward_hook(self._projection_hook(roles)) for module, roles in feeds.items()]
        self.handles += [layer.attn.register_forward_hook(self._attention_hook(i), with_kwargs=True)
                         for i, layer in enumerate(layers)]
        for module in modules:
            _ATTACHED.setdefault(module, weakref.WeakSet()).add(self)

    @property
    def triggered(self):
        return self.qkguard.triggered

    @property
    def on(self):
        """Whether the action is on now: fired, or QK-Clip always (record()'s "guard", the logs' qkguard/on)."""
        return self.triggered or self.always

    @property
    def acts(self):
        """Whether it ever changes the model: dormant or fired, or always clipping (not a watcher)."""
        return self.qkguard.enabled or self.always

    def _sharded(self):
        """Whether W_q or W_k is sharded now (FSDP2 may shard the model after the guard was attached)."""
        return any(is_sharded(m.weight) for layer in self.layers for m in (layer.q, layer.k))

    def _clipping(self):
        return self.always or (self.qkguard.triggered and self.qkguard.action == "qkclip")

    def _plan(self):
        """Whether the next update's forwards are measured, and over all rows or a sample."""
        self._measuring = self.steps % self.interval == 0 or self._clipping()
        # QK-Clip scales by tau / S: S must be the max over every row. It clips at the step that acts on
        # a queued check; whether that check crossed is on the host only then (reading it now would wait
        # for the device), so under qkclip every step with a check queued reads all rows too.
        may_clip = self.qkguard.action == "qkclip" and self.qkguard.pending is not None
        self._all_rows, self._sample_shape = self._clipping() or may_clip, None

    def _draw(self):
        """The next step's sample seed (sample_rows), from the guard's generator: here, not in a hook."""
        self._set_seed(int(torch.randint(0, 1 << 31, (), generator=self.generator)))

    def _set_seed(self, seed):
        """The seed as a number (for state_dict) and as a tensor the hooks read. A tensor, written in place:
        under torch.compile a graph reads it as an input, where a Python int would be a constant the
        graph is specialised on, and a new seed at each step would recompile the model each step."""
        self._seed = seed
        if not hasattr(self, "_seed_tensor"):
            self._seed_tensor = torch.zeros((), dtype=torch.int64)
        self._seed_tensor.fill_(seed)

    # ------------------------------------------------------------------------- the hooks

    def _projection_hook(self, roles):
        def hook(module, args, out):
            # a forward with gradients is one the update learns from; one under no_grad (a validation
            # loss, in train() mode or not) is not part of the step's signal
            measuring, new = self._measuring and torch.is_grad_enabled(), None
            for i, role in roles:
                layer, on = self.layers[i], self.attentions[i].qk_norm
                acting = on and layer.switch is None      # else the model normalizes itself, or it is off
                if not (acting or measuring):
                    continue                  # the dormant path: nothing computed, the output untouched
                started = time.perf_counter() if self.timing else 0.0
                if out.shape[-1] != module.weight.shape[1 if layer.transposed else 0]:
                    raise ValueError(f"QK-Guard: {type(module).__name__}'s output has {out.shape[-1]} features, not "
                                     f"its weight's {module.weight.shape[1 if layer.transposed else 0]}: under tensor "
                                     f"parallelism a rank forms only its own heads, which qkguard does not support "
                                     f"(data parallelism, DDP or FSDP2, is): attach to a model that is not tensor-parallel")
                cols = layer.cols(role, out)
                part = out[..., cols].unflatten(-1, (layer.heads(role), layer.head_dim))   # (B, T, heads, D)
                if acting:                         # the action, where q and k are formed
                    part = _rms_norm(part)
                    if isinstance(cols, slice) and cols == slice(None):
                        new = part.flatten(-2)
                    else:                          # a fused projection: its other columns pass through
                        new = out.clone() if new is None else new
                        new[..., cols] = part.flatten(-2)
                if measuring:                     # the sampled sequences, copied out
                    seqs = self._sample_for(part)[0]
                    seen = part.detach() if seqs is None else part.detach().index_select(0, seqs)
                    if on and layer.switch is not None:   # the model normalizes itself: measure what it sees
                        seen = _rms_norm(seen)
                    self._seen[i][role] = seen.transpose(-3, -2)                         # (S, heads, T, D)
                if self.timing:
                    self.seconds += time.perf_counter() - started
            return new
        return hook

    def _attention_hook(self, i):
        def hook(module, args, kwargs, out):
            seen = self._seen[i]
            if "q" in seen and "k" in seen:
                started, layer = time.perf_counter() if self.timing else 0.0, self.layers[i]
                with torch.no_grad():
                    q, k = seen["q"], seen["k"]
                    seqs, pos = self._sample
                    if layer.rotary is not None:
                        q, k = layer.rotary(q, k, args, kwargs, seqs)
                    value = sampled_max_logit(q, k, layer.scale, (None, pos), window=layer.window)
                running = self._running[i]
                self._running[i] = value if running is None else torch.maximum(running, value)
                if self.timing:
                    self.seconds += time.perf_counter() - started
            seen.clear()
        return hook

    def _sample_for(self, part):
        """This forward's sample of rows (sample_rows) for a projection's output part (B, T, heads, D):
        drawn once per batch shape and step, and read by every layer (and micro-batch) of that shape."""
        shape = part.shape[0], part.shape[-3]
        if self._sample_shape != shape:
            self._sample = (None, None) if self._all_rows else \
                sample_rows(*shape, self.seqs, self.rows, self._seed_tensor, part.device)
            self._sample_shape = shape
        return self._sample

    # ------------------------------------------------------------------------- the step

    def step(self):
        """Call once after each optimizer update, as train.py's loop does at (6) and (7). A monitored step
        refreshes sigma and hands QKGuard this step's signal: it acts on the check it queued last time
        and queues this one (observe_deferred: no host sync). Under qkclip, the covered heads are clipped.
        Returns the guard's event (a dict, train.py's guard_trigger record) on the step it acts, else None."""
        step, event, started = self.steps, None, time.perf_counter()
        max_logit = self._take_max_logit() if self._measuring else None
        if max_logit is not None:
            self.max_logit, self.max_logit_step = max_logit, step
        if step % self.interval == 0:
            if self.qkguard.signal == "sigma-product":    # else refreshed for the log only (record())
                self.sigma_head = self._measure_sigma()
            event = self.qkguard.observe_deferred(step, max_logit, self.sigma_head, self)
        if self._clipping():
            self._clip(max_logit)
        if step % self.interval == 0 and self._sharded():   # record()'s sigmas, after the clip: a gather needs
            if self.qkguard.signal != "sigma-product":        # every rank, and record() may be called on one
                self.sigma_head = self._measure_sigma()
            self._sigma_whole = self.sigma.measure(1, which="all")
        if event is not None:
            self.events.append(event)
            if self.writer is not None:
                self.writer.add_text("qkguard/event", json.dumps(event), step)
        if self.writer is not None and step % self.log_every == 0:
            self._write_tensorboard(step)
        self.steps += 1
        self._plan()
        self._draw()
        if self.timing:
            self.seconds += time.perf_counter() - started
        return event

    def _take_max_logit(self):
        missing = [i for i, value in enumerate(self._running) if value is None]
        if missing:
            raise RuntimeError(f"QK-Guard: no forward with gradients enabled reached attention layer {missing[0]} "
                               f"since the last guard.step(): call guard.step() once after each optimizer step (forwards "
                               f"under torch.no_grad, as a validation loss, are not measured)")
        out, self._running = torch.stack(self._running), [None] * len(self.layers)
        if torch.distributed.is_available() and torch.distributed.is_initialized():
            torch.distributed.all_reduce(out, op=torch.distributed.ReduceOp.MAX)   # every rank decides alike
        return out

    def _measure_sigma(self, iters=1):
        """(n_layer, 2, n_head): sigma(W_q,h) at [:, 0], and at [:, 1] sigma of the W_k head h reads."""
        s_q, s_k = self.sigma.measure(iters)
        return torch.stack([s_q, s_k.repeat_interleave(self.layers[0].n_head // self.layers[0].n_kv_head, dim=1)], dim=1)

    @torch.no_grad()
    def _clip(self, max_logit):
        """QK-Clip, with no host sync: each covered head h (every head, if always) gets its logits times
        f_h = tau / S_h where its max logit S_h passed tau (1 elsewhere). W_q's rows take f_h / a and
        W_k's take a, with a the least f_h among the query heads that read that key head, to the power
        1 - alpha: without GQA, f_h^alpha and f_h^(1 - alpha) (Kimi K2's split, sqrt each, at alpha 0.5;
        Megatron-LM's and torchtitan's alpha); under GQA the other heads of the group keep their logits."""
        tau = self.qkguard.tau
        for i in range(len(self.layers)) if self.always else self.qkguard.layers:
            layer = self.layers[i]
            s = max_logit[i]
            f = torch.where(s > tau, tau / s.clamp_min(1e-30), torch.ones_like(s))
            least = f.unflatten(0, (layer.n_kv_head, -1)).amin(dim=1)                # per key head
            a = least.sqrt() if self.alpha == 0.5 else least.pow(1 - self.alpha)       # (sqrt: the split as it was)
            for role, factor in (("q", f / a.repeat_interleave(layer.n_head // layer.n_kv_head)), ("k", a)):
                layer.scale_rows(role, factor.repeat_interleave(layer.head_dim))

    # ------------------------------------------------------------------------- logs and checkpoints

    def record(self, iters=2):
        """The last measured step's signals for a log line, under train.py's keys (a host sync: call it
        at log steps): max_logit (layer x head), sigma_q_head and sigma_k_head (per head; k's per key
        head), sigma_q and sigma_k (whole matrices), and guard. The sigmas the guard does not watch are
        refreshed here, by `iters` power steps from where the last call left them."""
        if self._sharded():         # gathering W_q here would wait for the ranks that do not log: step()'s values
            whole_q, whole_k = self._sigma_whole
        else:
            if self.qkguard.signal != "sigma-product":
                self.sigma_head = self._measure_sigma(iters)
            whole_q, whole_k = self._sigma_whole = self.sigma.measure(iters, which="all")
        groups = self.layers[0].n_head // self.layers[0].n_kv_head
        return {"max_logit": None if self.max_logit is None else self.max_logit.tolist(),
                "sigma_q": whole_q[:, 0].tolist(), "sigma_k": whole_k[:, 0].tolist(),
                "sigma_q_head": self.sigma_head[:, 0].tolist(),
                "sigma_k_head": self.sigma_head[:, 1, ::groups].tolist(),
                "guard": "on" if self.on else ("dormant" if self.qkguard.enabled else "off")}

    def _write_tensorboard(self, step):
        """Each signal at `step` only if it was measured at `step`: an older value plotted there would be stale."""
        if self.max_logit_step == step:
            for i, value in enumerate(self.max_logit.amax(dim=1).tolist()):
                self.writer.add_scalar(f"qkguard/max_logit/layer{i}", value, step)
        watched = self.qkguard.signal == "sigma-product"
        if not watched and not self._sharded():       # refreshed for the log alone, as record() does
            self.sigma_head = self._measure_sigma(iters=2)
        if not watched or step % self.interval == 0:   # the guard's own: measured at monitored steps
            for i, value in enumerate((self.sigma_head[:, 0] * self.sigma_head[:, 1]).amax(dim=1).tolist()):
                self.writer.add_scalar(f"qkguard/sigma_product/layer{i}", value, step)
        self.writer.add_scalar("qkguard/on", float(self.on), step)

    def _settings(self):
        g = self.qkguard
        return {"signal": g.signal, "action": g.action, "threshold": float(g.threshold), "scope": g.scope,
                "always": self.always, "alpha": self.alpha}

    def _shape(self):
        """What a state is a state of: per layer, the heads, key heads, head_dim and W_q's input width."""
        layer = self.layers[0]
        return [len(self.layers), layer.n_head, layer.n_kv_head, layer.head_dim, layer.in_features()]

    def state_dict(self):
        """The latch (QKGuard's trigger, covered layers, queued check), the settings it was latched under,
        the step count, the power iteration's vectors, the sampling generator and the next step's sample
        seed: plain tensors, lists and numbers (torch.load weights_only)."""
        return {"n_layer": len(self.layers), "shape": self._shape(), "steps": self.steps, "guard": self.qkguard.state_dict(),
                "settings": self._settings(), "sigma_v": {key: v.cpu() for key, v in self.sigma.v.items()},
                "generator": self.generator.get_state(), "sample_seed": self._seed,
                "events": [dict(event) for event in self.events],
                # the last max logit read and its step: a resumed run logs it where the uninterrupted one does
                "max_logit": None if self.max_logit is None else self.max_logit.cpu(),
                "max_logit_step": self.max_logit_step}

    def load_state_dict(self, state):
        """A saved guard back; a latched action is on again in the model at once. All or nothing: every
        check comes before the first change. The guard must have the saved one's signal, action,
        threshold and scope (a latch fired under one action and resumed under another would act as
        neither run asked), and be of a model of the saved one's shape. A watcher (enabled=False) never
        acts, so it refuses a state that fired: the model was trained with the action on."""
        missing = [key for key in ("guard", "steps", "sigma_v", "generator") if key not in state]
        if missing:
            raise ValueError(f"QK-Guard: this state has no {', '.join(missing)}: it is not a guard's state_dict() "
                             f"(nothing was changed)")
        if state.get("n_layer") != len(self.layers):
            raise ValueError(f"QK-Guard: this state is of a model with {state.get('n_layer')} attention layers, not "
                             f"{len(self.layers)}: load the guard state saved with this model")
        saved_v, mine_v = state.get("sigma_v", {}), self.sigma.v  # a state saved before "shape" was: its vectors
        if state.get("shape", self._shape()) != self._shape() or {k: tuple(v.shape) for k, v in saved_v.items()} != \
                {k: tuple(v.shape) for k, v in mine_v.items()}:
            names = "layers, heads, key heads, head_dim, width"
            raise ValueError(f"QK-Guard: this state is of a model with ({names}) {state.get('shape', '?')}, not "
                             f"{self._shape()}: load the guard state saved with this model (nothing was changed)")
        saved, mine = state.get("settings", {}), self._settings()    # a state saved before settings were: unchecked
        wrong = [key for key in mine if key in saved and saved[key] != mine[key]]
        if wrong:
            show = lambda settings: ", ".join(f"{key}={settings[key]!r}" for key in wrong)
            raise ValueError(f"QK-Guard: this state was saved by a guard with {show(saved)}, not {show(mine)}: attach "
                             f"with the saved run's settings to resume it")
        if state["guard"].get("trigger") is not None and not self.qkguard.enabled:
            raise ValueError(f"QK-Guard: this state fired (at step {state['guard']['trigger']['step']}) and this guard "
                             f"is a watcher (enabled=False), which never acts: the model was trained with the action "
                             f"on, so attach with enabled=True to resume it")
        if self.qkguard.action == "qknorm":   # the layers this guard switched on go off; the state's go on below
            for layer in self.qkguard.layers:
                self.attentions[layer].qk_norm = False
        self.qkguard.load_state_dict(state["guard"])
        self.steps = state["steps"]
        self.events = [dict(event) for event in state.get("events", [])]    # (a state saved before they were: none)
        self.max_logit, self.max_logit_step = state.get("max_logit"), state.get("max_logit_step")
        if self.max_logit is not None:
            self.max_logit = self.max_logit.to(self.sigma_head.device)
        self.sigma.v = {key: v.to(self.sigma.v[key].device) for key, v in state["sigma_v"].items()}
        self.generator.set_state(state["generator"])
        self.sigma_head, self._running = self._measure_sigma(iters=0), [None] * len(self.layers)
        self.qkguard.apply_to_model(self)
        self._plan()
        # the seed drawn for the next step before the save (a state saved before it was kept: a new draw)
        if "sample_seed" in state:
            self._set_seed(state["sample_seed"])
        else:
            self._draw()

    def detach(self):
        """Remove the hooks (an action the model switches itself, this project's qk_norm, stays as it is)."""
        for handle in self.handles:
            handle.remove()
        self.handles = []
        for guards in _ATTACHED.values():
            guards.discard(self)
        if self.writer is not None:
            self.writer.close()


def _tensorboard_writer(logdir):
    try:
        from torch.utils.tensorboard import SummaryWriter   # only when asked: tensorboard stays optional
    except ImportError:
        raise ImportError("attach(tensorboard=...) needs the tensorboard package: pip install tensorboard, or "
                          "leave tensorboard=None") from None
    return SummaryWriter(logdir)


def attach(model, adapter="auto", *, threshold=None, signal="max-logit", action="qknorm", scope="all",
           enabled=True, tau=None, interval=1, seqs=1, rows=None, seed=0, tensorboard=None, log_every=10,
           timing=False, always=False, alpha=0.5):
    """Attach QK-Guard to `model`; returns an AttachedGuard (call its step() after each update).

    adapter    "auto", a name in ADAPTERS, or a function model -> [Layer]
    threshold  in the signal's units; None: the signal's default (guard.DEFAULT_THRESHOLD: max-logit 200,
               sigma-product 50)
    signal     "max-logit" (sampled from q and k) or "sigma-product" (sigma(W_q,h) sigma(W_k,h))
    action     "qknorm" or "qkclip" (tau: QK-Clip's cap; None: guard.QKClip's); scope "all" or "crossed", as
               in guard.py
    enabled    False: watch and log, never act (the unguarded run of a comparison)
    always     True (with action="qkclip"): QK-Clip at every update from the first, no trigger, as Megatron-LM's
               --qk-clip (--qk-clip-threshold: tau, default 100) and torchtitan's; alpha (0 < alpha < 1, 0.5):
               the share of each head's factor taken by W_q, 1 - alpha by W_k (--qk-clip-alpha)
    interval   monitor one update in N (updates 0, N, 2N, ...: a spike on the updates between is not seen),
               reading `seqs` sequences of the batch and `rows` positions of each (drawn anew each step;
               None: all): the defaults read every row of one sequence. Under qkclip, steps that may clip
               read every row (AttachedGuard)
    tensorboard  a log folder for the signals every log_every steps (needs tensorboard); None: off
    timing     True: add the host time in the hooks and step() to guard.seconds (a graph break under torch.compile)
    """
    if not isinstance(model, nn.Module):
        raise TypeError(f"attach: model must be a torch.nn.Module, not a {type(model).__name__} ({model!r:.40}): load "
                        f"it first (e.g. transformers.AutoModelForCausalLM.from_pretrained(name)) and pass the model")
    if action not in ATTACH_ACTIONS:
        raise ValueError(f"attach: action {action!r} is not one an attached guard can take: choose one of "
                         f"{', '.join(ATTACH_ACTIONS)} (the others act in this project's kernel or train.py's loop)")
    if signal not in DEFAULT_THRESHOLD:
        raise ValueError(f"attach: unknown signal {signal!r}: choose one of {', '.join(DEFAULT_THRESHOLD)}")
    count = lambda n: isinstance(n, int) and not isinstance(n, bool) and n >= 1
    if not count(interval) or not count(log_every) or not all(n is None or count(n) for n in (seqs, rows)):
        raise ValueError(f"attach: interval ({interval!r}) and log_every ({log_every!r}) must be integers >= 1, seqs "
                         f"({seqs!r}) and rows ({rows!r}) integers >= 1 or None")
    # a threshold that is not a finite number never fires (NaN, inf) or fails at the first step (a string);
    # a cap tau <= 0 would scale W_q by 0 or a negative (or NaN) factor
    real = lambda x: isinstance(x, (int, float)) and not isinstance(x, bool) and math.isfinite(x)
    # and one <= 0 fires at once (a sigma product, a max logit over a batch are > 0): not a guard, a switch
    if threshold is not None and not (real(threshold) and threshold > 0):
        raise ValueError(f"attach: threshold must be a finite number > 0 in the signal's units, not {threshold!r}: "
                         f"give e.g. {DEFAULT_THRESHOLD[signal]} (None: that default); to act from the first step, "
                         f"attach(model, action='qkclip', always=True)")
    if always and not enabled:
        raise ValueError("attach: always=True clips every update, and enabled=False is a watcher, which never acts: "
                         "give one of them")
    if always and action != "qkclip":
        raise ValueError(f"attach: always=True is QK-Clip at every update (Megatron-LM's --qk-clip), not {action!r}: "
                         f"pass action='qkclip' (QK-norm from the first step is a model with QK-norm: build it so)")
    if not (real(alpha) and 0 < alpha < 1):
        raise ValueError(f"attach: alpha, W_q's share of QK-Clip's factor, must be a number in (0, 1), not {alpha!r}: "
                         f"give 0.5 (the default: sqrt of the factor on each of W_q and W_k)")
    if tau is not None and not (real(tau) and tau > 0):
        raise ValueError(f"attach: QK-Clip's tau must be a finite number > 0 (the max logit it caps a head at), not "
                         f"{tau!r}: give e.g. 100.0 (None: guard.py's default)")
    layers = find_layers(model, adapter)
    if action == "qkclip" and any(hasattr(m, "get_delta_weight") for l in layers for m in (l.q, l.k)):
        raise ValueError("attach: QK-Clip scales W_q and W_k, and under LoRA they are a frozen base weight (which "
                         "peft does not save with the adapter) plus B @ A: merge the adapter first "
                         "(model = model.merge_and_unload()), or use action='qknorm', which acts on q and k as "
                         "the LoRA model forms them")
    # always-on, the trigger has nothing to do: QKGuard only watches, and AttachedGuard clips every update
    qkguard = QKGuard(threshold=threshold, enabled=enabled and not always, signal=signal, action=action, scope=scope,
                      tau=tau)
    return AttachedGuard(model, layers, qkguard, interval=interval, seqs=seqs, rows=rows, seed=seed,
                         tensorboard=tensorboard, log_every=log_every, timing=timing, always=always, alpha=alpha)
