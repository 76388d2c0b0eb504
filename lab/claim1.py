"""
Claim 1 at CPU scale: does the bf16 streaming-softmax state, streamed through 4 key blocks per row,
make the attention logits grow past fp32 state's, and is it the prior work's tie mechanism?

    python -m lab.claim1 lab/results/stream                     # the verdict and its table
    python -m lab.claim1 lab/results/stream --plot lab/plots/claim1-stream.png

The rule was committed before its runs: lab/preregistered/claim1-stream.md (RESULTS.md names the
commit). Here it is as code, and nothing else: the statistic, the two sign tests, the A/A check, and
what is reported beside them. lab.report puts the verdict in RESULTS.md's claim-1 row, and this
section in claim 1's record (lab/claims/1/README.md).
"""
import argparse
import dataclasses
import glob
import json
import math
import os
import statistics
import sys

from lab.stats import ALPHA, binom_tail, mean_interval
from lab.sweep import DONE, Unreadable, read_log

RATIO = 2.0                        # a seed counts for the claim where M_bf16 >= RATIO * M_fp32
LAST_QUARTER = 0.75                # M: the median max logit of the logged steps after 3/4 of the horizon
RUNAWAY_LOGIT = 1000.0             # a runaway's max logit (lab/thresholds.py's)
ARMS = {"bf16": "bf16 state", "fp32": "fp32 state", "bf16-safemax": "bf16 state with safe-max (no exact 1s)"}


@dataclasses.dataclass(frozen=True)
class Study:
    """One pre-registered study of claim 1: its rule, the commit that held it before the runs, its seeds."""
    name: str
    label: str                     # its row in RESULTS.md's table
    rule: str                      # the rule's file, from the repository's root
    commit: str                    # the commit that holds it, made before the first of its runs
    seeds: tuple                   # every arm's seeds
    aa_seeds: tuple                # fp32 again, seed k of `seeds` against the k-th of these; () for none
    scale: str                     # its scale in RESULTS.md's words; {n}: the seeds that finished
    holds: str                     # the verdict where the primary test holds (and the A/A does not)
    safemax_if_separates: bool     # safe-max runs only where bf16 separates (else every seed, from the start)


STREAM = Study("stream", "1", "lab/preregistered/claim1-stream.md", "b823d3f", tuple(range(11, 19)),
               tuple(range(19, 27)), "gpt2 4x128, 4000 steps, {n}, 4 key blocks per row, 1,024 tokens a step",
               "reproduced", safemax_if_separates=False)
TOKENS = Study("tokens", "1 (16x tokens)", "lab/preregistered/claim1-tokens.md", "75c11bd", tuple(range(31, 36)), (),
               "gpt2 4x128, 1000 steps, {n}, 4 key blocks per row, 16,384 tokens a step", "separates",
               safemax_if_separates=True)
STUDIES = {s.name: s for s in (STREAM, TOKENS)}
# the first study's, by their old names
RULE, PREREGISTERED, SEEDS, AA_SEEDS = STREAM.rule, STREAM.commit, STREAM.seeds, STREAM.aa_seeds


class StreamRun:
    """One run folder, read for this rule: the max logit and sigma(W_q) of each logged step, its end."""

    def __init__(self, path):
        self.path = path
        try:
            records = read_log(path)
        except Unreadable as e:   # counted as unfinished, as a missing run is
            print(f"warning: {e}: counted as an unfinished run", file=sys.stderr)
            records = []
        steps = [r for r in records if "event" not in r and "loss" in r]
        end = records[-1] if records and records[-1].get("event") == "end" else {}
        self.finished = end.get("status") in DONE
        self.horizon = end.get("step", 0)
        self.steps = [r["step"] for r in steps]
        # each logged step's max over layers and heads; sigma(W_q): max over layers
        self.logit = [max(max(row) for row in r["max_logit"]) for r in steps]
        self.sigma_q = [max(r["sigma_q"]) for r in steps]
        self.collapsed = end.get("collapse_step") is not None or any(r.get("event") == "collapse" for r in records)
        self.final_val = end.get("val_loss")

    def late(self, values):
        """values at the logged steps of the last quarter of the horizon."""
        return [v for s, v in zip(self.steps, values) if s > LAST_QUARTER * self.horizon]

    def statistic(self):
        """M: the median max logit over the last quarter; None for a run that did not finish."""
        late = self.late(self.logit)
        return statistics.median(late) if self.finished and late else None


def arm_folder(root, arm):
    """root/<arm>, or root/<arm>-lr<lr> where the sweep ran it at one learning rate (lab.sweep --lrs)."""
    found = sorted(glob.glob(os.path.join(glob.escape(root), f"{arm}-lr*")))
    if os.path.isdir(os.path.join(root, arm)) or not found:
        return os.path.join(root, arm)
    if len(found) > 1:
        raise SystemExit(f"error: {root} holds {arm} at several learning rates ({', '.join(found)}): the rule "
                         f"judges one; give a folder that holds one")
    return found[0]


def load(root, study=STREAM):
    """{arm: {seed: StreamRun}} for the arms and seeds present under root/<arm>[-lr<lr>]/seed<k>."""
    out = {}
    for arm in ARMS:
        for seed in (*study.seeds, *study.aa_seeds):
            path = os.path.join(arm_folder(root, arm), f"seed{seed}")
            if os.path.isdir(path):
                out.setdefault(arm, {})[seed] = StreamRun(path)
    return out


def pilot_lr(root, seed=201, healthy_below=200.0, fallback=1e-3):
    """claim1-tokens.md's learning rate: the largest lr of the pilot (root/fp32-lr<lr>/seed<seed>) at which
    fp32 state stayed healthy: finished, no collapse, its max logit below `healthy_below` at every logged
    step; `fallback` if none did. Returns (lr, {lr: (healthy, peak max logit)})."""
    seen = {}
    for folder in glob.glob(os.path.join(glob.escape(root), "fp32-lr*")):
        r = StreamRun(os.path.join(folder, f"seed{seed}"))
        peak = max(r.logit, default=math.inf)
        seen[float(folder.rsplit("-lr", 1)[1])] = (r.finished and not r.collapsed and peak < healthy_below, peak)
    healthy = [lr for lr, (ok, _) in seen.items() if ok]
    return (max(healthy) if healthy else fallback), dict(sorted(seen.items()))


def ratio_test(runs, arm, ref, seeds, ref_seeds=None):
    """The rule's sign test: seed k counts where M(arm, k) >= RATIO * M(ref, k'), k' the k-th of ref_seeds
    (default: seeds); a run missing or unfinished counts against. Returns (count, n, p, the ratios of the
    seeds where both have an M)."""
    count, ratios = 0, []
    for seed, ref_seed in zip(seeds, ref_seeds or seeds):
        a, b = runs.get(arm, {}).get(seed), runs.get(ref, {}).get(ref_seed)
        m_a, m_b = a and a.statistic(), b and b.statistic()
        if m_a is not None and m_b is not None and m_b > 0:
            ratios.append(m_a / m_b)
            count += m_a >= RATIO * m_b
    return count, len(seeds), binom_tail(count, len(seeds)), ratios


def geometric_mean(ratios):
    """(geometric mean, 95% interval) of ratios, by a t interval on their logs; nan where fewer than 2."""
    mean, lo, hi = mean_interval([math.log(r) for r in ratios], level=0.95)
    return tuple(math.exp(x) if not math.isnan(x) else math.nan for x in (mean, lo, hi))


def sign_line(name, count, n, p):
    held = p < ALPHA
    return held, (f"sign test, {name}: M >= {RATIO:g}x in {count} of {n} seeds, p = {p:.3g} "
                  f"-> {'holds' if held else 'fails'}")


def judge(runs, study=STREAM):
    """(verdict, lines): the pre-registered verdict and the tests behind it."""
    if not runs.get("bf16") or not runs.get("fp32"):
        return "not run", [f"no bf16 and fp32 runs of the {study.name} study"]
    seeds = study.seeds
    primary, primary_line = sign_line("bf16 over fp32", *ratio_test(runs, "bf16", "fp32", seeds)[:3])
    mechanism, mechanism_line = sign_line("bf16-safemax over fp32", *ratio_test(runs, "bf16-safemax", "fp32", seeds)[:3])
    safemax_done = all(runs.get("bf16-safemax", {}).get(s) and runs["bf16-safemax"][s].finished for s in seeds)
    if study.safemax_if_separates:   # and it has no A/A set: the verdict is the primary test's
        lines = [primary_line, mechanism_line if runs.get("bf16-safemax") else "bf16-safemax: not run"]
        return (study.holds if primary else "does not separate"), lines
    lines = [primary_line, mechanism_line]
    aa_count, aa_n, aa_p, _ = ratio_test(runs, "fp32", "fp32", seeds, study.aa_seeds)
    aa_ran = all(s in runs["fp32"] for s in study.aa_seeds)
    aa_held, aa_line = sign_line(f"A/A, fp32 seeds {seeds[0]}-{seeds[-1]} over fp32 seeds "
                                 f"{study.aa_seeds[0]}-{study.aa_seeds[-1]}", aa_count, aa_n, aa_p)
    lines.append(aa_line if aa_ran else f"A/A: fp32 seeds {study.aa_seeds[0]}-{study.aa_seeds[-1]} not run")
    if not primary:
        return "not reproduced", lines
    if aa_held or not aa_ran:
        lines.append("the A/A set " + ("passes the same test: the threshold is inside this scale's noise" if aa_ran
                                       else "did not run, so the rule's noise is unchecked"))
        return "inconclusive", lines
    if mechanism:
        return "reproduced as state noise", lines
    if not safemax_done:   # a missing safe-max run could have passed the mechanism check
        lines.append("bf16-safemax did not finish every seed, so the mechanism check cannot clear the ties' role")
        return "inconclusive", lines
    return study.holds, lines


def reported(runs, study=STREAM):
    """What the rule reports beside its tests, as lines."""
    lines = []
    for arm in ("bf16", "bf16-safemax"):
        _, _, _, ratios = ratio_test(runs, arm, "fp32", study.seeds)
        if ratios:
            g, lo, hi = geometric_mean(ratios)
            lines.append(f"{arm} / fp32, M per seed: {', '.join(f'{r:.2f}' for r in ratios)}; geometric mean "
                         f"{g:.2f}, 95% interval [{lo:.2f}, {hi:.2f}] (n = {len(ratios)})")
        pairs = [(runs.get(arm, {}).get(s), runs["fp32"].get(s)) for s in study.seeds]
        gaps = [a.final_val - b.final_val for a, b in pairs if a and b and a.final_val is not None
                and b.final_val is not None]
        if len(gaps) > 1:
            mean, lo, hi = mean_interval(gaps, level=0.95)
            lines.append(f"final val loss, {arm} - fp32: mean {mean:+.3f} nat, 95% interval [{lo:+.3f}, {hi:+.3f}] "
                         f"(n = {len(gaps)})")
    for arm in ARMS:
        if arm == "bf16-safemax" and not runs.get(arm) and study.safemax_if_separates:
            continue   # safe-max runs only where bf16 separates: "not run" says it above
        done = [r for r in (runs.get(arm, {}).get(s) for s in study.seeds) if r and r.finished]
        away = sum(max(r.logit, default=0) >= RUNAWAY_LOGIT for r in done)
        lines.append(f"{arm}: {len(done)}/{len(study.seeds)} finished, {away} ran away (max logit >= "
                     f"{RUNAWAY_LOGIT:g}), {sum(r.collapsed for r in done)} collapsed")
    return lines


def fault_lines(root):
    """The final checkpoints' fault, per arm, from root/fault_size.json (`python -m lab.fault_size --runs`):
    medians over seeds of each run's median over layers and heads; [] where it was not measured."""
    path = os.path.join(root, "fault_size.json")
    if not os.path.exists(path):
        return []
    with open(path) as f:
        measured = json.load(f)
    lines = []
    for arm, m in measured["median"].items():
        n = sum(r["arm"] == arm for r in measured["per_seed"])
        lines.append(f"{arm} at its final checkpoints ({n} seeds, medians): (row, key block) pairs whose bf16 P "
                     f"holds 2+ exact 1s {m['tie_fraction_median']:.1%}; bf16 state's O error against fp32 "
                     f"state's {m['error_ratio_median']:.2e} of rms(O), its sign-keeping part {m['bias_ratio_median']:.2e}")
    return lines


TABLE_HEADER = ["seed"] + [f"{arm}: {what}" for arm in ARMS for what in ("M", "peak", "sigma(W_q)", "val")]


def seed_table(runs, study=STREAM):
    """[seed, then per arm: M, the last quarter's peak, the final sigma(W_q), the final val loss]."""
    rows = []
    for seed in study.seeds:
        row = [str(seed)]
        for arm in ARMS:
            r = runs.get(arm, {}).get(seed)
            m = r and r.statistic()
            row += ["-"] * 4 if r is None or m is None else [
                f"{m:.1f}", f"{max(r.late(r.logit)):.1f}", f"{r.sigma_q[-1]:.2f}",
                f"{r.final_val:.3f}" if r.final_val is not None else "-"]
        rows.append(row)
    return rows


def scale_words(runs, study=STREAM):
    """The rule's scale, in RESULTS.md's words: model, horizon, seeds; then what this study adds."""
    n = max((sum(r.finished for s, r in runs.get(arm, {}).items() if s in study.seeds) for arm in ARMS), default=0)
    seeds = f"{n} seed{'s' * (n != 1)}" + ("" if n == len(study.seeds) else f" ({len(study.seeds)} planned)")
    return study.scale.format(n=seeds)


def why(verdict, runs, study=STREAM):
    """The verdict's reason in at most 15 words."""
    count, n, _, _ = ratio_test(runs, "bf16", "fp32", study.seeds)
    need = next(k for k in range(n + 1) if binom_tail(k, n) < ALPHA) if binom_tail(n, n) < ALPHA else None
    return {"reproduced": f"bf16's late max logit reached 2x fp32's in {count} of {n} seeds; safe-max's did not",
            "reproduced as state noise": "bf16's logits reached 2x fp32's, and safe-max's too: not the ties",
            "inconclusive": "the A/A set passes the same test, or did not run",
            "not run": f"no runs of bf16, fp32 in the {study.name} study"}.get(
        verdict, f"bf16's late max logit reached 2x fp32's in {count} of {n} seeds; {need} needed")


def rule_row(runs, study=STREAM):
    """(claim, verdict, text) as lab.report's rules give them: the rule in a line, then its tests."""
    verdict, lines = judge(runs, study)
    return "1", verdict, "\n".join([f"claim 1 at CPU scale, pre-registered at {study.commit} ({study.rule})", *lines,
                                    *reported(runs, study)])


def summary_row(runs, study=STREAM):
    """RESULTS.md's claim-1 row: [claim, verdict, scale, key number (n, test), why]."""
    verdict, lines = judge(runs, study)
    if verdict == "not run":
        return [study.label, verdict, "-", "-", why(verdict, runs, study)]
    count, n, p, _ = ratio_test(runs, "bf16", "fp32", study.seeds)
    key = (f"`bf16` over `fp32`: M >= {RATIO:g}x in {count} of {n} seeds, sign test p = {p:.2g} "
           f"({'<' if p < ALPHA else '>='} {ALPHA:g})")
    return [study.label, verdict, scale_words(runs, study), key, why(verdict, runs, study)]


def section(runs, root, plot_path=None, markdown_dir=".", study=STREAM, rule_link=None):
    """A record's section on one study of claim 1: the rule's link (rule_link: its path from the record; the
    path from the repository's root by default) and commit, its tests, what is reported, the seed table and
    the figure."""
    verdict, lines = judge(runs, study)
    table = "\n".join("| " + " | ".join(row) + " |" for row in
                      [TABLE_HEADER, ["---"] * len(TABLE_HEADER), *seed_table(runs, study)])
    parts = [f"Pre-registered at commit {study.commit} ([{study.rule}]({rule_link or study.rule})), before the "
             f"first of its runs; "
             f"judged by `python -m lab.claim1 {root}{'' if study is STREAM else ' --study ' + study.name}`. M is a "
             f"run's median max attention logit over the last quarter of its steps. Verdict: **{verdict.upper()}**.",
             "\n".join(f"- {line}" for line in lines + reported(runs, study) + fault_lines(root)), table]
    if plot_path:
        parts.append(f"![claim 1 at CPU scale, the {study.name} study]({os.path.relpath(plot_path, markdown_dir)})")
    return parts


def plot(runs, path, study=STREAM, save=None):
    """Max logit and sigma(W_q) against step, one line per run, one color per state; save(fig, path) writes
    it (lab.files', to write it with the rest of a report; default: at once)."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, axes = plt.subplots(1, 2, figsize=(12, 4.5))
    colors = {"bf16": "tab:red", "fp32": "tab:blue", "bf16-safemax": "tab:green"}
    for arm, words in ARMS.items():
        these = [r for r in (runs.get(arm, {}).get(s) for s in study.seeds) if r is not None]
        for i, r in enumerate(these):
            label = f"{words} ({len(these)} seeds)" if i == 0 else None
            axes[0].plot(r.steps, r.logit, color=colors[arm], alpha=0.5, lw=0.8, label=label)
            axes[1].plot(r.steps, r.sigma_q, color=colors[arm], alpha=0.5, lw=0.8, label=label)
    horizon = max((r.horizon for arm in runs.values() for r in arm.values()), default=0)
    for ax, ylabel in zip(axes, ("max attention logit (over layers and heads)", "top singular value of W_q")):
        ax.set_xlabel("optimizer step")
        ax.set_ylabel(ylabel)
        ax.set_yscale("log")
        ax.axvspan(LAST_QUARTER * horizon, horizon, color="0.9", zorder=0)
        ax.legend(fontsize=8)
    axes[0].set_title("grey: the last quarter, where M (the median max logit) is read")
    fig.suptitle(f"Claim 1 at CPU scale: {study.scale.format(n='').replace(', ,', ',')}")
    fig.tight_layout()
    (save or (lambda f, p, **kw: f.savefig(p, **kw)))(fig, path, dpi=110)
    plt.close(fig)


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0].strip(), allow_abbrev=False)
    p.add_argument("root", help="the sweep's folder: <root>/<arm>/seed<k> (or <arm>-lr<lr>)")
    p.add_argument("--study", default="stream", choices=list(STUDIES), help="which pre-registered rule")
    p.add_argument("--plot", help="write the figure here (PNG)")
    p.add_argument("--pilot", action="store_true", help="the tokens study's pilot: print the lr its rule picks")
    args = p.parse_args(argv)
    if not os.path.isdir(args.root):
        p.error(f"{args.root} is not a folder: give the --out-root of the study's sweep")
    if args.pilot:
        lr, seen = pilot_lr(args.root)
        for each, (ok, peak) in seen.items():
            print(f"lr {each:g}: peak max logit {peak:.1f}, {'healthy' if ok else 'not healthy'}")
        print(f"the rule's learning rate: {lr:g}")
        return
    study = STUDIES[args.study]
    runs = load(args.root, study)
    verdict, lines = judge(runs, study)
    print(f"claim 1 at CPU scale, the {study.name} study ({study.rule}, pre-registered at {study.commit}): "
          f"{verdict.upper()}")
    for line in lines + reported(runs, study) + fault_lines(args.root):
        print("  " + line)
    table = [TABLE_HEADER, *seed_table(runs, study)]
    widths = [max(len(str(x)) for x in col) for col in zip(*table)]
    for row in table:
        print("  ".join(str(x).rjust(w) for x, w in zip(row, widths)))
    if args.plot:
        plot(runs, args.plot, study)
        print(f"wrote {args.plot}")


if __name__ == "__main__":
    main()
