"""
QK-Guard: watch the query-key channel, stay dormant, and switch an action on at the first crossing.

SpectralMonitor measures the weights (never a full SVD); the actions are one class each; QKGuard is the
dormant controller; CollapseDetector tells a collapsed run. The max attention logit is free to watch: the
kernel returns it, and forward() passes it on.
"""
import math
from typing import NamedTuple, Optional

import torch

SIGNALS = ("max-logit", "sigma-product")
# Default thresholds, between healthy runs and runaways: max-logit's from SOURCES.md's H200 runs, sigma-product's
# from lab/MEASUREMENTS.md's CPU runs (it scales with the model: set it from a healthy run's log).
DEFAULT_THRESHOLD = {"max-logit": 200.0, "sigma-product": 50.0}
SCOPES = ("all", "crossed")
# The actions by name, filled by Action's subclasses below: --guard-action's choices and the lab's claim 6
# arms follow it (the lab imports it: one list, not a copy kept in step by a test).
ACTIONS = {}
DEFAULT_ACTION = "qknorm"


class SpectralMonitor:
    """sigma_max(W) ~= |W v|, v the top right singular vector refined by `iters` power steps. The weights
    move little per step, so the v carried over stays close and one iteration keeps it converged
    (test_training.py checks it against the exact value)."""

    def __init__(self, model, seed=0):
        gen = torch.Generator().manual_seed(seed)
        attn = model.attentions[0]
        n_layer, self.n_head = len(model.attentions), attn.n_head
        device, n_embd = attn.q_proj.weight.device, attn.q_proj.weight.shape[1]
        self.v = {kind: torch.randn(n_layer, ws[0].shape[1], generator=gen).to(device)
                  for kind, ws in model.weight_matrices().items()}
        self.v["qk_head"] = torch.randn(n_layer, 2, self.n_head, n_embd, generator=gen).to(device)
        self.sigma, self.sigma_head = None, None

    @staticmethod
    def _power_step(w, v):
        """One step of v <- W^T W v, normalized, over any leading batch dims."""
        v = torch.einsum("...oi,...o->...i", w, torch.einsum("...oi,...i->...o", w, v))
        return v / v.norm(dim=-1, keepdim=True).clamp_min(1e-30)

    @torch.no_grad()
    def measure(self, model, iters=1, kinds=None):
        """Refresh self.sigma (of `kinds`; None: every kind model.py's WEIGHT_KINDS names) and, with W_q
        and W_k, self.sigma_head; returns both. Each call copies the weights it measures, so train.py
        measures non-QK kinds at log steps. (model.py is not imported: qkguard uses this file without it.)"""
        weights = model.weight_matrices() if kinds is None else model.weight_matrices(kinds)
        stacks = {kind: torch.stack(ws).float() for kind, ws in weights.items()}    # (layer, out, in)
        if "q" in stacks:   # head h owns rows h*head_dim:(h+1)*head_dim of W_q and W_k
            stacks["qk_head"] = torch.stack([stacks["q"], stacks["k"]], dim=1).unflatten(2, (self.n_head, -1))
        norms = {}
        for kind, w in stacks.items():
            for _ in range(iters):
                self.v[kind] = self._power_step(w, self.v[kind])
            norms[kind] = torch.einsum("...oi,...i->...o", w, self.v[kind]).norm(dim=-1)
        self.sigma_head = norms.pop("qk_head", self.sigma_head)      # (n_layer, 2, n_head)
        self.sigma = {**(self.sigma or {}), **norms}                  # {kind: (n_layer,)}
        return self.sigma, self.sigma_head

    def record(self):   # for the log
        return {**{f"sigma_{kind}": s.tolist() for kind, s in self.sigma.items()},
                "sigma_q_head": self.sigma_head[:, 0].tolist(), "sigma_k_head": self.sigma_head[:, 1].tolist()}

    def state_dict(self):
        return {"v": {k: v.cpu() for k, v in self.v.items()}, "sigma": {k: s.cpu() for k, s in self.sigma.items()},
                "sigma_head": self.sigma_head.cpu()}

    def load_state_dict(self, state):
        device = self.v["q"].device
        self.v = {k: v.to(device) for k, v in state["v"].items()}
        self.sigma = {k: s.to(device) for k, s in state["sigma"].items()}
        self.sigma_head = state["sigma_head"].to(device)


class Action:
    """What the guard switches on once it fires: the hooks below (no-ops; an action overrides those it needs).
    Its settings are class attributes (the defaults) named as QKGuard's keywords. kind, for the lab's claim
    6: "qk" acts on the query-key channel, "non-qk" is a control that acts elsewhere, "source" removes the
    error where it starts."""
    name = kind = words = None         # words: the action in the lab's reports and plots

    def __init_subclass__(cls):        # every action is registered by its name
        ACTIONS[cls.name] = cls

    def __init__(self, **settings):    # QKGuard passes every action's settings: keep ours, None: default
        for key, value in settings.items():
            if value is not None and hasattr(self, key):
                setattr(self, key, value)

    def apply_to_layer(self, attn): pass                # each covered attention layer, at switch-on and resume
    def lr_scale(self): return 1.0                      # where the loop sets the learning rate
    def grad_clip(self, base_clip): return base_clip    # where it clips the gradient (base_clip 0: no clip)
    def after_optimizer_step(self, model, layers, max_logit): return 0    # after each update; heads changed


class QKNorm(Action):
    """The paper's action: parameter-free QK-norm, q and k RMS-normalized per head (|logit| <= scale * head_dim)."""
    name, kind, words = "qknorm", "qk", "QK-norm"

    def apply_to_layer(self, attn):
        attn.qk_norm = True


class QKClip(Action):
    """Kimi K2's QK-Clip: after each update, the W_q and W_k rows of each covered head whose max logit
    S_max passed tau, each times sqrt(tau / S_max), so that the head's logits shrink by tau / S_max."""
    name, kind, words = "qkclip", "qk", "QK-Clip"
    tau = 100.0                        # --qkclip-tau

    @torch.no_grad()
    def after_optimizer_step(self, model, layers, max_logit):
        clipped = 0
        for layer in layers:
            over = max_logit[layer] > self.tau
            if over.any():
                factor = torch.where(over, (self.tau / max_logit[layer].clamp_min(1e-30)).sqrt(), 1.0)
                for w in model.attentions[layer].head_weights():    # W_q, W_k: (n_head, head_dim, n_embd)
                    w.mul_(factor.to(w.dtype)[:, None, None])
                clipped += int(over.sum())
        return clipped


class LrDrop(Action):
    """A non-QK control: the learning rate times lr_factor."""
    name, kind = "lr-drop", "non-qk"
    lr_factor = 0.1                    # --lr-drop-factor
    words = f"the lr cut {1 / lr_factor:g}x"

    def lr_scale(self):
        return self.lr_factor


class Clip(Action):
    """A non-QK control: the gradient norm clipped at clip_norm, or at the run's own clip if tighter
    (Adam rescales a clipped gradient back, so this acts mostly through the moments)."""
    name, kind, words = "clip", "non-qk", "tight gradient clipping"
    clip_norm = 0.1                    # --clip-tight

    def grad_clip(self, base_clip):
        return min(base_clip, self.clip_norm) if base_clip > 0 else self.clip_norm


class Softcap(Action):
    """A non-QK control, Gemma 2's: logits capped at c = softcap as c * tanh(logit / c) (in bf16 the
    capped logits pile up at the cap, making ties of their own)."""
    name, kind, words = "softcap", "non-qk", "a logit softcap"
    softcap = 50.0                     # --softcap-value

    def apply_to_layer(self, attn):
        attn.softcap = self.softcap


class FP32Accum(Action):
    """The fix at the source of the prior work's fault (Qiu & Yao 2025: a bf16 softmax state): that
    state in fp32, so the biased rounding that starts the runaway is gone."""
    name, kind, words = "fp32-accum", "source", "fp32 state"

    def apply_to_layer(self, attn):
        attn.accum = "fp32"


class Pending(NamedTuple):
    """A check queued by observe_deferred; `crossed` reaches the host while the next steps run."""
    step: int
    values: torch.Tensor             # the watched signal, (n_layer, n_head)
    crossed: torch.Tensor            # any value over threshold: on the host once `copied` is done
    copied: Optional[object]         # the CUDA event of that copy, or None: nothing to wait for


class QKGuard:
    """Dormant until the signal first crosses the threshold; then the action stays on for the run.

    signal  "max-logit":     the max attention logit of each (layer, head) in this step's forward.
            "sigma-product": sigma(W_q,h) * sigma(W_k,h), the bound on the head's bilinear form.
    scope   "all":     every layer from the trigger on (one switch, one recompile).
            "crossed": only layers whose signal crossed; a layer that crosses later joins then.
    """

    def __init__(self, *, threshold=None, enabled=False, signal="max-logit", action=DEFAULT_ACTION, scope="all",
                 tau=None, lr_factor=None, clip_norm=None, softcap=None):
        for name, value, valid in (("signal", signal, SIGNALS), ("action", action, ACTIONS), ("scope", scope, SCOPES)):
            if value not in valid:
                raise ValueError(f"unknown guard {name} {value!r}: choose one of {', '.join(valid)}")
        self.enabled, self.signal, self.action, self.scope = enabled, signal, action, scope   # action: its name
        self.threshold = DEFAULT_THRESHOLD[signal] if threshold is None else threshold
        self.act = ACTIONS[action](tau=tau, lr_factor=lr_factor, clip_norm=clip_norm, softcap=softcap)
        self.trigger = None      # {"step", "layer", "head", "value"} of the first crossing
        self.layers = []         # layers the action covers, sorted
        self.pending = None      # observe_deferred's queued check: a Pending

    @classmethod
    def from_args(cls, args):
        """The guard of train.py's flags (--guard*, each action's own); sample.py's, from the saved flags."""
        return cls(enabled=args.guard == "on", signal=args.guard_signal, threshold=args.guard_threshold,
                   action=args.guard_action, scope=args.guard_scope, tau=args.qkclip_tau,
                   lr_factor=args.lr_drop_factor, clip_norm=args.clip_tight, softcap=args.softcap_value)

    @property
    def triggered(self):
        return self.trigger is not None

    # QK-Clip's cap, which qkguard/hooks.py's own clip reads (and its tests set)
    tau = property(lambda self: self.act.tau, lambda self, value: setattr(self.act, "tau", value))

    def watching(self):
        return self.enabled and not (self.triggered and self.scope == "all")

    def watched_values(self, max_logit, sigma_head):
        """The signal (n_layer, n_head) of the layers the action does not cover yet; covered layers get
        -inf, or a signal the action does not lower (sigma-product under qknorm) would cross each check."""
        values = (max_logit if self.signal == "max-logit" else sigma_head[:, 0] * sigma_head[:, 1]).float().clone()
        values[self.layers] = -math.inf
        return values

    def observe_deferred(self, step, max_logit, sigma_head, model):
        """Check the signal one monitored step late, with no host sync: act on the check queued last time
        (its flag reached the host while this step ran), then queue this step's. An event names the
        step that crossed, and in active_from the first update the action changes (step + 1)."""
        event, pending, self.pending = None, self.pending, None
        if pending is not None and self._crossed(pending) and self.watching():
            event = self.switch_on(pending.step, pending.values, model)
            if event:
                event["active_from"] = step + 1
        if self.watching():
            values = self.watched_values(max_logit, sigma_head)
            crossed, copied = (values > self.threshold).any(), None
            if crossed.is_cuda:
                crossed = crossed.to("cpu", non_blocking=True)   # pinned (caching host allocator)
                copied = torch.cuda.Event()
                copied.record(torch.cuda.current_stream(values.device))
            self.pending = Pending(step, values, crossed, copied)
        return event

    @staticmethod
    def _crossed(pending):
        """A queued check's flag on the host; waits for that long-done copy, not for later work."""
        if pending.copied is not None:
            pending.copied.synchronize()
        return bool(pending.crossed)

    def pending_crossing(self):
        """The step of a crossing queued but not yet acted on (the run's last check), or None."""
        return self.pending.step if self.pending is not None and self._crossed(self.pending) else None

    def switch_on(self, step, values, model):
        """The signal crossed at `step`: extend the action to the new layers; returns the event."""
        crossed_layers = (values > self.threshold).any(dim=1).nonzero().flatten().tolist()
        candidates = range(values.shape[0]) if self.scope == "all" else crossed_layers
        new_layers = [layer for layer in candidates if layer not in self.layers]
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

    # Where train.py's loop applies the action (its class's hooks), once the guard has fired.

    def apply_to_model(self, model):
        """In the covered attention layers, at the switch-on and again after a resume."""
        for layer in self.layers:
            self.act.apply_to_layer(model.attentions[layer])

    def lr_scale(self):
        return self.act.lr_scale() if self.triggered else 1.0

    def grad_clip(self, base_clip):
        return self.act.grad_clip(base_clip) if self.triggered else base_clip

    def after_optimizer_step(self, model, max_logit):
        """Returns how many heads the action changed (QK-Clip's clipped heads)."""
        return self.act.after_optimizer_step(model, self.layers, max_logit) if self.triggered else 0

    def state_dict(self):
        # a queued check travels too, so a resumed run acts on it when an uninterrupted one would
        pending = None if self.pending is None else {"step": self.pending.step, "values": self.pending.values.cpu()}
        return {"trigger": self.trigger, "layers": list(self.layers), "pending": pending}

    def load_state_dict(self, state):
        """The latched state back; apply_to_model() then switches the action on in the model."""
        self.trigger, self.layers = state["trigger"], list(state["layers"])
        pending = state.get("pending")
        self.pending = None if pending is None else \
            Pending(pending["step"], pending["values"], (pending["values"] > self.threshold).any(), None)


class CollapseDetector:
    """Collapse: a non-finite loss, or the smoothed (EMA) loss above its running minimum + margin for
    `patience` logged steps in a row; small-batch noise and a spike that recovers do not count. collapsed_at
    is the first step of the bad streak. The guard's own switch (QK-norm cuts logits of hundreds in one
    step) can shake the loss: pause(until) ignores it up to step `until`; a loss still too high then counts."""

    def __init__(self, margin=1.0, patience=5, smoothing=0.9):
        self.margin, self.patience, self.smoothing = margin, patience, smoothing
        self.ema, self.best, self.streak_start, self.streak = None, math.inf, None, 0
        self.collapsed_at, self.paused_until = None, -1

    def pause(self, until):
        self.paused_until = max(self.paused_until, until)

    def update(self, step, loss):
        """Feed one logged loss; returns True the first time a collapse is detected."""
        if self.collapsed_at is not None:
            return False
        if not math.isfinite(loss):
            self.collapsed_at = step
            return True
        self.ema = loss if self.ema is None else self.smoothing * self.ema + (1 - self.smoothing) * loss
        if self.ema > self.best + self.margin and step >= self.paused_until:
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
