"""
The assay: move a controlled error to other sources, and probe the QK channel causally.

    ErrorInjector   a per-head error of chosen size and sign-coherence at one site in the forward,
                    the backward's delta (where the fault reaches dq, dk) or a weight's gradient
    measure_fault   the real fault's error (bf16 softmax state vs fp32), per layer and head
    Probe           project each step's W_q, W_k update off their top-k singular directions
                    (controls: the same shrink of the whole update, the next k directions, a fixed
                    random subspace, W_v's or the MLP's top-k, equal energy elsewhere)
    clean_qk_grads  --qk-fix clean-grad: fault-free W_q, W_k gradients; all else stays faulty

    Assay           all of it as train.py's extension (run.Extension): its flags (--inject-*, --qk-fix,
                    --probe*), their refusals, and the hooks the loop calls; a no-op without those flags.
                    `python -m lab.train_assay` is train.py with it (lab/train_assay.py)

The paper's claim under test: wherever an error enters, if its per-head sign persists from step
to step (temporal sign-coherence), it drives the same W_q/W_k spectral runaway.
"""
import contextlib
import dataclasses
import functools
import math

import torch

import attention_kernel
import run
from attention_kernel import BF16_STATE_BLOCK_N


INJECT_SITES = ("none", "attn-out", "mlp-in", "mlp-out", "residual", "delta", "grad-wv", "grad-mlp")
ACTIVATION_SITES = ("attn-out", "mlp-in", "mlp-out", "residual")   # forward: changes the model
GRAD_SITES = ("grad-wv", "grad-mlp")
PROBE_MODES = ("off", "qk-topk", "qk-shrink", "qk-nextk", "qk-fixed", "v-topk", "mlp-topk", "equal-energy")
QK_FIXES = ("off", "clean-grad", "qknorm")


def _rms(x):
    return x.float().pow(2).mean().sqrt()


def _unit_rms_groups(direction, n_groups):
    """Scale each of n_groups row groups (dim 0) of a random tensor to unit rms."""
    for group in direction.tensor_split(n_groups, dim=0):
        group /= _rms(group).clamp_min(1e-12)
    return direction


# ----------------------------------------------------------------------------------------------------------------
# The controlled error.

class ErrorInjector:
    """A controlled error at one site. Per head h (activation sites: channel group h; gradient
    sites: the weight's rows of head h, or the h-th of n_head row groups for MLP weights): a fixed
    random unit-rms direction d_h, times a sign s_h that persists to the next step with probability
    `coherence` (1: sign-coherent; 0.5: random each step; 0: flips every step), times `scale`,
    times the rms of head h's part of the joined signal, so a setting means the same at any site.

    Activation sites: the same vector at every token (a bias, like the real fault's), computed from
    the detached activation so gradients flow through unchanged. Gradient sites: added after
    backward, before clipping. delta: the backward's delta = rowsum(dO * O) sees O + s_h * scale_h
    * rms(O_h) * d_h, like the kernel fault's biased O (only dq, dk change; attention_with_delta_error).
    attach(model) first.
    """

    def __init__(self, site, scale, coherence, n_layer, n_head, n_embd, layers=None, seed=0):
        if site not in INJECT_SITES:
            raise ValueError(f"unknown site {site!r}; use one of {INJECT_SITES}")
        self.site, self.coherence = site, float(coherence)
        self.n_head, self.head_dim = n_head, n_embd // n_head
        self.layers = list(range(n_layer)) if layers is None else [int(i) for i in layers]
        self.seed = seed
        self.scales = torch.full((n_layer, n_head), float(scale))   # matched() sets them
        self.directions = {}                                        # layer -> direction, lazily
        self.sign_rng = torch.Generator().manual_seed(seed)
        self.signs = torch.randint(0, 2, (n_layer, n_head), generator=self.sign_rng).float() * 2 - 1
        self.step = None
        self._err_sq, self._sig_sq = 0.0, 0.0                       # since begin_step (last_stats)
        self.enabled, self.handles, self.attentions = True, [], []
        self._amplitudes = {}                                       # device -> s * scale, this step
        self.delta_errors = {}                                      # delta: layer -> this step's error

    def begin_step(self, step):
        """New signs: each (layer, head) keeps its sign with probability `coherence`, else flips.
        The first call keeps the initial signs; a repeated call for the same step does nothing."""
        if self.step is not None and step != self.step:
            flip = torch.rand(self.signs.shape, generator=self.sign_rng) >= self.coherence
            self.signs = torch.where(flip, -self.signs, self.signs)
        self.step = step
        self._err_sq, self._sig_sq, self._amplitudes = 0.0, 0.0, {}
        if self.site == "delta":
            self._set_delta_errors()
            if self.enabled:   # exact by construction: |amplitude| * rms(O) * (unit-rms direction)
                amp = torch.stack([self.amplitude(layer, "cpu") for layer in self.layers])
                self._track(amp.pow(2).sum(), amp.numel())

    def direction(self, layer, shape, device):
        """A layer's fixed direction, unit rms in each of the n_head row groups of dim 0; seeded by
        (seed, layer), so independent of call order; kept on the device of its first use."""
        if layer not in self.directions:
            rng = torch.Generator().manual_seed(self.seed * 1000 + layer + 1)
            self.directions[layer] = _unit_rms_groups(torch.randn(shape, generator=rng), self.n_head)
        if self.directions[layer].device != device:
            self.directions[layer] = self.directions[layer].to(device)
        return self.directions[layer]

    def amplitude(self, layer, device):
        """s_h * scale_h per head, as a tensor (Python floats would make torch.compile specialize on
        signs); copied to the device once per step (begin_step clears it), not once per layer."""
        key = str(device)
        if key not in self._amplitudes:
            self._amplitudes[key] = (self.signs * self.scales).to(device)
        return self._amplitudes[key][layer]

    def _track(self, error_sq, signal_sq):
        # running totals for last_stats, as tensors: the forward never waits on the device
        self._err_sq, self._sig_sq = self._err_sq + error_sq, self._sig_sq + signal_sq

    def __call__(self, x, site, layer):
        if not self.enabled or site != self.site or layer not in self.layers:
            return x
        heads = x.detach().float().reshape(-1, self.n_head, self.head_dim)     # (B*T, H, head_dim)
        signal_rms = heads.pow(2).mean(dim=(0, 2)).sqrt()                     # (H,)
        d = self.direction(layer, (self.n_head, self.head_dim), x.device)
        error = (self.amplitude(layer, x.device) * signal_rms)[:, None] * d   # (H, head_dim)
        self._track(error.pow(2).sum() * heads.shape[0], heads.pow(2).sum())
        return x + error.flatten().to(x.dtype)

    def attach(self, model):
        """Reach the site: a hook on the module whose input or output the error joins, or (delta) each
        attention layer's attention function wrapped (attention_with_delta_error, with the error that
        begin_step sets); the model's code is untouched."""
        self.attentions = model.attentions
        if self.site == "delta":   # each layer's own function, kept to be put back (detach)
            self.unwrapped = [attn.attention for attn in self.attentions]
            for layer, (attn, attention) in enumerate(zip(self.attentions, self.unwrapped)):
                attn.attention = functools.partial(self._attention, layer, attention)
        hook = {"attn-out": lambda b, layer: b.attn.o_proj.register_forward_pre_hook(
                    lambda m, args: (self(args[0], "attn-out", layer),)),
                "mlp-in": lambda b, layer: b.mlp.register_forward_pre_hook(
                    lambda m, args: (self(args[0], "mlp-in", layer),)),
                "mlp-out": lambda b, layer: b.mlp.register_forward_hook(
                    lambda m, args, out: self(out, "mlp-out", layer)),
                "residual": lambda b, layer: b.register_forward_hook(
                    lambda m, args, out: (self(out[0], "residual", layer), out[1]))}.get(self.site)
        if hook is not None:
            self.handles = [hook(block, layer) for layer, block in enumerate(model.blocks)]
        return self

    def detach(self):
        for handle in self.handles:
            handle.remove()
        self.handles = []
        for attn, attention in zip(self.attentions, self.unwrapped if self.site == "delta" else []):
            attn.attention = attention

    def _attention(self, layer, attention, q, k, v, **settings):
        """A delta layer's attention: its error in the backward while one is set and not paused."""
        error = self.delta_errors.get(layer) if self.enabled else None
        if error is None:
            return attention(q, k, v, **settings)
        return attention_with_delta_error(q, k, v, error, **settings)

    def _set_delta_errors(self):
        """delta: head h's error in the O that delta sees, in units of rms(O_h), per selected layer."""
        self.delta_errors = {layer: self.amplitude(layer, attn.q_proj.weight.device)[:, None] * self.direction(
            layer, (self.n_head, self.head_dim), attn.q_proj.weight.device)
            for layer, attn in enumerate(self.attentions) if self.enabled and layer in self.layers}

    @contextlib.contextmanager
    def paused(self):
        """No error inside the block (the fault-free passes of clean-grad and of measure_fault)."""
        self.enabled = False
        try:
            yield
        finally:
            self.enabled = True

    def inject_grads(self, model):
        """Gradient sites, after backward and before clipping: head h's rows of v_proj's gradient
        (grad-wv), or the h-th row group of up_proj's (grad-mlp), get d_h * s_h * scale_h * rms."""
        if self.site not in GRAD_SITES:
            return
        for layer in self.layers:
            block = model.blocks[layer]
            grad = (block.attn.v_proj if self.site == "grad-wv" else block.mlp.up_proj).weight.grad
            if grad is None:
                continue
            d = self.direction(layer, tuple(grad.shape), grad.device)
            amp = self.amplitude(layer, grad.device)
            for a, g, d_h in zip(amp, grad.tensor_split(self.n_head), d.tensor_split(self.n_head)):
                error = a * _rms(g) * d_h
                self._track(error.pow(2).sum(), g.float().pow(2).sum())
                g += error.to(g.dtype)      # g is a view: this writes into .grad

    @property
    def last_stats(self):
        """For the log: measured error rms / signal rms since begin_step, and the injected signs."""
        ratio = math.sqrt(float(self._err_sq) / max(float(self._sig_sq), 1e-30))
        return {"inject_rms_ratio": ratio, "inject_signs": self.signs[self.layers].tolist()}

    def state_dict(self):
        return {"signs": self.signs.clone(), "sign_rng": self.sign_rng.get_state(), "step": self.step,
                "scales": self.scales.clone(), "directions": {k: v.cpu() for k, v in self.directions.items()}}

    def load_state_dict(self, state):
        self.signs, self.step, self.scales = state["signs"].clone(), state["step"], state["scales"].clone()
        self._amplitudes = {}
        self.sign_rng.set_state(state["sign_rng"])
        self.directions = {int(k): v.clone() for k, v in state["directions"].items()}

    @classmethod
    def from_args(cls, args, model, first_batch, autocast):
        """train.py's injector, from its flags (--inject-*), attached to the model. With --inject-scale
        matched, the size and direction are the bias of this run's faulty state (bf16 if --accum fp32)
        on the initial model and first_batch() (B, T)."""
        layers = None if args.inject_layers == "all" else [int(i) for i in args.inject_layers.split(",")]
        coherence = 1.0 if args.inject_coherence is None else args.inject_coherence
        if args.inject_scale != "matched":
            injector = cls(args.inject_site, args.inject_scale, coherence, n_layer=args.n_layer, n_head=args.n_head,
                           n_embd=args.n_embd, layers=layers, seed=args.seed)
        else:
            with autocast():
                injector = cls.matched(model, first_batch(), site=args.inject_site,
                                       accum="bf16" if args.accum == "fp32" else args.accum,
                                       coherence=coherence, layers=layers, seed=args.seed)
        return injector.attach(model)

    @classmethod
    def matched(cls, model, idx, site="attn-out", accum="bf16", coherence=1.0, layers=None, seed=0, fault=None):
        """An injector that reproduces the real fault's bias, movable to any site.

        Per layer and head, the direction is the mean error of the faulty attention output
        (measure_fault's bias_dir) and the size that bias's rms over O_fp32's (bias_ratio), now
        relative to the new site's signal; the zero-mean part of the real error is left out. At
        grad-wv the direction is rank 1: the bias direction over the head's rows times a fixed
        random unit-rms vector over the columns. At grad-mlp the row groups are not head channels:
        the direction stays random, and only the per-head sizes are matched.
        """
        cfg = model.config
        fault = measure_fault(model, idx, accum) if fault is None else fault
        inj = cls(site, 1.0, coherence, n_layer=cfg.n_layer, n_head=cfg.n_head, n_embd=cfg.n_embd, layers=layers,
                  seed=seed)
        inj.scales = fault["bias_ratio"].clone()
        inj.signs = torch.ones_like(inj.signs)      # start with the measured sign, not its negation
        for layer in inj.layers:
            d = _unit_rms_groups(fault["bias_dir"][layer].clone(), cfg.n_head)   # (H, head_dim)
            if site in ACTIVATION_SITES or site == "delta":
                inj.directions[layer] = d
            elif site == "grad-wv":
                cols = torch.randn(cfg.n_embd, generator=torch.Generator().manual_seed(seed * 1000 + layer + 1))
                inj.directions[layer] = d.flatten()[:, None] * (cols / _rms(cols))[None, :]   # (C, C)
        return inj


# ----------------------------------------------------------------------------------------------------------------
# The delta site: the kernel's own ops, its backward shown a biased O. The kernel takes no error: this wrapper
# is the assay's alone, and the injector puts it in place of each layer's attention function (attach).

class _DeltaError(torch.autograd.Function):
    """attention_kernel's forward op as it is; its backward op given O + e for O, so that delta =
    rowsum(dO * (O + e)), e = error[h] * rms(O_h): the way a biased O reaches dq and dk (dv sees no O)."""

    @staticmethod
    def forward(ctx, q, k, v, error, *settings):   # settings: the forward op's, after q, k, v
        o, lse, row_max = torch.ops.qkguard.attn_fwd(q, k, v, *settings)
        ctx.save_for_backward(q, k, v, o, lse, error)
        scale, softcap, accum, rounding, beta, impl, block_n = settings
        ctx.args = (scale, softcap, rounding, impl, block_n)     # the backward op's
        ctx.mark_non_differentiable(lse, row_max)
        return o, lse, row_max

    @staticmethod
    def backward(ctx, do, _dlse, _drow_max):
        q, k, v, o, lse, error = ctx.saved_tensors
        rms = o.float().pow(2).mean(dim=(0, 2, 3)).sqrt()                              # (H,)
        o = (o.float() + (error.float() * rms[:, None])[None, :, None, :]).to(o.dtype)
        dq, dk, dv = torch.ops.qkguard.attn_bwd(do, q, k, v, o, lse, *ctx.args)
        return dq, dk, dv, None, *[None] * 7


def attention_with_delta_error(q, k, v, error, accum="fp32", qk_norm=False, return_max_logit=False, *,
                               scale=None, softcap=0.0, safemax_beta=2.0, impl="auto", block_n=None, rounding=None):
    """attention_kernel.attention(), its backward's delta seeing O + e: error (heads, head_dim) is e in
    units of each head's rms(O). The forward is the kernel's, bit for bit; so is the backward at error 0."""
    impl, rounding = attention_kernel._checked(q, k, v, accum, impl, softcap, safemax_beta, block_n, rounding)
    if impl == "sdpa":
        raise ValueError("the delta error changes the streaming kernel's backward: use impl='torch' or 'triton'")
    if tuple(error.shape) != (q.shape[1], q.shape[3]):
        raise ValueError(f"the delta error must be (heads, head_dim) = {(q.shape[1], q.shape[3])}; got "
                         f"{tuple(error.shape)}")
    scale = 1.0 / math.sqrt(q.shape[-1]) if scale is None else float(scale)
    if qk_norm:   # as attention() does
        q, k = attention_kernel._rms_norm(q), attention_kernel._rms_norm(k)
    o, _, row_max = _DeltaError.apply(q, k, v, error, scale, float(softcap), accum, ",".join(rounding),
                                      float(safemax_beta), impl, block_n)
    return (o, row_max.detach().amax(dim=-1)) if return_max_logit else o


@torch.no_grad()
def tie_fraction(q, k, scale, block_n):
    """The share of (query row, key block) pairs, over the blocks each row sees, where the bf16 state's P
    holds two or more exact 1s: the prior work's precondition for a biased P V (a row max that repeats;
    bf16 rounds exp(S - m) to 1 within about 2e-3 of the max). As the kernel's twin computes it: logits
    S = r(r(q k^T) * scale), the running max m rounded, P = r(exp(r(S - m))). Returns (H,) over batch."""
    r = lambda x: x.to(torch.bfloat16).float()
    T = q.shape[2]
    s = r(r(q.float() @ k.float().mT) * scale)
    causal = torch.ones(T, T, dtype=torch.bool, device=q.device).tril()
    s = s.masked_fill(~causal, float("-inf"))
    m = torch.full(s.shape[:3], float("-inf"), device=q.device)
    tied, seen = torch.zeros(s.shape[:2], device=q.device), torch.zeros((), device=q.device)
    for j in range(0, T, block_n):
        block = s[..., j:j + block_n]
        m = r(torch.maximum(m, block.amax(-1)))
        rows = slice(j, T)                                    # rows before j see none of this block's keys
        ones = (r(torch.exp(r(block[:, :, rows] - m[:, :, rows, None]))) == 1).sum(-1)   # (B, H, rows)
        tied += (ones >= 2).float().sum(dim=2)
        seen += T - j
    return (tied / seen).mean(0)


@torch.no_grad()
def measure_fault(model, idx, accum="bf16", dtype=torch.bfloat16):
    """The real fault's error, per layer and head, on a batch idx (B, T).

    Each layer's attention runs twice on the same q, k, v (cast to `dtype`, as under bf16 autocast):
    with the faulty state `accum` and with fp32 state, so the difference is the state's error alone.
    q, k, v are recomputed as CausalSelfAttention does, from the input a forward pre-hook captures
    while the model runs (pause an attached injector first). Returns float32 tensors, over batch and
    tokens: error_ratio (L, H) = rms(O_faulty - O_fp32) / rms(O_fp32); bias_dir (L, H, head_dim) =
    mean(O_faulty - O_fp32); bias_ratio (L, H) = rms(bias_dir) / rms(O_fp32); tie_fraction (L, H), the
    prior work's precondition (tie_fraction below).
    """
    inputs = {}
    hooks = [attn.register_forward_pre_hook(lambda m, args: inputs.__setitem__(m.layer_idx, args[:2]))
             for attn in model.attentions]
    try:
        model(idx)
    finally:
        for h in hooks:
            h.remove()
    stats = {"error_ratio": [], "bias_ratio": [], "bias_dir": [], "tie_fraction": []}
    for attn in model.attentions:
        x, rotary = inputs[attn.layer_idx]
        q, k, v = (t.to(dtype) for t in attn.project(x.float(), rotary))
        impl = "auto" if attn.impl == "sdpa" else attn.impl   # no softmax state
        run = lambda mode: attn.attend(q, k, v, accum=mode, impl=impl, return_max_logit=False).float()
        o_ref = run("fp32")
        err = run(accum) - o_ref                                     # (B, H, T, D)
        ref_rms = o_ref.pow(2).mean(dim=(0, 2, 3)).sqrt()           # (H,)
        bias = err.mean(dim=(0, 2))                                  # (H, D)
        stats["error_ratio"].append(err.pow(2).mean(dim=(0, 2, 3)).sqrt() / ref_rms)
        stats["bias_ratio"].append(bias.pow(2).mean(dim=1).sqrt() / ref_rms)
        stats["bias_dir"].append(bias)
        stats["tie_fraction"].append(tie_fraction(q, k, attn.scale or q.shape[-1] ** -0.5, attn.block_n or BF16_STATE_BLOCK_N))
    return {key: torch.stack(vals).cpu() for key, vals in stats.items()}


# ----------------------------------------------------------------------------------------------------------------
# The causal probe.

def _orthonormal_complement(basis, generator):
    """A random orthonormal basis (n, n - k) of the complement of the columns of `basis` (n, k)."""
    n, k = basis.shape
    g = torch.randn(n, n - k, generator=generator).to(basis)
    for _ in range(2):   # twice: where g is ill-conditioned, QR magnifies the first pass's roundoff along basis
        g = torch.linalg.qr(g - basis @ (basis.T @ g)).Q
    return g


class Probe:
    """Project each step's update of a weight off a rank-k subspace on both sides: the causal probe
    (W_q, W_k off their own top-k directions) and controls that must still run away if it works.

    With dW = W_after - W the step's update (AdamW, weight decay and all) and U, V orthonormal
    (n, k) bases on W's output and input sides:
      qk-topk:       U, V = W_q's (W_k's) current top-k singular vectors (exact SVD, cheap at these
                     sizes); dW' = (I - U U^T) dW (I - V V^T). The removed part dW - dW', every
                     component of dW that touches a top-k direction on either side, has norm e.
      The three controls below can be carried out at every step, whatever the update looks like:
      qk-shrink:     the whole dW scaled to the norm qk-topk would leave, ||dW'|| = ||dW - e||-wise:
                     dW' = dW * ||(I - U U^T) dW (I - V V^T)|| / ||dW||, the same step size, no
                     direction taken out. If it stops the runaway too, the probe works by step size.
      qk-nextk:      qk-topk's projection with U, V the singular vectors k+1..2k instead of 1..k.
      qk-fixed:      the same, with U, V a random rank-k subspace drawn once per weight and kept all
                     run (fresh random directions would average out).
      v-topk, mlp-topk:  qk-topk's projection on a non-QK weight: W_v, or the MLP's input matrix.
      equal-energy:  remove from W_q, W_k a part R of norm e orthogonal to their top-k on both
                     sides: with fresh random orthonormal bases P, Q of U's and V's complements,
                     C = P^T dW Q holds dW's out-of-top-k part. Take whole entries of C in random
                     order up to energy e^2 (the last in part): R = P (M * C) Q^T, M in [0, 1], so
                     ||R|| = e; if C holds less, it all goes (the log shows the gap). The update's
                     energy sits mostly in its top-k (lab/MEASUREMENTS.md), so this one falls short.
      off:           nothing.
    The optimizer's moments are left alone: only the applied update changes.
    """

    def __init__(self, mode, k=3, seed=0):
        if mode not in PROBE_MODES:
            raise ValueError(f"unknown probe mode {mode!r}; use one of {PROBE_MODES}")
        if k < 1:
            raise ValueError(f"probe k must be >= 1; got {k}")
        self.mode, self.k, self.seed = mode, k, seed
        self.rng = torch.Generator().manual_seed(seed)
        self.saved = []   # per weight: (layer, name, weight, its value before the step, U, V)
        self.fixed = {}   # qk-fixed: weight index -> its (U, V), drawn once
        self.fraction_min = 1.0   # min ||removed|| / ||target|| since reset_interval

    def _weights(self, model):
        names = {"v-topk": ("v",), "mlp-topk": ("mlp_in",)}.get(self.mode, ("q", "k"))
        weights = model.weight_matrices()
        return [(i, name, weights[name][i]) for i in range(len(model.blocks)) for name in names]

    def _fixed_basis(self, w, index):
        """qk-fixed: the same random (U, V) for weight `index` at every step, from (seed, index)."""
        gen = torch.Generator().manual_seed(self.seed * 1000 + index)
        return tuple(torch.linalg.qr(torch.randn(n, self.k, generator=gen)).Q.to(w.device) for n in w.shape)

    @torch.no_grad()
    def before_step(self, model):
        if self.mode == "off":
            return
        self.saved = []
        for index, (i, name, w) in enumerate(self._weights(model)):
            if self.mode == "qk-fixed":
                if index not in self.fixed:
                    self.fixed[index] = self._fixed_basis(w, index)
                U, V = self.fixed[index]
            else:   # qk-nextk: directions k+1..2k; every other mode: 1..k
                first = self.k if self.mode == "qk-nextk" else 0
                U, _, Vh = torch.linalg.svd(w.float(), full_matrices=False)
                U, V = U[:, first:first + self.k], Vh[first:first + self.k].T
            self.saved.append((i, name, w, w.detach().clone(), U, V))

    def _equal_energy(self, dW, U, V, energy):
        P, Q = _orthonormal_complement(U, self.rng), _orthonormal_complement(V, self.rng)
        coef = P.T @ dW @ Q
        c2 = coef.pow(2).flatten().double()
        order = torch.randperm(c2.numel(), generator=self.rng).to(c2.device)
        before = c2[order].cumsum(0) - c2[order]                    # energy taken before each entry
        budget = (energy ** 2 - before).clamp_min(0)
        share = torch.where(c2[order] > 0, (budget / c2[order]).clamp(max=1).sqrt(), torch.zeros_like(budget))
        mask = torch.empty_like(share).scatter_(0, order, share).view_as(coef).to(coef)
        return P @ (mask * coef) @ Q.T

    @torch.no_grad()
    def after_step(self, model):
        """Apply the projection; return per-layer norms for the log: {q,k}_update (||dW||), _removed
        (||R||), _kept (||dW - R||, the update applied) and _target (the projection's removal:
        _removed unless the equal-energy control fell short; qk-shrink's is qk-topk's), and
        removed_fraction_min, the smallest removed / target of any weight since reset_interval()."""
        norms = {}
        for i, name, w, w_before, U, V in self.saved if self.mode != "off" else []:
            dW = w.float() - w_before.float()
            kept = dW - U @ (U.T @ dW)
            kept = kept - (kept @ V) @ V.T                             # (I - U U^T) dW (I - V V^T)
            target = (dW - kept).norm()
            if self.mode == "equal-energy":
                removed = self._equal_energy(dW, U, V, target)
            elif self.mode == "qk-shrink":   # the same norm left as the projection leaves, all directions kept
                removed = dW * (1 - kept.norm() / dW.norm().clamp_min(1e-30))
            else:
                removed = dW - kept
            w.copy_((w_before.float() + dW - removed).to(w.dtype))
            for key, value in (("update", dW.norm()), ("removed", removed.norm()), ("kept", (dW - removed).norm()),
                               ("target", target)):
                norms.setdefault(f"{name}_{key}", []).append(value)
        self.saved = []
        if not norms:
            return {}
        stats = {key: torch.stack(values).tolist() for key, values in norms.items()}   # one host sync
        for name in ("q", "k"):
            for removed, target in zip(stats.get(f"{name}_removed", []), stats.get(f"{name}_target", [])):
                if target > 0:
                    self.fraction_min = min(self.fraction_min, removed / target)
        return {**stats, "removed_fraction_min": self.fraction_min}

    def reset_interval(self):
        """Start the next interval's removed_fraction_min (Assay.log_stats, at each log record)."""
        self.fraction_min = 1.0

    def state_dict(self):
        return {"mode": self.mode, "k": self.k, "rng": self.rng.get_state(),   # qk-fixed: seeded
                "fraction_min": self.fraction_min}

    def load_state_dict(self, state):
        self.mode, self.k, self.fixed = state["mode"], state["k"], {}
        self.rng.set_state(state["rng"])
        self.fraction_min = state.get("fraction_min", 1.0)


# ----------------------------------------------------------------------------------------------------------------
# The QK-only fix (--qk-fix clean-grad): W_q and W_k learn as if there were no fault.

@contextlib.contextmanager
def fault_free(model, injector=None):
    """The model without the fault under study: fp32 softmax state, no injected error (the kernel's
    other rounding points stay as the run has them)."""
    faulty_accums = [attn.accum for attn in model.attentions]
    for attn in model.attentions:
        attn.accum = "fp32"
    try:
        with injector.paused() if injector is not None else contextlib.nullcontext():
            yield
    finally:
        for attn, accum in zip(model.attentions, faulty_accums):
            attn.accum = accum


def clean_qk_grads(model, x, y, autocast, scale, injector=None):
    """--qk-fix clean-grad: W_q's and W_k's gradient from the fault-free model on this batch; no
    other .grad is touched, so every other weight keeps its faulty gradient."""
    with fault_free(model, injector), autocast():
        _, loss, _ = model(x, y)
    return torch.autograd.grad(loss * scale, model.qk_weights())


# ----------------------------------------------------------------------------------------------------------------
# train.py's extension (run.Extension): the assay's flags, their refusals, and the hooks the loop calls.
# `python -m lab.train_assay` runs train.py's main with it (lab/train_assay.py); the root never imports it.

@torch.no_grad()
def gain_record(model):
    """The pre-attention norm's gain g per layer (its rms and largest |g|), and per head the top singular value
    of W_q,h diag(g) and W_k,h diag(g): the QK weights as the normalized input x_hat meets them. A max logit is
    at most scale |x_hat_i| |x_hat_j| sigma(W_q,h diag g) sigma(W_k,h diag g), |x_hat|^2 <= n_embd: a gain can
    grow the logits with sigma(W_q) held (claim 5's probe holds W_q's, not g). Exact, at log steps only."""
    gains = torch.stack([block.norm1.weight for block in model.blocks]).detach().float()   # (layer, n_embd)
    heads = torch.stack([torch.stack(a.head_weights()) for a in model.attentions]).detach().float()
    gained = torch.linalg.matrix_norm(heads * gains[:, None, None, None, :], ord=2)       # (L, 2, head)
    return {"attn_gain_rms": gains.pow(2).mean(-1).sqrt().tolist(),
            "attn_gain_max": gains.abs().amax(-1).tolist(),
            "sigma_q_gain_head": gained[:, 0].tolist(), "sigma_k_gain_head": gained[:, 1].tolist()}


def injection_scale(text):
    """--inject-scale: a number > 0, or 'matched'."""
    return text if text == "matched" else run.POSITIVE(text)


class Assay(run.Extension):
    """The injector, the QK-only fix and the probe at the places train.py's loop calls (run.Extension); a
    no-op until start() finds an assay flag set."""
    command = run.ASSAY_COMMAND

    def __init__(self):
        self.injector, self.probe, self.clean_grad, self.model = None, Probe("off"), False, None
        self.clean, self.probe_stats = None, {}   # this step's summed clean W_q, W_k grads; the last probe log

    def add_flags(self, parser, add):
        """The assay's flags in train.py's parser (run.build_parser's add: None means unset)."""
        g = parser.add_argument_group("the assay: a controlled error at any source, the QK-only fix, the causal "
                                      "probe (lab/assay.py)")
        add(g, "--inject-site", "none", "where the error enters: attn-out, mlp-in, mlp-out, residual "
            "(the forward: the model changes), delta (the backward: only dq, dk change), grad-wv, "
            "grad-mlp (W_v's, W_up's gradient)", choices=list(INJECT_SITES))
        add(g, "--inject-scale", None, "error rms over the rms of the signal it joins, or 'matched' "
            "(the bf16 fault's bias, per head, measured on the first batch)", type=injection_scale)
        add(g, "--inject-coherence", None, "probability that a head's error sign persists to the next "
            "step (1, the default: sign-coherent; 0.5: a random sign each step)", type=run.PROBABILITY)
        add(g, "--inject-layers", "all", "comma-separated layer indices, or all")
        add(g, "--qk-fix", "off", "QK-only fix, the fault left on: clean-grad (fault-free W_q, W_k "
            "gradients; backward sites) or qknorm (from step 0; forward sites)", choices=list(QK_FIXES))
        add(g, "--probe", "off", "project each step's W_q/W_k update off its top-k singular directions "
            "(qk-topk); controls: the whole update shrunk to the norm qk-topk leaves (qk-shrink), the next "
            "k directions (qk-nextk), a fixed random subspace (qk-fixed), W_v's or the MLP's top-k "
            "(v-topk, mlp-topk), equal energy elsewhere (equal-energy)", choices=list(PROBE_MODES))
        add(g, "--probe-k", 3, "singular directions the probe removes", type=run.COUNT)

    def refusals(self, args, typed):
        """(refused, why and what to do instead), as run.refusals: assay settings that would do nothing."""
        site, scale, fix = args.inject_site, args.inject_scale, args.qk_fix
        guard_on, action = args.guard == "on", args.guard_action
        return [
            (site == "none" and scale is not None,
             "--inject-scale was given with --inject-site none: pick a site or drop the scale"),
            (site == "none" and args.inject_coherence is not None,
             "--inject-coherence was given with --inject-site none: pick a site or drop it"),
            (site != "none" and scale is None,
             f"--inject-site {site} needs --inject-scale (error rms / signal rms, or 'matched')"),
            (fix == "clean-grad" and site in GRAD_SITES and args.accum == "fp32",
             f"--qk-fix clean-grad recomputes the forward without the fault, but --inject-site {site} never "
             "touches the forward: the clean QK gradient would be the faulty one"),
            (fix == "clean-grad" and site in ACTIVATION_SITES,
             f"--qk-fix clean-grad with --inject-site {site} trains W_q, W_k on the model without the error, a "
             "different objective rather than a QK-only fix: use --qk-fix qknorm for a forward site (clean-grad "
             "is for the backward sites: delta, or grad-wv and grad-mlp beside a bf16 --accum)"),
            (fix != "off" and site == "none" and args.accum == "fp32",
             "--qk-fix corrects the QK channel while a fault is active, but there is none: set --inject-site or "
             "a faulty --accum"),
            (args.inject_layers != "all" and not all(i.strip().isdigit() for i in args.inject_layers.split(",")),
             f"--inject-layers {args.inject_layers!r}: give comma-separated layer indices, or all"),
            ("probe_k" in typed and args.probe == "off",
             "--probe-k has no effect with --probe off: choose a --probe mode"),
            ("inject_layers" in typed and args.inject_site == "none",
             "--inject-layers has no effect with --inject-site none"),
            (site == "delta" and args.attn_impl == "sdpa",
             "--inject-site delta changes the streaming kernel's backward: not with --attn-impl sdpa"),
            # --qk-fix qknorm is QK-norm from step 0, as --qknorm always (run.refusals)
            (guard_on and action == "qknorm" and fix == "qknorm",
             "--guard-action qknorm has nothing to switch when --qk-fix qknorm is set"),
        ]

    def check_sizes(self, args, parser):
        """What needs the model's sizes (run.resolve calls it once the preset filled them)."""
        if args.guard == "on" and args.guard_signal == "max-logit" and args.qk_fix == "qknorm" \
                and run.qk_norm_bound(args) <= args.guard_threshold:   # as run.check_sizes's
            parser.error("--guard-signal max-logit cannot cross --guard-threshold under QK-norm (--qk-fix "
                         "qknorm): use --guard-signal sigma-product")
        if args.inject_layers != "all" and max(map(int, args.inject_layers.split(","))) >= args.n_layer:
            parser.error(f"--inject-layers {args.inject_layers}: the model has layers 0..{args.n_layer - 1}")
        if args.probe != "off" and args.probe_k >= args.n_embd:   # every probed matrix has n_embd columns
            parser.error(f"--probe-k {args.probe_k} would remove every direction of the {args.n_embd}-wide "
                         f"weights (the whole update, freezing them): give a k below --n-embd {args.n_embd}")
        if args.probe == "qk-nextk" and 2 * args.probe_k > args.n_embd:   # directions k+1..2k must exist
            parser.error(f"--probe qk-nextk removes directions {args.probe_k + 1}..{2 * args.probe_k}, past the "
                         f"{args.n_embd}-wide weights: give a --probe-k of at most {args.n_embd // 2}")

    def model_config(self, args, config):
        """--qk-fix qknorm: parameter-free QK-norm from step 0, the model's own switch (--qknorm always)."""
        return dataclasses.replace(config, qk_norm=True) if args.qk_fix == "qknorm" else config

    def start(self, args, model, first_batch, autocast):
        active = args.inject_site != "none" or args.qk_fix != "off" or args.probe != "off"
        self.model = model if active else None   # whose gains log_stats records: none without a flag
        if args.inject_site != "none":
            self.injector = ErrorInjector.from_args(args, model, first_batch, autocast)
        self.probe, self.clean_grad = Probe(args.probe, k=args.probe_k, seed=args.seed), args.qk_fix == "clean-grad"

    def begin_step(self, step):
        if self.injector is not None:
            self.injector.begin_step(step)

    def after_micro_backward(self, model, x, y, autocast, micro_steps):
        if self.clean_grad:                # (3) QK-only fix: W_q, W_k learn fault-free
            grads = clean_qk_grads(model, x, y, autocast, 1.0 / micro_steps, self.injector)
            self.clean = grads if self.clean is None else [a + b for a, b in zip(self.clean, grads)]

    def after_backward(self, model, dist):
        if self.clean is not None:
            for weight, grad in zip(model.qk_weights(), self.clean):
                weight.grad = dist.all_reduce(grad)
            self.clean = None
        if self.injector is not None:      # (3) an error in a weight's gradient
            self.injector.inject_grads(model)

    def before_update(self, model):
        self.probe.before_step(model)

    def after_update(self, model):
        self.probe_stats = self.probe.after_step(model)

    def log_stats(self):
        """The attention gains (gain_record), the injected error's size and signs, the probe's last update;
        starts the probe's next interval."""
        stats = gain_record(self.model) if self.model is not None else {}
        stats.update(self.injector.last_stats if self.injector is not None else {})
        if self.probe_stats:
            stats["probe"] = self.probe_stats
        self.probe.reset_interval()
        return stats

    def parts(self):   # an unused probe keeps nothing: a run made by train.py resumes here too
        return {"probe": self.probe if self.probe.mode != "off" else None, "injector": self.injector}
