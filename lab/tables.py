"""
The report's tables and paragraphs, from the runs: each built once as rows of cells, rendered as aligned text
(the console) or as Markdown (the records). A run's table, a claim's seed table, the dose-response grid, the
learning-rate study's tables, and the scale every folder of runs ran at, read from their config.json.
"""
import json
import math
import os
import shlex
import statistics
import sys

from lab.loading import arm_flags, collapsed, done, end_val, lr_ran_away
from lab.rules.common import median, num
from lab.rules.injection import beyond, logit_ratio
from lab.rules.lr_study import AA_NAMES, ARCHS, LR_STUDY_ARMS, lr_cells, lr_sensitivity
from lab.sweep import (ASSAY_FLAGS, CLAIMS, COHERENCES, DOSES, NO_ERROR, SITES, SOURCES, action_arms, inject_arm,
                       lr_name, probe_arms)
from lab.thresholds import LOGIT_RATIO, RUNAWAY_LOGIT


# --------------------------------------------------------------------------------------------------
# Rendering: a table's cells may hold several lines


def render(header, rows, markdown):
    """Cells may hold several lines: <br> in Markdown, continuation lines in text."""
    if markdown:
        lines = [header, ["---"] * len(header)] + [[c.replace("|", "\\|").replace("\n", "<br>") for c in r]
                                                   for r in rows]
        return "\n".join("| " + " | ".join(r) + " |" for r in lines)
    cells = [[c.split("\n") for c in r] for r in [header] + rows]
    widths = [max(len(line) for r in cells for line in r[i]) for i in range(len(header))]
    return "\n".join("  ".join((c[k] if k < len(c) else "").ljust(w) for c, w in zip(r, widths)).rstrip()
                     for r in cells for k in range(max(map(len, r))))


# --------------------------------------------------------------------------------------------------
# A run in a row, an arm in a line


def group_line(name, runs):
    """A group in a line: collapses, median collapse step, maxima and losses, trigger steps."""
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


def pilot_rows(pilot_groups):
    """A pilot's runs, one row each: status, max logit, the steps it first passed the guard's threshold
    and reached RUNAWAY_LOGIT (what a horizon is chosen from), sigma growth, val loss."""
    step = lambda s: "-" if s is None else str(s)
    return [[name, r.seed, r.status, num(r.max_logit, ".4g"),
             f"{step(r.first_past(r.guard_threshold()))} / {step(r.first_past(RUNAWAY_LOGIT, inclusive=True))}",
             "{} / {}".format(*(num(x, ".3g") for x in r.qk_and_other_growth())), num(r.final_val, ".4f")]
            for name, runs in sorted(pilot_groups.items()) for r in runs]


# --------------------------------------------------------------------------------------------------
# The dose-response grid (claims 3 and 4), and the doses in the fault's own units


FIX_LABEL = "coherence 1 + QK-only fix"   # dose_curves' label of the fixed curve (the table's words)


# sweep.SITES' --qk-fix values in words: what each site's QK-only fix does (lab/assay.py)
FIX_WORDS = {"qknorm": "QK-norm from step 0", "clean-grad": "W_q, W_k trained on the error-free gradient"}


def dose_curves():
    """(site, label, dose -> arm name) for each curve of the dose-response table and figure: every coherence,
    and coherence 1 with the site's QK-only fix (fix_words names it)."""
    return [(site, label, name) for site in SITES for label, name in
            [(f"coherence {c:g}", lambda d, site=site, c=c: inject_arm(site, d, c)[0]) for c in COHERENCES]
            + [(FIX_LABEL, lambda d, site=site: inject_arm(site, d, 1.0, True)[0])]]


def fix_words(site):
    """The QK-only fix that sweep.SITES gives an injection site, in words."""
    return FIX_WORDS[SITES[site]]


def curve_words(site, label):
    """A dose-response curve (dose_curves' label) in words for its site's legend: the fix named."""
    return {"coherence 1": "sign-coherent error", "coherence 0.5": "error of a random sign each step",
            FIX_LABEL: f"sign-coherent error, fixed by {fix_words(site)}"}.get(label, label)


def paired_with_no_error(groups, name):
    """[(run, its seed's no-error run)] of arm `name`'s finished runs whose no-error run finished too."""
    ref = {r.seed: r for r in groups.get(NO_ERROR, []) if r.finished}
    return [(r, ref[r.seed]) for r in groups.get(name, []) if r.finished and r.seed in ref]


def logits_beyond(run, ref):
    """beyond()'s logit half: max logit >= RUNAWAY_LOGIT and LOGIT_RATIO x ref's (its other half, a collapse
    where ref did not, is the figure's other kind of runaway)."""
    return (run.max_logit or 0.0) >= max(RUNAWAY_LOGIT, LOGIT_RATIO * (ref.max_logit or 0.0))


def dose_outcomes(groups):
    """Claims 3 and 4, split as the figure's top panel draws them: per (site, coherence or fix), per dose,
    (runs whose max logit passed the bar beyond(run, ref) sets, runs that ran away beyond their no-error
    run only by collapsing: a loss collapse with logits under that bar, runs finished with their no-error
    run finished too). The first two add up to beyond's count."""
    curves = {}
    for site, label, name in dose_curves():
        cells = []
        for dose in DOSES:
            pairs = paired_with_no_error(groups, name(dose))
            by_logits = [logits_beyond(r, ref) for r, ref in pairs]
            by_collapse = [beyond(r, ref) and not logits for (r, ref), logits in zip(pairs, by_logits)]
            cells.append((sum(by_logits), sum(by_collapse), len(pairs)))
        if any(n for *_, n in cells):
            curves[(site, label)] = cells
    return curves


def dose_response(groups):
    """Claims 3 and 4: per (site, coherence or fix), per dose: (how many ran away beyond their
    seed's no-error run, how many finished with their no-error run finished too)."""
    return {key: [(logits + collapses, n) for logits, collapses, n in cells]
            for key, cells in dose_outcomes(groups).items()}


def dose_logits(groups):
    """Per (site, dose_response's label), per dose: (the finite max-logit ratios, logit_ratio, of its finished
    runs over their seed's no-error run, sorted; how many of them are off that scale: collapsed or diverged,
    logit_ratio's inf), for the dose-response figure's lower panel, which keeps both."""
    out = {}
    for site, label, name in dose_curves():
        cells = {}
        for d in DOSES:
            ratios = [logit_ratio(r, ref) for r, ref in paired_with_no_error(groups, name(d))]
            cells[d] = (sorted(x for x in ratios if math.isfinite(x) and x > 0), sum(x == math.inf for x in ratios))
        out[site, label] = cells
    return out


def dose_ratios(groups):
    """Per (site, dose_response's label), per dose: the finite max-logit ratios of dose_logits (its runs off
    the scale left out)."""
    return {key: {d: finite for d, (finite, _) in cells.items()} for key, cells in dose_logits(groups).items()}


def fault_size(root):
    """(the bf16 state's own error, rms over the attention output's, in the doses' units; the measurement's
    record) from <root>/fault_size.json (lab.fault_size), or None where it was not measured (a warning where
    it cannot be read)."""
    path = os.path.join(root, "fault_size.json")
    if not os.path.exists(path):
        return None
    try:
        with open(path) as f:
            fault = json.load(f)
        return fault["median"]["error_ratio_median"], fault
    except (OSError, ValueError, KeyError, TypeError) as e:
        print(f"warning: {path}: {e!r}: the doses are not shown in the fault's units", file=sys.stderr)
        return None


def fault_units(root):
    """The doses in units of the bf16 state's own error, from <root>/fault_size.json (lab.fault_size), if
    there: a paragraph, or nothing."""
    measured = fault_size(root)
    if measured is None:
        return []
    error, fault = measured
    try:
        bias = fault["median"]["bias_ratio_median"]
    except (KeyError, TypeError) as e:
        print(f"warning: {os.path.join(root, 'fault_size.json')}: {e!r}: the doses are not shown in the fault's "
              f"units", file=sys.stderr)
        return []
    where = f"a checkpoint ({fault['ckpt']})" if fault.get("ckpt") else \
        f"the initial models of {len(fault.get('per_seed', []))} seeds"
    return [f"The doses in units of the bf16 state's own error on {where}: its rms is {error:.3g} of the attention "
            f"output's (median over layers and heads; its sign-keeping mean {bias:.3g}), so "
            + ", ".join(f"dose {d:g} is {d / error:.3g}x" for d in DOSES)
            + f" the fault's size (`{' '.join(fault.get('command', []))}`)."]


def times_the_fault(dose, error):
    """A dose as a multiple of the fault's own error, three figures: 3 / 0.00287 -> '1,040x'."""
    return f"{float(f'{dose / error:.3g}'):,.0f}x"


def dose_scale(runs, root):
    """The doses an injected error ran at, from its runs' config.json, and what they are in the fault's own
    error (fault_size): '; doses 3-30, about 1,040x-10,400x the fault's own error', '; a delta error at dose 3,
    about ...' where one error at one dose is a runaway's source; '' where no run injected an error."""
    cells = {(a.get("inject_site"), a.get("inject_scale")) for r in runs for a in [r.config.get("args", {})]
             if a.get("inject_site") and a.get("inject_scale")}
    if not cells:
        return ""
    doses = sorted({d for _, d in cells})
    measured = fault_size(root)
    fault = lambda *ds: "" if measured is None else \
        f", about {'-'.join(times_the_fault(d, measured[0]) for d in ds)} the fault's own error"
    if len(cells) == 1:
        (site, dose), = cells
        return f"; a {site} error at dose {dose:g}{fault(dose)}"
    ends = (doses[0], doses[-1]) if len(doses) > 1 else (doses[0],)
    return f"; dose{'s' * (len(doses) > 1)} {'-'.join(f'{d:g}' for d in ends)}{fault(*ends)}"


def dose_table(groups):
    return [[site, label] + [f"{k}/{n}" if n else "-" for k, n in cells]
            for (site, label), cells in dose_response(groups).items()]


# --------------------------------------------------------------------------------------------------
# The scale runs ran at, from their config.json


def scale(groups):
    """The runs' scale in one paragraph, from their config.json (the same every time)."""
    configs = [r.config for rs in groups.values() for r in rs if r.config.get("args")]
    if not configs:
        return "Scale: unknown (no config.json)."
    values = lambda key: sorted({str(c["args"].get(key)) for c in configs})
    joined = lambda key: "/".join(values(key))
    seeds = sorted({r.seed for rs in groups.values() for r in rs}, key=lambda s: (len(s), s))
    # an arm that sets its own --max-steps (claim 6's long horizon) is named apart from the rest's
    own = {f"{a} {r.config['args'].get('max_steps')}" for a, rs in groups.items() if "max_steps" in arm_flags(a)
           for r in rs if r.config.get("args")}
    steps = "/".join(sorted({str(r.config["args"].get("max_steps")) for a, rs in groups.items() for r in rs
                             if r.config.get("args") and "max_steps" not in arm_flags(a)}, key=lambda v: (len(v), v)))
    steps = f"{steps} steps" + (f" ({', '.join(sorted(own))} for the arms that set their own)" if own else "")
    blocks = "/".join(sorted({str(max(1, c["args"].get("block_size", 0) // (c["args"].get("block_n") or 128)))
                              for c in configs}))
    return (f"Scale: preset {joined('preset')}: {joined('arch')} model, {joined('n_layer')} layers of width "
            f"{joined('n_embd')} ({joined('n_head')} heads), context {joined('block_size')} streamed in {blocks} "
            f"key block(s) per row{ONE_BLOCK if blocks == '1' else ''}, batch "
            f"{joined('batch_size')} x {joined('grad_accum')}, {steps} at lr {joined('lr')} "
            f"({joined('schedule')} after {joined('warmup_steps')} warmup steps); data {joined('dataset')} in "
            f"{joined('tokenizer')} tokens; {len(seeds)} seeds ({seeds[0]} to {seeds[-1]}), {len(configs)} runs; "
            f"{machines(configs)}.")


ONE_BLOCK = (" (so the bf16 state is rounded once per row and never rescaled across blocks: the assay injects its "
             "own error, and the fault's rescale is claim 1 at CPU scale's, with 4 blocks per row)")


PAPER_SCALE = ("the paper's guard result: plain GPT-2, 12 final train and val losses within 0.03 nat of always-on "
               "QK-norm over 60k steps (SOURCES.md)")


def paper_scale(*groups_list):
    """The runs' scale beside the paper's, in one sentence: parameters, steps, tokens, val tokens (config.json)."""
    configs = [r.config for groups in groups_list for rs in groups.values() for r in rs if r.config.get("args")]
    if not configs:
        return ""
    values = lambda f: sorted({f(c) for c in configs if f(c) is not None})
    params = "/".join(f"{p / 1e6:.2f}M" for p in values(lambda c: c.get("params")))
    steps = "/".join(map(str, values(lambda c: c["args"].get("max_steps"))))
    tokens = values(lambda c: c["args"].get("batch_size", 0) * c["args"].get("grad_accum", 1) * c["args"].get(
        "block_size", 0))
    val = values(lambda c: c["args"].get("eval_iters", 0) * c["args"].get("batch_size", 0) * c["args"].get(
        "block_size", 0))
    return (f"Scale against the paper's: {PAPER_SCALE}; these runs: models of {params or '?'} parameters, {steps} "
            f"steps of {'/'.join(f'{t:,}' for t in tokens)} tokens, the final val loss on "
            f"{'/'.join(f'{v:,}' for v in val)} tokens. A tolerance or a horizon set at the paper's scale is "
            f"checked here against this scale's own noise (rule 2p's A/A pair) and runaways (rules 5 and 6).")


def machines(configs):
    """Where and when runs ran, from their config.json: "machine cpu (torch ...); runs started ... to ..."."""
    hardware = sorted({f"{v.get('gpu') or v.get('device', '?')} (torch {v.get('torch', '?')}, triton "
                       f"{v.get('triton', '?')})" for v in (c.get("versions", {}) for c in configs)})
    started = sorted(c["started"] for c in configs if c.get("started"))
    return (f"machine {', '.join(hardware)}; runs started {started[0] if started else '?'} to "
            f"{started[-1] if started else '?'}")


def lr_arch(name):
    """The architecture of an lr-study arm, from its name."""
    return next(arch for arch, prefix in reversed(ARCHS.items()) if name.startswith(prefix))


def lr_scale(groups):
    """The lr study's scale in one paragraph, from its runs' config.json: preset, each architecture's sizes,
    steps, learning rates, seeds and the data's identity (config.json's data record)."""
    configs = [r.config for rs in groups.values() for r in rs if r.config.get("args")]
    if not configs:
        return "Scale: unknown (no config.json)."
    joined = lambda key, among=configs: "/".join(sorted({str(c["args"].get(key)) for c in among}))
    archs = []
    for arch in sorted({str(c["args"].get("arch")) for c in configs}):
        among = [c for c in configs if str(c["args"].get("arch")) == arch]
        archs.append(f"{arch} ({joined('n_layer', among)} layers of width {joined('n_embd', among)}, "
                     f"{joined('n_head', among)} heads, {len(among)} runs)")
    data = sorted({f"{d.get('dataset')} in {d.get('tokenizer')} tokens, content_sha256 {d.get('content_sha256')}, "
                   f"{d.get('train_tokens')} train and {d.get('val_tokens')} val tokens" if d else
                   "unrecorded (runs older than config.json's data record)"
                   for d in (c.get("data") or {} for c in configs)})
    lrs = sorted({lr for _, lr in lr_cells(groups)})
    seeds = sorted({r.seed for rs in groups.values() for r in rs}, key=lambda s: (len(s), s))
    return (f"Scale: preset {joined('preset')}; models {', '.join(archs)}; context {joined('block_size')}, batch "
            f"{joined('batch_size')} x {joined('grad_accum')}, {joined('max_steps')} steps per run "
            f"({joined('schedule')} schedule after {joined('warmup_steps')} warmup steps); learning rates "
            f"{', '.join(f'{lr:g}' for lr in lrs) or 'none'} (each run's lr and min_lr); {len(seeds)} seeds "
            f"({seeds[0]} to {seeds[-1]}), {len(configs)} runs; data {'; '.join(data)}; {machines(configs)}.")


def sources_run(groups):
    """The runaway sources on which claims 5 or 6 have a run (of an arm other than no-error)."""
    return [s for s in SOURCES if any(groups.get(a) for a in {**probe_arms(s), **action_arms(s)} if a != NO_ERROR)]


def cut_arms(groups):
    """The arms of the claims judged here that have no run at all: what the sweep left out."""
    full = {n for number, (_, arms) in CLAIMS.items() if number not in (5, 6) for n in arms}
    full |= {n for s in sources_run(groups) for n in {**probe_arms(s), **action_arms(s)}}
    return sorted(n for n in full if not groups.get(n))


def lr_order(groups):
    """The study's cells in table order: architecture, arm (as LR_STUDY_ARMS), lr: [(base, lr, name)]."""
    rank = {prefix + a: (i, j) for i, prefix in enumerate(ARCHS.values())
            for j, a in enumerate((*LR_STUDY_ARMS, *AA_NAMES))}
    return sorted(((base, lr, name) for (base, lr), name in lr_cells(groups).items()),
                  key=lambda cell: (rank[cell[0]], cell[1]))


# --------------------------------------------------------------------------------------------------
# A claim's seeds, its runs, their commands


def seed_cell(run):
    """One run in a claim's seed table: its max logit and final val loss; where it collapsed, the step; where
    it did not finish, its status."""
    if run is None:
        return "-"
    if not run.finished:
        return run.status
    return (f"{num(run.max_logit, '.3g')} / {num(run.final_val, '.3f')}"
            + (f", collapsed at {run.collapse_step}" if run.collapsed and run.collapse_step is not None else ""))


def seed_table(groups, arms):
    """(header, rows) of a rule's seeds: one row per arm that ran, one column per seed any of them ran."""
    arms = [a for a in dict.fromkeys(arms) if groups.get(a)]
    seeds = sorted({r.seed for a in arms for r in groups[a]}, key=lambda s: (len(s), s))
    by_seed = {a: {r.seed: r for r in groups[a]} for a in arms}
    return ["arm", *seeds], [[a, *(seed_cell(by_seed[a].get(s)) for s in seeds)] for a in arms]


def commands(runs):
    """The runs' own commands (config.json's), one a line, as a bash block's lines."""
    return [shlex.join(typed_again(r.config["command"])) for r in runs if r.config.get("command")]


def typed_again(argv):
    """A run's recorded sys.argv as a person types it today: an assay run (one with the assay's flags, which
    train.py took before the assay moved to lab/, or one lab.train_assay made, whose argv[0] is its file's path)
    as `python -m lab.train_assay ...`; any other run as `python train.py ...`, or as it was typed."""
    script, args = os.path.basename(argv[0]), list(argv[1:])
    if script == "train_assay.py" or (script == "train.py" and any(a.split("=", 1)[0] in ASSAY_FLAGS for a in args)):
        return ["python", "-m", "lab.train_assay", *args]
    return ["python", *argv]


def code(lines):
    return "```bash\n" + "\n".join(lines) + "\n```"


# --------------------------------------------------------------------------------------------------
# The learning-rate study's tables


def lr_arch_tables(groups, arch, markdown, title):
    """One architecture's tables: the LR sensitivity of each arm and the lr it starts to run away from, and
    the final val loss by learning rate; [] where the architecture has no runs."""
    prefix, cells = ARCHS[arch], lr_order(groups)
    sensitivity = lr_sensitivity(groups, prefix)
    if not sensitivity:
        return []
    lrs = sorted({lr for base, lr, _ in cells if lr_arch(base) == arch})
    table = []
    for arm, (by_seed, starts) in sensitivity.items():
        spread = (f"{statistics.median(by_seed):.3f} [{min(by_seed):.3f}, {max(by_seed):.3f}]" if by_seed
                  else "-")
        table.append([arm, spread, str(len(by_seed)), "none in the grid" if starts is None else f"{starts:g}"])
    finals = []
    for arm in sensitivity:
        row = [arm]
        for lr in lrs:
            runs = [r for r in groups.get(lr_name(arm, lr), []) if done(r)]
            row.append(f"{num(median(map(end_val, runs)), '.3f')} ({sum(map(lr_ran_away, runs))}/{len(runs)})"
                       if runs else "-")
        finals.append(row)
    guard, plain = sensitivity.get(prefix + "bf16-guard"), sensitivity.get(prefix + "bf16")
    ratio = (f" bf16-guard's median LR sensitivity is {statistics.median(guard[0]) / statistics.median(plain[0]):.0%}"
             f" of unguarded bf16's." if guard and plain and guard[0] and plain[0] and
             statistics.median(plain[0]) > 0 else "")
    return [title(f"{arch}: LR sensitivity, and where each arm starts to run away"),
            "LR sensitivity (Wortsman et al. 2023), per seed: the mean over the learning rates of min(final val "
            "loss, val loss at init), less the best final val loss of any arm at any learning rate of that "
            "seed's sweep (nat per token); a seed with a run missing, unfinished or without either loss is "
            "left out of its arm. Runs away from: the smallest learning rate at which the arm ran away in a "
            "majority of seeds." + ratio,
            render(["arm", "LR sensitivity: median over seeds [min, max]", "n", "runs away from lr"], table,
                   markdown),
            f"{arch}: final val loss by learning rate, median over the finished runs (ran away / finished):",
            render(["arm"] + [f"lr {lr:g}" for lr in lrs], finals, markdown)]


LR_RUN_HEADER = ["arm", "lr", "seed", "status", "val at init", "final val", "max logit", "ran away", "guard trigger",
                 "first past guard threshold", f"first past {RUNAWAY_LOGIT:g}"]


def lr_runs(groups, bases=None):
    """The study's runs in table order, of the base arms `bases` (all where None): [(base, lr, run)]."""
    return [(base, lr, r) for base, lr, name in lr_order(groups) if bases is None or base in bases
            for r in groups[name]]


def lr_run_rows(runs):
    return [[base, f"{lr:g}", r.seed, r.status, num(r.init_val, ".4f"), num(r.final_val, ".4f"),
             num(r.max_logit, ".4g"), ("yes" if lr_ran_away(r) else "no") if r.finished else "-", num(r.trigger),
             num(r.first_past(r.guard_threshold())), num(r.first_past(RUNAWAY_LOGIT, inclusive=True))]
            for base, lr, r in runs]
