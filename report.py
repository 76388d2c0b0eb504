"""
Read a sweep's runs and say, claim by claim, whether the paper's claims reproduced.

    python report.py runs/claims                          # tables on the console, PNG plots into runs/claims
    python report.py runs/claims --markdown RESULTS.md    # also Markdown: tables, date, hardware, commands, and the
                                                          # plots (into plots/ beside it, so the links survive a commit)
    python report.py runs/claims --plots figures/         # the plots elsewhere (they need matplotlib)

Reads every <root>/<experiment>/seed<k>/ that train.py wrote (log.jsonl, config.json; see sweep.py). Runs still
going, interrupted, crashed or empty are listed as such and left out of the verdicts.
"""
import argparse
import glob
import json
import math
import os
import shlex
import statistics
import time

from sweep import CLAIMS, read_log

# ---------------------------------------------------------------------------------------------------------------
# The verdict rules. A rule reads the finished runs (end status completed or collapsed) of the groups it names; a
# claim whose rule names a group without a finished run is "not run". The texts are printed with the verdicts.
FINAL_WINDOW = 5         # final train loss = mean of the last FINAL_WINDOW logged losses
LOSS_TOL = 0.03          # nat: the paper's largest gap between QK-Guard and always-on QK-norm
RUNAWAY_LOGIT = 1000.0   # a runaway's max attention logit (REFERENCE.md sec. 3: healthy 52-137, collapsing 1808+)
SIGMA_RATIO = 2.0        # "clearly larger" max sigma(W_q): by more than this factor (the paper's probe: 237 / 11.1)
# A run "ran away" if it collapsed or its max attention logit reached RUNAWAY_LOGIT.
RULES = {
    1: ("bf16 collapsed in a majority of seeds; fp32 and bf16-safemax in none",
        lambda g: collapses_vs_not(g["bf16"], g["fp32"], g["bf16-safemax"])),
    2: ("bf16-guard collapsed in no seed and triggered in a majority; its final train and val losses are within "
        "LOSS_TOL of bf16-qknorm-always's, seed by seed",
        lambda g: guard_matches(g["bf16-guard"], g["bf16-qknorm-always"])),
    3: ("inject-mlp-out ran away in a majority of seeds, inject-mlp-out-qkfix in none, and the median max "
        "sigma(W_q) of the first is more than SIGMA_RATIO times the second's",
        lambda g: runs_away_vs_not(g["inject-mlp-out"], g["inject-mlp-out-qkfix"])),
    4: ("inject-coherent ran away in a majority of seeds, inject-random in none, and the median max sigma(W_q) "
        "of coherent is more than SIGMA_RATIO times random's",
        lambda g: runs_away_vs_not(g["inject-coherent"], g["inject-random"])),
    5: ("the median max sigma(W_q) of bf16-probe-equal is more than SIGMA_RATIO times bf16-probe-topk's, and "
        "bf16-probe-topk collapsed in no seed",
        lambda g: probe_holds(g["bf16-probe-topk"], g["bf16-probe-equal"])),
    6: ("in each of bf16-guard-lr-drop, -clip and -softcap, in a majority of seeds, the guard triggered and the "
        "run failed anyway: it ran away, or its sigma(W_q) grew more than SIGMA_RATIO times after the trigger",
        lambda g: all_fail(g["bf16-guard-lr-drop"], g["bf16-guard-clip"], g["bf16-guard-softcap"])),
    7: ("llama-bf16 collapsed in a majority of seeds, llama-fp32 in none; llama-bf16-guard collapsed in none, "
        "triggered in a majority, and its final losses are within LOSS_TOL of llama-bf16-qknorm-always's",
        lambda g: both(collapses_vs_not(g["llama-bf16"], g["llama-fp32"]),
                       guard_matches(g["llama-bf16-guard"], g["llama-bf16-qknorm-always"]))),
}


# The words of the rules. Each check returns (holds, a note with the numbers it compared).
def collapsed(run): return run.collapsed
def triggered(run): return run.trigger is not None
def ran_away(run): return run.collapsed or (run.max_logit or 0.0) >= RUNAWAY_LOGIT
def most(runs, pred): return sum(map(pred, runs)) > len(runs) / 2
def none(runs, pred): return not any(map(pred, runs))
def both(a, b): return a[0] and b[0], "; ".join(n for n in (a[1], b[1]) if n)


def kept_growing(run):
    after = [s for step, s in zip(run.steps, run.sigma) if step >= run.trigger and not math.isnan(s)]
    return len(after) > 1 and max(after) > SIGMA_RATIO * after[0]


def sigma_ratio(runs, reference):
    """Median max sigma(W_q) of runs over reference's; nan (no verdict can pass) where a group logged none."""
    sigmas = [[r.max_sigma for r in rs if r.max_sigma] for rs in (runs, reference)]
    return statistics.median(sigmas[0]) / statistics.median(sigmas[1]) if all(sigmas) else math.nan


def loss_gap(runs, reference, attr):
    """The largest |loss - reference loss| over the seeds both groups ran (inf when they share none)."""
    ref = {r.seed: getattr(r, attr) for r in reference}
    gaps = [abs(getattr(r, attr) - ref[r.seed]) for r in runs
            if ref.get(r.seed) is not None and getattr(r, attr) is not None]
    return max(gaps) if gaps else math.inf


def collapses_vs_not(faulty, *repaired):
    return most(faulty, collapsed) and all(none(rs, collapsed) for rs in repaired), ""


def guard_matches(guarded, reference):
    train, val = loss_gap(guarded, reference, "final_train"), loss_gap(guarded, reference, "final_val")
    ok = none(guarded, collapsed) and most(guarded, triggered) and train <= LOSS_TOL and val <= LOSS_TOL
    return ok, f"largest loss gap to always-on QK-norm: train {train:.3f}, val {val:.3f}"


def runs_away_vs_not(runs, control):
    ratio = sigma_ratio(runs, control)
    return most(runs, ran_away) and none(control, ran_away) and ratio > SIGMA_RATIO, f"sigma ratio {ratio:.2f}"


def probe_holds(topk, equal):
    ratio = sigma_ratio(equal, topk)
    return ratio > SIGMA_RATIO and none(topk, collapsed), f"sigma ratio {ratio:.2f}"


def all_fail(*groups):
    failed = [most(runs, lambda r: triggered(r) and (ran_away(r) or kept_growing(r))) for runs in groups]
    return all(failed), "failed: " + ", ".join(f"{rs[0].group} {'yes' if f else 'no'}" for rs, f in zip(groups, failed))


# ---------------------------------------------------------------------------------------------------------------
# Reading runs

def finite_max(values):
    """The max without NaNs (an inf stays: a blown-up value is news), or None."""
    values = [v for v in values if v is not None and not math.isnan(v)]
    return max(values) if values else None


class Run:
    """One run folder, summarized: what the tables and the rules read."""

    def __init__(self, path):
        self.path, self.group, self.seed = path, os.path.basename(os.path.dirname(path)), os.path.basename(path)
        try:
            with open(os.path.join(path, "config.json")) as f:
                self.config = json.load(f)
        except (OSError, ValueError):
            self.config = {}
        records = read_log(path)
        events = [r for r in records if "event" in r]
        steps = [r for r in records if "event" not in r and "loss" in r]
        end = events[-1] if events and events[-1]["event"] == "end" else {}
        self.status = end.get("status") or ("in progress" if records else "empty log")
        self.finished = self.status in ("completed", "collapsed")
        self.steps, self.loss = [r["step"] for r in steps], [r["loss"] for r in steps]
        nan_if_none = lambda v: math.nan if v is None else v
        self.sigma = [nan_if_none(finite_max(r.get("sigma_q", []))) for r in steps]           # max over layers
        self.logit = [nan_if_none(finite_max(sum(r.get("max_logit", []), []))) for r in steps]  # layers, heads
        self.max_sigma, self.max_logit = finite_max(self.sigma), finite_max(self.logit)
        first = lambda kind: next((r["step"] for r in events if r["event"] == kind), None)
        self.collapse_step = first("collapse") if first("collapse") is not None else end.get("collapse_step")
        self.collapsed = self.status == "collapsed" or self.collapse_step is not None
        self.trigger = first("guard_trigger")
        if self.trigger is None:
            self.trigger = (end.get("guard_trigger") or {}).get("step")
        tail = self.loss[-FINAL_WINDOW:]
        self.final_train = sum(tail) / len(tail) if tail else None
        evals = [r["val_loss"] for r in events if r["event"] == "eval"]
        self.final_val = evals[-1] if evals else end.get("val_loss")


def load_runs(root):
    """group -> its runs, seeds in numeric order."""
    groups = {}
    for path in sorted(glob.glob(os.path.join(root, "*", "seed*")), key=lambda p: (len(p), p)):
        if os.path.isdir(path):
            run = Run(path)
            groups.setdefault(run.group, []).append(run)
    return groups


class NotRun(KeyError):
    pass


class Finished(dict):
    """The rules' view, group -> finished runs: reading a group without any raises NotRun."""

    def __missing__(self, name):
        raise NotRun(name)


def verdicts(groups):
    """One row per claim: number, verdict, and what was measured."""
    finished = Finished({n: [r for r in rs if r.finished] for n, rs in groups.items() if any(r.finished for r in rs)})
    rows = []
    for number, (title, experiments) in CLAIMS.items():
        try:
            ok, note = RULES[number][1](finished)
            verdict = "reproduced" if ok else "not reproduced"
            left_out = sum(not r.finished for n in experiments for r in groups.get(n, []))
            note = "; ".join(n for n in (note, left_out and f"{left_out} unfinished runs left out") if n)
        except NotRun as e:
            verdict, note = "not run", f"no finished run of {e.args[0]}"
        lines = [title] + [group_line(n, groups.get(n, [])) for n in experiments] + ([note] if note else [])
        rows.append([str(number), verdict, "\n".join(lines)])
    return rows


# ---------------------------------------------------------------------------------------------------------------
# Tables: built once, rendered as aligned text or as Markdown

def num(x, spec=".4g"):
    return "-" if x is None else format(x, spec)


def median(values):
    values = [v for v in values if v is not None]
    return statistics.median(values) if values else None


def group_line(name, runs, finished_only=True):
    """A group in one line: collapses, median collapse step, maxima and losses (medians), trigger steps."""
    done = [r for r in runs if r.finished or not finished_only]
    if not done:
        return f"{name}: " + (f"no finished runs ({len(runs)} unfinished)" if runs else "no runs")
    m = lambda attr, spec: num(median(getattr(r, attr) for r in done), spec)
    triggers = [r.trigger for r in done if r.trigger is not None]
    return (f"{name}: {sum(map(collapsed, done))}/{len(done)} collapsed" +
            (f" (median step {m('collapse_step', '.0f')})" if any(map(collapsed, done)) else "") +
            f", max sigma(W_q) {m('max_sigma', '.3g')}, max logit {m('max_logit', '.3g')}, train "
            f"{m('final_train', '.4f')}, val {m('final_val', '.4f')}" +
            (f", guard triggered at {', '.join(map(str, triggers))}" if triggers else ""))


GROUP_HEADER = ["seed", "status", "collapse step", "max sigma(W_q)", "max logit", "guard trigger", "final train",
                "final val", "last step"]


def group_rows(runs):
    return [[r.seed, r.status, num(r.collapse_step), num(r.max_sigma, ".3g"), num(r.max_logit, ".3g"),
             num(r.trigger), num(r.final_train, ".4f"), num(r.final_val, ".4f"), num(r.steps[-1] if r.steps else None)]
            for r in runs]


def render(header, rows, markdown):
    """Cells may hold several lines: <br> in Markdown, continuation lines in text."""
    if markdown:
        lines = [header, ["---"] * len(header)] + [[c.replace("\n", "<br>") for c in r] for r in rows]
        return "\n".join("| " + " | ".join(r) + " |" for r in lines)
    cells = [[c.split("\n") for c in r] for r in [header] + rows]
    widths = [max(len(line) for r in cells for line in r[i]) for i in range(len(header))]
    return "\n".join("  ".join((c[k] if k < len(c) else "").ljust(w) for c, w in zip(r, widths)).rstrip()
                     for r in cells for k in range(max(map(len, r))))


def build(groups, root, markdown, plots=(), markdown_dir="."):
    known = [n for _, experiments in CLAIMS.values() for n in experiments]
    order = [n for n in known if n in groups] + sorted(set(groups) - set(known))
    title = (lambda level, text: "#" * level + " " + text) if markdown else (lambda level, text: f"== {text} ==")
    parts = []
    if markdown:
        versions = [r.config.get("versions", {}) for rs in groups.values() for r in rs if r.config]
        hardware = sorted({f"{v.get('gpu') or v.get('device', '?')} (torch {v.get('torch', '?')})" for v in versions})
        parts += [title(1, "The paper's claims, reproduced at minute scale"),
                  f"Written by `python report.py {root}` on {time.strftime('%Y-%m-%d %H:%M')}. "
                  f"Hardware: {', '.join(hardware) or 'unknown'}."]
    parts += [title(2, "Claims"), render(["claim", "verdict", "what was measured (medians over finished seeds)"],
                                         verdicts(groups), markdown),
              f"Rules (FINAL_WINDOW={FINAL_WINDOW}, LOSS_TOL={LOSS_TOL}, RUNAWAY_LOGIT={RUNAWAY_LOGIT:g}, "
              f"SIGMA_RATIO={SIGMA_RATIO:g}; a run ran away if it collapsed or its max logit reached RUNAWAY_LOGIT):",
              "\n".join(f"{n}. {text}." for n, (text, _) in RULES.items()), title(2, "Runs")]
    for name in order:
        parts += [title(3, name), "All runs, medians: " + group_line(name, groups[name], finished_only=False),
                  render(GROUP_HEADER, group_rows(groups[name]), markdown)]
    if markdown and plots:
        parts += [title(2, "Plots"), "\n\n".join(f"![{os.path.splitext(os.path.basename(p))[0]}]"
                                                  f"({os.path.relpath(p, markdown_dir)})" for p in plots)]
    if markdown:
        commands = [shlex.join(["python", *r.config["command"]]) for n in order for r in groups[n]
                    if r.config.get("command")]
        parts += [title(2, "Commands"), "```bash\n" + "\n".join(commands) + "\n```"]
    return "\n\n".join(parts) + "\n"


# ---------------------------------------------------------------------------------------------------------------
# Plots: per claim, loss / max sigma(W_q) / max logit against step; the guard trigger a vertical line, a collapse an x

def plot_claims(groups, out_dir):
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("plots skipped: matplotlib is not installed (pip install matplotlib, then run report.py again)")
        return []
    os.makedirs(out_dir, exist_ok=True)
    saved = []
    for number, (title, experiments) in CLAIMS.items():
        runs = [r for n in experiments for r in groups.get(n, []) if r.steps]
        if not runs:
            continue
        fig, axes = plt.subplots(3, 1, sharex=True, figsize=(9, 10))
        for run in runs:
            color, k = f"C{list(experiments).index(run.group)}", run.seed[4:]
            style = ["-", "--", ":", "-."][(int(k) - 1) % 4 if k.isdigit() else 0]
            for ax, ys in zip(axes, (run.loss, run.sigma, run.logit)):
                ys = [y if math.isfinite(y) and y > 0 else math.nan for y in ys]    # log axes take only y > 0
                ax.plot(run.steps, ys, color=color, ls=style, lw=1, label=f"{run.group} {run.seed}")
                if run.trigger is not None:
                    ax.axvline(run.trigger, color=color, ls=":", lw=0.8)
                if run.collapse_step is not None:
                    i = min(range(len(ys)), key=lambda j: abs(run.steps[j] - run.collapse_step))
                    ax.plot([run.steps[i]], [finite_max(ys) if math.isnan(ys[i]) else ys[i]], "x", color=color,
                            ms=10, mew=2)
        for ax, label, scale in zip(axes, ("train loss", "max sigma(W_q) over layers", "max attention logit"),
                                    ("linear", "log", "log")):
            ax.set(ylabel=label, yscale=scale)
            ax.grid(alpha=0.3)
        axes[2].set_xlabel("step")
        axes[0].set_title(f"claim {number}: {title}", fontsize=10)
        axes[0].legend(fontsize=7, ncol=2)
        saved.append(os.path.join(out_dir, f"claim{number}.png"))
        fig.savefig(saved[-1], dpi=110, bbox_inches="tight")
        plt.close(fig)
    return saved


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("root", help="the sweep's --out-root, e.g. runs/claims")
    p.add_argument("--markdown", metavar="FILE", help="also write the tables as Markdown (for RESULTS.md)")
    p.add_argument("--plots", metavar="DIR",
                   help="where the PNG plots go (default: plots/ beside --markdown, else the runs folder)")
    args = p.parse_args(argv)
    if not os.path.isdir(args.root):
        print(f"error: {args.root} is not a folder: give the sweep's --out-root")
        return 1
    groups = load_runs(args.root)
    if not groups:
        print(f"no runs under {args.root} (expected <experiment>/seed<k>/log.jsonl)")
    print(build(groups, args.root, markdown=False))
    markdown_dir = os.path.dirname(os.path.abspath(args.markdown)) if args.markdown else None
    plots = plot_claims(groups, args.plots or (os.path.join(markdown_dir, "plots") if args.markdown else args.root))
    for path in plots:
        print(f"plot: {path}")
    if args.markdown:
        os.makedirs(markdown_dir, exist_ok=True)
        with open(args.markdown, "w") as f:
            f.write(build(groups, args.root, markdown=True, plots=plots, markdown_dir=markdown_dir))
        print(f"markdown: {args.markdown}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
