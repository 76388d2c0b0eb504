"""
Train a GPT and watch (or guard) the query-key channel.

    python train.py                                  # the default run: CPU preset on a CPU, assay preset on a GPU
    python train.py --accum bf16 --guard on          # the bf16 streaming-softmax fault, with QK-Guard watching
    python train.py --accum bf16 --guard off         # ... and without: watch it collapse (GPU preset)
    torchrun --nproc_per_node=8 train.py --preset gpt2 --accum bf16 --guard on

Every choice is a flag (`python train.py --help`). A run directory (--out-dir) holds config.json (the resolved
flags and the software/hardware versions), log.jsonl (one record per logged step, eval, guard or collapse event,
and a final record saying how the run ended) and ckpt.pt (everything needed to resume exactly).
"""
import argparse
import contextlib
import json
import math
import os
import platform
import random
import signal
import subprocess
import sys
import time

import numpy as np
import torch

import model as model_lib
import prepare_data
from assay import (INJECT_SITES, PROBE_MODES, ErrorInjector, Probe, check_assay_flags, clean_qk_grads, qk_weights)
from guard import ACTIONS, DEFAULT_THRESHOLD, SCOPES, SIGNALS, CollapseDetector, QKGuard, SpectralMonitor
from attention_kernel import ACCUM_MODES, ROUNDING_SOURCES, attention

# Training defaults per preset; any flag given on the command line wins. "auto" picks "cpu" or "assay".
PRESETS = {
    "cpu": dict(size="cpu", batch_size=8, grad_accum=1, max_steps=100, lr=3e-3, min_lr=3e-4, warmup_steps=10,
                schedule="cosine", log_interval=10, eval_interval=50, eval_iters=4, ckpt_interval=50),
    "assay": dict(size="assay", batch_size=32, grad_accum=1, max_steps=2000, lr=2e-3, min_lr=2e-3,
                  warmup_steps=200, schedule="constant", log_interval=10, eval_interval=250, eval_iters=20,
                  ckpt_interval=500),
    "gpt2": dict(size="gpt2", batch_size=16, grad_accum=32, max_steps=60000, lr=1e-3, min_lr=1e-4,
                 warmup_steps=2000, schedule="cosine", log_interval=10, eval_interval=1000, eval_iters=50,
                 ckpt_interval=1000),
    "gpt2-medium": dict(size="gpt2-medium", batch_size=8, grad_accum=64, max_steps=60000, lr=6e-4,
                        min_lr=6e-5, warmup_steps=2000, schedule="cosine", log_interval=10, eval_interval=1000,
                        eval_iters=50, ckpt_interval=1000),
}
PRESET_KEYS = {key for values in (*PRESETS.values(), *model_lib.MODEL_SIZES.values()) for key in values}
# Flags that may change when a run is resumed; any other difference from the saved run is an error.
RESUMABLE_CHANGES = {"max_steps", "log_interval", "eval_interval", "eval_iters", "ckpt_interval", "compile",
                     "on_collapse", "resume", "device", "out_dir"}
QK_FIXES = ("off", "clean-grad", "qknorm")


def build_parser(suppress_defaults=False):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter,
                                argument_default=argparse.SUPPRESS if suppress_defaults else None)

    def add(group, *flags, **kw):
        if suppress_defaults:
            kw.pop("default", None)
        elif flags[0][2:].replace("-", "_") in PRESET_KEYS:
            kw["help"] += " (default: from --preset)"
        elif kw.get("default") is not None and kw.get("action") != "store_true":
            kw["help"] += " (default: %(default)s)"
        group.add_argument(*flags, **kw)

    g = p.add_argument_group("data")
    add(g, "--dataset", default="pycode", help="dataset name; its files live in data/<dataset> (default pycode: "
        "Python sources of this interpreter, prepared automatically; others: see prepare_data.py)")
    add(g, "--data-dir", default=None, help="folder holding train.bin, val.bin, meta.json (unset: data/<dataset> "
        "beside train.py)")

    g = p.add_argument_group("model (sizes come from --preset unless given)")
    add(g, "--preset", default="auto", choices=["auto", *PRESETS], help="model size and training defaults "
        "(auto: cpu on a CPU, assay on a GPU)")
    add(g, "--arch", default="gpt2", choices=["gpt2", "llama"], help="gpt2: LayerNorm/GELU/learned positions; "
        "llama: RMSNorm/SwiGLU/rotary")
    add(g, "--n-layer", type=int, default=None, help="layers")
    add(g, "--n-head", type=int, default=None, help="attention heads")
    add(g, "--n-embd", type=int, default=None, help="model width")
    add(g, "--block-size", type=int, default=None, help="context length")
    add(g, "--dropout", type=float, default=0.0, help="dropout probability")

    g = p.add_argument_group("attention numerics")
    add(g, "--attn-impl", default="auto", choices=["auto", "triton", "torch", "sdpa"],
        help="auto: the Triton kernel on CUDA, its PyTorch twin on a CPU; sdpa: PyTorch SDPA (fp32 only)")
    add(g, "--accum", default="fp32", choices=list(ACCUM_MODES), help="streaming-softmax state precision: "
        "fp32 (the repair), bf16 (the fault), bf16-safemax (the prior work's fix at the source)")
    add(g, "--round", default="auto", type=rounding_sources, help="the kernel's other bf16 rounding points, "
        "comma-separated: logits (S out of a bf16 matmul), pv (each block's P V rounded by itself), backward (the "
        "prior work's bf16 backward); none; or auto: logits,pv for bf16 attention inputs (the prior work's kernel "
        "around its state, so that --accum changes the state alone)")
    add(g, "--attn-dtype", default="bf16", choices=["bf16", "native"], help="q, k, v enter attention in bf16 "
        "(on a CPU they are rounded there, as bf16 autocast makes them on a GPU, so the fault sees the GPU's "
        "inputs), or native: in the dtype they were computed in")
    add(g, "--block-n", type=int, default=0, help="key block of the streaming loop (0: the kernel's default)")
    add(g, "--safemax-beta", type=float, default=2.0, help="bf16-safemax: shift repeated maxima by beta*max")
    add(g, "--qknorm", default="off", choices=["off", "always"], help="parameter-free QK-norm from step 0 "
        "(the always-on baseline)")
    add(g, "--softcap", type=float, default=0.0, help="tanh soft-cap of attention logits from step 0 (0: off)")
    add(g, "--attn-scale", type=float, default=0.0, help="logit scale (0: 1/sqrt(head_dim)); a fixed scale is "
        "common with QK-norm")

    g = p.add_argument_group("monitor and QK-Guard")
    add(g, "--guard", default="off", choices=["on", "off"], help="QK-Guard: dormant until the signal first "
        "crosses --guard-threshold, then --guard-action stays on")
    add(g, "--guard-signal", default="max-logit", choices=list(SIGNALS), help="watched signal per layer and head")
    add(g, "--guard-threshold", type=float, default=None, help="trigger level, in the signal's units (default: "
        + ", ".join(f"{s} {v:g}" for s, v in DEFAULT_THRESHOLD.items()) + "; the README says where they come from)")
    add(g, "--guard-action", default="qknorm", choices=list(ACTIONS), help="qknorm (the paper's), qkclip "
        "(weight-side QK), or the non-QK controls lr-drop, clip, softcap, fp32-accum")
    add(g, "--guard-scope", default="all", choices=list(SCOPES), help="act on every layer, or on crossed layers")
    add(g, "--qkclip-tau", type=float, default=100.0, help="qkclip: cap on each head's max logit")
    add(g, "--lr-drop-factor", type=float, default=0.1, help="lr-drop: multiply the learning rate by this")
    add(g, "--clip-tight", type=float, default=0.1, help="clip: gradient-norm clip after the trigger")
    add(g, "--softcap-value", type=float, default=50.0, help="softcap action: the cap c (Gemma 2 uses 50)")
    add(g, "--monitor-interval", type=int, default=1, help="monitor (sigmas, guard check) every N steps")
    add(g, "--power-iters", type=int, default=1, help="power iterations per monitored step")
    add(g, "--collapse-margin", type=float, default=1.0, help="collapse: loss above its running min by this")
    add(g, "--collapse-patience", type=int, default=5, help="... for this many logged steps in a row")
    add(g, "--collapse-smoothing", type=float, default=0.9, help="EMA factor applied to logged losses first")
    add(g, "--collapse-grace", type=int, default=100, help="steps after the guard's action starts in which a loss "
        "transient does not count as a collapse (a non-finite loss always does)")
    add(g, "--on-collapse", default="stop", choices=["stop", "continue"], help="what to do at a collapse")

    g = p.add_argument_group("the assay: a controlled error at any source, the QK-only fix, the causal probe")
    add(g, "--inject-site", default="none", choices=list(INJECT_SITES), help="where a controlled error enters: "
        "the forward's attn-out, mlp-in, mlp-out, residual (the model changes), or the backward's delta (where the "
        "kernel fault reaches the gradient: only dq, dk change), or the gradient of W_v / W_up")
    add(g, "--inject-scale", type=injection_scale, default=None, help="error rms over the rms of the signal it joins, or 'matched' "
        "(size and per-head direction of the bf16 fault's bias, measured on the first batch)")
    add(g, "--inject-coherence", type=float, default=None, help="probability that a head's error sign persists "
        "to the next step (1: sign-coherent, the default; 0.5: a fresh random sign each step)")
    add(g, "--inject-layers", default="all", help="comma-separated layer indices, or all")
    add(g, "--qk-fix", default="off", choices=list(QK_FIXES), help="while the fault stays on, correct only the "
        "QK channel: clean-grad (W_q, W_k get the fault-free gradient; every other gradient stays faulty) or "
        "qknorm (parameter-free QK-norm from step 0)")
    add(g, "--probe", default="off", choices=list(PROBE_MODES), help="after each step, project the W_q/W_k update "
        "off their top-k singular directions (qk-topk); controls: a fixed random subspace of W_q/W_k (qk-fixed), "
        "W_v's or the MLP input's top-k (v-topk, mlp-topk), the same energy elsewhere (equal-energy)")
    add(g, "--probe-k", type=int, default=3, help="singular directions the probe removes")

    g = p.add_argument_group("optimization (defaults come from --preset unless given)")
    add(g, "--batch-size", type=int, default=None, help="sequences per micro-batch (per process)")
    add(g, "--grad-accum", type=int, default=None, help="micro-batches per step, over all processes")
    add(g, "--max-steps", type=int, default=None, help="optimizer steps")
    add(g, "--lr", type=float, default=None, help="peak learning rate")
    add(g, "--min-lr", type=float, default=None, help="final learning rate of the cosine schedule")
    add(g, "--warmup-steps", type=int, default=None, help="linear warmup steps")
    add(g, "--schedule", default=None, choices=["cosine", "constant"], help="after warmup")
    add(g, "--decay-steps", type=int, default=0, help="the cosine reaches --min-lr here (0: --max-steps; kept "
        "on resume, so a longer --max-steps does not bend the schedule)")
    add(g, "--weight-decay", type=float, default=0.0, help="AdamW weight decay on matrices")
    add(g, "--beta1", type=float, default=0.9, help="AdamW beta1")
    add(g, "--beta2", type=float, default=0.95, help="AdamW beta2")
    add(g, "--grad-clip", type=float, default=1.0, help="gradient-norm clip (0: off)")

    g = p.add_argument_group("run")
    add(g, "--out-dir", default=None, help="run directory (default runs/<date>-<time>-<accum>-guard-<on|off>)")
    add(g, "--resume", action="store_true", default=False, help="continue the run in --out-dir from ckpt.pt")
    add(g, "--seed", type=int, default=1337, help="seed of the weights and of the batch order")
    add(g, "--device", default="auto", help="auto, cpu, cuda, cuda:N")
    add(g, "--dtype", default="auto", choices=["auto", "bf16", "fp32"], help="autocast (auto: bf16 on CUDA)")
    add(g, "--compile", action="store_true", default=False, help="torch.compile the model")
    add(g, "--log-interval", type=int, default=None, help="steps between log records")
    add(g, "--eval-interval", type=int, default=None, help="steps between validation losses")
    add(g, "--eval-iters", type=int, default=None, help="batches per validation loss")
    add(g, "--ckpt-interval", type=int, default=None, help="steps between checkpoints")
    p.epilog = "presets (set what the command line leaves unset):\n" + "\n".join(
        f"  {name:12s} " + " ".join(f"{k}={x}" for k, x in {**model_lib.MODEL_SIZES[v["size"]], **v}.items()
                                    if k != "size") for name, v in PRESETS.items())
    return p


def parse_args(argv=None):
    parser = build_parser()
    args = parser.parse_args(argv)
    explicit = vars(build_parser(suppress_defaults=True).parse_args(argv))   # only what was typed
    try:
        check_assay_flags(args.inject_site, args.inject_scale, args.inject_coherence, args.probe, args.probe_k,
                          args.qk_fix, args.accum)
    except ValueError as e:
        parser.error(str(e))
    if args.guard_threshold is None:
        args.guard_threshold = DEFAULT_THRESHOLD[args.guard_signal]
    guard_on, action = args.guard == "on", args.guard_action
    qk_normed = args.qknorm == "always" or args.qk_fix == "qknorm"
    refusals = [   # (refused, why and what to do instead)
        (args.inject_layers != "all" and not all(i.strip().isdigit() for i in args.inject_layers.split(",")),
         f"--inject-layers {args.inject_layers!r}: give comma-separated layer indices, or all"),
        (guard_on and action == "qknorm" and qk_normed,
         "--guard-action qknorm has nothing to switch when --qknorm always or --qk-fix qknorm is set"),
        (guard_on and action == "fp32-accum" and args.accum == "fp32",
         "--guard-action fp32-accum has nothing to switch when --accum is already fp32"),
        (guard_on and args.guard_signal == "max-logit" and (qk_normed or 0 < args.softcap <= args.guard_threshold),
         "--guard-signal max-logit can never cross --guard-threshold when QK-norm or a smaller --softcap bounds "
         "the logits: use --guard-signal sigma-product"),
        (args.guard_scope == "crossed" and action in ("lr-drop", "clip"),
         f"--guard-scope crossed: --guard-action {action} acts on the whole model; use --guard-scope all"),
        (args.resume and "out_dir" not in explicit, "--resume needs the --out-dir of the run to continue"),
        ("probe_k" in explicit and args.probe == "off",
         "--probe-k has no effect with --probe off: choose --probe qk-topk or equal-energy"),
        ("inject_layers" in explicit and args.inject_site == "none",
         "--inject-layers has no effect with --inject-site none"),
        (args.attn_impl == "sdpa" and ("block_n" in explicit or "safemax_beta" in explicit),
         "--block-n and --safemax-beta belong to the streaming-softmax kernel, not to --attn-impl sdpa"),
    ]
    for refused, message in refusals:
        if refused:
            parser.error(message)
    return args, explicit, parser


def rounding_sources(text):
    """--round: auto, none, or a comma-separated list of the kernel's rounding sources."""
    if text in ("auto", "none"):
        return text
    unknown = [s for s in text.split(",") if s not in ROUNDING_SOURCES]
    if unknown:
        raise argparse.ArgumentTypeError(f"{unknown[0]!r} is not a rounding source: give auto, none, or some of "
                                         f"{','.join(ROUNDING_SOURCES)} separated by commas")
    return text


def injection_scale(text):
    """--inject-scale: a number, or 'matched'."""
    if text == "matched":
        return text
    try:
        return float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r}: give a number > 0 or 'matched'")


def check_model_config(config, args, device):
    """Fail before training, with the kernel's own words, on a setting it cannot run (a head dim, an impl)."""
    if config.n_embd % config.n_head:
        raise SystemExit(f"error: --n-embd {config.n_embd} is not a multiple of --n-head {config.n_head}")
    softcap = args.softcap_value if args.guard == "on" and args.guard_action == "softcap" else config.softcap
    dtype = torch.bfloat16 if device.type == "cuda" or config.attn_dtype == "bf16" else torch.float32
    probe = torch.zeros(1, 1, 1, config.n_embd // config.n_head, device=device, dtype=dtype)
    try:
        attention(probe, probe, probe, accum=config.accum, impl=config.attn_impl, softcap=softcap,
                  safemax_beta=config.safemax_beta, block_n=config.block_n or None, rounding=config.rounding)
    except ValueError as e:
        raise SystemExit(f"error: the attention settings cannot run: {e}")


def resolve_args(args, device, parser):
    """Fill the flags left unset from the preset and the model size table, then check what needs them."""
    preset = args.preset if args.preset != "auto" else ("cpu" if device.type == "cpu" else "assay")
    args.preset = preset
    for key, value in PRESETS[preset].items():
        if key != "size" and getattr(args, key) is None:
            setattr(args, key, value)
    for key, value in model_lib.MODEL_SIZES[PRESETS[preset]["size"]].items():
        if getattr(args, key) is None:
            setattr(args, key, value)
    args.data_dir = args.data_dir or os.path.join(os.path.dirname(os.path.abspath(__file__)), "data", args.dataset)
    args.decay_steps = args.decay_steps or args.max_steps
    if args.out_dir is None:
        stamp = time.strftime("%Y%m%d-%H%M%S")
        args.out_dir = os.path.join("runs", f"{stamp}-{args.accum}-guard-{args.guard}")
    for name in ("log_interval", "eval_interval", "eval_iters", "ckpt_interval", "monitor_interval", "max_steps",
                 "batch_size", "grad_accum", "power_iters"):
        if getattr(args, name) < 1:
            parser.error(f"--{name.replace('_', '-')} must be at least 1")
    if args.inject_layers != "all" and max(map(int, args.inject_layers.split(","))) >= args.n_layer:
        parser.error(f"--inject-layers {args.inject_layers}: the model has layers 0..{args.n_layer - 1}")
    return args


# ----------------------------------------------------------------------------------------------------------------
# Processes and devices

class Dist:
    """Rank bookkeeping: one process, or one per GPU (or CPU worker) under torchrun."""

    def __init__(self, device_flag):
        self.world = int(os.environ.get("WORLD_SIZE", "1"))
        self.rank = int(os.environ.get("RANK", "0"))
        self.local_rank = int(os.environ.get("LOCAL_RANK", "0"))
        if device_flag == "auto":
            device_flag = f"cuda:{self.local_rank}" if torch.cuda.is_available() else "cpu"
        elif device_flag == "cuda":
            device_flag = f"cuda:{self.local_rank}"
        self.device = torch.device(device_flag)
        if self.device.type == "cuda":
            torch.cuda.set_device(self.device)
        if self.world > 1:
            torch.distributed.init_process_group("nccl" if self.device.type == "cuda" else "gloo")
        self.master = self.rank == 0

    def all_reduce(self, tensor, op="avg"):
        """Reduced over ranks, so every rank takes the same guard and collapse decisions."""
        if self.world > 1:
            tensor = tensor.clone()
            if op == "avg":
                torch.distributed.all_reduce(tensor)
                tensor /= self.world
            else:
                torch.distributed.all_reduce(tensor, op=torch.distributed.ReduceOp.MAX)
        return tensor

    def barrier(self):
        if self.world > 1:
            torch.distributed.barrier()

    def close(self):
        if self.world > 1:
            torch.distributed.destroy_process_group()


# ----------------------------------------------------------------------------------------------------------------
# Data

class Batches(prepare_data.TokenWindows):
    """prepare_data.TokenWindows as torch tensors on the training device: inputs and next-token targets."""

    def get(self, split, step, index, device):
        window = torch.from_numpy(super().get(split, step, index))
        if device.type == "cuda":
            window = window.pin_memory().to(device, non_blocking=True)
        return window[:, :-1].contiguous(), window[:, 1:].contiguous()


def ensure_data(args, dist):
    """Prepare the dataset on first use (one process per node; prepare_data locks the folder) when
    prepare_data.py knows how to make it unaided."""
    if os.path.exists(os.path.join(args.data_dir, "meta.json")):
        return
    if args.dataset not in ("pycode", "shakespeare"):
        raise SystemExit(f"error: no prepared data in {args.data_dir} (meta.json missing): run "
                         f"`python prepare_data.py --dataset {args.dataset} --out-dir {args.data_dir} ...` first")
    if dist.local_rank == 0:
        print(f"no data in {args.data_dir}: preparing the {args.dataset} dataset (once)")
        prepare_data.prepare(dataset=args.dataset, out_dir=args.data_dir)
    dist.barrier()


# ----------------------------------------------------------------------------------------------------------------
# Run directory: config, log, checkpoints

def versions(device):
    def git(*cmd):
        try:
            return subprocess.run(["git", *cmd], capture_output=True, text=True, timeout=5,
                                  cwd=os.path.dirname(os.path.abspath(__file__))).stdout.strip()
        except (OSError, subprocess.SubprocessError):
            return ""
    import triton
    return {"python": platform.python_version(), "torch": torch.__version__, "triton": triton.__version__,
            "numpy": np.__version__, "device": str(device),
            "gpu": torch.cuda.get_device_name(device) if device.type == "cuda" else None,
            "host": platform.node(), "git_commit": git("rev-parse", "HEAD") or None,
            "git_dirty": bool(git("status", "--porcelain", "--untracked-files=no"))}


def save_checkpoint(path, state):
    """Write to a temporary file, fsync, keep the previous checkpoint as .prev, then rename into place: a crash
    at any moment leaves a complete checkpoint on disk."""
    tmp = path + ".tmp"
    with open(tmp, "wb") as f:
        torch.save(state, f)
        f.flush()
        os.fsync(f.fileno())
    if os.path.exists(path):
        os.replace(path, path + ".prev")
    os.replace(tmp, path)


def load_checkpoint(path):
    if not os.path.exists(path):
        raise SystemExit(f"error: --resume given but {path} does not exist: start a new run without --resume")
    try:
        state = torch.load(path, map_location="cpu", weights_only=False)
    except Exception as e:  # a truncated zip or pickle shows up as many exception types
        prev = path + ".prev"
        hint = f"; the previous good checkpoint is {prev}: move it to {path} to resume from there" \
            if os.path.exists(prev) else ""
        raise SystemExit(f"error: cannot read checkpoint {path} ({type(e).__name__}: {e}): it is truncated or "
                         f"not a checkpoint{hint}")
    if not isinstance(state, dict) or state.get("format") != "qkguard-checkpoint-1":
        raise SystemExit(f"error: {path} is not a checkpoint written by this train.py")
    return state


class RunLog:
    """log.jsonl for programs (one JSON object per line, flushed each time) and a console line for people."""

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
    """Every rank's RNG states (dropout draws differ per rank), gathered for rank 0's checkpoint."""
    state = {"python": random.getstate(), "numpy": np.random.get_state(), "torch": torch.get_rng_state(),
             "cuda": torch.cuda.get_rng_state_all() if torch.cuda.is_available() else None}
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
    random.setstate(state["python"])
    np.random.set_state(state["numpy"])
    torch.set_rng_state(state["torch"])
    if state["cuda"] is not None and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


# ----------------------------------------------------------------------------------------------------------------
# Training

def running_max(running, new):
    """The elementwise max so far, on the device (None before the first value)."""
    return new if running is None else torch.maximum(running, new)


def moved(x, device):
    """x on device; None stays None (the running maxima are None between intervals)."""
    return None if x is None else x.to(device)


def lr_at(step, args):
    if step < args.warmup_steps:
        return args.lr * (step + 1) / args.warmup_steps
    if args.schedule == "constant":
        return args.lr
    progress = min(1.0, (step - args.warmup_steps) / max(1, args.decay_steps - args.warmup_steps))
    return args.min_lr + 0.5 * (1.0 + math.cos(math.pi * progress)) * (args.lr - args.min_lr)


def start_run(args, explicit):
    """New run: refuse a folder that holds another run. Resume: the saved flags, with only safe changes."""
    paths = {name: os.path.join(args.out_dir, name) for name in ("config.json", "log.jsonl", "ckpt.pt")}
    if not args.resume:
        taken = [p for p in paths.values() if os.path.exists(p)]
        if taken:
            raise SystemExit(f"error: {args.out_dir} already holds a run ({', '.join(taken)}): continue it with "
                             f"--resume, or choose another --out-dir")
        return args, None, {}
    state = load_checkpoint(paths["ckpt.pt"])
    saved = state["args"]
    conflicts = [f"--{k.replace('_', '-')} {v} (saved: {saved.get(k)})" for k, v in explicit.items()
                 if k not in RESUMABLE_CHANGES and k in saved and saved[k] != v
                 and not (k == "preset" and v == "auto")]
    if conflicts:
        raise SystemExit(f"error: --resume keeps the saved run's settings, but these differ: {'; '.join(conflicts)}."
                         f" Resume without them, or start a new run in another --out-dir")
    changed = {k: [saved.get(k), v] for k, v in explicit.items()
               if k in RESUMABLE_CHANGES - {"resume"} and saved.get(k) != v}
    merged = {**saved, **{k: v for k, v in explicit.items() if k in RESUMABLE_CHANGES}, "resume": True}
    if state["step"] >= merged["max_steps"]:
        raise SystemExit(f"error: the run in {args.out_dir} already reached step {state['step']}: pass a "
                         f"--max-steps above it to train on")
    return argparse.Namespace(**merged), state, changed


class Trainer:
    """Everything one run holds: the model and optimizer, the data, the monitor, the guard, the collapse
    detector and the assay's injector and probe; each part restores itself from the checkpoint."""

    def __init__(self, args, dist, state):
        self.args, self.dist, device = args, dist, dist.device
        use_bf16 = args.dtype == "bf16" or (args.dtype == "auto" and device.type == "cuda")
        self.autocast = (lambda: torch.autocast(device.type, dtype=torch.bfloat16)) if use_bf16 \
            else contextlib.nullcontext
        torch.manual_seed(args.seed)            # the same initial weights on every rank
        config = model_lib.GPTConfig(
            arch=args.arch, n_layer=args.n_layer, n_head=args.n_head, n_embd=args.n_embd,
            block_size=args.block_size, dropout=args.dropout, attn_impl=args.attn_impl, accum=args.accum,
            block_n=args.block_n, safemax_beta=args.safemax_beta, qk_norm=args.qknorm == "always",
            rounding=None if args.round == "auto" else args.round, attn_dtype=args.attn_dtype,
            softcap=args.softcap, attn_scale=args.attn_scale)
        check_model_config(config, args, device)
        self.model = model = model_lib.GPT(config).to(device)
        torch.manual_seed(args.seed + dist.rank)  # dropout masks differ per rank
        self.batches = Batches(args.data_dir, args.block_size, args.batch_size, args.seed, config.vocab_size,
                               args.dataset)
        self.optimizer = model.configure_optimizer(args.lr, args.weight_decay, (args.beta1, args.beta2))
        self.monitor = SpectralMonitor(model, seed=args.seed)
        self.guard = QKGuard(enabled=args.guard == "on", signal=args.guard_signal, threshold=args.guard_threshold,
                             action=args.guard_action, scope=args.guard_scope, tau=args.qkclip_tau,
                             lr_factor=args.lr_drop_factor, clip_norm=args.clip_tight, softcap=args.softcap_value)
        self.detector = CollapseDetector(args.collapse_margin, args.collapse_patience, args.collapse_smoothing)
        self.probe = Probe(args.probe, k=args.probe_k, seed=args.seed)
        self.injector = self.make_injector().attach(model) if args.inject_site != "none" else None
        if args.qk_fix == "qknorm":
            for attn in model.attentions:
                attn.qk_norm = True
        self.step = 0
        self.probe_stats, self.monitor_max_logit = {}, None
        # what the log record of the current interval accumulates (saved too, so a resume continues it)
        self.interval = {"loss_sum": 0.0, "steps": 0, "max_logit": None}
        if state is None:
            self.monitor.measure(model, iters=30)   # converge before step 0
        else:
            self.restore(state)
        self.saved_step = self.step   # nothing to save before the first update (a resume: it is on disk)
        self.train_model = torch.compile(model) if args.compile else model
        if dist.world > 1:
            self.train_model = torch.nn.parallel.DistributedDataParallel(
                self.train_model, device_ids=[device.index] if device.type == "cuda" else None)

    def make_injector(self):
        args = self.args
        layers = None if args.inject_layers == "all" else [int(i) for i in args.inject_layers.split(",")]
        coherence = 1.0 if args.inject_coherence is None else args.inject_coherence
        if args.inject_scale != "matched":
            return ErrorInjector(args.inject_site, args.inject_scale, coherence, args.n_layer, args.n_head,
                                 args.n_embd, layers=layers, seed=args.seed)
        # the bias of this run's faulty kernel (bf16 when the kernel itself is fp32), on the initial model
        with self.autocast():
            return ErrorInjector.matched(self.model, self.batches.get("train", 0, 0, self.dist.device)[0],
                                         site=args.inject_site, accum="bf16" if args.accum == "fp32" else args.accum,
                                         coherence=coherence, layers=layers, seed=args.seed)

    def state_dict(self):
        return {"format": "qkguard-checkpoint-1", "step": self.step, "args": vars(self.args),
                "model": self.model.state_dict(), "optimizer": self.optimizer.state_dict(),
                "monitor": {**self.monitor.state_dict(),
                            # the max logit since the last monitored step (--monitor-interval > 1), not yet checked
                            "max_logit": moved(self.monitor_max_logit, "cpu")},
                "guard": self.guard.state_dict(),
                "detector": self.detector.state_dict(), "probe": self.probe.state_dict(),
                "injector": self.injector.state_dict() if self.injector is not None else None,
                "interval": {**self.interval, "loss_sum": float(self.interval["loss_sum"]),
                             "max_logit": moved(self.interval["max_logit"], "cpu")},
                "data_content_sha256": self.batches.content_hash, "rng": rng_state(self.dist)}

    def checkpoint(self):
        """Save ckpt.pt, unless this step is already saved (a checkpoint interval that ends the run)."""
        state = self.state_dict()           # every rank takes part (the RNG states are gathered)
        if self.dist.master and self.saved_step != self.step:
            save_checkpoint(os.path.join(self.args.out_dir, "ckpt.pt"), state)
        self.saved_step = self.step

    def restore(self, state):
        if state.get("data_content_sha256") != self.batches.content_hash:
            raise SystemExit(f"error: the data in {self.args.data_dir} is not the data this run started with "
                             f"(content hash {self.batches.content_hash} != {state.get('data_content_sha256')}): "
                             f"resume with the original data, or start a new run")
        self.model.load_state_dict(state["model"])
        self.optimizer.load_state_dict(state["optimizer"])
        self.monitor.load_state_dict(state["monitor"])
        self.guard.load_state_dict(state["guard"], self.model)
        self.detector.load_state_dict(state["detector"])
        self.probe.load_state_dict(state["probe"])
        if self.injector is not None:
            self.injector.load_state_dict(state["injector"])
        device = self.dist.device
        self.interval = {**state["interval"], "max_logit": moved(state["interval"]["max_logit"], device)}
        set_rng_state(state["rng"], self.dist)
        self.step = state["step"]
        self.monitor_max_logit = moved(state["monitor"].get("max_logit"), device)

    @torch.no_grad()
    def evaluate(self):
        """Mean validation loss over the same eval_iters batches every time, split over the ranks."""
        dist, model = self.dist, self.train_model
        model.eval()
        total = torch.zeros(2, device=dist.device)
        for i in range(dist.rank, self.args.eval_iters, dist.world):
            x, y = self.batches.get("val", 0, i, dist.device)
            with self.autocast():
                _, loss, _ = model(x, y)
            total += torch.stack([loss.float(), torch.ones((), device=dist.device)])
        model.train()
        if dist.world > 1:
            torch.distributed.all_reduce(total)
        return (total[0] / total[1]).item()

    def train_step(self):
        """One optimizer step: forward/backward over the micro-batches (the assay's fixes and errors included),
        clip, update. Returns the step's lr, gradient norm, and max attention logit per layer and head."""
        args, dist, model = self.args, self.dist, self.model
        lr = lr_at(self.step, args) * self.guard.lr_scale()
        for group in self.optimizer.param_groups:
            group["lr"] = lr
        if self.injector is not None:
            self.injector.begin_step(self.step)
        micro_steps = args.grad_accum // dist.world
        max_logit, loss_sum, clean_grads = None, 0.0, None
        for micro in range(micro_steps):
            x, y = self.batches.get("train", self.step, micro * dist.world + dist.rank, dist.device)
            sync = dist.world == 1 or micro == micro_steps - 1     # DDP all-reduces on the last micro-step only
            with self.autocast(), (contextlib.nullcontext() if sync else self.train_model.no_sync()):
                _, loss, step_max_logit = self.train_model(x, y)
            (loss / micro_steps).backward()
            loss_sum += loss.detach().float() / micro_steps
            max_logit = running_max(max_logit, step_max_logit)
            if args.qk_fix == "clean-grad":
                grads = clean_qk_grads(model, x, y, self.autocast, 1.0 / micro_steps, self.injector)
                clean_grads = grads if clean_grads is None else [a + b for a, b in zip(clean_grads, grads)]
        if clean_grads is not None:
            for weight, grad in zip(qk_weights(model), clean_grads):
                weight.grad = dist.all_reduce(grad)
        if self.injector is not None:
            self.injector.inject_grads(model)
        clip = self.guard.grad_clip(args.grad_clip)
        grad_norm = torch.nn.utils.clip_grad_norm_(model.parameters(), clip if clip > 0 else float("inf"))
        self.probe.before_step(model)
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        self.probe_stats = self.probe.after_step(model)
        return lr, grad_norm, loss_sum, dist.all_reduce(max_logit.float(), "max")

    def watch(self, max_logit):
        """The monitor and the guard, after the update: sigma of W_q/W_k, then a trigger check on the max logit
        since the last monitored step (so no crossing is missed), then QK-Clip if that is the action. The check
        is deferred (QKGuard.observe_deferred): a crossing at monitored step s acts from the update after the
        next monitored step, which the event records as active_from; the GPU never waits for the guard."""
        self.monitor_max_logit = running_max(self.monitor_max_logit, max_logit)
        event = None
        if self.step % self.args.monitor_interval == 0:
            self.monitor.measure(self.model, self.args.power_iters)
            event = self.guard.observe_deferred(self.step, self.monitor_max_logit, self.monitor.sigma_head, self.model)
            self.monitor_max_logit = None
            if event:   # the action's own transient is not a collapse
                self.detector.pause(event["active_from"] + self.args.collapse_grace)
        self.guard.after_optimizer_step(self.model, max_logit)
        return event

    def accumulate(self, loss, max_logit):
        """Add one step to the interval's record, on the device: no host sync until the record is written."""
        interval = self.interval
        interval["loss_sum"] = interval["loss_sum"] + loss
        interval["steps"] += 1
        interval["max_logit"] = running_max(interval["max_logit"], max_logit)

    def log_record(self, lr, grad_norm, elapsed):
        """The record of the steps since the last one: mean loss, max logit over the interval, latest sigmas.
        Called after the update, so the last update's index is step - 1."""
        interval, tokens = self.interval, self.args.grad_accum * self.args.batch_size * self.args.block_size
        loss = self.dist.all_reduce(torch.as_tensor(interval["loss_sum"] / interval["steps"])).item()
        record = {"step": self.step - 1, "lr": lr, "loss": loss, "grad_norm": grad_norm.item(),
                  "tokens_per_s": tokens * interval["steps"] / elapsed, "max_logit": interval["max_logit"].tolist(),
                  **self.monitor.record(),
                  "guard": "on" if self.guard.triggered else ("dormant" if self.guard.enabled else "off")}
        if self.injector is not None:
            record.update(self.injector.last_stats)
        if self.probe_stats:
            record["probe"] = self.probe_stats
        self.interval = {"loss_sum": 0.0, "steps": 0, "max_logit": None}
        return record


def console_line(record):
    max_logit = torch.tensor(record["max_logit"])
    top = int(max_logit.argmax())
    return (f"step {record['step']:6d} | loss {record['loss']:.4f} | lr {record['lr']:.2e} | gnorm "
            f"{record['grad_norm']:.2f} | max logit {max_logit.max().item():7.1f} (L{top // max_logit.shape[1]} "
            f"H{top % max_logit.shape[1]}) | sigma(Wq) {max(record['sigma_q']):.2f} | "
            f"{record['tokens_per_s'] / 1e3:.1f}k tok/s | guard {record['guard']}")


def main(argv=None):
    args, explicit, parser = parse_args(argv)
    dist = Dist(args.device)
    if dist.world > 1:      # one timestamped default out_dir for all ranks
        holder = [resolve_args(args, dist.device, parser) if dist.master else None]
        torch.distributed.broadcast_object_list(holder, src=0)
        args = holder[0]
    else:
        args = resolve_args(args, dist.device, parser)
    args, state, changed = start_run(args, explicit)
    if args.grad_accum % dist.world:
        raise SystemExit(f"error: --grad-accum {args.grad_accum} must be a multiple of the {dist.world} processes")
    ensure_data(args, dist)
    run = Trainer(args, dist, state)
    model = run.model

    if dist.master:
        os.makedirs(args.out_dir, exist_ok=True)
    log, run_versions = RunLog(os.path.join(args.out_dir, "log.jsonl"), dist.master), versions(dist.device)
    if dist.master and state is None:
        with open(os.path.join(args.out_dir, "config.json"), "w") as f:
            json.dump({"args": vars(args), "versions": run_versions, "command": sys.argv,
                       "world_size": dist.world, "params": model.num_params()}, f, indent=2)
    log.write({"event": "resume" if state else "start", "step": run.step, "versions": run_versions,
               "world_size": dist.world, "command": sys.argv, "changed": changed},
              f"{'resuming' if state else 'starting'} {args.out_dir} at step {run.step}: {args.preset} preset, "
              f"{args.arch} {args.n_layer}x{args.n_embd}, {model.num_params() / 1e6:.2f}M params, accum "
              f"{args.accum}, guard {args.guard}, on {dist.device} x{dist.world}")

    def evaluate():
        val_loss = run.evaluate()
        log.write({"event": "eval", "step": run.step, "val_loss": val_loss},
                  f"step {run.step:6d} | val loss {val_loss:.4f}")
        return val_loss

    stop_signal = []
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda signum, frame: stop_signal.append(signum))

    # "step" in every record counts the updates done before it: a step record's loss and max logit come from
    # the forward of update `step`, an eval at `step` sees the weights after `step` updates.
    status, val_loss, interval_start = "completed", None, time.time()
    try:
        if state is None:
            val_loss = evaluate()
        while run.step < args.max_steps:
            lr, grad_norm, loss, max_logit = run.train_step()
            event = run.watch(max_logit)
            if event:
                log.write(event, f"step {event['step']:6d} | QK-Guard {event['event']}: {event['signal']} "
                          f"{event['value']:.1f} > {run.guard.threshold:g} at layer {event['layer']} head "
                          f"{event['head']}: {run.guard.action} on in layers {event['layers']} from step "
                          f"{event['active_from']}")
            run.accumulate(loss, max_logit)
            run.step += 1

            if run.step % args.log_interval == 0 or run.step == args.max_steps:
                record = run.log_record(lr, grad_norm, time.time() - interval_start)
                log.write(record, console_line(record))
                interval_start = time.time()
                if run.detector.update(record["step"], record["loss"]):
                    log.write({"event": "collapse", "step": run.detector.collapsed_at, "loss": record["loss"]},
                              f"step {record['step']:6d} | COLLAPSE detected (first bad step "
                              f"{run.detector.collapsed_at})")
                    if args.on_collapse == "stop":
                        status = "collapsed"
                        break
            if run.step % args.eval_interval == 0 or run.step == args.max_steps:
                val_loss = evaluate()
            if run.step % args.ckpt_interval == 0:
                run.checkpoint()
            stop = bool(stop_signal)
            if dist.world > 1:   # a signal may reach the ranks at different steps: stop together
                stop = dist.all_reduce(torch.tensor(float(stop), device=dist.device), "max").item() > 0
            if stop:
                status = "interrupted"
                break
        if status == "collapsed":   # the end record's val loss is the collapsed model's, not an old one
            val_loss = evaluate()
        run.checkpoint()
    except BaseException as e:
        log.write({"event": "end", "status": "error", "step": run.step, "error": f"{type(e).__name__}: {e}"})
        raise
    # guard_pending: a crossing at the last check, which the deferred guard had no step left to act on
    log.write({"event": "end", "status": status, "step": run.step, "collapse_step": run.detector.collapsed_at,
               "guard_trigger": run.guard.trigger, "guard_pending": run.guard.pending_crossing(),
               "val_loss": val_loss},
              f"run {status} at step {run.step}; log and checkpoint in {args.out_dir}")
    dist.close()


if __name__ == "__main__":
    main()
