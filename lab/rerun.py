"""
The commands that rerun a claim, read back from its runs' config.json: each run lab.sweep made holds the train.py
command it ran ([train.py, the arm's own flags, the extra flags, --seed, --out-dir]), so the sweep commands that
plan the same runs (the same flags, seeds and learning rates) can be written again, and broken into lines as a
person would type them. lab/test_tools.py checks that they plan exactly the runs of each claim's runs.md.
"""
import os
import shlex

from lab.loading import read_config
from lab.sweep import SEEDS, Unreadable, experiments, split_lr


def sweep_flags(run, number, source):
    """(base arm, lr, extra flags) of a run lab.sweep made, read back from the train.py command its config.json
    records: [train.py, the arm's own flags, the extra flags, --seed, --out-dir]; None for a run made another
    way."""
    command, group = run.config.get("command") or [], run.group
    table = experiments([number], source=source or "bf16")
    base, lr = (group, None) if group in table else split_lr(group)
    if base not in table or "--seed" not in command or "--out-dir" not in command:
        return None
    own = table[base] + (["--lr", f"{lr:g}", "--min-lr", f"{lr:g}"] if lr is not None else [])
    out_dir = command[command.index("--out-dir") + 1]
    if command[1:1 + len(own)] != own or os.path.basename(os.path.dirname(out_dir)) != group:
        return None
    return base, lr, tuple(command[1 + len(own):command.index("--seed")])


def out_root(folder):
    """Where a rerun writes the runs kept in `folder` (lab.keep copied them there): runs/<its name>."""
    return os.path.join("runs", os.path.basename(os.path.normpath(folder)))


def seed_ranges(seeds):
    """Seed numbers as --seeds values: [1..8] -> [None] (the default), [9..16] -> ["9-16"], [1, 3] -> ["1-1", ..."""
    seeds, out = sorted(seeds), []
    for s in seeds:
        if out and s == out[-1][1] + 1:
            out[-1][1] = s
        else:
            out.append([s, s])
    return [None if (a, b) == (1, SEEDS) else str(b) if a == 1 else f"{a}-{b}" for a, b in out]


def wrapped(words, width=110):
    """A shell command over several lines, as a person would break it: between arguments (a flag kept with its
    value), the next line indented; a long comma list after a comma, the rest at column 0 (bash joins a line
    that ends in a backslash to the next, so the list stays one word)."""
    units = []
    for word in map(shlex.quote, words):
        flag = units and units[-1].startswith("--") and " " not in units[-1] and units[-1] != "--"
        if flag and not word.startswith("--"):
            units[-1] += " " + word
        else:
            units.append(word)
    lines, line, fresh = [], "", True   # fresh: at a line's start (no space before the next unit)
    for unit in units:
        while True:
            sep = "" if fresh else " "
            if len(line) + len(sep) + len(unit) <= width:
                line, fresh = line + sep + unit, False
                break
            cut = unit.rfind(",", 0, width - len(line) - len(sep) - 1)
            if cut > 0:           # a comma list: as much as fits, the rest from column 0
                lines.append(line + sep + unit[:cut + 1] + "\\")
                line, unit, fresh = "", unit[cut + 1:], True
            elif fresh:           # too long for any line: alone on its own
                line, fresh = line + unit, False
                break
            else:
                lines.append(line + " \\")
                line, fresh = "    ", True
    return lines + [line]


def rerun_commands(runs, number, source, root):
    """The lab.sweep commands that plan these runs again into `root`, with the flags, seeds and learning rates
    they ran (one command per extra flags and seeds, the lrs grouped where they share arms), and how many runs
    lab.sweep did not make (their commands are in runs.md)."""
    cells, other = {}, 0
    for run in runs:
        found = sweep_flags(run, number, source)
        if found is None:
            other += 1
            continue
        base, lr, extra = found
        cells.setdefault(extra, {}).setdefault((base, lr), set()).add(int(run.seed[len("seed"):]))
    order = list(experiments([number], source=source or "bf16"))
    out = []
    for extra, by_cell in cells.items():
        by_seeds = {}
        for (base, lr), seeds in by_cell.items():
            by_seeds.setdefault(tuple(sorted(seeds)), {}).setdefault(lr, set()).add(base)
        for seeds, by_lr in by_seeds.items():
            lrs_of = {}
            for lr, bases in by_lr.items():
                lrs_of.setdefault(tuple(sorted(bases, key=order.index)), []).append(lr)
            for bases, lrs in lrs_of.items():
                for seed_flag in seed_ranges(seeds):
                    words = ["python", "-m", "lab.sweep", "--claims", str(number)]
                    words += ["--source", source] if source and source != "bf16" else []
                    words += ["--only", ",".join(bases)]
                    words += ["--lrs", ",".join(f"{lr:g}" for lr in sorted(lrs))] if None not in lrs else []
                    words += ["--seeds", seed_flag] if seed_flag else []
                    words += ["--out-root", root] + (["--", *extra] if extra else [])
                    out.append(words)
    return out, other


class Row:
    """A claim-1 study's run as a runs.md table reads it (claim1.StreamRun, with its folder's config.json)."""

    def __init__(self, run):
        self.run, self.path = run, run.path
        self.group, self.seed = os.path.basename(os.path.dirname(run.path)), os.path.basename(run.path)
        try:
            self.config = read_config(run.path)
        except Unreadable:   # its log's warning names the run (claim1.StreamRun); no command to show
            self.config = {}


def stream_runs(runs):
    """claim1.load's {arm: {seed: run}} as Rows, arm by arm, seeds in order."""
    return [Row(r) for arm in runs.values() for _, r in sorted(arm.items())]
