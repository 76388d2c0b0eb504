"""
A GPT in one file, in two flavours chosen by config:
  arch="gpt2":  LayerNorm, GELU MLP, learned positions, tied embeddings (GPT-2 / nanoGPT).
  arch="llama": RMSNorm, rotary positions, SwiGLU MLP, tied embeddings (LLaMA style).

Every attention layer goes through attention_kernel.attention(), whose state precision (`accum`)
is the fault under study. W_q and W_k are separate nn.Linear layers, so the monitor and the guard
reach them per layer and, by rows, per head: head h owns rows h*head_dim:(h+1)*head_dim.

The guard switches attention per layer through plain Python attributes (qk_norm, softcap, accum),
not tensors: torch.compile recompiles once when they flip, and the dormant path does no extra work.
"""
import math
from dataclasses import dataclass

import torch
import torch.nn as nn
import torch.nn.functional as F

from attention_kernel import attention


@dataclass
class GPTConfig:
    arch: str = "gpt2"          # "gpt2" or "llama"
    n_layer: int = 4
    n_head: int = 4
    n_embd: int = 128
    block_size: int = 128       # context length
    vocab_size: int = 50304     # GPT-2's 50257 padded up to a multiple of 64 for faster matmuls
    dropout: float = 0.0
    # attention numerics (see attention_kernel.py)
    attn_impl: str = "auto"     # "auto" (Triton on CUDA, twin on CPU), "triton", "torch", "sdpa"
    accum: str = "fp32"         # the streaming-softmax state: "fp32", "bf16", "bf16-safemax"
    rounding: tuple | None = None   # e.g. ("logits", "pv"); (): none; None: the kernel's default
    attn_dtype: str = "bf16"    # q, k, v enter attention in bf16 (as under autocast) or "native"
    block_n: int | None = None  # key block of the streaming loop; None: the kernel's default
    safemax_beta: float = 2.0
    qk_norm: bool = False       # parameter-free QK-norm from step 0 (the always-on baseline)
    softcap: float = 0.0        # tanh soft-capping of attention logits; 0 = off
    attn_scale: float = 0.0     # logit scale; 0 = 1/sqrt(head_dim)
    max_logit: bool = True      # return max logits, the guard's signal (sdpa: an extra QK^T pass)


# The weight matrices the monitor watches, by kind: one per layer each (logged as sigma_<kind>).
WEIGHT_KINDS = ("q", "k", "v", "o", "mlp_in", "mlp_out")
QK_KINDS, NON_QK_KINDS = WEIGHT_KINDS[:2], WEIGHT_KINDS[2:]
WEIGHT_OWNERS = {"q": "attn.q_proj", "k": "attn.k_proj", "v": "attn.v_proj", "o": "attn.o_proj",
                 "mlp_in": "mlp.up_proj", "mlp_out": "mlp.down_proj"}   # per kind, in a Block


# Named sizes: "cpu" for a CPU, "assay" for SOURCES.md's H200 collapse, GPT-2 124M and 350M.
MODEL_SIZES = {
    "cpu":         dict(n_layer=4, n_head=4, n_embd=128, block_size=128),
    "assay":       dict(n_layer=6, n_head=6, n_embd=384, block_size=512),
    "gpt2":        dict(n_layer=12, n_head=12, n_embd=768, block_size=1024),
    "gpt2-medium": dict(n_layer=24, n_head=16, n_embd=1024, block_size=1024),
}


def make_norm(config):
    if config.arch == "llama":
        return nn.RMSNorm(config.n_embd, eps=1e-6)   # a learned gain, as LLaMA's
    return nn.LayerNorm(config.n_embd, bias=False)


def rotary_tables(seq_len, head_dim, base=10000.0):
    """cos and sin of the rotary angles, each (seq_len, head_dim // 2)."""
    inv_freq = 1.0 / base ** (torch.arange(0, head_dim, 2, dtype=torch.float32) / head_dim)
    angles = torch.outer(torch.arange(seq_len, dtype=torch.float32), inv_freq)
    return angles.cos(), angles.sin()


def apply_rotary(x, cos, sin):
    """Rotate (first half, second half) pairs of the head dimension; x is (B, H, T, D)."""
    x1, x2 = x.float().chunk(2, dim=-1)
    rotated = torch.cat([x1 * cos - x2 * sin, x1 * sin + x2 * cos], dim=-1)
    return rotated.type_as(x)


class CausalSelfAttention(nn.Module):
    def __init__(self, config, layer_idx):
        super().__init__()
        assert config.n_embd % config.n_head == 0, "n_embd must be a multiple of n_head"
        self.layer_idx = layer_idx
        self.n_head = config.n_head
        self.head_dim = config.n_embd // config.n_head
        self.q_proj = nn.Linear(config.n_embd, config.n_embd, bias=False)   # W_q
        self.k_proj = nn.Linear(config.n_embd, config.n_embd, bias=False)   # W_k
        self.v_proj = nn.Linear(config.n_embd, config.n_embd, bias=False)
        self.o_proj = nn.Linear(config.n_embd, config.n_embd, bias=False)
        self.o_proj.residual_out = True
        self.dropout = nn.Dropout(config.dropout)
        self.impl, self.block_n, self.beta = config.attn_impl, config.block_n, config.safemax_beta
        self.rounding = config.rounding
        self.attn_dtype = torch.bfloat16 if config.attn_dtype == "bf16" else None
        self.scale = config.attn_scale or None
        self.return_max_logit = config.max_logit
        # Switched by the guard, per layer (see the module docstring).
        self.accum = config.accum
        self.qk_norm = config.qk_norm
        self.softcap = config.softcap
        self.attention = attention   # what attend() calls: the kernel's, or a wrapper of it

    def head_weights(self):
        """W_q and W_k viewed per head: two (n_head, head_dim, n_embd) views of the live weights."""
        shape = (self.n_head, self.head_dim, -1)
        return self.q_proj.weight.view(shape), self.k_proj.weight.view(shape)

    def project(self, x, rotary=None):
        """q, k, v of x (B, T, C), each (B, n_head, T, head_dim), rotary applied to q and k."""
        B, T, C = x.shape
        q, k, v = (proj(x).view(B, T, self.n_head, self.head_dim).transpose(1, 2)
                   for proj in (self.q_proj, self.k_proj, self.v_proj))
        if rotary is not None:
            cos, sin = rotary
            q, k = apply_rotary(q, cos, sin), apply_rotary(k, cos, sin)
        return q, k, v

    def attend(self, q, k, v, **changes):
        """self.attention() with this layer's settings (the guard's switches included); `changes`
        overrides some, as a fault-free pass and train.py's settings check do."""
        settings = dict(accum=self.accum, qk_norm=self.qk_norm, scale=self.scale,
                        return_max_logit=self.return_max_logit, softcap=self.softcap,
                        safemax_beta=self.beta, impl=self.impl, block_n=self.block_n,
                        rounding=self.rounding)
        return self.attention(q, k, v, **{**settings, **changes})

    def forward(self, x, rotary=None):
        B, T, C = x.shape
        q, k, v = self.project(x, rotary)
        computed_in = q.dtype
        if self.attn_dtype is not None:   # a no-op under autocast; on a CPU, what a GPU's would be
            q, k, v = q.to(self.attn_dtype), k.to(self.attn_dtype), v.to(self.attn_dtype)
        out = self.attend(q, k, v)
        y, max_logit = out if self.return_max_logit else (out, None)
        y = y.transpose(1, 2).contiguous().view(B, T, C).to(computed_in)   # head h: h*hd:(h+1)*hd
        # max over the batch: the per-head signal the monitor and the guard watch
        return self.dropout(self.o_proj(y)), None if max_logit is None else max_logit.amax(dim=0)


class MLP(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.swiglu = config.arch == "llama"
        if self.swiglu:   # hidden 8/3 * d (a 4d GELU MLP's parameters), rounded to 64
            hidden = 64 * math.ceil(8 * config.n_embd / 3 / 64)
            self.gate_proj = nn.Linear(config.n_embd, hidden, bias=False)
        else:
            hidden = 4 * config.n_embd
        self.up_proj = nn.Linear(config.n_embd, hidden, bias=False)
        self.down_proj = nn.Linear(hidden, config.n_embd, bias=False)
        self.down_proj.residual_out = True
        self.dropout = nn.Dropout(config.dropout)

    def forward(self, x):
        h = F.silu(self.gate_proj(x)) * self.up_proj(x) if self.swiglu else F.gelu(self.up_proj(x))
        return self.dropout(self.down_proj(h))


class Block(nn.Module):
    def __init__(self, config, layer_idx):
        super().__init__()
        self.norm1 = make_norm(config)
        self.attn = CausalSelfAttention(config, layer_idx)
        self.norm2 = make_norm(config)
        self.mlp = MLP(config)

    def forward(self, x, rotary=None):
        attn_out, max_logit = self.attn(self.norm1(x), rotary)
        x = x + attn_out
        return x + self.mlp(self.norm2(x)), max_logit


class GPT(nn.Module):
    def __init__(self, config):
        super().__init__()
        if config.arch not in ("gpt2", "llama"):
            raise ValueError(f"unknown arch {config.arch!r}: choose 'gpt2' or 'llama'")
        self.config = config
        self.tok_emb = nn.Embedding(config.vocab_size, config.n_embd)
        learned = config.arch == "gpt2"   # positions: learned (gpt2), or rotary (llama)
        self.pos_emb = nn.Embedding(config.block_size, config.n_embd) if learned else None
        self.drop = nn.Dropout(config.dropout)
        self.blocks = nn.ModuleList(Block(config, i) for i in range(config.n_layer))
        self.norm_f = make_norm(config)
        self.lm_head = nn.Linear(config.n_embd, config.vocab_size, bias=False)
        self.lm_head.weight = self.tok_emb.weight   # tied embeddings
        if config.arch == "llama":
            cos, sin = rotary_tables(config.block_size, config.n_embd // config.n_head)
            self.register_buffer("rotary_cos", cos, persistent=False)
            self.register_buffer("rotary_sin", sin, persistent=False)
        self.apply(self._init_weights)

    def _init_weights(self, module):
        # GPT-2 init; projections that write into the residual stream are scaled down by depth
        if isinstance(module, nn.Linear):
            residual = getattr(module, "residual_out", False)
            std = 0.02 / math.sqrt(2 * self.config.n_layer) if residual else 0.02
            nn.init.normal_(module.weight, mean=0.0, std=std)
        elif isinstance(module, nn.Embedding):
            nn.init.normal_(module.weight, mean=0.0, std=0.02)

    @property
    def attentions(self):
        return [block.attn for block in self.blocks]

    def weight_matrices(self, kinds=WEIGHT_KINDS):
        """{kind: its weight in every layer}; mlp_in is the up projection (SwiGLU's gate aside)."""
        return {kind: [block.get_submodule(WEIGHT_OWNERS[kind]).weight for block in self.blocks]
                for kind in kinds}

    def qk_weights(self):
        """W_q and W_k of every layer, layer by layer: the QK channel's parameters."""
        return [w for layer in zip(*self.weight_matrices(QK_KINDS).values()) for w in layer]

    def num_params(self):
        n = sum(p.numel() for p in self.parameters())
        return n - (self.pos_emb.weight.numel() if self.pos_emb is not None else 0)

    def forward(self, idx, targets=None):
        """(logits, loss or None, max_logit: (n_layer, n_head), None if config.max_logit is off)."""
        B, T = idx.shape
        if T > self.config.block_size:
            raise ValueError(f"sequence of length {T} is longer than block_size "
                             f"{self.config.block_size}")
        x = self.tok_emb(idx)
        rotary = None
        if self.pos_emb is not None:
            x = x + self.pos_emb(torch.arange(T, device=idx.device))
        else:
            rotary = (self.rotary_cos[:T], self.rotary_sin[:T])
        x = self.drop(x)
        max_logits = []
        for block in self.blocks:
            x, max_logit = block(x, rotary)
            max_logits.append(max_logit)
        logits = self.lm_head(self.norm_f(x))
        loss = None
        if targets is not None:
            loss = F.cross_entropy(logits.float().view(-1, logits.size(-1)), targets.reshape(-1))
        max_logit = torch.stack(max_logits).detach() if self.config.max_logit else None
        return logits, loss, max_logit

    @torch.no_grad()
    def generate(self, idx, max_new_tokens, temperature=1.0, top_k=None):
        """Sample max_new_tokens onto each row of idx (B, T), the context cropped to block_size."""
        for _ in range(max_new_tokens):
            logits = self(idx[:, -self.config.block_size:])[0][:, -1, :].float() / temperature
            if top_k is not None:
                kth = torch.topk(logits, min(top_k, logits.size(-1))).values[:, [-1]]
                logits = logits.masked_fill(logits < kth, float("-inf"))
            next_token = torch.multinomial(F.softmax(logits, dim=-1), num_samples=1)
            idx = torch.cat([idx, next_token], dim=1)
        return idx

    def configure_optimizer(self, lr, weight_decay, betas):
        """AdamW with weight decay on matrices (linear weights, embeddings), not on norm gains."""
        params = [p for p in self.parameters() if p.requires_grad]
        groups = [
            {"params": [p for p in params if p.dim() >= 2], "weight_decay": weight_decay},
            {"params": [p for p in params if p.dim() < 2], "weight_decay": 0.0},
        ]
        # fused: one kernel for all tensors, faster than the default per-tensor loop on a CPU too
        return torch.optim.AdamW(groups, lr=lr, betas=betas, fused=True)
