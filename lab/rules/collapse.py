"""
Claims 1, 2 and 7 on the natural fault (a GPU's bf16 state): it collapses where fp32 state and the safemax fix
do not (1); QK-Guard prevents it, within LOSS_TOL of always-on QK-norm, and stays dormant on healthy training
(2, 2v); both again on llama (7). Each rule: (its label, the rule in words, its arms, its check).
"""
import math

from lab.loading import collapsed, triggered
from lab.rules.common import grace_line, joined
from lab.stats import LOSS_TOL


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


RULE_1 = ("1", "bf16 state collapses, fp32 state and bf16-safemax do not: bf16 collapses where fp32 does not, and "
               "where bf16-safemax does not, each by a sign test at p < ALPHA",
          ["bf16", "fp32", "bf16-safemax"], lambda c: collapses_vs_not(c, "bf16", "fp32", "bf16-safemax"))
RULE_2 = ("2", "QK-Guard prevents it: bf16-guard collapses in no seed, fewer than bf16 (sign test), triggers before "
               "each bf16 collapse of the same seed, and ends within LOSS_TOL of bf16-qknorm-always in every seed",
          ["bf16", "bf16-guard", "bf16-qknorm-always"],
          lambda c: joined(guard_prevents(c, "bf16", "bf16-guard", "bf16-qknorm-always"),
                           (True, [grace_line(c, "bf16-guard")])))
RULE_2V = ("2v", "the guard is valid: on healthy training (fp32 state) it fires in no seed, and while dormant it "
                 "changes the final val loss by at most LOSS_TOL",
           ["fp32", "fp32-guard"], lambda c: guard_is_dormant(c, "fp32", "fp32-guard"))
RULE_7 = ("7", "the same on llama: llama-bf16 collapses where llama-fp32 does not, llama-bf16-guard prevents it "
               "within LOSS_TOL of always-on QK-norm, and llama-fp32-guard stays dormant",
          ["llama-bf16", "llama-fp32", "llama-bf16-guard", "llama-bf16-qknorm-always", "llama-fp32-guard"],
          lambda c: joined(collapses_vs_not(c, "llama-bf16", "llama-fp32"),
                           guard_prevents(c, "llama-bf16", "llama-bf16-guard", "llama-bf16-qknorm-always"),
                           guard_is_dormant(c, "llama-fp32", "llama-fp32-guard")))
