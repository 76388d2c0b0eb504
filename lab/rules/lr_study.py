"""
The learning-rate study (lab.sweep --lrs): claims 1, 2 and 7 as a CPU-scale proxy, after Wortsman et al. 2023.
The arms of sweep.LR_STUDY_ARMS at each lr, in folders <arm>-lr<lr> (sweep.lr_name). Here the runaway's source
is the learning rate and the bf16 state's fault rides along. A rule compares its arms at the same lr; across
lrs only where its words say so: 1p (bf16 state ends worse than fp32 state at some lr, by a sign test at ALPHA /
the committed grid's lrs), 2p (the guard prevents the runaway within LOSS_TOL of always-on QK-norm, by two
one-sided tests, and stays dormant where training is healthy), 7p (both on llama).
"""
import math
import statistics

from lab.loading import commit_of, done, end_val, lr_ran_away, same_losses, started
from lab.rules.common import joined, median, median_range, num, part
from lab.stats import (ALPHA, LOSS_TOL, equivalence, equivalence_power, mean_interval, paired_t, seeds_for_power,
                       sign_test, slope_interval)
from lab.sweep import AA_ARMS, LR_STUDY_ARMS, SEEDS, TILE_ARMS, lr_name, split_lr
from lab.thresholds import COMMITTED_LRS, RUNAWAY_LOGIT, tests_counted


# --------------------------------------------------------------------------------------------------
# The study's arms and folders


LLAMA = "llama-"                   # a llama arm: "llama-" and the gpt2 arm's name (sweep.CLAIMS[7])


ARCHS = {"gpt2": "", "llama": LLAMA}


# the A/A arms (the arm at 1 and 2 threads) and the 2026-12-03 tile pair: the lr study reads both
AA_NAMES = tuple(a for pairs in (AA_ARMS, TILE_ARMS) for pair in pairs.values() for a in pair)


PROXY = ("A proxy, not the claims themselves: claims 1, 2 and 7 at CPU scale as a learning-rate sensitivity "
         "study, in the style of Wortsman et al. 2023 (\"Small-scale proxies for large-scale Transformer training "
         "instabilities\"). Here the runaway's source is the learning rate; the bf16 state's fault rides along.")


def lr_cells(groups):
    """{(base arm, lr): group name} of the study's folders that are <arm>-lr<lr> of a study arm."""
    bases = {prefix + a for prefix in ARCHS.values() for a in (*LR_STUDY_ARMS, *AA_NAMES)}
    return {(base, lr): name for name in groups for base, lr in [split_lr(name)]
            if base in bases and lr is not None and lr_name(base, lr) == name}


def lrs_run(c):
    """The learning rates at which this rule's lr-study arms (sweep.lr_name) have runs."""
    return sorted({lr for a in c.arms if c.runs[a] for lr in [split_lr(a)[1]] if lr is not None})


# --------------------------------------------------------------------------------------------------
# Rule 1p: bf16 state worse than fp32 state at some lr, the safemax fix at none


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
    ALPHA / the committed grid's lrs, or the lrs run where more ran), and at no lr does bf16-safemax by the
    same test. Says so where the two states give the same curve (within LOSS_TOL, the same runaways, at every
    lr and seed)."""
    fp32, bf16, safemax = (prefix + a for a in ("fp32", "bf16", "bf16-safemax"))
    lrs = lrs_run(c)
    count = tests_counted(COMMITTED_LRS, lrs)
    alpha = ALPHA / count
    found, fixed, same = False, True, True
    lines = [f"lrs run: {', '.join(f'{lr:g}' for lr in lrs)} (Bonferroni: threshold ALPHA / {count}, the committed "
             f"grid's count ({len(COMMITTED_LRS)} lrs) or the lrs run where more ran)"]
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


# --------------------------------------------------------------------------------------------------
# Rule 2p: the guard against always-on QK-norm where bf16 runs away, dormant where training is healthy


def lr_seeds(c, arms, lr):
    """The seeds any of `arms` ran at lr (an arm's seed missing among them counts against the claim)."""
    return c.seeds_of(*(lr_name(a, lr) for a in arms))


def paired_gaps(c, arm, ref, lr, seeds):
    """Final val loss of arm minus ref's, per seed of `seeds` where both finished with a finite val loss; and
    how many seeds lacked either."""
    pairs = [(c.runs.get(lr_name(arm, lr), {}).get(s), c.runs.get(lr_name(ref, lr), {}).get(s)) for s in seeds]
    gaps = [end_val(a) - end_val(b) for a, b in pairs if done(a) and done(b) and math.isfinite(end_val(a) - end_val(b))]
    return gaps, len(pairs) - len(gaps)


def gap_words(verdict, mean, lo, hi, n, sd):
    return (f"mean {mean:+.3f} nat, 90% interval [{lo:+.3f}, {hi:+.3f}], sd {sd:.3f}, n {n} (two one-sided tests "
            f"at +-LOSS_TOL: {verdict})")


def equivalence_line(c, arm, ref, lr, seeds):
    """(the TOST verdict, its words) on arm - ref's paired final val loss at lr over `seeds`."""
    gaps, left = paired_gaps(c, arm, ref, lr, seeds)
    verdict, mean, lo, hi = equivalence(gaps)
    sd = statistics.stdev(gaps) if len(gaps) > 1 else math.nan
    return verdict, left, gap_words(verdict, mean, lo, hi, len(gaps), sd)


def aa_lines(c, prefix, always, lr):
    """(whether the A/A pair showed a gap at lr, its lines): the pair of AA_ARMS (the same arm at 1 and 2 CPU
    threads, run side by side), the twin less the arm, by a paired t test (a 95% interval that excludes 0 is a
    gap where none should be); the 1-thread arm less the arm's own runs of the sweep (0 where no change of the
    code or CPU since moved a bit); and TILE_ARMS, the 2026-12-03 pair, as what it is."""
    one, two = (prefix + a for a in AA_ARMS["bf16-qknorm-always"])
    again, tile = (prefix + a for a in TILE_ARMS["bf16-qknorm-always"])
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
        for ref in (always, again):   # the same flags made on earlier days: what the code's changes since moved
            if c.runs.get(lr_name(ref, lr)):
                redo, _ = paired_gaps(c, one, ref, lr, lr_seeds(c, (one,), lr))
                lines.append(f"lr {lr:g}, {one} - {ref} (the same flags at one thread, run on a later day: what "
                             f"the code's changes since moved): identical in {sum(g == 0 for g in redo)}/"
                             f"{len(redo)} seeds")
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
    for lr in lrs_run(c):
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


# --------------------------------------------------------------------------------------------------
# The rules, and the study's own measure


LR_RULES = [
    ("1p", "claim 1 as a proxy: at some lr of the grid bf16 state ends worse than fp32 state, seed by seed (a final "
           "val loss more than LOSS_TOL above fp32's, or a runaway where fp32 ran none), by a sign test at p < ALPHA "
           "/ the committed grid's 5 lrs, or the lrs run where more ran (Bonferroni), and bf16-safemax is worse "
           "than fp32 by that test at no lr",
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
