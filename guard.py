"""
QK-Guard: watch the query-key channel, stay dormant, and at the first threshold crossing switch an action on.

Three parts, one screen each:
  SpectralMonitor   the largest singular value of W_q and W_k, per layer and per head, by power iteration
                    carried across steps (a few matrix-vector products per step, never a full SVD).
  QKGuard           the dormant controller: signal -> first crossing of a threshold -> an action latched on for
                    the rest of the run (its state travels in the checkpoint, so it stays latched on resume).
  CollapseDetector  a non-finite loss, or a loss stuck above its running minimum by a margin.

The max attention logit itself costs nothing to watch: the attention kernel returns it as a by-product, and the
model hands it back from forward() as an (n_layer, n_head) tensor.
"""
import math

import torch

SIGNALS = ("max-logit", "sigma-product")
ACTIONS = ("qknorm", "qkclip", "lr-drop", "clip", "softcap", "fp32-accum")
SCOPES = ("all", "crossed")


class SpectralMonitor:
    """sigma_max(W) ~= |W v| where v, the top right singular vector, is refined by `iters` power steps per call
    (one, by default).

    The weights move slowly between optimizer steps, so the vector carried over from the last step is already
    close, and a single iteration keeps it converged (the test checks 1% of the exact value after warm-up).
    Each call stacks an fp32 copy of every W_q and W_k (2 * n_layer * d^2 floats) for a few batched products.
    """

    def __init__(self, model, seed=0):
        attn = model.attentions[0]
        n_layer, n_head, n_embd = len(model.attentions), attn.n_head, attn.q_proj.weight.shape[1]
        gen = torch.Generator().manual_seed(seed)
        device = attn.q_proj.weight.device
        # index 0 holds W_q's vectors, index 1 W_k's
        self.v_full = torch.randn(n_layer, 2, n_embd, generator=gen).to(device)
        self.v_head = torch.randn(n_layer, 2, n_head, n_embd, generator=gen).to(device)

    @torch.no_grad()
    def measure(self, model, iters=1):
        """Returns sigma (n_layer, 2) and sigma_head (n_layer, 2, n_head); [:, 0] is W_q, [:, 1] is W_k."""
        attns = model.attentions
        # every layer's W_q and W_k in one (n_layer, 2, C_out, C_in) stack: a handful of batched kernels per
        # step instead of a handful per matrix; head h owns output rows h*head_dim:(h+1)*head_dim
        w = torch.stack([torch.stack([a.q_proj.weight, a.k_proj.weight]) for a in attns]).float()
        w_heads = w.unflatten(2, (attns[0].n_head, -1))                  # (n_layer, 2, n_head, head_dim, C_in)
        v, vh = self.v_full, self.v_head
        for _ in range(iters):   # v <- W^T W v, normalized
            v = torch.einsum("lwoi,lwo->lwi", w, torch.einsum("lwoi,lwi->lwo", w, v))
            v = v / v.norm(dim=-1, keepdim=True).clamp_min(1e-30)
            vh = torch.einsum("lwhoi,lwho->lwhi", w_heads, torch.einsum("lwhoi,lwhi->lwho", w_heads, vh))
            vh = vh / vh.norm(dim=-1, keepdim=True).clamp_min(1e-30)
        self.v_full, self.v_head = v, vh
        sigma = torch.einsum("lwoi,lwi->lwo", w, v).norm(dim=-1)
        sigma_head = torch.einsum("lwhoi,lwhi->lwho", w_heads, vh).norm(dim=-1)
        return sigma, sigma_head

    def state_dict(self):
        return {"v_full": self.v_full.cpu(), "v_head": self.v_head.cpu()}

    def load_state_dict(self, state):
        self.v_full = state["v_full"].to(self.v_full.device)
        self.v_head = state["v_head"].to(self.v_head.device)


class QKGuard:
    """Dormant until the signal first crosses the threshold; then the action stays on for the rest of the run.

    signal  "max-logit":     the max attention logit of each (layer, head) in this step's forward.
            "sigma-product": sigma(W_q,h) * sigma(W_k,h) per head, the bound on the logit's bilinear form.
    scope   "all":     the action covers every layer from the trigger on (one switch, one recompile).
            "crossed": only layers whose signal crossed; a layer that crosses later joins then.

    observe() checks at once, which reads one flag back to the host and so makes a GPU wait for the step to end.
    observe_deferred(), what train.py uses, copies the flag in the background and acts on it at the next check:
    the action starts one monitored step later, and the GPU never waits for the guard.
    """

    def __init__(self, enabled=False, signal="max-logit", threshold=200.0, action="qknorm", scope="all",
                 tau=100.0, lr_factor=0.1, clip_norm=0.1, softcap=50.0):
        for name, value, valid in (("signal", signal, SIGNALS), ("action", action, ACTIONS),
                                   ("scope", scope, SCOPES)):
            if value not in valid:
                raise ValueError(f"unknown guard {name} {value!r}: choose one of {', '.join(valid)}")
        self.enabled, self.signal, self.threshold = enabled, signal, threshold
        self.action, self.scope = action, scope
        self.tau, self.lr_factor, self.clip_norm, self.softcap = tau, lr_factor, clip_norm, softcap
        self.trigger = None      # {"step", "layer", "head", "value"} of the first crossing
        self.layers = []         # layers the action covers, sorted
        self.pending = None      # observe_deferred: (step, signal values, crossed flag, copy-done event or None)

    @property
    def triggered(self):
        return self.trigger is not None

    def signal_values(self, max_logit, sigma_head):
        """(n_layer, n_head) values of the watched signal."""
        if self.signal == "max-logit":
            return max_logit
        return sigma_head[:, 0] * sigma_head[:, 1]

    def watching(self):
        return self.enabled and not (self.triggered and self.scope == "all")

    def watched_values(self, max_logit, sigma_head):
        """The signal of the layers the action does not cover yet (covered layers -inf: a signal the action does
        not lower, like sigma-product under qknorm, must not count as a new crossing at every check)."""
        values = self.signal_values(max_logit, sigma_head).float().clone()
        values[self.layers] = -math.inf
        return values

    def observe(self, step, max_logit, sigma_head, model):
        """Check the signal; on a (new) crossing switch the action on. Returns the trigger event or None."""
        if not self.watching():
            return None
        values = self.watched_values(max_logit, sigma_head)
        if not (values > self.threshold).any():      # a device->host read: the GPU must finish the step first
            return None
        return self.switch_on(step, values, model)

    def observe_deferred(self, step, max_logit, sigma_head, model):
        """observe() one monitored step late, without a host sync: act on the check queued last time (its flag
        reached the host while this step ran), then queue this step's. An event names the step that crossed, and
        in active_from the first update that the action changes: the one after `step`."""
        event, pending, self.pending = None, self.pending, None
        if pending is not None and self._crossed(pending) and self.watching():
            event = self.switch_on(pending[0], pending[1], model)
            if event:
                event["active_from"] = step + 1
        if self.watching():
            values = self.watched_values(max_logit, sigma_head)
            crossed, copied = (values > self.threshold).any(), None
            if crossed.is_cuda:
                stream = torch.cuda.current_stream(crossed.device)
                crossed = crossed.to("cpu", non_blocking=True)   # pinned by the caching host allocator
                copied = torch.cuda.Event()
                copied.record(stream)
            self.pending = (step, values, crossed, copied)
        return event

    @staticmethod
    def _crossed(pending):
        """A queued check's flag on the host. Waits for that copy only, long done: not for the work queued since."""
        _, _, crossed, copied = pending
        if copied is not None:
            copied.synchronize()
        return bool(crossed)

    def pending_crossing(self):
        """The step of a crossing queued but not yet acted on (the run's last check), or None."""
        return self.pending[0] if self.pending is not None and self._crossed(self.pending) else None

    def switch_on(self, step, values, model):
        """The signal crossed at `step`: extend the action to the new layers it covers. Returns the event."""
        crossed = values > self.threshold
        crossed_layers = crossed.any(dim=1).nonzero().flatten().tolist()
        n_layer = values.shape[0]
        new_layers = list(range(n_layer)) if self.scope == "all" else crossed_layers
        new_layers = [layer for layer in new_layers if layer not in self.layers]
        if not new_layers:
            return None
        # report the largest crossing among the layers the action now takes on
        masked = torch.full_like(values, -math.inf)
        masked[new_layers] = values[new_layers]
        layer, head = divmod(int(masked.argmax()), values.shape[1])
        event = {"event": "guard_trigger" if not self.triggered else "guard_extend", "step": step,
                 "layer": layer, "head": head, "value": float(values[layer, head]), "signal": self.signal,
                 "threshold": self.threshold, "action": self.action, "layers": new_layers}
        if not self.triggered:
            self.trigger = {k: event[k] for k in ("step", "layer", "head", "value")}
        self.layers = sorted(self.layers + new_layers)
        self.apply_to_model(model)
        return event

    def apply_to_model(self, model):
        """Switch the attention-side actions on in the covered layers (also used after a resume)."""
        for layer in self.layers:
            attn = model.attentions[layer]
            if self.action == "qknorm":
                attn.qk_norm = True
            elif self.action == "softcap":
                attn.softcap = self.softcap
            elif self.action == "fp32-accum":
                attn.accum = "fp32"

    def lr_scale(self):
        return self.lr_factor if self.triggered and self.action == "lr-drop" else 1.0

    def grad_clip(self, base_clip):
        if self.triggered and self.action == "clip":
            return min(base_clip, self.clip_norm) if base_clip > 0 else self.clip_norm
        return base_clip

    @torch.no_grad()
    def after_optimizer_step(self, model, max_logit):
        """QK-Clip (Kimi K2): scale W_q and W_k rows of every covered head whose max logit exceeds tau by
        sqrt(tau / S_max) each, so that head's logits shrink by tau / S_max: the same inputs give max = tau."""
        if not (self.triggered and self.action == "qkclip"):
            return 0
        clipped = 0
        for layer in self.layers:
            over = max_logit[layer] > self.tau
            if not over.any():
                continue
            factor = torch.where(over, (self.tau / max_logit[layer].clamp_min(1e-30)).sqrt(), 1.0)
            w_q, w_k = model.attentions[layer].head_weights()
            w_q.mul_(factor.to(w_q.dtype)[:, None, None])
            w_k.mul_(factor.to(w_k.dtype)[:, None, None])
            clipped += int(over.sum())
        return clipped

    def state_dict(self):
        # a queued check travels too, so a resumed run acts on it at the same step as an uninterrupted one
        pending = None if self.pending is None else {"step": self.pending[0], "values": self.pending[1].cpu()}
        return {"trigger": self.trigger, "layers": list(self.layers), "pending": pending}

    def load_state_dict(self, state, model):
        self.trigger, self.layers = state["trigger"], list(state["layers"])
        pending = state.get("pending")
        self.pending = None if pending is None else \
            (pending["step"], pending["values"], (pending["values"] > self.threshold).any(), None)
        self.apply_to_model(model)


class CollapseDetector:
    """Collapse = a non-finite loss, or the smoothed loss above its running minimum + margin for `patience`
    logged steps in a row. Smoothing (an EMA of the logged losses) keeps the noise of small batches from
    counting; a spike that recovers is not a collapse. The recorded step is the first of the bad streak."""

    def __init__(self, margin=1.0, patience=5, smoothing=0.9):
        self.margin, self.patience, self.smoothing = margin, patience, smoothing
        self.ema, self.best = None, math.inf
        self.streak_start, self.streak = None, 0
        self.collapsed_at = None

    def update(self, step, loss):
        """Feed one logged loss; returns True the first time a collapse is detected."""
        if self.collapsed_at is not None:
            return False
        if not math.isfinite(loss):
            self.collapsed_at = step
            return True
        self.ema = loss if self.ema is None else self.smoothing * self.ema + (1 - self.smoothing) * loss
        if self.ema > self.best + self.margin:
            self.streak += 1
            self.streak_start = step if self.streak == 1 else self.streak_start
            if self.streak >= self.patience:
                self.collapsed_at = self.streak_start
                return True
        else:
            self.streak, self.streak_start = 0, None
        self.best = min(self.best, self.ema)
        return False

    def state_dict(self):
        return dict(vars(self))

    def load_state_dict(self, state):
        vars(self).update(state)
