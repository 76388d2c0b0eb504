"""
Read a sweep's runs and say, claim by claim, whether the paper's claims reproduced, and how sure that is.

    python report.py runs/claims                          # tables on the console, PNG plots into runs/claims
    python report.py runs/claims --markdown RESULTS.md    # also Markdown: tables, date, hardware, commands, and the
                                                          # plots (into plots/ beside it, so the links survive a commit)
    python report.py runs/claims --plots figures/         # the plots elsewhere (they need matplotlib)
    python report.py --runs runs/A runs/B --png fig.png   # loss, max logit, sigma(W_q) of a few runs, one figure

Reads every <root>/<experiment>/seed<k>/ that train.py wrote (log.jsonl, config.json; see sweep.py). Arms are
compared seed by seed (sweep.py gives every arm the same seeds). A run that did not finish, or a seed missing from
an arm that another arm of the claim ran, counts against the claim: it is scored the way that hurts the claim.
"""
import argparse
import glob
import json
import math
import os
import shlex
import statistics
import time

from sweep import CLAIMS, COHERENCES, DONE, DOSES, SITES, inject_arm, read_log

# ---------------------------------------------------------------------------------------------------------------
# The verdict rules' constants.
ALPHA = 0.05             # a contrast holds at one-sided p < ALPHA (exact sign test over the seeds where arms differ)
FINAL_WINDOW = 5         # final train loss = mean of the last FINAL_WINDOW logged losses
LOSS_TOL = 0.03          # nat: the paper's largest gap between QK-Guard and always-on QK-norm
RUNAWAY_LOGIT = 1000.0   # a runaway's max attention logit (H200 emulation: healthy runs peaked at 52-137, the
                         # runaways reached 1808 and 10240; Wortsman et al. saw divergence past 1e4)
SIGMA_RATIO = 2.0        # "through the QK channel": sigma(W_q or W_k) grew more than SIGMA_RATIO times as much as
                         # any other weight matrix's (v, o, MLP in, MLP out)
NON_QK_KINDS = ("v", "o", "mlp_in", "mlp_out")


# ---------------------------------------------------------------------------------------------------------------
# Exact statistics, no dependencies: the one-sided sign test and Clopper-Pearson intervals.

def binom_tail(k, n):
    """P(X >= k) for X ~ Binomial(n, 1/2)."""
    return sum(math.comb(n, i) for i in range(k, n + 1)) / 2 ** n if n else 1.0


def sign_test(pairs):
    """pairs: (a, b) booleans per seed. One-sided test of "a happens where b does not more often than the reverse":
    (a-only count, b-only count, p)."""
    a_only = sum(a and not b for a, b in pairs)
    b_only = sum(b and not a for a, b in pairs)
    return a_only, b_only, binom_tail(a_only, a_only + b_only)


def clopper_pearson(k, n, alpha=ALPHA):
    """Exact two-sided 1 - alpha interval for a rate of k in n (bisection on the binomial tails)."""
    def cdf(p, j):   # P(X <= j) for X ~ Binomial(n, p)
        return sum(math.comb(n, i) * p ** i * (1 - p) ** (n - i) for i in range(j + 1))

    def solve(f):    # the p in [0, 1] where the increasing f crosses alpha / 2
        lo, hi = 0.0, 1.0
        for _ in range(60):
            mid = (lo + hi) / 2
            lo, hi = (mid, hi) if f(mid) < alpha / 2 else (lo, mid)
        return (lo + hi) / 2
    if n == 0:
        return 0.0, 1.0
    lower = 0.0 if k == 0 else solve(lambda p: 1 - cdf(p, k - 1))
    upper = 1.0 if k == n else 1 - solve(lambda p: cdf(1 - p, k))
    return lower, upper


# ---------------------------------------------------------------------------------------------------------------
# Reading runs

def finite_max(values):
    """The max without NaNs (an inf stays: a blown-up value is news), or None."""
    values = [v for v in values if v is not None and not math.isnan(v)]
    return max(values) if values else None


class Run:
    """One run folder, summarized: what the tables and the rules read."""

    def __init__(self, path):
        self.path, self.group, self.seed = path, os.path.basename(os.path.dirname(path)), os.path.basename(path)
        try:
            with open(os.path.join(path, "config.json")) as f:
                self.config = json.load(f)
        except (OSError, ValueError):
            self.config = {}
        records = read_log(path)
        events = [r for r in records if "event" in r]
        steps = [r for r in records if "event" not in r and "loss" in r]
        end = events[-1] if events and events[-1]["event"] == "end" else {}
        self.status = end.get("status") or ("in progress" if records else "empty log")
        self.finished = self.status in DONE
        self.steps, self.loss = [r["step"] for r in steps], [r["loss"] for r in steps]
        nan_if_none = lambda v: math.nan if v is None else v
        # per kind, the max over layers at each logged step
        self.sigmas = {kind: [nan_if_none(finite_max(r.get(f"sigma_{kind}", []))) for r in steps]
                       for kind in ("q", "k", *NON_QK_KINDS)}
        self.sigma = self.sigmas["q"]
        self.logit = [nan_if_none(finite_max(sum(r.get("max_logit", []), []))) for r in steps]  # layers, heads
        self.max_sigma, self.max_logit = finite_max(self.sigma), finite_max(self.logit)
        first = lambda kind: next((r["step"] for r in events if r["event"] == kind), None)
        self.collapse_step = first("collapse") if first("collapse") is not None else end.get("collapse_step")
        self.collapsed = self.status == "collapsed" or self.collapse_step is not None
        self.trigger = first("guard_trigger")
        if self.trigger is None:
            self.trigger = (end.get("guard_trigger") or {}).get("step")
        # the first update the action changed (the check is deferred: later than the crossing)
        self.acting_from = next((r.get("active_from", r["step"]) for r in events if r["event"] == "guard_trigger"),
                                self.trigger)
        tail = self.loss[-FINAL_WINDOW:]
        self.final_train = sum(tail) / len(tail) if tail else None
        evals = [r["val_loss"] for r in events if r["event"] == "eval"]
        self.final_val = evals[-1] if evals else end.get("val_loss")

    def growth(self, kind):
        """How many times its first logged value sigma(kind) grew to, at most (nan if not logged)."""
        values = [v for v in self.sigmas[kind] if not math.isnan(v)]
        return max(values) / values[0] if values and values[0] > 0 else math.nan

    def qk_and_other_growth(self):
        """(growth of sigma(W_q or W_k), the most-grown other kind's: None where none was logged)."""
        return max(self.growth("q"), self.growth("k")), finite_max([self.growth(k) for k in NON_QK_KINDS])

    def logit_after(self, step):
        return finite_max([v for s, v in zip(self.steps, self.logit) if s > step]) or 0.0


def load_runs(root):
    """group -> its runs, seeds in numeric order."""
    groups = {}
    for path in sorted(glob.glob(os.path.join(root, "*", "seed*")), key=lambda p: (len(p), p)):
        if os.path.isdir(path):
            run = Run(path)
            groups.setdefault(run.group, []).append(run)
    return groups


# ---------------------------------------------------------------------------------------------------------------
# The words of the rules. A predicate reads one finished run; `outcomes` scores a whole arm seed by seed.

def collapsed(run): return run.collapsed
def triggered(run): return run.trigger is not None
def ran_away(run): return run.collapsed or (run.max_logit or 0.0) >= RUNAWAY_LOGIT


def qk_specific(run):
    """The runaway went through the QK channel: sigma(W_q or W_k) grew more than SIGMA_RATIO times as much as the
    most-grown other weight matrix. False where the other kinds were not logged."""
    qk, other = run.qk_and_other_growth()
    return other is not None and not math.isnan(qk) and qk > SIGMA_RATIO * other


class Claim:
    """The runs of one claim, by arm and seed, and the counting the rules share."""

    def __init__(self, groups, arms):
        self.runs = {a: {r.seed: r for r in groups.get(a, [])} for a in {*groups, *arms}}
        self.seeds = sorted({s for a in arms for s in self.runs[a]}, key=lambda s: (len(s), s))

    def outcomes(self, arm, pred, claim_wants):
        """Per seed: pred(run) for a finished run; for an unfinished or missing one, the value that hurts the
        claim (claim_wants is the value the claim hopes for in this arm)."""
        out = []
        for seed in self.seeds:
            run = self.runs[arm].get(seed)
            out.append(pred(run) if run is not None and run.finished else not claim_wants)
        return out

    def unfinished(self, arm):
        return sum(not (self.runs[arm].get(s) and self.runs[arm][s].finished) for s in self.seeds)

    def count(self, arm, name, pred, claim_wants):
        """A line: arm, name, k/n with its exact 95% interval; returns (line, outcomes)."""
        out = self.outcomes(arm, pred, claim_wants)
        lo, hi = clopper_pearson(sum(out), len(out))
        left = self.unfinished(arm)
        return (f"{arm}: {name} {sum(out)}/{len(out)} [95% CI {lo:.2f}-{hi:.2f}]"
                + (f" ({left} unfinished, counted against)" if left else "")), out

    def contrast(self, a, a_pred, b, b_pred, name, alpha=ALPHA):
        """Does a's event happen where b's does not (seed by seed)? The claim wants a's event and not b's."""
        la, oa = self.count(a, name, a_pred, True)
        lb, ob = self.count(b, name, b_pred, False)
        k, j, p = sign_test(list(zip(oa, ob)))
        holds = p < alpha
        return holds, [la, lb, f"sign test, {a} over {b}: {k} seeds one way, {j} the other, p = {p:.3g}"
                       f"{'' if alpha == ALPHA else f' (threshold {alpha:.3g})'} -> {'holds' if holds else 'fails'}"]


def collapses_vs_not(c, faulty, *repaired):
    holds, lines = True, []
    for arm in repaired:
        ok, more = c.contrast(faulty, collapsed, arm, collapsed, "collapsed")
        holds, lines = holds and ok, lines + more
    return holds, lines


def guard_prevents(c, unguarded, guarded, reference):
    """The guard arm collapses in no seed, fewer than the unguarded arm (sign test), triggers before each
    unguarded collapse of the same seed, and ends within LOSS_TOL of always-on QK-norm in every seed."""
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
    """On healthy training the guard fires in no seed, and while dormant it changes nothing (final losses within
    LOSS_TOL of the unguarded healthy run, seed by seed)."""
    line, fired = c.count(guarded, "triggered", triggered, False)
    gaps = []
    for s in c.seeds:
        g, h = c.runs[guarded].get(s), c.runs[healthy].get(s)
        if g and g.finished and g.trigger is not None:
            continue                     # counted above, as a false trigger
        both = all(r and r.finished and r.final_val is not None for r in (g, h))
        gaps.append(abs(g.final_val - h.final_val) if both else math.inf)    # unfinished: against the claim
    cost = max(gaps) if gaps else math.inf
    return not any(fired) and cost <= LOSS_TOL, [
        line, f"dormant cost, largest |val loss - {healthy}'s| over {len(gaps)} untriggered seeds (an unfinished "
              f"one counts as infinite): {cost:.4f}"]


def dose_contrast(c, site, better, worse, better_pred, worse_pred, name):
    """The contrast at each dose of the grid that was run (a sweep may run part of it); holds at some dose with
    p < ALPHA / the number of doses run (Bonferroni)."""
    doses = [d for d in DOSES if c.runs.get(better(site, d)) or c.runs.get(worse(site, d))]
    holds, lines = False, [f"{site}: doses run {', '.join(f'{d:g}' for d in doses) or 'none'}"]
    for dose in doses:
        a, b = better(site, dose), worse(site, dose)
        ok, more = c.contrast(a, better_pred, b, worse_pred, name, alpha=ALPHA / len(doses))
        holds, lines = holds or ok, lines + more
    return holds, lines


def runs_away_through_qk(run):
    return ran_away(run) and qk_specific(run)


def injection_claim(c, site):
    """Claim 3 at one site: the coherent error runs away through the QK channel where its QK-only fix does not."""
    return dose_contrast(c, site, lambda s, d: inject_arm(s, d, 1.0)[0], lambda s, d: inject_arm(s, d, 1.0, True)[0],
                         runs_away_through_qk, ran_away, "ran away (through QK for the first)")


def coherence_claim(c, site):
    """Claim 4 at one site: coherent errors run away where random-sign ones (coherence 0.5) do not."""
    return dose_contrast(c, site, lambda s, d: inject_arm(s, d, 1.0)[0], lambda s, d: inject_arm(s, d, 0.5)[0],
                         ran_away, ran_away, "ran away")


def probe_holds(c):
    """The top-k probe stops the runaway of the unprobed bf16 run, while each control still runs away."""
    holds, lines = c.contrast("bf16", ran_away, "bf16-probe-topk", ran_away, "ran away")
    for control in ("bf16-probe-fixed", "bf16-probe-v-topk", "bf16-probe-mlp-topk"):
        ok, more = c.contrast(control, ran_away, "bf16-probe-topk", ran_away, "ran away")
        holds, lines = holds and ok, lines + more[::2]
    costs = []
    for arm in ("bf16-probe-topk", "bf16-probe-fixed", "bf16-probe-v-topk", "bf16-probe-mlp-topk", "bf16-probe-equal"):
        diffs = [c.runs[arm][s].final_val - c.runs["fp32"][s].final_val for s in c.seeds
                 if all(s in c.runs.get(a, {}) and c.runs[a][s].finished and c.runs[a][s].final_val is not None
                        for a in (arm, "fp32"))]
        costs.append(f"{arm} {statistics.median(diffs):+.3f}" if diffs else f"{arm} n/a")
    return holds, lines + ["loss cost, median final val loss - fp32's: " + ", ".join(costs)]


def broke_down(run):
    """Collapsed, or its logits reached RUNAWAY_LOGIT after the guard's trigger (anywhere, if it never fired)."""
    return run.collapsed or run.logit_after(run.trigger if run.trigger is not None else -1) >= RUNAWAY_LOGIT


def non_qk_actions_fail(c):
    """Each non-QK action, at the same trigger, fails where QK-norm does not: it collapses, runs away after the
    trigger, or ends more than LOSS_TOL above QK-norm's val loss on the same seed."""
    qknorm = c.runs["bf16-guard"]

    def failed(run):
        ref = qknorm.get(run.seed)
        worse = ref is None or not ref.finished or ref.final_val is None or run.final_val is None or \
            run.final_val > ref.final_val + LOSS_TOL
        return broke_down(run) or worse
    holds, lines = True, []
    for arm in ("bf16-guard-lr-drop", "bf16-guard-clip", "bf16-guard-softcap"):
        ok, (arm_line, qknorm_line, test_line) = c.contrast(arm, failed, "bf16-guard", broke_down, "failed")
        shown = [arm_line, test_line] if lines else [arm_line, qknorm_line, test_line]   # QK-norm's count once
        holds, lines = holds and ok, lines + shown
    for arm in ("bf16-guard-qkclip", "bf16-guard-fp32-accum"):
        if c.runs.get(arm):
            lines.append(c.count(arm, "failed", failed, False)[0] + " (for comparison, not judged)")
    return holds, lines


def joined(*results):
    """Several checks as one: all must hold."""
    return all(ok for ok, _ in results), [line for _, lines in results for line in lines]


# One rule per row: (claim, the rule in words, its arms, the check). The words print beside the verdicts.
def _inject_arms(coherences, fixes, sites):
    """The arms of the dose grid a rule reads: of the doses with any run at each site (all of them where none
    ran, so that "not run" names them)."""
    def arms(groups):
        out = []
        for site in sites:
            by_dose = {d: [inject_arm(site, d, c, f)[0] for c in coherences for f in fixes] for d in DOSES}
            run = [d for d, names in by_dose.items() if any(groups.get(n) for n in names)]
            out += [n for d in (run or DOSES) for n in by_dose[d]]
        return out
    return arms


RULES = [
    ("1", "bf16 state collapses, fp32 state and bf16-safemax do not: bf16 collapses where fp32 does not, and where "
          "bf16-safemax does not, each by a sign test at p < ALPHA",
     ["bf16", "fp32", "bf16-safemax"], lambda c: collapses_vs_not(c, "bf16", "fp32", "bf16-safemax")),
    ("2", "QK-Guard prevents it: bf16-guard collapses in no seed, fewer than bf16 (sign test), triggers before "
          "each bf16 collapse of the same seed, and ends within LOSS_TOL of bf16-qknorm-always in every seed",
     ["bf16", "bf16-guard", "bf16-qknorm-always"], lambda c: guard_prevents(c, "bf16", "bf16-guard",
                                                                             "bf16-qknorm-always")),
    ("2v", "the guard is valid: on healthy training (fp32 state) it fires in no seed, and while dormant it changes "
           "the final val loss by at most LOSS_TOL",
     ["fp32", "fp32-guard"], lambda c: guard_is_dormant(c, "fp32", "fp32-guard")),
    ("3", "an error outside attention (mlp-out, coherence 1) runs away through the QK channel where the same "
          "error with QK-norm does not, at some dose of the grid (sign test, p < ALPHA / the doses run)",
     _inject_arms((1.0,), (False, True), ["mlp-out"]), lambda c: injection_claim(c, "mlp-out")),
    ("3+", "positive control: the same at the backward's delta, where the kernel fault lands, against W_q, W_k "
           "trained on the error-free gradient",
     _inject_arms((1.0,), (False, True), ["delta"]), lambda c: injection_claim(c, "delta")),
    ("4", "sign-coherence, not size: at both sites, coherence 1 runs away where coherence 0.5 does not, at some "
          "dose (sign test, p < ALPHA / the doses run)",
     _inject_arms((1.0, 0.5), (False,), list(SITES)), lambda c: joined(*(coherence_claim(c, site) for site in SITES))),
    ("5", "the causal probe: bf16 runs away where bf16-probe-topk does not, and so does each control (a fixed "
          "random QK subspace, W_v's top-k, the MLP's top-k) (sign tests, p < ALPHA)",
     ["bf16", "bf16-probe-topk", "bf16-probe-fixed", "bf16-probe-v-topk", "bf16-probe-mlp-topk"], probe_holds),
    ("6", "non-QK actions fail: lr-drop, clip and softcap at the guard's trigger each fail (collapse, logits past "
          "RUNAWAY_LOGIT after the trigger, or a val loss more than LOSS_TOL above QK-norm's) where QK-norm does "
          "not (sign tests, p < ALPHA). Caveats: Adam rescales a clipped gradient back, so clip acts mostly "
          "through the moments; a bf16 softcap piles logits at the cap, making ties of its own",
     ["bf16-guard", "bf16-guard-lr-drop", "bf16-guard-clip", "bf16-guard-softcap"], non_qk_actions_fail),
    ("7", "the same on llama: llama-bf16 collapses where llama-fp32 does not, llama-bf16-guard prevents it within "
          "LOSS_TOL of always-on QK-norm, and llama-fp32-guard stays dormant",
     ["llama-bf16", "llama-fp32", "llama-bf16-guard", "llama-bf16-qknorm-always", "llama-fp32-guard"],
     lambda c: joined(collapses_vs_not(c, "llama-bf16", "llama-fp32"),
                      guard_prevents(c, "llama-bf16", "llama-bf16-guard", "llama-bf16-qknorm-always"),
                      guard_is_dormant(c, "llama-fp32", "llama-fp32-guard"))),
]


def verdicts(groups):
    """One row per rule: [claim, verdict, what was measured]. A rule with an arm that has no run folder at all is
    "not run" (a dose-grid rule: when no arm of its grid has one); otherwise it is judged, every missing or
    unfinished run counted against it, and "inconclusive" where it fails with too few seeds for any sign test to
    reach p < ALPHA (4 or fewer)."""
    rows = []
    for claim, text, arm_list, rule in RULES:
        arms = arm_list(groups) if callable(arm_list) else arm_list
        title = {"2v": "QK-Guard stays dormant on healthy training, at no cost",
                 "3+": "positive control: the backward's delta, where the kernel fault reaches the gradient"}.get(
                     claim, CLAIMS[int(claim[0])][0])
        missing = [a for a in arms if not groups.get(a)]
        if missing and (not callable(arm_list) or len(missing) == len(arms)):   # a grid: part of it may run
            rows.append([claim, "not run", f"{title}\nno runs of {', '.join(missing[:3])}"
                                           f"{f' and {len(missing) - 3} more arms' if len(missing) > 3 else ''}"])
            continue
        c = Claim(groups, arms)
        holds, lines = rule(c)
        verdict = "reproduced" if holds else "not reproduced"
        if not holds and binom_tail(len(c.seeds), len(c.seeds)) >= ALPHA:
            # no sign test over so few seeds can reach p < ALPHA: a failed rule says nothing against the claim
            verdict = "inconclusive"
            lines.append(f"{len(c.seeds)} seeds: even all of them one way give p = "
                         f"{binom_tail(len(c.seeds), len(c.seeds)):.3g} >= {ALPHA}; run at least 5 (sweep.py --seeds)")
        rows.append([claim, verdict, "\n".join([title] + lines)])
    return rows


# ---------------------------------------------------------------------------------------------------------------
# Tables: built once, rendered as aligned text or as Markdown

def num(x, spec=".4g"):
    return "-" if x is None else format(x, spec)


def median(values):
    values = [v for v in values if v is not None]
    return statistics.median(values) if values else None


def group_line(name, runs):
    """A group in one line: collapses, median collapse step, maxima and losses (medians), trigger steps."""
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


def dose_table(groups):
    """Claims 3 and 4: runaways per (site, coherence or fix) and dose, as k/n over the finished runs."""
    rows = []
    for site in SITES:
        for label, name in [(f"c{c:g}", lambda d, c=c: inject_arm(site, d, c)[0]) for c in COHERENCES] + \
                [("c1 + QK-only fix", lambda d: inject_arm(site, d, 1.0, True)[0])]:
            cells = []
            for dose in DOSES:
                done = [r for r in groups.get(name(dose), []) if r.finished]
                cells.append(f"{sum(map(ran_away, done))}/{len(done)}" if done else "-")
            rows.append([site, label] + cells)
    return rows


def render(header, rows, markdown):
    """Cells may hold several lines: <br> in Markdown, continuation lines in text."""
    if markdown:
        lines = [header, ["---"] * len(header)] + [[c.replace("\n", "<br>") for c in r] for r in rows]
        return "\n".join("| " + " | ".join(r) + " |" for r in lines)
    cells = [[c.split("\n") for c in r] for r in [header] + rows]
    widths = [max(len(line) for r in cells for line in r[i]) for i in range(len(header))]
    return "\n".join("  ".join((c[k] if k < len(c) else "").ljust(w) for c, w in zip(r, widths)).rstrip()
                     for r in cells for k in range(max(map(len, r))))


def build(groups, root, markdown, plots=(), markdown_dir="."):
    known = list(dict.fromkeys(n for _, experiments in CLAIMS.values() for n in experiments))
    order = [n for n in known if n in groups] + sorted(set(groups) - set(known))
    title = (lambda level, text: "#" * level + " " + text) if markdown else (lambda level, text: f"== {text} ==")
    parts = []
    if markdown:
        versions = [r.config.get("versions", {}) for rs in groups.values() for r in rs if r.config]
        hardware = sorted({f"{v.get('gpu') or v.get('device', '?')} (torch {v.get('torch', '?')})" for v in versions})
        parts += [title(1, "The paper's claims, reproduced at minute scale"),
                  f"Written by `python report.py {root}` on {time.strftime('%Y-%m-%d %H:%M')}. "
                  f"Hardware: {', '.join(hardware) or 'unknown'}."]
    parts += [title(2, "Claims"), render(["claim", "verdict", "arms: n, counts [exact 95% interval]; tests"],
                                         verdicts(groups), markdown),
              f"Rules (ALPHA={ALPHA}, FINAL_WINDOW={FINAL_WINDOW}, LOSS_TOL={LOSS_TOL}, "
              f"RUNAWAY_LOGIT={RUNAWAY_LOGIT:g}, SIGMA_RATIO={SIGMA_RATIO:g}; a run ran away if it collapsed or "
              f"its max logit reached RUNAWAY_LOGIT; arms are compared seed by seed with an exact one-sided sign "
              f"test over the seeds where they differ; an unfinished or missing run counts against the claim):",
              "\n".join(f"{claim}. {text}." for claim, text, _, _ in RULES)]
    if any(g.startswith("inject-") for g in groups):
        parts += [title(2, "Dose-response (claims 3 and 4): runs that ran away / finished runs"),
                  render(["site", "coherence"] + [f"dose {d:g}" for d in DOSES], dose_table(groups), markdown)]
    parts.append(title(2, "Runs"))
    for name in order:
        parts += [title(3, name), "Medians: " + group_line(name, groups[name]),
                  render(GROUP_HEADER, group_rows(groups[name]), markdown)]
    if markdown and plots:
        parts += [title(2, "Plots"), "\n\n".join(f"![{os.path.splitext(os.path.basename(p))[0]}]"
                                                  f"({os.path.relpath(p, markdown_dir)})" for p in plots)]
    if markdown:
        commands = [shlex.join(["python", *r.config["command"]]) for n in order for r in groups[n]
                    if r.config.get("command")]
        parts += [title(2, "Commands"), "```bash\n" + "\n".join(commands) + "\n```"]
    return "\n\n".join(parts) + "\n"


# ---------------------------------------------------------------------------------------------------------------
# Plots: per claim, loss / max logit / sigma(W_q) / the most-grown other weight against step (trigger a vertical
# line, collapse an x), and the survival curves (fraction of seeds not yet collapsed)

def _pyplot():
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
        return plt
    except ImportError:
        print("plots skipped: matplotlib is not installed (pip install matplotlib, then run report.py again)")
        return None


def survival(runs):
    """Kaplan-Meier: [(step, fraction not yet collapsed)]; runs that did not collapse are censored at their end."""
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


PANELS = {"loss": ("train loss", "linear"), "logit": ("max attention logit", "log"),
          "sigma": ("max sigma(W_q) over layers", "log"), "others": ("max sigma of W_v, W_o, MLP", "log")}


def plot_runs(runs, axes, colors, panels=tuple(PANELS)):
    """One line per run in each panel; the guard trigger a dotted vertical line, a collapse an x."""
    def series(run, panel):
        if panel == "others":
            return [finite_max([run.sigmas[k][i] for k in NON_QK_KINDS]) or math.nan for i in range(len(run.steps))]
        return getattr(run, panel)
    for run in runs:
        color, k = colors[run.group], run.seed[4:]
        style = ["-", "--", ":", "-."][(int(k) - 1) % 4 if k.isdigit() else 0]
        for ax, panel in zip(axes, panels):
            ys = [y if y is not None and math.isfinite(y) and y > 0 else math.nan for y in series(run, panel)]
            ax.plot(run.steps, ys, color=color, ls=style, lw=1, label=f"{run.group} {run.seed}".strip())
            if run.trigger is not None:
                ax.axvline(run.trigger, color=color, ls=":", lw=0.8)
            if run.collapse_step is not None and run.steps:
                i = min(range(len(ys)), key=lambda j: abs(run.steps[j] - run.collapse_step))
                ax.plot([run.steps[i]], [finite_max(ys) if math.isnan(ys[i]) else ys[i]], "x", color=color,
                        ms=10, mew=2)
    for ax, panel in zip(axes, panels):
        label, scale = PANELS[panel]
        ax.set(ylabel=label, yscale=scale)
        ax.grid(alpha=0.3)
    axes[-1].set_xlabel("step")


def plot_claims(groups, out_dir):
    plt = _pyplot()
    if plt is None:
        return []
    os.makedirs(out_dir, exist_ok=True)
    saved = []
    for number, (title, experiments) in CLAIMS.items():
        arms = [n for n in experiments if groups.get(n)]
        runs = [r for n in arms for r in groups[n] if r.steps]
        if not runs:
            continue
        colors = {n: f"C{i % 10}" for i, n in enumerate(arms)}
        fig, axes = plt.subplots(5, 1, sharex=True, figsize=(9, 14))
        plot_runs(runs, axes[:4], colors)
        for n in arms:
            steps, alive = zip(*survival(groups[n]))
            axes[4].step(steps, alive, where="post", color=colors[n], label=n)
        axes[4].set(ylabel="fraction not collapsed", ylim=(-0.05, 1.05))
        axes[4].grid(alpha=0.3)
        axes[0].set_title(f"claim {number}: {title}", fontsize=10)
        axes[0].legend(fontsize=6, ncol=2)
        saved.append(os.path.join(out_dir, f"claim{number}.png"))
        fig.savefig(saved[-1], dpi=110, bbox_inches="tight")
        plt.close(fig)
    return saved


def plot_some_runs(paths, png):
    """--runs: one figure of a few run folders (the demo's unguarded and guarded runs, say)."""
    plt = _pyplot()
    if plt is None:
        return None
    runs = [Run(os.path.abspath(p)) for p in paths]
    for run, path in zip(runs, paths):
        run.group, run.seed = os.path.basename(os.path.normpath(path)), ""
    fig, axes = plt.subplots(3, 1, sharex=True, figsize=(8, 8))
    plot_runs(runs, axes, {r.group: f"C{i}" for i, r in enumerate(runs)}, panels=("loss", "logit", "sigma"))
    axes[0].legend(fontsize=8)
    axes[0].set_title("dotted line: guard trigger; x: collapse", fontsize=9)
    fig.savefig(png, dpi=110, bbox_inches="tight")
    plt.close(fig)
    return png


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("root", nargs="?", help="the sweep's --out-root, e.g. runs/claims")
    p.add_argument("--markdown", metavar="FILE", help="also write the tables as Markdown (for RESULTS.md)")
    p.add_argument("--plots", metavar="DIR",
                   help="where the PNG plots go (default: plots/ beside --markdown, else the runs folder)")
    p.add_argument("--runs", nargs="+", metavar="DIR", help="plot these run folders instead (with --png)")
    p.add_argument("--png", default="runs.png", help="--runs: the figure's file (default runs.png)")
    args = p.parse_args(argv)
    if args.runs:
        missing = [d for d in args.runs if not os.path.exists(os.path.join(d, "log.jsonl"))]
        if missing:
            p.error(f"no log.jsonl in {', '.join(missing)}: give run folders that train.py wrote")
        png = plot_some_runs(args.runs, args.png)
        if png:
            print(f"plot: {png}")
        return 0
    if args.root is None or not os.path.isdir(args.root):
        p.error(f"{args.root} is not a folder: give the sweep's --out-root (or --runs DIR ...)")
    groups = load_runs(args.root)
    if not groups:
        print(f"no runs under {args.root} (expected <experiment>/seed<k>/log.jsonl)")
    print(build(groups, args.root, markdown=False))
    markdown_dir = os.path.dirname(os.path.abspath(args.markdown)) if args.markdown else None
    plots = plot_claims(groups, args.plots or (os.path.join(markdown_dir, "plots") if args.markdown else args.root))
    for path in plots:
        print(f"plot: {path}")
    if args.markdown:
        os.makedirs(markdown_dir, exist_ok=True)
        with open(args.markdown, "w") as f:
            f.write(build(groups, args.root, markdown=True, plots=plots, markdown_dir=markdown_dir))
        print(f"markdown: {args.markdown}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
