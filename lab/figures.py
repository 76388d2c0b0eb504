"""
The report's figures: per claim the median over seeds of loss, max logit and sigma(W_q) against step, and the
survival curve; the dose-response curves of claims 3 and 4; the learning-rate study's, after Wortsman et al.;
and a few runs of one's choosing (--runs: the demo's figure). Each written whole (lab/files.py).
"""
import math
import os
import statistics

from guard import ACTIONS
from lab.files import save_figure
from lab.loading import Run, done, end_val, finite_max, lr_ran_away, ran_away
from lab.rules.common import median
from lab.rules.lr_study import ARCHS, lr_cells
from lab.stats import LOSS_TOL, mean_interval
from lab.sweep import AA_ARMS, DOSES, LONG_STEPS, LR_STUDY_ARMS, NO_ERROR, SITES, lr_name, split_lr
from lab.tables import curve_words, dose_logits, dose_outcomes, fix_words, lr_arch, lr_order
from lab.thresholds import GUARD_THRESHOLD, LOGIT_RATIO, RUNAWAY_LOGIT
from lab.verdicts import SOURCE_WORDS, expanded_rules, verdicts


# --------------------------------------------------------------------------------------------------
# Drawing runs


def _pyplot(quiet=False):
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
        return plt
    except ImportError:
        if not quiet:   # quiet: said once already
            print("plots skipped: matplotlib is not installed (pip install matplotlib, then run lab.report again)")
        return None


def survival(runs):
    """Kaplan-Meier [(step, fraction not yet collapsed)]; uncollapsed runs censored at their end."""
    # at equal steps the collapses come first: a run censored at step t was still at risk at t
    times = sorted(((r.collapse_step if r.collapsed and r.collapse_step is not None else (r.steps or [0])[-1]),
                    not r.collapsed) for r in runs)
    at_risk, alive, curve = len(times), 1.0, [(0, 1.0)]
    for step, censored in times:
        if not censored:
            alive *= (at_risk - 1) / at_risk
            curve.append((step, alive))
        at_risk -= 1
    return curve


PANELS = {"loss": ("train loss (nat per token)", "linear"), "logit": ("max attention logit", "log"),
          "sigma": ("max sigma(W_q) over layers", "log"), "others": ("max sigma of W_v, W_o, MLP", "log")}


def plot_runs(runs, axes, colors, panels=tuple(PANELS)):
    """One line per run in each panel; the guard trigger a dotted vertical line, a collapse an x."""
    def series(run, panel):
        if panel == "others":
            return [finite_max([run.sigmas[k][i] for k in run.other_kinds]) or math.nan for i in range(len(run.steps))]
        return getattr(run, panel)
    drawn = set()   # the panels with a value to draw: a log scale of nothing but NaN cannot be drawn
    for run in runs:
        color, k = colors[run.group], run.seed[4:]
        style = ["-", "--", ":", "-."][(int(k) - 1) % 4 if k.isdigit() else 0]
        for ax, panel in zip(axes, panels):
            ys = [y if y is not None and math.isfinite(y) and y > 0 else math.nan for y in series(run, panel)]
            if any(not math.isnan(y) for y in ys):
                drawn.add(panel)
            ax.plot(run.steps, ys, color=color, ls=style, lw=1, label=f"{run.group} {run.seed}".strip())
            if run.trigger is not None:
                ax.axvline(run.trigger, color=color, ls=":", lw=0.8)
            if run.collapse_step is not None and run.steps:
                i = min(range(len(ys)), key=lambda j: abs(run.steps[j] - run.collapse_step))
                ax.plot([run.steps[i]], [finite_max(ys) if math.isnan(ys[i]) else ys[i]], "x", color=color,
                        ms=10, mew=2)
    for ax, panel in zip(axes, panels):
        label, scale = PANELS[panel]
        ax.set(ylabel=label, yscale=scale if panel in drawn else "linear")
        if panel not in drawn:
            ax.text(0.5, 0.5, "no finite positive value logged", transform=ax.transAxes, ha="center",
                    fontsize=9)
        ax.grid(alpha=0.3)
    axes[-1].set_xlabel("step")


# --------------------------------------------------------------------------------------------------
# An arm in words, for legends


# claims 1, 2 and 7's arms that no pattern below names
NAMED_ARMS = {"bf16-safemax": "bf16 state with safemax (the prior work's fix)",
              "bf16-qknorm-always": "bf16 state, QK-norm from step 0",
              "bf16-qknorm-always-aa": "bf16 state, QK-norm from step 0, run again beside key tiles of 64",
              "bf16-qknorm-always-tile64": "bf16 state, QK-norm from step 0, key tiles of 64 (not an A/A)",
              "bf16-qknorm-always-t1": "bf16 state, QK-norm from step 0, 1 CPU thread (A/A)",
              "bf16-qknorm-always-t2": "bf16 state, QK-norm from step 0, 2 CPU threads (A/A)",
              "bf16-guard": "bf16 state, QK-Guard",
              "fp32-guard": "fp32 state, QK-Guard", "fp32-qknorm-always": "fp32 state, QK-norm from step 0",
              "state-only": "bf16 state, no other rounding", "logits-only": "fp32 state, logits rounded to bf16",
              "pv-only": "fp32 state, P V rounded to bf16", "standard": "fp32 state, no other rounding",
              "bf16-all": "bf16 state, logits, P V and the backward rounded"}


LR_WORDS = {"fp32": "fp32 state", "bf16": "bf16 state", "bf16-safemax": "bf16 state, safemax fix",
            "bf16-guard": "bf16 state, QK-Guard", "bf16-qknorm-always": "bf16 state, QK-norm always",
            "fp32-guard": "fp32 state, QK-Guard",
            "bf16-qknorm-always-aa": "bf16 state, QK-norm always, run again beside its 64-key twin",
            "bf16-qknorm-always-tile64": "bf16 state, QK-norm always, state rounded per 64 keys (not an A/A)",
            "bf16-qknorm-always-t1": "bf16 state, QK-norm always, 1 CPU thread (A/A)",
            "bf16-qknorm-always-t2": "bf16 state, QK-norm always, 2 CPU threads (A/A)"}


def action_words(rest):
    """'guard-<action>' in words, from guard.py's registry (claim 6's actions); else rest as it is."""
    action = ACTIONS.get(rest[len("guard-"):])
    return action.words if action else rest


def arm_words(name):
    """An arm's name in words, for legends: 'inject-mlp-out-0.1-c1-qkfix' -> 'mlp-out error 0.1,
    coherent, with the QK-only fix'."""
    if name.endswith("-long-gain"):
        return f"{arm_words(name[:-len('-gain')])}, run again with its norm gain logged"
    if name.endswith("-long"):
        return f"{arm_words(name[:-len('-long')])}, {LONG_STEPS} steps"
    if name == NO_ERROR:
        return "no error (fp32 state)"
    if name.startswith("llama-"):
        return "llama, " + arm_words(name[len("llama-"):])
    if name in NAMED_ARMS:
        return NAMED_ARMS[name]
    if name.startswith("inject-"):
        for site in SITES:
            if name.startswith(f"inject-{site}-"):
                dose, coherence = name[len(f"inject-{site}-"):].split("-")[:2]
                kind = "coherent" if coherence == "c1" else f"sign kept with p {coherence[1:]}"
                return f"{site} error {dose}, {kind}" + (", with the QK-only fix" if name.endswith("-qkfix") else "")
    for source, words in SOURCE_WORDS.items():
        if name == source:
            return words
        if name.startswith(source + "-"):
            rest = name[len(source) + 1:]
            rest = {"guard": "QK-Guard (QK-norm)", "probe-topk": "probe: QK's top-k removed",
                    "probe-equal": "equal energy removed elsewhere", "probe-fixed": "a fixed random QK subspace "
                    "removed", "probe-shrink": "the whole update shrunk as much",
                    "probe-nextk": "QK's next k directions removed", "probe-v-topk": "W_v's top-k removed", "probe-mlp-topk": "the MLP's top-k removed"}.get(
                        rest, f"QK-Guard's trigger, then {action_words(rest)}")
            short = {"bf16": "bf16 state", "assay": "injected delta error", "lr": "lr 3e-2"}.get(source, source)
            return f"{short}: {rest}"
    return name


# --------------------------------------------------------------------------------------------------
# A claim's figure


def arm_horizon(runs):
    """The steps an arm's runs were set to run (the longest of them)."""
    return max((r.horizon() for r in runs), default=0)


def horizon_columns(groups, arms):
    """A claim figure's columns, [(steps shown, its arms)]: one of every arm, or, where some arms run
    more than twice as long as the shortest (claim 6's -long arms), two: the shortest horizon with
    every arm, and the longest with the arms that ran it, so that neither squeezes the other."""
    steps = {n: arm_horizon(groups[n]) for n in arms}
    short, longest = min(steps.values()), max(steps.values())
    if longest <= 2 * short:
        return [(longest, arms)]
    return [(short, arms), (longest, [n for n in arms if steps[n] > 2 * short])]


def arm_medians(runs, panel):
    """(steps, per step the median over runs of panel's value, nan where none is positive)."""
    steps = sorted({s for r in runs for s in r.steps})
    by_run = [dict(zip(r.steps, getattr(r, panel))) for r in runs]
    values = [median([v.get(s) for v in by_run]) for s in steps]
    return steps, [y if y is not None and y > 0 else math.nan for y in values]


def plot_claim(plt, groups, label, arms, png):
    """One claim's figure: per arm the median over seeds of loss, max logit and sigma(W_q) against step,
    and its survival curve; in two columns where the arms' horizons differ (horizon_columns)."""
    columns = horizon_columns(groups, arms)
    fig, axes = plt.subplots(4, len(columns), sharex="col", figsize=(9 if len(columns) == 1 else 15, 12),
                             squeeze=False)
    panels = ("loss", "logit", "sigma")
    lines = {(n, panel): arm_medians([r for r in groups[n] if r.steps], panel) for n in arms for panel in panels}
    for col, (steps, shown) in enumerate(columns):
        ax = axes[:, col]
        for n in shown:
            color = f"C{arms.index(n) % 10}"
            for a, panel in zip(ax[:3], panels):
                a.plot(*lines[n, panel], color=color, lw=1.2, label=arm_words(n))
            curve = survival(groups[n])   # drawn on to the arm's last logged step: no collapse after its last
            ax[3].step(*zip(*curve, (lines[n, "loss"][0][-1], curve[-1][1])), where="post", color=color)
        for a, panel in zip(ax[:3], panels):
            a.set(ylabel=PANELS[panel][0].replace(" (", "\n("), yscale=PANELS[panel][1])
        ax[3].set(ylabel="fraction of seeds\nnot collapsed", ylim=(-0.05, 1.05), xlabel="step (optimizer updates)",
                  xlim=(0, steps))
        for a in ax:
            a.grid(alpha=0.3)
        if len(columns) > 1:
            ax[0].set_title(f"the first {steps} steps: every arm" if col == 0 else
                            f"the whole {steps} steps: the {len(shown)} arms run that long", fontsize=10)
    fig.legend(handles=axes[0][0].get_lines(), loc="upper center", bbox_to_anchor=(0.5, 0), ncol=len(columns),
               fontsize=8)
    split = f"; left the first {columns[0][0]} steps, right the whole {columns[1][0]}" if len(columns) > 1 else ""
    fig.suptitle(f"claim {label}: each line the median over seeds of one arm{split}", fontsize=11, y=0.985)
    fig.subplots_adjust(top=0.95, bottom=0.08)   # room for the title, and for the legend below the axes
    save_figure(fig, png, dpi=110, bbox_inches="tight")
    plt.close(fig)


def plot_claims(groups, out_dir):
    """Claims 1, 2, 5, 6, 7: per arm, the median over seeds of loss, max logit and sigma(W_q)
    against step, and survival curves (plot_claim); claims 3 and 4: dose-response curves
    (dose_response.png, plot_dose_response)."""
    plt = _pyplot()
    if plt is None:
        return []
    os.makedirs(out_dir, exist_ok=True)
    saved = []
    judged = {row[0] for row in verdicts(groups) if row[1] != "not run"}
    rules = {label: arms for label, _, arms, _ in expanded_rules(groups) if not callable(arms) and label in judged}
    for label, arms in rules.items():
        arms = [n for n in dict.fromkeys(arms) if any(r.steps for r in groups.get(n, []))]
        if not arms or label in ("2v",):
            continue
        saved.append(os.path.join(out_dir, f"claim{label.replace(' ', '').replace('(', '-').replace(')', '')}.png"))
        plot_claim(plt, groups, label, arms, saved[-1])
    if dose_outcomes(groups):
        saved.append(os.path.join(out_dir, "dose_response.png"))
        plot_dose_response(plt, groups, saved[-1])
    return saved


# --------------------------------------------------------------------------------------------------
# Claims 3 and 4: the dose-response figure


OFF_SCALE_STEP = 2.5   # the dose figure's band above the logit scale: one row per curve, this factor apart


def plot_dose_response(plt, groups, png):
    """Claims 3 and 4, a column per site. Top: the fraction of seeds that ran away beyond their no-error run,
    by its max logit (solid) and, dashed where it adds any, by a collapse too (dose_outcomes). Bottom: the scale
    claim 4 judges on, each run's max logit over its seed's no-error run's (median, range shaded); a run that
    collapsed or diverged ranks above every logit, so it is kept as a row of marks above the scale, with the
    count (dose_logits)."""
    outcomes, logits = dose_outcomes(groups), dose_logits(groups)
    sites = list(dict.fromkeys(site for site, _ in outcomes))
    labels = list(dict.fromkeys(label for _, label in outcomes))   # a color and an off-scale row each
    finite = [x for key in outcomes for values, _ in logits[key].values() for x in values]
    low, high = (min(finite), max(finite)) if finite else (1.0, 1.0)
    row_y = {label: high * OFF_SCALE_STEP ** (i + 1) for i, label in enumerate(labels)}
    band = (high * OFF_SCALE_STEP ** 0.5, high * OFF_SCALE_STEP ** (len(labels) + 0.6))
    any_off = any(off for key in outcomes for _, off in logits[key].values())
    fig, axes = plt.subplots(2, len(sites), figsize=(4.8 * len(sites), 8), sharex="col", sharey="row", squeeze=False)
    for col, site in enumerate(sites):
        top, bottom = axes[0][col], axes[1][col]
        handles, dashed, off_here = [], False, False
        for i, label in enumerate(labels):
            if (site, label) not in outcomes:
                continue
            color = f"C{i}"
            cells = [(d, a, b, n) for d, (a, b, n) in zip(DOSES, outcomes[site, label]) if n]
            xs = [d for d, *_ in cells]
            top.plot(xs, [a / n for _, a, _, n in cells], "o-", color=color)
            if any(b for _, _, b, _ in cells):
                dashed = True
                top.plot(xs, [(a + b) / n for _, a, b, n in cells], "o--", color=color, mfc="none")
            handles.append(plt.Line2D([], [], color=color, marker="o", label=curve_words(site, label)))
            values = [logits[site, label][d][0] + [math.inf] * logits[site, label][d][1] for d in xs]
            at = lambda v: row_y[label] if v == math.inf else v   # off the scale: the curve's row above it
            meds = [at(statistics.median(v)) if v else math.nan for v in values]
            bottom.plot(xs, meds, "-", color=color)
            bottom.plot([x for x, m in zip(xs, meds) if m != row_y[label]], [m for m in meds if m != row_y[label]],
                        "o", color=color)
            bottom.fill_between(xs, [at(min(v)) if v else math.nan for v in values],
                                [at(max(v)) if v else math.nan for v in values], color=color, alpha=0.15, lw=0)
            for d, v in zip(xs, values):
                off = sum(x == math.inf for x in v)
                if off:
                    off_here = True
                    bottom.plot([d], [row_y[label]], "^", color=color, ms=8)
                    bottom.annotate(f"{off}/{len(v)}", (d, row_y[label]), xytext=(6, 0), textcoords="offset points",
                                    fontsize=7, color=color, va="center")
        top.set_title(f"error at {site}\n(its QK-only fix: {fix_words(site)})", fontsize=9)
        bottom.set(xscale="log", yscale="log", xlabel="error size per step (rms / signal rms)")
        bottom.axhline(1.0, color="grey", lw=0.8, ls=":")
        if any_off:   # the band above the scale, its ticks left off (a row there is a count, not a logit)
            bottom.axhspan(*band, color="0.92", zorder=0)
            bottom.set_ylim(low / 2, band[1])
            ticks = [10.0 ** k for k in range(math.floor(math.log10(low / 2)), math.floor(math.log10(band[0])) + 1)
                     if low / 2 <= 10.0 ** k]
            bottom.set_yticks(ticks + [math.sqrt(band[0] * band[1])],
                              [f"$10^{{{round(math.log10(t))}}}$" for t in ticks] + ["collapsed"])
        dose_ticks = [d for d in DOSES if any(n for (s, _), cells in outcomes.items() if s == site
                                              for dd, (*_, n) in zip(DOSES, cells) if dd == d)]
        bottom.set_xticks(dose_ticks, [f"{d:g}" for d in dose_ticks])
        bottom.minorticks_off()
        for ax in (top, bottom):
            ax.grid(alpha=0.3)
        grey = dict(color="grey")
        handles += [plt.Line2D([], [], ls="-", label=f"top, solid: max logit >= {RUNAWAY_LOGIT:g} and >= "
                               f"{LOGIT_RATIO:g}x the no-error run's", **grey)]
        if dashed:
            handles.append(plt.Line2D([], [], ls="--", marker="o", mfc="none", label="top, dashed: that, or a "
                                      "collapse of the loss with logits under that bar", **grey))
        handles.append(plt.Line2D([], [], ls=":", lw=0.8, label="bottom: 1 = the no-error run's max logit", **grey))
        if off_here:
            handles.append(plt.Line2D([], [], ls="", marker="^", label="bottom, grey band: collapsed or diverged "
                                      "(off the scale), k/n seeds", **grey))
        bottom.legend(handles=handles, fontsize=7, loc="upper center", bbox_to_anchor=(0.5, -0.16))
    axes[0][0].set(ylabel="fraction of seeds that ran away\nbeyond the no-error run (same seed)", ylim=(-0.05, 1.05))
    axes[1][0].set(ylabel="max attention logit over the no-error\nrun's, same seed (median, range)")
    save_figure(fig, png, dpi=110, bbox_inches="tight")
    plt.close(fig)


# --------------------------------------------------------------------------------------------------
# The learning-rate study's figures


AA_AGAIN, AA_TWIN = AA_ARMS["bf16-qknorm-always"]   # the lr study's A/A pair, where run: bf16-qknorm-always


GAP_LEVEL = 0.90                       # the lr figures' interval around the mean paired gap


def seed_gaps(groups, name, ref):
    """[(seed, final val loss of folder `name`'s run less folder ref's)] over the seeds where both finished:
    a seed only one of them ran is left out. Not finite where either diverged (end_val)."""
    theirs = {r.seed: r for r in groups.get(ref, []) if done(r)}
    return [(r.seed, end_val(r) - end_val(theirs[r.seed])) for r in groups.get(name, []) if done(r)
            and r.seed in theirs]


def runaway_lrs(groups, prefix=""):
    """The lrs where the unguarded bf16 arm ran away in a majority of its seeds (an unfinished run counted
    as ran away), the lrs where rule 2p judges the guard against always-on QK-norm."""
    return sorted(lr for (base, lr), name in lr_cells(groups).items() if base == prefix + "bf16" and groups[name]
                  and 2 * sum(not done(r) or lr_ran_away(r) for r in groups[name]) > len(groups[name]))


def lr_gaps(groups, prefix=""):
    """The paired gap rule 2p judges: ({runaway lr: seed_gaps(bf16-guard, bf16-qknorm-always)}, {lr: the
    A/A twin's seed_gaps to the arm run again beside it} at each lr both ran, read from the folders: lr_cells knows
    only the study's own arms)."""
    always = lambda lr: lr_name(prefix + "bf16-qknorm-always", lr)
    guard = {lr: seed_gaps(groups, lr_name(prefix + "bf16-guard", lr), always(lr))
             for lr in runaway_lrs(groups, prefix)}
    aa = {lr: seed_gaps(groups, name, lr_name(prefix + AA_AGAIN, lr)) for name in groups
          for base, lr in [split_lr(name)] if base == prefix + AA_TWIN and lr is not None and groups[name]
          and groups.get(lr_name(prefix + AA_AGAIN, lr))}
    return guard, aa


def plot_gaps(ax, gaps, color, label, shift, mean_label=None):
    """One arm's paired gaps in the lr figure's third panel: each seed a dot, the mean with its GAP_LEVEL
    interval an error bar (its legend entry mean_label), `shift` decades right of its lr; a gap not finite
    (a diverged run) counted at the top."""
    for i, (lr, pairs) in enumerate(sorted(gaps.items())):
        values = [g for _, g in pairs if math.isfinite(g)]
        x = lr * 10 ** shift
        spread = [x * 10 ** (0.08 * (j / max(1, len(values) - 1) - 0.5)) for j in range(len(values))]
        ax.plot(spread, values, "o", color=color, ms=3.5, alpha=0.6, label=f"{label}: one seed" if i == 0 else None)
        if values:
            mean, lo, hi = mean_interval(values, GAP_LEVEL)
            ax.errorbar([x], [mean], yerr=[[mean - lo], [hi - mean]] if math.isfinite(lo) else None, fmt="D",
                        color=color, mec="k", capsize=4, ms=6, lw=1.5,
                        label=mean_label if i == 0 else None)
        if len(values) < len(pairs):
            ax.annotate(f"{len(pairs) - len(values)} not finite", (x, 1), xycoords=("data", "axes fraction"),
                        ha="center", va="top", fontsize=7, color=color)


def plot_lr_study(groups, out_dir, quiet=False):
    """The lr study, one figure per architecture (lr-gpt2.png, lr-llama.png), as Wortsman et al. 2023's
    Figure 1: final val loss and max attention logit against the learning rate, per arm the median over its
    finished runs and their min-max range shaded; the guard's threshold and RUNAWAY_LOGIT marked. A third
    panel: the paired gap rule 2p judges (lr_gaps), with the A/A arm's where it ran."""
    plt = _pyplot(quiet)
    if plt is None:
        return []
    os.makedirs(out_dir, exist_ok=True)
    saved, cells = [], lr_order(groups)
    for arch, prefix in ARCHS.items():
        mine = [(base, lr, [r for r in groups[name] if done(r)]) for base, lr, name in cells if lr_arch(base) == arch]
        if not any(runs for _, _, runs in mine):
            continue
        fig, axes = plt.subplots(3, 1, sharex=True, figsize=(7, 11.5), gridspec_kw={"height_ratios": [1, 1, 0.9]})
        arms = [a for a in LR_STUDY_ARMS if any(base == prefix + a and runs for base, _, runs in mine)]
        for i, arm in enumerate(arms):
            at = [(lr, runs) for base, lr, runs in mine if base == prefix + arm and runs]
            for ax, value in zip(axes, (lambda r: r.final_val, lambda r: r.max_logit)):
                points = [(lr, [v for v in map(value, runs) if v is not None and math.isfinite(v) and v > 0])
                          for lr, runs in at]
                points = [(lr, vs) for lr, vs in points if vs]   # a diverged run's nan or inf is not drawn
                if points:
                    xs = [lr for lr, _ in points]
                    ax.plot(xs, [statistics.median(vs) for _, vs in points], "o-", color=f"C{i}", lw=1.5,
                            label=LR_WORDS[arm] if ax is axes[0] else None)   # one legend of the arms
                    ax.fill_between(xs, [min(vs) for _, vs in points], [max(vs) for _, vs in points],
                                    color=f"C{i}", alpha=0.15, lw=0)
        guarded = [r.guard_threshold() for base, _, runs in mine if base.endswith("-guard") for r in runs]
        threshold = statistics.median(guarded) if guarded else GUARD_THRESHOLD
        axes[1].axhline(threshold, color="k", ls=":", lw=1, label=f"QK-Guard's threshold ({threshold:g})")
        axes[1].axhline(RUNAWAY_LOGIT, color="k", ls="--", lw=1, label=f"{RUNAWAY_LOGIT:g}: a runaway "
                        f"(RUNAWAY_LOGIT)")
        # the third panel: QK-Guard against always-on QK-norm, seed by seed, where rule 2p compares them
        guard, aa = lr_gaps(groups, prefix)
        gap_ax = axes[2]
        gap_ax.axhspan(-LOSS_TOL, LOSS_TOL, color="C2", alpha=0.15, lw=0,
                       label=f"within {LOSS_TOL:g} nat (LOSS_TOL): rule 2p's tolerance")
        gap_ax.axhline(0.0, color="k", lw=0.8)
        color = f"C{arms.index('bf16-guard')}" if "bf16-guard" in arms else "C3"
        plot_gaps(gap_ax, guard, color, "QK-Guard less QK-norm always", shift=0.0,
                  mean_label=f"the mean, its {GAP_LEVEL:.0%} interval (Student t)")
        plot_gaps(gap_ax, aa, "grey", "A/A: QK-norm always at 2 less 1 CPU threads", shift=0.12)
        if not guard:
            gap_ax.text(0.5, 0.5, "no learning rate where bf16 state ran away in a majority of seeds",
                        transform=gap_ax.transAxes, ha="center", fontsize=8)
        axes[0].set(xscale="log", ylabel="final val loss (nat per token)")
        axes[1].set(xscale="log", yscale="log", ylabel="max attention logit (over all logged steps)")
        gap_ax.set(ylabel="final val loss, QK-Guard less\nQK-norm always, same seed (nat)", xlabel="learning rate")
        for ax in axes:
            ax.grid(alpha=0.3)
            ax.legend(fontsize=7)
        counts = sorted({len(runs) for _, _, runs in mine if runs})   # 8 seeds, 16 where rule 2p needed them
        seeds = f"{counts[0]}" if len(counts) == 1 else f"{counts[0]} to {counts[-1]}"
        steps = "/".join(str(s) for s in sorted({r.horizon() for _, _, runs in mine for r in runs}))
        axes[0].set_title(f"{arch}, a CPU-scale proxy, {steps} steps per run: each line the median over its "
                          f"{seeds} seeds of one arm (shaded: their min to max)", fontsize=9)
        gap_ax.set_title("the paired gap rule 2p judges, at each lr where bf16 state ran away in a majority of seeds"
                         + ("; grey: the A/A pair's, at the lrs it ran" if aa else ""), fontsize=9)
        saved.append(os.path.join(out_dir, f"lr-{arch}.png"))
        save_figure(fig, saved[-1], dpi=110, bbox_inches="tight")
        plt.close(fig)
    return saved


# --------------------------------------------------------------------------------------------------
# A few runs (--runs): the demo's figure


def describe(run):
    """A run in words for a legend, from its config.json: "guard off", "guard on (qknorm from step 23)"
    (the first update its action changed); the folder name where there is no config."""
    args = run.config.get("args", {})
    if not args:
        return os.path.basename(os.path.normpath(run.path))
    if args.get("guard") != "on":
        return "guard off"
    action = {"qknorm": "QK-norm", "qkclip": "QK-Clip"}.get(args.get("guard_action", "qknorm"), args.get("guard_action"))
    return f"guard on ({action} from step {run.acting_from})" if run.acting_from is not None else \
        f"guard on ({action}), never fired"


def runs_title(runs):
    """What a few runs share, for their figure's title: the learning rate, preset and softmax state, and
    "a max-logit runaway" only where one of them ran away; the marks drawn, only where there are some."""
    shared = lambda key: "/".join(dict.fromkeys(format(a[key], "g") if isinstance(a[key], float) else str(a[key])
                                                for r in runs for a in [r.config.get("args", {})] if key in a))
    setting = ", ".join(f"{shared(key)} {word}" for key, word in (("preset", "preset"), ("accum", "state"))
                        if shared(key))   # what another script's runs (lab.attach_demo) do not record, left out
    marks = [("dotted line: the guard's trigger", any(r.trigger is not None for r in runs)),
             ("x: a collapse", any(r.collapse_step is not None for r in runs))]
    return (f"{'a max-logit runaway at' if any(map(ran_away, runs)) else 'training at'} lr {shared('lr') or '?'}"
            + (f" ({setting})" if setting else "") + "".join(f"; {words}" for words, drawn in marks if drawn))


def plot_some_runs(paths, png, labels=None):
    """--runs: one figure of a few run folders (say the demo's unguarded and guarded runs), labelled
    by `labels` or describe(), titled by what drives them (runs_title)."""
    plt = _pyplot()
    if plt is None:
        return None
    runs = [Run(os.path.abspath(p)) for p in paths]
    for i, run in enumerate(runs):
        run.group, run.seed = labels[i] if labels else describe(run), ""
    fig, axes = plt.subplots(3, 1, sharex=True, figsize=(8, 8))
    plot_runs(runs, axes, {r.group: f"C{i}" for i, r in enumerate(runs)}, panels=("loss", "logit", "sigma"))
    thresholds = sorted({r.guard_threshold() for r in runs if r.config.get("args", {}).get("guard") == "on"})
    for value in thresholds:
        axes[1].axhline(value, color="grey", ls="--", lw=0.8, label=f"the guard's threshold ({value:g})")
    for ax, words in zip(axes, ("train loss (nat per token)", "max attention logit\n(over layers and heads)",
                                "top singular value of W_q\n(max over layers)")):
        ax.set_ylabel(words)
    axes[2].yaxis.set_major_formatter(plt.FuncFormatter(lambda v, _: f"{v:g}"))   # 30, not 3 x 10^1
    axes[2].yaxis.set_minor_formatter(plt.FuncFormatter(lambda v, _: f"{v:g}" if f"{v:g}"[0] in "235" else ""))
    axes[-1].set_xlabel("step (optimizer updates)")
    axes[0].legend(fontsize=8)
    if thresholds:
        axes[1].legend(handles=axes[1].get_lines()[-len(thresholds):], fontsize=8, loc="center right")
    axes[0].set_title(runs_title(runs), fontsize=9)
    save_figure(fig, png, dpi=110, bbox_inches="tight")
    plt.close(fig)
    return png
