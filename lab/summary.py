"""
RESULTS.md's verdict table: one row per rule, read from what the rules computed (their verdicts and lines), so
that it can say no more than the records do: [claim, VERDICT, scale, the test that decided it, why].
"""
import re

from lab.rules.actions import QK_SIDE_FAILED
from lab.rules.lr_study import LR_RULES, lr_cells
from lab.stats import ALPHA, LOSS_TOL
from lab.sweep import NO_ERROR, QKNORM_ALONE
from lab.tables import dose_scale
from lab.thresholds import FIX_TOL, LOGIT_GAP
from lab.verdicts import expanded_rules


# --------------------------------------------------------------------------------------------------
# The rules' lines, read back


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


# --------------------------------------------------------------------------------------------------
# The rows


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


def summary(groups, rows, study=None, lr_rows=(), root=None):
    """The opening table's rows, from verdicts' rows (and the lr study's groups and lr_verdicts' rows). root:
    the folder of fault_size.json, where an injected error's dose is also given in the fault's own units."""
    arms = {label: arm_list(groups) if callable(arm_list) else arm_list
            for label, _, arm_list, _ in expanded_rules(groups)}
    out = []
    for row in rows:
        scale, n = row_scale(groups, arms[row[0]])
        doses = dose_scale([r for a in arms[row[0]] for r in groups.get(a, [])], root) if root else ""
        out.append(summary_row(*row, scale + doses, n))
    cells = lr_cells(study or {})
    for row, (_, _, bases, _) in zip(lr_rows, LR_RULES):
        names = [name for (base, _), name in cells.items() if base in bases]
        seeds_at = {}   # lr -> the seeds its arms ran (rule 2p ran more seeds at the runaway lrs)
        for (base, lr), name in cells.items():
            if base in bases:
                seeds_at.setdefault(lr, set()).update(r.seed for r in study.get(name, []))
        out.append(summary_row(*row, *row_scale(study, names, seeds_at)))
    return out
