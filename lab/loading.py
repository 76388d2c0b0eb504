"""
Reading runs: one run folder summarized as the rules read it (Run), a sweep's folders by arm (load_runs), which
flags an arm sets itself, and the predicates every rule shares (finished, ran away, collapsed, its final loss).

Reads every <root>/<experiment>/seed<k>/ that train.py wrote (log.jsonl or log.jsonl.gz, config.json; see
sweep.py). A run whose log or config.json cannot be read is kept as unreadable, so unfinished (a warning names
it): it counts against its claim as a missing run does.
"""
import glob
import json
import math
import os
import statistics
import sys
import time

from lab.sweep import CLAIMS, DONE, SOURCES, Unreadable, experiments, read_log, split_lr
from lab.thresholds import FINAL_WINDOW, GUARD_THRESHOLD, RUNAWAY_LOGIT


# --------------------------------------------------------------------------------------------------
# Which flags an arm sets itself: the only flags but RUN_SPECIFIC in which a rule's arms may differ


# config.json's flags in which the runs a rule compares may differ: where a run ran and how it logged,
# not what it trained: run.RESUMABLE_CHANGES (a resume may change them) but max_steps, which arms
# must share, and data_dir, which a recorded content hash stands in for (see mixed()), and the seed (a
# test keeps the two lists in step)
RUN_SPECIFIC = {"seed", "out_dir", "resume", "device", "compile", "on_collapse", "log_interval", "eval_interval",
                "eval_iters", "ckpt_interval"}


def own_flags():
    """arm -> the config.json keys its own flags in sweep.py's table set (--inject-site: inject_site):
    the only flags but RUN_SPECIFIC in which a rule's arms may differ."""
    table = experiments(list(CLAIMS))
    for source in SOURCES:   # claims 5 and 6 on every runaway source, not only bf16
        table.update(experiments([5, 6], source=source))
    owned = {name: {flag[2:].split("=")[0].replace("-", "_") for flag in flags if flag.startswith("--")}
             for name, flags in table.items()}
    # an arm's own --max-steps also sets decay_steps (run.py: 0 means --max-steps), which config.json records
    return {name: keys | ({"decay_steps"} if "max_steps" in keys else set()) for name, keys in owned.items()}


OWN_FLAGS = own_flags()


def arm_flags(name):
    """The config.json keys an arm's own flags set; an lr-study arm's (sweep.lr_name: bf16-lr0.03) are its
    base arm's and lr, min_lr (sweep.at_lrs)."""
    base, lr = split_lr(name)
    if name in OWN_FLAGS or lr is None or base not in OWN_FLAGS:
        return OWN_FLAGS.get(name, set())
    return OWN_FLAGS[base] | {"lr", "min_lr"}


# --------------------------------------------------------------------------------------------------
# One run folder, summarized


def finite_max(values):
    """The max without NaNs (an inf stays: a blown-up value is news), or None."""
    values = [v for v in values if v is not None and not math.isnan(v)]
    return max(values) if values else None


def read_config(path):
    """A run folder's config.json ({} if there is none); Unreadable, naming it, if it is not a JSON object."""
    config = os.path.join(path, "config.json")
    if not os.path.exists(config):
        return {}
    try:
        with open(config) as f:
            out = json.load(f)
    except (OSError, ValueError) as e:   # UnicodeDecodeError and JSONDecodeError are ValueErrors
        raise Unreadable(f"{config}: {e}") from e
    if not isinstance(out, dict):
        raise Unreadable(f"{config}: not a JSON object")
    return out


class Run:
    """One run folder, summarized: what the tables and the rules read."""

    def __init__(self, path):
        self.path, self.group, self.seed = path, os.path.basename(os.path.dirname(path)), os.path.basename(path)
        try:
            self.config, records, unreadable = read_config(path), read_log(path), False
        except Unreadable as e:   # skipped, so unfinished: it counts against its claim as a missing run does
            self.config, records, unreadable = {}, [], True
            print(f"warning: {e}: skipped as unreadable (counted as an unfinished run)", file=sys.stderr)
        events = [r for r in records if "event" in r]
        steps = [r for r in records if "event" not in r and "loss" in r]
        end = events[-1] if events and events[-1]["event"] == "end" else {}
        self.status = "unreadable" if unreadable else end.get("status") or ("in progress" if records else "empty log")
        self.finished = self.status in DONE
        self.steps, self.loss = [r["step"] for r in steps], [r["loss"] for r in steps]
        self.grad_norm = [r.get("grad_norm", math.nan) for r in steps]   # lab.detectors' loss-side rules
        nan_if_none = lambda v: math.nan if v is None else v
        # per kind, each logged step's max over layers (and heads, for max_logit): q, k and the
        # other kinds the log holds, as train.py logs them: sigma_<kind>, one number per layer
        per_layer = lambda v: isinstance(v, list) and not any(isinstance(x, list) for x in v)
        logged = {key[len("sigma_"):] for r in steps for key, v in r.items() if key.startswith("sigma_")
                  and per_layer(v)}
        self.other_kinds = sorted(logged - {"q", "k"})
        self.sigmas = {kind: [nan_if_none(finite_max(r.get(f"sigma_{kind}", []))) for r in steps]
                       for kind in ("q", "k", *self.other_kinds)}
        self.sigma = self.sigmas["q"]
        self.logit = [nan_if_none(finite_max(sum(r.get("max_logit", []), []))) for r in steps]
        self.max_sigma, self.max_logit = finite_max(self.sigma), finite_max(self.logit)
        first = lambda kind: next((r["step"] for r in events if r["event"] == kind), None)
        self.collapse_step = first("collapse") if first("collapse") is not None else end.get("collapse_step")
        self.collapsed = self.status == "collapsed" or self.collapse_step is not None
        self.trigger = first("guard_trigger")
        if self.trigger is None:
            self.trigger = (end.get("guard_trigger") or {}).get("step")
        self.trigger_value = next((r.get("value") for r in events if r["event"] == "guard_trigger"),
                                  (end.get("guard_trigger") or {}).get("value"))
        # the first update the action changed (the check is deferred: later than the crossing)
        self.acting_from = next((r.get("active_from", r["step"]) for r in events if r["event"] == "guard_trigger"),
                                self.trigger)
        tail = self.loss[-FINAL_WINDOW:]
        self.final_train = sum(tail) / len(tail) if tail else None
        # the equal-energy control: the least share of its target any step removed (None: no probe)
        shares = [r["probe"]["removed_fraction_min"] for r in steps if "removed_fraction_min" in r.get("probe", {})]
        self.removed_fraction = min(shares) if shares else None
        self.grace_excess = self._grace_excess()
        # sigma(W_q,h) sigma(W_k,h) of every (layer, head) per logged step, flattened (claim 6's QK growth)
        self.qk_heads = [[q * k for row_q, row_k in zip(r["sigma_q_head"], r["sigma_k_head"])
                          for q, k in zip(row_q, row_k)] if "sigma_q_head" in r and "sigma_k_head" in r else None
                         for r in steps]
        # the probe's norms, per layer, of the last update of each logged interval (claim 5's energy report)
        self.probe_norms = [r["probe"] for r in steps if "q_update" in r.get("probe", {})]
        self.evals = [(r["step"], r["val_loss"]) for r in events if r["event"] == "eval"]
        # the end record's val loss (the model's at its end), else the last eval's
        self.final_val = end["val_loss"] if end.get("val_loss") is not None else \
            self.evals[-1][1] if self.evals else None
        # the lr study's: the loss at init (the eval before the first update), and a loss that is not finite
        self.init_val = next((v for s, v in self.evals if s == 0), None)
        self.nonfinite = any(v is not None and not math.isfinite(v) for v in [*self.loss, self.final_val])

    def _grace_excess(self):
        """A guarded run's worst smoothed loss in the collapse detector's grace window (the steps
        after its action starts, where a transient does not count), above its best smoothed loss
        before; None if the guard never acted. Smoothed as the detector is (config.json's flags)."""
        args = self.config.get("args", {})
        if self.acting_from is None:
            return None
        smoothing, grace = args.get("collapse_smoothing", 0.9), args.get("collapse_grace", 100)
        ema, best, worst = None, math.inf, None
        for step, loss in zip(self.steps, self.loss):
            ema = loss if ema is None else smoothing * ema + (1 - smoothing) * loss
            if step < self.acting_from:
                best = min(best, ema)
            elif step < self.acting_from + grace:
                worst = ema if worst is None else max(worst, ema)
        return None if worst is None or best == math.inf else worst - best

    def growth(self, kind):
        """max sigma(kind) / its first logged value (nan if not logged)."""
        values = [v for v in self.sigmas[kind] if not math.isnan(v)]
        return max(values) / values[0] if values and values[0] > 0 else math.nan

    def qk_and_other_growth(self):
        """(growth of sigma(W_q or W_k), of the most-grown other kind: None if none logged)."""
        return max(self.growth("q"), self.growth("k")), finite_max([self.growth(k) for k in self.other_kinds])

    def qk_growth_after(self, step):
        """The most-grown head's sigma(W_q,h) sigma(W_k,h) at the last logged step over its value at the last
        logged step up to `step` (the trigger); nan where not logged."""
        at = [p for s, p in zip(self.steps, self.qk_heads) if s <= step and p]
        end = next((p for p in reversed(self.qk_heads) if p), None)
        ratios = [e / a for e, a in zip(end, at[-1]) if a > 0 and not math.isnan(e / a)] if at and end else []
        return max(ratios) if ratios else math.nan

    def logit_rise(self, step, window):
        """(max logit over the last `window` steps / at the last logged step up to `step`, and whether it
        is still rising: the last window's max above the window's before); (nan, False) where not logged."""
        at = [v for s, v in zip(self.steps, self.logit) if s <= step]
        end = self.steps[-1] if self.steps else 0
        last = [v for s, v in zip(self.steps, self.logit) if s > end - window]
        before = [v for s, v in zip(self.steps, self.logit) if end - 2 * window < s <= end - window]
        if not at or not at[-1] or not last:
            return math.nan, False
        return max(last) / at[-1], bool(before) and max(last) > max(before)

    def probe_shares(self):
        """(share of the W_q, W_k updates' energy the probe removed, 1 - ||applied||^2 / ||dW||^2; norm left,
        ||applied|| / ||dW||): medians over the logged updates and layers, None where not logged (logs before
        qk-shrink have no norm left: there the share is ||R||^2 / ||dW||^2, the same for a projection)."""
        removed, left = [], []
        for p in self.probe_norms:
            for name in ("q", "k"):
                for i, u in enumerate(p.get(f"{name}_update", [])):
                    if u > 0:   # ||dW||^2 - ||dW applied||^2: for qk-shrink R is not orthogonal to what it keeps
                        kept = p.get(f"{name}_kept", [None] * (i + 1))[i]
                        removed.append(1 - (kept / u) ** 2 if kept is not None else (p[f"{name}_removed"][i] / u) ** 2)
                        if kept is not None:
                            left.append(kept / u)
        return (statistics.median(removed) if removed else None, statistics.median(left) if left else None)

    def logit_after(self, step):
        return finite_max([v for s, v in zip(self.steps, self.logit) if s > step]) or 0.0

    def first_past(self, bar, inclusive=False):
        """The first logged step whose max logit passed bar (> bar; >= if inclusive), or None."""
        return next((s for s, v in zip(self.steps, self.logit) if v > bar or inclusive and v >= bar), None)

    def horizon(self):
        """The steps it was set to run (config.json's max_steps), else its last logged step + 1."""
        return self.config.get("args", {}).get("max_steps") or (self.steps[-1] + 1 if self.steps else 0)

    def guard_threshold(self):
        return self.config.get("args", {}).get("guard_threshold") or GUARD_THRESHOLD

    def runaway_from(self):
        """The earliest update at which its runaway (lr_ran_away) may have begun: the first update of the
        logged interval where it first showed, as a record sums the updates since the one before; None if
        it did not run away."""
        for i, (step, loss, logit) in enumerate(zip(self.steps, self.loss, self.logit)):
            if logit >= RUNAWAY_LOGIT or loss is None or not math.isfinite(loss) or \
                    self.collapse_step is not None and step >= self.collapse_step:
                return self.steps[i - 1] + 1 if i else 0
        return self.collapse_step if self.collapsed else 0 if self.nonfinite else None


def load_runs(root):
    """group -> its runs, seeds in numeric order."""
    groups = {}
    for path in sorted(glob.glob(os.path.join(root, "*", "seed*")), key=lambda p: (len(p), p)):
        if os.path.isdir(path):
            run = Run(path)
            groups.setdefault(run.group, []).append(run)
    return groups


# --------------------------------------------------------------------------------------------------
# What every rule asks of a run


def collapsed(run): return run.collapsed


def triggered(run): return run.trigger is not None


def ran_away(run): return run.collapsed or (run.max_logit or 0.0) >= RUNAWAY_LOGIT


def lr_ran_away(run):
    """The study's runaway: ran_away's (a collapse, or a max logit past RUNAWAY_LOGIT), or a loss not finite."""
    return ran_away(run) or run.nonfinite


def done(run):
    return run is not None and run.finished


def end_val(run):
    """Its final val loss; infinite where missing or not finite (a diverged run ended worst)."""
    return run.final_val if run.final_val is not None and math.isfinite(run.final_val) else math.inf


def same_losses(run, ref):
    """Every logged loss (train and val) the same, bit for bit, at the same steps."""
    logged = lambda r: json.dumps([r.steps, r.loss, r.evals])   # JSON floats round-trip exactly; NaN too
    return logged(run) == logged(ref)


def started(run):
    """When a run started (config.json's "started", seconds since the epoch), or nan."""
    try:
        return time.mktime(time.strptime(run.config["started"].rsplit(" ", 1)[0], "%Y-%m-%d %H:%M:%S"))
    except (AttributeError, KeyError, TypeError, ValueError):
        return math.nan


def commit_of(run):
    return ((run.config.get("versions") or {}).get("git_commit") or "")[:7] or None
