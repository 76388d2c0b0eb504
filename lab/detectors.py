"""
QK-Guard scored as a detector: how early it fires before a runaway or a collapse, and how often it fires on
healthy training, beside the loss-spike detectors of the field, all replayed on the committed runs' logs.

    python -m lab.detectors lab/results --markdown lab/DETECTORS.md --plot lab/plots/detectors.png

The guard is two things, a detector (the first crossing of a threshold) and an action; this scores the detector.
Each detector below is written from its documented rule (its source is cited; no code was copied) and replayed
on a run's log: the step it would first fire, or None.

Resolution. A log holds one record per log_interval updates (10 in every committed run): the interval's mean
loss, its max attention logit, and, at its last update, the grad norm and sigma(W_q,h), sigma(W_k,h). A record's
step is that last update's. So every firing and every event (a runaway, a collapse) is known to the interval:
a detection in the same interval as the event counts as lead 0, and leads are multiples of the interval.

The loss-based windows count records, not steps: a window of S steps is ceil(S / interval) records (128 steps
are 13 records at interval 10; 10 steps, 1 record: the mean of the last 10 steps is the record before). A record's
loss is already a 10-step mean, so a one-step spike shows at a tenth of its height: where a rule is unclear at
record resolution, the reading that fires earlier is taken (the field's detectors get the benefit of the doubt).

Only unguarded runs are scored: a guarded run's action changes it from its trigger on, so nothing after the
trigger can be compared. Their triggers serve one check instead: an unguarded run and its guarded twin (same
study, arm and seed) are the same run up to the trigger, so the guard's own trigger (at step resolution) must
fall in the interval where the replayed max-logit trigger fires on the twin (check_twins).
"""
import argparse
import collections
import glob
import math
import os
import re
import shlex
import statistics
import sys
from typing import NamedTuple, Optional

from guard import DEFAULT_THRESHOLD
from lab.figures import _pyplot
from lab.files import save_figure, save_text, written_together
from lab.loading import load_runs, lr_ran_away
from lab.thresholds import LOGIT_RATIO, RISE_WINDOW, RUNAWAY_LOGIT
from lab.sweep import split_lr

# --------------------------------------------------------------------------------------------------
# One run's log, as the detectors read it: one value per record


class Log(NamedTuple):
    steps: list        # each record's step: the last update of its interval
    loss: list         # the interval's mean train loss
    grad_norm: list    # the grad norm of the interval's last update, before clipping
    logit: list        # the interval's max attention logit over layers and heads
    qk: list           # max over heads of sigma(W_q,h) sigma(W_k,h) at the interval's last update (nan: not logged)
    interval: int      # updates per record (config.json's log_interval)


def records(steps, interval):
    """A window of `steps` updates in records: ceil(steps / interval), at least one."""
    return max(1, math.ceil(steps / interval))


def first_over(log, values, threshold):
    """The step of the first record whose value is over threshold (> as the guard compares), or None."""
    return next((s for s, v in zip(log.steps, values) if v > threshold), None)


# --------------------------------------------------------------------------------------------------
# QK-Guard's trigger, and a self-calibrating one

def qk_guard_max_logit(log, threshold=DEFAULT_THRESHOLD["max-logit"]):
    """guard.py, signal "max-logit": the first max attention logit over the threshold (200 by default)."""
    return first_over(log, log.logit, threshold)


def qk_guard_sigma_product(log, threshold=DEFAULT_THRESHOLD["sigma-product"]):
    """guard.py, signal "sigma-product": the first sigma(W_q,h) sigma(W_k,h) of a head over the threshold (50).
    The guard checks it every update; the log holds it at each interval's last update."""
    return first_over(log, log.qk, threshold)


CALIBRATION_STEPS = 100    # the self-calibrating trigger's warm-up: Megatron-LM's 100 samples (below)
CALIBRATION_FACTOR = LOGIT_RATIO   # 10: Megatron-LM's factor, and the lab's "beyond healthy" ratio (report.py)


def self_calibrating_max_logit(log, warmup=CALIBRATION_STEPS, factor=CALIBRATION_FACTOR):
    """Megatron-LM's spiky-loss rule (below) applied to the max logit: the threshold is `factor` times the
    largest max logit of the first `warmup` steps, and it fires at the first record after them over it.
    Both numbers are Megatron's, fixed before any run was scored (none tuned on the outcome); a run that
    runs away within its warm-up sets its threshold on the runaway, and is missed."""
    n = records(warmup, log.interval)
    if len(log.logit) <= n:
        return None
    threshold = factor * max(log.logit[:n])
    return next((s for s, v in zip(log.steps[n:], log.logit[n:]) if v > threshold), None)


# --------------------------------------------------------------------------------------------------
# The field's loss-spike detectors, each at its documented defaults

def olmo_core_skip_step(log, window=128, sigma_factor=6.0, min_history=64, signals=("loss", "grad_norm")):
    """OLMo-core, olmo_core.optim.SkipStepOptimizer (rolling_interval_length=128, sigma_factor=6): skip a step
    whose loss, or grad norm, is more than sigma_factor standard deviations (sample std) from the mean of the
    previous `window` values: |x - mean| > 6 sd, both ways, so a sudden drop fires too. It starts once it holds
    max(20, window // 2) = 64 values, the current one included. Replayed: 13 records of history, 7 to start; a
    z-score that is not finite (a non-finite value, or a zero sd under a change) fires, as its `z <= 6` fails."""
    n, start = records(window, log.interval), records(max(20, min_history), log.interval)

    def outlier(values, i):
        history = values[max(0, i - n):i]
        mean = sum(history) / len(history)
        sd = math.sqrt(sum((v - mean) ** 2 for v in history) / (len(history) - 1))   # torch.std's, n - 1
        deviation = abs(values[i] - mean)
        return not math.isfinite(values[i]) or (deviation > sigma_factor * sd if sd > 0 else deviation > 0)

    series = [getattr(log, name) for name in signals]     # one of them alone: which one fired (render)
    return next((log.steps[i] for i in range(start - 1, len(log.steps)) if any(outlier(v, i) for v in series)), None)


def lightning_spike_detection(log, window=10, warmup=1, rtol=2.0):
    """Lightning, lightning.fabric.utilities.spike.SpikeDetection (mode="min", window=10, warmup=1, atol=None,
    rtol=2.0, finite_only=True): from the batch after `warmup` on, a non-finite loss is a spike; a loss no
    higher than the last is not; else it is a spike when |loss - running mean| >= rtol * |running mean|, the
    mean of the last `window` losses: for a rising loss, loss >= 3x that mean (relative tolerance 2 means 3x,
    not 2x). Replayed: the window is 1 record, so the mean is the previous record's loss."""
    n = records(window, log.interval)
    for i in range(records(warmup, log.interval), len(log.steps)):
        loss, mean = log.loss[i], statistics.fmean(log.loss[max(0, i - n):i])
        if not math.isfinite(loss) or loss > log.loss[i - 1] and abs(loss - mean) >= rtol * abs(mean):
            return log.steps[i]
    return None


def llm_foundry_kill_loss_spike(log, window=100, outlier_multiplier=2.0, patience=4, max_loss_cap=10.0):
    """llm-foundry, llmfoundry.callbacks.KillLossSpike (window_size=100, outlier_multiplier=2, patience=4,
    loss_cap=10): once its window of the last 100 losses is full, a loss >= 2x the window's mean is an outlier;
    patience + 1 = 5 outliers in a row fire (a loss that is not one resets the count). Also high losses: from
    step 2 x window on, half the window's losses over the loss cap, which recent versions set to the largest
    loss of the first window, at most 10 (and the window to 5% of the run, at least 100: 100 for every run
    scored here, none longer than 2,000 steps). Replayed: a window of 10 records, the cap their largest; 5
    outlier steps in a row fit in one interval, so one outlier record fires (the earlier reading)."""
    n, in_a_row = records(window, log.interval), records(patience + 1, log.interval)
    loss_cap = min(max_loss_cap, max(log.loss[:n], default=max_loss_cap))
    streak = 0
    for i in range(n, len(log.steps)):
        recent = log.loss[i - n:i]
        streak = streak + 1 if log.loss[i] >= outlier_multiplier * statistics.fmean(recent) else 0
        high = i >= 2 * n and sum(loss > loss_cap for loss in recent) >= n / 2
        if streak >= in_a_row or high:
            return log.steps[i]
    return None


def megatron_spiky_loss(log, samples=100, threshold=10.0):
    """Megatron-LM, RerunStateMachine.is_unexpectedly_large with threshold 10 (--check-for-spiky-loss): the
    largest |loss| of the first 100 values is the reference; from then on a |loss| >= 10x it is spiky (NaN and
    inf are left to the separate --check-for-nan-in-loss-and-grad, on by default, which fires on them: both are
    here). Replayed: the first 10 records are the reference."""
    n = records(samples, log.interval)
    for i, (step, loss) in enumerate(zip(log.steps, log.loss)):
        if not math.isfinite(loss) or i >= n and abs(loss) >= threshold * max(abs(v) for v in log.loss[:n]):
            return step
    return None


# --------------------------------------------------------------------------------------------------
# Each detector as a score per record and its own threshold, so that each can be swept over that threshold
# (matched false-alarm rates): at its default threshold it fires where its rule above does (a test checks)

def logit_score(log):
    return list(log.logit)


def qk_score(log):
    return list(log.qk)


def self_calibrating_score(log, warmup=CALIBRATION_STEPS):
    """The max logit over the largest of the first `warmup` steps (nan before: it cannot fire there)."""
    n = records(warmup, log.interval)
    if len(log.logit) <= n:
        return [math.nan] * len(log.logit)
    ref = max(log.logit[:n])
    return [math.nan] * n + [v / ref if ref > 0 else math.inf for v in log.logit[n:]]


def olmo_core_score(log, window=128, min_history=64, signals=("loss", "grad_norm")):
    """The larger |x - mean| / sd of the loss and grad norm over the previous records (inf: not finite, or a
    change over a zero sd; nan before it starts)."""
    n, start = records(window, log.interval), records(max(20, min_history), log.interval)
    out = [math.nan] * len(log.steps)
    for i in range(start - 1, len(log.steps)):
        zs = []
        for values in (getattr(log, name) for name in signals):
            history = values[max(0, i - n):i]
            mean = sum(history) / len(history)
            sd = math.sqrt(sum((v - mean) ** 2 for v in history) / (len(history) - 1))
            deviation = abs(values[i] - mean)
            zs.append(math.inf if not math.isfinite(values[i]) else deviation / sd if sd > 0 else
                      math.inf if deviation > 0 else 0.0)
        out[i] = max(zs)
    return out


def lightning_score(log, window=10, warmup=1):
    """|loss - running mean| / |running mean| where the loss rose (-inf where it did not; inf: not finite)."""
    n, out = records(window, log.interval), [math.nan] * len(log.steps)
    for i in range(records(warmup, log.interval), len(log.steps)):
        loss, mean = log.loss[i], statistics.fmean(log.loss[max(0, i - n):i])
        out[i] = math.inf if not math.isfinite(loss) else -math.inf if not loss > log.loss[i - 1] else \
            abs(loss - mean) / abs(mean) if mean else math.inf
    return out


def llm_foundry_score(log, window=100, patience=4, max_loss_cap=10.0):
    """The smallest loss / window mean over the last patience + 1 steps' records (its streak), inf where the
    high-loss rule fires; nan before the window is full."""
    n, in_a_row = records(window, log.interval), records(patience + 1, log.interval)
    loss_cap = min(max_loss_cap, max(log.loss[:n], default=max_loss_cap))
    ratio = [math.nan] * len(log.steps)
    for i in range(n, len(log.steps)):
        mean = statistics.fmean(log.loss[i - n:i])
        # a mean of 0 makes every loss an outlier; a nan mean, none
        ratio[i] = log.loss[i] / mean if mean > 0 else math.inf if mean == 0 else math.nan
    out = [math.nan] * len(log.steps)
    for i in range(n, len(log.steps)):
        high = i >= 2 * n and sum(loss > loss_cap for loss in log.loss[i - n:i]) >= n / 2
        streak = ratio[i - in_a_row + 1:i + 1] if i - in_a_row + 1 >= n else []
        out[i] = math.inf if high else min(streak) if streak else math.nan
    return out


def megatron_score(log, samples=100):
    """|loss| over the largest |loss| of the first `samples` steps (inf: not finite, from the first
    record)."""
    n, out = records(samples, log.interval), []
    ref = max((abs(v) for v in log.loss[:n]), default=math.nan)
    for i, loss in enumerate(log.loss):
        ratio = abs(loss) / ref if i >= n and ref > 0 else math.nan
        out.append(math.inf if not math.isfinite(loss) else ratio)
    return out


def first_at(log, scores, threshold, strict):
    """The step of the first record whose score passes threshold (> if strict, else >=), or None."""
    passes = (lambda v: v > threshold) if strict else (lambda v: v >= threshold)
    return next((s for s, v in zip(log.steps, scores) if passes(v)), None)


class Detector(NamedTuple):
    name: str       # in the tables and the figure
    signal: str     # what it watches
    rule: str       # when it fires, as replayed on the records (interval 10)
    cite: str       # where its rule is documented
    first: object   # Log -> the step it first fires, or None
    purpose: str = ""          # what it is for, in one line
    score: object = None       # Log -> a score per record: it fires where the score passes its threshold
    threshold: float = 0.0     # its default threshold on that score
    strict: bool = True        # fires at score > threshold (else >=)
    knob: str = ""             # what its threshold is, in words


DETECTORS = [
    Detector("QK-Guard, max logit", "max attention logit", "over 200 (guard.DEFAULT_THRESHOLD)",
             "this repository, guard.py", qk_guard_max_logit,
             "switch QK-norm on, once, before the attention logits run away", logit_score,
             DEFAULT_THRESHOLD["max-logit"], True, "the max logit"),
    Detector("QK-Guard, sigma product", "sigma(W_q,h) sigma(W_k,h), max over heads",
             "over 50 (guard.DEFAULT_THRESHOLD)", "this repository, guard.py", qk_guard_sigma_product,
             "the same switch, read from the weights instead of the logits", qk_score,
             DEFAULT_THRESHOLD["sigma-product"], True, "the sigma product"),
    Detector("self-calibrating max logit", "max attention logit",
             "over 10x the largest of the first 100 steps (10 records); Megatron-LM's rule on the logit",
             "this module, fixed before scoring", self_calibrating_max_logit,
             "the max-logit switch with no threshold to set: each run's own first steps set it",
             self_calibrating_score, CALIBRATION_FACTOR, True,
             "the factor over the first 100 steps' largest"),
    Detector("OLMo-core SkipStepOptimizer", "loss, grad norm",
             "either more than 6 sd from the mean of the last 128 steps (13 records), from 64 steps (7 records)",
             "olmo_core.optim.SkipStepOptimizer", olmo_core_skip_step,
             "skip one optimizer step whose loss or grad norm is an outlier, then go on (not an alarm)",
             olmo_core_score, 6.0, True, "the sd factor"),
    Detector("Lightning SpikeDetection", "loss",
             "rising and >= 3x the mean of the last 10 steps (1 record): relative tolerance 2; or not finite",
             "lightning.fabric.utilities.spike.SpikeDetection", lightning_spike_detection,
             "stop training (raise) at a loss spike, to resume from a checkpoint", lightning_score, 2.0,
             False,
             "the relative tolerance"),
    Detector("llm-foundry KillLossSpike", "loss",
             ">= 2x the mean of the last 100 steps (10 records), 5 steps in a row (1 record); or, from 200 steps, "
             "half of them over the first 100 steps' largest (at most 10)", "llmfoundry.callbacks.KillLossSpike",
             llm_foundry_kill_loss_spike, "stop a run whose loss spikes persist, or stays high, to save "
                                          "compute",
             llm_foundry_score, 2.0, False, "the outlier multiplier"),
    Detector("Megatron-LM spiky loss", "loss",
             ">= 10x the largest of the first 100 steps (10 records); or not finite",
             "megatron.core.rerun_state_machine (is_unexpectedly_large)", megatron_spiky_loss,
             "flag a loss that may be silent data corruption, for a rerun on another machine", megatron_score,
             10.0, False, "the factor over the first 100 steps' largest"),
]


# --------------------------------------------------------------------------------------------------
# The runs scored: the unguarded ones, their runaway and collapse as lab.report's verdicts read them

ASSAY = "the assay source (coherent error at delta, dose 3)"
NO_ERROR = "no error"


class Subject(NamedTuple):
    name: str                # <study>/<arm>/seed<k>
    arch: str                # gpt2, llama
    source: str              # what drives it: the lr study's learning rate, an injected error's site, ...
    log: Log
    runaway: Optional[int]   # the first record with a max logit >= RUNAWAY_LOGIT, or None
    collapse: Optional[int]  # the collapse detector's first bad step (a record's), or None
    healthy: bool            # neither ran away nor collapsed (lab.report's lr_ran_away)
    flags: dict = {}         # its config.json's args (train.py's flags)
    rising: bool = False     # its max logit still rose at its end (lab.report's logit_rise over RISE_WINDOW)


def source_of(run):
    """The lr study's arms (named <arm>-lr<lr>) by learning rate; the others by their injected error."""
    args = run.config.get("args", {})
    if split_lr(run.group)[1] is not None:
        return f"lr study, lr {args['lr']:g}"
    if run.group.startswith("assay"):
        return ASSAY
    site = args.get("inject_site", "none")
    return NO_ERROR if site in (None, "none", "off") else f"injected error at {site}"


def subject(study, run):
    args = run.config["args"]
    qk = [max(p) if p else math.nan for p in run.qk_heads]
    log = Log(run.steps, run.loss, run.grad_norm, run.logit, qk, args["log_interval"])
    return Subject(f"{study}/{run.group}/{run.seed}", args.get("arch", "gpt2"), source_of(run), log,
                   run.first_past(RUNAWAY_LOGIT, inclusive=True), run.collapse_step, not lr_ran_away(run), args,
                   run.logit_rise(run.steps[-1], RISE_WINDOW)[1] if run.steps else False)


def studies(root):
    """root's studies: its subfolders that hold <arm>/seed<k>/ folders, and root itself where it holds some
    (a study; or loose runs beside study folders: all scored, with a warning, where once only they were)."""
    loose = sorted({os.path.basename(os.path.dirname(p))
                    for p in glob.glob(os.path.join(root, "*", "seed*"))})
    found = sorted(d for d in glob.glob(os.path.join(root, "*")) if glob.glob(os.path.join(d, "*", "seed*")))
    if not loose and not found:
        raise SystemExit(f"error: no runs under {root}: give a folder of <arm>/seed<k>/ runs, or of such folders")
    if loose and found:
        print(f"warning: {root} holds runs of its own ({', '.join(loose)}) beside study folders "
              f"({', '.join(os.path.basename(d) for d in found)}): scoring them all, the loose ones as study "
              f"{os.path.basename(os.path.normpath(root))}/; move them into a study folder", file=sys.stderr)
    return ([root] if loose else []) + found


def load(root):
    """(the unguarded runs as Subjects, the guarded runs as lab.report Runs keyed by study, the replays: the
    unguarded runs whose logged losses and max logits repeat, step for step, another's of their study and
    seed, as {replay's name: its original's}). One trajectory is scored once, so that a rerun (claim 5's probe
    again to log its gain) does not count its detections twice; its flags are not compared, as a flag added
    since (--threads) is recorded by the rerun alone."""
    subjects, guarded, replays, seen = [], {}, {}, {}
    for path in studies(root):
        study = os.path.basename(os.path.normpath(path))
        for runs in load_runs(path).values():
            for run in runs:
                if not run.config.get("args"):
                    print(f"warning: {run.path}: no config.json args; not scored", file=sys.stderr)
                    continue
                if run.config["args"].get("guard", "off") != "off":
                    guarded.setdefault(study, []).append(run)
                    continue
                one = subject(study, run)
                key = (study, run.seed, tuple(run.steps), tuple(run.loss), tuple(run.logit))
                if key in seen:
                    replays[one.name] = seen[key]
                else:
                    seen[key] = one.name
                    subjects.append(one)
    return subjects, guarded, replays


def twin_arm(arm):
    """The unguarded arm a guarded arm copies up to its trigger: the arm less -guard and its action."""
    return re.sub(r"-guard(-[a-z0-9.-]*?)??(?=-lr\d|$)", "", arm)


# The flags of the guard and of its actions: they change nothing before the trigger; any other differs a twin
GUARD_FLAGS = {"guard", "guard_signal", "guard_threshold", "guard_action", "guard_scope", "qkclip_tau",
               "lr_drop_factor", "clip_tight", "softcap_value", "out_dir", "resume"}


def same_but_guard(a, b):
    keys = (set(a) | set(b)) - GUARD_FLAGS
    return all(a.get(k) == b.get(k) for k in keys)


def check_twins(subjects, guarded):
    """(agreeing, compared, the names of those that disagree): the guard's recorded trigger (step resolution)
    lies in the interval where the max-logit replay first fires on its unguarded twin, or neither fires. A twin
    has the same flags but the guard's; a guarded run set to other steps (claim 6's long arms) has another
    lr schedule, so none."""
    by_name = {s.name: s for s in subjects}
    agree, compared, disagree = 0, 0, []
    for study, runs in sorted(guarded.items()):
        for run in runs:
            twin = by_name.get(f"{study}/{twin_arm(run.group)}/{run.seed}")
            if twin is None or not same_but_guard(run.config["args"], twin.flags):
                continue
            fired = qk_guard_max_logit(twin.log)
            same = fired is None and run.trigger is None or None not in (fired, run.trigger) and \
                fired - twin.log.interval < run.trigger <= fired
            compared, agree = compared + 1, agree + same
            if not same:
                disagree.append(f"{study}/{run.group}/{run.seed}")
    return agree, compared, disagree


# --------------------------------------------------------------------------------------------------
# Scores

class Score(NamedTuple):
    runs: int
    runaways: int
    runaway_leads: list      # steps from the first firing to the runaway, of each runaway it caught
    runaway_late: int        # runaways it missed but fired after
    collapses: int
    collapse_leads: list
    collapse_late: int
    healthy: int
    false_alarms: int        # healthy runs it fired on


def score(subjects, fired):
    """fired: subject name -> the step the detector first fired, or None. An event is caught where the
    detector fired at or before it (the same record: lead 0); a miss is one it had not fired by (late: it
    fired after)."""
    gaps = {"runaway": [], "collapse": []}     # event step - firing step, of each event it fired on
    for s in subjects:
        for kind, event in (("runaway", s.runaway), ("collapse", s.collapse)):
            if event is not None and fired[s.name] is not None:
                gaps[kind].append(event - fired[s.name])
    caught = {kind: [g for g in gs if g >= 0] for kind, gs in gaps.items()}
    late = {kind: len(gs) - len(caught[kind]) for kind, gs in gaps.items()}
    return Score(len(subjects), sum(s.runaway is not None for s in subjects), caught["runaway"], late["runaway"],
                 sum(s.collapse is not None for s in subjects), caught["collapse"], late["collapse"],
                 sum(s.healthy for s in subjects), sum(s.healthy and fired[s.name] is not None for s in subjects))


# --------------------------------------------------------------------------------------------------
# The collapse, the label no detector here watches, at matched false-alarm rates

HORIZON = 100   # steps: a firing counts for a collapse that follows it within this many (RISE_WINDOW)
FA_RATES = (0.01, 0.05, 0.10)


def negatives(subjects, kind):
    """The runs a firing on is a false alarm for the collapse label: "healthy" (neither collapsed nor ran
    away; a runaway that did not collapse is then neither a catch nor a false alarm), or "not collapsed" (all
    others)."""
    return [s for s in subjects if s.collapse is None and (kind == "not collapsed" or s.healthy)]


def peak(values):
    return max((v for v in values if not math.isnan(v)), default=-math.inf)


def threshold_at(scores, negs, rate):
    """The threshold on a detector's score (fires at score > it) that fires on at most `rate` of the
    negatives: the (floor(rate n) + 1)-th largest of their peaks."""
    peaks = sorted((peak(scores[s.name]) for s in negs), reverse=True)
    return peaks[min(len(peaks) - 1, math.floor(rate * len(peaks)))] if peaks else math.inf


class Matched(NamedTuple):
    threshold: float
    false_alarms: int     # negatives it fired on
    negatives: int
    within: int           # collapses whose run it first fired on within HORIZON steps before the collapse
    before: int           # ... at any step before (or in the collapse's record)
    collapses: int
    fired: int            # runs (collapsed or negative) it fired on
    precise: int          # of those, runs whose first firing a collapse followed within HORIZON steps


def matched(subjects, scores, negs, threshold, strict=True):
    """The collapse label at one threshold: the detector's first firing per run, as a one-shot trigger
    (QK-Guard latches; a first alarm that comes too early is not credited by a later one)."""
    pos = [s for s in subjects if s.collapse is not None]
    first = {s.name: first_at(s.log, scores[s.name], threshold, strict) for s in pos + negs}
    lead = lambda s: None if first[s.name] is None or s.collapse is None else s.collapse - first[s.name]
    fired = [s for s in pos + negs if first[s.name] is not None]
    return Matched(threshold, sum(first[s.name] is not None for s in negs), len(negs),
                   sum(lead(s) is not None and 0 <= lead(s) <= HORIZON for s in pos),
                   sum(lead(s) is not None and lead(s) >= 0 for s in pos), len(pos), len(fired),
                   sum(lead(s) is not None and 0 <= lead(s) <= HORIZON for s in fired))


def all_scores(subjects):
    return {d.name: {s.name: d.score(s.log) for s in subjects} for d in DETECTORS}


def matched_rows(subjects, scores, kind):
    """Per detector and false-alarm rate: its threshold there and the collapse label's counts."""
    negs, rows = negatives(subjects, kind), []
    for d in DETECTORS:
        for rate in FA_RATES:
            m = matched(subjects, scores[d.name], negs, threshold_at(scores[d.name], negs, rate))
            rows.append([d.name, f"{rate:.0%}", f"{m.threshold:.3g}", rate_words(m.false_alarms, m.negatives),
                         f"{m.within} / {m.collapses}", f"{m.before} / {m.collapses}",
                         rate_words(m.precise, m.fired)])
    return rows


def default_rows(subjects, scores, kind):
    negs = negatives(subjects, kind)
    out = []
    for d in DETECTORS:
        m = matched(subjects, scores[d.name], negs, d.threshold, d.strict)
        out.append([d.name, f"{d.threshold:g}", rate_words(m.false_alarms, m.negatives), f"{m.within} / "
                                                                                         f"{m.collapses}",
                    f"{m.before} / {m.collapses}", rate_words(m.precise, m.fired)])
    return out


def rate_words(k, n):
    return f"{k} / {n} ({100 * k / n:.0f}%)" if n else "-"


MATCHED_HEADER = ["detector", "false alarms allowed", "its threshold there", "false alarms",
                  f"collapses caught within {HORIZON} steps before", "caught at any step before",
                  f"precision: first firings a collapse followed within {HORIZON} steps"]


def leads_words(subjects, scores, kind="healthy"):
    """Where QK-Guard's trigger leads and where it does not, in numbers: the runaway label (by construction),
    the collapse at each matched false-alarm rate (its rank among the detectors) and at the defaults."""
    negs, trigger = negatives(subjects, kind), DETECTORS[0].name
    runaway = score(subjects, {s.name: qk_guard_max_logit(s.log) for s in subjects})
    parts = [f"Where QK-Guard's max-logit trigger leads: on the runaway, by construction (it caught "
             f"{len(runaway.runaway_leads)} of {runaway.runaways}, a median "
             f"{lead_words(runaway.runaway_leads)} steps "
             f"ahead; that lead is the time from {DEFAULT_THRESHOLD['max-logit']:g} to {RUNAWAY_LOGIT:g})."]
    for rate in FA_RATES:
        got = {d.name: matched(subjects, scores[d.name], negs, threshold_at(scores[d.name], negs, rate))
               for d in DETECTORS}
        mine = got[trigger]

        def most(key):   # how many detectors caught more than the trigger; the most caught, and by whom
            top = max(getattr(m, key) for m in got.values())
            ahead = sum(getattr(m, key) > getattr(mine, key) for m in got.values())
            who = " / ".join(n for n in got if getattr(got[n], key) == top)
            return f"{ahead} caught more; the most, {top}, by {who}"
        parts.append(f"On the collapse at {rate:.0%} false alarms (of the {len(negs)} {kind} runs): it "
                     f"caught {mine.within} of {mine.collapses} within {HORIZON} steps before "
                     f"({most('within')}) and {mine.before} at any step before ({most('before')}).")
    d0 = {d.name: matched(subjects, scores[d.name], negs, d.threshold, d.strict) for d in DETECTORS}
    fired_at = lambda rule, s: rule(s.log) if s.collapse is not None else None
    early = sum((f := fired_at(qk_guard_max_logit, s)) is not None and s.collapse - f > HORIZON
                for s in subjects)
    olmo_early = sum((f := fired_at(olmo_core_skip_step, s)) is not None and f <= 99 for s in subjects)
    parts.append(f"At the defaults its trigger fired before {d0[trigger].before} of {d0[trigger].collapses} "
                 f"collapses, {early} of them more than {HORIZON} steps before; OLMo-core's rule fired "
                 f"before {d0[DETECTORS[3].name].before}, {olmo_early} "
                 f"of them by step 99 (an early firing that \"fired at or before\" credits).")
    return " ".join(parts)


def lead_words(leads):
    return f"{statistics.median(leads):g} [{min(leads)}, {max(leads)}]" if leads else "-"


def caught_words(leads, late, events):
    missed = events - len(leads)
    return f"{len(leads)} / {missed}" + (f" ({late} late)" if late else "") if events else "-"


def rate(k, n):
    return f"{k} / {n} ({100 * k / n:.0f}%)" if n else "-"


HEADER = ["detector", "runs scored", "runaways caught / missed", "lead to runaway, median [range], steps",
          "collapses caught / missed", "lead to collapse, median [range], steps", "false alarms / healthy runs"]


def row(name, sc):
    return [name, str(sc.runs), caught_words(sc.runaway_leads, sc.runaway_late, sc.runaways),
            lead_words(sc.runaway_leads), caught_words(sc.collapse_leads, sc.collapse_late, sc.collapses),
            lead_words(sc.collapse_leads), rate(sc.false_alarms, sc.healthy)]


def table(header, rows):
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    return "\n".join(lines + ["| " + " | ".join(r) + " |" for r in rows])


def source_order(source):
    """The lr study by learning rate, then the injected errors by site, the assay source, no error."""
    lr = re.match(r"lr study, lr (\S+)$", source)
    return (0, float(lr.group(1)), "") if lr else (1, 0.0, source) if source.startswith("injected") else \
        (2, 0.0, source) if source == ASSAY else (3, 0.0, source)


# --------------------------------------------------------------------------------------------------
# The document and the figure

COMMAND = "python -m lab.detectors lab/results --markdown lab/DETECTORS.md --plot lab/plots/detectors.png"


def render(root, subjects, guarded, firings, plot=None, scores=None, command=COMMAND, replays=None):
    """The Markdown document: what is scored and how, then the tables: all runs, by architecture, by source;
    command: the one that wrote it; replays: load's, said and counted among the runs, scored once."""
    replays = replays or {}
    intervals = sorted({s.log.interval for s in subjects})
    runaways, collapses = sum(s.runaway is not None for s in subjects), sum(s.collapse is not None for s in subjects)
    agree, compared, disagree = check_twins(subjects, guarded)
    by_study = collections.Counter(s.name.split("/")[0] for s in subjects) + collections.Counter(
        name.split("/")[0] for name in replays)
    scores = scores or all_scores(subjects)
    out = [
        "# QK-Guard as a detector: lead time and false alarms beside the field's loss-spike detectors", "",
        f"Written by `{command}` from the committed run logs (lab/detectors.py says how each detector is "
        "replayed; lab/test_detectors.py tests each rule). The guard is a detector (the first crossing of a "
        "threshold) and an action; this scores the detector alone, on runs that none of these detectors acted on.", "",
        f"**Runs.** The {len(subjects) + len(replays)} unguarded runs under {root} ("
        + ", ".join(f"{n} in {study}/" for study, n in sorted(by_study.items()))
        + (f"; {len(replays)} of them log the same losses and max logits at every step as another run of their "
           f"study and seed, and are scored once: {replay_words(replays)}" if replays else "")
        + f"): of the {len(subjects)} scored, {runaways} ran away (a max logit >= {RUNAWAY_LOGIT:g}, lab.report's RUNAWAY_LOGIT), {collapses} "
        f"collapsed (lab.report's collapse step), {sum(s.healthy for s in subjects)} did neither within its steps "
        f"(healthy: one cut off while its logit still rose counts here). The {sum(map(len, guarded.values()))} "
        "guarded runs are not scored: their action changes them from their trigger on.", "",
        f"**Resolution.** Every scored run logs one record per {' or '.join(map(str, intervals))} updates: the "
        "interval's mean loss and max logit, the last update's grad norm and sigmas. Firings and events are known "
        "to the interval; a detection in the interval of the event counts as lead 0, and leads are multiples of "
        "the interval. The loss detectors' windows, in steps, are counted in records (ceil(steps / interval)).", "",
        "**Check of the replay.** A guarded run is its unguarded twin (same study, arm, seed and every flag but "
        f"the guard's) up to its trigger. In {agree} of {compared} guarded runs with a twin, the guard's own "
        "trigger (logged at step resolution) falls in the interval where the replayed max-logit trigger first "
        "fires on the twin, or neither fires"
        + (f"; not in {', '.join(disagree)}." if disagree else "."), "",
        "**Labels.** Two events are scored. The runaway (a max logit >= "
        f"{RUNAWAY_LOGIT:g}) is the max-logit trigger's own signal further up, so that trigger catches every "
        f"runaway "
        "by construction and its lead is the time from its threshold to the runaway's: that table is kept, "
        "apart "
        "and labelled so. The collapse (lab.report's collapse step: the smoothed loss held above its best by "
        "a "
        "margin) is read by none of these detectors; there each detector is swept over its own threshold and "
        "compared at matched false-alarm rates, first firing only (a one-shot trigger, as QK-Guard latches), "
        f"caught if it first fired within {HORIZON} steps before the collapse (or, the looser reading, at "
        "any step before), with the precision of those first firings. No paired outcome is used: the one "
        "these runs allow, a run's loss against its guarded twin's, differs only where the guard's own "
        "trigger fired.", "",
        "## The detectors", "",
        table(["detector", "what it is for", "watches", "fires when (records at interval 10)",
               "documented in"], [[d.name, d.purpose, d.signal, d.rule, d.cite] for d in DETECTORS]), "",
        "## The collapse, at matched false-alarm rates", "",
        leads_words(subjects, scores), "",
        f"A false alarm: a first firing on a healthy run (neither collapsed nor ran away; a runaway that did "
        f"not "
        f"collapse is neither a catch nor a false alarm here). Each detector's threshold is set, on its own "
        f"score, "
        f"to fire on at most that share of the {len(negatives(subjects, 'healthy'))} healthy runs; its first "
        f"firing "
        f"in a run counts. Precision: of the runs it first fired on, the share whose collapse followed "
        f"within {HORIZON} steps.", "",
        table(MATCHED_HEADER, matched_rows(subjects, scores, "healthy")), "",
        "At each detector's own default threshold, on the same label:", "",
        table(["detector", "default threshold", "false alarms (healthy runs)", f"collapses caught within "
               f"{HORIZON} steps before", "caught at any step before", f"precision within {HORIZON} steps"],
              default_rows(subjects, scores, "healthy")), "",
        f"The same with every run that did not collapse as a negative "
        f"({len(negatives(subjects, 'not collapsed'))} "
        "runs: a runaway without a collapse is then a false alarm):", "",
        table(MATCHED_HEADER, matched_rows(subjects, scores, "not collapsed")), "",
        "## The runaway (by construction for the max-logit trigger), and both events at the defaults", "",
        "Caught: fired at or before the event (a runaway: the first record with a max logit >= "
        f"{RUNAWAY_LOGIT:g}; a collapse: its first bad step); missed: not fired by then. A false alarm: it fired "
        "on a healthy run. Late: a missed event it fired after. Leads in steps (updates), median over the events "
        "it caught, [shortest, longest]. The max-logit trigger watches the signal a runaway is defined on: a max "
        f"logit that reached {RUNAWAY_LOGIT:g} passed {DEFAULT_THRESHOLD['max-logit']:g} at or before, so it "
        "catches every runaway by construction; its lead and its false alarms are the measure. \"At or "
        "before\" "
        "also credits an early firing however far ahead of the event: the section above does not.", "",
        "### All scored runs", "",
        table(HEADER, [row(d.name, score(subjects, firings[d.name])) for d in DETECTORS]), "",
        false_alarm_words(subjects, firings[DETECTORS[0].name]), "", olmo_words(subjects), "",
        "### By architecture", "",
    ]
    for arch in sorted({s.arch for s in subjects}):
        runs = [s for s in subjects if s.arch == arch]
        out += [f"{arch} ({len(runs)} runs):", "",
                table(HEADER, [row(d.name, score(runs, firings[d.name])) for d in DETECTORS]), ""]
    out += ["### By source", "",
            "What drives the run: the lr study's learning rate (both architectures, every state and fix), an "
            "injected error by its site (every dose and coherence, with and without its QK fix), the assay source "
            "(claims 5 and 6's runaway, with its probes), or nothing (the no-error arms).", ""]
    for source in sorted({s.source for s in subjects}, key=source_order):
        runs = [s for s in subjects if s.source == source]
        out += [f"{source} ({len(runs)} runs):", "",
                table(HEADER, [row(d.name, score(runs, firings[d.name])) for d in DETECTORS]), ""]
    if plot:
        out += ["## The figure", "", f"![left: collapses caught within {HORIZON} steps against the "
                                     f"false-alarm rate, "
                f"each detector swept over its threshold; right: runaways caught (by construction for the "
                f"max-logit "
                f"trigger) at the defaults]({plot})", ""]
    return "\n".join(out) + "\n"


def false_alarm_words(subjects, fired):
    """What the max-logit trigger's false alarms look like: how many runs were still on the way up."""
    alarms = [s for s in subjects if s.healthy and fired[s.name] is not None]
    if not alarms:
        return "The max-logit trigger fired on no healthy run."
    peaks = [max(s.log.logit) for s in alarms]
    return (f"The max-logit trigger's {len(alarms)} false alarms are runs whose max logit passed "
            f"{DEFAULT_THRESHOLD['max-logit']:g} but not {RUNAWAY_LOGIT:g} within their steps (peaks {min(peaks):g} to "
            f"{max(peaks):g}, median {statistics.median(peaks):g}); {sum(s.rising for s in alarms)} of them were still "
            f"rising at their end (the last {RISE_WINDOW} steps' max logit above the {RISE_WINDOW} before: "
            "lab.report's logit_rise), so some may be runaways cut short rather than healthy runs.")


def olmo_words(subjects):
    """Which of its two signals OLMo-core's rule first fired on."""
    first = {signal: [olmo_core_skip_step(s.log, signals=(signal,)) for s in subjects]
             for signal in ("loss", "grad_norm")}
    both = [min((f for f in pair if f is not None), default=None) for pair in zip(*first.values())]
    fired = [i for i, f in enumerate(both) if f is not None]
    by = {signal: sum(first[signal][i] == both[i] for i in fired) for signal in first}
    return (f"OLMo-core's rule fired on {len(fired)} runs: first on the grad norm in {by['grad_norm']}, on the loss "
            f"in {by['loss']} (both in the same record: counted in both).")


def collapse_curve(subjects, scores, negs):
    """(false-alarm %, collapses caught within HORIZON %) at every threshold between the negatives' peaks."""
    peaks = sorted({peak(scores[s.name]) for s in negs} | {math.inf}, reverse=True)
    points = []
    for threshold in peaks:
        m = matched(subjects, scores, negs, threshold)
        caught = 100 * m.within / m.collapses if m.collapses else math.nan
        points.append((100 * m.false_alarms / m.negatives, caught))
    return points


def draw(subjects, firings, path, scores=None):
    """Left: the collapse (no detector watches it), each detector swept over its own threshold: the share of
    the collapses its first firing caught within HORIZON steps before, against its false-alarm rate on healthy
    runs, its default marked. Right: the runaway at the defaults (by construction for the max-logit
    trigger): the share caught against the false-alarm rate. False if matplotlib is missing."""
    plt = _pyplot()
    if plt is None:
        return False
    scores = scores or all_scores(subjects)
    negs = negatives(subjects, "healthy")
    fig, (curve, caught) = plt.subplots(1, 2, figsize=(13, 5.5))
    handles, rates = [], []
    for d, marker in zip(DETECTORS, "osD^v<>"):
        xs, ys = zip(*collapse_curve(subjects, scores[d.name], negs))
        (h,) = curve.plot(xs, ys, "-", lw=1.3, label=d.name, drawstyle="steps-post")
        m = matched(subjects, scores[d.name], negs, d.threshold, d.strict)
        curve.plot([100 * m.false_alarms / max(1, m.negatives)], [100 * m.within / max(1, m.collapses)], marker,
                   color=h.get_color(), markersize=8, mec="k")
        handles.append(h)
        sc = score(subjects, firings[d.name])
        x = 100 * sc.false_alarms / sc.healthy if sc.healthy else math.nan
        rates.append(x)
        caught.plot([x], [100 * len(sc.runaway_leads) / sc.runaways if sc.runaways else math.nan], marker,
                    color=h.get_color(), markersize=9, mec="k", label=d.name)
    for rate in FA_RATES:
        curve.axvline(100 * rate, color="grey", ls=":", lw=0.8)
    curve.set(xlabel=f"false alarms: first firings on healthy runs (% of {len(negs)})", xlim=(-1, 40),
              ylim=(-3, 103),
              ylabel=f"collapses caught (% of {sum(s.collapse is not None for s in subjects)}): first "
                     f"firing\n"
                     f"within {HORIZON} steps before the collapse")
    curve.set_title("label: the collapse (lab.report's collapse step), read by no detector;\n"
                    "each line one detector's threshold swept, the marker its default; dotted: 1, 5, 10%",
                    fontsize=9)
    caught.set(xlabel="false alarms: healthy runs it fired on (% of the healthy runs)",
               xlim=(-2, max([40] + [r + 5 for r in rates if not math.isnan(r)])), ylim=(-3, 103),
               ylabel=f"runaways caught (% of the runaways):\nfired at or before max logit >= "
                      f"{RUNAWAY_LOGIT:g}")
    caught.set_title(f"label: the runaway, max logit >= {RUNAWAY_LOGIT:g}, each detector at its default;\nby "
                     f"construction the max-logit trigger (200) catches all", fontsize=9)
    for ax in (curve, caught):
        ax.grid(alpha=0.3)
    curve.legend(handles=handles, fontsize=8, loc="upper right", title="a line per detector",
                 title_fontsize=8)
    caught.legend(fontsize=8, loc="lower right", title="a marker per detector, at its default",
                  title_fontsize=8)
    fig.suptitle(f"{len(subjects)} unguarded runs replayed, one log record per {subjects[0].log.interval} "
                 f"steps")
    fig.tight_layout()
    os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
    save_figure(fig, path, dpi=100, metadata={"Software": None})
    plt.close(fig)
    return True


def scored(markdown):
    """{study: unguarded runs, "guarded": guarded runs} a document scored, from its **Runs.** paragraph;
    {} where there is no such file."""
    try:
        with open(markdown, errors="replace") as f:
            runs = next((line for line in f if line.startswith("**Runs.**")), "")
    except OSError:
        return {}
    counts = {study: int(n) for n, study in re.findall(r"(\d+) in (\S+?)/", runs.split("):", 1)[0])}
    guarded = re.search(r"The (\d+) guarded runs", runs)
    return {**counts, **({"guarded": int(guarded.group(1))} if guarded else {})}


def replay_words(replays):
    """{replay: original} as "<study>/<arm> (of <arm>, k seeds)", one entry per pair of arms."""
    pairs = collections.Counter((r.rsplit("/", 1)[0], o.split("/")[1]) for r, o in replays.items())
    return ", ".join(f"{arm}/ (of {original}, {n} seeds)" for (arm, original), n in sorted(pairs.items()))


def lost_runs(markdown, subjects, guarded, replays=None):
    """Why the document at `markdown` must not be replaced by one of these runs: the studies (and guarded
    runs) it scored more runs of; None if none."""
    new = {**(collections.Counter(s.name.split("/")[0] for s in subjects)
              + collections.Counter(name.split("/")[0] for name in replays or {})),
           "guarded": sum(map(len, guarded.values()))}
    fewer = [f"{study}{'' if study == 'guarded' else '/'}: {n} runs, here {new.get(study, 0)}"
             for study, n in scored(markdown).items() if new.get(study, 0) < n]
    return f"it scored runs this one lacks ({'; '.join(fewer)})" if fewer else None


def replay(subjects):
    """Detector name -> subject name -> the step it first fires, or None."""
    return {d.name: {s.name: d.first(s.log) for s in subjects} for d in DETECTORS}


def main(argv=None):
    ap = argparse.ArgumentParser(description="Replay QK-Guard's trigger and the field's loss-spike detectors on "
                                 "the committed runs: lead time, misses, false alarms.")
    ap.add_argument("root", help="a folder of <arm>/seed<k>/ runs, or of such folders (lab/results)")
    ap.add_argument("--markdown", help="write the document here (else it is printed)")
    ap.add_argument("--plot", help="write the figure (PNG) here")
    ap.add_argument("--force", action="store_true", help="--markdown: write it even if the document it "
                    "replaces scored more runs of some study")
    args = ap.parse_args(argv)
    for out in (args.markdown, args.plot):
        if out and os.path.isdir(out):
            raise SystemExit(f"error: {out} is a folder: give a file name")
    subjects, guarded, replays = load(args.root)
    if not subjects:
        raise SystemExit(f"error: no unguarded runs under {args.root}: only those are scored")
    refused = lost_runs(args.markdown, subjects, guarded, replays) if args.markdown and not args.force else None
    if refused:   # before anything is drawn or written: a subset of the runs (a typo in the root)
        raise SystemExit(f"error: --markdown {args.markdown}: {refused}: left as it is, and its figure; give "
                         f"the folder its opening line names, or pass --force to write it anyway")
    firings, scores = replay(subjects), all_scores(subjects)
    command = shlex.join(["python", "-m", "lab.detectors", args.root, *(["--markdown", args.markdown] if
                          args.markdown else []), *(["--plot", args.plot] if args.plot else [])])
    with written_together():   # the figure and the document, each whole, both or neither
        plot = None
        if args.plot and draw(subjects, firings, args.plot, scores):
            plot = os.path.relpath(args.plot, os.path.dirname(os.path.abspath(args.markdown)) if args.markdown
                                   else ".")
        text = render(args.root.rstrip("/") + "/", subjects, guarded, firings, plot, scores, command, replays)
        if args.markdown:
            os.makedirs(os.path.dirname(args.markdown) or ".", exist_ok=True)
            save_text(args.markdown, text)
    if args.markdown:
        print(f"wrote {args.markdown}" + (f" and {args.plot}" if plot else ""))
    else:
        print(text)


if __name__ == "__main__":
    main()
