"""
The bf16 softmax state's own error, in the units of the assay's doses: how far above the real fault a
dose of claims 3 and 4 sits.

    python -m lab.fault_size --preset lab --device cpu                       # the initial models of seeds 1..8
    python -m lab.fault_size --preset lab --device cpu --ckpt runs/x/ckpt.pt   # a trained model
    python -m lab.fault_size --preset lab --device cpu --out lab/results/lab/fault_size.json

A dose is an injected error's rms over the rms of the signal it joins (lab/assay.py). measure_fault runs
each layer's attention twice on the same q, k, v, with bf16 and with fp32 state, and gives the same ratio for
the fault itself: error_ratio = rms(O_bf16 - O_fp32) / rms(O_fp32), per layer and head, and bias_ratio, the
rms of its mean over tokens (the part that keeps its sign). So a dose d is d / error_ratio times the fault's
own error. lab.report prints the doses in these units when the sweep's folder holds fault_size.json.
Other flags are train.py's (the model, the data, --seed is replaced by --seeds).
"""
import argparse
import json
import os
import statistics
import sys

import torch

import model as model_lib
import run
from lab.assay import measure_fault
from lab.sweep import output_problem
from train import Batches, vocabulary


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
        model = model_lib.GPT(run.model_config(args))
        if ckpt:
            model.load_state_dict(torch.load(ckpt, map_location="cpu", weights_only=False)["model"])
        model.eval()
        with torch.no_grad():
            faults = [measure_fault(model, batches.get("train", step, 0)[0]) for step in range(batches_per_seed)]
        stats = {key: torch.stack([f[key] for f in faults]).mean(0) for key in ("error_ratio", "bias_ratio")}
        out.append({"seed": seed, **{f"{key}_{how}": float(fn(v.flatten())) for key, v in stats.items()
                                     for how, fn in (("median", torch.median), ("max", torch.max))}})
    return out


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], allow_abbrev=False)
    p.add_argument("--seeds", type=int, default=8, help="the initial models of seeds 1..N (train.py's --seed k)")
    p.add_argument("--ckpt", help="a train.py checkpoint to measure instead of the initial models")
    p.add_argument("--out", help="write the measurements as JSON here (lab.report reads <sweep>/fault_size.json)")
    ours, rest = p.parse_known_args(argv)
    if ours.seeds < 1:
        p.error("--seeds must be at least 1")
    if ours.out and output_problem(ours.out):   # before the measurement, not after it
        p.error(f"--out {ours.out}: {output_problem(ours.out)}")
    args, typed, parser = run.parse_args(rest)
    args.device = "cpu" if args.device == "auto" else args.device   # the CPU lab's measurement, unless told
    args = run.resolve(args, torch.device(args.device), parser)
    rows = measure(args, typed, range(1, ours.seeds + 1) if not ours.ckpt else [args.seed], ours.ckpt)
    summary = {key: statistics.median(r[key] for r in rows) for key in rows[0] if key != "seed"}
    print(f"{'seed':>6} {'error ratio median':>19} {'max':>9} {'bias ratio median':>18} {'max':>9}")
    for r in rows:
        print(f"{r['seed']:>6} {r['error_ratio_median']:>19.3g} {r['error_ratio_max']:>9.3g} "
              f"{r['bias_ratio_median']:>18.3g} {r['bias_ratio_max']:>9.3g}")
    if ours.out:
        os.makedirs(os.path.dirname(os.path.abspath(ours.out)), exist_ok=True)
        with open(ours.out, "w") as f:
            json.dump({"command": ["python", "-m", "lab.fault_size", *sys.argv[1:]] if argv is None else
                       ["python", "-m", "lab.fault_size", *argv], "ckpt": ours.ckpt, "per_seed": rows,
                       "median": summary}, f, indent=1)
        print(f"wrote {ours.out}")


if __name__ == "__main__":
    main()
