"""
Claim 5, the causal probe (lab/assay.py's --probe): projecting W_q, W_k's updates off their top-k singular
directions stops the runaway, and removing as much in other ways does not: the whole update shrunk to the
probe's norm, the next k directions, a fixed random subspace. Judged on a runaway's source (sweep.SOURCES);
where the top-k probe and the shrink ran at LONG_STEPS, the shrink is judged there. Reported beside it: the
energy each removed, the paper's measure, and the logit's escape route through the pre-attention gain.
"""
import math
import statistics

from lab.loading import done, ran_away, same_losses
from lab.rules.common import median, num, runaway_span
from lab.stats import ALPHA, sign_test
from lab.sweep import LONG_STEPS, NO_ERROR, probe_gain_arm, probe_long_arms, read_log
from lab.thresholds import GUARD_THRESHOLD, RISE_WINDOW, RUNAWAY_LOGIT


# --------------------------------------------------------------------------------------------------
# The controls, and the shrink's horizon


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


# --------------------------------------------------------------------------------------------------
# Reported beside the rule: the paper's measure, and the logit's growth split into its parts


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
    the pre-attention gain, attn_gain_rms per layer); [] where the log holds no gain (logs before
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


# --------------------------------------------------------------------------------------------------
# The rule


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


RULE_5 = ("5", "the causal probe: the source runs away (max logit past RUNAWAY_LOGIT, or a collapse) where the "
               "probe on W_q/W_k's top-k does not, and so does each control that can be carried out at every "
               "step: the whole update shrunk to the probe's norm (if it stops the runaway too, the probe works "
               "through step size), the next k singular directions, a fixed random rank-k subspace (sign tests, "
               "p < ALPHA). The probe freezes W_q's top singular values by construction, so they are not "
               "evidence; the energy each removed and the equal-energy and non-QK controls are reported. "
               "Decided on 2026-12-03 as its runs began (3 of their 32 had started): where the top-k probe and "
               f"the shrink ran at {LONG_STEPS} steps (-long), the shrink is judged there instead: the claim's "
               "core needs the shrink to run away (max logit past RUNAWAY_LOGIT, or a collapse) where top-k does not, by a "
               "sign test at p < ALPHA over those seeds (a run unfinished or missing counted against); a shrink "
               "that did not run away held only if it never passed the guard's threshold, or ran at least the "
               "source's slowest runaway (its steps from the threshold to RUNAWAY_LOGIT) divided by the update "
               "norm the shrink left (its step factor) after it first passed it, else it is too short to judge; "
               "the probe \"works through step size\" only if the source runs away where the shrink held, by a "
               "sign test at p < ALPHA. Reported beside it, by the paper's measure: each probe arm's final "
               "sigma(W_q). Its escape route, decided on 2026-12-05 before its runs (reported, not judged): the "
               "top-k probe rerun at 2500 steps with each layer's pre-attention norm gain g logged (-long-gain, "
               "seeds 1 up); from its first logged step to its first logged step past RUNAWAY_LOGIT (or its "
               "collapse), the growth of the max logit of the head that holds it then is split, in logs, into "
               "sigma(W_q,h) sigma(W_k,h), the gain's part (sigma(W_q,h diag g) sigma(W_k,h diag g) over that "
               "product) and the rest (how the normalized inputs meet those directions: a logit is at most "
               "scale n_embd times the gained product). The logit escapes through the gain if the gain's part "
               "grew more than the sigma product in more seeds than not, by a sign test at p < ALPHA over the "
               "seeds that ran away",
     lambda source: [source, f"{source}-probe-topk", *(f"{source}-probe-{n}" for n in PROBE_CONTROLS), NO_ERROR],
     probe_holds)
