"""
What every rule shares: the runs of one rule by arm and seed, counted the way that hurts the claim (Claim); a
rule's verdict from its check (judge_rule); the refusal to judge runs that differ in more than their arms'
own flags (mixed); and the number format of the rules' lines.

A rule's check takes a Claim and returns (holds, lines): holds is True, False, "inconclusive" or "refuted"
(a result against the claim); lines are its counts and tests, in words, one a line, as RESULTS.md's records
print them.
"""
import json
import statistics

from lab.loading import RUN_SPECIFIC, arm_flags, ran_away
from lab.stats import ALPHA, binom_tail, clopper_pearson, sign_test
from lab.thresholds import RUNAWAY_LOGIT


# --------------------------------------------------------------------------------------------------
# The runs of one rule, and the counting the rules share


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


def joined(*results):
    """Several checks as one: all must hold; where none fails and one is undecided ("inconclusive"), so is
    the whole."""
    oks = [ok for ok, _ in results]
    ok = False if False in oks else next((o for o in oks if isinstance(o, str)), True)
    return ok, [line for _, lines in results for line in lines]


def part(name, result):
    """One part of a joined rule, its lines under a heading line."""
    ok, lines = result
    return ok, [f"part {name}: {ok if isinstance(ok, str) else 'holds' if ok else 'fails'}"] + lines


# --------------------------------------------------------------------------------------------------
# Runs a rule may not judge together


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


def refuse(refused):
    """Stop (SystemExit, one line) if any rule's runs were mixed: [(label, why)]."""
    if refused:
        (label, why), more = refused[0], ", ".join(label for label, _ in refused[1:])
        raise SystemExit(f"error: rule {label}'s runs {why}" + (f" (and rule{'s' * (',' in more)} {more} too)"
                                                                if more else "")
                         + ": put each kind in a folder of its own and report them apart")


# --------------------------------------------------------------------------------------------------
# Measures more than one rule reads


def runaway_span(run, threshold):
    """Logged steps the run took from its first max logit past the guard's threshold to its first at
    RUNAWAY_LOGIT (or its collapse); None if it did not run away."""
    if not ran_away(run):
        return None
    end = run.first_past(RUNAWAY_LOGIT, inclusive=True)
    end = run.collapse_step if end is None else end if run.collapse_step is None else min(end, run.collapse_step)
    start = run.first_past(threshold)
    return 0 if start is None or end is None else max(0, end - start)


def grace_line(c, arm):
    """Per seed, the guarded run's worst smoothed loss in the grace window above its best before the
    trigger: shown, as a grace window hides a real collapse as well as the switch's transient."""
    margin = lambda r: r.config.get("args", {}).get("collapse_margin", 1.0)
    cells = [f"{s} {num(c.runs[arm][s].grace_excess, '+.3f')}" + (" (past the margin: would have counted)" if
             (c.runs[arm][s].grace_excess or 0) > margin(c.runs[arm][s]) else "")
             for s in c.seeds if s in c.runs[arm] and c.runs[arm][s].grace_excess is not None]
    return f"{arm}: worst smoothed loss in the grace window above the pre-trigger best, by seed: " + \
        (", ".join(cells) or "the guard acted in no seed")


# --------------------------------------------------------------------------------------------------
# Numbers in the rules' lines


def num(x, spec=".4g"):
    return "-" if x is None else format(x, spec)


def median(values):
    values = [v for v in values if v is not None]
    return statistics.median(values) if values else None


def median_range(values, spec="+.3f"):
    return f"median {statistics.median(values):{spec}} ({min(values):{spec}} to {max(values):{spec}})" if values \
        else "n/a"
