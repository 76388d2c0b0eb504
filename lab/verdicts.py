"""
Every rule, in order, judged on a sweep's runs: one row per rule, [label, verdict, its title and lines].

A rule is "not run" where an arm it reads has no run at all (a dose grid: an arm kind that ran at no dose of a
site, or no no-error run: rules/injection.py); else it is judged, a missing or unfinished run counted against
its claim, and "inconclusive" where its seeds are too few for any of its sign tests to reach its threshold.
The runs a rule compares must share the data and every flag but their arms' own: a mix is refused, not judged.
"""
from lab.rules.actions import RULE_6
from lab.rules.collapse import RULE_1, RULE_2, RULE_2V, RULE_7
from lab.rules.common import judge_rule, mixed, refuse
from lab.rules.injection import RULE_3, RULE_3PLUS, RULE_4, RULES_3_GRADIENT
from lab.rules.lr_study import LR_RULES, LR_TITLES, lr_cells
from lab.rules.probe import RULE_5
from lab.sweep import CLAIMS, NO_ERROR, QKNORM_ALONE, SOURCES, long_arms, lr_name, probe_gain_arm, probe_long_arms

# (label, the rule in words, its arms: a list, or a grid's arms from the runs, or a source's; its check)
RULES = [RULE_1, RULE_2, RULE_2V, RULE_3, *RULES_3_GRADIENT, RULE_3PLUS, RULE_4, RULE_5, RULE_6, RULE_7]
SOURCE_RULES = ("5", "6")   # judged once per source whose arms ran (bf16 where none did)
OPTIONAL_ARMS = {"5": probe_long_arms,   # claim 5 judges the shrink at LONG_STEPS where those arms ran
                 "6": long_arms}         # claim 6 the lr-drop
REPORTED_ARMS = {"5": probe_gain_arm}   # read where they ran (each alone), reported, never judged
SOURCE_WORDS = {"bf16": "the natural fault (bf16 state)", "assay": "an injected coherent error at the backward's "
                "delta", "lr": "the demo's learning-rate runaway"}


def optional_arms():
    """Every source's optional and reported arms: their seeds are not a rule's seeds (more of them count
    against nothing)."""
    kinds = (*OPTIONAL_ARMS.values(), *REPORTED_ARMS.values())
    return [a for arms in kinds for s in SOURCES for a in arms(s)]


def expanded_rules(groups):
    """RULES with claims 5 and 6 once per source that has runs: (row label, claim, arms, check)."""
    out = []
    for claim, _, arms, rule in RULES:
        if claim not in SOURCE_RULES:
            out.append((claim, claim, arms, rule))
            continue
        ran = [s for s in SOURCES if any(groups.get(a) for a in arms(s) if a != NO_ERROR)] or ["bf16"]
        # a source ran if an arm other than no-error did; bf16 stands in if none did ("not run").
        # Arms a rule reads where they ran and does without where they did not (claim 6's long horizon):
        # all of them if any ran (a missing one then makes the rule not run, as any arm it reads does)
        optional = lambda s: [*OPTIONAL_ARMS[claim](s)] if claim in OPTIONAL_ARMS and any(
            groups.get(a) for a in OPTIONAL_ARMS[claim](s)) else []
        reported = lambda s: [a for a in REPORTED_ARMS.get(claim, lambda _: [])(s) if groups.get(a)]
        out += [(claim if s == "bf16" else f"{claim} ({s})", claim, arms(s) + optional(s) + reported(s),
                 lambda c, s=s, rule=rule: rule(c, s)) for s in ran]
    return out


def rule_title(label, claim):
    """A rule's title: its claim's words (sweep.CLAIMS), the rule's own where it is not the claim's whole."""
    title = {"2v": "QK-Guard stays dormant on healthy training, at no cost",
             "3+": "an error at the backward's delta, where the kernel fault reaches the gradient, drives the "
                   "same QK runaway"}.get(claim, CLAIMS[int(claim[0])][0])
    if label.startswith("3 ("):
        title = f"an error in a gradient outside attention ({label[3:-1]}) drives the same QK runaway"
    if claim in SOURCE_RULES:
        title += f"; the runaway's source: {SOURCE_WORDS[label[3:-1] if '(' in label else 'bf16']}"
    return title


def not_run(title, missing, where=""):
    return f"{title}\nno runs of {', '.join(missing[:3])}" + \
        (f" and {len(missing) - 3} more arms" if len(missing) > 3 else "") + where


def verdicts(groups):
    """One row per rule: [claim, verdict, what was measured]. Refuses (SystemExit) if a rule's runs differ
    in more than its arms' own flags (see mixed)."""
    rows, refused = [], []
    for label, claim, arm_list, rule in expanded_rules(groups):
        title = rule_title(label, claim)
        arms = arm_list(groups) if callable(arm_list) else arm_list
        missing = arm_list.missing(groups) if callable(arm_list) else [a for a in arms if not groups.get(a)]
        if missing:
            rows.append([label, "not run", not_run(title, missing)])
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


def lr_verdicts(groups):
    """One row per rule of LR_RULES, as verdicts gives: "not run" if an arm ran at no lr; else judged at
    the lrs any of its arms ran. Refuses (SystemExit) a mix of flags other than the arms' own (mixed)."""
    rows, refused, cells = [], [], lr_cells(groups)
    for label, _, bases, rule in LR_RULES:
        lrs = sorted({lr for (base, lr), name in cells.items() if base in bases and groups[name]})
        missing = [b for b in bases if not any(groups.get(lr_name(b, lr)) for lr in lrs)]
        if missing:
            rows.append([label, "not run", not_run(LR_TITLES[label], missing, " at any learning rate")])
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
