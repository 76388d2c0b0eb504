"""
Read a sweep's runs and say, claim by claim, whether the paper's claims reproduced, and how sure that is.

    python -m lab.report runs/claims                   # tables on the console, PNG plots into runs/claims
    python -m lab.report runs/claims --markdown R.md   # also Markdown: tables, date, hardware, commands, and
                                                       # the plots (into plots/ beside it, or --plots DIR)
    python -m lab.report runs/claims --plots figures/  # the plots elsewhere (they need matplotlib)
    python -m lab.report --runs runs/A runs/B --png fig.png   # loss, max logit, sigma(W_q) of a few runs
    python -m lab.report runs/claims --lr-study runs/lr --markdown R.md   # and the learning-rate study
                                                       # (lab.sweep --lrs): claims 1, 2, 7 as a CPU-scale proxy

Reads every <root>/<experiment>/seed<k>/ that train.py wrote (log.jsonl, config.json; see sweep.py). Arms are
compared seed by seed (sweep.py gives every arm the same seeds). A run that did not finish, or a seed missing from
an arm that another arm of the claim ran, counts against the claim: it is scored the way that hurts the claim; so
does a run whose log or config.json cannot be read (a warning names it). The runs a rule compares must share the
data and every flag but their arms' own (the preset, the learning rate, ...): a mix is refused, not judged.
"""
import argparse
import contextlib
import glob
import json
import math
import os
import re
import shlex
import statistics
import sys
import time

from guard import ACTIONS, DEFAULT_THRESHOLD
from lab import claim1
from lab.stats import (ALPHA, LOSS_TOL, binom_tail, clopper_pearson, equivalence, equivalence_power,  # noqa: F401
                       mean_interval, normal_cdf, paired_t, seeds_for_power, sign_test, slope_interval, t_p,
                       t_quantile)
from lab.sweep import (AA_ARMS, CLAIM3_SITE, CLAIM4_SITES, CLAIMS, COHERENCES, DONE, DOSES, LR_STUDY_ARMS, NO_ERROR,
                       LONG_STEPS, QKNORM_ALONE, SEEDS, SITES, SOURCES, TILE_ARMS, Unreadable, action_arms,
                       actions_of, experiments, inject_arm, long_arms, lr_name, not_a_folder, probe_arms,
                       probe_gain_arm, probe_long_arms, read_log, split_lr)

# --------------------------------------------------------------------------------------------------
# The verdict rules' constants.
FINAL_WINDOW = 5         # final train loss = mean of the last FINAL_WINDOW logged losses
RUNAWAY_LOGIT = 1000.0   # a runaway's max logit, between healthy and runaway peaks (SOURCES.md)
SIGMA_RATIO = 2.0        # "through the QK channel": sigma(W_q or W_k) grew SIGMA_RATIO times as
                         # much as any other weight matrix's, and as the no-error run's
LOGIT_RATIO = 10.0       # "beyond the no-error run": max logit >= LOGIT_RATIO x that run's
LOGIT_GAP = 2.0          # claim 4: one error's max logit "higher" than the other's only by this factor
GUARD_THRESHOLD = DEFAULT_THRESHOLD["max-logit"]     # the guard's default, for a run that gave none
LR_DROP_FACTOR = ACTIONS["lr-drop"].lr_factor        # the lr-drop's default (run.py's flag too; a test checks)
FIX_TOL = 0.1            # nat: a QK-only fix ends at most FIX_TOL above the no-error run's val loss
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
# Reading runs

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
# The rules' words. A predicate reads one finished run; `outcomes` scores an arm seed by seed.

def collapsed(run): return run.collapsed
def triggered(run): return run.trigger is not None
def ran_away(run): return run.collapsed or (run.max_logit or 0.0) >= RUNAWAY_LOGIT


def qk_specific(run):
    """Through the QK channel: sigma(W_q or W_k) grew more than SIGMA_RATIO times as much as the
    most-grown other weight matrix. False where the other kinds were not logged."""
    qk, other = run.qk_and_other_growth()
    return other is not None and not math.isnan(qk) and qk > SIGMA_RATIO * other


class Claim:
    """The runs of one claim, by arm and seed, and the counting the rules share."""

    def __init__(self, groups, arms, refs=()):
        """refs: arms the rule compares with, whose other seeds are not the rule's (see verdicts)."""
        self.runs = {a: {r.seed: r for r in groups.get(a, [])} for a in {*groups, *arms}}
        self.arms = set(arms)
        self.seeds = sorted({s for a in arms if a not in refs for s in self.runs[a]}, key=lambda s: (len(s), s))
        self.alpha = ALPHA      # the strictest threshold the rule's tests used, for "inconclusive"

    def seeds_of(self, *arms):
        """The seeds any of `arms` ran, in numeric order (a seed one of them lacks counts against a claim)."""
        return sorted({s for a in arms for s in self.runs.get(a, {})}, key=lambda s: (len(s), s))

    def outcomes(self, arm, pred, claim_wants, ref=None):
        """Per seed: pred(run), or pred(run, the same seed's run of arm `ref`) if ref is given;
        a run it needs unfinished or missing gives not claim_wants (what the claim hopes for)."""
        out = []
        for seed in self.seeds:
            run, other = self.runs[arm].get(seed), self.runs[ref].get(seed) if ref else None
            ok = run is not None and run.finished and (ref is None or (other is not None and other.finished))
            out.append((pred(run, other) if ref else pred(run)) if ok else not claim_wants)
        return out

    def doses_run(self, site):
        """The doses of the grid at which this rule's arms at this site have runs (a sweep may run
        part of it; another rule's arms at other doses do not count)."""
        arms_at = lambda d: [inject_arm(site, d, c, f)[0] for c in COHERENCES for f in (False, True)]
        return [d for d in DOSES if any(self.runs[a] for a in arms_at(d) if a in self.arms)]

    def lrs_run(self):
        """The learning rates at which this rule's lr-study arms (sweep.lr_name) have runs."""
        return sorted({lr for a in self.arms if self.runs[a] for lr in [split_lr(a)[1]] if lr is not None})

    def val_gaps(self, arm, ref):
        """Per seed where both runs finished with a val loss: arm's final val loss minus ref's."""
        pairs = [(self.runs.get(arm, {}).get(s), self.runs.get(ref, {}).get(s)) for s in self.seeds]
        return [a.final_val - b.final_val for a, b in pairs if a is not None and b is not None
                and a.finished and b.finished and None not in (a.final_val, b.final_val)]

    def unfinished(self, arm):
        return sum(not (self.runs[arm].get(s) and self.runs[arm][s].finished) for s in self.seeds)

    def count(self, arm, name, pred, claim_wants, ref=None):
        """A line: arm, name, k/n with its exact 95% interval; returns (line, outcomes)."""
        out = self.outcomes(arm, pred, claim_wants, ref)
        lo, hi = clopper_pearson(sum(out), len(out))
        left = self.unfinished(arm)
        return (f"{arm}: {name} {sum(out)}/{len(out)} [95% CI {lo:.2f}-{hi:.2f}]"
                + (f" ({left} unfinished, counted against)" if left else "")), out

    def contrast(self, a, a_pred, b, b_pred, name, alpha=ALPHA, ref=None):
        """Does a's event happen where b's does not, seed by seed? The claim wants a's, not b's.
        With ref, the predicates also read the same seed's run of arm ref."""
        la, oa = self.count(a, name, a_pred, True, ref)
        lb, ob = self.count(b, name, b_pred, False, ref)
        k, j, p = sign_test(list(zip(oa, ob)))
        holds = p < alpha
        self.alpha = min(self.alpha, alpha)
        return holds, [la, lb, f"sign test, {a} over {b}: {k} seeds one way, {j} the other, p = {p:.3g}"
                       f"{'' if alpha == ALPHA else f' (threshold {alpha:.3g})'} -> {'holds' if holds else 'fails'}"]


def collapses_vs_not(c, faulty, *repaired):
    holds, lines = True, []
    for arm in repaired:
        ok, more = c.contrast(faulty, collapsed, arm, collapsed, "collapsed")
        holds, lines = holds and ok, lines + more
    return holds, lines


def guard_prevents(c, unguarded, guarded, reference):
    """The guarded arm collapses in no seed, fewer than the unguarded (sign test); in every seed it
    triggers before any unguarded collapse and ends within LOSS_TOL of always-on QK-norm."""
    never = c.outcomes(guarded, collapsed, False)
    ok, lines = c.contrast(unguarded, collapsed, guarded, collapsed, "collapsed")
    leads, early = [], True
    for seed in c.seeds:
        bad, good = c.runs[unguarded].get(seed), c.runs[guarded].get(seed)
        if bad and bad.finished and bad.collapsed:
            lead = None if not (good and good.trigger is not None) else bad.collapse_step - good.acting_from
            leads.append(f"{seed} {lead if lead is not None else 'none'}")
            early = early and lead is not None and lead > 0
    gaps = {}
    for attr in ("final_train", "final_val"):
        diffs = [abs(getattr(c.runs[guarded][s], attr) - getattr(c.runs[reference][s], attr))
                 if all(s in c.runs[a] and c.runs[a][s].finished and getattr(c.runs[a][s], attr) is not None
                        for a in (guarded, reference)) else math.inf for s in c.seeds]
        gaps[attr] = max(diffs) if diffs else math.inf
    holds = not any(never) and ok and early and max(gaps.values()) <= LOSS_TOL
    return holds, lines + [
        f"steps from the guard's action to the unguarded collapse, by seed: {', '.join(leads) or 'no collapse'}",
        f"largest gap to {reference}: train {gaps['final_train']:.3f}, val {gaps['final_val']:.3f} nat "
        f"(tolerance {LOSS_TOL})"]


def guard_is_dormant(c, healthy, guarded):
    """On healthy training the guard fires in no seed, and while dormant changes nothing (final val
    loss within LOSS_TOL of the unguarded healthy run, seed by seed)."""
    line, fired = c.count(guarded, "triggered", triggered, False)
    gaps = []
    for s in c.seeds:
        g, h = c.runs[guarded].get(s), c.runs[healthy].get(s)
        if g and g.finished and g.trigger is not None:
            continue                     # counted above, as a false trigger
        both = all(r and r.finished and r.final_val is not None for r in (g, h))
        gaps.append(abs(g.final_val - h.final_val) if both else math.inf)  # unfinished: inf, fails
    cost = max(gaps) if gaps else math.inf
    return not any(fired) and cost <= LOSS_TOL, [
        line, f"dormant cost, largest |val loss - {healthy}'s| over {len(gaps)} untriggered seeds (an unfinished "
              f"one counts as infinite): {cost:.4f}"]


def dose_contrast(c, site, better, worse, better_pred, worse_pred, name, ref=None):
    """The contrast at each dose of the grid that ran; holds if at some dose p < ALPHA / the number
    of doses run (Bonferroni)."""
    doses = c.doses_run(site)
    holds, lines = False, [f"{site}: doses run {', '.join(f'{d:g}' for d in doses) or 'none'}"]
    for dose in doses:
        a, b = better(site, dose), worse(site, dose)
        ok, more = c.contrast(a, better_pred, b, worse_pred, name, alpha=ALPHA / len(doses), ref=ref)
        holds, lines = holds or ok, lines + more
    return holds, lines


def beyond(run, ref):
    """Ran away beyond ref, its seed's no-error run: max logit >= RUNAWAY_LOGIT and LOGIT_RATIO x
    ref's, or it collapsed where ref did not. A bar the no-error run passes too proves nothing."""
    logits = (run.max_logit or 0.0) >= max(RUNAWAY_LOGIT, LOGIT_RATIO * (ref.max_logit or 0.0))
    return logits or (run.collapsed and not ref.collapsed)


def through_qk(run, ref):
    """Ran away beyond ref through the QK channel: sigma(W_q or W_k) grew SIGMA_RATIO times as much as ref's
    did. Whether other matrices grew too is reported, not asked (qk_specific): an error that reaches every
    weight may grow them all, and the QK-only fix, not the others' growth, is the test of the channel."""
    qk, ref_qk = run.qk_and_other_growth()[0], ref.qk_and_other_growth()[0]
    return beyond(run, ref) and not (math.isnan(qk) or math.isnan(ref_qk)) and qk >= SIGMA_RATIO * ref_qk


def fix_failed(fix, error):
    """A QK-only fix failed against its error's run of the same seed: it ran away or ended without a finite
    val loss, or did not remove the error's runaway (where the error's logits ran away, its max logit is
    not LOGIT_RATIO below them), or it ended more than FIX_TOL above the error run's val loss, or above its own
    val loss at init (it did not train). Judged against the error in every seed, a collapsed one too: what the
    error harms through other channels no QK-side fix can mend, and a fix that ends nats below its error's
    collapse is evidence for it; the floor at init keeps a fix that never trained from passing beside a
    collapse."""
    runaway = (error.max_logit or 0.0) >= RUNAWAY_LOGIT   # a collapse alone: the fix must not collapse
    kept = runaway and (fix.max_logit or 0.0) * LOGIT_RATIO > error.max_logit
    untrained = fix.init_val is not None and end_val(fix) >= fix.init_val
    return ran_away(fix) or kept or untrained or not math.isfinite(end_val(fix)) or \
        end_val(fix) > end_val(error) + FIX_TOL


def median_range(values, spec="+.3f"):
    return f"median {statistics.median(values):{spec}} ({min(values):{spec}} to {max(values):{spec}})" if values \
        else "n/a"


def injection_claim(c, site):
    """Claim 3 at one site: at some dose, seed by seed, the coherent error runs away through QK beyond the
    no-error run where its QK-only fix does not fail against it (sign test at ALPHA / the doses run).
    Reported beside: each fix's val loss against its error and against no-error, and QK-norm's own cost
    (fp32 with QK-norm always, against fp32)."""
    doses, holds, lines = c.doses_run(site), False, []
    alpha = ALPHA / max(1, len(doses))
    lines.append(f"{site}: doses run {', '.join(f'{d:g}' for d in doses)}")
    for dose in doses:
        error, fix = inject_arm(site, dose, 1.0)[0], inject_arm(site, dose, 1.0, True)[0]
        la, oa = c.count(error, "ran away through QK beyond no-error", through_qk, True, ref=NO_ERROR)
        lb, ob = c.count(fix, "failed against the error (kept its runaway, or FIX_TOL worse)", fix_failed, False,
                         ref=error)
        # a seed where the error ran away and its fix failed counts against the claim (not a tie)
        k, j, p = sign_test([(a and not b, b) for a, b in zip(oa, ob)])
        holds, c.alpha = holds or p < alpha, min(c.alpha, alpha)
        errors = [r for r in c.runs[error].values() if done(r) and r.seed in c.seeds]
        specific = sum(qk_specific(r) for r in errors)
        lines += [f"{site} {dose:g}: {la}", f"{site} {dose:g}: {lb}",
                  f"sign test, {error} over {fix}: {k} seeds one way, {j} the other, p = {p:.3g} (threshold "
                  f"{alpha:.3g}) -> {'holds' if p < alpha else 'fails'}",
                  f"{site} {dose:g}: the error's sigma(W_q or W_k) grew SIGMA_RATIO times more than every other "
                  f"matrix in {specific}/{len(errors)} finished seeds (reported: the QK channel alone)",
                  f"{site} {dose:g}: fix's val loss - the error's, {median_range(c.val_gaps(fix, error))}; "
                  f"- no-error's, {median_range(c.val_gaps(fix, NO_ERROR))} (FIX_TOL {FIX_TOL})"]
    if SITES[site] == "qknorm":
        lines.append(f"QK-norm's own cost, {QKNORM_ALONE} val loss - {NO_ERROR}'s: "
                     f"{median_range(c.val_gaps(QKNORM_ALONE, NO_ERROR))}")
    return holds, lines


def logit_ratio(run, ref):
    """A run's max logit over its seed's no-error run's; inf where it collapsed or its loss diverged (the
    worst runaway ranks above any logit it logged before)."""
    if run.collapsed or run.nonfinite:
        return math.inf
    return (run.max_logit or 0.0) / max(ref.max_logit or 0.0, 1e-30)


def runaway_rank(run, ref):
    """Claim 4's scale, on which a seed's two runs are compared: a collapse or diverged loss ranks above any
    finite logit ratio, and an earlier one above a later one: (1, -its step) or (0, logit_ratio)."""
    if run.collapsed or run.nonfinite:
        return 1, -(run.runaway_from() or 0)
    return 0, logit_ratio(run, ref)


def qk_growth_ratio(run, ref):
    """A run's sigma(W_q or W_k) growth over its seed's no-error run's."""
    return run.qk_and_other_growth()[0] / ref.qk_and_other_growth()[0]


def higher(a, b):
    """a's runaway above b's by claim 4's scale (runaway_rank): a collapse above a finite logit ratio, an earlier
    collapse above a later one, a ratio above another by LOGIT_GAP. Plain ratios: inf above any finite one."""
    if isinstance(a, tuple):
        if a[0] != b[0]:
            return a[0] > b[0]
        if a[0] == 1:
            return a[1] > b[1]   # both collapsed: the earlier one (its step negated)
        a, b = a[1], b[1]
    return a > b if math.isinf(a) or math.isinf(b) else a >= LOGIT_GAP * b and a > b


def coherence_claim(c):
    """Claim 4 on a scale, at every site and dose run: seed by seed, the coherent error's max logit over
    the paired no-error run's against the random-sign error's (coherence 0.5); one is higher where it is
    LOGIT_GAP times the other (a collapse ranks above any logit). Coherence "raises" the runaway at a dose
    if the coherent one is higher by a sign test at ALPHA / the doses run at the site, a seed with a run
    unfinished or missing counted against it; it "reverses" it if the random-sign one is higher by a
    sign test at ALPHA / the cells run at all sites (any reversal refutes), counted on finished seeds
    only (missing data cannot refute). Holds where it raises at some dose of every site and reverses at
    none. The sigma(W_q, W_k) growth against no-error is reported by the same counts."""
    doses = {site: c.doses_run(site) for site in CLAIM4_SITES}
    cells = sum(len(d) for d in doses.values())
    alpha_reverse = ALPHA / max(1, cells)
    raised, reversed_at, lines = {}, [], []
    for site in CLAIM4_SITES:
        alpha = ALPHA / max(1, len(doses[site]))
        c.alpha = min(c.alpha, alpha, alpha_reverse)
        raised[site] = []
        if not doses[site]:
            lines.append(f"{site}: not run (counted against the claim, which needs a raise at every site)")
            continue
        lines.append(f"{site}: doses run {', '.join(f'{d:g}' for d in doses[site])} (thresholds: raises ALPHA / "
                     f"{len(doses[site])}, reverses ALPHA / {cells}, the cells run at all sites)")
        for dose in doses[site]:
            coherent, random = inject_arm(site, dose, 1.0)[0], inject_arm(site, dose, 0.5)[0]
            runs = [(c.runs[coherent].get(s), c.runs[random].get(s), c.runs[NO_ERROR].get(s)) for s in c.seeds]
            both = [(a, b, r) for a, b, r in runs if done(a) and done(b) and done(r)]
            logits = [(runaway_rank(a, r), runaway_rank(b, r)) for a, b, r in both]
            collapsed_at = lambda runs: ", ".join(f"{x.seed} {x.runaway_from()}" for x in runs if x.collapsed or x.nonfinite)
            growth = [(qk_growth_ratio(a, r), qk_growth_ratio(b, r)) for a, b, r in both]
            up, down, missing = sum(higher(x, y) for x, y in logits), sum(higher(y, x) for x, y in logits), \
                len(runs) - len(both)
            p_up, p_down = binom_tail(up, up + down + missing), binom_tail(down, up + down)
            verdict = "raises" if p_up < alpha else "reverses" if p_down < alpha_reverse else "no measurable effect"
            if verdict == "raises":
                raised[site].append(dose)
            elif verdict == "reverses":
                reversed_at.append(f"{site} {dose:g}")
            g_up, g_down = sum(x > y for x, y in growth), sum(y > x for x, y in growth)
            past = [(b, r) for _, b, r in both if (b.max_logit or 0.0) >= RUNAWAY_LOGIT]
            if past:   # whether a random-sign runaway's logit measures the QK channel at all
                lines.append(f"{site} {dose:g}: random sign past RUNAWAY_LOGIT in {len(past)} seeds; there sigma(W_q, "
                             f"W_k) grew {num(median([qk_growth_ratio(b, r) for b, r in past]), '.3g')}x the "
                             f"no-error run's growth, the most-grown other matrix "
                             f"{num(median([b.qk_and_other_growth()[1] for b, _ in past]), '.3g')}x (medians)")
            lines.append(
                f"{site} {dose:g}: max logit / no-error's, median coherent "
                f"{num(median([logit_ratio(a, r) for a, _, r in both]), '.3g')} vs random sign "
                f"{num(median([logit_ratio(b, r) for _, b, r in both]), '.3g')} (collapsed, seed and step: coherent "
                f"{collapsed_at(a for a, _, _ in both) or 'none'}; random sign {collapsed_at(b for _, b, _ in both) or 'none'}); "
                f"coherent {LOGIT_GAP:g}x higher or earlier collapsed in "
                f"{up} seeds, random sign in {down} ({missing} unfinished or missing, counted against raising); "
                f"p = {p_up:.3g} (raises), {p_down:.3g} (reverses) -> {verdict}; sigma(W_q, W_k) growth / "
                f"no-error's higher for coherent in {g_up}, random sign in {g_down}")
    if reversed_at:
        lines.append(f"refuted: random-sign errors run away further than coherent ones at {', '.join(reversed_at)}")
        return "refuted", lines
    holds = all(raised.values())
    lines.append("coherence raises the runaway at " + "; ".join(
        f"{site} {', '.join(f'{d:g}' for d in ds) or 'no dose'}" for site, ds in raised.items()))
    return holds, lines


# Claim 5's judged controls (each must still run away where the probe does not) and reported ones.
PROBE_CONTROLS = {"shrink": "the whole update shrunk to the probe's norm: step size alone",
                  "nextk": "singular directions k+1..2k", "fixed": "a fixed random rank-k subspace"}
REPORTED_CONTROLS = ("equal", "v-topk", "mlp-topk")


def shrink_held(run, need):
    """A shrink control's run that did not run away, over a horizon that can tell: it never passed the guard's
    threshold, or ran at least `need` steps (the source's slowest runaway, threshold to RUNAWAY_LOGIT) divided
    by its own step factor (the update norm it left, median) after it first did. "held", "too short",
    "ran away" or "unfinished"."""
    if not done(run):
        return "unfinished"
    if ran_away(run):
        return "ran away"
    crossed, left = run.first_past(run.guard_threshold()), run.probe_shares()[1]
    if crossed is None:
        return "held"
    if need is None or not left:
        return "too short"
    return "held" if run.horizon() - crossed >= need / left else "too short"


def long_probe_lines(c, source, need):
    """Claim 5 at LONG_STEPS: the shrink runs away where top-k does not (sign test at ALPHA over the long
    arms' seeds, a run unfinished or missing counted against); the shrink's holds, judged by shrink_held;
    the source against held shrinks (the step-size statement). Returns (holds, step size alone stopped it,
    lines)."""
    topk, shrink = probe_long_arms(source)
    seeds = c.seeds_of(topk, shrink)
    runs = lambda arm: [c.runs.get(arm, {}).get(s) for s in seeds]
    pairs = [(done(b) and ran_away(b), not done(a) or ran_away(a)) for a, b in zip(runs(topk), runs(shrink))]
    k, j, p = sign_test(pairs)
    holds = p < ALPHA
    states = [shrink_held(r, need) for r in runs(shrink)]
    count = lambda arm, pred: sum(done(r) and pred(r) for r in runs(arm))
    lines = [f"at {LONG_STEPS} steps, seeds {seeds[0]} to {seeds[-1]}: {topk} ran away in "
             f"{count(topk, ran_away)}/{len(seeds)}, {shrink} in {count(shrink, ran_away)}/{len(seeds)}",
             f"sign test, {shrink} over {topk}: {k} seeds one way, {j} the other, p = {p:.3g} -> "
             f"{'holds' if holds else 'fails'}",
             f"{shrink}, by seed (needing {num(need)} steps / its update norm left after its first logit past the "
             f"threshold): " + ", ".join(f"{s} {state}" for s, state in zip(seeds, states))]
    for arm in (topk, shrink):
        finished = [r for r in runs(arm) if done(r)]
        first = [r.first_past(RUNAWAY_LOGIT, inclusive=True) for r in finished]
        rising = [r.logit_rise(r.steps[-1] if r.steps else 0, RISE_WINDOW)[1] for r in finished]
        lines.append(f"{arm}: max logit median {num(median([r.max_logit for r in finished]), '.4g')}, past the "
                     f"threshold in {sum(r.first_past(r.guard_threshold()) is not None for r in finished)}/"
                     f"{len(finished)}, first at RUNAWAY_LOGIT at steps {', '.join(str(f) for f in first if f) or 'none'}"
                     f", still rising over its last {RISE_WINDOW} steps in {sum(rising)}/{len(finished)}")
    delayed = count(topk, ran_away)
    by_loss = count(topk, lambda r: ran_away(r) and (r.max_logit or 0.0) < RUNAWAY_LOGIT)
    if 2 * delayed > len(seeds):   # what the long probe itself showed, whatever the shrink did
        lines.append(f"not reproduced at this scale: the top-k probe itself ran away by {LONG_STEPS} steps in {delayed} "
                     f"of {len(seeds)} seeds (it delays the runaway; it does not stop it)"
                     + (f"; in {by_loss} of them by a collapse, its max logit under RUNAWAY_LOGIT" if by_loss else ""))
    onset = lambda r: r.runaway_from() if ran_away(r) else math.inf   # no runaway: later than any
    both = [(a, b) for a, b in zip(runs(topk), runs(shrink)) if done(a) and done(b)]
    later, earlier, p_late = sign_test([(onset(a) > onset(b), onset(a) < onset(b)) for a, b in both])
    gaps = [onset(a) - onset(b) for a, b in both if ran_away(a) and ran_away(b)]
    lines.append(f"{topk}'s runaway began later than {shrink}'s in {later} of {len(both)} seeds (one that never ran "
                 f"away counted as later), earlier in {earlier} (sign test p = {p_late:.3g}), by a median "
                 f"{num(median(gaps))} steps over the {len(gaps)} seeds where both ran away (its first logged step past "
                 f"RUNAWAY_LOGIT, or its collapse; reported, not judged: looked at after the runs)")
    source_pairs = [(ran_away(c.runs[source][s]), state != "held") for s, state in zip(seeds, states)
                    if done(c.runs[source].get(s))]
    stopped, _, p_step = sign_test(source_pairs)
    return holds, (stopped, p_step), lines + [
        f"{source} ran away where {shrink} held (over a horizon that can tell) in {stopped} of the "
        f"{len(source_pairs)} seeds both ran, p = {p_step:.3g}"]


def paper_measure_line(c, source, arms):
    """Claim 5's probe by the paper's measure, beside the lab's: each arm's final sigma(W_q) (max over layers,
    at its last logged step) and its max logit, medians with their ranges."""
    cells = []
    for arm in arms:
        runs = [r for r in c.runs.get(arm, {}).values() if done(r) and r.sigma]
        if runs:
            final = [r.sigma[-1] for r in runs]
            cells.append(f"{arm} sigma(W_q) {num(median(final), '.3g')} ({num(min(final), '.3g')}-"
                         f"{num(max(final), '.3g')}), max logit "
                         f"{num(median([r.max_logit for r in runs]), '.3g')}")
    return [("by the paper's measure, the final sigma(W_q) (max over layers), median (range), beside the "
             "lab's, the "
             "max logit over the run, median: " + "; ".join(cells))] if cells else []


def head_series(run, gain=True):
    """A run's logged steps as (step, max logit per (layer, head), sigma(W_q,h) sigma(W_k,h), the same with
    the pre-attention gain, attn_gain_rms per layer); [] where the log holds no gain (train.py before
    2026-12-05). gain=False: any log with per-head sigmas, the gained product taken as the plain one (so the
    gain's part is 0 and the rest holds the gain and the inputs' alignment together)."""
    out, key = [], "sigma_q_gain_head" if gain else "sigma_q_head"
    for r in read_log(run.path):
        if "event" not in r and key in r and "max_logit" in r:
            prod = lambda q, k: [[a * b for a, b in zip(rq, rk)] for rq, rk in zip(r[q], r[k])]
            plain = prod("sigma_q_head", "sigma_k_head")
            out.append((r["step"], r["max_logit"], plain,
                        prod("sigma_q_gain_head", "sigma_k_gain_head") if gain else plain,
                        r.get("attn_gain_rms")))
    return out


def sigma_share_line(c, arms):
    """From logs without the gain: each arm's runaways (first logged step to the first past RUNAWAY_LOGIT, or
    the collapse), the share of the max logit's log growth that the sigma product of the head holding it
    explains; the rest is the gain and the inputs' alignment together (reported, not judged)."""
    cells = []
    for arm in arms:
        shares = []
        for run in c.runs.get(arm, {}).values():
            stop = run.runaway_from() if done(run) and ran_away(run) else None
            series = head_series(run, gain=False) if stop is not None else []
            end = next((i for i, rec in enumerate(series) if rec[0] >= stop), None)
            if end:
                logit, sigma, _, _, _ = escape_split(series, 0, end)
                if logit > 0:
                    shares.append(sigma / logit)
        if shares:
            cells.append(f"{arm} {num(median(shares), '.2f')} ({num(min(shares), '.2f')} to "
                         f"{num(max(shares), '.2f')}, {len(shares)} runaways)")
    return [("the share of the max logit's log growth, to its runaway, that the sigma product of its head "
             "explains, median (range), from logs without the gain (the rest is the gain and the inputs' "
             "alignment together; reported, looked at after the runs): " + "; ".join(cells))] if cells else []


def escape_split(series, start, end):
    """The max logit's growth from record `start` to record `end`, in logs, for the (layer, head) holding the
    max logit at `end`: (logit, the sigma product's part, the gain's part, the rest, (layer, gain rms at start
    and end)); the three parts add up to the logit's."""
    _, logits, prods, gained, rms = series[end]
    cells = [(i, j) for i, row in enumerate(logits) for j in range(len(row))]
    layer, head = max(cells, key=lambda ij: logits[ij[0]][ij[1]])
    at = lambda k, i: series[k][i][layer][head]
    logit = math.log(at(end, 1) / at(start, 1))
    sigma = math.log(at(end, 2) / at(start, 2))
    gain = math.log(at(end, 3) / at(end, 2)) - math.log(at(start, 3) / at(start, 2))
    rms_at = lambda k: series[k][4][layer] if series[k][4] else math.nan
    return logit, sigma, gain, logit - sigma - gain, (layer, rms_at(start), rms_at(end))


def escape_lines(c, source):
    """Claim 5's escape route (rule 5's words, decided before its runs): on the top-k probe rerun with its
    gain logged (-long-gain), the max logit's growth from its first logged step to its first past
    RUNAWAY_LOGIT (or its collapse) split into the sigma product, the gain's part and the rest (escape_split);
    the logit escapes through the gain if the gain's part grew more than the sigma product, by a sign test
    over the seeds that ran away. Also: whether each rerun logged its -long run's losses bit for bit, and the
    split over the climb from the guard's threshold alone. Reported, not judged."""
    gain_arm, long_arm = probe_gain_arm(source), probe_long_arms(source)[f"{source}-probe-topk-long"]
    gain_arm = next(iter(gain_arm))
    runs = {s: r for s, r in c.runs.get(gain_arm, {}).items() if done(r)}
    if not runs:
        return []
    same = sum(same_losses(r, c.runs.get(f"{source}-probe-topk-long", {}).get(s))
               for s, r in runs.items() if c.runs.get(f"{source}-probe-topk-long", {}).get(s))
    splits, climbs, cells, held = [], [], [], []
    for seed, run in sorted(runs.items(), key=lambda kv: (len(kv[0]), kv[0])):
        series = head_series(run)
        if not series:
            continue
        stop = run.runaway_from() if ran_away(run) else None
        end = next((i for i, rec in enumerate(series) if stop is not None and rec[0] >= stop), None)
        if end is None:
            held.append(seed)
            continue
        split = escape_split(series, 0, end)
        splits.append(split)
        over = lambda rec: max(map(max, rec[1])) > run.guard_threshold()
        past = next((i for i, rec in enumerate(series[:end]) if over(rec)), None)
        if past is not None and past < end:
            climbs.append(escape_split(series, past, end))
        x = lambda v: f"x{math.exp(v):.3g}"
        layer, g0, g1 = split[4]
        cells.append(f"{seed} logit {x(split[0])} = sigma product {x(split[1])}, gain {x(split[2])}, "
                     f"rest {x(split[3])} (layer {layer}, gain rms {g0:.2f} -> {g1:.2f}, to step "
                     f"{series[end][0]})")
    more, less, p = sign_test([(g > sg, g < sg) for _, sg, g, _, _ in splits])
    share = lambda rows, i: num(median([r[i] / r[0] for r in rows if r[0] > 0]), ".2f") if rows else "n/a"
    shares = lambda rows: f"sigma product {share(rows, 1)}, gain {share(rows, 2)}, rest {share(rows, 3)}"
    verdict = "the logit escapes through the gain" if p < ALPHA else "no escape through the gain shown"
    long_arm = f"{source}-probe-topk-long"
    lines = [f"{gain_arm} (the top-k probe again, the pre-attention gain logged): {len(runs)} seeds "
             f"finished, their logged losses bit for bit {long_arm}'s in {same}/{len(runs)}; ran away in "
             f"{len(splits)}"
             + (f", held in {len(held)} ({', '.join(held)})" if held else ""),
             f"{gain_arm}: the max logit's growth to its runaway split, in logs, by seed: "
             + ("; ".join(cells) or "none"),
             f"{gain_arm}: the gain's part grew more than the sigma product's in {more} of {len(splits)} "
             f"seeds that ran away, less in {less}: sign test p = {p:.3g} -> {verdict}; median share of the "
             f"logit's log growth: {shares(splits)}; over the climb from the guard's threshold alone "
             f"({len(climbs)} seeds): {shares(climbs)} (reported, not judged)"]
    return lines


def probe_holds(c, source):
    """Claim 5 on the runaway of `source`: the source runs away where the probe (W_q, W_k's update off
    their top-k singular directions) does not, and so does each of three controls that can be carried out
    at every step: the same shrink of the whole update, the next k directions, a fixed random subspace
    (sign tests at ALPHA; all must hold). Where the -long arms ran (LONG_STEPS), the shrink is judged there
    instead (long_probe_lines), decided before they ran: a shrink that only slows the step needs the horizon
    of a slowed runaway. If the shrink stops the runaway too, the probe works through step size, and the
    verdict says so. Each arm's removed energy and the norm it left are reported, not used as a filter; the
    equal-energy control (it cannot take its energy where the update has none) and the non-QK top-k are
    reported."""
    topk, long_ran = f"{source}-probe-topk", any(c.runs.get(a) for a in probe_long_arms(source))
    holds, lines = c.contrast(source, ran_away, topk, ran_away, "ran away")
    for name, words in PROBE_CONTROLS.items():
        ok, (control_line, _, test_line) = c.contrast(f"{source}-probe-{name}", ran_away, topk, ran_away, "ran away")
        judged = not (long_ran and name == "shrink")
        holds = holds and (ok or not judged)
        lines += [f"{control_line} ({words})", test_line + ("" if judged else
                                                            f" (at {LONG_STEPS} steps below: reported, not judged)")]
    if long_ran:
        threshold = next((r.guard_threshold() for r in c.runs[source].values()), GUARD_THRESHOLD)
        need = max((v for s, r in c.runs[source].items() if done(r) for v in [runaway_span(r, threshold)]
                    if v is not None), default=None)
        ok, (stopped, p), more = long_probe_lines(c, source, need)
        holds, lines = holds and ok, lines + more
    else:
        pairs = [(c.runs[source].get(s), c.runs.get(f"{source}-probe-shrink", {}).get(s)) for s in c.seeds]
        stopped, _, p = sign_test([(ran_away(a), ran_away(b)) for a, b in pairs if done(a) and done(b)])
    if p < ALPHA:
        lines.append(f"the shrink alone stopped the runaway ({stopped} seeds, p = {p:.3g}): the probe works through "
                     f"step size, not through the top directions")
    for name in REPORTED_CONTROLS:
        if c.runs.get(f"{source}-probe-{name}"):
            lines.append(c.count(f"{source}-probe-{name}", "ran away", ran_away, True)[0]
                         + " (a control, reported, not judged)")
    for arm in (topk, *(f"{source}-probe-{n}" for n in (*PROBE_CONTROLS, *REPORTED_CONTROLS)),
                *(probe_long_arms(source) if long_ran else ())):
        shares = [r.probe_shares() for r in c.runs.get(arm, {}).values()]
        removed, left = [r for r, _ in shares if r is not None], [k for _, k in shares if k is not None]
        if removed:
            lines.append(f"{arm}: share of the W_q, W_k update energy removed, median over seeds "
                         f"{statistics.median(removed):.3f}; update norm left, "
                         f"{num(median(left), '.3f') if left else 'not logged'}")
    costs = [f"{arm} {num(median(c.val_gaps(arm, NO_ERROR)), '+.3f') if c.val_gaps(arm, NO_ERROR) else 'n/a'}"
             for arm in (topk, *(f"{source}-probe-{n}" for n in PROBE_CONTROLS)) if c.runs.get(arm)]
    lines += paper_measure_line(c, source, (source, topk, *(f"{source}-probe-{n}" for n in PROBE_CONTROLS),
                                            *(probe_long_arms(source) if long_ran else ())))
    lines += sigma_share_line(c, (source, *(probe_long_arms(source) if long_ran else ())))
    return holds, lines + [f"loss cost, median final val loss - {NO_ERROR}'s: " + ", ".join(costs)] + \
        escape_lines(c, source)


def broke_down(run):
    """Collapsed, or logits reached RUNAWAY_LOGIT after the guard's action started (anywhere, if it
    never fired). A softcap caps the logits it reports at its c: for it only a collapse counts."""
    start = run.acting_from if run.acting_from is not None else -1
    return run.collapsed or run.logit_after(start - 1) >= RUNAWAY_LOGIT


def runaway_span(run, threshold):
    """Logged steps the run took from its first max logit past the guard's threshold to its first at
    RUNAWAY_LOGIT (or its collapse); None if it did not run away."""
    if not ran_away(run):
        return None
    end = run.first_past(RUNAWAY_LOGIT, inclusive=True)
    end = run.collapse_step if end is None else end if run.collapse_step is None else min(end, run.collapse_step)
    start = run.first_past(threshold)
    return 0 if start is None or end is None else max(0, end - start)


def qk_growth_failed(run, qknorm):
    """After the trigger (the QK-norm run's, where the action's is missing), the most-grown head's
    sigma(W_q,h) sigma(W_k,h) grew SIGMA_RATIO times as much as under QK-norm, the same seed, and at least
    SIGMA_RATIO times (a QK-norm run whose heads shrank does not make a flat one a runaway)."""
    trigger = run.trigger if run.trigger is not None else qknorm.trigger
    if trigger is None:
        return False
    growth, ref = run.qk_growth_after(trigger), qknorm.qk_growth_after(trigger)
    return not (math.isnan(growth) or math.isnan(ref)) and growth >= SIGMA_RATIO * max(ref, 1.0)


def action_failed(run, qknorm):
    """A non-QK action failed: it broke down, or let the QK channel grow SIGMA_RATIO times as much as
    QK-norm did after the same trigger (a capped or slowed logit with W_q, W_k still running away)."""
    return broke_down(run) or qk_growth_failed(run, qknorm)


def qk_side_failed(run, qknorm):
    """A QK-side action failed: it broke down, or ended more than FIX_TOL above QK-norm's final val loss, the
    same seed (a collapsed or unfinished QK-norm run leaves it judged by its breakdown alone). Not QK growth:
    QK-norm takes sigma out of its logits, so its sigma grows freely; an action that leaves sigma in them is
    held to whether training goes on as well as under QK-norm."""
    worse = done(qknorm) and not broke_down(qknorm) and end_val(run) > end_val(qknorm) + FIX_TOL
    return broke_down(run) or worse


QK_SIDE_FAILED = "failed (broke down, or ended FIX_TOL above QK-norm's val loss)"


def action_pace(run):
    """How much an action slows the optimizer's step: the lr-drop's factor (Adam's step is proportional
    to the lr, so a runaway it only slows takes 1 / factor times the steps), else 1."""
    args = run.config.get("args", {})
    if args.get("guard_action", "lr-drop" if "-lr-drop" in run.group else None) != "lr-drop":
        return 1.0
    return args.get("lr_drop_factor") or LR_DROP_FACTOR


def too_short(run, qknorm, need):
    """An action's run that did not fail, yet ran fewer steps after the trigger than the source's slowest
    runaway took (need), stretched by its pace: too short to tell a runaway it delays from one it
    prevents. It counts against claim 6, as an unfinished run does, and not as evidence that it held."""
    trigger = run.trigger if run.trigger is not None else qknorm.trigger
    if need is None or trigger is None or action_failed(run, qknorm):
        return False
    return run.horizon() - trigger < need / action_pace(run)


def judged_actions(c, source):
    """Claim 6's (non-QK action, the QK-norm arm it is judged against): the lr-drop at LONG_STEPS against
    QK-norm at LONG_STEPS where those ran (sweep.long_arms), else both at the usual horizon."""
    qknorm, (long_qknorm, long_lr_drop) = f"{source}-guard", long_arms(source)
    ran = c.runs.get(long_lr_drop) or c.runs.get(long_qknorm)     # either: the other, missing, counts against
    pairs = {a: (f"{source}-guard-{a}", qknorm) for a in actions_of("non-qk")}
    if ran:
        pairs["lr-drop"] = (long_lr_drop, long_qknorm)
    return list(pairs.values())


def judgeable(c, source, qknorm):
    """Claim 6's seeds: where the source ran away, and the guarded runs were set to run at least as many
    steps after the trigger (their --max-steps, not where a collapse stopped one) as the slowest of the
    source's runaways took from the trigger's threshold to RUNAWAY_LOGIT. A seed with a run unfinished or
    missing stays (it counts against the claim); the others are reported, not counted. Returns (seeds,
    need: those steps, or None if no runaway; lines)."""
    runs = c.runs[qknorm]
    threshold = next((r.guard_threshold() for r in runs.values()), GUARD_THRESHOLD)
    spans = {s: runaway_span(r, threshold) for s, r in c.runs[source].items() if done(r) and s in c.seeds}
    need = max((v for v in spans.values() if v is not None), default=None)
    seeds, out = [], []
    for s in c.seeds:
        src, guarded = c.runs[source].get(s), runs.get(s)
        if done(src) and spans.get(s) is None:
            out.append(f"{s} (the source did not run away)")
        elif done(src) and done(guarded) and guarded.trigger is not None and need is not None and \
                guarded.horizon() - guarded.trigger < need:
            out.append(f"{s} ({guarded.horizon() - guarded.trigger} steps after the trigger at "
                       f"{guarded.trigger})")
        else:
            seeds.append(s)
    spans_text = ", ".join(f"{s} {num(v)}" for s, v in spans.items() if v is not None) or "none ran away"
    return seeds, need, [f"{source}: steps from the threshold {threshold:g} to RUNAWAY_LOGIT, by seed: {spans_text}; "
                   f"a judged seed needs {num(need)} steps after its trigger",
                   f"seeds judged: {len(seeds)} of {len(c.seeds)}" + (f"; reported, not counted: {', '.join(out)}"
                                                                      if out else "")]


def grace_line(c, arm):
    """Per seed, the guarded run's worst smoothed loss in the grace window above its best before the
    trigger: shown, as a grace window hides a real collapse as well as the switch's transient."""
    margin = lambda r: r.config.get("args", {}).get("collapse_margin", 1.0)
    cells = [f"{s} {num(c.runs[arm][s].grace_excess, '+.3f')}" + (" (past the margin: would have counted)" if
             (c.runs[arm][s].grace_excess or 0) > margin(c.runs[arm][s]) else "")
             for s in c.seeds if s in c.runs[arm] and c.runs[arm][s].grace_excess is not None]
    return f"{arm}: worst smoothed loss in the grace window above the pre-trigger best, by seed: " + \
        (", ".join(cells) or "the guard acted in no seed")


def non_qk_actions_fail(c, source):
    """Claim 6 on the runaway of `source`, on the seeds where it can be judged (judgeable): each non-QK
    action at QK-Guard's trigger fails (action_failed: breaks down, or lets the QK channel grow SIGMA_RATIO
    times as much as QK-norm) where QK-norm, the guard's own action, breaks down in no more seeds (sign
    tests at ALPHA); QK-Clip, also QK-side, breaks down in no seed. The val-loss gap to QK-norm is
    reported. "inconclusive" where it fails only by actions that held over too few steps (too_short): had
    they failed, it would hold."""
    qknorm, (long_qknorm, long_lr_drop) = f"{source}-guard", long_arms(source)
    c.seeds, need, lines = judgeable(c, source, qknorm)
    holds, shown, halves = bool(c.seeds), set(), []
    holds_if_short_failed = holds
    for arm, ref in judged_actions(c, source):
        # a seed whose source is unfinished stays judged and counts against: its action did not fail
        la, oa = c.count(arm, "failed (broke down, or QK grew SIGMA_RATIO x QK-norm's)",
                         lambda run, other: action_failed(run, other) and done(c.runs[source].get(run.seed)), True,
                         ref=ref)
        lb, ob = c.count(ref, "broke down", broke_down, False)
        k, j, p = sign_test(list(zip(oa, ob)))
        holds = holds and p < ALPHA
        lines += [la] + ([lb] if ref not in shown else [])
        shown.add(ref)
        pairs = [(c.runs[arm].get(s), c.runs[ref].get(s)) for s in c.seeds]
        is_short = [done(r) and done(q) and too_short(r, q, need) for r, q in pairs]
        holds_if_short_failed = holds_if_short_failed and sign_test(
            [(a or short, b) for a, short, b in zip(oa, is_short, ob)])[2] < ALPHA
        if any(is_short):
            pace = action_pace(next(r for (r, _), short in zip(pairs, is_short) if short))
            lines.append(f"{arm}: held in {sum(is_short)} of {len(c.seeds)} seeds with fewer than {num(need / pace)} "
                         f"steps after the trigger (the slowest runaway's {num(need)} at its {pace:g}x step): too "
                         f"short to tell a delayed runaway from a prevented one"
                         + (f" (its long-horizon arm {long_lr_drop} was not run)" if arm != long_lr_drop and pace < 1
                            else ""))
        lines.append(f"sign test, {arm} over {ref}: {k} seeds one way, {j} the other, p = {p:.3g} -> "
                     f"{'holds' if p < ALPHA else 'fails'}")
    if not holds and holds_if_short_failed:
        holds = "inconclusive"
        lines.append("it fails only by actions that held over too few steps to tell (had they failed, it "
                     "would "
                     "hold)")
    halves.append(part("the non-QK actions fail", (holds, lines)))
    qk_broke, lines = False, []
    for action in actions_of("qk"):   # judged by breakdown and loss: see qk_side_failed
        line, out = c.count(f"{source}-guard-{action}", QK_SIDE_FAILED, qk_side_failed, False, ref=qknorm)
        grown = c.count(f"{source}-guard-{action}", "QK grew SIGMA_RATIO x QK-norm's (reported, not judged)",
                        qk_growth_failed, False, ref=qknorm)[0]
        qk_broke = qk_broke or any(out)
        lines += [line + " (a QK-side action: the claim wants none)", grown]
    halves.append(part("the QK-side actions hold", (not qk_broke, lines)))
    holds, lines = joined(*halves)
    if holds == "inconclusive":
        lines.append("inconclusive: it fails only by actions that held over too few steps to tell (had they "
                     "failed, it would hold)")
    if holds is False and halves[0][0] is True:
        lines.append("not reproduced at this scale: the non-QK actions fail as claimed, but a QK-side action "
                     "failed "
                     "too")
    for arm in (f"{source}-guard-{a}" for a in actions_of("source") if c.runs.get(f"{source}-guard-{a}")):
        lines.append(c.count(arm, "broke down", broke_down, False)[0]
                     + " (the source's own fix, for comparison, not judged)")
    gaps, growths, climbs = [], [], []
    shown = [(f"{source}-guard-{a}", qknorm) for a in actions_of("non-qk") + actions_of("qk")] + [(qknorm, qknorm)]
    if c.runs.get(long_lr_drop) or c.runs.get(long_qknorm):
        shown += [(long_lr_drop, long_qknorm), (long_qknorm, long_qknorm)]
    for arm, ref in shown:
        after = [c.runs[arm][s].logit_rise(c.runs[arm][s].trigger, RISE_WINDOW) for s in c.seeds
                 if s in c.runs.get(arm, {}) and c.runs[arm][s].trigger is not None]
        ratios = [x for x, _ in after if not math.isnan(x)]
        climbs.append(f"{arm} {num(median(ratios), '.3g') if ratios else 'n/a'}, still rising in "
                      f"{sum(r for _, r in after)}/{len(after)}")
        diffs = c.val_gaps(arm, ref)
        if arm != ref:
            gaps.append((f"{arm} {statistics.median(diffs):+.3f}" if diffs else f"{arm} n/a")
                        + (f" (against {ref})" if ref != qknorm else ""))
        grown = [c.runs[arm][s].qk_growth_after(c.runs[arm][s].trigger) for s in c.seeds
                 if s in c.runs.get(arm, {}) and c.runs[arm][s].trigger is not None]
        grown = [g for g in grown if not math.isnan(g)]
        growths.append(f"{arm} {num(median(grown), '.3g') if grown else 'n/a'}")
    healthy = [c.runs[NO_ERROR][s].qk_growth_after(c.runs[qknorm][s].trigger) for s in c.seeds
               if s in c.runs.get(NO_ERROR, {}) and s in c.runs[qknorm] and c.runs[qknorm][s].trigger is not None]
    healthy = [g for g in healthy if not math.isnan(g)]
    growths.append(f"{NO_ERROR} over the same steps (no error, no action) {num(median(healthy), '.3g') if healthy else 'n/a'}")
    triggers = [f"{s} {num(c.runs[qknorm][s].trigger)}" for s in c.seeds if s in c.runs[qknorm]]
    caps = sorted({r.config.get("args", {}).get("softcap_value") for r in c.runs.get(f"{source}-guard-softcap",
                                                                                        {}).values()} - {None})
    if caps and min(caps) <= next((r.guard_threshold() for r in c.runs[qknorm].values()), GUARD_THRESHOLD):
        lines.append(f"the softcap ran at {', '.join(f'{v:g}' for v in caps)}, not above the trigger: it caps the "
                     f"logits by construction, so only its collapses and QK growth can fail it")
    elif caps and min(caps) < RUNAWAY_LOGIT:
        lines.append(f"the softcap ran at {', '.join(f'{v:g}' for v in caps)}, above the trigger but under "
                     f"RUNAWAY_LOGIT: its logits cannot run away, so its collapses and QK growth judge it")
    return holds, lines + [f"val loss - {qknorm}'s, median: " + ", ".join(gaps),
                           "QK growth after the trigger (most-grown head's sigma(W_q,h) sigma(W_k,h), end over "
                           "trigger), median: " + ", ".join(growths),
                           f"max logit of the last {RISE_WINDOW} steps over the trigger's, median, and seeds where "
                           f"it was still rising (above the {RISE_WINDOW} steps before): " + "; ".join(climbs)
                           + " (an action that slows the runaway, as an lr-drop does, may need a longer horizon "
                           "to show whether it delays or prevents it)",
                           f"{qknorm}: trigger step by seed: {', '.join(triggers)}", grace_line(c, qknorm)]


def action_rows(groups, source):
    """Claim 6's actions on one table, by the measures rule 6 judges them on the seeds it judges: failed (a
    non-QK action: broke down, or QK grew SIGMA_RATIO x QK-norm's; a QK-side one: broke down, or ended FIX_TOL
    above QK-norm's val loss), each part apart, the QK growth after the trigger and the val loss against
    QK-norm (the long arms against QK-norm at their horizon)."""
    qknorm, (long_qknorm, long_lr_drop) = f"{source}-guard", long_arms(source)
    arms = [(f"{source}-guard-{a}", qknorm, kind) for kind in ("non-qk", "qk", "source") for a in actions_of(kind)]
    arms += [(long_lr_drop, long_qknorm, "non-qk"), (long_qknorm, long_qknorm, "qk"), (qknorm, qknorm, "qk")]
    arms = [(a, ref, kind) for a, ref, kind in arms if groups.get(a)]
    c = Claim(groups, [source, qknorm], refs=(NO_ERROR, *optional_arms()))
    c.seeds, _, _ = judgeable(c, source, qknorm)
    rows = []
    for arm, ref, kind in arms:
        pairs = [(c.runs[arm].get(s), c.runs[ref].get(s)) for s in c.seeds]
        both = [(r, q) for r, q in pairs if done(r) and done(q)]
        grown = [r.qk_growth_after(r.trigger) for r, _ in both if r.trigger is not None]
        grown = [g for g in grown if not math.isnan(g)]
        gaps = c.val_gaps(arm, ref)
        failed = qk_side_failed if kind == "qk" else action_failed
        rows.append([arm, {"non-qk": "non-QK", "qk": "QK-side", "source": "the source's fix"}[kind],
                     f"{sum(failed(r, q) for r, q in both) + len(pairs) - len(both)}/{len(pairs)}",
                     f"{sum(broke_down(r) for r, _ in both)}/{len(both)}",
                     f"{sum(qk_growth_failed(r, q) for r, q in both)}/{len(both)}",
                     num(median(grown), ".3g") if grown else "-",
                     f"{statistics.median(gaps):+.3f}" if gaps and arm != ref else "-"])
    return rows


def joined(*results):
    """Several checks as one: all must hold; where none fails and one is undecided ("inconclusive"), so is
    the whole."""
    oks = [ok for ok, _ in results]
    ok = False if False in oks else next((o for o in oks if isinstance(o, str)), True)
    return ok, [line for _, lines in results for line in lines]


# RULES: (claim, rule in words, its arms, its check), one a row; the words print with the verdicts.
def _inject_arms(coherences, fixes, sites):
    """The dose-grid arms a rule reads: at each site, those of the doses with any run (all doses
    where none ran, so that "not run" names them)."""
    def arms(groups):
        out = []
        for site in sites:
            by_dose = {d: [inject_arm(site, d, c, f)[0] for c in coherences for f in fixes] for d in DOSES}
            run = [d for d, names in by_dose.items() if any(groups.get(n) for n in names)]
            out += [n for d in (run or DOSES) for n in by_dose[d]]
            if True in fixes and SITES[site] == "qknorm" and QKNORM_ALONE not in out:
                out.append(QKNORM_ALONE)   # QK-norm's own cost, reported beside its fix
        return out + [NO_ERROR]   # the paired no-error runs the predicates compare with
    return arms


SOURCE_WORDS = {"bf16": "the natural fault (bf16 state)", "assay": "an injected coherent error at the backward's "
                "delta", "lr": "the demo's learning-rate runaway"}
RULES = [
    ("1", "bf16 state collapses, fp32 state and bf16-safemax do not: bf16 collapses where fp32 does not, and where "
          "bf16-safemax does not, each by a sign test at p < ALPHA",
     ["bf16", "fp32", "bf16-safemax"], lambda c: collapses_vs_not(c, "bf16", "fp32", "bf16-safemax")),
    ("2", "QK-Guard prevents it: bf16-guard collapses in no seed, fewer than bf16 (sign test), triggers before "
          "each bf16 collapse of the same seed, and ends within LOSS_TOL of bf16-qknorm-always in every seed",
     ["bf16", "bf16-guard", "bf16-qknorm-always"],
     lambda c: joined(guard_prevents(c, "bf16", "bf16-guard", "bf16-qknorm-always"),
                      (True, [grace_line(c, "bf16-guard")]))),
    ("2v", "the guard is valid: on healthy training (fp32 state) it fires in no seed, and while dormant it changes "
           "the final val loss by at most LOSS_TOL",
     ["fp32", "fp32-guard"], lambda c: guard_is_dormant(c, "fp32", "fp32-guard")),
    ("3", f"an error outside attention ({CLAIM3_SITE}, coherence 1, the site fixed before the sweep) runs away "
          f"through the QK channel beyond the no-error run of its seed (max logit >= RUNAWAY_LOGIT and LOGIT_RATIO "
          f"times the no-error run's, sigma(W_q or W_k) growth SIGMA_RATIO times the no-error run's) where the same "
          f"error with QK-norm from step 0 does not fail against it (it keeps the runaway: runs away, or a max logit "
          f"not LOGIT_RATIO below the error run's; or it ends FIX_TOL above the error run's val loss, a collapsed "
          f"one's too, or above its own val loss at init), at some dose of the grid (sign test, p < ALPHA / the "
          f"doses run; a seed where the error ran away and the fix failed counts against). QK-norm's own cost "
          f"({QKNORM_ALONE} against {NO_ERROR}), the fix's loss against no-error and whether QK outgrew every "
          f"other matrix are reported",
     _inject_arms((1.0,), (False, True), [CLAIM3_SITE]), lambda c: injection_claim(c, CLAIM3_SITE)),
    *[(f"3 ({site})", f"the same from a gradient-side site outside attention ({site}), fix QK-norm",
       _inject_arms((1.0,), (False, True), [site]), lambda c, site=site: injection_claim(c, site))
      for site in SITES if site not in (CLAIM3_SITE, "delta")],
    ("3+", "the same at the backward's delta, where the kernel fault lands, its QK-only fix W_q, W_k trained on "
           "the error-free gradient (the site a positive control would use; not one, as the claim is not known to "
           "pass it)",
     _inject_arms((1.0,), (False, True), ["delta"]), lambda c: injection_claim(c, "delta")),
    ("4", f"sign-coherence, not size, on a scale: at {' and '.join(CLAIM4_SITES)} and each dose, seed by seed, the "
          f"coherent error's max logit over its seed's no-error run's against the random-sign error's (coherence "
          f"0.5), one higher where LOGIT_GAP times the other (a collapse above any logit): holds if coherence "
          f"raises it (sign test at ALPHA / the site's doses, unfinished seeds counted against) at some dose of "
          f"each site and reverses it (sign test at ALPHA / all cells, finished seeds only) at none; a reversal "
          f"at any dose refutes the claim. At mlp-out (an activation site) the error is one vector per head, the "
          f"same at every token of a step (its amplitude times the step's signal rms times a fixed direction): "
          f"coherent, it is a constant bias that later layers can learn to cancel; random-sign, a bias whose sign "
          f"flips, noise they cannot learn; so there coherence tests learnability as much as the QK channel. At "
          f"delta the error is in the backward alone, where no layer can learn it: the site with a coherent error "
          f"that is not a learnable constant",
     _inject_arms((1.0, 0.5), (False,), list(CLAIM4_SITES)), coherence_claim),
    ("5", "the causal probe: the source runs away (max logit past RUNAWAY_LOGIT, or a collapse) where the probe "
          "on W_q/W_k's top-k does not, and so does each control that can be carried out at every step: the whole "
          "update shrunk to the probe's norm (if it stops the runaway too, the probe works through step size), the "
          "next k singular directions, a fixed random rank-k subspace (sign tests, p < ALPHA). The probe freezes "
          "W_q's top singular values by construction, so they are not evidence; the energy each removed and the "
          "equal-energy and non-QK controls are reported. Decided on 2026-12-03 as its runs began (3 of "
          "their 32 had started): where the top-k "
          f"probe and the shrink ran at {LONG_STEPS} steps (-long), the shrink is judged there instead: the claim's "
          "core needs the shrink to run away (max logit past RUNAWAY_LOGIT, or a collapse) where top-k does not, by "
          "a sign test at p < ALPHA over those seeds (a run unfinished or missing counted against); a shrink that "
          "did not run away held only if it never passed the guard's threshold, or ran at least the source's "
          "slowest runaway (its steps from the threshold to RUNAWAY_LOGIT) divided by the update norm the shrink "
          "left (its step factor) after it first passed it, else it is too short to judge; the probe \"works "
          "through step size\" only if the source runs away where the shrink held, by a sign test at p < "
          "ALPHA. "
          "Reported beside it, by the paper's measure: each probe arm's final sigma(W_q). Its escape route, "
          "decided "
          "on 2026-12-05 before its runs (reported, not judged): the top-k probe rerun at 2500 steps with "
          "each "
          "layer's pre-attention norm gain g logged (-long-gain, seeds 1 up); from its first logged step to "
          "its "
          "first logged step past RUNAWAY_LOGIT (or its collapse), the growth of the max logit of the head "
          "that "
          "holds it then is split, in logs, into sigma(W_q,h) sigma(W_k,h), the gain's part (sigma(W_q,h "
          "diag g) sigma(W_k,h diag g) over that product) and the rest (how the normalized inputs meet those "
          "directions: a "
          "logit is at most scale n_embd times the gained product). The logit escapes through the gain if "
          "the gain's part grew more than the sigma product in more seeds than not, by a sign test at p < "
          "ALPHA over "
          "the seeds that ran away",
     lambda source: [source, f"{source}-probe-topk", *(f"{source}-probe-{n}" for n in PROBE_CONTROLS), NO_ERROR],
     probe_holds),
    ("6", "non-QK actions fail, judged only on seeds where the source ran away with as many steps after the "
          "trigger as its slowest runaway took from the threshold to RUNAWAY_LOGIT: lr-drop, clip and softcap (its "
          "cap between the trigger and RUNAWAY_LOGIT) at QK-Guard's trigger each fail (break down: a collapse, or "
          "logits past RUNAWAY_LOGIT after they act; or let the most-grown head's sigma(W_q,h) sigma(W_k,h) grow "
          "SIGMA_RATIO times as much after the trigger as under QK-norm) where QK-norm breaks down (sign tests, "
          "p < ALPHA), and QK-Clip, a QK-side action, fails in no seed, judged (from 2026-12-05) by "
          "breakdown and loss: a breakdown, or a final val loss more than FIX_TOL above QK-norm's. QK-norm "
          "takes sigma out of its "
          "logits, so its sigma growth is no healthy bar for an action that leaves sigma in them; the QK "
          "growth "
          "against QK-norm's is reported for every action. The loss gap to QK-norm "
          "is reported, for every action in one table, and the non-QK half's result on its own. "
          "An action that slows the step (the lr-drop, by its factor f) and did not fail needs the slowest runaway's "
          f"steps / f after its trigger, or it counts against the claim as too short (a verdict only such holds decide is "
          f"inconclusive); the lr-drop is judged at "
          f"{LONG_STEPS} steps against QK-norm at {LONG_STEPS} where those arms ran. "
          "Adam rescales a clipped gradient back, so clip acts mostly through the moments",
     lambda source: [source, *(a for a in action_arms(source) if a not in long_arms(source)
                               and a not in [f"{source}-guard-{s}" for s in actions_of("source")])],
     non_qk_actions_fail),
    ("7", "the same on llama: llama-bf16 collapses where llama-fp32 does not, llama-bf16-guard prevents it within "
          "LOSS_TOL of always-on QK-norm, and llama-fp32-guard stays dormant",
     ["llama-bf16", "llama-fp32", "llama-bf16-guard", "llama-bf16-qknorm-always", "llama-fp32-guard"],
     lambda c: joined(collapses_vs_not(c, "llama-bf16", "llama-fp32"),
                      guard_prevents(c, "llama-bf16", "llama-bf16-guard", "llama-bf16-qknorm-always"),
                      guard_is_dormant(c, "llama-fp32", "llama-fp32-guard"))),
]
SOURCE_RULES = ("5", "6")   # judged once per source whose arms ran (bf16 where none did)
OPTIONAL_ARMS = {"5": probe_long_arms,   # claim 5 judges the shrink at LONG_STEPS where those arms ran
                 "6": long_arms}         # claim 6 the lr-drop


REPORTED_ARMS = {"5": probe_gain_arm}   # read where they ran (each alone), reported, never judged


def optional_arms():
    """Every source's optional and reported arms: their seeds are not a rule's seeds (more of them count
    against nothing)."""
    kinds = (*OPTIONAL_ARMS.values(), *REPORTED_ARMS.values())
    return [a for arms in kinds for s in SOURCES for a in arms(s)]
# How claims 3-6's rules changed from their first version, and why (a review found the first versions
# could fail by the lab's own construction); RESULTS.md prints it under the rules.
RULE_CHANGES = {
    "3": "the fix was judged against the no-error run, which charged it with what the error harms through other "
         "channels; now against its own error's run, with QK-norm's own cost measured by an arm of its own. Then "
         "(2026-12-03): where the error collapsed, the fix was still held to QK-norm alone or no-error + FIX_TOL "
         "(at delta dose 10 it ended a median 3.37 nat below its error's run and \"failed\" 8 of 8): now to its "
         "error's run in every seed, with a floor at its own init loss; a seed where the error ran away and the fix "
         "failed was a tie, dropped: now it counts against; and the gate \"QK grew SIGMA_RATIO times more than "
         "every other matrix\" asked that QK be the only channel, not a channel (at delta dose 1 it dropped 4 of "
         "the 6 runaways that the fix stopped): now QK's growth against the no-error run's alone, the other "
         "matrices reported",
    "4": "the smallest dose past a max logit of RUNAWAY_LOGIT on a 10x grid hid reversals below it; now every dose "
         "(half-decades) on a scale, both ways, a reversal refuting the claim",
    "5": "the equal-energy control could not be carried out where an update's energy sits in its top-k, and both "
         "probes shrink the step; now three controls that always can (the same shrink, the next k directions, a "
         "fixed random subspace), the energy each removed reported. Then (2026-12-03) the shrink's 7 holds of 8 at "
         "600 steps read as \"works through step size\", though its logit passed 200 in 4 and was still rising in "
         "7, and claim 6's horizon rule called 3 of the holds too short: now the shrink is judged at "
         f"{LONG_STEPS} steps on 16 seeds, its holds against the horizon a slowed runaway needs",
    "6": "QK-Clip was judged by breakdowns alone (2026-12-03), then by the non-QK actions' measure, "
         "breakdown or QK growth against QK-norm's (2 of 8 failed, by growth alone); a review (2026-12-05, "
         "after the runs) found "
         "that bar unfair to a QK-side action, as QK-norm's sigma grows freely outside its logits: now "
         "breakdown "
         "or a final val loss FIX_TOL above QK-norm's (the verdict was not reproduced under both). Before "
         "that, "
         "seeds where the source never ran away, or that ended before a runaway could show, were counted, and a "
         "capped logit passed as held; now only seeds with a runaway and room after the trigger, QK growth as a "
         "failure too, and the softcap above the trigger; and an lr-drop that held for fewer steps than a runaway "
         "slowed 10x would take was counted as holding: now such a run is too short to judge (a verdict only "
         "such holds decide is inconclusive), and the lr-drop runs 2500 steps beside QK-norm",
}

# The rules changed on 2026-12-03 (verdicts v3) and why, with what the rules before them (commit 8f7ffca) said on
# the logs they had (8 seeds; claim 5's shrink at 600 steps); RESULTS.md prints them under the rules.
V3_CHANGES = {
    "1p": "the sign test sees only seeds more than LOSS_TOL apart, so a small, consistent cost went unseen: the mean "
          "paired gap with its 95% interval is now reported at every lr beside it (the rule is unchanged)",
    "2p": "every one of 8 seeds had to land within LOSS_TOL of always-on QK-norm, which two arms with no true gap "
          "seldom do at this scale, where the guard's paired gaps spread with an sd of 0.02 to 0.09 nat (and the "
          "A/A pair below): now two one-sided tests on the mean paired gap, "
          "on 16 seeds at the runaway lrs, an A/A pair beside it as the noise floor; the same for 7p",
    "3+": "see 3 (the same rule at delta); no longer called a positive control, as the claim is not known to pass it",
    "4": "every collapse scored as infinite tied the seeds where both errors collapsed: now an earlier collapse "
         "ranks above a later one",
}
V2_VERDICTS = {"2p": "not reproduced (8 seeds, every one within 0.03 asked)", "7p": "not reproduced (the same)",
               "3+": "not reproduced (the fix held to no-error + FIX_TOL where its error collapsed; both-failed seeds "
                     "dropped; the QK-only gate)",
               "4": "not reproduced (both-collapsed seeds tied: 4/0 at delta 30, p = 0.0625)",
               "5 (assay)": "not reproduced, \"the probe works through step size\" (the shrink's 600-step holds)",
               "6 (assay)": "reproduced (QK-Clip judged by breakdowns alone)"}

# The changes of 2026-12-05 (issue 55) and what the rules before them (commit b823d3f) said on their logs
V4_CHANGES = {
    "2p": "its A/A pair was the same arm at a 64-key tile, which moves the bf16 state's rounding (the fault "
          "itself) and "
          "whose arms ran three hours and two commits apart: now the same arm at 1 and 2 CPU threads, side "
          "by side, and a gap between them makes a holding verdict inconclusive; lr 0.01, where the guard "
          "stays dormant "
          "for a stretch, runs 32 seeds, and the late switch's cost is reported; the words \"in every seed\" "
          "(the TOST judges the mean) are gone; the same for 7p",
    "5": "the paper's measure (the final sigma(W_q)) and the probe's escape route through the pre-attention "
         "gain "
         "are reported (not judged)",
    "6": "see 6 above: QK-Clip by breakdown and loss; the row says each half",
}
V3_VERDICTS = {"2p": "inconclusive (16 seeds at the runaway lrs; the 64-key pair as its noise floor)",
               "7p": "not reproduced (1p fails on llama)",
               "6 (assay)": "not reproduced (QK-Clip failed 2 of 8 by QK growth against QK-norm's)"}

RISE_WINDOW = 100   # claim 6 reports whether an action's logits were still rising over its last steps

# The first rules' verdicts on the first (300-step) logs, kept so a reader sees what each change moved.
FIRST_VERDICTS = {
    "3": "not reproduced; at mlp-out no dose ran away through QK, and the fix failed against the no-error run in 7 "
         "and 8 of 8 seeds at doses 3 and 30, by what the error harmed outside QK",
    "4": "not reproduced; coherent errors ran away at a smaller dose than random-sign ones at delta (6 of 8, p = "
         "0.016), while at mlp-out neither ran away at any dose, so reversals below the threshold went unseen",
    "5": "not reproduced; the probe stopped the runaway (6 of 8, p = 0.016), but the equal-energy control, which "
         "never ran away either, could not count: it fell short of its energy in every seed (0.13-0.42 of it at "
         "its worst step)",
    "6": "not reproduced; clip failed in 6 of 8 (p = 0.016), the lr-drop and the softcap (at 50, below the "
         "trigger) in none, two seeds counted whose guard fired 93 and 41 steps before the end",
}


def expanded_rules(groups):
    """RULES with claims 5 and 6 once per source that has runs: (row label, claim, arms, check)."""
    out = []
    for claim, _, arms, rule in RULES:
        if claim not in SOURCE_RULES:
            out.append((claim, claim, arms, rule))
            continue
        ran = [s for s in SOURCES if any(groups.get(a) for a in arms(s) if a != NO_ERROR)] or ["bf16"]
        # a source ran if an arm other than no-error did; bf16 stands in if none did ("not run")
        # arms a rule reads where they ran and does without where they did not (claim 6's long horizon)
        # (all of them if any ran: a missing one then counts against the claim as a missing run does)
        optional = lambda s: [*OPTIONAL_ARMS[claim](s)] if claim in OPTIONAL_ARMS and any(
            groups.get(a) for a in OPTIONAL_ARMS[claim](s)) else []
        reported = lambda s: [a for a in REPORTED_ARMS.get(claim, lambda _: [])(s) if groups.get(a)]
        out += [(claim if s == "bf16" else f"{claim} ({s})", claim, arms(s) + optional(s) + reported(s),
                 lambda c, s=s, rule=rule: rule(c, s)) for s in ran]
    return out


def mixed(groups, arms):
    """Why the runs of a rule's arms may not be judged together, or None: they trained on different
    data (config.json's data.content_sha256; runs without it are "unrecorded", alike only to each
    other), or differ in a flag that neither an arm's own definition sets nor is RUN_SPECIFIC (the
    preset, the learning rate). A run without config.json tells nothing; a flag only some runs record
    (older runs lack newer flags) is compared among those."""
    runs = [r for a in dict.fromkeys(arms) for r in groups.get(a, []) if r.config.get("args")]

    def spread(value):   # "value (arms), value (arms)" where the runs' values are not all one, else ""
        seen = {}
        for r in runs:
            v = value(r)
            if v is not None and r.group not in seen.setdefault(v, []):
                seen[v].append(r.group)
        return ", ".join(f"{v} ({', '.join(names)})" for v, names in seen.items()) if len(seen) > 1 else ""
    data = spread(lambda r: ((r.config.get("data") or {}).get("content_sha256") or "unrecorded")[:12])
    if data:
        return f"trained on different data, content_sha256 {data}"

    def flag(run, key):   # its value, or None where it may differ or is not recorded
        args = run.config["args"]
        if key not in args or key in arm_flags(run.group) or key == "data_dir" and run.config.get("data"):
            return None      # data_dir: a recorded hash says which data, wherever its folder was
        return json.dumps(args[key])
    keys = [k for k in dict.fromkeys(k for r in runs for k in r.config["args"]) if k not in RUN_SPECIFIC]
    flags = [f"{k} {values}" for k in keys for values in [spread(lambda r, k=k: flag(r, k))] if values]
    if flags:
        return f"differ in flags that its arms do not set, {'; '.join(flags)}"
    # the arms that set their own horizon (claim 6's long ones) are compared with each other: one of them
    # resumed with another --max-steps would judge an action over other steps than its reference
    own = spread(lambda r: r.config["args"].get("max_steps") if "max_steps" in arm_flags(r.group) else None)
    return f"ran other horizons in the arms that set their own, max_steps {own}" if own else None


def verdicts(groups):
    """One row per rule: [claim, verdict, what was measured]. "not run" if an arm has no run folder
    (a dose grid: if none of its arms has one); else judged, missing or unfinished runs counted
    against it, and "inconclusive" if judged on too few seeds for any sign test to pass. Refuses
    (SystemExit) if a rule's runs differ in more than its arms' own flags (see mixed)."""
    rows, refused = [], []
    for label, claim, arm_list, rule in expanded_rules(groups):
        arms = arm_list(groups) if callable(arm_list) else arm_list
        title = {"2v": "QK-Guard stays dormant on healthy training, at no cost",
                 "3+": "an error at the backward's delta, where the kernel fault reaches the gradient, drives the "
                       "same QK runaway"}.get(
                     claim, CLAIMS[int(claim[0])][0])
        if label.startswith("3 ("):
            title = f"an error in a gradient outside attention ({label[3:-1]}) drives the same QK runaway"
        if claim in SOURCE_RULES:
            title += f"; the runaway's source: {SOURCE_WORDS[label[3:-1] if '(' in label else 'bf16']}"
        missing = [a for a in arms if not groups.get(a)]
        grid_run = [a for a in arms if a not in (NO_ERROR, QKNORM_ALONE) and a not in missing]  # grids may run in part
        if missing and (not callable(arm_list) or not grid_run):
            rows.append([label, "not run", f"{title}\nno runs of {', '.join(missing[:3])}"
                                           f"{f' and {len(missing) - 3} more arms' if len(missing) > 3 else ''}"])
            continue
        why = mixed(groups, arms)
        if why:
            refused.append((label, why))
            continue
        # fp32 is a judged arm of claims 1 and 2v; elsewhere it is the paired no-error reference, and
        # its seeds beyond the rule's own arms (runs of claims 1 and 2v) are not the rule's seeds
        verdict, lines = judge_rule(groups, arms, rule,
                                    refs=() if claim in ("1", "2v") else (NO_ERROR, QKNORM_ALONE, *optional_arms()))
        rows.append([label, verdict, "\n".join([title] + lines)])
    refuse(refused)
    return rows


def judge_rule(groups, arms, rule, refs):
    """(verdict, lines) of one rule on its arms' runs: "inconclusive" where too few seeds were run for
    any of its sign tests to reach its threshold."""
    c = Claim(groups, arms, refs=refs)
    holds, lines = rule(c)   # True, False or "refuted" (a result against the claim, rule 4's reversal)
    verdict = holds if isinstance(holds, str) else "reproduced" if holds else "not reproduced"
    if binom_tail(len(c.seeds), len(c.seeds)) >= c.alpha:
        # no sign test over so few seeds can reach the rule's threshold (Bonferroni-corrected
        # for a dose grid): a failure says nothing against the claim, nor a pass for it (a rule
        # without a sign test, as 2v's, can pass on any few seeds)
        verdict = "inconclusive"
        enough = next(n for n in range(1, 64) if binom_tail(n, n) < c.alpha)
        lines.append(f"{len(c.seeds)} seeds: even all of them one way give p = "
                     f"{binom_tail(len(c.seeds), len(c.seeds)):.3g} >= {c.alpha:.3g}, this rule's threshold; "
                     f"run at least {enough} (sweep.py --seeds)")
    return verdict, lines


def refuse(refused):
    """Stop (SystemExit, one line) if any rule's runs were mixed: [(label, why)]."""
    if refused:
        (label, why), more = refused[0], ", ".join(label for label, _ in refused[1:])
        raise SystemExit(f"error: rule {label}'s runs {why}" + (f" (and rule{'s' * (',' in more)} {more} too)"
                                                                if more else "")
                         + ": put each kind in a folder of its own and report them apart")


# --------------------------------------------------------------------------------------------------
# The learning-rate study (lab.sweep --lrs): claims 1, 2 and 7 as a CPU-scale proxy, after Wortsman et
# al. 2023. The arms of sweep.LR_STUDY_ARMS at each lr, in folders <arm>-lr<lr> (sweep.lr_name). Here the
# runaway's source is the learning rate and the bf16 state's fault rides along. A rule compares its arms at
# the same lr; across lrs only where its words say so.

LLAMA = "llama-"                   # a llama arm: "llama-" and the gpt2 arm's name (sweep.CLAIMS[7])
ARCHS = {"gpt2": "", "llama": LLAMA}
LR_WORDS = {"fp32": "fp32 state", "bf16": "bf16 state", "bf16-safemax": "bf16 state, safemax fix",
            "bf16-guard": "bf16 state, QK-Guard", "bf16-qknorm-always": "bf16 state, QK-norm always",
            "fp32-guard": "fp32 state, QK-Guard",
            "bf16-qknorm-always-aa": "bf16 state, QK-norm always, run again beside its 64-key twin",
            "bf16-qknorm-always-tile64": "bf16 state, QK-norm always, state rounded per 64 keys (not an A/A)",
            "bf16-qknorm-always-t1": "bf16 state, QK-norm always, 1 CPU thread (A/A)",
            "bf16-qknorm-always-t2": "bf16 state, QK-norm always, 2 CPU threads (A/A)"}
# the A/A arms (the arm at 1 and 2 threads) and the 2026-12-03 tile pair: the lr study reads both
AA_NAMES = tuple(a for pairs in (AA_ARMS, TILE_ARMS) for pair in pairs.values() for a in pair)
PROXY = ("A proxy, not the claims themselves: claims 1, 2 and 7 at CPU scale as a learning-rate sensitivity "
         "study, in the style of Wortsman et al. 2023 (\"Small-scale proxies for large-scale Transformer training "
         "instabilities\"). Here the runaway's source is the learning rate; the bf16 state's fault rides along.")


def lr_ran_away(run):
    """The study's runaway: ran_away's (a collapse, or a max logit past RUNAWAY_LOGIT), or a loss not finite."""
    return ran_away(run) or run.nonfinite


def done(run):
    return run is not None and run.finished


def end_val(run):
    """Its final val loss; infinite where missing or not finite (a diverged run ended worst)."""
    return run.final_val if run.final_val is not None and math.isfinite(run.final_val) else math.inf


def worse(run, ref):
    """Ended worse than ref, its seed's run of another arm: a final val loss more than LOSS_TOL above
    ref's, or it ran away where ref did not."""
    return end_val(run) > end_val(ref) + LOSS_TOL or lr_ran_away(run) and not lr_ran_away(ref)


def worse_test(c, arm, ref, alpha, claim_wants):
    """Is arm worse than ref, seed by seed (one-sided sign test at alpha)? claim_wants: that it is. A seed
    with either run missing or unfinished is scored the way that hurts the claim."""
    seeds = c.seeds_of(arm, ref)   # not the other arms'
    both = [(c.runs[arm].get(s), c.runs[ref].get(s)) for s in seeds]
    pairs = [(worse(a, b), worse(b, a)) if done(a) and done(b) else (not claim_wants, claim_wants) for a, b in both]
    left = sum(not (done(a) and done(b)) for a, b in both)
    k, j, p = sign_test(pairs)
    c.alpha = min(c.alpha, alpha)
    holds = p < alpha
    return holds, [f"sign test, {arm} worse than {ref}: {k} seeds one way, {j} the other of {len(seeds)}, p = {p:.3g} "
                   f"(threshold {alpha:.3g}) -> {'holds' if holds else 'fails'}"
                   + ("" if claim_wants else " (the claim wants it to fail)")
                   + (f" ({left} seeds with a run unfinished or missing, counted against)" if left else "")]


def lr_fault_claim(c, prefix=""):
    """1p: at some lr of the grid bf16 state ends worse than fp32 state (worse, seed by seed, a sign test at
    ALPHA / the lrs run), and at no lr does bf16-safemax by the same test. Says so where the two states give
    the same curve (within LOSS_TOL, the same runaways, at every lr and seed)."""
    fp32, bf16, safemax = (prefix + a for a in ("fp32", "bf16", "bf16-safemax"))
    lrs = c.lrs_run()
    alpha = ALPHA / len(lrs)
    found, fixed, same = False, True, True
    lines = [f"lrs run: {', '.join(f'{lr:g}' for lr in lrs)} (Bonferroni: threshold ALPHA / {len(lrs)})"]
    for lr in lrs:
        ok, more = worse_test(c, lr_name(bf16, lr), lr_name(fp32, lr), alpha, True)
        bad, most = worse_test(c, lr_name(safemax, lr), lr_name(fp32, lr), alpha, False)
        found, fixed, lines = found or ok, fixed and not bad, lines + more + most
        for s in lr_seeds(c, (bf16, fp32), lr):
            a, b = c.runs[lr_name(bf16, lr)].get(s), c.runs[lr_name(fp32, lr)].get(s)
            same = same and done(a) and done(b) and lr_ran_away(a) == lr_ran_away(b) and (
                end_val(a) == end_val(b) or abs(end_val(a) - end_val(b)) <= LOSS_TOL)
    for lr in lrs:
        finished = lambda arm: [r for r in c.runs[lr_name(arm, lr)].values() if done(r)]
        lines.append(f"lr {lr:g}: " + ", ".join(
            f"{arm} median final val {num(median(map(end_val, finished(arm))), '.3f')}, ran away "
            f"{sum(map(lr_ran_away, finished(arm)))}/{len(finished(arm))} finished" for arm in (fp32, bf16, safemax)))
    costly = []
    for lr in lrs:   # the effect's size beside the sign test, which sees only gaps past LOSS_TOL
        sizes = []
        for arm in (bf16, safemax):
            gaps, left = paired_gaps(c, arm, fp32, lr, lr_seeds(c, (arm, fp32), lr))
            mean, lo, hi = mean_interval(gaps, 1 - ALPHA)
            sizes.append(f"{arm} - {fp32} mean {num(mean, '+.3f')} nat, 95% interval [{num(lo, '+.3f')}, "
                         f"{num(hi, '+.3f')}], worse in {sum(g > 0 for g in gaps)}/{len(gaps)} seeds"
                         + (f" ({left} without both runs finished)" if left else ""))
            if arm == bf16 and lo > 0:
                costly.append(f"{lr:g} ({num(mean, '+.3f')} [{num(lo, '+.3f')}, {num(hi, '+.3f')}])")
        lines.append(f"lr {lr:g}, final val loss, paired t (reported, not judged; unadjusted): " + "; ".join(sizes))
    if costly:
        lines.append(f"where bf16 state ends measurably worse than fp32 state (the 95% interval of the mean paired gap "
                     f"above 0), whatever the rule says: lr {', '.join(costly)}")
    if same and lrs:
        lines.append("not reproduced at this scale: bf16 and fp32 state give the same curve" + (
            f" on {prefix[:-1]}" if prefix else "") + " (final val loss within LOSS_TOL, the same runaways, at "
            "every lr in every seed)")
    return found and fixed, lines


def same_losses(run, ref):
    """Every logged loss (train and val) the same, bit for bit, at the same steps."""
    logged = lambda r: json.dumps([r.steps, r.loss, r.evals])   # JSON floats round-trip exactly; NaN too
    return logged(run) == logged(ref)


def aa_lines(c, prefix, always, lr):
    """(whether the A/A pair showed a gap at lr, its lines): the pair of AA_ARMS (the same arm at 1 and 2 CPU
    threads, run side by side), the twin less the arm, by a paired t test (a 95% interval that excludes 0 is a
    gap where none should be); the 1-thread arm less the arm's own runs of the sweep (0 where no change of the
    code or CPU since moved a bit); and TILE_ARMS, the 2026-12-03 pair, as what it is."""
    one, two = (prefix + a for a in AA_ARMS["bf16-qknorm-always"])
    aa_gap, lines = False, []
    if c.runs.get(lr_name(one, lr)) and c.runs.get(lr_name(two, lr)):
        gaps, left = paired_gaps(c, two, one, lr, lr_seeds(c, (one, two), lr))
        mean, lo, hi, p = paired_t(gaps)
        aa_gap = left > 0 or not lo <= 0 <= hi
        sd = statistics.stdev(gaps) if len(gaps) > 1 else math.nan
        lines.append(f"A/A at lr {lr:g}, {two} - {one} (the same arm at 2 and 1 CPU threads, run side by "
                     f"side in one sweep: fp32 sums in another order, no rounding point moved): mean "
                     f"{num(mean, '+.3f')} nat, 95% interval [{num(lo, '+.3f')}, {num(hi, '+.3f')}], sd "
                     f"{num(sd, '.3f')}, n {len(gaps)}, paired t p = {num(p, '.2g')} -> "
                     f"{'a gap where none should be' if aa_gap else 'no gap'}"
                     + (f" ({left} seeds without both runs finished, counted as a gap)" if left else "")
                     + f"; per seed {', '.join(f'{g:+.3f}' for g in gaps)}")
        redo, _ = paired_gaps(c, one, always, lr, lr_seeds(c, (one,), lr))
        lines.append(f"lr {lr:g}, {one} - {always} (the same flags at one thread, run on a later day: what "
                     f"the code's "
                     f"changes since moved): identical in {sum(g == 0 for g in redo)}/{len(redo)} seeds")
    again, tile = (prefix + a for a in TILE_ARMS["bf16-qknorm-always"])
    if c.runs.get(lr_name(again, lr)) and c.runs.get(lr_name(tile, lr)):
        seeds = lr_seeds(c, (again, tile), lr)
        gaps, _ = paired_gaps(c, tile, again, lr, seeds)
        mean, lo, hi, p = paired_t(gaps)
        both = [(c.runs[lr_name(again, lr)].get(s), c.runs[lr_name(tile, lr)].get(s)) for s in seeds]
        hours = [abs(started(a) - started(b)) / 3600 for a, b in both if a and b]
        commits = sorted({commit_of(r) for a in (again, tile) for r in c.runs[lr_name(a, lr)].values()}
                         - {None})
        lines.append(f"lr {lr:g}, {tile} - {again} (the 2026-12-03 pair, not an A/A: the 64-key tile rounds "
                     f"the bf16 "
                     f"state twice per row, the fault's own rounding; its arms started "
                     f"{num(min(hours, default=math.nan), '.1f')} to "
                     f"{num(max(hours, default=math.nan), '.1f')} h apart "
                     f"seed by seed, at commits {', '.join(commits) or 'unrecorded'}): mean "
                     f"{num(mean, '+.3f')} nat, "
                     f"95% interval [{num(lo, '+.3f')}, {num(hi, '+.3f')}], paired t p = {num(p, '.2g')}, n "
                     f"{len(gaps)}; "
                     f"per seed {', '.join(f'{g:+.3f}' for g in gaps)}")
        redo, _ = paired_gaps(c, again, always, lr, lr_seeds(c, (again,), lr))
        lines.append(f"lr {lr:g}, {again} - {always} (the same flags, run again on a later day: other code, "
                     f"perhaps "
                     f"another CPU): identical in {sum(g == 0 for g in redo)}/{len(redo)} seeds; per seed "
                     f"{', '.join(f'{g:+.3f}' for g in redo)}")
    return aa_gap, lines


def started(run):
    """When a run started (config.json's "started", seconds since the epoch), or nan."""
    try:
        return time.mktime(time.strptime(run.config["started"].rsplit(" ", 1)[0], "%Y-%m-%d %H:%M:%S"))
    except (AttributeError, KeyError, TypeError, ValueError):
        return math.nan


def commit_of(run):
    return ((run.config.get("versions") or {}).get("git_commit") or "")[:7] or None


def late_switch_lines(c, guard, always, lr, judged):
    """Rule 2p's finding at a runaway lr: the guard's cost against always-on QK-norm (mean paired gap, 95% t
    interval) and its slope on the trigger step; how many triggers fell inside the warmup; the equivalence
    test's power at the gaps' own sd. Reported, not judged."""
    pairs = [(c.runs[lr_name(guard, lr)].get(s), c.runs[lr_name(always, lr)].get(s)) for s in judged]
    pairs = [(g, a) for g, a in pairs if done(g) and done(a) and g.trigger is not None
             and math.isfinite(end_val(g) - end_val(a))]
    if not pairs:
        return []
    steps, gaps = [g.trigger for g, _ in pairs], [end_val(g) - end_val(a) for g, a in pairs]
    mean, lo, hi, p = paired_t(gaps)
    slope, s_lo, s_hi, r = slope_interval(steps, gaps)
    warmup = statistics.median(g.config.get("args", {}).get("warmup_steps", 0) for g, _ in pairs)
    early = sum(t < warmup for t in steps)
    sd = statistics.stdev(gaps) if len(gaps) > 1 else math.nan
    need = seeds_for_power(sd) if sd > 0 else None
    cost = "a cost" if lo > 0 else "a gain" if hi < 0 else "no gap shown"
    return [f"lr {lr:g}, the late switch's cost (a finding, reported not judged): {guard} - {always} final "
            f"val, mean "
            f"{num(mean, '+.3f')} nat, 95% interval [{num(lo, '+.3f')}, {num(hi, '+.3f')}], paired t p = "
            f"{num(p, '.2g')}, n {len(gaps)} ({cost}); against the trigger step (median "
            f"{statistics.median(steps):g}, "
            f"{min(steps)} to {max(steps)}): slope {num(100 * slope, '+.3f')} nat per 100 steps, 95% "
            f"interval [{num(100 * s_lo, '+.3f')}, {num(100 * s_hi, '+.3f')}], r = {num(r, '+.2f')}",
            f"lr {lr:g}: {guard}'s trigger inside the {warmup:g} warmup steps in {early}/{len(steps)} seeds"
            + (" (there the guard is QK-norm nearly from the start: its equivalence with always-on QK-norm "
               "is nearly built in)" if early else ""),
            f"lr {lr:g}: the equivalence test's power at the gaps' sd {num(sd, '.3f')}, were the true gap 0: "
            f"{num(100 * equivalence_power(sd, len(gaps)), '.0f')}% at n {len(gaps)}; 80% needs about "
            f"{need if need is not None else 'more than 10,000'} seeds (normal approximation)"]


def lr_seeds(c, arms, lr):
    """The seeds any of `arms` ran at lr (an arm's seed missing among them counts against the claim)."""
    return c.seeds_of(*(lr_name(a, lr) for a in arms))


def gap_words(verdict, mean, lo, hi, n, sd):
    return (f"mean {mean:+.3f} nat, 90% interval [{lo:+.3f}, {hi:+.3f}], sd {sd:.3f}, n {n} (two one-sided tests "
            f"at +-LOSS_TOL: {verdict})")


def paired_gaps(c, arm, ref, lr, seeds):
    """Final val loss of arm minus ref's, per seed of `seeds` where both finished with a finite val loss; and
    how many seeds lacked either."""
    pairs = [(c.runs.get(lr_name(arm, lr), {}).get(s), c.runs.get(lr_name(ref, lr), {}).get(s)) for s in seeds]
    gaps = [end_val(a) - end_val(b) for a, b in pairs if done(a) and done(b) and math.isfinite(end_val(a) - end_val(b))]
    return gaps, len(pairs) - len(gaps)


def equivalence_line(c, arm, ref, lr, seeds):
    """(the TOST verdict, its words) on arm - ref's paired final val loss at lr over `seeds`."""
    gaps, left = paired_gaps(c, arm, ref, lr, seeds)
    verdict, mean, lo, hi = equivalence(gaps)
    sd = statistics.stdev(gaps) if len(gaps) > 1 else math.nan
    return verdict, left, gap_words(verdict, mean, lo, hi, len(gaps), sd)


def lr_guard_claim(c, prefix=""):
    """2p: at every lr where bf16 runs away in a majority of its seeds, bf16-guard runs away in none, its
    trigger (read below RUNAWAY_LOGIT) comes no later than the logged step where the same seed's bf16 run first
    showed its runaway, and its final val loss is equivalent to bf16-qknorm-always's within LOSS_TOL: the 90%
    t interval of the mean paired gap lies inside +-LOSS_TOL (two one-sided tests at ALPHA; every lr must pass,
    an intersection-union test, so no correction); an interval wholly past the margin fails, one that reaches
    past it without being wholly past is inconclusive. At every lr where fp32 and bf16 stay healthy in every
    seed (max logit under the guard's threshold), bf16-guard and fp32-guard fire in no seed and log the
    unguarded run's losses bit for bit; lrs in between are reported, not judged. Both kinds of lr must be in
    the grid. Each lr is judged on the seeds its arms ran; a run missing or unfinished among them fails it.
    Beside it, where it ran, the A/A pair (AA_ARMS: one QK-norm arm at 1 and 2 CPU threads) gives this scale's
    noise floor; a gap between its arms (a 95% t interval that excludes 0) makes a verdict that would hold
    inconclusive. At each runaway lr the late switch's cost is reported (late_switch_lines)."""
    bf16, fp32, guard, always, fp32_guard = (prefix + a for a in ("bf16", "fp32", "bf16-guard", "bf16-qknorm-always",
                                                                  "fp32-guard"))
    holds, unsure, lines, kinds, aa_gaps = True, False, [], set(), []
    for lr in c.lrs_run():
        seeds = lr_seeds(c, (bf16, fp32, guard, always, fp32_guard), lr)
        at = lambda arm, among=seeds: [c.runs[lr_name(arm, lr)].get(s) for s in among]
        ran_b = lr_seeds(c, (bf16,), lr) or seeds   # whether bf16 runs away: over the seeds it ran
        away = lambda arm, among=seeds: sum(not done(r) or lr_ran_away(r) for r in at(arm, among))  # unfinished: ran away
        runaway = 2 * away(bf16, ran_b) > len(ran_b)
        # healthy: the unguarded runs' logits stayed under the guard's threshold, so a guard that fires
        # there fires on healthy training. Between that and a runaway (past the threshold, short of
        # RUNAWAY_LOGIT within the horizon: still growing) the guard ought to fire, and nothing is judged.
        healthy = not any(done(r) and (lr_ran_away(r) or (r.max_logit or 0.0) > r.guard_threshold())
                          for r in at(bf16) + at(fp32))   # unfinished: as healthy, then fails the test
        if runaway:
            kinds.add("runaway")
            judged = lr_seeds(c, (guard, always), lr)
            verdict, left, words = equivalence_line(c, guard, always, lr, judged)
            leads, late = [], 0
            for seed, b, g in zip(ran_b, at(bf16, ran_b), at(guard, ran_b)):
                if done(b) and not lr_ran_away(b):
                    continue   # nothing to prevent in this seed
                # Until the guard acts, the guarded run is the unguarded one, and it checks every step:
                # its first crossing, read below RUNAWAY_LOGIT, precedes the runaway, provided it comes
                # no later than the unguarded run's first logged runaway (a record ends its interval)
                seen = (b.first_past(RUNAWAY_LOGIT, inclusive=True) or b.runaway_from()) if done(b) else None
                lead = seen - g.trigger if done(g) and g.trigger is not None and seen is not None else None
                leads.append(f"{seed} {'none' if lead is None else lead}")
                late += lead is None or lead < 0 or (g.trigger_value or 0.0) >= RUNAWAY_LOGIT
            prevented = not away(guard, judged) and not late and not left
            ok = prevented and verdict == "within"
            result = "holds" if ok else "inconclusive" if prevented and verdict == "inconclusive" else "fails"
            holds, unsure = holds and result != "fails", unsure or result == "inconclusive"
            lines += [f"at lr {lr:g}: {bf16} ran away in {away(bf16, ran_b)}/{len(ran_b)} seeds, so the guard must "
                      f"prevent it: {guard} ran away in {away(guard, judged)}/{len(judged)}, acted too late in {late}"
                      + (f", {left} seeds without both runs finished (counted against)" if left else "")
                      + f"; final val - {always}'s: {words} -> {result}",
                      f"lr {lr:g}: steps from {guard}'s trigger to the logged step where {bf16} first showed its "
                      f"runaway, by seed: {', '.join(leads) or 'none ran away'}"]
            against = paired_gaps(c, guard, bf16, lr, ran_b)[0]   # the loss evidence that it prevented something
            lines.append(f"lr {lr:g}: {guard} - {bf16} (unguarded) final val, {median_range(against)}, lower in "
                         f"{sum(g < 0 for g in against)}/{len(against)} seeds")
            if len(judged) > SEEDS:   # what the first sweep's seeds alone said
                lines.append(f"lr {lr:g}, seeds {judged[0]} to {judged[SEEDS - 1]} alone (the first sweep): "
                             + equivalence_line(c, guard, always, lr, judged[:SEEDS])[2])
            lines += late_switch_lines(c, guard, always, lr, judged)
            gap, more = aa_lines(c, prefix, always, lr)
            aa_gaps, lines = aa_gaps + [f"{lr:g}"] * gap, lines + more
        if healthy:
            kinds.add("healthy")
            fired = {g: sum(not done(r) or r.trigger is not None for r in at(g)) for g in (guard, fp32_guard)}
            same = {g: sum(done(r) and done(h) and same_losses(r, h) for r, h in zip(at(g), at(plain)))
                    for g, plain in ((guard, bf16), (fp32_guard, fp32))}
            ok = not any(fired.values()) and all(k == len(seeds) for k in same.values())
            holds = holds and ok
            lines.append(f"at lr {lr:g}: {fp32} and {bf16} healthy in every seed, so the guard must stay dormant: "
                         f"fired in {fired[guard]}/{len(seeds)} ({guard}), {fired[fp32_guard]}/{len(seeds)} "
                         f"({fp32_guard}); logged losses bit for bit the unguarded run's in {same[guard]}/{len(seeds)} "
                         f"({guard} vs {bf16}), {same[fp32_guard]}/{len(seeds)} ({fp32_guard} vs {fp32}) (unfinished "
                         f"counted against) -> {'holds' if ok else 'fails'}")
        if not runaway and not healthy:
            ran_f = lr_seeds(c, (fp32,), lr) or seeds
            fired = sum(done(r) and r.trigger is not None for r in at(guard))
            gaps = [end_val(g) - end_val(b) for g, b in zip(at(guard), at(bf16)) if done(g) and done(b)]
            lines.append(f"at lr {lr:g}: neither ({bf16} ran away in {away(bf16, ran_b)}/{len(ran_b)} seeds, {fp32} in "
                         f"{away(fp32, ran_f)}/{len(ran_f)}; their max logits passed the guard's threshold short of a runaway): "
                         f"not judged; {guard} fired in {fired}/{len(seeds)} and ended {num(median(gaps), '+.3f')} nat "
                         f"from {bf16} (median final val loss difference)")
    for kind, words in (("runaway", f"{bf16} ran away in a majority of seeds: nothing for the guard to prevent"),
                        ("healthy", f"{fp32} and {bf16} were healthy in every seed: no dormancy to check")):
        if kind not in kinds:
            holds = False
            lines.append(f"at lr none: no lr of the grid where {words} -> fails")
    if holds and aa_gaps:
        lines.append(f"inconclusive: the A/A pair showed a gap where none should be (lr "
                     f"{', '.join(aa_gaps)}), so the "
                     "test cannot tell two arms from noise")
        return "inconclusive", lines
    if holds and unsure:
        lines.append("inconclusive: at some runaway lr the gap's interval reaches past LOSS_TOL without lying "
                     "wholly past it")
        return "inconclusive", lines
    return holds, lines


def part(name, result):
    """One part of a joined rule, its lines under a heading line."""
    ok, lines = result
    return ok, [f"part {name}: {ok if isinstance(ok, str) else 'holds' if ok else 'fails'}"] + lines


LR_RULES = [
    ("1p", "claim 1 as a proxy: at some lr of the grid bf16 state ends worse than fp32 state, seed by seed (a final "
           "val loss more than LOSS_TOL above fp32's, or a runaway where fp32 ran none), by a sign test at p < ALPHA "
           "/ the lrs run (Bonferroni), and bf16-safemax is worse than fp32 by that test at no lr",
     ("fp32", "bf16", "bf16-safemax"), lr_fault_claim),
    ("2p", "claim 2 as a proxy: at every lr where bf16 runs away (a majority of seeds), bf16-guard runs away in no "
           "seed, its final val loss is equivalent to bf16-qknorm-always's within LOSS_TOL (two one-sided "
           "tests at "
           "ALPHA on the mean paired gap over every seed both arms ran: the 90% t interval inside "
           "+-LOSS_TOL; one wholly past it fails, one that reaches past it is inconclusive), and its trigger "
           "(read below RUNAWAY_LOGIT) comes no later than the logged step where the same seed's bf16 run "
           "first showed its runaway; at every lr where fp32 and bf16 stay healthy in every seed (their max "
           "logit under the guard's threshold), bf16-guard and fp32-guard fire in no seed and log the losses "
           "of bf16 and fp32 bit for bit; the grid must hold both kinds of lr. Decided on 2026-12-05 before "
           "their runs: the A/A pair "
           "(bf16-qknorm-always at 1 and 2 CPU threads, run side by side in one sweep; they differ in the "
           "order "
           "of fp32 sums alone) must not show a gap: where it ran, a 95% t interval of its mean paired gap "
           "that "
           "excludes 0 makes a 2p that would hold inconclusive (the test then cannot tell two arms from "
           "noise); "
           "at lr 0.01, where the guard stays dormant for a stretch, bf16-guard and bf16-qknorm-always run "
           "32 seeds and the late switch's cost is reported as a finding: the mean paired gap with its 95% t "
           "interval, and its least-squares slope on the trigger step with the slope's 95% interval; at "
           "every runaway lr the "
           "seeds whose trigger fell inside the warmup are counted (there the guard is QK-norm nearly from "
           "the "
           "start, so its equivalence with always-on QK-norm is nearly built in), and the equivalence test's "
           "power "
           "at the gaps' own sd (with the seeds 80% would need) is stated",
     ("bf16", "bf16-guard", "bf16-qknorm-always", "fp32", "fp32-guard"), lr_guard_claim),
    ("7p", "claim 7 as a proxy: 1p and 2p both hold on llama (the llama- arms)",
     tuple(LLAMA + a for a in LR_STUDY_ARMS),
     lambda c: joined(part("1p on llama", lr_fault_claim(c, LLAMA)), part("2p on llama", lr_guard_claim(c, LLAMA)))),
]
LR_TITLES = {"1p": "claim 1 as a proxy: bf16 state ends worse than fp32 state at some learning rate, the safemax "
                   "fix at none",
             "2p": "claim 2 as a proxy: QK-Guard prevents the learning rate's runaway within LOSS_TOL of always-on "
                   "QK-norm, and where training is healthy stays dormant bit for bit",
             "7p": "claim 7 as a proxy: 1p and 2p on llama"}


def lr_cells(groups):
    """{(base arm, lr): group name} of the study's folders that are <arm>-lr<lr> of a study arm."""
    bases = {prefix + a for prefix in ARCHS.values() for a in (*LR_STUDY_ARMS, *AA_NAMES)}
    return {(base, lr): name for name in groups for base, lr in [split_lr(name)]
            if base in bases and lr is not None and lr_name(base, lr) == name}


def lr_verdicts(groups):
    """One row per rule of LR_RULES, as verdicts gives: "not run" if an arm ran at no lr; else judged at
    the lrs any of its arms ran. Refuses (SystemExit) a mix of flags other than the arms' own (mixed)."""
    rows, refused, cells = [], [], lr_cells(groups)
    for label, _, bases, rule in LR_RULES:
        lrs = sorted({lr for (base, lr), name in cells.items() if base in bases and groups[name]})
        missing = [b for b in bases if not any(groups.get(lr_name(b, lr)) for lr in lrs)]
        if missing:
            rows.append([label, "not run", f"{LR_TITLES[label]}\nno runs of {', '.join(missing[:3])}"
                                           f"{f' and {len(missing) - 3} more arms' if len(missing) > 3 else ''} "
                                           f"at any learning rate"])
            continue
        arms = [lr_name(b, lr) for lr in lrs for b in bases]
        why = mixed(groups, arms)
        if why:
            refused.append((label, why))
            continue
        verdict, lines = judge_rule(groups, arms, rule, refs=())
        rows.append([label, verdict, "\n".join([LR_TITLES[label]] + lines)])
    refuse(refused)
    return rows


def lr_sensitivity(groups, prefix=""):
    """Per arm of one architecture (prefix: ARCHS), with runs: (its LR sensitivity by seed, the smallest lr at
    which it ran away in a majority of seeds or None). A seed's LR sensitivity (Wortsman et al. 2023): the
    mean over the lr grid of min(final val loss, val loss at init), less the best final val loss of any arm at
    any lr of that seed's sweep. A seed whose run at some lr is missing, unfinished or lacks either loss is
    left out of that arm (n counts the seeds in)."""
    cells = {key: {r.seed: r for r in groups[name]} for key, name in lr_cells(groups).items()
             if key[0] in {prefix + a for a in LR_STUDY_ARMS} and groups[name]}
    lrs = sorted({lr for _, lr in cells})
    seeds = sorted({s for runs in cells.values() for s in runs}, key=lambda s: (len(s), s))
    out = {}
    for arm in (prefix + a for a in LR_STUDY_ARMS):
        if not any((arm, lr) in cells for lr in lrs):
            continue
        by_seed = []
        for seed in seeds:
            best = min((end_val(r) for runs in cells.values() for s, r in runs.items() if s == seed and done(r)),
                       default=math.inf)
            runs = [cells.get((arm, lr), {}).get(seed) for lr in lrs]
            if math.isfinite(best) and all(done(r) and r.init_val is not None for r in runs):
                by_seed.append(statistics.mean(min(end_val(r), r.init_val) for r in runs) - best)
        starts = next((lr for lr in lrs if 2 * sum(done(r) and lr_ran_away(r) for r in cells.get((arm, lr), {})
                                                   .values()) > len(seeds)), None)
        out[arm] = (by_seed, starts)
    return out


# --------------------------------------------------------------------------------------------------
# Tables: built once, rendered as aligned text or as Markdown

def num(x, spec=".4g"):
    return "-" if x is None else format(x, spec)


def median(values):
    values = [v for v in values if v is not None]
    return statistics.median(values) if values else None


def group_line(name, runs):
    """A group in a line: collapses, median collapse step, maxima and losses, trigger steps."""
    if not runs:
        return f"{name}: no runs"
    m = lambda attr, spec: num(median(getattr(r, attr) for r in runs), spec)
    triggers = [r.trigger for r in runs if r.trigger is not None]
    unfinished = sum(not r.finished for r in runs)
    return (f"{name}: {sum(map(collapsed, runs))}/{len(runs)} collapsed" +
            (f" (median step {m('collapse_step', '.0f')})" if any(map(collapsed, runs)) else "") +
            f", max sigma(W_q) {m('max_sigma', '.3g')}, max logit {m('max_logit', '.3g')}, train "
            f"{m('final_train', '.4f')}, val {m('final_val', '.4f')}" +
            (f", guard triggered at {', '.join(map(str, triggers))}" if triggers else "") +
            (f"; {unfinished} unfinished" if unfinished else ""))


GROUP_HEADER = ["seed", "status", "collapse step", "max sigma(W_q)", "sigma growth q / others", "max logit",
                "guard trigger", "final train", "final val", "last step"]


def group_rows(runs):
    def growth(r):
        qk, others = r.qk_and_other_growth()
        return f"{num(qk, '.3g')} / {num(others, '.3g')}"
    return [[r.seed, r.status, num(r.collapse_step), num(r.max_sigma, ".3g"), growth(r), num(r.max_logit, ".3g"),
             num(r.trigger), num(r.final_train, ".4f"), num(r.final_val, ".4f"),
             num(r.steps[-1] if r.steps else None)] for r in runs]


FIX_LABEL = "coherence 1 + QK-only fix"   # dose_curves' label of the fixed curve (the table's words)
# sweep.SITES' --qk-fix values in words: what each site's QK-only fix does (lab/assay.py)
FIX_WORDS = {"qknorm": "QK-norm from step 0", "clean-grad": "W_q, W_k trained on the error-free gradient"}


def dose_curves():
    """(site, label, dose -> arm name) for each curve of the dose-response table and figure: every coherence,
    and coherence 1 with the site's QK-only fix (fix_words names it)."""
    return [(site, label, name) for site in SITES for label, name in
            [(f"coherence {c:g}", lambda d, site=site, c=c: inject_arm(site, d, c)[0]) for c in COHERENCES]
            + [(FIX_LABEL, lambda d, site=site: inject_arm(site, d, 1.0, True)[0])]]


def fix_words(site):
    """The QK-only fix that sweep.SITES gives an injection site, in words."""
    return FIX_WORDS[SITES[site]]


def curve_words(site, label):
    """A dose-response curve (dose_curves' label) in words for its site's legend: the fix named."""
    return {"coherence 1": "sign-coherent error", "coherence 0.5": "error of a random sign each step",
            FIX_LABEL: f"sign-coherent error, fixed by {fix_words(site)}"}.get(label, label)


def paired_with_no_error(groups, name):
    """[(run, its seed's no-error run)] of arm `name`'s finished runs whose no-error run finished too."""
    ref = {r.seed: r for r in groups.get(NO_ERROR, []) if r.finished}
    return [(r, ref[r.seed]) for r in groups.get(name, []) if r.finished and r.seed in ref]


def logits_beyond(run, ref):
    """beyond()'s logit half: max logit >= RUNAWAY_LOGIT and LOGIT_RATIO x ref's (its other half, a collapse
    where ref did not, is the figure's other kind of runaway)."""
    return (run.max_logit or 0.0) >= max(RUNAWAY_LOGIT, LOGIT_RATIO * (ref.max_logit or 0.0))


def dose_outcomes(groups):
    """Claims 3 and 4, split as the figure's top panel draws them: per (site, coherence or fix), per dose,
    (runs whose max logit passed the bar beyond(run, ref) sets, runs that ran away beyond their no-error
    run only by collapsing: a loss collapse with logits under that bar, runs finished with their no-error
    run finished too). The first two add up to beyond's count."""
    curves = {}
    for site, label, name in dose_curves():
        cells = []
        for dose in DOSES:
            pairs = paired_with_no_error(groups, name(dose))
            by_logits = [logits_beyond(r, ref) for r, ref in pairs]
            by_collapse = [beyond(r, ref) and not logits for (r, ref), logits in zip(pairs, by_logits)]
            cells.append((sum(by_logits), sum(by_collapse), len(pairs)))
        if any(n for *_, n in cells):
            curves[(site, label)] = cells
    return curves


def dose_response(groups):
    """Claims 3 and 4: per (site, coherence or fix), per dose: (how many ran away beyond their
    seed's no-error run, how many finished with their no-error run finished too)."""
    return {key: [(logits + collapses, n) for logits, collapses, n in cells]
            for key, cells in dose_outcomes(groups).items()}


def dose_logits(groups):
    """Per (site, dose_response's label), per dose: (the finite max-logit ratios, logit_ratio, of its finished
    runs over their seed's no-error run, sorted; how many of them are off that scale: collapsed or diverged,
    logit_ratio's inf), for the dose-response figure's lower panel, which keeps both."""
    out = {}
    for site, label, name in dose_curves():
        cells = {}
        for d in DOSES:
            ratios = [logit_ratio(r, ref) for r, ref in paired_with_no_error(groups, name(d))]
            cells[d] = (sorted(x for x in ratios if math.isfinite(x) and x > 0), sum(x == math.inf for x in ratios))
        out[site, label] = cells
    return out


def dose_ratios(groups):
    """Per (site, dose_response's label), per dose: the finite max-logit ratios of dose_logits (its runs off
    the scale left out)."""
    return {key: {d: finite for d, (finite, _) in cells.items()} for key, cells in dose_logits(groups).items()}


def fault_units(root):
    """The doses in units of the bf16 state's own error, from <root>/fault_size.json (lab.fault_size), if
    there: a paragraph, or nothing."""
    path = os.path.join(root, "fault_size.json")
    if not os.path.exists(path):
        return []
    try:
        with open(path) as f:
            fault = json.load(f)
        error, bias = fault["median"]["error_ratio_median"], fault["median"]["bias_ratio_median"]
    except (OSError, ValueError, KeyError, TypeError) as e:
        print(f"warning: {path}: {e!r}: the doses are not shown in the fault's units", file=sys.stderr)
        return []
    where = f"a checkpoint ({fault['ckpt']})" if fault.get("ckpt") else \
        f"the initial models of {len(fault.get('per_seed', []))} seeds"
    return [f"The doses in units of the bf16 state's own error on {where}: its rms is {error:.3g} of the attention "
            f"output's (median over layers and heads; its sign-keeping mean {bias:.3g}), so "
            + ", ".join(f"dose {d:g} is {d / error:.3g}x" for d in DOSES)
            + f" the fault's size (`{' '.join(fault.get('command', []))}`)."]


def dose_table(groups):
    return [[site, label] + [f"{k}/{n}" if n else "-" for k, n in cells]
            for (site, label), cells in dose_response(groups).items()]


def render(header, rows, markdown):
    """Cells may hold several lines: <br> in Markdown, continuation lines in text."""
    if markdown:
        lines = [header, ["---"] * len(header)] + [[c.replace("|", "\\|").replace("\n", "<br>") for c in r]
                                                   for r in rows]
        return "\n".join("| " + " | ".join(r) + " |" for r in lines)
    cells = [[c.split("\n") for c in r] for r in [header] + rows]
    widths = [max(len(line) for r in cells for line in r[i]) for i in range(len(header))]
    return "\n".join("  ".join((c[k] if k < len(c) else "").ljust(w) for c, w in zip(r, widths)).rstrip()
                     for r in cells for k in range(max(map(len, r))))


def scale(groups):
    """The runs' scale in one paragraph, from their config.json (the same every time)."""
    configs = [r.config for rs in groups.values() for r in rs if r.config.get("args")]
    if not configs:
        return "Scale: unknown (no config.json)."
    values = lambda key: sorted({str(c["args"].get(key)) for c in configs})
    joined = lambda key: "/".join(values(key))
    seeds = sorted({r.seed for rs in groups.values() for r in rs}, key=lambda s: (len(s), s))
    # an arm that sets its own --max-steps (claim 6's long horizon) is named apart from the rest's
    own = {f"{a} {r.config['args'].get('max_steps')}" for a, rs in groups.items() if "max_steps" in arm_flags(a)
           for r in rs if r.config.get("args")}
    steps = "/".join(sorted({str(r.config["args"].get("max_steps")) for a, rs in groups.items() for r in rs
                             if r.config.get("args") and "max_steps" not in arm_flags(a)}, key=lambda v: (len(v), v)))
    steps = f"{steps} steps" + (f" ({', '.join(sorted(own))} for the arms that set their own)" if own else "")
    blocks = "/".join(sorted({str(max(1, c["args"].get("block_size", 0) // (c["args"].get("block_n") or 128)))
                              for c in configs}))
    return (f"Scale: preset {joined('preset')}: {joined('arch')} model, {joined('n_layer')} layers of width "
            f"{joined('n_embd')} ({joined('n_head')} heads), context {joined('block_size')} streamed in {blocks} "
            f"key block(s) per row{ONE_BLOCK if blocks == '1' else ''}, batch "
            f"{joined('batch_size')} x {joined('grad_accum')}, {steps} at lr {joined('lr')} "
            f"({joined('schedule')} after {joined('warmup_steps')} warmup steps); data {joined('dataset')} in "
            f"{joined('tokenizer')} tokens; {len(seeds)} seeds ({seeds[0]} to {seeds[-1]}), {len(configs)} runs; "
            f"{machines(configs)}.")


ONE_BLOCK = (" (so the bf16 state is rounded once per row and never rescaled across blocks: the assay injects its "
             "own error, and the fault's rescale is claim 1 at CPU scale's, with 4 blocks per row)")
PAPER_SCALE = ("the paper's guard result: plain GPT-2, 12 final train and val losses within 0.03 nat of always-on "
               "QK-norm over 60k steps (SOURCES.md)")


def paper_scale(*groups_list):
    """The runs' scale beside the paper's, in one sentence: parameters, steps, tokens, val tokens (config.json)."""
    configs = [r.config for groups in groups_list for rs in groups.values() for r in rs if r.config.get("args")]
    if not configs:
        return ""
    values = lambda f: sorted({f(c) for c in configs if f(c) is not None})
    params = "/".join(f"{p / 1e6:.2f}M" for p in values(lambda c: c.get("params")))
    steps = "/".join(map(str, values(lambda c: c["args"].get("max_steps"))))
    tokens = values(lambda c: c["args"].get("batch_size", 0) * c["args"].get("grad_accum", 1) * c["args"].get(
        "block_size", 0))
    val = values(lambda c: c["args"].get("eval_iters", 0) * c["args"].get("batch_size", 0) * c["args"].get(
        "block_size", 0))
    return (f"Scale against the paper's: {PAPER_SCALE}; these runs: models of {params or '?'} parameters, {steps} "
            f"steps of {'/'.join(f'{t:,}' for t in tokens)} tokens, the final val loss on "
            f"{'/'.join(f'{v:,}' for v in val)} tokens. A tolerance or a horizon set at the paper's scale is "
            f"checked here against this scale's own noise (rule 2p's A/A pair) and runaways (rules 5 and 6).")


def machines(configs):
    """Where and when runs ran, from their config.json: "machine cpu (torch ...); runs started ... to ..."."""
    hardware = sorted({f"{v.get('gpu') or v.get('device', '?')} (torch {v.get('torch', '?')}, triton "
                       f"{v.get('triton', '?')})" for v in (c.get("versions", {}) for c in configs)})
    started = sorted(c["started"] for c in configs if c.get("started"))
    return (f"machine {', '.join(hardware)}; runs started {started[0] if started else '?'} to "
            f"{started[-1] if started else '?'}")


def lr_arch(name):
    """The architecture of an lr-study arm, from its name."""
    return next(arch for arch, prefix in reversed(ARCHS.items()) if name.startswith(prefix))


def lr_scale(groups):
    """The lr study's scale in one paragraph, from its runs' config.json: preset, each architecture's sizes,
    steps, learning rates, seeds and the data's identity (config.json's data record)."""
    configs = [r.config for rs in groups.values() for r in rs if r.config.get("args")]
    if not configs:
        return "Scale: unknown (no config.json)."
    joined = lambda key, among=configs: "/".join(sorted({str(c["args"].get(key)) for c in among}))
    archs = []
    for arch in sorted({str(c["args"].get("arch")) for c in configs}):
        among = [c for c in configs if str(c["args"].get("arch")) == arch]
        archs.append(f"{arch} ({joined('n_layer', among)} layers of width {joined('n_embd', among)}, "
                     f"{joined('n_head', among)} heads, {len(among)} runs)")
    data = sorted({f"{d.get('dataset')} in {d.get('tokenizer')} tokens, content_sha256 {d.get('content_sha256')}, "
                   f"{d.get('train_tokens')} train and {d.get('val_tokens')} val tokens" if d else
                   "unrecorded (runs older than config.json's data record)"
                   for d in (c.get("data") or {} for c in configs)})
    lrs = sorted({lr for _, lr in lr_cells(groups)})
    seeds = sorted({r.seed for rs in groups.values() for r in rs}, key=lambda s: (len(s), s))
    return (f"Scale: preset {joined('preset')}; models {', '.join(archs)}; context {joined('block_size')}, batch "
            f"{joined('batch_size')} x {joined('grad_accum')}, {joined('max_steps')} steps per run "
            f"({joined('schedule')} schedule after {joined('warmup_steps')} warmup steps); learning rates "
            f"{', '.join(f'{lr:g}' for lr in lrs) or 'none'} (each run's lr and min_lr); {len(seeds)} seeds "
            f"({seeds[0]} to {seeds[-1]}), {len(configs)} runs; data {'; '.join(data)}; {machines(configs)}.")


def sources_run(groups):
    """The runaway sources on which claims 5 or 6 have a run (of an arm other than no-error)."""
    return [s for s in SOURCES if any(groups.get(a) for a in {**probe_arms(s), **action_arms(s)} if a != NO_ERROR)]


def cut_arms(groups):
    """The arms of the claims judged here that have no run at all: what the sweep left out."""
    full = {n for number, (_, arms) in CLAIMS.items() if number not in (5, 6) for n in arms}
    full |= {n for s in sources_run(groups) for n in {**probe_arms(s), **action_arms(s)}}
    return sorted(n for n in full if not groups.get(n))


def pilot_rows(pilot_groups):
    """A pilot's runs, one row each: status, max logit, the steps it first passed the guard's threshold
    and reached RUNAWAY_LOGIT (what a horizon is chosen from), sigma growth, val loss."""
    step = lambda s: "-" if s is None else str(s)
    return [[name, r.seed, r.status, num(r.max_logit, ".4g"),
             f"{step(r.first_past(r.guard_threshold()))} / {step(r.first_past(RUNAWAY_LOGIT, inclusive=True))}",
             "{} / {}".format(*(num(x, ".3g") for x in r.qk_and_other_growth())), num(r.final_val, ".4f")]
            for name, runs in sorted(pilot_groups.items()) for r in runs]


def lr_order(groups):
    """The study's cells in table order: architecture, arm (as LR_STUDY_ARMS), lr: [(base, lr, name)]."""
    rank = {prefix + a: (i, j) for i, prefix in enumerate(ARCHS.values())
            for j, a in enumerate((*LR_STUDY_ARMS, *AA_NAMES))}
    return sorted(((base, lr, name) for (base, lr), name in lr_cells(groups).items()),
                  key=lambda cell: (rank[cell[0]], cell[1]))


def lr_section(path, groups, rows, markdown, title, plots=(), markdown_dir="."):
    """The lr study's part of the report: its scale, verdicts and rules, per architecture the LR sensitivity
    and final val loss tables and the figure, its runs and (in Markdown) their commands."""
    parts = [title(2, f"Learning-rate study ({path}): claims 1, 2 and 7 as a proxy at CPU scale"),
             f"{PROXY} {lr_scale(groups)}"]
    cells = lr_order(groups)
    others = sorted(set(groups) - {name for _, _, name in cells})
    if others:
        parts.append(f"Not of the study (no <arm>-lr<lr> of {', '.join(LR_STUDY_ARMS)} or their llama- arms), "
                     f"skipped: {', '.join(others)}.")
    parts += [render(["claim", "verdict", "arms: counts; tests, by learning rate"], rows, markdown)]
    figures = {os.path.splitext(os.path.basename(p))[0]: p for p in plots}
    for arch, prefix in ARCHS.items():
        sensitivity = lr_sensitivity(groups, prefix)
        if not sensitivity:
            continue
        lrs = sorted({lr for base, lr, _ in cells if lr_arch(base) == arch})
        table = []
        for arm, (by_seed, starts) in sensitivity.items():
            spread = (f"{statistics.median(by_seed):.3f} [{min(by_seed):.3f}, {max(by_seed):.3f}]" if by_seed
                      else "-")
            table.append([arm, spread, str(len(by_seed)), "none in the grid" if starts is None else f"{starts:g}"])
        finals = []
        for arm in sensitivity:
            row = [arm]
            for lr in lrs:
                runs = [r for r in groups.get(lr_name(arm, lr), []) if done(r)]
                row.append(f"{num(median(map(end_val, runs)), '.3f')} ({sum(map(lr_ran_away, runs))}/{len(runs)})"
                           if runs else "-")
            finals.append(row)
        guard, plain = sensitivity.get(prefix + "bf16-guard"), sensitivity.get(prefix + "bf16")
        ratio = (f" bf16-guard's median LR sensitivity is {statistics.median(guard[0]) / statistics.median(plain[0]):.0%}"
                 f" of unguarded bf16's." if guard and plain and guard[0] and plain[0] and
                 statistics.median(plain[0]) > 0 else "")
        parts += [title(3, f"{arch}: LR sensitivity, and where each arm starts to run away"),
                  "LR sensitivity (Wortsman et al. 2023), per seed: the mean over the learning rates of min(final val "
                  "loss, val loss at init), less the best final val loss of any arm at any learning rate of that "
                  "seed's sweep (nat per token); a seed with a run missing, unfinished or without either loss is "
                  "left out of its arm. Runs away from: the smallest learning rate at which the arm ran away in a "
                  "majority of seeds." + ratio,
                  render(["arm", "LR sensitivity: median over seeds [min, max]", "n", "runs away from lr"], table,
                         markdown),
                  f"{arch}: final val loss by learning rate, median over the finished runs (ran away / finished):",
                  render(["arm"] + [f"lr {lr:g}" for lr in lrs], finals, markdown)]
        if markdown and f"lr-{arch}" in figures:
            parts.append(f"![lr-{arch}]({os.path.relpath(figures[f'lr-{arch}'], markdown_dir)})")
    header = ["arm", "lr", "seed", "status", "val at init", "final val", "max logit", "ran away", "guard trigger",
              "first past guard threshold", f"first past {RUNAWAY_LOGIT:g}"]
    table = [[base, f"{lr:g}", r.seed, r.status, num(r.init_val, ".4f"), num(r.final_val, ".4f"),
              num(r.max_logit, ".4g"), ("yes" if lr_ran_away(r) else "no") if r.finished else "-", num(r.trigger),
              num(r.first_past(r.guard_threshold())), num(r.first_past(RUNAWAY_LOGIT, inclusive=True))]
             for base, lr, name in cells for r in groups[name]]
    parts += [title(3, "Runs of the learning-rate study"), render(header, table, markdown)]
    if markdown:
        commands = [shlex.join(["python", *r.config["command"]]) for _, _, name in cells for r in groups[name]
                    if r.config.get("command")]
        parts += [title(3, "Commands of the learning-rate study"), "```bash\n" + "\n".join(commands) + "\n```"]
    return parts


# --------------------------------------------------------------------------------------------------
# The opening table: one row per rule, read from what the rules computed (their verdicts and lines), so
# that it can say no more than the detail below it does.

VERDICT_WORDS = {"reproduced": "REPRODUCED", "not reproduced": "NOT REPRODUCED", "refuted": "REFUTED",
                 "inconclusive": "INCONCLUSIVE", "not run": "NOT RUN"}   # one spelling, in every table
SIGN_LINE = re.compile(r"sign test, (\S+) (over|worse than) (\S+): (\d+) seeds one way, (\d+) the other(?: of (\d+))?, "
                       r"p = (\S+)"
                       r"(?: \(threshold (\S+)\))? -> (holds|fails)( \(the claim wants it to fail\))?"
                       r"(?: \(\d+ seeds with a run unfinished or missing, counted against\))?$")
COUNT_LINE = re.compile(r"(?:^|: )(\S+): ([^\d(]+?) (\d+)/(\d+) \[95% CI")
DOSE_LINE = re.compile(r"^(\S+) (\S+): max logit .*?coherent 2x higher or earlier collapsed in (\d+) seeds, random sign "
                       r"in (\d+) .*?"
                       r"p = (\S+) \(raises\), (\S+) \(reverses\) -> (.+?);")
QK_SIDE_LINE = re.compile(r"^(\S+): " + re.escape(QK_SIDE_FAILED) + r" (\d+)/(\d+) \[95% CI [^\]]*\].*"
                          r"\(a QK-side action: the claim wants none\)$")
LR_LINE = re.compile(r"^at lr (\S+): .*?(?:(\S+) ran away in (\d+)/(\d+), acted .*?final val - (\S+)'s: mean (\S+) "
                     r"nat, 90% interval \[(\S+), (\S+)\].*?)?-> (holds|fails|inconclusive)$")


def checks(lines, n):
    """The rule's tests as it printed them (n: its seeds): [(for the claim?, p or None, key text, why text,
    the site a dose grid's test is at)]."""
    plain = [re.sub(r" \([^)]*\)", "", line) for line in lines]   # without the asides in parentheses
    counts = {m.group(1): (m.group(2).strip(), m.group(3), m.group(4)) for m in map(COUNT_LINE.search, plain) if m}
    out = []
    for line in lines:
        if m := SIGN_LINE.search(line):
            a, how, b, k, j, of, p, alpha, result, wants_fail = m.groups()
            held = result == "holds"
            why = (f"{a} {counts[a][0]} {counts[a][1]}/{counts[a][2]}; {b} {counts[b][0]} {counts[b][1]}/{counts[b][2]}"
                   if a in counts and b in counts else f"{a} {how} {b} in {k} seeds, the reverse in {j}")
            out.append((held != bool(wants_fail), float(p),
                        f"`{a}` {how} `{b}` in {k} of {of or n} seeds, the reverse in {j}: sign test p = {float(p):.2g} "
                        f"({'<' if held else '>='} {float(alpha or ALPHA):.2g})", why, None))
        elif m := DOSE_LINE.search(line):
            site, dose, up, down, p_up, _, effect = m.groups()
            out.append((effect == "raises", float(p_up), f"{site} dose {dose}: coherent {LOGIT_GAP:g}x higher (or earlier collapsed) in {up} "
                        f"of {n} seeds, random sign in {down}: sign test p = {float(p_up):.2g}", "", site))
        elif m := QK_SIDE_LINE.search(line):
            arm, k, of = m.groups()
            out.append((k == "0", None, f"`{arm}` (QK-side) failed in {k} of {of} seeds: broke down, or "
                        f"ended more than FIX_TOL ({FIX_TOL:g} nat) above QK-norm's val loss (the claim "
                        f"wants 0)",
                        f"{arm} failed {k}/{of}", None))
        elif m := LR_LINE.search(line):
            lr, guard, away, n, ref, mean, lo, hi, result = m.groups()
            out.append((result == "holds", None, f"lr {lr}: " + (
                f"mean gap to `{ref}` {mean} nat, 90% interval [{lo}, {hi}] (margin +-{LOSS_TOL})" if mean else
                "the guard stayed dormant, its losses bit for bit"),
                f"{guard} ran away in {away}/{n}; its mean gap's interval [{lo}, {hi}] is "
                + ("inside" if result == "holds" else "not wholly inside") + f" +-{LOSS_TOL}" if mean else
                "the guard stayed dormant where training was healthy", None))
    return out


def conclusion(lines):
    """The rule's own verdict sentence where it printed one, shortened to its point."""
    for line in lines:
        for start in ("not reproduced at this scale: ", "refuted: ", "inconclusive: ", "coherence raises"):
            if line.startswith(start):
                return line[len(start) if start.endswith(": ") else 0:].split(" (")[0]
        if line.startswith("the shrink alone stopped the runaway"):
            return line.split("): ", 1)[1]
    return ""


def decisive(verdict, lines, n):
    """The test that decided a verdict: a reproduced claim's weakest passing test, else the failing test
    that came closest to passing (p, where it has one; in a dose grid, at a site where none passed);
    None where the lines hold no test."""
    found, passed = checks(lines, n), {c[4] for c in checks(lines, n) if c[0] and c[4]}
    found = [c for c in found if c[0] == (verdict == "reproduced") and (c[0] or c[4] not in passed)] or found
    rank = lambda c: c[1] if c[1] is not None else 1.0
    return (max if verdict == "reproduced" else min)(found, key=rank) if found else None


def row_scale(groups, arms, lrs=None):
    """(the model, steps and seeds of a rule's runs, as their config.json records them; the seeds it judges).
    lrs: the lr study's {lr: the seeds its arms ran there}."""
    configs = [r.config["args"] for a in arms for r in groups.get(a, []) if r.config.get("args")]
    seeds = {r.seed for a in arms if a not in (NO_ERROR, QKNORM_ALONE) for r in groups.get(a, [])}
    pick = lambda key: "/".join(sorted({str(c[key]) for c in configs if c.get(key) is not None},
                                       key=lambda v: (len(v), v)))
    model = f"{pick('arch')} {pick('n_layer')}x{pick('n_embd')}" if all(map(pick, ("arch", "n_layer", "n_embd"))) else ""
    by_horizon = {}   # arms of several horizons (claim 5's and 6's long ones) may have run other seeds
    for a in arms:
        if a not in (NO_ERROR, QKNORM_ALONE):
            for r in groups.get(a, []):
                by_horizon.setdefault(r.config.get("args", {}).get("max_steps"), set()).add(r.seed)
    def plural(n):
        counts = sorted({len(ss) for ss in (lrs or {}).values()})
        if len(counts) < 2:
            return f"{n} seed{'s' * (n != 1)}" + (f" x {len(lrs)} lrs" if lrs else "")
        at = ", ".join(f"{lr:g}" for lr, ss in sorted(lrs.items()) if len(ss) == counts[-1])   # where the most ran
        return f"{counts[0]}-{counts[-1]} seeds x {len(lrs)} lrs ({counts[-1]} for some arms at lr {at})"
    if len(by_horizon) > 1 and None not in by_horizon:
        steps = ", ".join(f"{h} steps x {plural(len(ss))}" for h, ss in sorted(by_horizon.items()))
        return ", ".join(filter(None, [model, steps])), len(seeds)
    return ", ".join(filter(None, [model, pick("max_steps") and f"{pick('max_steps')} steps", plural(len(seeds))])
                     ), len(seeds)


def summary_row(label, verdict, text, scale_text, n):
    """[claim, VERDICT, scale, key number with its test, why]: the test that decided the verdict, and why
    in a few words; a rule of parts ("part 1p on llama: fails") says it of each part."""
    lines = text.splitlines()[1:]
    if verdict == "not run":
        return [label, VERDICT_WORDS[verdict], "-", "-", lines[0] if lines else "no runs"]
    starts = [i for i, line in enumerate(lines) if line.startswith("part ")]
    parts = [(lines[i][len("part "):].rsplit(": ", 1), lines[i + 1:j]) for i, j in zip(starts, starts[1:] + [None])]
    if parts:   # each part's own verdict decides which of its tests to show
        keys = [(name, decisive("reproduced" if ok == "holds" else "not reproduced", part, n)) for (name, ok), part in parts]
        key = "\n".join(f"{name}: {k[2]}" for name, k in keys if k)
        failing = [name for (name, ok), _ in parts if ok == "fails"]
        why = conclusion(lines) or (f"fails in part {' and '.join(failing)}" if failing else "every part holds")
    else:
        found = decisive(verdict, lines, n)
        key, why = found[2] if found else "-", conclusion(lines) or (found[3] if found else "")
    if verdict == "inconclusive" and not conclusion(lines):
        why = "too few seeds for any sign test to reach its threshold"
    return [label, VERDICT_WORDS.get(verdict, verdict.upper()), scale_text, key, why]


def summary(groups, rows, study=None, lr_rows=()):
    """The opening table's rows, from verdicts' rows (and the lr study's groups and lr_verdicts' rows)."""
    arms = {label: arm_list(groups) if callable(arm_list) else arm_list
            for label, _, arm_list, _ in expanded_rules(groups)}
    out = [summary_row(*row, *row_scale(groups, arms[row[0]])) for row in rows]
    cells = lr_cells(study or {})
    for row, (_, _, bases, _) in zip(lr_rows, LR_RULES):
        names = [name for (base, _), name in cells.items() if base in bases]
        seeds_at = {}   # lr -> the seeds its arms ran (rule 2p ran more seeds at the runaway lrs)
        for (base, lr), name in cells.items():
            if base in bases:
                seeds_at.setdefault(lr, set()).update(r.seed for r in study.get(name, []))
        out.append(summary_row(*row, *row_scale(study, names, seeds_at)))
    return out


def build(groups, root, markdown, plots=(), markdown_dir=".", pilots=(), plots_flag=None, study=None,
          study_plots=(), stream=None, stream_plot=None, tokens=None, tokens_plot=None):
    """The report as text (markdown False) or Markdown (markdown: the file's path as given; plots_flag:
    the --plots given, for the command that rewrites it); study: (its folder, its groups), the lr study's;
    stream: (its folder, claim1.load's runs), claim 1 at CPU scale, which then decides claim 1's row;
    tokens: the same at 16x the tokens a step (claim1.TOKENS), reported in a section of its own."""
    known = list(dict.fromkeys(n for _, experiments in CLAIMS.values() for n in experiments))
    order = [n for n in known if n in groups] + sorted(set(groups) - set(known))
    title = (lambda level, text: "#" * level + " " + text) if markdown else (lambda level, text: f"== {text} ==")
    rows = verdicts(groups)
    if stream:   # claim 1 judged at CPU scale, by its pre-registered rule (lab/claim1.py)
        rows = [claim1.rule_row(stream[1]) if row[0] == "1" else row for row in rows]
    lr_rows = lr_verdicts(study[1]) if study else []
    parts = []
    if markdown:
        parts += [title(1, "The paper's claims, judged on this project's own runs"),
                  f"Written by `python -m lab.report {root}"
                  + "".join(f" --pilot {p}" for p, _ in pilots) + (f" --lr-study {study[0]}" if study else "")
                  + (f" --stream {stream[0]}" if stream else "") + (f" --tokens {tokens[0]}" if tokens else "")
                  + f" --markdown {markdown}"
                  + (f" --plots {plots_flag}" if plots_flag else "") + "`, from the runs' logs. One row per rule: "
                  "its verdict, the scale it ran at, the test that decided it (a reproduced claim's weakest passing "
                  "test, else the failing test that came closest to passing) and why. The rules follow, then the "
                  "detail: every test, the learning-rate study, each run and its command."]
    table = summary(groups, rows, study and study[1], lr_rows)
    if stream:
        row = claim1.summary_row(stream[1])
        table = [[row[0], VERDICT_WORDS.get(row[1], row[1].upper()), *row[2:]] if old[0] == "1" else old
                 for old in table]
    parts.append(render(["claim", "verdict", "scale", "key number (n, test)", "why"], table, markdown))
    parts.append(paper_scale(groups, *([study[1]] if study else [])))
    if markdown:
        parts.append(f"QK-Guard's trigger as a detector, scored beside OLMo-core's, Lightning's, llm-foundry's and "
                     f"Megatron-LM's loss-spike rules on the unguarded committed runs (on the collapse, "
                     f"which none of them reads, each swept over its threshold to matched false-alarm rates; "
                     f"the runaway, the "
                     f"trigger's own signal, apart): [lab/DETECTORS.md](lab/DETECTORS.md) (a link from the "
                     f"repository's root), written by "
                     f"`python -m lab.detectors lab/results --markdown lab/DETECTORS.md --plot lab/plots/detectors.png`.")
    shown = lambda table: [[label, VERDICT_WORDS.get(verdict, verdict.upper()), text] for label, verdict, text in table]
    rows, lr_rows = shown(rows), shown(lr_rows)
    parts += [title(2, "Rules"),
              f"ALPHA={ALPHA}, FINAL_WINDOW={FINAL_WINDOW}, LOSS_TOL={LOSS_TOL}, "
              f"RUNAWAY_LOGIT={RUNAWAY_LOGIT:g}, SIGMA_RATIO={SIGMA_RATIO:g}, LOGIT_RATIO={LOGIT_RATIO:g}, "
              f"LOGIT_GAP={LOGIT_GAP:g}, FIX_TOL={FIX_TOL}; a run ran away if it collapsed or "
              f"its max logit reached RUNAWAY_LOGIT; arms are compared seed by seed with an exact one-sided sign "
              f"test over the seeds where they differ; an unfinished or missing run counts against the claim:",
              "\n".join(f"{claim}. {text}." for claim, text, _, _ in RULES)]
    if study:
        parts += ["The learning-rate study's rules (a run ran away if it collapsed, its max logit reached "
                  "RUNAWAY_LOGIT at a logged step, or a loss was not finite; arms are compared seed by seed at the "
                  "same learning rate):", "\n".join(f"{label}. {words}." for label, words, _, _ in LR_RULES)]
    parts += ["What changed in the rules of claims 3 to 6, and why: "
              + "; ".join(f"{claim}: {why}" for claim, why in RULE_CHANGES.items()) + ".",
              "What the first rules said on the first, 300-step logs (commit 988d81c; the verdicts above are "
              "the new rules' on 600-step runs): "
              + "; ".join(f"{claim}: {said}" for claim, said in FIRST_VERDICTS.items()) + ".",
              "What changed in the rules on 2026-12-03, and why (3, 5 and 6 above): "
              + "; ".join(f"{claim}: {why}" for claim, why in V3_CHANGES.items()) + ". What the rules before "
              "(commit 8f7ffca) said on the logs they had: "
              + "; ".join(f"{claim}: {said}" for claim, said in V2_VERDICTS.items()) + ".",
              "What changed on 2026-12-05, and why: "
              + "; ".join(f"{claim}: {why}" for claim, why in V4_CHANGES.items()) + ". What the rules before "
              "(commit b823d3f) said on the logs they had: "
              + "; ".join(f"{claim}: {said}" for claim, said in V3_VERDICTS.items()) + "."]
    if markdown:
        parts += [title(2, "Scale, and what was not run"), scale(groups)]
        cut = cut_arms(groups)
        idle = [s for s in SOURCES if s not in sources_run(groups)]
        if cut or idle:
            parts.append(f"Not run (cut from the sweep; a rule that needs them says \"not run\", or counts them "
                         f"against its claim): {', '.join(cut) or 'nothing of the claims judged'}"
                         + (f"; claims 5 and 6 on the source{'s' if len(idle) > 1 else ''} {', '.join(idle)}"
                            if idle else "") + ".")
    judged = [r for r in rows + lr_rows if r[1] != "NOT RUN"]
    if judged:
        parts += [title(2, "Verdicts at a glance"), "\n".join(
            f"- **{label}: {verdict}**"
            + (f" ({text.splitlines()[0]})" if text else "") + ": "
            + "; ".join(line.replace("sign test, ", "") for line in text.splitlines()
                        if line.startswith(("sign test", "at lr ", "part ", "not reproduced at this scale", "refuted",
                                            "inconclusive:",
                                          "coherence raises", "the shrink alone", "seeds judged"))
                        or "claim wants none" in line)
            for label, verdict, text in judged)]
    parts += [title(2, "Claims"), render(["claim", "verdict", "arms: n, counts [exact 95% interval]; tests"],
                                         rows, markdown)]
    for source in sources_run(groups):
        table = action_rows(groups, source)
        if table:
            parts += [title(2, f"Claim 6's actions on one table ({SOURCE_WORDS[source]})"),
                      "Each action on the seeds rule 6 judges, by the measures it judges them: failed (broke "
                      "down: a "
                      "collapse or logits past RUNAWAY_LOGIT after it acts; then, for a non-QK action, the "
                      "most-grown "
                      "head's sigma(W_q,h) sigma(W_k,h) grew SIGMA_RATIO times as much after the trigger as "
                      "under "
                      "QK-norm, and for a QK-side one, its final val loss ended more than FIX_TOL above "
                      "QK-norm's; "
                      "a run unfinished or missing counted as failed), each part apart, that growth's median "
                      "(for "
                      "every action), and the final val loss less QK-norm's (the long arms against QK-norm "
                      "at the same horizon).",
                      render(["arm", "kind", "failed", "broke down", "QK grew SIGMA_RATIO x QK-norm's",
                              "QK growth after the trigger, median", "val loss - QK-norm's, median"], table, markdown)]
    if any(g.startswith("inject-") for g in groups):
        parts += [title(2, "Dose-response (claims 3 and 4): runs that ran away beyond the no-error run of their "
                           "seed / finished pairs"),
                  render(["site", "coherence"] + [f"dose {d:g}" for d in DOSES], dose_table(groups), markdown)]
        parts += fault_units(root)
    if stream:
        parts.append(title(2, "Claim 1 at CPU scale: the bf16 streaming state, 4 key blocks per row"))
        parts += (claim1.section(stream[1], stream[0], stream_plot, markdown_dir) if markdown else
                  ["\n".join(claim1.judge(stream[1])[1] + claim1.reported(stream[1]))])
    if tokens:
        parts.append(title(2, "Claim 1 at 16x the tokens a step (16,384), 4 key blocks per row"))
        parts += (claim1.section(tokens[1], tokens[0], tokens_plot, markdown_dir, claim1.TOKENS) if markdown else
                  ["\n".join(claim1.judge(tokens[1], claim1.TOKENS)[1] + claim1.reported(tokens[1], claim1.TOKENS))])
    if study:
        parts += lr_section(*study, lr_rows, markdown, title, study_plots, markdown_dir)
    parts.append(title(2, "Runs"))
    for name in order:
        parts += [title(3, name), "Medians: " + group_line(name, groups[name]),
                  render(GROUP_HEADER, group_rows(groups[name]), markdown)]
    if markdown and plots:
        parts += [title(2, "Plots"), "\n\n".join(f"![{os.path.splitext(os.path.basename(p))[0]}]"
                                                  f"({os.path.relpath(p, markdown_dir)})" for p in plots)]
    for path, pilot in pilots:
        parts += [title(2, f"Pilot ({path}): runs that fixed a grid or a horizon, on seeds the claims do not use"),
                  scale(pilot),
                  render(["arm", "seed", "status", "max logit", f"first step past the guard's threshold / at "
                          f"{RUNAWAY_LOGIT:g}", "sigma growth q / others", "final val"],
                         pilot_rows(pilot), markdown)]
    if markdown:
        commands = [shlex.join(["python", *r.config["command"]]) for n in order for r in groups[n]
                    if r.config.get("command")]
        parts += [title(2, "Commands"), "```bash\n" + "\n".join(commands) + "\n```"]
    return "\n\n".join(parts) + "\n"


# --------------------------------------------------------------------------------------------------
# Plots: loss, max logit, sigma(W_q) and the most-grown other weight against step (a trigger is a
# vertical line, a collapse an x), and survival curves (the fraction of seeds not yet collapsed)

# Files written whole, and together (main): each to <path>.tmp, all renamed into place only once every one was
# written; a failure (or a refusal) before then leaves every file as it was.

STAGED = None   # inside written_together(): [(temp file, its path)]


@contextlib.contextmanager
def written_together():
    global STAGED
    STAGED = []
    try:
        yield
        for tmp, path in STAGED:
            os.replace(tmp, path)
    finally:
        for tmp, _ in STAGED:   # those not renamed: an error came first
            with contextlib.suppress(OSError):
                os.remove(tmp)
        STAGED = None


def _place(tmp, path):
    if STAGED is None:
        os.replace(tmp, path)
    else:
        STAGED.append((tmp, path))


def save_figure(fig, png, **kw):
    """fig as a PNG at png, whole: a temp file renamed at once, or with the rest (written_together)."""
    fig.savefig(png + ".tmp", format="png", **kw)
    _place(png + ".tmp", png)


def save_text(path, text):
    with open(path + ".tmp", "w") as f:
        f.write(text)
    _place(path + ".tmp", path)


def _pyplot(quiet=False):
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
        return plt
    except ImportError:
        if not quiet:   # quiet: said once already
            print("plots skipped: matplotlib is not installed (pip install matplotlib, then run lab.report again)")
        return None


def survival(runs):
    """Kaplan-Meier [(step, fraction not yet collapsed)]; uncollapsed runs censored at their end."""
    # at equal steps the collapses come first: a run censored at step t was still at risk at t
    times = sorted(((r.collapse_step if r.collapsed and r.collapse_step is not None else (r.steps or [0])[-1]),
                    not r.collapsed) for r in runs)
    at_risk, alive, curve = len(times), 1.0, [(0, 1.0)]
    for step, censored in times:
        if not censored:
            alive *= (at_risk - 1) / at_risk
            curve.append((step, alive))
        at_risk -= 1
    return curve


PANELS = {"loss": ("train loss (nat per token)", "linear"), "logit": ("max attention logit", "log"),
          "sigma": ("max sigma(W_q) over layers", "log"), "others": ("max sigma of W_v, W_o, MLP", "log")}


def plot_runs(runs, axes, colors, panels=tuple(PANELS)):
    """One line per run in each panel; the guard trigger a dotted vertical line, a collapse an x."""
    def series(run, panel):
        if panel == "others":
            return [finite_max([run.sigmas[k][i] for k in run.other_kinds]) or math.nan for i in range(len(run.steps))]
        return getattr(run, panel)
    drawn = set()   # the panels with a value to draw: a log scale of nothing but NaN cannot be drawn
    for run in runs:
        color, k = colors[run.group], run.seed[4:]
        style = ["-", "--", ":", "-."][(int(k) - 1) % 4 if k.isdigit() else 0]
        for ax, panel in zip(axes, panels):
            ys = [y if y is not None and math.isfinite(y) and y > 0 else math.nan for y in series(run, panel)]
            if any(not math.isnan(y) for y in ys):
                drawn.add(panel)
            ax.plot(run.steps, ys, color=color, ls=style, lw=1, label=f"{run.group} {run.seed}".strip())
            if run.trigger is not None:
                ax.axvline(run.trigger, color=color, ls=":", lw=0.8)
            if run.collapse_step is not None and run.steps:
                i = min(range(len(ys)), key=lambda j: abs(run.steps[j] - run.collapse_step))
                ax.plot([run.steps[i]], [finite_max(ys) if math.isnan(ys[i]) else ys[i]], "x", color=color,
                        ms=10, mew=2)
    for ax, panel in zip(axes, panels):
        label, scale = PANELS[panel]
        ax.set(ylabel=label, yscale=scale if panel in drawn else "linear")
        if panel not in drawn:
            ax.text(0.5, 0.5, "no finite positive value logged", transform=ax.transAxes, ha="center",
                    fontsize=9)
        ax.grid(alpha=0.3)
    axes[-1].set_xlabel("step")


# claims 1, 2 and 7's arms that no pattern below names
NAMED_ARMS = {"bf16-safemax": "bf16 state with safemax (the prior work's fix)",
              "bf16-qknorm-always": "bf16 state, QK-norm from step 0",
              "bf16-qknorm-always-aa": "bf16 state, QK-norm from step 0, run again beside key tiles of 64",
              "bf16-qknorm-always-tile64": "bf16 state, QK-norm from step 0, key tiles of 64 (not an A/A)",
              "bf16-qknorm-always-t1": "bf16 state, QK-norm from step 0, 1 CPU thread (A/A)",
              "bf16-qknorm-always-t2": "bf16 state, QK-norm from step 0, 2 CPU threads (A/A)",
              "bf16-guard": "bf16 state, QK-Guard",
              "fp32-guard": "fp32 state, QK-Guard", "fp32-qknorm-always": "fp32 state, QK-norm from step 0",
              "state-only": "bf16 state, no other rounding", "logits-only": "fp32 state, logits rounded to bf16",
              "pv-only": "fp32 state, P V rounded to bf16", "standard": "fp32 state, no other rounding",
              "bf16-all": "bf16 state, logits, P V and the backward rounded"}


def action_words(rest):
    """'guard-<action>' in words, from guard.py's registry (claim 6's actions); else rest as it is."""
    action = ACTIONS.get(rest[len("guard-"):])
    return action.words if action else rest


def arm_words(name):
    """An arm's name in words, for legends: 'inject-mlp-out-0.1-c1-qkfix' -> 'mlp-out error 0.1,
    coherent, with the QK-only fix'."""
    if name.endswith("-long-gain"):
        return f"{arm_words(name[:-len('-gain')])}, run again with its norm gain logged"
    if name.endswith("-long"):
        return f"{arm_words(name[:-len('-long')])}, {LONG_STEPS} steps"
    if name == NO_ERROR:
        return "no error (fp32 state)"
    if name.startswith("llama-"):
        return "llama, " + arm_words(name[len("llama-"):])
    if name in NAMED_ARMS:
        return NAMED_ARMS[name]
    if name.startswith("inject-"):
        for site in SITES:
            if name.startswith(f"inject-{site}-"):
                dose, coherence = name[len(f"inject-{site}-"):].split("-")[:2]
                kind = "coherent" if coherence == "c1" else f"sign kept with p {coherence[1:]}"
                return f"{site} error {dose}, {kind}" + (", with the QK-only fix" if name.endswith("-qkfix") else "")
    for source, words in SOURCE_WORDS.items():
        if name == source:
            return words
        if name.startswith(source + "-"):
            rest = name[len(source) + 1:]
            rest = {"guard": "QK-Guard (QK-norm)", "probe-topk": "probe: QK's top-k removed",
                    "probe-equal": "equal energy removed elsewhere", "probe-fixed": "a fixed random QK subspace "
                    "removed", "probe-shrink": "the whole update shrunk as much",
                    "probe-nextk": "QK's next k directions removed", "probe-v-topk": "W_v's top-k removed", "probe-mlp-topk": "the MLP's top-k removed"}.get(
                        rest, f"QK-Guard's trigger, then {action_words(rest)}")
            short = {"bf16": "bf16 state", "assay": "injected delta error", "lr": "lr 3e-2"}.get(source, source)
            return f"{short}: {rest}"
    return name


def arm_horizon(runs):
    """The steps an arm's runs were set to run (the longest of them)."""
    return max((r.horizon() for r in runs), default=0)


def horizon_columns(groups, arms):
    """A claim figure's columns, [(steps shown, its arms)]: one of every arm, or, where some arms run
    more than twice as long as the shortest (claim 6's -long arms), two: the shortest horizon with
    every arm, and the longest with the arms that ran it, so that neither squeezes the other."""
    steps = {n: arm_horizon(groups[n]) for n in arms}
    short, longest = min(steps.values()), max(steps.values())
    if longest <= 2 * short:
        return [(longest, arms)]
    return [(short, arms), (longest, [n for n in arms if steps[n] > 2 * short])]


def arm_medians(runs, panel):
    """(steps, per step the median over runs of panel's value, nan where none is positive)."""
    steps = sorted({s for r in runs for s in r.steps})
    by_run = [dict(zip(r.steps, getattr(r, panel))) for r in runs]
    values = [median([v.get(s) for v in by_run]) for s in steps]
    return steps, [y if y is not None and y > 0 else math.nan for y in values]


def plot_claim(plt, groups, label, arms, png):
    """One claim's figure: per arm the median over seeds of loss, max logit and sigma(W_q) against step,
    and its survival curve; in two columns where the arms' horizons differ (horizon_columns)."""
    columns = horizon_columns(groups, arms)
    fig, axes = plt.subplots(4, len(columns), sharex="col", figsize=(9 if len(columns) == 1 else 15, 12),
                             squeeze=False)
    panels = ("loss", "logit", "sigma")
    lines = {(n, panel): arm_medians([r for r in groups[n] if r.steps], panel) for n in arms for panel in panels}
    for col, (steps, shown) in enumerate(columns):
        ax = axes[:, col]
        for n in shown:
            color = f"C{arms.index(n) % 10}"
            for a, panel in zip(ax[:3], panels):
                a.plot(*lines[n, panel], color=color, lw=1.2, label=arm_words(n))
            curve = survival(groups[n])   # drawn on to the arm's last logged step: no collapse after its last
            ax[3].step(*zip(*curve, (lines[n, "loss"][0][-1], curve[-1][1])), where="post", color=color)
        for a, panel in zip(ax[:3], panels):
            a.set(ylabel=PANELS[panel][0].replace(" (", "\n("), yscale=PANELS[panel][1])
        ax[3].set(ylabel="fraction of seeds\nnot collapsed", ylim=(-0.05, 1.05), xlabel="step (optimizer updates)",
                  xlim=(0, steps))
        for a in ax:
            a.grid(alpha=0.3)
        if len(columns) > 1:
            ax[0].set_title(f"the first {steps} steps: every arm" if col == 0 else
                            f"the whole {steps} steps: the {len(shown)} arms run that long", fontsize=10)
    fig.legend(handles=axes[0][0].get_lines(), loc="upper center", bbox_to_anchor=(0.5, 0), ncol=len(columns),
               fontsize=8)
    split = f"; left the first {columns[0][0]} steps, right the whole {columns[1][0]}" if len(columns) > 1 else ""
    fig.suptitle(f"claim {label}: each line the median over seeds of one arm{split}", fontsize=11, y=0.985)
    fig.subplots_adjust(top=0.95, bottom=0.08)   # room for the title, and for the legend below the axes
    save_figure(fig, png, dpi=110, bbox_inches="tight")
    plt.close(fig)


def plot_claims(groups, out_dir):
    """Claims 1, 2, 5, 6, 7: per arm, the median over seeds of loss, max logit and sigma(W_q)
    against step, and survival curves (plot_claim); claims 3 and 4: dose-response curves
    (dose_response.png, plot_dose_response)."""
    plt = _pyplot()
    if plt is None:
        return []
    os.makedirs(out_dir, exist_ok=True)
    saved = []
    judged = {row[0] for row in verdicts(groups) if row[1] != "not run"}
    rules = {label: arms for label, _, arms, _ in expanded_rules(groups) if not callable(arms) and label in judged}
    for label, arms in rules.items():
        arms = [n for n in dict.fromkeys(arms) if any(r.steps for r in groups.get(n, []))]
        if not arms or label in ("2v",):
            continue
        saved.append(os.path.join(out_dir, f"claim{label.replace(' ', '').replace('(', '-').replace(')', '')}.png"))
        plot_claim(plt, groups, label, arms, saved[-1])
    if dose_outcomes(groups):
        saved.append(os.path.join(out_dir, "dose_response.png"))
        plot_dose_response(plt, groups, saved[-1])
    return saved


OFF_SCALE_STEP = 2.5   # the dose figure's band above the logit scale: one row per curve, this factor apart


def plot_dose_response(plt, groups, png):
    """Claims 3 and 4, a column per site. Top: the fraction of seeds that ran away beyond their no-error run,
    by its max logit (solid) and, dashed where it adds any, by a collapse too (dose_outcomes). Bottom: the scale
    claim 4 judges on, each run's max logit over its seed's no-error run's (median, range shaded); a run that
    collapsed or diverged ranks above every logit, so it is kept as a row of marks above the scale, with the
    count (dose_logits)."""
    outcomes, logits = dose_outcomes(groups), dose_logits(groups)
    sites = list(dict.fromkeys(site for site, _ in outcomes))
    labels = list(dict.fromkeys(label for _, label in outcomes))   # a color and an off-scale row each
    finite = [x for key in outcomes for values, _ in logits[key].values() for x in values]
    low, high = (min(finite), max(finite)) if finite else (1.0, 1.0)
    row_y = {label: high * OFF_SCALE_STEP ** (i + 1) for i, label in enumerate(labels)}
    band = (high * OFF_SCALE_STEP ** 0.5, high * OFF_SCALE_STEP ** (len(labels) + 0.6))
    any_off = any(off for key in outcomes for _, off in logits[key].values())
    fig, axes = plt.subplots(2, len(sites), figsize=(4.8 * len(sites), 8), sharex="col", sharey="row", squeeze=False)
    for col, site in enumerate(sites):
        top, bottom = axes[0][col], axes[1][col]
        handles, dashed, off_here = [], False, False
        for i, label in enumerate(labels):
            if (site, label) not in outcomes:
                continue
            color = f"C{i}"
            cells = [(d, a, b, n) for d, (a, b, n) in zip(DOSES, outcomes[site, label]) if n]
            xs = [d for d, *_ in cells]
            top.plot(xs, [a / n for _, a, _, n in cells], "o-", color=color)
            if any(b for _, _, b, _ in cells):
                dashed = True
                top.plot(xs, [(a + b) / n for _, a, b, n in cells], "o--", color=color, mfc="none")
            handles.append(plt.Line2D([], [], color=color, marker="o", label=curve_words(site, label)))
            values = [logits[site, label][d][0] + [math.inf] * logits[site, label][d][1] for d in xs]
            at = lambda v: row_y[label] if v == math.inf else v   # off the scale: the curve's row above it
            meds = [at(statistics.median(v)) if v else math.nan for v in values]
            bottom.plot(xs, meds, "-", color=color)
            bottom.plot([x for x, m in zip(xs, meds) if m != row_y[label]], [m for m in meds if m != row_y[label]],
                        "o", color=color)
            bottom.fill_between(xs, [at(min(v)) if v else math.nan for v in values],
                                [at(max(v)) if v else math.nan for v in values], color=color, alpha=0.15, lw=0)
            for d, v in zip(xs, values):
                off = sum(x == math.inf for x in v)
                if off:
                    off_here = True
                    bottom.plot([d], [row_y[label]], "^", color=color, ms=8)
                    bottom.annotate(f"{off}/{len(v)}", (d, row_y[label]), xytext=(6, 0), textcoords="offset points",
                                    fontsize=7, color=color, va="center")
        top.set_title(f"error at {site}\n(its QK-only fix: {fix_words(site)})", fontsize=9)
        bottom.set(xscale="log", yscale="log", xlabel="error size per step (rms / signal rms)")
        bottom.axhline(1.0, color="grey", lw=0.8, ls=":")
        if any_off:   # the band above the scale, its ticks left off (a row there is a count, not a logit)
            bottom.axhspan(*band, color="0.92", zorder=0)
            bottom.set_ylim(low / 2, band[1])
            ticks = [10.0 ** k for k in range(math.floor(math.log10(low / 2)), math.floor(math.log10(band[0])) + 1)
                     if low / 2 <= 10.0 ** k]
            bottom.set_yticks(ticks + [math.sqrt(band[0] * band[1])],
                              [f"$10^{{{round(math.log10(t))}}}$" for t in ticks] + ["collapsed"])
        dose_ticks = [d for d in DOSES if any(n for (s, _), cells in outcomes.items() if s == site
                                              for dd, (*_, n) in zip(DOSES, cells) if dd == d)]
        bottom.set_xticks(dose_ticks, [f"{d:g}" for d in dose_ticks])
        bottom.minorticks_off()
        for ax in (top, bottom):
            ax.grid(alpha=0.3)
        grey = dict(color="grey")
        handles += [plt.Line2D([], [], ls="-", label=f"top, solid: max logit >= {RUNAWAY_LOGIT:g} and >= "
                               f"{LOGIT_RATIO:g}x the no-error run's", **grey)]
        if dashed:
            handles.append(plt.Line2D([], [], ls="--", marker="o", mfc="none", label="top, dashed: that, or a "
                                      "collapse of the loss with logits under that bar", **grey))
        handles.append(plt.Line2D([], [], ls=":", lw=0.8, label="bottom: 1 = the no-error run's max logit", **grey))
        if off_here:
            handles.append(plt.Line2D([], [], ls="", marker="^", label="bottom, grey band: collapsed or diverged "
                                      "(off the scale), k/n seeds", **grey))
        bottom.legend(handles=handles, fontsize=7, loc="upper center", bbox_to_anchor=(0.5, -0.16))
    axes[0][0].set(ylabel="fraction of seeds that ran away\nbeyond the no-error run (same seed)", ylim=(-0.05, 1.05))
    axes[1][0].set(ylabel="max attention logit over the no-error\nrun's, same seed (median, range)")
    save_figure(fig, png, dpi=110, bbox_inches="tight")
    plt.close(fig)


AA_AGAIN, AA_TWIN = AA_ARMS["bf16-qknorm-always"]   # the lr study's A/A pair, where run: bf16-qknorm-always
                    # at 1 and 2 CPU threads, side by side: their gap is the noise floor
GAP_LEVEL = 0.90                       # the lr figures' interval around the mean paired gap


def seed_gaps(groups, name, ref):
    """[(seed, final val loss of folder `name`'s run less folder ref's)] over the seeds where both finished:
    a seed only one of them ran is left out. Not finite where either diverged (end_val)."""
    theirs = {r.seed: r for r in groups.get(ref, []) if done(r)}
    return [(r.seed, end_val(r) - end_val(theirs[r.seed])) for r in groups.get(name, []) if done(r)
            and r.seed in theirs]


def runaway_lrs(groups, prefix=""):
    """The lrs where the unguarded bf16 arm ran away in a majority of its seeds (an unfinished run counted
    as ran away), the lrs where rule 2p judges the guard against always-on QK-norm."""
    return sorted(lr for (base, lr), name in lr_cells(groups).items() if base == prefix + "bf16" and groups[name]
                  and 2 * sum(not done(r) or lr_ran_away(r) for r in groups[name]) > len(groups[name]))


def lr_gaps(groups, prefix=""):
    """The paired gap rule 2p judges: ({runaway lr: seed_gaps(bf16-guard, bf16-qknorm-always)}, {lr: the
    A/A twin's seed_gaps to the arm run again beside it} at each lr both ran, read from the folders: lr_cells knows
    only the study's own arms)."""
    always = lambda lr: lr_name(prefix + "bf16-qknorm-always", lr)
    guard = {lr: seed_gaps(groups, lr_name(prefix + "bf16-guard", lr), always(lr))
             for lr in runaway_lrs(groups, prefix)}
    aa = {lr: seed_gaps(groups, name, lr_name(prefix + AA_AGAIN, lr)) for name in groups
          for base, lr in [split_lr(name)] if base == prefix + AA_TWIN and lr is not None and groups[name]
          and groups.get(lr_name(prefix + AA_AGAIN, lr))}
    return guard, aa


def plot_gaps(ax, gaps, color, label, shift, mean_label=None):
    """One arm's paired gaps in the lr figure's third panel: each seed a dot, the mean with its GAP_LEVEL
    interval an error bar (its legend entry mean_label), `shift` decades right of its lr; a gap not finite
    (a diverged run) counted at the top."""
    for i, (lr, pairs) in enumerate(sorted(gaps.items())):
        values = [g for _, g in pairs if math.isfinite(g)]
        x = lr * 10 ** shift
        spread = [x * 10 ** (0.08 * (j / max(1, len(values) - 1) - 0.5)) for j in range(len(values))]
        ax.plot(spread, values, "o", color=color, ms=3.5, alpha=0.6, label=f"{label}: one seed" if i == 0 else None)
        if values:
            mean, lo, hi = mean_interval(values, GAP_LEVEL)
            ax.errorbar([x], [mean], yerr=[[mean - lo], [hi - mean]] if math.isfinite(lo) else None, fmt="D",
                        color=color, mec="k", capsize=4, ms=6, lw=1.5,
                        label=mean_label if i == 0 else None)
        if len(values) < len(pairs):
            ax.annotate(f"{len(pairs) - len(values)} not finite", (x, 1), xycoords=("data", "axes fraction"),
                        ha="center", va="top", fontsize=7, color=color)


def plot_lr_study(groups, out_dir, quiet=False):
    """The lr study, one figure per architecture (lr-gpt2.png, lr-llama.png), as Wortsman et al. 2023's
    Figure 1: final val loss and max attention logit against the learning rate, per arm the median over its
    finished runs and their min-max range shaded; the guard's threshold and RUNAWAY_LOGIT marked. A third
    panel: the paired gap rule 2p judges (lr_gaps), with the A/A arm's where it ran."""
    plt = _pyplot(quiet)
    if plt is None:
        return []
    os.makedirs(out_dir, exist_ok=True)
    saved, cells = [], lr_order(groups)
    for arch, prefix in ARCHS.items():
        mine = [(base, lr, [r for r in groups[name] if done(r)]) for base, lr, name in cells if lr_arch(base) == arch]
        if not any(runs for _, _, runs in mine):
            continue
        fig, axes = plt.subplots(3, 1, sharex=True, figsize=(7, 11.5), gridspec_kw={"height_ratios": [1, 1, 0.9]})
        arms = [a for a in LR_STUDY_ARMS if any(base == prefix + a and runs for base, _, runs in mine)]
        for i, arm in enumerate(arms):
            at = [(lr, runs) for base, lr, runs in mine if base == prefix + arm and runs]
            for ax, value in zip(axes, (lambda r: r.final_val, lambda r: r.max_logit)):
                points = [(lr, [v for v in map(value, runs) if v is not None and math.isfinite(v) and v > 0])
                          for lr, runs in at]
                points = [(lr, vs) for lr, vs in points if vs]   # a diverged run's nan or inf is not drawn
                if points:
                    xs = [lr for lr, _ in points]
                    ax.plot(xs, [statistics.median(vs) for _, vs in points], "o-", color=f"C{i}", lw=1.5,
                            label=LR_WORDS[arm] if ax is axes[0] else None)   # one legend of the arms
                    ax.fill_between(xs, [min(vs) for _, vs in points], [max(vs) for _, vs in points],
                                    color=f"C{i}", alpha=0.15, lw=0)
        guarded = [r.guard_threshold() for base, _, runs in mine if base.endswith("-guard") for r in runs]
        threshold = statistics.median(guarded) if guarded else GUARD_THRESHOLD
        axes[1].axhline(threshold, color="k", ls=":", lw=1, label=f"QK-Guard's threshold ({threshold:g})")
        axes[1].axhline(RUNAWAY_LOGIT, color="k", ls="--", lw=1, label=f"{RUNAWAY_LOGIT:g}: a runaway "
                        f"(RUNAWAY_LOGIT)")
        # the third panel: QK-Guard against always-on QK-norm, seed by seed, where rule 2p compares them
        guard, aa = lr_gaps(groups, prefix)
        gap_ax = axes[2]
        gap_ax.axhspan(-LOSS_TOL, LOSS_TOL, color="C2", alpha=0.15, lw=0,
                       label=f"within {LOSS_TOL:g} nat (LOSS_TOL): rule 2p's tolerance")
        gap_ax.axhline(0.0, color="k", lw=0.8)
        color = f"C{arms.index('bf16-guard')}" if "bf16-guard" in arms else "C3"
        plot_gaps(gap_ax, guard, color, "QK-Guard less QK-norm always", shift=0.0,
                  mean_label=f"the mean, its {GAP_LEVEL:.0%} interval (Student t)")
        plot_gaps(gap_ax, aa, "grey", "A/A: QK-norm always at 2 less 1 CPU threads", shift=0.12)
        if not guard:
            gap_ax.text(0.5, 0.5, "no learning rate where bf16 state ran away in a majority of seeds",
                        transform=gap_ax.transAxes, ha="center", fontsize=8)
        axes[0].set(xscale="log", ylabel="final val loss (nat per token)")
        axes[1].set(xscale="log", yscale="log", ylabel="max attention logit (over all logged steps)")
        gap_ax.set(ylabel="final val loss, QK-Guard less\nQK-norm always, same seed (nat)", xlabel="learning rate")
        for ax in axes:
            ax.grid(alpha=0.3)
            ax.legend(fontsize=7)
        counts = sorted({len(runs) for _, _, runs in mine if runs})   # 8 seeds, 16 where rule 2p needed them
        seeds = f"{counts[0]}" if len(counts) == 1 else f"{counts[0]} to {counts[-1]}"
        steps = "/".join(str(s) for s in sorted({r.horizon() for _, _, runs in mine for r in runs}))
        axes[0].set_title(f"{arch}, a CPU-scale proxy, {steps} steps per run: each line the median over its "
                          f"{seeds} seeds of one arm (shaded: their min to max)", fontsize=9)
        gap_ax.set_title("the paired gap rule 2p judges, at each lr where bf16 state ran away in a majority of seeds"
                         + ("; grey: the A/A pair's, at the lrs it ran" if aa else ""), fontsize=9)
        saved.append(os.path.join(out_dir, f"lr-{arch}.png"))
        save_figure(fig, saved[-1], dpi=110, bbox_inches="tight")
        plt.close(fig)
    return saved


def describe(run):
    """A run in words for a legend, from its config.json: "guard off", "guard on (qknorm from step 23)"
    (the first update its action changed); the folder name where there is no config."""
    args = run.config.get("args", {})
    if not args:
        return os.path.basename(os.path.normpath(run.path))
    if args.get("guard") != "on":
        return "guard off"
    action = {"qknorm": "QK-norm", "qkclip": "QK-Clip"}.get(args.get("guard_action", "qknorm"), args.get("guard_action"))
    return f"guard on ({action} from step {run.acting_from})" if run.acting_from is not None else \
        f"guard on ({action}), never fired"


def runs_title(runs):
    """What a few runs share, for their figure's title: the learning rate, preset and softmax state, and
    "a max-logit runaway" only where one of them ran away; the marks drawn, only where there are some."""
    shared = lambda key: "/".join(dict.fromkeys(format(a[key], "g") if isinstance(a[key], float) else str(a[key])
                                                for r in runs for a in [r.config.get("args", {})] if key in a))
    setting = ", ".join(f"{shared(key)} {word}" for key, word in (("preset", "preset"), ("accum", "state"))
                        if shared(key))   # what another script's runs (lab.attach_demo) do not record, left out
    marks = [("dotted line: the guard's trigger", any(r.trigger is not None for r in runs)),
             ("x: a collapse", any(r.collapse_step is not None for r in runs))]
    return (f"{'a max-logit runaway at' if any(map(ran_away, runs)) else 'training at'} lr {shared('lr') or '?'}"
            + (f" ({setting})" if setting else "") + "".join(f"; {words}" for words, drawn in marks if drawn))


def plot_some_runs(paths, png, labels=None):
    """--runs: one figure of a few run folders (say the demo's unguarded and guarded runs), labelled
    by `labels` or describe(), titled by what drives them (runs_title)."""
    plt = _pyplot()
    if plt is None:
        return None
    runs = [Run(os.path.abspath(p)) for p in paths]
    for i, run in enumerate(runs):
        run.group, run.seed = labels[i] if labels else describe(run), ""
    fig, axes = plt.subplots(3, 1, sharex=True, figsize=(8, 8))
    plot_runs(runs, axes, {r.group: f"C{i}" for i, r in enumerate(runs)}, panels=("loss", "logit", "sigma"))
    thresholds = sorted({r.guard_threshold() for r in runs if r.config.get("args", {}).get("guard") == "on"})
    for value in thresholds:
        axes[1].axhline(value, color="grey", ls="--", lw=0.8, label=f"the guard's threshold ({value:g})")
    for ax, words in zip(axes, ("train loss (nat per token)", "max attention logit\n(over layers and heads)",
                                "top singular value of W_q\n(max over layers)")):
        ax.set_ylabel(words)
    axes[2].yaxis.set_major_formatter(plt.FuncFormatter(lambda v, _: f"{v:g}"))   # 30, not 3 x 10^1
    axes[2].yaxis.set_minor_formatter(plt.FuncFormatter(lambda v, _: f"{v:g}" if f"{v:g}"[0] in "235" else ""))
    axes[-1].set_xlabel("step (optimizer updates)")
    axes[0].legend(fontsize=8)
    if thresholds:
        axes[1].legend(handles=axes[1].get_lines()[-len(thresholds):], fontsize=8, loc="center right")
    axes[0].set_title(runs_title(runs), fontsize=9)
    save_figure(fig, png, dpi=110, bbox_inches="tight")
    plt.close(fig)
    return png


def judged_claims(markdown):
    """How many rows of a report's opening table (summary) have a verdict other than NOT RUN; markdown: its
    text, or the path of a file (0 if there is none)."""
    if "\n" not in markdown:
        try:
            with open(markdown, errors="replace") as f:
                markdown = f.read()
        except OSError:
            return 0
    rows = markdown.split("\n| claim | verdict |", 1)[1:]
    table = rows[0].split("\n\n", 1)[0].splitlines()[2:] if rows else []   # less the header's rest and | --- |
    return sum(line.split("|")[2].strip() != VERDICT_WORDS["not run"] for line in table if line.count("|") > 2)


def evidence(markdown):
    """{(section, arm folder): {seed folders}}: the runs a report was made from, read from its run tables
    (the claims' Runs, the lr study's, the pilots': a section is its heading less the folder in brackets);
    markdown: its text, or the path of a file ({} if there is none)."""
    if "\n" not in markdown:
        try:
            with open(markdown, errors="replace") as f:
                markdown = f.read()
        except OSError:
            return {}
    runs, section, heading, header = {}, None, None, None
    for line in markdown.splitlines():
        if line.startswith("#"):
            level, _, words = line.partition(" ")
            section = re.sub(r" \(.*", "", words) if level == "##" else section
            heading, header = words, None
            continue
        if not line.startswith("|"):
            header = None
            continue
        cells = [cell.strip() for cell in line.strip().strip("|").split("|")]
        if header is None:
            header = cells
            continue
        seed = cells[header.index("seed")] if "seed" in header and len(cells) == len(header) else ""
        if re.fullmatch(r"seed\d+", seed):
            arm = cells[header.index("arm")] if "arm" in header else heading
            if "lr" in header:
                arm = lr_name(arm, float(cells[header.index("lr")]))
            runs.setdefault((section, arm), set()).add(seed)
    return runs


def lost_evidence(path, text, most=3):
    """Why `text` must not replace the report at `path`: the runs that file was made from which this one
    lacks, per arm and seed (fewer seeds or arms; a one-seed verdict still counts as judged), or fewer
    claims judged; None if neither."""
    old, new = evidence(path), evidence(text)
    lacking = [(section, arm, seeds, new.get((section, arm), set())) for (section, arm), seeds in old.items()
               if seeds - new.get((section, arm), set())]
    if lacking:
        said = "; ".join(f"{arm} ({section}): {len(seeds)} seeds, here {len(here)}"
                         for section, arm, seeds, here in lacking[:most])
        more = f" and {len(lacking) - most} more arms" if len(lacking) > most else ""
        return f"it was made from runs this report lacks: {said}{more}"
    if judged_claims(text) < judged_claims(path):
        return f"it judges {judged_claims(path)} claims, this report {judged_claims(text)}"
    return None


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("root", nargs="?", help="the sweep's --out-root, e.g. runs/claims")
    p.add_argument("--markdown", metavar="FILE", help="also write Markdown, e.g. RESULTS.md")
    p.add_argument("--plots", metavar="DIR",
                   help="the plots' folder (default: plots/ beside --markdown, else the root)")
    p.add_argument("--pilot", action="append", default=[], metavar="DIR",
                   help="a pilot's runs, <DIR>/<experiment>/seed<k>/, tabled apart (repeatable)")
    p.add_argument("--lr-study", metavar="DIR", help="the learning-rate study's runs (lab.sweep --lrs), "
                   "<DIR>/<arm>-lr<lr>/seed<k>/: claims 1, 2 and 7 as a CPU-scale proxy, in a section of their own")
    p.add_argument("--stream", metavar="DIR", help="claim 1 at CPU scale, the stream preset's runs "
                   "(lab/claim1.py): <DIR>/<bf16|fp32|bf16-safemax>/seed<k>/; it decides claim 1's row")
    p.add_argument("--tokens", metavar="DIR", help="claim 1 at 16x the tokens a step (lab/claim1.py, study "
                   "tokens): <DIR>/<arm>-lr<lr>/seed<k>/, in a section of its own")
    p.add_argument("--runs", nargs="+", metavar="DIR", help="plot these run folders instead")
    p.add_argument("--png", default="runs.png", help="--runs: the figure's file (default runs.png)")
    p.add_argument("--labels", nargs="+", metavar="TEXT",
                   help="--runs: the legend's words, one per run (default: from each run's config)")
    p.add_argument("--force", action="store_true",
                   help="--markdown: write it even if the file it replaces was made from runs (arms, seeds) "
                        "this report lacks, or judges more claims")
    args = p.parse_args(argv)
    if args.runs:
        missing = [d for d in args.runs if not any(os.path.exists(os.path.join(d, name))
                                                   for name in ("log.jsonl", "log.jsonl.gz"))]
        if missing:
            p.error(f"no log.jsonl in {', '.join(missing)}: give run folders that train.py wrote")
        if args.labels and len(args.labels) != len(args.runs):
            p.error(f"--labels: give one per run ({len(args.runs)}), got {len(args.labels)}")
        if not_a_folder(os.path.dirname(os.path.abspath(args.png))):
            p.error(f"--png {args.png}: {not_a_folder(os.path.dirname(os.path.abspath(args.png)))} is a file, not a "
                    f"folder: give another path")
        os.makedirs(os.path.dirname(os.path.abspath(args.png)), exist_ok=True)
        png = plot_some_runs(args.runs, args.png, args.labels)
        if png:
            print(f"plot: {png}")
        return 0
    if args.root is None or not os.path.isdir(args.root):
        p.error(f"{args.root} is not a folder: give the sweep's --out-root (or --runs DIR ...)")
    for d in args.pilot:
        if not os.path.isdir(d):
            p.error(f"--pilot {d} is not a folder: give a pilot's runs, <DIR>/<experiment>/seed<k>/")
    if args.stream is not None and not os.path.isdir(args.stream):
        p.error(f"--stream {args.stream} is not a folder: give the stream sweep's runs, <DIR>/<arm>/seed<k>/")
    if args.tokens is not None and not os.path.isdir(args.tokens):
        p.error(f"--tokens {args.tokens} is not a folder: give the tokens sweep's runs, <DIR>/<arm>-lr<lr>/seed<k>/")
    if args.lr_study is not None and not os.path.isdir(args.lr_study):
        p.error(f"--lr-study {args.lr_study} is not a folder: give the study's runs, <DIR>/<arm>-lr<lr>/seed<k>/")
    if args.markdown:   # before the work: appending, so an existing file is kept as it is
        try:
            existed = os.path.exists(args.markdown)
            os.makedirs(os.path.dirname(os.path.abspath(args.markdown)), exist_ok=True)
            open(args.markdown, "a").close()
            if not existed:
                os.remove(args.markdown)
        except OSError as e:
            # makedirs says "File exists" of a file where a folder of the path should be
            why = "not a folder" if isinstance(e, (FileExistsError, NotADirectoryError)) else e.strerror or str(e)
            where = f": {e.filename}" if e.filename else ""
            p.error(f"--markdown {args.markdown}: cannot write it ({why}{where}): give a writable path")
    plots_dir = args.plots or (os.path.join(os.path.dirname(os.path.abspath(args.markdown)), "plots")
                               if args.markdown else args.root)
    if not_a_folder(plots_dir):
        p.error(f"--plots {plots_dir}: {not_a_folder(plots_dir)} is a file, not a folder: give another path")
    groups = load_runs(args.root)
    if not groups:
        if args.markdown:   # a report of nothing would replace the file with "not run" lines
            p.error(f"no runs under {args.root} (expected <experiment>/seed<k>/log.jsonl): {args.markdown} left "
                    f"as it is; give the folder that holds the runs")
        print(f"no runs under {args.root} (expected <experiment>/seed<k>/log.jsonl)")
    pilots = [(d, load_runs(d)) for d in args.pilot]
    study = (args.lr_study, load_runs(args.lr_study)) if args.lr_study is not None else None
    stream = (args.stream, claim1.load(args.stream)) if args.stream is not None else None
    tokens = (args.tokens, claim1.load(args.tokens, claim1.TOKENS)) if args.tokens is not None else None
    print(build(groups, args.root, markdown=False, pilots=pilots, study=study, stream=stream, tokens=tokens))
    markdown_dir = os.path.dirname(os.path.abspath(args.markdown)) if args.markdown else None
    if args.markdown and not args.force:   # before any file is drawn: the run tables need no figure
        refused = lost_evidence(args.markdown, build(groups, args.root, markdown=args.markdown, pilots=pilots,
                                                     plots_flag=args.plots, study=study, stream=stream, tokens=tokens))
        if refused:   # the folders given hold less than the file's (a typo in the root, one-seed copies)
            p.error(f"--markdown {args.markdown}: {refused}: left as it is, and its figures; give the "
                    f"folders its opening line names, or pass --force to write it anyway")
    stream_plot = os.path.join(plots_dir, "claim1-stream.png") if stream else None
    tokens_plot = os.path.join(plots_dir, "claim1-tokens.png") if tokens else None
    with written_together():   # the figures and the Markdown, each whole, all or none
        plots = plot_claims(groups, plots_dir)
        study_plots = plot_lr_study(study[1], plots_dir, quiet=True) if study else []
        for runs, path, which in ((stream, stream_plot, claim1.STREAM), (tokens, tokens_plot, claim1.TOKENS)):
            if path and _pyplot(quiet=True):
                os.makedirs(plots_dir, exist_ok=True)
                claim1.plot(runs[1], path, which, save=save_figure)
                print(f"plot: {path}")
        if args.markdown:
            os.makedirs(markdown_dir, exist_ok=True)
            save_text(args.markdown, build(groups, args.root, markdown=args.markdown, plots=plots,
                                           markdown_dir=markdown_dir, pilots=pilots, plots_flag=args.plots,
                                           study=study, study_plots=study_plots, stream=stream,
                                           stream_plot=stream_plot, tokens=tokens, tokens_plot=tokens_plot))
    for path in plots + study_plots:
        print(f"plot: {path}")
    if args.markdown:
        print(f"markdown: {args.markdown}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
