"""
The run machinery that train.py needs and its reader can skip: processes, data on disk, the run
directory (config.json, log.jsonl, ckpt.pt, source.diff), exact resume, and stopping.

  Dist          one process, or one per GPU (or CPU worker) under torchrun
  start_run     a new run refuses a folder holding another; --resume takes the saved run's own flags
  save/load_checkpoint   atomic writes; weights_only=True loads (a checkpoint cannot run code)
  rng_state     every rank's RNG states, so a resumed run draws the same dropout masks
  RunDir        the start record, checkpoints and the way back, for the loop
  RunLog        log.jsonl for programs, one console line for people
  StopSignal    a first Ctrl-C (or SIGTERM) stops after the step with a checkpoint; a second at once
"""
import argparse
import json
import os
import platform
import random
import signal
import subprocess
import sys
import time

import numpy as np
import torch

import prepare_data
from config import RESUMABLE_CHANGES

CHECKPOINT_FORMAT = "qkguard-checkpoint-2"   # 2: tensors, numbers, strings, lists and dicts only
# Runs saved before the byte tokenizer existed trained on GPT-2's BPE, at its padded vocabulary.
OLD_RUN_VOCABULARY = {"tokenizer": "gpt2", "vocab_size": 50304}


class Dist:
    """Rank bookkeeping: one process, or one per GPU (or CPU worker) under torchrun."""

    def __init__(self, device_flag):
        self.world = int(os.environ.get("WORLD_SIZE", "1"))
        self.rank = int(os.environ.get("RANK", "0"))
        self.local_rank = int(os.environ.get("LOCAL_RANK", "0"))
        self.device = torch.device(device_name(device_flag, self.local_rank))
        if self.device.type == "cuda":
            torch.cuda.set_device(self.device)
        if self.world > 1:
            torch.distributed.init_process_group("nccl" if self.device.type == "cuda" else "gloo")
        self.master = self.rank == 0

    def all_reduce(self, tensor, op="avg"):
        """Reduced over ranks (avg, sum or max), so that every rank makes the same decisions."""
        if self.world > 1:
            tensor = tensor.clone()
            ops = torch.distributed.ReduceOp
            torch.distributed.all_reduce(tensor, op=ops.MAX if op == "max" else ops.SUM)
            if op == "avg":
                tensor /= self.world
        return tensor

    def any(self, flag):
        """True on every rank when true on one (a signal may reach the ranks at different steps)."""
        if self.world == 1:
            return bool(flag)
        return bool(self.all_reduce(torch.tensor(float(bool(flag)), device=self.device), "max"))

    def barrier(self):
        if self.world > 1:
            torch.distributed.barrier()

    def close(self):
        if self.world > 1:
            torch.distributed.destroy_process_group()


def tune_cpu_allocator():
    """Keep freed memory in the process (glibc malloc): past its mmap threshold glibc serves each
    large temporary with fresh pages, whose faults slowed the attention twin (lab/MEASUREMENTS.md).
    jemalloc and tcmalloc, which PyTorch's CPU guides recommend, do this by default."""
    try:
        import ctypes
        libc = ctypes.CDLL("libc.so.6")
    except OSError:   # not glibc (macOS, Windows, musl): nothing to tune
        return
    M_TRIM_THRESHOLD, M_TOP_PAD, M_MMAP_THRESHOLD = -1, -2, -3
    libc.mallopt(M_MMAP_THRESHOLD, 1 << 30)
    libc.mallopt(M_TRIM_THRESHOLD, 1 << 30)
    libc.mallopt(M_TOP_PAD, 64 << 20)


def device_name(flag, local_rank=0):
    """--device as a torch device name, or a one-line error saying what this machine has."""
    cuda = torch.cuda.is_available()
    if flag == "auto":
        return f"cuda:{local_rank}" if cuda else "cpu"
    if flag == "cpu":
        return flag
    if flag == "cuda" or flag.startswith("cuda:") and flag[5:].isdigit():
        index = local_rank if flag == "cuda" else int(flag[5:])
        if not cuda:
            raise SystemExit(f"error: --device {flag}: this machine has no CUDA GPU (or this torch build has no "
                             f"CUDA): use --device cpu or auto")
        if index >= torch.cuda.device_count():
            raise SystemExit(f"error: --device {flag}: this machine has {torch.cuda.device_count()} CUDA devices")
        return f"cuda:{index}"
    raise SystemExit(f"error: --device {flag!r}: give auto, cpu, cuda or cuda:N")


def ensure_data(args, dist):
    """Prepare the dataset on first use when prepare_data.py can make it (one process per node),
    into a folder that is new or empty: one that holds anything else is never written over."""
    if os.path.exists(os.path.join(args.data_dir, "meta.json")):
        return
    how = (f"`python prepare_data.py --dataset {args.dataset} --tokenizer {args.tokenizer} --out-dir "
           f"{args.data_dir}`")
    held = sorted(os.listdir(args.data_dir)) if os.path.isdir(args.data_dir) else []
    if held and prepare_data.REPLACING not in held:   # REPLACING: our own build crashed; prepare repairs it
        shown = ", ".join(held[:4]) + (", ..." if len(held) > 4 else "")
        raise SystemExit(f"error: {args.data_dir} has no meta.json but holds {shown}: it is left alone. Rebuild it "
                         f"with prepare_data.py and the dataset it holds (e.g. `python prepare_data.py --dataset "
                         f"text --input YOUR_FILES --tokenizer {args.tokenizer} --out-dir {args.data_dir}`), or "
                         f"give another --data-dir")
    if args.dataset not in ("pycode", "shakespeare"):
        raise SystemExit(f"error: no prepared data in {args.data_dir} (meta.json missing): run {how[:-1]} ...` "
                         f"first")
    if dist.local_rank == 0:
        print(f"no data in {args.data_dir}: preparing the {args.dataset} dataset, {args.tokenizer} tokens (once)")
        try:
            prepare_data.prepare(dataset=args.dataset, out_dir=args.data_dir, tokenizer=args.tokenizer)
        except prepare_data.DataError as e:
            raise SystemExit(f"error: {e.code}")
    dist.barrier()


def check_memory(args, device):
    """A rough bound on a CPU run's memory against what is free: an error, not hours of swapping.
    It counts one key block's attention scores per query row (the twin holds a few such tensors)
    and the activations the backward keeps. A GPU fails fast with its own out-of-memory error."""
    if device.type != "cpu" or not hasattr(os, "sysconf"):
        return
    try:
        free = os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (ValueError, OSError):
        return
    B, T, L, C = args.batch_size, args.block_size, args.n_layer, args.n_embd
    scores = 4 * 4 * B * args.n_head * T * min(T, args.block_n or 128)
    activations = 4 * 20 * B * T * L * C
    need = scores + activations
    if need > free:
        raise SystemExit(f"error: --block-size {T} with --batch-size {B} needs about {need / 2**30:.1f} GiB on this "
                         f"CPU, and {free / 2**30:.1f} GiB are free: lower --block-size or --batch-size")


# ----------------------------------------------------------------------------------------------------------------
# The run directory

def versions(device):
    """What config.json records to replay a run: software versions, the device, the git commit."""
    import triton
    commit = git("rev-parse", "HEAD") or None
    return {"python": platform.python_version(), "torch": torch.__version__, "triton": triton.__version__,
            "numpy": np.__version__, "device": str(device),
            # a CPU's sums follow its thread count: at the demo's lr, 1 and 2 threads end apart
            "torch_threads": torch.get_num_threads(),
            # ... and the machine: one seed with the same packages and threads differed in the loss's 6th
            # digit by step 9 in two sessions' machines (lab/MEASUREMENTS.md); the CPU and the vector kernels
            # torch picked for it say whether a replay can be bit for bit
            "cpu": cpu_name(), "cpu_capability": torch.backends.cpu.get_cpu_capability(),
            "gpu": torch.cuda.get_device_name(device) if device.type == "cuda" else None,
            "host": platform.node(), "git_commit": commit,
            "git_dirty": bool(git("status", "--porcelain")) if commit else None}


def cpu_name():
    """The CPU's model name (Linux's /proc/cpuinfo; elsewhere what platform says, or None)."""
    try:
        with open("/proc/cpuinfo") as f:
            return next((line.split(":", 1)[1].strip() for line in f if line.startswith("model name")), None)
    except OSError:
        return platform.processor() or None


def git(*cmd):
    try:
        return subprocess.run(["git", *cmd], capture_output=True, text=True, timeout=10,
                              cwd=os.path.dirname(os.path.abspath(__file__))).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return ""


def save_source(out_dir, run_versions):
    """An edited tree cannot be replayed from its commit: save `git diff` with the new files as
    source.diff (`git apply` it on that commit); without git, copy every .py file to source/."""
    here = os.path.dirname(os.path.abspath(__file__))
    if run_versions["git_commit"] is None:
        os.makedirs(os.path.join(out_dir, "source"), exist_ok=True)
        for name in sorted(os.listdir(here)):
            if name.endswith(".py"):
                with open(os.path.join(here, name), "rb") as src, \
                        open(os.path.join(out_dir, "source", name), "wb") as dst:
                    dst.write(src.read())
        return
    if not run_versions["git_dirty"]:
        return
    new = git("ls-files", "--others", "--exclude-standard").splitlines()
    patch = git("diff", "--binary", "HEAD") + "".join(
        "\n" + git("diff", "--binary", "--no-index", "/dev/null", path) for path in new)
    with open(os.path.join(out_dir, "source.diff"), "w") as f:
        f.write(patch.strip() + "\n")


def start_run(args, typed):
    """New run: refuse a folder that holds another. Resume: the saved flags, only safe changes; a
    run without a checkpoint starts over from step 0 with its config.json flags."""
    if os.path.exists(args.out_dir) and not os.path.isdir(args.out_dir):
        raise SystemExit(f"error: --out-dir {args.out_dir} is a file: give a folder")
    paths = {name: os.path.join(args.out_dir, name) for name in ("config.json", "log.jsonl", *CHECKPOINTS)}
    held = [p for p in paths.values() if os.path.exists(p)]
    checkpoints = [paths[name] for name in CHECKPOINTS if os.path.exists(paths[name])]
    if not args.resume:
        if held:
            how = "" if checkpoints else " (it saved no checkpoint: it starts over at step 0)"
            raise SystemExit(f"error: {args.out_dir} already holds a run ({', '.join(held)}): continue it with "
                             f"--resume{how}, or choose another --out-dir")
        return args, None, {}
    if checkpoints:
        state = newest_checkpoint(paths["ckpt.pt"])
        saved = state["args"]
    elif os.path.exists(paths["config.json"]):
        state = None
        saved = read_saved_args(paths["config.json"])
    else:
        raise SystemExit(f"error: --resume: {args.out_dir} holds no run (no ckpt.pt, no config.json): start a new "
                         f"run without --resume")
    saved = {**OLD_RUN_VOCABULARY, **saved}
    conflicts = [f"--{k.replace('_', '-')} {v} (saved: {saved.get(k)})" for k, v in typed.items()
                 if k not in RESUMABLE_CHANGES and k in saved and saved[k] != v
                 and not (k == "preset" and v == "auto")]
    if conflicts:
        raise SystemExit(f"error: --resume keeps the saved run's settings, but these differ: {'; '.join(conflicts)}."
                         f" Resume without them, or start a new run in another --out-dir")
    changed = {k: [saved.get(k), v] for k, v in typed.items()
               if k in RESUMABLE_CHANGES - {"resume"} and saved.get(k) != v}
    merged = {**vars(args), **saved, **{k: v for k, v in typed.items() if k in RESUMABLE_CHANGES}, "resume": True}
    if state is not None and state["step"] >= merged["max_steps"]:
        raise SystemExit(f"error: the run in {args.out_dir} already reached step {state['step']}: pass a "
                         f"--max-steps above it to train on")
    return argparse.Namespace(**merged), state, changed


class RunDir:
    """The run directory (--out-dir) as the loop sees it: start record, checkpoints, way back."""

    def __init__(self, args, dist, data):
        """data: prepare_data.TokenWindows.identity, the dataset the run trains on."""
        self.args, self.dist, self.data = args, dist, data
        self.data_hash = data["content_sha256"]
        self.ckpt = os.path.join(args.out_dir, "ckpt.pt")

    def start_log(self, params, step, resumed, changed):
        """log.jsonl with a start (or resume) record; a new run saves config.json, source.diff."""
        args, dist = self.args, self.dist
        if dist.master:
            os.makedirs(args.out_dir, exist_ok=True)
        log, run_versions = RunLog(os.path.join(args.out_dir, "log.jsonl"), dist.master), versions(dist.device)
        config_json = os.path.join(args.out_dir, "config.json")
        if dist.master and not resumed and not os.path.exists(config_json):
            with open(config_json, "w") as f:
                json.dump({"args": vars(args), "versions": run_versions, "command": sys.argv, "data": self.data,
                           "world_size": dist.world, "params": params,
                           "started": time.strftime("%Y-%m-%d %H:%M:%S %Z")}, f, indent=2)
            save_source(args.out_dir, run_versions)
        verb = "resuming" if args.resume else "starting"
        over = " (it had saved no checkpoint: starting over)" if args.resume and not resumed else ""
        log.write({"event": "resume" if args.resume else "start", "step": step, "from_checkpoint": resumed,
                   "versions": run_versions, "world_size": dist.world, "command": sys.argv, "changed": changed,
                   "data": self.data},
                  f"{verb} {args.out_dir} at step {step}{over}: {args.preset} preset, {args.arch} "
                  f"{args.n_layer}x{args.n_embd}, {params / 1e6:.2f}M params, {args.tokenizer} tokens, accum "
                  f"{args.accum}, guard {args.guard}, on {dist.device} x{dist.world}")
        return log

    def save(self, step, parts, totals):
        """ckpt.pt: all it takes to go on exactly; all ranks take part (RNG states are gathered)."""
        state = {"format": CHECKPOINT_FORMAT, "step": step, "args": vars(self.args),
                 **{name: part.state_dict() for name, part in parts.items() if part is not None},
                 **totals.state_dict(), "data_content_sha256": self.data_hash, "rng": rng_state(self.dist)}
        if self.dist.master:
            save_checkpoint(self.ckpt, state)

    def restore(self, state, parts, totals):
        """Load every part and the running totals from the checkpoint; returns its step."""
        if state.get("data_content_sha256") != self.data_hash:
            raise SystemExit(f"error: the data in {self.args.data_dir} is not the data this run started with "
                             f"(content hash {self.data_hash} != {state.get('data_content_sha256')}): resume with "
                             f"the original data, or start a new run")
        for name, part in parts.items():
            if part is not None:
                part.load_state_dict(state[name])
        totals.load_state_dict(state, self.dist.device)
        set_rng_state(state["rng"], self.dist)
        return state["step"]


def read_saved_args(path):
    try:
        with open(path) as f:
            return json.load(f)["args"]
    except (OSError, ValueError, KeyError) as e:
        raise SystemExit(f"error: cannot read the run's flags from {path} ({type(e).__name__}): start a new run "
                         f"in another --out-dir")


def save_checkpoint(path, state):
    """Temp file, fsync, old one to .prev, rename: a crash at any time leaves a whole checkpoint."""
    tmp = path + ".tmp"
    with open(tmp, "wb") as f:
        torch.save(state, f)
        f.flush()
        os.fsync(f.fileno())
    if os.path.exists(path):
        os.replace(path, path + ".prev")
    os.replace(tmp, path)


# A checkpoint and what save_checkpoint leaves beside it: a crash between its two renames leaves a
# whole ckpt.pt.tmp (the newest) and ckpt.pt.prev, and no ckpt.pt.
CHECKPOINTS = ("ckpt.pt", "ckpt.pt.tmp", "ckpt.pt.prev")


def newest_checkpoint(path):
    """The checkpoint to resume from: ckpt.pt; without it, the newest whole one that a crash inside
    save_checkpoint left (ckpt.pt.tmp, then ckpt.pt.prev). None loads: refuse, never start over."""
    if os.path.exists(path):
        return load_checkpoint(path)
    found = [path + suffix for suffix in (".tmp", ".prev") if os.path.exists(path + suffix)]
    for candidate in found:
        try:
            state = load_checkpoint(candidate)
        except SystemExit:
            continue
        print(f"{path} is missing (a crash while saving?): resuming from {candidate}", file=sys.stderr)
        return state
    raise SystemExit(f"error: {path} is missing and {' and '.join(found)} cannot be read (truncated?): the run "
                     f"cannot resume; start a new run in another --out-dir")


def load_checkpoint(path):
    """weights_only=True: tensors, numbers, strings, lists, dicts; a pickle running code fails."""
    try:
        state = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as e:  # a truncated zip, a foreign pickle: many exception types
        prev = path + ".prev"
        hint = f"; the previous checkpoint is {prev}: move it to {path} to resume from there" \
            if os.path.exists(prev) else ""
        why = (str(e).splitlines() or ["empty file" if os.path.getsize(path) == 0 else "no message"])[0][:200]
        raise SystemExit(f"error: cannot read checkpoint {path} ({type(e).__name__}: {why}): it is truncated, from "
                         f"an older train.py, or not a checkpoint{hint}")
    if not isinstance(state, dict) or state.get("format") != CHECKPOINT_FORMAT:
        old = isinstance(state, dict) and str(state.get("format", "")).startswith("qkguard-checkpoint")
        what = "an older checkpoint format" if old else "not a checkpoint written by this train.py"
        raise SystemExit(f"error: {path} is {what}: resume it with the train.py that wrote it, or start a new run")
    return state


class RunLog:
    """log.jsonl for programs (one JSON object a line, flushed) and a console line for people."""

    def __init__(self, path, enabled):
        self.file = open(path, "a") if enabled else None

    def write(self, record, line=None):
        if self.file is None:
            return
        self.file.write(json.dumps(record) + "\n")
        self.file.flush()
        if line:
            print(line, flush=True)


def rng_state(dist):
    """Every rank's RNG states (dropout differs per rank), as tensors and numbers."""
    version, internal, gauss = random.getstate()
    kind, keys, pos, has_gauss, cached = np.random.get_state()
    state = {"python": [version, list(internal), gauss], "numpy": [kind, torch.from_numpy(keys.astype(np.int64)),
                                                                   pos, has_gauss, cached],
             "torch": torch.get_rng_state(), "cuda": torch.cuda.get_rng_state_all() if torch.cuda.is_available() else None}
    if dist.world == 1:
        return [state]
    states = [None] * dist.world
    torch.distributed.all_gather_object(states, state)
    return states


def set_rng_state(states, dist):
    if len(states) != dist.world:   # the weights, optimizer and batches still resume exactly
        print(f"warning: the checkpoint holds the RNG states of {len(states)} processes and this run has "
              f"{dist.world}: dropout masks will differ from an uninterrupted run")
        return
    state = states[dist.rank]
    version, internal, gauss = state["python"]
    random.setstate((version, tuple(internal), gauss))
    kind, keys, pos, has_gauss, cached = state["numpy"]
    np.random.set_state((kind, keys.numpy().astype(np.uint32), pos, has_gauss, cached))
    torch.set_rng_state(state["torch"])
    if state["cuda"] is not None and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


class StopSignal:
    """SIGINT / SIGTERM: the first stops the loop after this step, with a checkpoint; a second
    ends the process at once. Saves are atomic, so `--resume` goes on from the last one."""

    def __init__(self):
        self.signum = None
        for sig in (signal.SIGINT, signal.SIGTERM):
            signal.signal(sig, self._handle)

    def _handle(self, signum, frame):
        self.signum = signum
        for sig in (signal.SIGINT, signal.SIGTERM):
            signal.signal(sig, signal.SIG_DFL)
        print(f"\n{signal.Signals(signum).name}: stopping after this step with a checkpoint; send it again to stop "
              f"at once", file=sys.stderr, flush=True)

    def __bool__(self):
        return self.signum is not None


def running_max(running, new):
    """The elementwise max so far, on the device (None before the first value)."""
    return new if running is None else torch.maximum(running, new)


def moved(x, device):
    """x on device; None stays None (the running maxima are None between intervals)."""
    return None if x is None else x.to(device)
