"""
The report as documents, from the runs: RESULTS.md (the verdict table, one row per rule, and links); one record
per claim, <records>/<n>/README.md (the hypothesis, each rule in words with its verdict, every test it printed,
its seeds and figure, the commands that rerun it) and <records>/<n>/runs.md (each run and its own command); an
index, <records>/README.md (the rules' shared terms, each folder's scale, what was not run, the pilots). The
console gets the verdicts as text (console()). Every link is relative to the file it is in: lab.report runs
at the repository's root, where the paths it is given start.
"""
import os

from lab import claim1
from lab.rules.actions import action_rows
from lab.rules.lr_study import AA_NAMES, ARCHS, LR_RULES, PROXY
from lab.stats import ALPHA, LOSS_TOL
from lab.summary import VERDICT_WORDS, summary
from lab.rerun import out_root, rerun_commands, stream_runs, wrapped
from lab.sweep import CLAIMS, DOSES, LR_STUDY_ARMS, SOURCES, experiments
from lab.tables import (GROUP_HEADER, LR_RUN_HEADER, code, commands, cut_arms, dose_table, fault_units, group_line,
                        group_rows, lr_arch_tables, lr_order, lr_run_rows, lr_runs, lr_scale, paper_scale, pilot_rows,
                        render, scale, seed_table, sources_run)
from lab.thresholds import (COMMITTED_DOSES, COMMITTED_LRS, FINAL_WINDOW, FIX_TOL, LOGIT_GAP, LOGIT_RATIO,
                            RUNAWAY_LOGIT, SIGMA_RATIO)
from lab.verdicts import RULES, SOURCE_RULES, SOURCE_WORDS, expanded_rules, lr_verdicts, verdicts

TITLE = "The paper's claims, judged on this project's own runs"
SUMMARY_HEADER = ["claim", "verdict", "scale", "deciding test", "why"]
DETECTORS = "lab/DETECTORS.md"        # from the repository's root, as every path given to lab.report
MEASUREMENTS = "lab/MEASUREMENTS.md"


def link(target, doc):
    """target's path from doc's folder (both as given: from where lab.report runs, the repository's root)."""
    return os.path.relpath(os.path.abspath(target), os.path.dirname(os.path.abspath(doc)))




def record_of(label):
    """The claim whose record holds a rule's row: 3 for "3", "3+" and "3 (grad-mlp)", 1 for "1p"."""
    return int(label[0])


# --------------------------------------------------------------------------------------------------
# What every document reads: the runs, and their verdicts, computed once

class Judged:
    """The runs given to lab.report and every rule's verdict on them.

    groups: the sweep's runs by arm (loading.load_runs); root: their folder; pilots: [(folder, groups)];
    study: (folder, groups) of the learning-rate study; stream, tokens: (folder, claim1.load's runs) of claim 1
    at CPU scale (stream then decides claim 1's row) and at 16x the tokens a step."""

    def __init__(self, groups, root, pilots=(), study=None, stream=None, tokens=None):
        self.groups, self.root, self.pilots = groups, root, list(pilots)
        self.study, self.stream, self.tokens = study, stream, tokens
        rows = verdicts(groups)
        if stream:   # claim 1 judged at CPU scale, by its pre-registered rule (lab/claim1.py)
            rows = [claim1.rule_row(stream[1]) if row[0] == "1" else row for row in rows]
        self.rows, self.lr_rows = rows, lr_verdicts(study[1]) if study else []
        self.arms = {label: arm_list(groups) if callable(arm_list) else arm_list
                     for label, _, arm_list, _ in expanded_rules(groups)}
        self.table = summary(groups, rows, study and study[1], self.lr_rows, root)
        for found, which in ((stream, claim1.STREAM), (tokens, claim1.TOKENS)):
            if not found:
                continue
            label, verdict, *cells = claim1.summary_row(found[1], which)
            row = [label, VERDICT_WORDS.get(verdict, verdict.upper()), *cells]
            at = [old[0] for old in self.table].index("1")
            if label == "1":   # the first study judges claim 1 in place of the lab's rule
                self.table[at] = row
            else:              # a later study: its own row under claim 1's
                self.table.insert(at + 1, row)
        self.words = {label: words for label, words, _, _ in [*RULES, *LR_RULES]}

    def all_rows(self):
        """[label, verdict, text] of every rule, the sweep's and the lr study's."""
        return self.rows + self.lr_rows

    def claim_groups(self, n):
        """The sweep's arms that claim n's record reads, in sweep.py's order: the arms of its rules judged here
        (claim 1's lab rule not where the stream study judges it), and the arms of this claim alone (claim 1's
        rounding sources), those with runs; [(source or None, arm)]."""
        out, verdict = {}, {row[0]: row[1] for row in self.rows}
        for label, claim, arms, _ in expanded_rules(self.groups):
            if record_of(label) == n and verdict[label] != "not run" and not (label == "1" and self.stream):
                source = label[3:-1] if claim in SOURCE_RULES and "(" in label else \
                    "bf16" if claim in SOURCE_RULES else None
                out.update({a: source for a in self.arms[label] if self.groups.get(a)})
        shared = {a for m, (_, arms) in CLAIMS.items() if m != n for a in arms}
        if n not in (5, 6):
            out.update({a: None for a in CLAIMS[n][1] if self.groups.get(a) and a not in out and a not in shared})
        known = list(dict.fromkeys(a for _, arms in CLAIMS.values() for a in arms))
        for s in SOURCES:
            known += [a for a in experiments([5, 6], source=s) if a not in known]
        return sorted(((s, a) for a, s in out.items()), key=lambda sa: (known + [sa[1]]).index(sa[1]))

    def other_groups(self):
        """The sweep's arms with runs that no claim's record reads."""
        mine = {a for n in CLAIMS for _, a in self.claim_groups(n)}
        return sorted(a for a in self.groups if a not in mine)

    def lr_bases(self, n):
        """The lr study's base arms of claim n's rules (1p, 2p with its A/A arms, 7p with llama's)."""
        bases = [b for label, _, rule_bases, _ in LR_RULES if record_of(label) == n for b in rule_bases]
        if n == 2:
            bases += [a for a in AA_NAMES]
        if n == 7:
            bases += [ARCHS["llama"] + a for a in AA_NAMES]
        return list(dict.fromkeys(bases))


# --------------------------------------------------------------------------------------------------
# A claim's commands: the sweeps that made its runs (lab/rerun.py), and the command that judges them

def rerun_section(j, n):
    """A record's "Rerun it": the sweep commands of its runs, then the command that judges them."""
    sweeps, judges, other = [], [], 0
    by_source = {}
    for source, arm in j.claim_groups(n):
        by_source.setdefault(source, []).extend(j.groups[arm])
    root = out_root(j.root)
    for source, runs in by_source.items():
        more, left = rerun_commands(runs, n, source, root)
        sweeps, other = sweeps + more, other + left
    if by_source:
        judges.append(["python", "-m", "lab.report", root, "--markdown", f"{root}/RESULTS.md"])
    if j.study and j.lr_bases(n):
        root = out_root(j.study[0])
        more, left = rerun_commands([r for _, _, r in lr_runs(j.study[1], j.lr_bases(n))], n, None, root)
        sweeps, other = sweeps + more, other + left
        judges.append(["python", "-m", "lab.report", root, "--lr-study", root, "--markdown", f"{root}/RESULTS.md"])
    for study, found in ((claim1.STREAM, j.stream), (claim1.TOKENS, j.tokens)):
        if n == 1 and found:
            root = out_root(found[0])
            more, left = rerun_commands(stream_runs(found[1]), 1, None, root)
            sweeps, other = sweeps + more, other + left
            judges.append(["python", "-m", "lab.claim1", root] + ([] if study is claim1.STREAM else
                                                                  ["--study", study.name]))
    if sweeps:
        words = ("The sweeps that made its runs, with the flags, seeds and learning rates their config.json records "
                 "(a\nsweep skips a run already finished), each into one folder, then the command that judges them"
                 + (f"; {other} of its runs were made another way (their own commands: [runs.md](runs.md))"
                    if other else "") + ":")
    else:   # no run of it made by the sweep: its own defaults
        root = "runs/claims"
        sweeps = [["python", "-m", "lab.sweep", "--claims", str(n), "--out-root", root]]
        judges = [["python", "-m", "lab.report", root, "--markdown", f"{root}/RESULTS.md"]]
        words = ("No run of it was made by lab.sweep" + (f" (the commands of its {other} runs: [runs.md](runs.md))"
                                                          if other else "")
                 + "; the sweep's own\ncommand for the claim, on its default seeds, and the command that judges them:")
    return ["## Rerun it", words, code([line for w in sweeps + judges for line in wrapped(w)])]


# --------------------------------------------------------------------------------------------------
# RESULTS.md: the verdict table and links

def report_command(j, paths):
    """lab.report's command line that writes these documents, as typed: what RESULTS.md opens with."""
    words = ["python", "-m", "lab.report", j.root]
    words += [w for p, _ in j.pilots for w in ("--pilot", p)]
    for flag, given in (("--lr-study", j.study), ("--stream", j.stream), ("--tokens", j.tokens)):
        words += [flag, given[0]] if given else []
    words += ["--markdown", paths.markdown]
    words += ["--records", paths.records_flag] if paths.records_flag else []
    words += ["--plots", paths.plots_flag] if paths.plots_flag else []
    return words


def results_md(j, paths):
    doc = paths.markdown
    table = [[*row, f"[claim {record_of(row[0])}]({link(paths.record(record_of(row[0])), doc)})"]
             for row in j.table]
    return [f"# {TITLE}",
            "Written from the runs' logs, with each claim's record and the figures, by one command (a test checks\n"
            "that it gives every file byte for byte):",
            code(wrapped(report_command(j, paths), width=100)),
            "One row per rule: its verdict; its scale (model, steps, seeds; an injected error's dose, also as a\n"
            "multiple of the fault's own error); the test that decided it (a reproduced claim's weakest passing\n"
            "test, else the failing test that came closest to passing); why; and the claim's record: its\n"
            "hypothesis, its rules in words, every test they printed, its seeds and figure, the commands that\n"
            "rerun it, and its runs with their own commands.",
            render(SUMMARY_HEADER + ["record"], table, True),
            paper_scale(j.groups, *([j.study[1]] if j.study else [])),
            "QK-Guard's trigger as a detector, scored beside OLMo-core's, Lightning's, llm-foundry's and\n"
            "Megatron-LM's loss-spike rules on the unguarded committed runs (on the collapse, which none of them\n"
            "reads, each swept over its threshold to matched false-alarm rates; the runaway, the trigger's own\n"
            f"signal, apart): [{DETECTORS}]({link(DETECTORS, doc)}), written by\n"
            "`python -m lab.detectors lab/results --markdown lab/DETECTORS.md --plot lab/plots/detectors.png`.",
            f"The rules' shared terms, each folder's scale, what was not run, and the pilots: "
            f"[{paths.index}]({link(paths.index, doc)}).\nHow the rules changed, and what the rules before "
            f"said of the logs they had: [{MEASUREMENTS}]({link(MEASUREMENTS, doc)})\n"
            f"(\"{HISTORY}\")."]


HISTORY = "2026-12-05: the verdict rules' history"   # lab/MEASUREMENTS.md's section


# --------------------------------------------------------------------------------------------------
# The index: the rules' shared terms, each folder's scale, what was not run, the pilots

def shared_terms(j):
    parts = [f"ALPHA={ALPHA}, FINAL_WINDOW={FINAL_WINDOW}, LOSS_TOL={LOSS_TOL}, RUNAWAY_LOGIT={RUNAWAY_LOGIT:g}, "
             f"SIGMA_RATIO={SIGMA_RATIO:g}, LOGIT_RATIO={LOGIT_RATIO:g}, LOGIT_GAP={LOGIT_GAP:g}, FIX_TOL={FIX_TOL} "
             "(lab/thresholds.py); a run ran away if it collapsed or its max logit reached RUNAWAY_LOGIT; arms are "
             "compared seed by seed with an exact one-sided sign test over the seeds where they differ; an "
             "unfinished or missing run counts against the claim.",
             "A rule is not run where an arm it reads has no run at all (in a dose grid: an arm kind, the error, its "
             "fix or its random-sign twin, that ran at no dose of a site, or no no-error run), and inconclusive "
             "where its seeds are too few for any of its sign tests to reach its threshold. A Bonferroni correction "
             "counts the "
             "grid its rule was committed with, not the part of it that ran (the count run where more ran): "
             + ", ".join(f"{site} {len(doses)} doses" for site, doses in COMMITTED_DOSES.items())
             + f", the learning-rate study {len(COMMITTED_LRS)} lrs. So a rerun of part of a grid keeps the "
             "committed thresholds."]
    if j.study:
        parts.append("The learning-rate study's rules: a run ran away if it collapsed, its max logit reached "
                     "RUNAWAY_LOGIT at a logged step, or a loss was not finite; arms are compared seed by seed at "
                     "the same learning rate.")
    return parts


def index_md(j, paths):
    doc = paths.index
    verdicts_of = lambda n: "; ".join(f"{row[0]}: {row[1]}" for row in j.table if record_of(row[0]) == n)
    rows = [[f"[{n}]({link(paths.record(n), doc)})", words, verdicts_of(n)] for n, (words, _) in CLAIMS.items()]
    parts = ["# The claims' records",
             f"Written with [RESULTS.md]({link(paths.markdown, doc)}) by the command on its first lines. One "
             "folder per claim: its record\n(README.md) and its runs, each with its own command (runs.md).",
             render(["claim", "hypothesis", "its rules' verdicts"], rows, True),
             "## The rules' shared terms", *shared_terms(j),
             "## Scale, and what was not run", scale(j.groups)]
    cut, idle = cut_arms(j.groups), [s for s in SOURCES if s not in sources_run(j.groups)]
    if cut or idle:
        parts.append(f"Not run (cut from the sweep; a rule that needs them says \"not run\", or counts them "
                     f"against its claim): {', '.join(cut) or 'nothing of the claims judged'}"
                     + (f"; claims 5 and 6 on the source{'s' if len(idle) > 1 else ''} {', '.join(idle)}"
                        if idle else "") + ".")
    if j.study:
        path, groups = j.study
        parts += [f"## The learning-rate study ({path}): claims 1, 2 and 7 as a proxy at CPU scale",
                  f"{PROXY} {lr_scale(groups)}"]
        others = sorted(set(groups) - {name for _, _, name in lr_order(groups)})
        if others:
            parts.append(f"Not of the study (no <arm>-lr<lr> of {', '.join(LR_STUDY_ARMS)} or their llama- arms), "
                         f"skipped: {', '.join(others)}.")
    for path, pilot in j.pilots:
        parts += [f"## Pilot ({path}): runs that fixed a grid or a horizon, on seeds the claims do not use",
                  scale(pilot),
                  render(["arm", "seed", "status", "max logit", f"first step past the guard's threshold / at "
                          f"{RUNAWAY_LOGIT:g}", "sigma growth q / others", "final val"], pilot_rows(pilot), True)]
        every = commands(r for name in sorted(pilot) for r in pilot[name])
        parts += [code(every)] if every else []
    others = j.other_groups()
    if others:
        parts += ["## Other runs", "Runs of no claim's arm, under the sweep's folder:"]
        parts += group_tables(j.groups, others, True, lambda text: f"### {text}")
        parts.append(code(commands(r for a in others for r in j.groups[a])))
    return parts


def group_tables(groups, arms, markdown, title):
    return [part for a in arms for part in (title(a), "Medians: " + group_line(a, groups[a]),
                                             render(GROUP_HEADER, group_rows(groups[a]), markdown))]


# --------------------------------------------------------------------------------------------------
# A claim's record: README.md, and runs.md

def rule_section(j, label, verdict, text, paths, n):
    """One rule in a record: its words, its verdict, every line it printed, its seeds."""
    doc, lines = paths.record(n), text.splitlines()
    head = [f"## Rule {label}: {lines[0]}"]
    if label == "1" and j.stream:   # judged at CPU scale by its pre-registered rule
        figure = paths.stream_plot
        return head + [f"On a GPU the rule reads: {j.words['1']}. At CPU scale claim 1 is judged by the rule "
                       "committed before its runs:"] + \
            claim1.section(j.stream[1], j.stream[0], figure, os.path.dirname(os.path.abspath(doc)),
                           rule_link=link(claim1.STREAM.rule, doc))
    parts = head + [f"The rule: {j.words[label.split(' (')[0] if record_of(label) in (5, 6) else label]}."]
    if verdict == "not run":
        return parts + [f"**NOT RUN**: {lines[1] if len(lines) > 1 else 'no runs'}."]
    parts += [f"**{VERDICT_WORDS.get(verdict, verdict.upper())}**, by these tests and counts, as the rule printed "
              "them:", "\n".join(f"- {line}" for line in lines[1:])]
    if label in j.arms:
        header, rows = seed_table(j.groups, j.arms[label])
        parts += ["Its seeds: each run's max logit / final val loss (where it collapsed, the step; where it did not "
                  "finish, its status):", render(header, rows, True)]
    return parts


def record_md(j, n, paths):
    doc = paths.record(n)
    labels = [row[0] for row in j.table if record_of(row[0]) == n]
    figures = {os.path.splitext(os.path.basename(p))[0]: p for p in paths.plots}
    parts = [f"# Claim {n}: {CLAIMS[n][0]}",
             f"Its record, written with [RESULTS.md]({link(paths.markdown, doc)}) from the runs' logs: each rule "
             "that judges the\nclaim in words, its verdict, every test it printed and its seeds; the figures; the "
             "commands that rerun it.\nEach run, with its own command: [runs.md](runs.md). The rules' shared "
             f"terms: [the index]({link(paths.index, doc)}).",
             render(SUMMARY_HEADER, [row for row in j.table if row[0] in labels], True)]
    texts = {row[0]: row for row in j.all_rows()}
    for label in labels:
        if label == claim1.TOKENS.label:
            continue   # its section follows, written by lab/claim1.py
        _, verdict, text = texts[label]
        parts += rule_section(j, label, verdict, text, paths, n)
        name = f"claim{label.replace(' ', '').replace('(', '-').replace(')', '')}"
        if name in figures:
            parts.append(f"![{name}]({link(figures[name], doc)})")
    if n == 1 and j.tokens:
        parts += ["## Claim 1 at 16x the tokens a step (16,384), 4 key blocks per row",
                  *claim1.section(j.tokens[1], j.tokens[0], paths.tokens_plot, os.path.dirname(os.path.abspath(doc)),
                                  claim1.TOKENS, rule_link=link(claim1.TOKENS.rule, doc))]
    if n == 6:
        for source in sources_run(j.groups):
            table = action_rows(j.groups, source)
            if table:
                parts += [f"## Claim 6's actions on one table ({SOURCE_WORDS[source]})", ACTIONS_WORDS,
                          render(["arm", "kind", "failed", "broke down", "QK grew SIGMA_RATIO x QK-norm's",
                                  "QK growth after the trigger, median", "val loss - QK-norm's, median"], table, True)]
    if n in (3, 4) and any(g.startswith("inject-") for g in j.groups):
        parts += ["## Dose-response (claims 3 and 4): runs that ran away beyond the no-error run of their seed / "
                  "finished pairs",
                  render(["site", "coherence"] + [f"dose {d:g}" for d in DOSES], dose_table(j.groups), True),
                  *fault_units(j.root)]
        if "dose_response" in figures:
            parts.append(f"![dose_response]({link(figures['dose_response'], doc)})")
    if j.study and j.lr_bases(n):
        arch = "llama" if n == 7 else "gpt2"
        parts += lr_arch_tables(j.study[1], arch, True, lambda text: f"## The learning-rate study, {text}")
        if f"lr-{arch}" in figures:
            parts.append(f"![lr-{arch}]({link(figures[f'lr-{arch}'], doc)})")
    return parts + rerun_section(j, n)


ACTIONS_WORDS = ("Each action on the seeds rule 6 judges, by the measures it judges them: failed (broke down: a "
                 "collapse or logits past RUNAWAY_LOGIT after it acts; then, for a non-QK action, the most-grown "
                 "head's sigma(W_q,h) sigma(W_k,h) grew SIGMA_RATIO times as much after the trigger as under "
                 "QK-norm, and for a QK-side one, its final val loss ended more than FIX_TOL above QK-norm's; a run "
                 "unfinished or missing counted as failed), each part apart, that growth's median (for every "
                 "action), and the final val loss less QK-norm's (the long arms against QK-norm at the same "
                 "horizon).")


def runs_md(j, n, paths):
    arms = [a for _, a in j.claim_groups(n)]
    parts = [f"# Claim {n}'s runs",
             f"Each run that [claim {n}'s record](README.md) reads, as its log gives it, and the command that made "
             "it\n(written by lab.report with RESULTS.md)."]
    lab_runs = [r for a in arms for r in j.groups[a]]
    if arms:
        parts += ["## Runs", *group_tables(j.groups, arms, True, lambda text: f"### {text}")]
    lr = lr_runs(j.study[1], j.lr_bases(n)) if j.study and j.lr_bases(n) else []
    if lr:
        parts += ["## Runs of the learning-rate study", render(LR_RUN_HEADER, lr_run_rows(lr), True)]
    studies = [(s, found) for s, found in ((claim1.STREAM, j.stream), (claim1.TOKENS, j.tokens)) if n == 1 and found]
    for study, (path, runs) in studies:
        parts += [f"## Runs of the {study.name} study ({path})", render(STREAM_HEADER, stream_rows(runs), True)]
    every = commands(lab_runs) + commands(r for _, _, r in lr) + \
        [c for _, (_, runs) in studies for c in commands(stream_runs(runs))]
    if not (lab_runs or lr or studies):
        parts.append("No runs yet: its record says how to make them.")
    return parts + (["## Commands", code(every)] if every else [])


STREAM_HEADER = ["arm", "seed", "finished", "last step", "max logit", "M (late median)", "final val"]


def stream_rows(runs):
    return [[row.group, row.seed, "yes" if row.run.finished else "no", str(row.run.horizon),
             f"{max(row.run.logit, default=float('nan')):.4g}",
             "-" if row.run.statistic() is None else f"{row.run.statistic():.1f}",
             "-" if row.run.final_val is None else f"{row.run.final_val:.4f}"] for row in stream_runs(runs)]


# --------------------------------------------------------------------------------------------------
# Every document, by its path

class Paths:
    """Where the documents go, as given (from the repository's root): markdown (RESULTS.md), records (their
    folder), plots (the figures drawn), the claim-1 figures; records_flag, plots_flag: the flags as typed."""

    def __init__(self, markdown, records=None, plots=(), stream_plot=None, tokens_plot=None, plots_flag=None):
        self.markdown, self.records_flag, self.plots_flag = markdown, records, plots_flag
        self.records = records or (os.path.join(os.path.dirname(markdown), "claims") if markdown else None)
        self.plots, self.stream_plot, self.tokens_plot = list(plots), stream_plot, tokens_plot
        self.index = os.path.join(self.records, "README.md") if self.records else None

    def record(self, n):
        return os.path.join(self.records, str(n), "README.md")

    def runs(self, n):
        return os.path.join(self.records, str(n), "runs.md")


def documents(j, paths):
    """{path: text} of every Markdown file of the report: RESULTS.md, the index, each claim's record and runs."""
    joined = lambda parts: "\n\n".join(parts) + "\n"
    docs = {paths.markdown: joined(results_md(j, paths)), paths.index: joined(index_md(j, paths))}
    for n in CLAIMS:
        docs[paths.record(n)] = joined(record_md(j, n, paths))
        docs[paths.runs(n)] = joined(runs_md(j, n, paths))
    return docs


# --------------------------------------------------------------------------------------------------
# The console: the same verdicts as text

def console(j):
    """The report as aligned text: the verdict table, the rules in words, every rule's lines, the tables."""
    title = lambda text: f"== {text} =="
    shown = lambda rows: [[label, VERDICT_WORDS.get(verdict, verdict.upper()), text] for label, verdict, text in rows]
    parts = [render(SUMMARY_HEADER, j.table, False), paper_scale(j.groups, *([j.study[1]] if j.study else [])),
             title("Rules"), *shared_terms(j), "\n".join(f"{label}. {words}." for label, words, _, _ in RULES)]
    if j.study:
        parts.append("\n".join(f"{label}. {words}." for label, words, _, _ in LR_RULES))
    parts += [title("Claims"), render(["claim", "verdict", "arms: n, counts [exact 95% interval]; tests"],
                                      shown(j.rows), False)]
    for source in sources_run(j.groups):
        table = action_rows(j.groups, source)
        if table:
            parts += [title(f"Claim 6's actions on one table ({SOURCE_WORDS[source]})"),
                      render(["arm", "kind", "failed", "broke down", "QK grew SIGMA_RATIO x QK-norm's",
                              "QK growth after the trigger, median", "val loss - QK-norm's, median"], table, False)]
    if any(g.startswith("inject-") for g in j.groups):
        parts += [title("Dose-response (claims 3 and 4): runs that ran away beyond the no-error run of their seed / "
                        "finished pairs"),
                  render(["site", "coherence"] + [f"dose {d:g}" for d in DOSES], dose_table(j.groups), False),
                  *fault_units(j.root)]
    for study, found, words in ((claim1.STREAM, j.stream, "the bf16 streaming state, 4 key blocks per row"),
                                (claim1.TOKENS, j.tokens, "16x the tokens a step (16,384), 4 key blocks per row")):
        if found:
            parts += [title(f"Claim 1 at CPU scale: {words}"),
                      "\n".join(claim1.judge(found[1], study)[1] + claim1.reported(found[1], study))]
    if j.study:
        path, groups = j.study
        parts += [title(f"Learning-rate study ({path}): claims 1, 2 and 7 as a proxy at CPU scale"),
                  f"{PROXY} {lr_scale(groups)}",
                  render(["claim", "verdict", "arms: counts; tests, by learning rate"], shown(j.lr_rows), False)]
        for arch in ARCHS:
            parts += lr_arch_tables(groups, arch, False, title)
        parts += [title("Runs of the learning-rate study"), render(LR_RUN_HEADER, lr_run_rows(lr_runs(groups)), False)]
    known = list(dict.fromkeys(a for _, arms in CLAIMS.values() for a in arms))
    order = [a for a in known if a in j.groups] + sorted(set(j.groups) - set(known))
    parts += [title("Runs"), *group_tables(j.groups, order, False, title)]
    for path, pilot in j.pilots:
        parts += [title(f"Pilot ({path}): runs that fixed a grid or a horizon, on seeds the claims do not use"),
                  scale(pilot),
                  render(["arm", "seed", "status", "max logit", f"first step past the guard's threshold / at "
                          f"{RUNAWAY_LOGIT:g}", "sigma growth q / others", "final val"], pilot_rows(pilot), False)]
    return "\n\n".join(parts) + "\n"
