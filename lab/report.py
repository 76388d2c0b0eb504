"""
Read a sweep's runs and say, claim by claim, whether the paper's claims reproduced, and how sure that is.

    python -m lab.report runs/claims                   # the verdicts and every rule's tests on the console,
                                                       # PNG plots into runs/claims
    python -m lab.report runs/claims --markdown R.md   # also the record: R.md (the verdict table), one record
                                                       # per claim (claims/ beside it, or --records DIR), the
                                                       # plots (plots/ beside it, or --plots DIR)
    python -m lab.report runs/claims --lr-study runs/lr --markdown R.md   # and the learning-rate study
                                                       # (lab.sweep --lrs): claims 1, 2, 7 as a CPU-scale proxy
    python -m lab.report --runs runs/A runs/B --png fig.png   # loss, max logit, sigma(W_q) of a few runs

The layers, each importing only those before it: stats (the tests) -> thresholds (the rules' numbers) -> loading
(a run folder, summarized) -> rules/ (one file per claim) -> verdicts (every rule, in order) -> tables, summary
(rows) -> files, figures, rerun (a claim's commands, from its runs) -> records (the documents) -> report (this
command: what it refuses, and the writing).

Nothing is written until every check passed; then every file whole (a temp file, renamed), all or none. A
--markdown that would replace a record made from more runs (arms, seeds), or judging more claims, is refused
unless --force.
"""
import argparse
import os
import re

from lab import claim1
from lab.figures import _pyplot, plot_claims, plot_lr_study, plot_some_runs
from lab.files import save_figure, save_text, written_together
from lab.loading import load_runs
from lab.records import Judged, Paths, console, documents
from lab.summary import VERDICT_WORDS
from lab.sweep import lr_name, not_a_folder


# --------------------------------------------------------------------------------------------------
# What a record was made from, read back from its Markdown: a report made from less is refused

def judged_claims(markdown):
    """How many rows of a report's opening table (summary) have a verdict other than NOT RUN; markdown: its
    text, or the path of a file (0 if there is none)."""
    if "\n" not in markdown:
        try:
            with open(markdown, errors="replace") as f:
                markdown = f.read()
        except OSError:
            return 0
    rows = markdown.split("\n| claim | verdict |", 1)[1:]
    table = rows[0].split("\n\n", 1)[0].splitlines()[2:] if rows else []   # less the header's rest and | --- |
    return sum(line.split("|")[2].strip() != VERDICT_WORDS["not run"] for line in table if line.count("|") > 2)


def evidence(markdown):
    """{(section, arm folder): {seed folders}}: the runs a report was made from, read from its run tables
    (the claims' Runs, the lr study's, the pilots': a section is its heading less the folder in brackets);
    markdown: its text, or the path of a file ({} if there is none)."""
    if "\n" not in markdown:
        try:
            with open(markdown, errors="replace") as f:
                markdown = f.read()
        except OSError:
            return {}
    runs, section, heading, header = {}, None, None, None
    for line in markdown.splitlines():
        if line.startswith("#"):
            level, _, words = line.partition(" ")
            section = re.sub(r" \(.*", "", words) if level == "##" else section
            heading, header = words, None
            continue
        if not line.startswith("|"):
            header = None
            continue
        cells = [cell.strip() for cell in line.strip().strip("|").split("|")]
        if header is None:
            header = cells
            continue
        seed = cells[header.index("seed")] if "seed" in header and len(cells) == len(header) else ""
        if re.fullmatch(r"seed\d+", seed):
            arm = cells[header.index("arm")] if "arm" in header else heading
            if "lr" in header:
                arm = lr_name(arm, float(cells[header.index("lr")]))
            runs.setdefault((section, arm), set()).add(seed)
    return runs


def lost_evidence(texts, main, most=3):
    """Why the documents `texts` ({path: text}) must not replace those on disk at their paths: the runs the
    old ones were made from which the new ones lack, per arm and seed over all of them (fewer seeds or arms; a
    one-seed verdict still counts as judged), or fewer claims judged in `main` (RESULTS.md); None if neither."""
    old, new = {}, {}
    for path, text in texts.items():
        for store, found in ((old, evidence(path)), (new, evidence(text))):
            for key, seeds in found.items():
                store.setdefault(key, set()).update(seeds)
    lacking = [(section, arm, seeds, new.get((section, arm), set())) for (section, arm), seeds in old.items()
               if seeds - new.get((section, arm), set())]
    if lacking:
        said = "; ".join(f"{arm} ({section}): {len(seeds)} seeds, here {len(here)}"
                         for section, arm, seeds, here in lacking[:most])
        more = f" and {len(lacking) - most} more arms" if len(lacking) > most else ""
        return f"it was made from runs this report lacks: {said}{more}"
    if judged_claims(texts[main]) < judged_claims(main):
        return f"it judges {judged_claims(main)} claims, this report {judged_claims(texts[main])}"
    return None


# --------------------------------------------------------------------------------------------------
# The command

def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("root", nargs="?", help="the sweep's --out-root, e.g. runs/claims")
    p.add_argument("--markdown", metavar="FILE", help="also write the record: FILE (the verdict table, e.g. "
                   "RESULTS.md), each claim's record and runs (--records), the plots")
    p.add_argument("--records", metavar="DIR", help="--markdown: the claims' records, <DIR>/<claim>/README.md and "
                   "runs.md and an index <DIR>/README.md (default: claims/ beside --markdown)")
    p.add_argument("--plots", metavar="DIR",
                   help="the plots' folder (default: plots/ beside --markdown, else the root)")
    p.add_argument("--pilot", action="append", default=[], metavar="DIR",
                   help="a pilot's runs, <DIR>/<experiment>/seed<k>/, tabled apart (repeatable)")
    p.add_argument("--lr-study", metavar="DIR", help="the learning-rate study's runs (lab.sweep --lrs), "
                   "<DIR>/<arm>-lr<lr>/seed<k>/: claims 1, 2 and 7 as a CPU-scale proxy (rules 1p, 2p, 7p, in "
                   "their records)")
    p.add_argument("--stream", metavar="DIR", help="claim 1 at CPU scale, the stream preset's runs "
                   "(lab/claim1.py): <DIR>/<bf16|fp32|bf16-safemax>/seed<k>/; it decides claim 1's row")
    p.add_argument("--tokens", metavar="DIR", help="claim 1 at 16x the tokens a step (lab/claim1.py, study "
                   "tokens): <DIR>/<arm>-lr<lr>/seed<k>/, in a section of claim 1's record")
    p.add_argument("--runs", nargs="+", metavar="DIR", help="plot these run folders instead")
    p.add_argument("--png", default="runs.png", help="--runs: the figure's file (default runs.png)")
    p.add_argument("--labels", nargs="+", metavar="TEXT",
                   help="--runs: the legend's words, one per run (default: from each run's config)")
    p.add_argument("--force", action="store_true",
                   help="--markdown: write it even if the files it replaces were made from runs (arms, seeds) "
                        "this report lacks, or judge more claims")
    args = p.parse_args(argv)
    if args.runs:
        missing = [d for d in args.runs if not any(os.path.exists(os.path.join(d, name))
                                                   for name in ("log.jsonl", "log.jsonl.gz"))]
        if missing:
            p.error(f"no log.jsonl in {', '.join(missing)}: give run folders that train.py wrote")
        if args.labels and len(args.labels) != len(args.runs):
            p.error(f"--labels: give one per run ({len(args.runs)}), got {len(args.labels)}")
        if not_a_folder(os.path.dirname(os.path.abspath(args.png))):
            p.error(f"--png {args.png}: {not_a_folder(os.path.dirname(os.path.abspath(args.png)))} is a file, not a "
                    f"folder: give another path")
        os.makedirs(os.path.dirname(os.path.abspath(args.png)), exist_ok=True)
        png = plot_some_runs(args.runs, args.png, args.labels)
        if png:
            print(f"plot: {png}")
        return 0
    if args.root is None or not os.path.isdir(args.root):
        p.error(f"{args.root} is not a folder: give the sweep's --out-root (or --runs DIR ...)")
    for d in args.pilot:
        if not os.path.isdir(d):
            p.error(f"--pilot {d} is not a folder: give a pilot's runs, <DIR>/<experiment>/seed<k>/")
    if args.stream is not None and not os.path.isdir(args.stream):
        p.error(f"--stream {args.stream} is not a folder: give the stream sweep's runs, <DIR>/<arm>/seed<k>/")
    if args.tokens is not None and not os.path.isdir(args.tokens):
        p.error(f"--tokens {args.tokens} is not a folder: give the tokens sweep's runs, <DIR>/<arm>-lr<lr>/seed<k>/")
    if args.lr_study is not None and not os.path.isdir(args.lr_study):
        p.error(f"--lr-study {args.lr_study} is not a folder: give the study's runs, <DIR>/<arm>-lr<lr>/seed<k>/")
    if args.markdown:   # before the work: appending, so an existing file is kept as it is
        try:
            existed = os.path.exists(args.markdown)
            os.makedirs(os.path.dirname(os.path.abspath(args.markdown)), exist_ok=True)
            open(args.markdown, "a").close()
            if not existed:
                os.remove(args.markdown)
        except OSError as e:
            # makedirs says "File exists" of a file where a folder of the path should be
            why = "not a folder" if isinstance(e, (FileExistsError, NotADirectoryError)) else e.strerror or str(e)
            where = f": {e.filename}" if e.filename else ""
            p.error(f"--markdown {args.markdown}: cannot write it ({why}{where}): give a writable path")
    if args.records and not args.markdown:
        p.error("--records: give --markdown too (the records are written with it)")
    records = args.records or (os.path.join(os.path.dirname(args.markdown), "claims") if args.markdown else None)
    if records and not_a_folder(records):
        p.error(f"--records {records}: {not_a_folder(records)} is a file, not a folder: give another path")
    plots_dir = args.plots or (os.path.join(os.path.dirname(os.path.abspath(args.markdown)), "plots")
                               if args.markdown else args.root)
    if not_a_folder(plots_dir):
        p.error(f"--plots {plots_dir}: {not_a_folder(plots_dir)} is a file, not a folder: give another path")
    groups = load_runs(args.root)
    if not groups:
        if args.markdown:   # a report of nothing would replace the file with "not run" lines
            p.error(f"no runs under {args.root} (expected <experiment>/seed<k>/log.jsonl): {args.markdown} left "
                    f"as it is; give the folder that holds the runs")
        print(f"no runs under {args.root} (expected <experiment>/seed<k>/log.jsonl)")
    judged = Judged(groups, args.root, pilots=[(d, load_runs(d)) for d in args.pilot],
                    study=(args.lr_study, load_runs(args.lr_study)) if args.lr_study is not None else None,
                    stream=(args.stream, claim1.load(args.stream)) if args.stream is not None else None,
                    tokens=(args.tokens, claim1.load(args.tokens, claim1.TOKENS)) if args.tokens is not None else None)
    print(console(judged))
    paths = lambda plots=(): Paths(args.markdown, args.records, plots,
                                   os.path.join(plots_dir, "claim1-stream.png") if judged.stream else None,
                                   os.path.join(plots_dir, "claim1-tokens.png") if judged.tokens else None,
                                   plots_flag=args.plots)
    if args.markdown and not args.force:   # before any file is drawn: the run tables need no figure
        refused = lost_evidence(documents(judged, paths()), args.markdown)
        if refused:   # the folders given hold less than the files' (a typo in the root, one-seed copies)
            p.error(f"--markdown {args.markdown}: {refused}: left as it is, with its records and figures; give "
                    f"the folders its opening lines name, or pass --force to write it anyway")
    with written_together():   # the figures and the Markdown, each whole, all or none
        plots = plot_claims(groups, plots_dir)
        study_plots = plot_lr_study(judged.study[1], plots_dir, quiet=True) if judged.study else []
        where = paths()
        for found, path, which in ((judged.stream, where.stream_plot, claim1.STREAM),
                                   (judged.tokens, where.tokens_plot, claim1.TOKENS)):
            if found and _pyplot(quiet=True):
                os.makedirs(plots_dir, exist_ok=True)
                claim1.plot(found[1], path, which, save=save_figure)
                print(f"plot: {path}")
        if args.markdown:
            for path, text in documents(judged, paths(plots + study_plots)).items():
                os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
                save_text(path, text)
    for path in plots + study_plots:
        print(f"plot: {path}")
    if args.markdown:
        print(f"markdown: {args.markdown}, records: {records}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
