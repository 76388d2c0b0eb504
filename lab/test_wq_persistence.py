"""Is the bf16 state's error in dW_q persistent in direction from one training step to the next?

A measurement of the fault's character in training, run as a test (moved here from test_numerics.py on
2026-12-05, unchanged: test_numerics.py is the kernel's numerics).

    python -m pytest -s lab/test_wq_persistence.py    # prints one fresh seed's row
"""
import math

import torch

from test_numerics import DEV, poison, seed  # noqa: F401 (fixtures: every kernel buffer starts as NaN; the seed)

# Qiu & Yao (SOURCES.md): in GPT-2 small, after thousands of steps, the bf16 state makes the error
# in dW_q a sum of similar rank-1 terms with a persistent sign, so W_q grows along one direction.
# Here a tiny GPT trains with fp32 state; at each of 8 steps the same batch is backpropagated three
# times, and per layer e_t = dW_q(bf16 state) - dW_q(fp32 state). Measured: cE = cos(e_t, e_{t+1})
# and cM = cos(e_t, mean of e_0..e_{t-1}), against two nulls: (1) the random level,
# E|cos| = sqrt(2/(pi*n)) = 0.012 for n = 64*64; (2) the fair one, c_t = dW_q(fp32 state, key block 32) - dW_q(fp32 state, key block 64), an unbiased
# rounding perturbation (summation order only; cosines are scale-free) whose cos(c_t, c_{t+1}) is
# cC: errors sit in few directions, so even cC spreads far beyond 0.012. Positive control: the fp32
# gradient's cos(g_t, g_{t+1}) (cG).
#
# Set-up: 2 layers, d=64, 2 heads, T=256, key block 64, batch 4; tokens from a fixed pool of 8
# six-grams over 32 tokens with 10% noise (structure to learn); AdamW (0.9, 0.95), clip 1.0; a fresh
# batch each step, or the same one. bf16 q, k, v and no other rounding source: e is the state's
# error alone, c only fp32 summation order. The measured ranges over seeds, and the conclusion, are in
# lab/MEASUREMENTS.md ("the bf16 state's error in dW_q"): at this scale it is NOT persistent in
# direction; a weak persistent part shows on a repeated batch only. cE or cM above 0.2 would be a
# finding: report it.
#
# Asserted per run, for one fresh seed, fresh and repeated batch (from init, lr 1e-3), with margin
# over every measurement in lab/MEASUREMENTS.md:
#   - the fault is active: 3e-4 < |e|/|g| < 3e-2;
#   - no strong persistence: cE < 0.2 and cM < 0.2 (measured max 0.103 and 0.079); |cC| < 0.1;
#   - persistence would show: cG > 0.3 (measured min 0.46) and cG - cE > 0.25 (measured min 0.41).
# The weak same-batch persistence (cE > cC) is printed, not asserted: per seed its margin is thin.

def _ngram_tokens(gen, pool, vocab, B, T, noise=0.1):
    """B rows of T+1 tokens: n-grams from `pool` (phrases repeat), a fraction `noise` replaced."""
    n, L = pool.shape
    seq = pool[torch.randint(0, n, (B, T // L + 2), generator=gen)].reshape(B, -1)[:, :T + 1].clone()
    flip = torch.rand(seq.shape, generator=gen) < noise
    seq[flip] = torch.randint(0, vocab, (int(flip.sum()),), generator=gen)
    return seq


def _wq_grads(model, x, y, accum, block_n):
    """dW_q of every layer as float64 (n_layer, C, C), with every layer's state set to `accum`."""
    for a in model.attentions:
        a.accum, a.block_n = accum, block_n
    model.zero_grad(set_to_none=True)
    model(x, y)[1].backward()
    return torch.stack([a.q_proj.weight.grad.detach().double() for a in model.attentions])


def _cos(a, b):
    """Cosine over the last two dims (whole matrices)."""
    a, b = a.flatten(-2), b.flatten(-2)
    return (a * b).sum(-1) / (a.norm(dim=-1) * b.norm(dim=-1))


def wq_error_persistence(seed, same_batch, steps=8, B=4, T=256, vocab=32, block_n=64, lr=1e-3):
    """Train a tiny GPT with fp32 state; e_t = dW_q(bf16) - dW_q(fp32) on each step's batch, per
    layer. Returns per-seed means of cE = cos(e_t, e_{t+1}), cM = cos(e_t, mean e_<t), cC = cos(c_t,
    c_{t+1}) (summation-order control), cG = cos(g_t, g_{t+1}) (fp32 gradient), rel = |e| / |g|."""
    from model import GPT, GPTConfig
    torch.manual_seed(seed)
    gen = torch.Generator().manual_seed(seed)
    cfg = GPTConfig(n_layer=2, n_head=2, n_embd=64, block_size=T, vocab_size=vocab, attn_impl="torch",
                    accum="fp32", block_n=block_n, rounding=())   # only the state differs in e
    model = GPT(cfg).to(DEV)
    opt = torch.optim.AdamW(model.parameters(), lr=lr, betas=(0.9, 0.95), weight_decay=0.0)
    pool = torch.randint(0, vocab, (8, 6), generator=gen)
    batch = _ngram_tokens(gen, pool, vocab, B, T)
    E, C, G = [], [], []
    for _ in range(steps):
        if not same_batch:
            batch = _ngram_tokens(gen, pool, vocab, B, T)
        x, y = batch[:, :-1].to(DEV), batch[:, 1:].to(DEV)
        g16 = _wq_grads(model, x, y, "bf16", block_n)
        g32_other_order = _wq_grads(model, x, y, "fp32", block_n // 2)
        g32 = _wq_grads(model, x, y, "fp32", block_n)  # last: these gradients drive the step
        E.append(g16 - g32)
        C.append(g32_other_order - g32)
        G.append(g32)
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
    E, C, G = torch.stack(E), torch.stack(C), torch.stack(G)  # (steps, n_layer, C, C)
    consec = lambda X: _cos(X[:-1], X[1:]).mean().item()
    running = torch.stack([E[:t].mean(0) for t in range(1, steps)])
    return dict(cE=consec(E), cM=_cos(E[1:], running).mean().item(), cC=consec(C), cG=consec(G),
                rel=(E.flatten(-2).norm(dim=-1) / G.flatten(-2).norm(dim=-1)).mean().item(),
                null=(2 / math.pi / E[0, 0].numel()) ** 0.5)


def test_wq_error_persistence_across_steps(seed):
    rows = {batches: wq_error_persistence(seed, same) for batches, same in (("fresh", False), ("same", True))}
    table = f"{'batch':>6} {'seed':>10} {'cE':>7} {'cM':>7} {'cC':>7} {'cG':>7} {'|e|/|g|':>8} {'null':>6}" + "".join(
        f"\n{b:>6} {seed:>10} " + " ".join(f"{r[k]:+7.3f}" for k in ("cE", "cM", "cC", "cG"))
        + f" {r['rel']:8.1e} {r['null']:6.3f}" for b, r in rows.items())
    print("\ndW_q error e = bf16-state grad - fp32-state grad, tiny GPT, 8 steps from init; cE = cos(e_t, e_t+1), "
          "cM = cos(e_t, mean e_<t), cC = same for an fp32 summation-order control, cG = for the gradient\n" + table)
    msg = (f"seed {seed}\n{table}\n(see the comment above: cE or cM >= 0.2 would be a persistence that "
           f"no earlier measurement showed, a finding to report)")
    for r in rows.values():
        assert 3e-4 < r["rel"] < 3e-2, msg
        assert r["cE"] < 0.2 and r["cM"] < 0.2, msg
        assert abs(r["cC"]) < 0.1, msg
        assert r["cG"] > 0.3 and r["cG"] - r["cE"] > 0.25, msg
