"""
The bf16 softmax state's own error, in the units of the assay's doses: how far above the real fault a
dose of claims 3 and 4 sits.

    python -m lab.fault_size --preset lab --device cpu                       # the initial models of seeds 1..8
    python -m lab.fault_size --preset lab --device cpu --ckpt runs/x/ckpt.pt   # a trained model
    python -m lab.fault_size --preset lab --device cpu --out lab/results/lab/fault_size.json
    python -m lab.fault_size --runs runs/stream --out lab/results/stream/fault_size.json   # each run's last checkpoint

A dose is an injected error's rms over the rms of the signal it joins (lab/assay.py). measure_fault runs
each layer's attention twice on the same q, k, v, with bf16 and with fp32 state, and gives the same ratio for
the fault itself: error_ratio = rms(O_bf16 - O_fp32) / rms(O_fp32), per layer and head, and bias_ratio, the
rms of its mean over tokens (the part that keeps its sign). So a dose d is d / error_ratio times the fault's
own error. lab.report prints the doses in these units when the sweep's folder holds fault_size.json.
tie_fraction is the share of (row, key block) pairs where the bf16 state's P holds two or more exact 1s,
the prior work's precondition (lab/assay.py). --runs measures the final checkpoint of every run under a
sweep's folder, each with its own config.json's flags, on the val batches every run evaluates.
Other flags are train.py's (the model, the data, --seed is replaced by --seeds).
"""
import argparse
import glob
import json
import os
import statistics
import sys

import torch

import model as model_lib
import run
from lab.assay import Assay, measure_fault
from lab.sweep import DONE, output_problem, run_state
from train import Batches, vocabulary


STATS = ("error_ratio", "bias_ratio", "tie_fraction")
ASSAY = Assay()   # the flags and model of lab.train_assay's runs (--qk-fix qknorm: QK-norm)


def summarize(stats):
    """{<stat>_median, <stat>_max} over layers and heads."""
    return {f"{key}_{how}": float(fn(v.flatten())) for key, v in stats.items()
            for how, fn in (("median", torch.median), ("max", torch.max))}


def measure_runs(root, batches=4):
    """Per run folder root/<arm>/seed<k> with a checkpoint: its final model's fault, on val batches 0..3."""
    out = []
    for ckpt in sorted(glob.glob(os.path.join(root, "*", "seed*", "ckpt.pt")), key=lambda p: (len(p), p)):
        folder = os.path.dirname(ckpt)
        if run_state(folder) not in DONE:   # a run still going (or stopped) has no final checkpoint yet
            print(f"{folder}: skipped, {run_state(folder)}", flush=True)
            continue
        state = torch.load(ckpt, map_location="cpu", weights_only=False)
        args, _, _ = run.parse_args([], ASSAY)
        vars(args).update(state["args"])
        args.device = "cpu"
        model = model_lib.GPT(ASSAY.model_config(args, run.model_config(args)))
        model.load_state_dict(state["model"])
        model.eval()
        val = Batches(args, torch.device("cpu"))
        with torch.no_grad():
            faults = [measure_fault(model, val.get("val", 0, i)[0]) for i in range(batches)]
        stats = {key: torch.stack([f[key] for f in faults]).mean(0) for key in STATS}
        out.append({"arm": os.path.basename(os.path.dirname(folder)), "seed": int(folder.rsplit("seed", 1)[1]),
                    "step": state.get("step"), **summarize(stats)})
        print(f"{folder}: step {state.get('step')}, " + ", ".join(f"{k} {v:.3g}" for k, v in out[-1].items()
                                                                    if k.endswith("_median")), flush=True)
    return out


def measure(args, typed, seeds, ckpt=None, batches_per_seed=4):
    """Per seed: the median and max over layers and heads of error_ratio and bias_ratio, each the mean
    over `batches_per_seed` training batches of that seed's first steps."""
    run.ensure_data(args, run.Dist(args.device))
    out = []
    for seed in seeds:
        args.seed = seed
        batches = Batches(args, torch.device(args.device))
        args.tokenizer, args.vocab_size = vocabulary(args, typed, batches.windows)
        torch.manual_seed(seed)    # train.py's initial weights for this seed
        model = model_lib.GPT(ASSAY.model_config(args, run.model_config(args)))
        if ckpt:
            model.load_state_dict(torch.load(ckpt, map_location="cpu", weights_only=False)["model"])
        model.eval()
        with torch.no_grad():
            faults = [measure_fault(model, batches.get("train", step, 0)[0]) for step in range(batches_per_seed)]
        stats = {key: torch.stack([f[key] for f in faults]).mean(0) for key in STATS}
        out.append({"seed": seed, **summarize(stats)})
    return out


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], allow_abbrev=False)
    p.add_argument("--seeds", type=int, default=8, help="the initial models of seeds 1..N (train.py's --seed k)")
    p.add_argument("--ckpt", help="a train.py checkpoint to measure instead of the initial models")
    p.add_argument("--runs", help="measure the last checkpoint of every run under this sweep folder instead")
    p.add_argument("--out", help="write the measurements as JSON here (lab.report reads <sweep>/fault_size.json)")
    ours, rest = p.parse_known_args(argv)
    if ours.seeds < 1:
        p.error("--seeds must be at least 1")
    if ours.out and output_problem(ours.out):   # before the measurement, not after it
        p.error(f"--out {ours.out}: {output_problem(ours.out)}")
    if ours.runs:
        if rest:
            p.error(f"--runs reads each run's own flags from its checkpoint: drop {' '.join(rest)}")
        rows = measure_runs(ours.runs)
        if not rows:
            p.error(f"--runs {ours.runs}: no <arm>/seed<k>/ckpt.pt under it")
        summary = {arm: {key: statistics.median(r[key] for r in rows if r["arm"] == arm) for key in rows[0]
                         if key.endswith("_median")} for arm in dict.fromkeys(r["arm"] for r in rows)}
        for arm, values in summary.items():
            print(f"{arm}: " + ", ".join(f"{k} {v:.3g}" for k, v in values.items()))
        write(ours.out, argv, ours.runs, rows, summary)
        return
    args, typed, parser = run.parse_args(rest, ASSAY)   # train.py's flags, as lab.train_assay reads them
    args.device = "cpu" if args.device == "auto" else args.device   # the CPU lab's measurement, unless told
    args = run.resolve(args, torch.device(args.device), parser, ASSAY)
    rows = measure(args, typed, range(1, ours.seeds + 1) if not ours.ckpt else [args.seed], ours.ckpt)
    summary = {key: statistics.median(r[key] for r in rows) for key in rows[0] if key != "seed"}
    print(f"{'seed':>6} {'error ratio median':>19} {'max':>9} {'bias ratio median':>18} {'max':>9}")
    for r in rows:
        print(f"{r['seed']:>6} {r['error_ratio_median']:>19.3g} {r['error_ratio_max']:>9.3g} "
              f"{r['bias_ratio_median']:>18.3g} {r['bias_ratio_max']:>9.3g}")
    write(ours.out, argv, ours.ckpt, rows, summary)


def write(out, argv, measured, rows, summary):
    if out:
        os.makedirs(os.path.dirname(os.path.abspath(out)), exist_ok=True)
        with open(out, "w") as f:
            json.dump({"command": ["python", "-m", "lab.fault_size", *(sys.argv[1:] if argv is None else argv)],
                       "ckpt": measured, "per_seed": rows, "median": summary}, f, indent=1)
        print(f"wrote {out}")


if __name__ == "__main__":
    main()
