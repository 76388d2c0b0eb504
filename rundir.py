"""
The run folder (--out-dir), which keeps a run's work safe: one writer at a time (a lock), what ran
(config.json, source.diff), every record (log.jsonl), checkpoints that a crash at any moment leaves
whole (ckpt.pt), and a resume from them that goes on bit for bit.
"""
import argparse
import atexit
import contextlib
import dataclasses
import json
import os
import platform
import random
import shutil
import signal
import subprocess
import sys
import time

import numpy as np
import torch

import prepare_data
import run

fcntl = prepare_data.fcntl   # None on Windows: no lock
HERE = os.path.dirname(os.path.abspath(__file__))   # the code a run records (git, source.diff)
HELD = {}   # this process's run folders -> their lock files
CHECKPOINT_FORMAT = "qkguard-checkpoint-3"   # tensors, numbers, strings, tuples, lists, dicts
# ckpt.pt, and what a crash inside RunDir.save can leave instead (newest_checkpoint reads them)
CHECKPOINTS = ("ckpt.pt", "ckpt.pt.tmp", "ckpt.pt.prev")
MODEL_SHAPE = ("arch", "n_layer", "n_head", "n_embd", "vocab_size")   # a checkpoint's and config's


def start_run(args, typed, defaults, master=True):
    """New run: lock the folder, refuse one that holds another. Resume: (the saved flags with only
    the changes that keep it the same run, its newest checkpoint or None, the flags it changed); a
    run that saved no checkpoint starts over from step 0 with its config.json flags. defaults: each
    flag's default, what a run saved without that flag (an extension's, a newer one's) ran with."""
    out = args.out_dir
    paths = {name: os.path.join(out, name) for name in ("config.json", "log.jsonl", *CHECKPOINTS)}
    if os.path.exists(out) and not os.path.isdir(out):
        raise SystemExit(f"error: --out-dir {out} is a file: give a folder")
    if os.path.exists(paths["log.jsonl"] + ".gz") and not os.path.exists(paths["log.jsonl"]):
        raise SystemExit(f"error: {out} holds a kept result (log.jsonl.gz): give another --out-dir")
    if master:
        claim(out)
        clear_failed_start(paths)
    held = [p for p in paths.values() if os.path.exists(p)]
    checkpoints = [paths[name] for name in CHECKPOINTS if os.path.exists(paths[name])]
    if not checkpoints and not os.path.exists(paths["config.json"]) and (held or args.resume):
        what = "move its log.jsonl away to start over there, or give another --out-dir" if held \
            else "drop --resume"
        raise SystemExit(f"error: {out} holds no run to resume (no config.json, no checkpoint): "
                         f"{what}")
    if not args.resume:
        if held:
            how = "" if checkpoints else " (it saved no checkpoint: it starts over at step 0)"
            raise SystemExit(f"error: {out} already holds a run ({', '.join(held)}): continue "
                             f"it with --resume{how}, or choose another --out-dir")
        return args, None, {}
    state = newest_checkpoint(paths["ckpt.pt"]) if checkpoints else None
    config = read_saved_args(paths["config.json"]) if os.path.exists(paths["config.json"]) else None
    saved = state["args"] if state else config
    differ = [f"{k} {saved.get(k)} vs {config.get(k)}" for k in MODEL_SHAPE
              if config is not None and config.get(k) != saved.get(k)]
    if differ:
        raise SystemExit(f"error: the checkpoint and config.json in {out} disagree "
                         f"({', '.join(differ)}): resume a folder whose files are one run's")
    # the default data folder of the checkout it ran in is this checkout's (unless --data-dir)
    here = prepare_data.default_out_dir(saved["dataset"], saved["tokenizer"])
    if os.path.normpath(saved["data_dir"]).split(os.sep)[-2:] == here.split(os.sep)[-2:]:
        saved = {**saved, "data_dir": typed.get("data_dir", here)}
    used = [f"--{k.replace('_', '-')} {saved[k]}" for k, unused in run.ASSAY_UNUSED.items()
            if k not in vars(args) and saved.get(k, unused) != unused]
    if used:   # the lab's assay, which train.py does not have: its own command goes on
        raise SystemExit(f"error: this run used the lab's assay ({', '.join(used)}): resume it "
                         f"with `{run.ASSAY_COMMAND} --resume --out-dir {out}`")
    saved = {**defaults, **saved}   # a typed --qk-fix must not slip into a run made without it
    free = run.RESUMABLE_CHANGES
    conflicts = [f"--{k.replace('_', '-')} {v} (saved: {saved.get(k)})" for k, v in typed.items()
                 if k in saved and saved[k] != v and k not in free and (k, v) != ("preset", "auto")]
    if conflicts:
        raise SystemExit(f"error: --resume keeps the saved flags, but these differ: "
                         f"{'; '.join(conflicts)}: drop them, or start a new run in another "
                         f"--out-dir")
    changed = {k: [saved.get(k), v] for k, v in typed.items()
               if k in free - {"resume"} and saved.get(k) != v}
    kept = {k: v for k, v in typed.items() if k in free}
    args = argparse.Namespace(**{**vars(args), **saved, **kept, "resume": True})
    # at max_steps without an end record (killed as it ended), it goes on to write that record
    if state and (state["step"] > args.max_steps or state["step"] == args.max_steps and ended(out)):
        raise SystemExit(f"error: the run already reached step {state['step']}: give a larger "
                         f"--max-steps")
    return args, state, changed


def ended(out_dir):
    """Whether the log's last start, resume or end record is a completed or collapsed end."""
    status = None
    with contextlib.suppress(OSError), open(os.path.join(out_dir, "log.jsonl"), "rb") as f:
        for line in f:
            with contextlib.suppress(ValueError):   # a line cut short
                record = json.loads(line)
                if isinstance(record, dict) and record.get("event") in ("start", "resume", "end"):
                    status = record.get("status")
    return status in ("completed", "collapsed")


def read_saved_args(path):
    try:
        with open(path) as f:
            return json.load(f)["args"]
    except (OSError, ValueError, KeyError) as e:
        raise SystemExit(f"error: cannot read the run's flags from {path} ({type(e).__name__}): "
                         f"start a new run")


def newest_checkpoint(path):
    """The checkpoint to resume from: ckpt.pt; without it, the newest whole one that a crash inside
    RunDir.save left (ckpt.pt.tmp, then ckpt.pt.prev). None loads: refuse, never start over."""
    if os.path.exists(path):
        return load_checkpoint(path)
    found = [path + suffix for suffix in (".tmp", ".prev") if os.path.exists(path + suffix)]
    for candidate in found:
        with contextlib.suppress(SystemExit):
            state = load_checkpoint(candidate)
            print(f"{path} is missing (a crash while saving?): resuming from {candidate}",
                  file=sys.stderr)
            return state
    raise SystemExit(f"error: {path} is missing and {' and '.join(found)} cannot be read: the run "
                     f"cannot resume; start a new run in another --out-dir")


def clear_failed_start(paths):
    """Empty files and nothing else (an older train.py's first write on a full disk left a 0-byte
    config.json): they hold no run, so they are removed rather than block every start."""
    held = [p for p in paths.values() if os.path.exists(p)]
    if held and all(os.path.getsize(p) == 0 for p in held) and os.path.exists(paths["config.json"]):
        for p in held:
            os.remove(p)
        print(f"removed {', '.join(held)}: empty, left by a first write that failed", file=sys.stderr)


def load_checkpoint(path):
    """weights_only=True: tensors, numbers, strings, lists, dicts; a pickle running code fails."""
    try:
        state = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as e:   # a truncated zip, a foreign pickle: many exception types
        why = (str(e).splitlines() or ["empty file" if not os.path.getsize(path) else "?"])[0]
        hint = f"; the previous checkpoint is {path}.prev: move it to {path} to resume from there" \
            if os.path.exists(path + ".prev") else ""
        raise SystemExit(f"error: cannot read checkpoint {path} ({type(e).__name__}: {why[:200]}): "
                         f"it is truncated, from an older train.py, or not a checkpoint{hint}")
    if not isinstance(state, dict) or state.get("format") != CHECKPOINT_FORMAT:
        raise SystemExit(f"error: {path} is not a checkpoint written by this train.py: use the one "
                         f"that wrote it")
    return state


def claim(out_dir):
    """One writer: a lock on <out_dir>/.lock naming its pid, held till the process ends (kill -9
    too). A folder it made and left holding only the lock (a refusal, Ctrl-C) goes as it ends."""
    made, held = not os.path.isdir(out_dir), HELD.pop(os.path.realpath(out_dir), None)
    if held is not None:   # this process's earlier run of the folder (then a resume, one process)
        held.close()
    with writing(out_dir):
        os.makedirs(out_dir, exist_ok=True)
        lock = HELD[os.path.realpath(out_dir)] = open(os.path.join(out_dir, ".lock"), "a+")
    if made:
        atexit.register(remove_if_only_the_lock, out_dir)
    try:
        if fcntl is not None:
            fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        holder = open(lock.name).read().strip() or "?"
        raise SystemExit(f"error: {out_dir} is in use by process {holder} (a run writing it): wait "
                         f"for it to end or stop it, or give another --out-dir") from None
    except OSError as e:   # ENOLCK: a file system without locks (some NFS mounts)
        raise SystemExit(f"error: cannot lock {out_dir} ({e.strerror}): one writer per run folder "
                         f"needs flock: give an --out-dir on a local disk") from None
    lock.truncate(0)
    print(os.getpid(), file=lock, flush=True)


def remove_if_only_the_lock(out_dir):
    if os.path.isdir(out_dir) and set(os.listdir(out_dir)) <= {".lock"}:
        shutil.rmtree(out_dir)


@contextlib.contextmanager
def writing(path, what="give an --out-dir on a writable disk with free space"):
    try:   # an OSError (a full or read-only disk, a folder under a file): one line naming the path
        yield
    except OSError as e:
        raise SystemExit(f"error: cannot write {path} ({e.strerror or e}): {what}") from None


def say(line, file=None):
    """print, flushed; on a terminal that closed (SIGHUP: every write to it fails with EIO) the line
    is dropped, so that the run still reaches its checkpoint (the log holds every record)."""
    with contextlib.suppress(OSError):
        print(line, file=file or sys.stdout, flush=True)


def git(*cmd):
    with contextlib.suppress(OSError, subprocess.SubprocessError):
        return subprocess.run(["git", *cmd], capture_output=True, text=True, timeout=10,
                              cwd=HERE).stdout.strip()
    return ""


def versions(device):
    """What config.json records to replay a run: versions, the device, the git commit. A CPU's
    sums follow its threads and the machine (lab/MEASUREMENTS.md): is a replay bit for bit?"""
    import triton
    commit, cpu = git("rev-parse", "HEAD") or None, platform.processor() or None
    with contextlib.suppress(OSError), open("/proc/cpuinfo") as f:   # Linux's name for it
        cpu = next((line.split(":", 1)[1].strip() for line in f if line.startswith("model name")),
                   cpu)
    return {"python": platform.python_version(), "torch": torch.__version__,
            "triton": triton.__version__, "numpy": np.__version__, "device": str(device),
            "host": platform.node(), "git_commit": commit,
            "git_dirty": bool(git("status", "--porcelain")) if commit else None,
            "gpu": torch.cuda.get_device_name(device) if device.type == "cuda" else None,
            "torch_threads": torch.get_num_threads(), "cpu": cpu,
            "cpu_capability": torch.backends.cpu.get_cpu_capability()}


class RunDir:
    """The run folder as train.py's loop sees it: its log, its checkpoints, the way back to them."""

    def __init__(self, args, dist, data):   # data: TokenWindows.identity, what the run trains on
        self.args, self.dist, self.data = args, dist, data
        self.ckpt = os.path.join(args.out_dir, "ckpt.pt")

    def start_log(self, params, step, resumed, changed):
        """Open log.jsonl with a start (or resume) record. A new run first saves source.diff and
        config.json, whole or absent: it says a run began here; a full disk undoes them both."""
        args, dist, path = self.args, self.dist, lambda name: os.path.join(self.args.out_dir, name)
        run_versions, blocks = versions(dist.device), run.key_blocks_per_row(args)
        new = dist.master and not resumed and not os.path.exists(path("config.json"))
        try:
            with writing(args.out_dir):
                if new and run_versions["git_dirty"]:
                    with open(path("source.diff"), "w") as f:
                        f.write(source_diff())
                if new:
                    with open(path("config.json.tmp"), "w") as f:
                        json.dump({"args": vars(args), "versions": run_versions,
                                   "command": sys.argv, "data": self.data, "world_size": dist.world,
                                   "params": params, "key_blocks_per_row": blocks,
                                   "started": time.strftime("%Y-%m-%d %H:%M:%S %Z")}, f, indent=2)
                    os.replace(path("config.json.tmp"), path("config.json"))
                self.file = open(path("log.jsonl"), "ab+") if dist.master else None
                if self.file is not None and not ends_a_line(self.file):   # cut short (kill -9, a
                    self.file.write(b"\n")                                # full disk): a fresh line
            verb = "resuming" if args.resume else "starting"
            over = " (it had saved no checkpoint: starting over)" if args.resume and not resumed \
                else ""
            self.write({"event": "resume" if args.resume else "start", "step": step,
                        "from_checkpoint": resumed, "versions": run_versions,
                        "world_size": dist.world, "command": sys.argv, "changed": changed,
                        "data": self.data, "key_blocks_per_row": blocks},
                       f"{verb} {args.out_dir} at step {step}{over}: {args.preset} preset, "
                       f"{args.arch} {args.n_layer}x{args.n_embd}, {params / 1e6:.2f}M params, "
                       f"{args.tokenizer} tokens, accum {args.accum} with {blocks} key blocks per "
                       f"row (block {run.key_block(args)} of {args.block_size}), "
                       f"guard {args.guard}, on {dist.device} x{dist.world}")
        except SystemExit:
            undone = ("config.json", "config.json.tmp", "log.jsonl", "source.diff") if new else ()
            for name in undone:
                with contextlib.suppress(OSError):
                    os.remove(path(name))
            raise
        return self

    def write(self, record, line=None):
        """A record in log.jsonl for programs (a JSON object a line, flushed); a line for people."""
        if self.file is None:
            return
        with writing(self.file.name):
            self.file.write((json.dumps(record) + "\n").encode())
            self.file.flush()
        if line:
            say(line)

    def save(self, step, parts):
        """ckpt.pt: all it takes to go on exactly; all ranks take part (RNG states are gathered).
        Temp file, fsync, old one to .prev, rename: a crash at any time leaves a whole one."""
        state = {"format": CHECKPOINT_FORMAT, "step": step, "args": vars(self.args),
                 "model_config": dataclasses.asdict(parts["model"].config),   # sample.py's model
                 **{name: part.state_dict() for name, part in parts.items() if part is not None},
                 "data_content_sha256": self.data["content_sha256"], "rng": rng_state(self.dist)}
        if self.dist.master:
            kept = "the previous checkpoint is kept: make room, then --resume"
            with writing(self.ckpt + ".tmp", kept), open(self.ckpt + ".tmp", "wb") as f:
                torch.save(state, f)
                f.flush()
                os.fsync(f.fileno())
            if os.path.exists(self.ckpt):
                os.replace(self.ckpt, self.ckpt + ".prev")
            os.replace(self.ckpt + ".tmp", self.ckpt)

    def restore(self, state, parts):
        """Every part as the checkpoint left it, on the data it started with; returns its step."""
        if state.get("data_content_sha256") != self.data["content_sha256"]:
            raise SystemExit(f"error: {self.args.data_dir} is not the data this run started with "
                             f"(content hash {self.data['content_sha256']:.12} != "
                             f"{state.get('data_content_sha256')!s:.12}): resume on the original "
                             f"data")
        for name, part in parts.items():
            if part is not None:
                part.load_state_dict(state[name])
        set_rng_state(state["rng"], self.dist)
        return state["step"]


def source_diff():
    """An edited tree as `git diff`, new files too: `git apply` it on the commit config names."""
    new = git("ls-files", "--others", "--exclude-standard").splitlines()
    diffs = [git("diff", "--binary", "HEAD")] + [git("diff", "--binary", "--no-index", "/dev/null",
                                                     name) for name in new]
    return "\n".join(diffs).strip() + "\n"


def ends_a_line(file):
    """Whether a file open for appending is empty or ends with a newline."""
    size = file.seek(0, os.SEEK_END)
    file.seek(max(size - 1, 0))
    return size == 0 or file.read(1) == b"\n"


def rng_state(dist):
    """Every rank's RNG states (dropout differs per rank), as tensors and numbers."""
    kind, keys, pos, has_gauss, cached = np.random.get_state()
    cuda = torch.cuda.get_rng_state_all() if torch.cuda.is_available() else None
    state = {"python": random.getstate(), "torch": torch.get_rng_state(), "cuda": cuda,
             "numpy": [kind, torch.from_numpy(keys.astype(np.int64)), pos, has_gauss, cached]}
    states = [state] * dist.world
    if dist.world > 1:
        torch.distributed.all_gather_object(states, state)
    return states


def set_rng_state(states, dist):
    if len(states) != dist.world:   # the weights, optimizer and batches still resume exactly
        print(f"warning: the checkpoint holds {len(states)} processes' RNG states, not "
              f"{dist.world}: dropout differs")
        return
    state = states[dist.rank]
    random.setstate(state["python"])
    kind, keys, pos, has_gauss, cached = state["numpy"]
    np.random.set_state((kind, keys.numpy().astype(np.uint32), pos, has_gauss, cached))
    torch.set_rng_state(state["torch"])
    if state["cuda"] is not None and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


class StopSignal:
    """Ctrl-C, kill, a terminal that closed (SIGINT, SIGTERM, SIGHUP): the first stops the loop
    after this step, with a checkpoint; a second ends the process at once (saves are atomic)."""
    SIGNALS = [signal.SIGINT, signal.SIGTERM] + [s for s in [getattr(signal, "SIGHUP", None)] if s]

    def __init__(self):
        self.signum = None
        for sig in self.SIGNALS:
            signal.signal(sig, self._handle)

    def _handle(self, signum, frame):
        self.signum = signum
        for sig in self.SIGNALS:
            signal.signal(sig, signal.SIG_DFL)
        say(f"\n{signal.Signals(signum).name}: stopping after this step with a checkpoint; send it "
            f"again to stop at once", file=sys.stderr)

    def __bool__(self):
        return self.signum is not None
