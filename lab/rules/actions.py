"""
Claim 6: at QK-Guard's trigger, the non-QK actions (lr-drop, clip, softcap) fail where QK-norm, the guard's
own action, does not, and QK-Clip, also QK-side, fails in no seed. Judged on the seeds where the source ran
away with room after the trigger (judgeable); an action that slows the step and held over too few steps to
tell is too short (too_short). The actions are the lab's own list (sweep.CLAIM6_ACTIONS), not guard.py's.
"""
import math
import statistics

from lab.loading import done, end_val
from lab.rules.common import Claim, grace_line, joined, median, num, part, runaway_span
from lab.stats import ALPHA, sign_test
from lab.sweep import LONG_STEPS, NO_ERROR, action_arms, actions_of, long_arms
from lab.thresholds import FIX_TOL, GUARD_THRESHOLD, LR_DROP_FACTOR, RISE_WINDOW, RUNAWAY_LOGIT, SIGMA_RATIO


# --------------------------------------------------------------------------------------------------
# What fails an action


def broke_down(run):
    """Collapsed, or logits reached RUNAWAY_LOGIT after the guard's action started (anywhere, if it
    never fired). A softcap caps the logits it reports at its c: for it only a collapse counts."""
    start = run.acting_from if run.acting_from is not None else -1
    return run.collapsed or run.logit_after(start - 1) >= RUNAWAY_LOGIT


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


# --------------------------------------------------------------------------------------------------
# Which seeds can tell, and which runs are too short to


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


# --------------------------------------------------------------------------------------------------
# The rule, and its actions on one table


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
    c = Claim(groups, [source, qknorm])
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


RULE_6 = ("6", "non-QK actions fail, judged only on seeds where the source ran away with as many steps after "
               "the trigger as its slowest runaway took from the threshold to RUNAWAY_LOGIT: lr-drop, clip and "
               "softcap (its cap between the trigger and RUNAWAY_LOGIT) at QK-Guard's trigger each fail (break "
               "down: a collapse, or logits past RUNAWAY_LOGIT after they act; or let the most-grown head's "
               "sigma(W_q,h) sigma(W_k,h) grow SIGMA_RATIO times as much after the trigger as under QK-norm) "
               "where QK-norm breaks down (sign tests, p < ALPHA), and QK-Clip, a QK-side action, fails in no "
               "seed, judged (from 2026-12-05) by breakdown and loss: a breakdown, or a final val loss more "
               "than FIX_TOL above QK-norm's. QK-norm takes sigma out of its logits, so its sigma growth is no "
               "healthy bar for an action that leaves sigma in them; the QK growth against QK-norm's is "
               "reported for every action. The loss gap to QK-norm is reported, for every action in one table, "
               "and the non-QK half's result on its own. An action that slows the step (the lr-drop, by its "
               "factor f) and did not fail needs the slowest runaway's steps / f after its trigger, or it "
               "counts against the claim as too short (a verdict only such holds decide is inconclusive); the "
               f"lr-drop is judged at {LONG_STEPS} steps against QK-norm at {LONG_STEPS} where those arms ran. "
               "Adam rescales a clipped gradient back, so clip acts mostly through the moments",
     lambda source: [source, *(a for a in action_arms(source) if a not in long_arms(source)
                               and a not in [f"{source}-guard-{s}" for s in actions_of("source")])],
     non_qk_actions_fail)
