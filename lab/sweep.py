"""
Launch the paper's claims as a batch of train.py runs, side by side on one GPU (or CPU); an arm that uses the
assay's flags runs as `python -m lab.train_assay` (train.py with the assay: lab/train_assay.py).

    python -m lab.sweep                                   # every claim, 8 seeds: runs/claims/<experiment>/seed<k>/
    python -m lab.sweep --claims 1,2 --seeds 4            # some claims
    python -m lab.sweep --claims 1 --dry-run              # print the commands only
    python -m lab.sweep --claims 1 -- --max-steps 50 --n-layer 2 --device cpu   # extra flags go to every run
    python -m lab.sweep --resume                          # also continue runs that were interrupted or crashed

Every arm of every claim runs the same seeds (seed k passes --seed k: the same initial weights and batch order),
so report.py compares arms seed by seed. Each run is one train.py subprocess with its stdout.log / stderr.log in
its own folder; at most --parallel run at once. A run whose log already ends with a completed or collapsed "end"
record is skipped, so launching the same sweep again only runs what is left; a run made with other flags than
those planned now is refused, naming them, and one that a live train.py still writes (a killed sweep's orphan)
is not launched a second time. Read the results with `python -m lab.report runs/claims`.
"""
import argparse
import gzip
import itertools
import json
import os
import re
import shlex
import signal
import subprocess
import sys
import time
import zlib


ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))   # the reference: train.py, prepare_data.py
# The assay's flags (lab/assay.py; a test checks the list): an arm that gives one runs through its command, which
# resumes it too. Every other arm runs train.py itself.
ASSAY_FLAGS = ("--inject-site", "--inject-scale", "--inject-coherence", "--inject-layers", "--qk-fix", "--probe",
               "--probe-k")
ASSAY_COMMAND = ["-m", "lab.train_assay"]

# Seeds per arm. report.py compares two arms by an exact sign test over the seeds where they
# differ: p < 0.05 needs 5 such seeds all one way (1/32), the dose grid's Bonferroni 0.05 / 3
# needs 6 (1/64). 8 leave room for seeds where both arms agree.
SEEDS = 8
# Claims 3 and 4: the injected error's size (its rms / that of the signal it joins; see lab/assay.py)
# and sign-coherence (1: coherent; 0.5: a fresh random sign each step). The range was fixed in
# advance from a pilot on seed 101 (RESULTS.md, "Pilot"); half-decades since the first sweep's
# decades hid where the two coherences cross (claim 4 is judged dose by dose).
DOSES = (0.3, 1.0, 3.0, 10.0, 30.0)
COHERENCES = (0.5, 1.0)
# Injection site -> its QK-only fix. Outside attention: mlp-out in the forward (claim 3's site,
# chosen before any sweep ran) and the gradients of W_up and W_v, fixed by parameter-free QK-norm
# from step 0. The positive control, the backward's delta (where the kernel fault lands), is fixed
# by training W_q and W_k on the error-free gradient.
SITES = {"mlp-out": "qknorm", "grad-mlp": "qknorm", "grad-wv": "qknorm", "delta": "clean-grad"}
CLAIM3_SITE = "mlp-out"
CLAIM4_SITES = ("mlp-out", "delta")   # claim 4's random-sign arms run at these sites only (compute)
NO_ERROR = "fp32"                     # the paired no-error arm: fp32 state, no injection
QKNORM_ALONE = "fp32-qknorm-always"   # QK-norm's own cost, without an error (claim 3 reports it)


def inject_arm(site, dose, coherence, fix=False):
    """(name, flags) of one cell of the dose grid."""
    name = f"inject-{site}-{dose:g}-c{coherence:g}" + ("-qkfix" if fix else "")
    flags = f"--accum fp32 --inject-site {site} --inject-scale {dose:g} --inject-coherence {coherence:g}"
    return name, flags + (f" --qk-fix {SITES[site]}" if fix else "")


def _grid(coherences, fix, sites=tuple(SITES)):
    return dict(inject_arm(site, dose, c, fix) for site in sites for dose in DOSES for c in coherences)


# Claims 5 and 6 act on a runaway something else drives: its source. On a GPU, the natural fault
# (bf16 state, assay preset). In the CPU lab bf16 state does not run away (MEASUREMENTS.md), so the
# source is a coherent error at delta, at a dose the pilot saw run away (RESULTS.md), or the demo's
# learning rate. A source names its arms: bf16, bf16-probe-topk, assay-guard-clip, ...
SOURCES = {
    "bf16": "--accum bf16",
    "assay": "--accum fp32 --inject-site delta --inject-scale 3 --inject-coherence 1",
    "lr": "--accum bf16 --lr 3e-2 --min-lr 3e-2 --warmup-steps 20 --schedule constant",
}


def probe_arms(source):
    """Claim 5: the source, the probe on W_q/W_k's top-k, three controls that can be carried out at
    every step (the whole update shrunk alike, the next k directions, a fixed random subspace), three
    reported ones (the paper's equal-energy, W_v's and the MLP's top-k), fp32 for the loss."""
    base = SOURCES[source]
    modes = {"topk": "qk-topk", "shrink": "qk-shrink", "nextk": "qk-nextk", "fixed": "qk-fixed",
             "equal": "equal-energy", "v-topk": "v-topk", "mlp-topk": "mlp-topk"}
    return {source: base, **{f"{source}-probe-{name}": f"{base} --probe {mode}" for name, mode in modes.items()},
            **probe_long_arms(source), **probe_gain_arm(source), NO_ERROR: "--accum fp32"}


def probe_long_arms(source):
    """Claim 5's top-k probe and shrink control at LONG_STEPS (<arm>-long): the shrink slows the step, so a
    runaway it only delays needs the horizon of a slowed runaway to show (report.py's rule 5)."""
    long = f"{SOURCES[source]} --max-steps {LONG_STEPS}"
    return {f"{source}-probe-topk-long": f"{long} --probe qk-topk", f"{source}-probe-shrink-long": f"{long} --probe qk-shrink"}


def probe_gain_arm(source):
    """Claim 5's escape route: the top-k probe at LONG_STEPS again, the same flags as
    <source>-probe-topk-long, its log now holding each layer's pre-attention norm gain (lab/assay.py's
    gain_record; train.py's own log held it on 2026-12-05)."""
    return {f"{source}-probe-topk-long-gain": probe_long_arms(source)[f"{source}-probe-topk-long"]}


# Claim 6's softcap, between the guard's trigger (200) and a runaway's max logit (report.RUNAWAY_LOGIT,
# 1000): a cap below the trigger would cap the logits by construction, from the first step it acts.
SOFTCAP = 500
# Claim 6's lr-drop cuts Adam's step 10x, so a runaway it only slows takes about 10x the steps to show:
# the CPU lab's slowest source runaway took 220 steps from the trigger's threshold to a max logit of
# 1000 (RESULTS.md), so 2,200 steps at a tenth of the lr, after a trigger as late as step 256. The
# lr-drop and QK-norm, which it is judged against, also run this long (report.py's rule 6 checks that
# it is enough). The arms set --max-steps themselves: run them without one after `--`.
LONG_STEPS = 2500


# Claim 6's actions at QK-Guard's trigger, besides its own (QK-norm), by kind: the lab's list, not guard.py's
# registry, so that an action a fork adds to guard.py changes no committed arm or verdict (add it here to
# run it in claim 6). Each is one of guard.ACTIONS of that kind (a test checks).
CLAIM6_ACTIONS = {"non-qk": ("lr-drop", "clip", "softcap"), "qk": ("qkclip",), "source": ("fp32-accum",)}


def actions_of(kind):
    """Claim 6's actions of a kind ("non-qk", "qk", "source"), in CLAIM6_ACTIONS' order."""
    return list(CLAIM6_ACTIONS[kind])


def action_arms(source):
    """Claim 6: the source (the rule judges only seeds where it runs away), QK-Guard's own action
    (QK-norm) and the others at its trigger: the non-QK controls, the other QK-side ones, and the fixes
    at the source only where the state is bf16 (fp32 state has nothing to switch)."""
    base = f"{SOURCES[source]} --guard on"
    actions = actions_of("non-qk") + actions_of("qk") + (actions_of("source") if "--accum bf16" in base else [])
    extra = {"softcap": f" --softcap-value {SOFTCAP}"}
    return {source: SOURCES[source], f"{source}-guard": base,
            **{f"{source}-guard-{a}": f"{base} --guard-action {a}{extra.get(a, '')}" for a in actions},
            **long_arms(source)}


def long_arms(source):
    """Claim 6's lr-drop and QK-norm at LONG_STEPS (<arm>-long): the lr-drop slows a runaway as much as it
    cuts the lr, so the usual horizon cannot tell a delay from prevention."""
    base = f"{SOURCES[source]} --guard on --max-steps {LONG_STEPS}"
    return {f"{source}-guard-long": base, f"{source}-guard-lr-drop-long": f"{base} --guard-action lr-drop"}


# claim -> (its words, {arm: train.py flags}). An arm in several claims (bf16, fp32) runs once.
# Flags left out take train.py's defaults (on a GPU: the assay preset).
CLAIMS = {
    1: ("bf16 softmax state collapses; fp32 state and bf16-safemax do not", {
        "bf16": "--accum bf16",
        "fp32": "--accum fp32",
        "bf16-safemax": "--accum bf16-safemax",
        # which rounding source drives it, one at a time (reported, not judged)
        "state-only": "--accum bf16 --round none",
        "logits-only": "--accum fp32 --round logits",
        "pv-only": "--accum fp32 --round pv",
        "standard": "--accum fp32 --round none",
        "bf16-all": "--accum bf16 --round logits,pv,backward",
    }),
    2: ("QK-Guard prevents it, within 0.03 nat of always-on QK-norm; it stays dormant on healthy training", {
        "bf16": "--accum bf16",
        "bf16-guard": "--accum bf16 --guard on",
        "bf16-qknorm-always": "--accum bf16 --qknorm always",
        # the 2026-12-03 pair: the arm above again, and its twin with the bf16 state rounded after each 64
        # keys instead of once per 128-key row. Not an A/A: the tile moves the bf16 state's rounding, the
        # fault itself (attention_kernel.py); and its two arms ran three hours and two commits apart
        "bf16-qknorm-always-aa": "--accum bf16 --qknorm always",
        "bf16-qknorm-always-tile64": "--accum bf16 --qknorm always --block-n 64",
        # the A/A pair (2p's noise floor, 2026-12-05): the same arm at 1 and 2 CPU threads, run side by side
        # in one sweep. A CPU's sums follow its thread count, so the two differ only in the order of fp32 sums
        # (from the first update: lab/MEASUREMENTS.md); no rounding point, tile or flag of the numerics moves
        "bf16-qknorm-always-t1": "--accum bf16 --qknorm always --threads 1",
        "bf16-qknorm-always-t2": "--accum bf16 --qknorm always --threads 2",
        "fp32": "--accum fp32",
        "fp32-guard": "--accum fp32 --guard on",
    }),
    3: ("an error outside attention drives the same QK runaway; the QK-only fix stops it", {
        NO_ERROR: "--accum fp32", QKNORM_ALONE: "--accum fp32 --qknorm always", **_grid((1.0,), fix=False),
        **_grid((1.0,), fix=True)}),
    4: ("sign-coherence, not size, lets an error in: at the same dose, coherent errors drive the QK runaway "
        "further than random-sign ones", {NO_ERROR: "--accum fp32", **_grid(COHERENCES, fix=False, sites=CLAIM4_SITES)}),
    5: ("causal probe: removing QK's top directions stops the runaway; the same removal elsewhere does not",
        probe_arms("bf16")),
    6: ("non-QK actions at the same trigger fail", action_arms("bf16")),
    7: ("the same on a second architecture (llama: RMSNorm, SwiGLU, rotary)", {
        "llama-bf16": "--arch llama --accum bf16",
        "llama-fp32": "--arch llama --accum fp32",
        "llama-bf16-guard": "--arch llama --accum bf16 --guard on",
        "llama-bf16-qknorm-always": "--arch llama --accum bf16 --qknorm always",
        "llama-bf16-qknorm-always-aa": "--arch llama --accum bf16 --qknorm always",
        "llama-bf16-qknorm-always-tile64": "--arch llama --accum bf16 --qknorm always --block-n 64",
        "llama-bf16-qknorm-always-t1": "--arch llama --accum bf16 --qknorm always --threads 1",
        "llama-bf16-qknorm-always-t2": "--arch llama --accum bf16 --qknorm always --threads 2",
        "llama-fp32-guard": "--arch llama --accum fp32 --guard on",
        "llama-bf16-safemax": "--arch llama --accum bf16-safemax",
    }),
}
# The learning-rate study (claims 1, 2 and 7 at CPU scale, Wortsman et al. 2023's proxy): the arms
# below at each learning rate of LRS, with a constant schedule (the lab preset's), on both
# architectures. The grid comes from a pilot (RESULTS.md, "Pilot"): from a healthy lr to ones where
# the unguarded runs run away, half-decades.
LRS = (1e-3, 3e-3, 1e-2, 3e-2, 1e-1)
LR_STUDY_ARMS = ("fp32", "bf16", "bf16-safemax", "bf16-guard", "bf16-qknorm-always", "fp32-guard")
# A/A arms: an arm -> (the arm at 1 thread, its twin at 2): they differ in the order of fp32 sums alone, and
# run side by side in one sweep (the noise floor of a tolerance at this scale: report.py's rule 2p); run at
# the learning rates that need it. The arm at 1 thread also shows what the code's changes since the arm's own
# runs moved (0 where none moved a bit).
AA_ARMS = {"bf16-qknorm-always": ("bf16-qknorm-always-t1", "bf16-qknorm-always-t2")}
# The 2026-12-03 pair, reported as what it is: the arm again, and a 64-key tile (a bf16 rounding change)
TILE_ARMS = {"bf16-qknorm-always": ("bf16-qknorm-always-aa", "bf16-qknorm-always-tile64")}
DONE = ("completed", "collapsed")    # end statuses that mean "nothing left to run"
STOP_WAIT_S = 300                    # after Ctrl-C, how long children get to save their checkpoint


def experiments(claims, only=None, source="bf16"):
    """name -> train.py flags for the chosen claims (and names), a shared arm once; claims 5 and 6
    act on the runaway of `source` (SOURCES)."""
    chosen = {}
    for number in claims:
        arms = {5: lambda: probe_arms(source), 6: lambda: action_arms(source)}.get(number, lambda: CLAIMS[number][1])
        for name, flags in arms().items():
            if only is None or name in only:
                chosen[name] = shlex.split(flags)
    return chosen


def lr_name(arm, lr):
    """The folder of `arm` at learning rate lr: <arm>-lr<lr>, e.g. bf16-guard-lr0.03."""
    return f"{arm}-lr{lr:g}"


def split_lr(name):
    """(arm, lr) of an lr_name, or (name, None) for an arm at its preset's lr."""
    arm, sep, lr = name.rpartition("-lr")
    try:
        return (arm, float(lr)) if sep and arm else (name, None)
    except ValueError:
        return name, None


def at_lrs(names_flags, lrs):
    """Each arm at each learning rate, the lr one more axis of the arm: --lr and --min-lr (the
    floor of a cosine schedule; a constant one never reaches it) set to it, after the arm's flags."""
    return {lr_name(name, lr): [*flags, "--lr", f"{lr:g}", "--min-lr", f"{lr:g}"]
            for name, flags in names_flags.items() for lr in lrs}


class Unreadable(Exception):
    """A run's file that cannot be read at all (a truncated or non-gzip log.jsonl.gz, a config.json
    that is not JSON); the message names the file."""


def read_log(out_dir):
    """The records of a run's log.jsonl, or of log.jsonl.gz (as results/ keeps them); [] if neither.
    A line cut short (still being written, or killed) is skipped; a file that cannot be read raises
    Unreadable (a gzip cut short has lost its end, so none of it is trusted)."""
    records, path = [], os.path.join(out_dir, "log.jsonl")
    opener = (open, path) if os.path.exists(path) else (gzip.open, path + ".gz") if os.path.exists(path + ".gz") \
        else None
    if opener:
        try:
            with opener[0](opener[1], "rt") as f:
                for line in f:
                    record = parse_record(line)
                    if record is None:
                        continue
                    if record.get("event") == "resume":   # drop what the resumed run logs again
                        records = [r for r in records if not replayed(r, record["step"])
                                   and (record.get("from_checkpoint", True) or r.get("event") == "start")]
                    records.append(record)
        except (OSError, EOFError, zlib.error, UnicodeDecodeError) as e:   # BadGzipFile is an OSError
            raise Unreadable(f"{opener[1]}: {e or type(e).__name__}") from e
    return records


def parse_record(line):
    """One log line's record, or None. A line cut short by a kill or a full disk can have the next
    record fused onto its end (a resumed process writes its "resume" event first): the fragment is
    dropped and that event kept. A line of JSON that is not an object is no record."""
    # the candidates are found lazily: a whole line (nearly every one) parses at the first
    for start in itertools.chain([0], (i for i in range(1, len(line)) if line.startswith('{"', i))):
        try:
            record = json.loads(line[start:])
        except ValueError:
            continue
        if start == 0:
            return record if isinstance(record, dict) else None
        if isinstance(record, dict) and "event" in record:   # what a process writes first: start, resume
            return record
    return None


def replayed(record, resume_step):
    """Whether the run resumed at `resume_step` writes this earlier record again: step records and
    guard/collapse events of updates >= resume_step, evals after it (train.py's step numbering)."""
    if "step" not in record or record.get("event") in ("start", "resume", "end"):
        return False
    return record["step"] > resume_step if record.get("event") == "eval" else record["step"] >= resume_step


def run_state(out_dir):
    """'new' (nothing there), 'completed' / 'collapsed' (done), or why it is unfinished."""
    if not any(os.path.exists(os.path.join(out_dir, f)) for f in ("config.json", "log.jsonl", "log.jsonl.gz",
                                                                   "ckpt.pt")):
        return "new"
    try:
        records = read_log(out_dir)
    except Unreadable as e:
        return f"unreadable log {e}"
    if not records:
        return "empty log"
    return records[-1].get("status", "unknown") if records[-1].get("event") == "end" else "no end record"


def seed_range(text):
    """--seeds: "N" is seeds 1..N, "A-B" seeds A..B (to add seeds to a sweep that ran 1..A-1)."""
    first, _, last = text.partition("-")
    try:
        first, last = (1, int(first)) if not last else (int(first), int(last))
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r}: give N (seeds 1..N) or A-B, e.g. 16 or 9-16")
    if not 1 <= first <= last:
        raise argparse.ArgumentTypeError(f"{text!r}: seeds start at 1 and A-B needs A <= B, e.g. 9-16")
    return range(first, last + 1)


def plan(names_flags, seeds, out_root, extra, resume, train_parser=None):
    """The runs to launch, seed-major (each experiment's seed 1 before any seed 2, so a sweep cut
    short still covers them all), and the ones skipped with the reason. With train_parser (train.py's),
    a run made with other flags than planned is refused (SystemExit), not skipped or resumed."""
    train = [os.path.relpath(os.path.join(ROOT, "train.py"))]
    todo, skipped = [], []
    for seed in (range(1, seeds + 1) if isinstance(seeds, int) else seeds):
        for name, flags in names_flags.items():
            out_dir = os.path.join(out_root, name, f"seed{seed}")
            state = run_state(out_dir)
            run_flags = [*flags, *extra, "--seed", str(seed), "--out-dir", out_dir]
            assay = any(flag.split("=", 1)[0] in ASSAY_FLAGS for flag in run_flags)
            cmd = [sys.executable, *(ASSAY_COMMAND if assay else train), *run_flags]
            writer = live_writer(out_dir) if state not in DONE else None
            if train_parser is not None and state != "new" and not state.startswith("unreadable"):
                refuse_other_flags(out_dir, train_parser, run_flags, finished=state in DONE)
            if writer:   # orphaned by a killed sweep, say: a second writer would log every step twice
                skipped.append((out_dir, f"unfinished: process {writer} is still writing it; wait for it, or stop "
                                         f"it (kill -INT {writer}) and launch again"))
            elif state in DONE:
                skipped.append((out_dir, state))
            elif state == "new":
                todo.append((out_dir, cmd))
            elif state.startswith("unreadable"):   # what it ran is unknown: not resumed onto
                skipped.append((out_dir, f"unfinished ({state}): delete {out_dir} to run it again"))
            elif not resume:
                skipped.append((out_dir, f"unfinished ({state}): pass --resume to continue it, or delete it"))
            else:   # train.py --resume continues from the checkpoint, or starts over without one
                todo.append((out_dir, cmd + ["--resume"]))
    return todo, skipped


# ----------------------------------------------------------------------------------------------------------------
# The flags as train.py reads them: argparse would take --inject-sc for --inject-scale, so the extra flags are
# checked by name and compared by what they set (their dest), and a finished run's config.json by value.

def train_flag_parser(sweep_parser):
    """train.py's parser with the assay's flags (lab/train_assay.py's), its errors reported as the sweep's."""
    import run      # only here: it imports torch, which report.py (importing this file) does not need
    from lab.assay import Assay
    parser = run.build_parser(Assay())
    parser.error = lambda message: sweep_parser.error(f"after `--`: {message}")
    return parser


def typed_flags(parser, flags):
    """{dest: value} of the flags in a train.py flag list, as train.py would read them."""
    return {k: v for k, v in vars(parser.parse_args(flags)).items() if v is not None}


def unknown_flag(parser, flags):
    """A line on the first flag that is not one of train.py's by its exact name (a prefix of one too), or None."""
    names = {s for action in parser._actions for s in action.option_strings}
    for token in flags:
        name = token.split("=", 1)[0]
        if not name.startswith("-") or name in names or re.fullmatch(r"-[\d.]+(e-?\d+)?", name):
            continue
        full = sorted(n for n in names if n.startswith(name) and name.startswith("--"))
        return (f"{name} after `--` is not a train.py flag" + (f" (it abbreviates {' or '.join(full)}): give the "
                f"flag's full name" if full else ": see python train.py --help"))
    return None


def refuse_other_flags(out_dir, parser, flags, finished):
    """SystemExit naming the flags a run in out_dir was made with that differ from the planned ones: every
    flag its config.json records, typed or not (planned_args), not only those typed now. A resume may change
    what train.py lets it (run.RESUMABLE_CHANGES); a finished run only how it ran, not its --max-steps. A flag
    config.json lacks or records as null (an older run) is not held against it."""
    import run
    try:
        with open(os.path.join(out_dir, "config.json")) as f:
            config = json.load(f)
        saved = config["args"]
    except (OSError, ValueError, KeyError, TypeError):
        return   # no config.json yet (killed at start-up): train.py --resume starts over and says so
    if not isinstance(saved, dict):
        return
    free = run.RESUMABLE_CHANGES - ({"max_steps"} if finished else set())
    planned = json.loads(json.dumps(planned_args(parser, flags, config)))   # tuples as config.json holds them
    differ = [f"--{k.replace('_', '-')} {v} (the run's: {saved[k]})" for k, v in planned.items()
              if k not in free and saved.get(k) is not None and saved[k] != v]
    if differ:
        raise SystemExit(f"error: {out_dir} was run with other flags than planned: {'; '.join(differ)}. Give the "
                         f"flags it was run with, or another --out-root (or delete it to run it again)")


def planned_args(parser, flags, config):
    """Every flag train.py would record in config.json for `flags` (run.parse_args and run.resolve): those
    typed, then the preset's (auto: the one the run's own device picked), then the defaults. Left out: what
    a path or the data sets (the run and data folders) and --decay-steps 0 (--max-steps at the start)."""
    import run
    from guard import DEFAULT_THRESHOLD
    args = {**parser.flag_defaults, **typed_flags(parser, flags)}
    device = str((config.get("versions") or {}).get("device", "cpu")).split(":")[0]
    preset = run.auto_preset(device) if args["preset"] == "auto" else args["preset"]
    if preset in run.PRESETS:
        sizes = run.model_lib.MODEL_SIZES[run.PRESETS[preset]["size"]]
        args.update({k: v for k, v in {**run.PRESETS[preset], **sizes}.items()
                     if k != "size" and args.get(k) is None})
        args["preset"] = preset
    if args.get("guard_threshold") is None:
        args["guard_threshold"] = DEFAULT_THRESHOLD[args["guard_signal"]]
    derived = {"out_dir", "data_dir"} | ({"decay_steps"} if not args.get("decay_steps") else set())
    return {k: v for k, v in args.items() if k not in derived}


# ----------------------------------------------------------------------------------------------------------------
# One writer per run folder: the sweep records each child's pid in its folder, so that a sweep launched again
# (after kill -9 of the last one, whose children live on) does not start a second writer beside one.

PID_FILE = "sweep.pid"


def not_a_folder(path):
    """The file at `path` or above it where a folder is needed (the first that exists), or None."""
    path = os.path.abspath(path)
    while not os.path.exists(path) and os.path.dirname(path) != path:
        path = os.path.dirname(path)
    return None if os.path.isdir(path) else path


def output_problem(path, folder=False):
    """Why the lab's tools cannot write `path` as a file (or as a folder): one clause, or None."""
    if not folder and os.path.isdir(path):
        return f"{path} is a folder: give a file's name"
    above = not_a_folder(path if folder else os.path.dirname(os.path.abspath(path)))
    return f"{above} is a file, not a folder: give another path" if above else None


def ended_writing(out_dir):
    try:
        os.remove(os.path.join(out_dir, PID_FILE))
    except FileNotFoundError:
        pass


def live_writer(out_dir):
    """The pid of a live train.py (or lab.train_assay) a sweep started to write out_dir, or None."""
    try:
        with open(os.path.join(out_dir, PID_FILE)) as f:
            pid = int(f.read())
        os.kill(pid, 0) if pid > 0 else None    # signal 0: only whether it exists
    except PermissionError:                     # it exists, under another user
        return pid
    except (OSError, ValueError):               # no pid file, or no such process
        return None
    try:   # a pid since reused by another program is no writer
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            command = f.read()
        return pid if pid > 0 and (b"train.py" in command or b"lab.train_assay" in command) else None
    except OSError:     # no /proc (macOS): trust the pid
        return pid if pid > 0 else None


def flag_value(flags, name, default=None):
    """`name`'s value in a train.py flag list: the last wins, as in argparse; --name=value too."""
    value = default
    for i, flag in enumerate(flags):
        if flag == name and i + 1 < len(flags):
            value = flags[i + 1]
        elif flag.startswith(name + "="):
            value = flag.split("=", 1)[1]
    return value


def prepare_data_once(extra):
    """Build the default dataset once, first, or N runs starting together would all build it; with
    the tokenizer train.py picks (--tokenizer, else the preset's; preset auto is demo on a CPU)."""
    if flag_value(extra, "--data-dir"):
        return
    import run       # only here, as torch below: report.py imports this file and needs neither
    import prepare_data
    import torch
    dataset, preset = flag_value(extra, "--dataset", "pycode"), flag_value(extra, "--preset", "auto")
    if preset == "auto":
        on_gpu = torch.cuda.is_available() and not flag_value(extra, "--device", "auto").startswith("cpu")
        preset = run.auto_preset("cuda" if on_gpu else "cpu")
    tokenizer = flag_value(extra, "--tokenizer", run.PRESETS.get(preset, {}).get("tokenizer", "gpt2"))
    out = prepare_data.default_out_dir(dataset, tokenizer)
    if dataset == "pycode" and not os.path.exists(os.path.join(out, "meta.json")):   # train.py's own
        print(f"preparing {out} ({tokenizer} tokens) once before the runs start", flush=True)
        subprocess.run([sys.executable, os.path.join(ROOT, "prepare_data.py"), "--dataset", dataset,
                        "--tokenizer", tokenizer, "--out-dir", out], check=True)


def default_parallel(extra):
    """8 runs share a GPU, 1 a CPU. 8 is not measured (SOURCES.md has 4 sharing an H200);
    gpu_checks.sh says how to find the number for a GPU."""
    if flag_value(extra, "--device", "auto").startswith("cpu"):
        return 1
    import torch    # only here: the rest of sweep.py, and report.py which imports it, need no torch
    return 8 if torch.cuda.is_available() else 1


def outcome(out_dir, returncode):
    """(ok, text) for the progress line, from the run's exit code and its log's end record."""
    try:
        last = (read_log(out_dir) or [{}])[-1]
    except Unreadable as e:
        return False, f"ERROR: unreadable log {e}; see {os.path.join(out_dir, 'stderr.log')}"
    if returncode != 0 or last.get("event") != "end" or last.get("status") == "error":
        why = last.get("error") or f"exit code {returncode}"
        return False, f"ERROR: {why}; see {os.path.join(out_dir, 'stderr.log')}"
    text = f"{last.get('status')} at step {last.get('step')}"
    if last.get("collapse_step") is not None:
        text += f", collapse from step {last['collapse_step']}"
    if last.get("guard_trigger"):
        text += f", guard triggered at step {last['guard_trigger']['step']}"
    if last.get("val_loss") is not None:
        text += f", val loss {last['val_loss']:.4f}"
    return True, text


def say(text):
    """print, flushed; dropped where the terminal is gone (a hangup: every write to it fails with EIO), so
    that stopping goes on."""
    try:
        print(text, flush=True)
    except OSError:
        pass


def stop(running):
    """Send every child SIGINT (train.py finishes its step and saves a checkpoint), then wait. The signals
    go first: nothing printed (to a terminal that may be gone) can keep a child from its stop."""
    for proc in running:
        proc.send_signal(signal.SIGINT)
    say(f"stopping {len(running)} runs (they save a checkpoint; Ctrl-C again to kill them)")
    try:
        deadline = time.time() + STOP_WAIT_S
        for proc in running:
            proc.wait(timeout=max(1.0, deadline - time.time()))
    except (KeyboardInterrupt, subprocess.TimeoutExpired):
        for proc in running:
            if proc.poll() is None:
                proc.kill()
    for proc, (out_dir, _) in running.items():
        if proc.poll() is not None:
            ended_writing(out_dir)
        say(f"  {out_dir}: {run_state(out_dir)}")


def launch(todo, parallel):
    """Run the commands, at most `parallel` at once; return the folders of the runs that errored."""
    queue, running, errors, n, started, ended = list(todo), {}, [], len(todo), 0, 0
    try:
        while queue or running:
            while queue and len(running) < parallel:
                out_dir, cmd = queue.pop(0)
                os.makedirs(out_dir, exist_ok=True)
                # appended, so a resumed run keeps the output of its earlier part
                with open(os.path.join(out_dir, "stdout.log"), "a") as out, \
                        open(os.path.join(out_dir, "stderr.log"), "a") as err:
                    # own session: a terminal's Ctrl-C reaches only us, and we pass on one SIGINT
                    proc = subprocess.Popen(cmd, stdout=out, stderr=err, start_new_session=True,
                                            env=dict(os.environ, PYTHONUNBUFFERED="1"))
                with open(os.path.join(out_dir, PID_FILE), "w") as f:
                    f.write(f"{proc.pid}\n")
                running[proc] = (out_dir, time.time())
                started += 1
                say(f"[start {started}/{n}] {out_dir}")
            for proc in [p for p in running if p.poll() is not None]:
                out_dir, t0 = running.pop(proc)
                ended_writing(out_dir)
                ok, text = outcome(out_dir, proc.returncode)
                ended += 1
                say(f"[end {ended}/{n}] {out_dir}: {text} ({time.time() - t0:.0f} s)")
                if not ok:
                    errors.append(out_dir)
            time.sleep(0.2)
    except KeyboardInterrupt:
        stop(running)
        raise
    except OSError as e:   # a run's folder or logs cannot be written (a disk that filled or is read-only)
        stop(running)
        where = e.filename or "a run folder"
        raise SystemExit(f"error: cannot write {where} ({e.strerror or e}): make room, or give an --out-root "
                         f"on a writable disk; then launch again with --resume") from None
    return errors


def unwritable(folder):
    """Why `folder` cannot be written (it is made if need be, and a file made and removed in it), or None."""
    try:
        os.makedirs(folder, exist_ok=True)
        probe = os.path.join(folder, f".sweep-write-check-{os.getpid()}")
        with open(probe, "w"):
            pass
        os.remove(probe)
    except OSError as e:
        return e.strerror or str(e)
    return None


def main(argv=None):
    argv = sys.argv[1:] if argv is None else list(argv)
    cut = argv.index("--") if "--" in argv else len(argv)
    argv, extra = argv[:cut], argv[cut + 1:]
    # no abbreviations: a train.py flag typed before `--` (--seed 3) would be read as --seeds 3
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter,
                                usage="%(prog)s [options] [-- extra train.py flags for every run]", allow_abbrev=False)
    p.add_argument("--claims", default=",".join(map(str, CLAIMS)), help="claims 1-7, e.g. 1,2")
    p.add_argument("--only", default=None, help="comma-separated arm names from those claims")
    p.add_argument("--seeds", type=seed_range, default=range(1, SEEDS + 1),
                   help="N: seeds 1..N; A-B: seeds A..B (seed k passes --seed k)")
    p.add_argument("--source", default="bf16", choices=list(SOURCES),
                   help="the runaway claims 5 and 6 act on: bf16 (the natural fault, GPU), assay (an "
                        "injected coherent error, the CPU lab), lr (the demo's learning-rate runaway)")
    p.add_argument("--lrs", default=None, help="each arm at each of these learning rates, comma-separated "
                   f"(the lr study: {','.join(f'{lr:g}' for lr in LRS)}); folders <arm>-lr<lr>")
    p.add_argument("--parallel", type=int, default=None, help="runs at once (default 8 on CUDA, else 1)")
    p.add_argument("--out-root", default="runs/claims", help="into <out-root>/<experiment>/seed<k>/")
    p.add_argument("--resume", action="store_true", help="continue unfinished runs too")
    p.add_argument("--dry-run", action="store_true", help="print the commands, run nothing")
    args = p.parse_args(argv)
    if args.parallel is not None and args.parallel < 1:
        p.error("--parallel must be at least 1")
    if not set(args.claims.split(",")) <= set(map(str, CLAIMS)):
        p.error(f"--claims {args.claims!r}: give some of {','.join(map(str, CLAIMS))}")
    claims = [int(c) for c in args.claims.split(",")]
    only = None if args.only is None else set(args.only.split(","))
    names_flags = experiments(claims, only, args.source)
    if only is not None and only - set(names_flags):
        p.error(f"--only: {', '.join(sorted(only - set(names_flags)))} not in claims {args.claims}")
    if args.lrs is not None:
        try:
            lrs = [float(x) for x in args.lrs.split(",")]
        except ValueError:
            lrs = []
        if not lrs or not all(0 < lr < float("inf") for lr in lrs):
            p.error(f"--lrs {args.lrs!r}: give learning rates above 0, comma-separated, e.g. 1e-3,3e-3")
        names_flags = at_lrs(names_flags, lrs)

    train_parser = train_flag_parser(p)
    if unknown_flag(train_parser, extra):
        p.error(unknown_flag(train_parser, extra))
    extra_sets = typed_flags(train_parser, extra)
    clash = {name: shared for name, flags in names_flags.items()
             for shared in [sorted(set(typed_flags(train_parser, flags)) & set(extra_sets))] if shared}
    if clash:   # the extra flags come last, so they would silently change what the arm is
        name, shared = next(iter(clash.items()))
        shared = [f"--{dest.replace('_', '-')}" for dest in shared]
        p.error(f"{', '.join(shared)} after `--` would override what arm {name} sets itself"
                f"{f' (and {len(clash) - 1} more arms)' if len(clash) > 1 else ''}: drop it there, or leave "
                f"those arms out of --only")
    if not_a_folder(args.out_root):
        p.error(f"--out-root {args.out_root}: {not_a_folder(args.out_root)} is a file, not a folder: give a folder")
    todo, skipped = plan(names_flags, args.seeds, args.out_root, extra, args.resume, train_parser)
    for out_dir, why in skipped:
        print(f"skip {out_dir}: {why}")
    if args.dry_run:
        for _, cmd in todo:
            print(shlex.join(cmd))
        return 0
    if not todo:
        print(f"nothing to run; read the results with: python -m lab.report {args.out_root}")
        return 0
    if unwritable(args.out_root):   # a read-only disk: one line now, not a traceback at the first run
        p.error(f"--out-root {args.out_root}: cannot write there ({unwritable(args.out_root)}): give a "
                f"folder on a writable disk")
    parallel = args.parallel or default_parallel(extra)
    prepare_data_once(extra)
    print(f"{len(todo)} runs, {parallel} at a time, into {args.out_root}", flush=True)

    def interrupt(signum, frame):
        raise KeyboardInterrupt
    # SIGINT too: background jobs start ignoring it; SIGHUP: the terminal closed (the children, in their own
    # sessions, would live on unseen)
    for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP):
        signal.signal(sig, interrupt)
    try:
        errors = launch(todo, parallel)
    except KeyboardInterrupt:
        say("sweep interrupted: launch it again with --resume to continue the unfinished runs")
        return 130
    if errors:
        print(f"{len(errors)} runs errored:" + "".join(f"\n  {d}" for d in errors))
        return 1
    unfinished = sum(why.startswith("unfinished") for _, why in skipped)
    print(f"all {len(todo)} runs ended" + (f" ({unfinished} unfinished ones skipped: see above)" if unfinished else "")
          + f"; read them with: python -m lab.report {args.out_root}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
