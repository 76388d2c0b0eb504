"""
A nanoGPT-style GPT, guarded: the example qkguard/README.md points to, and the model qkguard's tests
and lab/attach_demo.py train.

    python -m qkguard.example                  # guarded: QK-norm from just after the max logit passes 200
    python -m qkguard.example --guard off      # watched only: the same hooks measure, the guard never acts

NanoGPT has nanoGPT's layout (one fused c_attn Linear per attention, n_head, F.scaled_dot_product_attention),
so attach() finds it by its nanogpt adapter; nanoGPT's own GPT(GPTConfig(...)) takes the same loop.
The run is a copy task (each sequence a random half, repeated) at a learning rate high enough that the
attention logits run away within a few dozen steps on a CPU. At that rate the model learns nothing
(the loss stays near ln 64): what the example shows is the guard, not a model.
"""
import argparse
import sys

import torch
import torch.nn as nn
import torch.nn.functional as F

from qkguard import attach

VOCAB, BLOCK, BATCH = 64, 32, 8
WARMUP, GRAD_CLIP = 20, 1.0


class NanoAttention(nn.Module):
    def __init__(self, n_embd, n_head, dropout):
        super().__init__()
        self.c_attn = nn.Linear(n_embd, 3 * n_embd)          # q, k, v in one projection
        self.c_proj = nn.Linear(n_embd, n_embd)
        self.n_head, self.n_embd, self.dropout = n_head, n_embd, dropout
        self.resid_dropout = nn.Dropout(dropout)

    def forward(self, x):
        B, T, C = x.shape
        q, k, v = (t.view(B, T, self.n_head, C // self.n_head).transpose(1, 2)
                   for t in self.c_attn(x).split(self.n_embd, dim=2))
        y = F.scaled_dot_product_attention(q, k, v, dropout_p=self.dropout if self.training else 0.0, is_causal=True)
        return self.resid_dropout(self.c_proj(y.transpose(1, 2).reshape(B, T, C)))


class NanoBlock(nn.Module):
    def __init__(self, n_embd, n_head, dropout):
        super().__init__()
        self.ln_1, self.ln_2 = nn.LayerNorm(n_embd), nn.LayerNorm(n_embd)
        self.attn = NanoAttention(n_embd, n_head, dropout)
        self.mlp = nn.Sequential(nn.Linear(n_embd, 4 * n_embd), nn.GELU(), nn.Linear(4 * n_embd, n_embd),
                                 nn.Dropout(dropout))

    def forward(self, x):
        x = x + self.attn(self.ln_1(x))
        return x + self.mlp(self.ln_2(x))


class NanoGPT(nn.Module):
    """nanoGPT's layout (transformer.wte/wpe/h/ln_f, tied lm_head); forward(idx, targets) -> (logits, loss)."""

    def __init__(self, vocab_size=VOCAB, block_size=BLOCK, n_layer=2, n_head=4, n_embd=64, dropout=0.0):
        super().__init__()
        self.transformer = nn.ModuleDict(dict(
            wte=nn.Embedding(vocab_size, n_embd), wpe=nn.Embedding(block_size, n_embd), drop=nn.Dropout(dropout),
            h=nn.ModuleList(NanoBlock(n_embd, n_head, dropout) for _ in range(n_layer)), ln_f=nn.LayerNorm(n_embd)))
        self.lm_head = nn.Linear(n_embd, vocab_size, bias=False)
        self.lm_head.weight = self.transformer.wte.weight
        for module in self.modules():
            if isinstance(module, (nn.Linear, nn.Embedding)):
                nn.init.normal_(module.weight, std=0.02)

    def forward(self, idx, targets=None):
        x = self.transformer.wte(idx) + self.transformer.wpe(torch.arange(idx.shape[1], device=idx.device))
        x = self.transformer.drop(x)
        for block in self.transformer.h:
            x = block(x)
        logits = self.lm_head(self.transformer.ln_f(x))
        loss = None if targets is None else F.cross_entropy(logits.flatten(0, 1), targets.flatten())
        return logits, loss


def copy_batch(generator):
    """(inputs, targets): BATCH sequences of BLOCK + 1 tokens, each a random half repeated."""
    half = torch.randint(0, VOCAB, (BATCH, BLOCK // 2 + 1), generator=generator)
    tokens = torch.cat([half, half], dim=1)[:, :BLOCK + 1]
    return tokens[:, :-1], tokens[:, 1:]


def train(steps=200, lr=3e-2, guarded=True, threshold=None, seed=0, report=print):
    """Train NanoGPT with a guard attached; returns the guard and each step's (loss, max logit)."""
    torch.manual_seed(seed)
    model = NanoGPT()
    optimizer = torch.optim.AdamW(model.parameters(), lr=lr, betas=(0.9, 0.95), weight_decay=0.0)
    guard = attach(model, threshold=threshold, enabled=guarded)   # threshold None: the signal's default
    batches, history = torch.Generator().manual_seed(seed + 1), []
    for step in range(steps):
        for group in optimizer.param_groups:
            group["lr"] = lr * min(1.0, (step + 1) / WARMUP)       # linear warmup, then constant
        _, loss = model(*copy_batch(batches))
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), GRAD_CLIP)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        if event := guard.step():                                   # after each update; once, at the trigger
            report(f"step {step}: QK-Guard fired: max logit {event['value']:.1f} > {event['threshold']:g} at layer "
                   f"{event['layer']} head {event['head']} (step {event['step']}); {event['action']} on from step "
                   f"{event['active_from']}")
        history.append((loss.item(), guard.max_logit.max().item()))
        if step % 20 == 0 or step == steps - 1:
            report(f"step {step}: loss {history[-1][0]:.3f}, max logit {history[-1][1]:.1f}")
    return guard, history


def main(argv=None):
    p = argparse.ArgumentParser(description="A nanoGPT-style GPT trained with QK-Guard attached.")
    p.add_argument("--steps", type=int, default=200)
    p.add_argument("--lr", type=float, default=3e-2, help="high enough that the logits run away")
    p.add_argument("--guard", choices=("on", "off"), default="on", help="off: watch and log, never act")
    p.add_argument("--threshold", type=float, default=None, help="max logit that fires the guard (default 200)")
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args(argv)
    if args.steps < 1 or args.lr <= 0 or (args.threshold is not None and args.threshold <= 0):
        p.error("--steps must be >= 1, --lr and --threshold > 0")
    guard, history = train(args.steps, args.lr, args.guard == "on", args.threshold, args.seed)
    bound = guard.layers[0].scale * guard.layers[0].head_dim
    print(f"max logit over the run {max(m for _, m in history):.1f}; guard {guard.record()['guard']}"
          + (f" (QK-norm bounds every logit by {bound:g})" if guard.triggered else ""))
    return 0


if __name__ == "__main__":
    sys.exit(main())
