"""
Claims 3 and 4, on an injected error (lab/assay.py) at a grid of doses: an error outside attention runs away
through the QK channel beyond the no-error run of its seed where its QK-only fix does not fail against it (3,
at mlp-out; 3+ at the backward's delta; the gradient sites); sign-coherence, not size, drives it (4: the
coherent error against the random-sign one, dose by dose).

A grid rule is judged at the doses its arms ran, each test at ALPHA / the committed grid's count
(thresholds.COMMITTED_DOSES): a rerun of part of the grid keeps the committed thresholds. An arm kind the
rule needs that ran at no dose of a site (the error, its fix, its random-sign twin), or no no-error run,
makes the rule NOT RUN; a kind missing at one dose counts against the claim there.
"""
import math

from lab.loading import done, end_val, ran_away
from lab.rules.common import median, median_range, num
from lab.stats import ALPHA, binom_tail, sign_test
from lab.sweep import CLAIM3_SITE, CLAIM4_SITES, COHERENCES, DOSES, NO_ERROR, QKNORM_ALONE, SITES, inject_arm
from lab.thresholds import (COMMITTED_DOSES, FIX_TOL, LOGIT_GAP, LOGIT_RATIO, RUNAWAY_LOGIT, SIGMA_RATIO,
                            tests_counted)


# --------------------------------------------------------------------------------------------------
# A grid rule's arms, the doses that ran, and when it is not run


def grid_arm(site, dose, kind):
    """The arm of one kind at a dose: kind is (coherence, fix?)."""
    return inject_arm(site, dose, *kind)[0]


class GridArms:
    """A grid rule's arms: at each of its sites, every kind (coherence, fix?) at the doses where any of them
    ran (at every dose where none did, so that "not run" names them), and the paired no-error arm; QK-norm's
    own arm beside a QK-norm fix, reported only. missing(groups): what makes the rule NOT RUN."""

    def __init__(self, kinds, sites):
        self.kinds, self.sites = kinds, sites

    def __call__(self, groups):
        out = []
        for site in self.sites:
            ran = [d for d in DOSES if any(groups.get(grid_arm(site, d, k)) for k in self.kinds)]
            out += [grid_arm(site, d, k) for d in (ran or DOSES) for k in self.kinds]
            if any(fix for _, fix in self.kinds) and SITES[site] == "qknorm" and QKNORM_ALONE not in out:
                out.append(QKNORM_ALONE)   # QK-norm's own cost, reported beside its fix
        return out + [NO_ERROR]   # the paired no-error runs the predicates compare with

    def missing(self, groups):
        """The arms of each kind that ran at no dose of its site (named at the doses the rule's other arms
        ran, else at all), and the no-error arm if it has no runs: [] where the rule can be judged."""
        arms = self(groups)
        out = [a for site in self.sites for k in self.kinds
               if not any(groups.get(grid_arm(site, d, k)) for d in DOSES)
               for a in arms if a in [grid_arm(site, d, k) for d in DOSES]]
        return sorted(out, key=arms.index) + ([] if groups.get(NO_ERROR) else [NO_ERROR])


def doses_run(c, site):
    """The doses of the grid at which this rule's arms at this site have runs (a sweep may run part of it;
    another rule's arms at other doses do not count)."""
    arms_at = lambda d: [grid_arm(site, d, (coh, fix)) for coh in COHERENCES for fix in (False, True)]
    return [d for d in DOSES if any(c.runs[a] for a in arms_at(d) if a in c.arms)]


def doses_words(doses):
    return ", ".join(f"{d:g}" for d in doses) or "none"


# --------------------------------------------------------------------------------------------------
# Claim 3: beyond the no-error run, through QK, where the QK-only fix does not fail


def qk_specific(run):
    """Through the QK channel: sigma(W_q or W_k) grew more than SIGMA_RATIO times as much as the
    most-grown other weight matrix. False where the other kinds were not logged."""
    qk, other = run.qk_and_other_growth()
    return other is not None and not math.isnan(qk) and qk > SIGMA_RATIO * other


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


def injection_claim(c, site):
    """Claim 3 at one site: at some dose, seed by seed, the coherent error runs away through QK beyond the
    no-error run where its QK-only fix does not fail against it (sign test at ALPHA / the committed grid's
    doses, or the doses run where more ran).
    Reported beside: each fix's val loss against its error and against no-error, and QK-norm's own cost
    (fp32 with QK-norm always, against fp32)."""
    doses, holds, lines = doses_run(c, site), False, []
    count = tests_counted(COMMITTED_DOSES[site], doses)
    alpha = ALPHA / count
    lines.append(f"{site}: doses run {doses_words(doses)}; each tested at ALPHA / {count}, the committed grid's "
                 f"count ({len(COMMITTED_DOSES[site])} doses) or the doses run where more ran")
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


# --------------------------------------------------------------------------------------------------
# Claim 4: the coherent error against the random-sign one, on one scale


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
    if the coherent one is higher by a sign test at ALPHA / the site's committed doses (or the doses run where
    more ran), a seed with a run unfinished or missing counted against it; it "reverses" it if the random-sign
    one is higher by a sign test at ALPHA / the committed cells of all sites (any reversal refutes), counted
    on finished seeds only (missing data cannot refute). Holds where it raises at some dose of every site and
    reverses at none. The sigma(W_q, W_k) growth against no-error is reported by the same counts."""
    doses = {site: doses_run(c, site) for site in CLAIM4_SITES}
    counts = {site: tests_counted(COMMITTED_DOSES[site], doses[site]) for site in CLAIM4_SITES}
    cells = sum(counts.values())
    alpha_reverse = ALPHA / cells
    raised, reversed_at, lines = {}, [], []
    for site in CLAIM4_SITES:
        alpha = ALPHA / counts[site]
        c.alpha = min(c.alpha, alpha, alpha_reverse)
        raised[site] = []
        lines.append(f"{site}: doses run {doses_words(doses[site])} (thresholds: raises ALPHA / {counts[site]}, "
                     f"reverses ALPHA / {cells}, the committed grid's counts or the doses run where more ran)")
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


# The rules, (label, the rule in words, its arms, its check): claim 3 at the site fixed before the sweep, at
# the gradient sites, at delta (3+); claim 4 at its two sites.
RULE_3 = ("3", f"an error outside attention ({CLAIM3_SITE}, coherence 1, the site fixed before the sweep) runs away "
               f"through the QK channel beyond the no-error run of its seed (max logit >= RUNAWAY_LOGIT and "
               f"LOGIT_RATIO times the no-error run's, sigma(W_q or W_k) growth SIGMA_RATIO times the no-error run's) "
               f"where the same error with QK-norm from step 0 does not fail against it (it keeps the runaway: runs "
               f"away, or a max logit not LOGIT_RATIO below the error run's; or it ends FIX_TOL above the error run's "
               f"val loss, a collapsed one's too, or above its own val loss at init), at some dose of the grid (sign "
               f"test, p < ALPHA / the committed grid's doses, or the doses run where more ran; a seed where the "
               f"error ran away and the fix failed counts against). QK-norm's own cost ({QKNORM_ALONE} against "
               f"{NO_ERROR}), the fix's loss against no-error and whether QK outgrew every other matrix are reported",
          GridArms([(1.0, False), (1.0, True)], [CLAIM3_SITE]), lambda c: injection_claim(c, CLAIM3_SITE))
RULES_3_GRADIENT = [(f"3 ({site})", f"the same from a gradient-side site outside attention ({site}), fix QK-norm",
                     GridArms([(1.0, False), (1.0, True)], [site]), lambda c, site=site: injection_claim(c, site))
                    for site in SITES if site not in (CLAIM3_SITE, "delta")]
RULE_3PLUS = ("3+", "the same at the backward's delta, where the kernel fault lands, its QK-only fix W_q, W_k trained "
                    "on the error-free gradient (the site a positive control would use; not one, as the claim is not "
                    "known to pass it)",
              GridArms([(1.0, False), (1.0, True)], ["delta"]), lambda c: injection_claim(c, "delta"))
RULE_4 = ("4", f"sign-coherence, not size, on a scale: at {' and '.join(CLAIM4_SITES)} and each dose, seed by seed, "
               f"the coherent error's max logit over its seed's no-error run's against the random-sign error's "
               f"(coherence 0.5), one higher where LOGIT_GAP times the other (a collapse above any logit): holds if "
               f"coherence raises it (sign test at ALPHA / the site's committed doses, unfinished seeds counted "
               f"against) at some dose of each site and reverses it (sign test at ALPHA / the committed cells of all "
               f"sites, finished seeds only) at none; a reversal at any dose refutes the claim. At mlp-out (an "
               f"activation site) the error is one vector per head, the same at every token of a step (its amplitude "
               f"times the step's signal rms times a fixed direction): coherent, it is a constant bias that later "
               f"layers can learn to cancel; random-sign, a bias whose sign flips, noise they cannot learn; so there "
               f"coherence tests learnability as much as the QK channel. At delta the error is in the backward "
               f"alone, where no layer can learn it: the site with a coherent error that is not a learnable constant",
          GridArms([(1.0, False), (0.5, False)], list(CLAIM4_SITES)), coherence_claim)
