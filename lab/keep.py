"""Keep a sweep's finished runs as lab/results/ holds them: each run's config.json and its log, gzipped.

    python -m lab.keep runs/lab600 lab/results/lab --whole-seeds

A sweep's folder also holds checkpoints and stdout (hundreds of MB); the report needs only the config and
the log, so those are what gets committed. The gzip is written without a timestamp, so keeping the same
run twice gives the same bytes, and a kept run is never overwritten by a different one (the command
refuses, naming the file). Unfinished runs are left out and listed: the report counts a missing run
against its claim, so with --whole-seeds only the seeds that finished in every arm are kept.
"""

import argparse
import glob
import gzip
import io
import json
import os
import shutil
import sys
import zlib

from lab.sweep import not_a_folder, run_state

DONE = ("completed", "collapsed")
ROOT_FILES = ("fault_size.json",)   # a sweep root's own measurements the report reads beside the runs
KEPT_NAMES = ("config.json", "log.jsonl.gz", *ROOT_FILES)   # every file a keep writes


def runs_in(root):
    """{(arm, seed folder): its state} for every <root>/<arm>/seed<k>/."""
    found = {}
    for arm in sorted(os.listdir(root)):
        if os.path.isdir(os.path.join(root, arm)):
            for seed in sorted(os.listdir(os.path.join(root, arm))):
                if seed.startswith("seed") and os.path.isdir(os.path.join(root, arm, seed)):
                    found[arm, seed] = run_state(os.path.join(root, arm, seed))
    return found


def kept_bytes(run_dir):
    """{file name: bytes} as results/ keeps a run: config.json as it is, the log gzipped with mtime 0."""
    with open(os.path.join(run_dir, "config.json"), "rb") as f:
        config = f.read()
    plain = os.path.join(run_dir, "log.jsonl")
    if not os.path.exists(plain):                    # already kept once: copy the gzip as it is
        with open(plain + ".gz", "rb") as f:
            return {"config.json": config, "log.jsonl.gz": f.read()}
    buf = io.BytesIO()
    with open(plain, "rb") as f, gzip.GzipFile(fileobj=buf, mode="wb", mtime=0, filename="") as g:
        shutil.copyfileobj(f, g)
    return {"config.json": config, "log.jsonl.gz": buf.getvalue()}


def damaged(path, data):
    """Why a kept file cannot be read (a gzip cut short, a config that is not JSON), or None."""
    try:
        json.loads(gzip.decompress(data) if path.endswith(".gz") else data)
    except (OSError, EOFError, zlib.error) as e:   # BadGzipFile is an OSError
        return f"not a whole gzip: {e or type(e).__name__}"
    except ValueError as e:
        if path.endswith(".gz"):   # a log is JSON lines, not one JSON value: readable is enough
            return None
        return f"not JSON: {e}"
    return None


def readable_config(run_dir):
    try:
        with open(os.path.join(run_dir, "config.json")) as f:
            return isinstance(json.load(f), dict)
    except (OSError, ValueError):
        return False


def keep(src, dst, whole_seeds=False):
    """Copy src's finished runs into dst; returns (kept, left out with why). Refuses (SystemExit) before
    writing anything if a file already in dst differs from what it would write."""
    found = runs_in(src)
    arms = sorted({arm for arm, _ in found})
    unfinished_seeds = {seed for (arm, seed), state in found.items() if state not in DONE}
    if whole_seeds:   # a seed some arm has not run at all is not whole either
        seeds = {seed for _, seed in found}
        unfinished_seeds |= {seed for seed in seeds for arm in arms if (arm, seed) not in found}
    plan, left = {}, []
    for (arm, seed), state in sorted(found.items()):
        if state in DONE and not readable_config(os.path.join(src, arm, seed)):
            state = "config.json missing or not JSON"    # the report could not tell what the run was
        if state not in DONE:
            left.append(f"{arm}/{seed}: {state}")
        elif whole_seeds and seed in unfinished_seeds:
            left.append(f"{arm}/{seed}: finished, but {seed} is not finished in every arm")
        else:
            for name, data in kept_bytes(os.path.join(src, arm, seed)).items():
                plan[os.path.join(dst, arm, seed, name)] = data
    for name in ROOT_FILES:
        if os.path.exists(os.path.join(src, name)):
            with open(os.path.join(src, name), "rb") as f:
                plan[os.path.join(dst, name)] = f.read()
    for path, data in plan.items():   # every kept file is compared (config, log, fault size), not the log alone
        if os.path.isdir(path):
            sys.exit(f"error: {path} is a folder where a kept run's {os.path.basename(path)} goes: move it "
                     f"away (nothing was kept), and keep again")
        if os.path.exists(path):
            with open(path, "rb") as f:
                held = f.read()
            if held != data and damaged(path, held):
                sys.exit(f"error: {path} is damaged ({damaged(path, held)}), by an interrupted keep or copy perhaps: "
                         f"remove it (or restore it from git) and keep again")
            if held != data:
                sys.exit(f"error: {path} already holds another run's {os.path.basename(path)}; keep into a new "
                         f"folder, or remove that run's folder first")
    for leftover in glob.glob(os.path.join(glob.escape(dst), "**", "*.tmp"), recursive=True):
        if os.path.basename(leftover)[:-len(".tmp")] in KEPT_NAMES:   # an interrupted keep's own temp file
            os.remove(leftover)
    try:
        for path, data in plan.items():   # each file whole or not at all: a kill mid-keep leaves no half file
            os.makedirs(os.path.dirname(path), exist_ok=True)
            with open(path + ".tmp", "wb") as f:
                f.write(data)
            os.replace(path + ".tmp", path)
    except OSError as e:   # a full or read-only disk, a file where a folder goes
        sys.exit(f"error: cannot write {e.filename or path} ({e.strerror or e}): the files kept before it are whole; "
                 f"free the space or fix the path, and keep again")
    return sorted({os.path.dirname(p) for p in plan if p.endswith("log.jsonl.gz")}), left


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("src", help="a sweep's --out-root, e.g. runs/lab600")
    p.add_argument("dst", help="where results are kept, e.g. lab/results/lab")
    p.add_argument("--whole-seeds", action="store_true",
                   help="keep only the seeds that finished in every arm (a partial sweep's commit)")
    args = p.parse_args(argv)
    if not os.path.isdir(args.src):
        sys.exit(f"{args.src} is not a folder; pass a sweep's --out-root")
    if not_a_folder(args.dst):
        sys.exit(f"error: {args.dst}: {not_a_folder(args.dst)} is a file; pass the folder results are kept in, e.g. "
                 f"lab/results/lab")
    kept, left = keep(args.src, args.dst, args.whole_seeds)
    print(f"kept {len(kept)} runs in {args.dst}; left out {len(left)}" + "".join(f"\n  {w}" for w in left))


if __name__ == "__main__":
    main()
