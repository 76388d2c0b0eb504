"""
The run around train.py's loop, which its reader can skip: the flags, presets and refusals, the
processes, the run folder (config.json, log.jsonl, ckpt.pt, source.diff), exact resume, stopping.

A value comes from the command line, else from --preset (auto: demo on a CPU, assay on a GPU), else
from the flag's default. Numbers are checked as parsed: a bad one fails in one line naming the flag.
"""
import argparse
import atexit
import contextlib
import dataclasses
import json
import math
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

import model as model_lib
import prepare_data
from attention_kernel import ACCUM_MODES, BF16_STATE_BLOCK_N, ROUNDING_SOURCES
from guard import ACTIONS, DEFAULT_ACTION, DEFAULT_THRESHOLD, SCOPES, SIGNALS
fcntl = prepare_data.fcntl   # None on Windows: no lock

# Training defaults per preset, one column per flag; the model sizes are model.MODEL_SIZES[size].
PRESET_COLUMNS = ("size", "tokenizer", "batch_size", "grad_accum", "max_steps", "lr", "min_lr", "warmup_steps",
                  "schedule", "log_interval", "eval_interval", "eval_iters", "ckpt_interval", "block_n")
PRESETS = {name: dict(zip(PRESET_COLUMNS, row)) for name, row in {
    # block_n: the key block where the bf16 state is rounded (0: the kernel's, 128). The fault lives in the
    # streaming rescale across key blocks, so a preset that shows it streams 4 per row (the H200 collapse's
    # 512 / 128, SOURCES.md): 32-key blocks at the CPU model's context of 128. The lab preset keeps one
    # 128-key block per row: the claims 3-6 assay injects its own error and its committed runs used it.
    # demo (auto's pick on a CPU): the cpu model at an lr that makes its logits run away (README)
    "demo":        ("cpu", "byte", 8, 1, 300, 3e-2, 3e-2, 20, "constant", 10, 100, 4, 100, 32),
    "cpu":         ("cpu", "byte", 8, 1, 100, 3e-3, 3e-4, 10, "cosine", 10, 50, 4, 50, 32),
    # lab (the claims sweeps of RESULTS.md): the cpu model at a healthy lr, held constant so that
    # an injected error meets the same optimizer all run long
    "lab":         ("cpu", "byte", 8, 1, 300, 3e-3, 3e-3, 20, "constant", 10, 100, 4, 100, 0),
    # stream (claim 1 at CPU scale, lab/preregistered/claim1-stream.md): the lab's model and lr with
    # 4 key blocks per row, long enough for a slow drift; the final val loss on 16 batches
    "stream":      ("cpu", "byte", 8, 1, 4000, 3e-3, 3e-3, 20, "constant", 10, 500, 16, 500, 32),
    "assay":       ("assay", "gpt2", 32, 1, 2000, 2e-3, 2e-3, 200, "constant", 10, 250, 20, 500, 0),
    "gpt2":        ("gpt2", "gpt2", 16, 32, 60000, 1e-3, 1e-4, 2000, "cosine", 10, 1000, 50, 1000, 0),
    "gpt2-medium": ("gpt2-medium", "gpt2", 8, 64, 60000, 6e-4, 6e-5, 2000, "cosine", 10, 1000, 50, 1000, 0),
}.items()}
PRESET_KEYS = {key for values in (*PRESETS.values(), *model_lib.MODEL_SIZES.values()) for key in values}
# Flags that may change when a run is resumed; any other difference from the saved run is an error.
RESUMABLE_CHANGES = {"max_steps", "log_interval", "eval_interval", "eval_iters", "ckpt_interval", "compile",
                     "on_collapse", "resume", "device", "out_dir", "data_dir"}
# The lab's assay (lab/assay.py) runs as ASSAY_COMMAND, train.py with its extension: its flags, typed to
# train.py or set in a run resumed by it, get one line naming that command. Each flag's value when unused.
ASSAY_COMMAND = "python -m lab.train_assay"
ASSAY_UNUSED = {"inject_site": "none", "inject_scale": None, "inject_coherence": None, "inject_layers": "all",
                "qk_fix": "off", "probe": "off", "probe_k": 3}
HELD = {}   # this process's run folders -> their lock files
CHECKPOINT_FORMAT = "qkguard-checkpoint-3"   # tensors, numbers, strings, tuples, lists, dicts; 3: Totals' own
# ckpt.pt, and what a crash inside RunDir.save can leave instead (newest_checkpoint reads them)
CHECKPOINTS = ("ckpt.pt", "ckpt.pt.tmp", "ckpt.pt.prev")
HERE = os.path.dirname(os.path.abspath(__file__))   # the code a run records (git, source.diff)
MODEL_SHAPE = ("arch", "n_layer", "n_head", "n_embd", "vocab_size")


# ----------------------------------------------------------------------------------------------------------------
# The flags. Value types refuse nonsense in argparse's "argument --flag: ..." line; p.flag_defaults keeps each
# flag's default (None: from the preset). An extension (below) adds its own.

def number(kind=float, low=None, high=None, above=False, below=False):
    """A parser of int or finite float values in [low, high] (above / below: bound excluded)."""
    def parse(text):
        try:
            x = kind(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text!r} is not {'an integer' if kind is int else 'a number'}")
        if not math.isfinite(x):
            raise argparse.ArgumentTypeError(f"{text!r}: give a finite number")
        if low is not None and (x < low or above and x == low):
            raise argparse.ArgumentTypeError(f"{text} is too small: give a value {'>' if above else '>='} {low}")
        if high is not None and (x > high or below and x == high):
            raise argparse.ArgumentTypeError(f"{text} is too large: give a value {'<' if below else '<='} {high}")
        return x
    return parse


COUNT, SIZE = number(int, 1), number(int, 0)                  # at least 1; at least 0
POSITIVE, NONNEGATIVE = number(low=0, above=True), number(low=0)
FRACTION, PROBABILITY = number(low=0, high=1, below=True), number(low=0, high=1)


def rounding_sources(text):
    """--round: auto, none, or a comma-separated list of the kernel's rounding sources."""
    unknown = [s for s in text.split(",") if s not in ROUNDING_SOURCES] if text not in ("auto", "none") else []
    if unknown:
        raise argparse.ArgumentTypeError(f"{unknown[0]!r} is not a rounding source: give auto, none, or some of "
                                         f"{','.join(ROUNDING_SOURCES)} separated by commas")
    return text


def build_parser(extension=None):
    extension = extension or Extension()
    p = argparse.ArgumentParser(prog=extension.command, description="Train a GPT and watch (or guard) the query-key "
                                "channel.", formatter_class=argparse.RawDescriptionHelpFormatter, allow_abbrev=False)
    p.flag_defaults = {}

    def add(group, flag, default, help, **kw):
        # argparse's default stays None, which tells what was typed (a resume keeps the saved values)
        name = flag[2:].replace("-", "_")
        p.flag_defaults[name] = default
        if name in PRESET_KEYS:
            help += " (default: from --preset)"
        elif default not in (None, False):
            help += f" (default: {default})"
        group.add_argument(flag, default=None, help=help, **kw)

    g = p.add_argument_group("data")
    add(g, "--dataset", "pycode", "dataset name (pycode: this Python's own sources, prepared on first use; others: "
        "see prepare_data.py)")
    add(g, "--tokenizer", None, "byte (the CPU presets) or gpt2 (GPT-2's BPE: the GPU presets); the vocabulary "
        "follows the data's meta.json", choices=list(prepare_data.TOKENIZERS))
    add(g, "--data-dir", "", "folder of train.bin, val.bin and meta.json, which names the tokenizer (empty: "
        "data/<dataset>, or data/<dataset>-byte for byte, beside train.py)")
    g = p.add_argument_group("model (sizes come from --preset unless given)")
    add(g, "--preset", "auto", "model and training defaults (auto: demo on a CPU, assay on a GPU)",
        choices=["auto", *PRESETS])
    add(g, "--arch", "gpt2", "gpt2: LayerNorm/GELU/learned positions; llama: RMSNorm/SwiGLU/rotary",
        choices=["gpt2", "llama"])
    add(g, "--n-layer", None, "layers", type=COUNT)
    add(g, "--n-head", None, "attention heads", type=COUNT)
    add(g, "--n-embd", None, "model width", type=COUNT)
    add(g, "--block-size", None, "context length", type=COUNT)
    add(g, "--dropout", 0.0, "dropout probability", type=FRACTION)
    g = p.add_argument_group("attention numerics (attention_kernel.py; its docstring has the rounding table)")
    add(g, "--attn-impl", "auto", "auto: the Triton kernel on CUDA, its PyTorch twin on a CPU; sdpa: PyTorch SDPA "
        "(fp32 only)", choices=["auto", "triton", "torch", "sdpa"])
    add(g, "--accum", "fp32", "the streaming-softmax state (m, l, O): fp32 (the repair), bf16 (the fault), "
        "bf16-safemax (the prior work's fix at the source)", choices=list(ACCUM_MODES))
    add(g, "--round", "auto", "the other bf16 rounding points (attention_kernel.py), comma-separated: logits, pv, "
        "backward; none; or auto: logits,pv for bf16 inputs, so --accum changes the state alone", type=rounding_sources)
    add(g, "--attn-dtype", "bf16", "q, k, v enter attention in bf16 (as under a GPU's autocast), or native: in the "
        "dtype they were computed in", choices=["bf16", "native"])
    add(g, "--block-n", None, "key block of the streaming loop, where the bf16 state is rounded (0: the kernel's "
        "default, 128); context / block-n is the key blocks per row", type=SIZE)
    add(g, "--safemax-beta", 2.0, "bf16-safemax: shift repeated maxima by beta*max", type=number(low=1, above=True))
    add(g, "--qknorm", "off", "parameter-free QK-norm from step 0 (the always-on baseline)", choices=["off", "always"])
    add(g, "--softcap", 0.0, "tanh soft-cap of the logits from step 0 (0: off)", type=NONNEGATIVE)
    add(g, "--attn-scale", 0.0, "logit scale (0: 1/sqrt(head_dim)), often fixed with QK-norm", type=NONNEGATIVE)
    g = p.add_argument_group("monitor and QK-Guard (guard.py)")
    add(g, "--guard", "off", "QK-Guard: dormant until the signal first crosses --guard-threshold, then "
        "--guard-action stays on", choices=["on", "off"])
    add(g, "--guard-signal", "max-logit", "the signal, per layer and head", choices=list(SIGNALS))
    add(g, "--guard-threshold", None, "trigger level (default: the signal's, " + ", ".join(
        f"{s} {v:g}" for s, v in DEFAULT_THRESHOLD.items()) + "; see the README)", type=POSITIVE)
    add(g, "--guard-action", DEFAULT_ACTION, "qknorm (the paper's), qkclip (weight-side QK), or the non-QK controls "
        "lr-drop, clip, softcap, fp32-accum", choices=list(ACTIONS))
    add(g, "--guard-scope", "all", "act on every layer, or on crossed layers", choices=list(SCOPES))
    add(g, "--qkclip-tau", ACTIONS["qkclip"].tau, "qkclip: cap on each head's max logit", type=POSITIVE)
    add(g, "--lr-drop-factor", ACTIONS["lr-drop"].lr_factor, "lr-drop: multiply the lr by this",
        type=number(low=0, high=1, above=True))
    add(g, "--clip-tight", ACTIONS["clip"].clip_norm, "clip: gradient-norm clip after the trigger", type=POSITIVE)
    add(g, "--softcap-value", ACTIONS["softcap"].softcap, "softcap action: the cap c (Gemma 2 uses 50)", type=POSITIVE)
    add(g, "--monitor-interval", 1, "monitor (sigmas, guard check) every N steps", type=COUNT)
    add(g, "--power-iters", 1, "power iterations per monitored step", type=COUNT)
    add(g, "--collapse-margin", 1.0, "collapse: loss above its running min by this", type=POSITIVE)
    add(g, "--collapse-patience", 5, "... for this many logged steps in a row", type=COUNT)
    add(g, "--collapse-smoothing", 0.9, "EMA factor applied to logged losses first", type=FRACTION)
    add(g, "--collapse-grace", 100, "steps after the guard acts in which a loss transient is no collapse (a "
        "non-finite loss always is)", type=SIZE)
    add(g, "--on-collapse", "stop", "what to do at a collapse", choices=["stop", "continue"])
    extension.add_flags(p, add)
    g = p.add_argument_group("optimization (defaults come from --preset unless given)")
    add(g, "--batch-size", None, "sequences per micro-batch (per process)", type=COUNT)
    add(g, "--grad-accum", None, "micro-batches per step, over all processes", type=COUNT)
    add(g, "--max-steps", None, "optimizer steps", type=COUNT)
    add(g, "--lr", None, "peak learning rate", type=POSITIVE)
    add(g, "--min-lr", None, "final learning rate of the cosine schedule", type=NONNEGATIVE)
    add(g, "--warmup-steps", None, "linear warmup steps", type=SIZE)
    add(g, "--schedule", None, "after warmup", choices=["cosine", "constant"])
    add(g, "--decay-steps", 0, "the cosine reaches --min-lr here (0: --max-steps; kept on resume, "
        "so a longer --max-steps does not bend the schedule)", type=SIZE)
    add(g, "--weight-decay", 0.0, "AdamW weight decay on matrices", type=NONNEGATIVE)
    add(g, "--beta1", 0.9, "AdamW beta1", type=FRACTION)
    add(g, "--beta2", 0.95, "AdamW beta2", type=FRACTION)
    add(g, "--grad-clip", 1.0, "gradient-norm clip (0: off)", type=NONNEGATIVE)
    g = p.add_argument_group("run (run.py)")
    add(g, "--out-dir", "", "run directory (empty: runs/<date>-<time>-<accum>-guard-<on|off>-<pid>)")
    add(g, "--resume", False, "continue the run in --out-dir from ckpt.pt", action="store_true")
    add(g, "--seed", 1337, "seed of the weights and of the batch order", type=number(int, 0, 2**63 - 1))
    add(g, "--device", "auto", "auto, cpu, cuda, cuda:N")
    add(g, "--dtype", "auto", "autocast (auto: bf16 on CUDA)", choices=["auto", "bf16", "fp32"])
    add(g, "--compile", False, "torch.compile the model", action="store_true")
    add(g, "--threads", 0, "CPU threads of torch's sums (0: torch's own, OMP_NUM_THREADS); the sums' order "
        "follows the count, so runs at 1 and 2 differ in fp32 rounding order alone (the lab's A/A)",
        type=SIZE)
    add(g, "--log-interval", None, "steps between log records", type=COUNT)
    add(g, "--eval-interval", None, "steps between validation losses", type=COUNT)
    add(g, "--eval-iters", None, "batches per validation loss", type=COUNT)
    add(g, "--ckpt-interval", None, "steps between checkpoints", type=COUNT)
    p.epilog = "presets (set what the command line leaves unset):\n" + "\n".join(
        f"  {name:12s} " + " ".join(f"{k}={x}" for k, x in {**model_lib.MODEL_SIZES[v['size']], **v}.items()
                                    if k != "size") for name, v in PRESETS.items())
    return p


def parse_args(argv=None, extension=None):
    """(args with the flags' defaults, the flags typed, the parser); resolve() adds the preset's."""
    extension = extension or Extension()
    parser = build_parser(extension)
    for flag in sys.argv[1:] if argv is None else argv:
        name = flag.split("=", 1)[0][2:].replace("-", "_")
        if flag.startswith("--") and name in ASSAY_UNUSED and name not in parser.flag_defaults:
            parser.error(f"{flag.split('=', 1)[0]} is a flag of the lab's assay: run `{ASSAY_COMMAND}` with the "
                         f"same flags (lab/train_assay.py)")
    typed = {k: v for k, v in vars(parser.parse_args(argv)).items() if v is not None}
    args = argparse.Namespace(**{**parser.flag_defaults, **typed})
    if args.guard_threshold is None:   # the signal's default, as a number: config.json records it
        args.guard_threshold = DEFAULT_THRESHOLD[args.guard_signal]
    for refused, message in refusals(args, typed) + extension.refusals(args, typed):
        if refused:
            parser.error(message)
    ignored = " ".join(f"--{k.replace('_', '-')}" for k in typed if k.startswith("guard_") or k in (
        "qkclip_tau", "lr_drop_factor", "clip_tight", "softcap_value"))   # a note: the lab's sweep gives all arms one
    if ignored and args.guard == "off" and not args.resume:               # set of extra flags, unguarded arms too
        print(f"note: {ignored} act only with --guard on, and this run's guard is off", file=sys.stderr)
    return args, typed, parser


def refusals(args, typed):
    """(refused, why and what to do instead): settings that would do nothing or fail later."""
    guard_on, action, qk_normed = args.guard == "on", args.guard_action, qk_norm_from_step_0(args)
    return [
        (guard_on and action == "qknorm" and qk_normed,
         "--guard-action qknorm has nothing to switch when --qknorm always is set"),
        (guard_on and action == "fp32-accum" and args.accum == "fp32",
         "--guard-action fp32-accum has nothing to switch when --accum is already fp32"),
        (guard_on and args.guard_signal == "max-logit" and (qk_normed or 0 < args.softcap <= args.guard_threshold),
         "--guard-signal max-logit cannot cross --guard-threshold under QK-norm or a smaller --softcap: use "
         "--guard-signal sigma-product"),
        (args.guard_scope == "crossed" and action in ("lr-drop", "clip"),
         f"--guard-scope crossed: --guard-action {action} acts on the whole model; use --guard-scope all"),
        (args.resume and "out_dir" not in typed, "--resume needs the --out-dir of the run to continue"),
        (args.attn_impl == "sdpa" and ("block_n" in typed or "safemax_beta" in typed),
         "--block-n and --safemax-beta belong to the streaming-softmax kernel, not to --attn-impl sdpa"),
    ]


def auto_preset(device_type):
    return "demo" if device_type == "cpu" else "assay"


def launcher_pid():
    """This process's pid; under torchrun the launcher's, which every rank shares, so all name one folder."""
    return os.getppid() if "TORCHELASTIC_RUN_ID" in os.environ else os.getpid()


def resolve(args, device, parser, extension=None):
    """Fill what the command line left to the preset, then check what needs the sizes."""
    args.preset = args.preset if args.preset != "auto" else auto_preset(device.type)
    for key, value in {**PRESETS[args.preset], **model_lib.MODEL_SIZES[PRESETS[args.preset]["size"]]}.items():
        if key != "size" and getattr(args, key) is None:
            setattr(args, key, value)
    args.data_dir = args.data_dir or prepare_data.default_out_dir(args.dataset, args.tokenizer)
    args.decay_steps = args.decay_steps or args.max_steps
    args.out_dir = args.out_dir or os.path.join("runs", f"{time.strftime('%Y%m%d-%H%M%S')}-{args.accum}-guard-"
                                                        f"{args.guard}-{launcher_pid()}")   # two at once: two names
    (extension or Extension()).check_sizes(args, parser)
    if args.schedule == "cosine" and args.min_lr > args.lr:
        parser.error(f"--min-lr {args.min_lr:g} is above --lr {args.lr:g}: the cosine would climb; lower --min-lr")
    if args.n_embd % args.n_head:
        parser.error(f"--n-embd {args.n_embd} is not a multiple of --n-head {args.n_head}")
    block = args.block_n or BF16_STATE_BLOCK_N
    if args.block_n and (args.block_n < 16 or args.block_n > 128 or args.block_n & (args.block_n - 1)):
        parser.error(f"--block-n {args.block_n}: the kernel's Triton path (a GPU) runs key blocks of 16, 32, 64 or "
                     f"128; give one of them (or 0, the kernel's 128)")
    if args.block_size > block and args.block_size % block:
        parser.error(f"--block-size {args.block_size} is not a whole number of --block-n {block} key blocks: the "
                     f"last block of a row would be partial; give a multiple of {block}")
    return args


def key_blocks_per_row(args):
    """How many key blocks the longest row streams through, each rounding the bf16 state once: the
    rescale across blocks (alpha = exp(m_old - m_new)) happens only where there are 2 or more."""
    return max(1, args.block_size // (args.block_n or BF16_STATE_BLOCK_N))


def qk_norm_from_step_0(args):
    return args.qknorm == "always"


def model_config(args):
    """The GPTConfig of the flags: a field takes its own-named flag (a new model option is a flag and a field:
    README, "Fork it"); block_n 0 and --round auto become None (the kernel's defaults), --qknorm always
    becomes qk_norm. An extension may change it (Extension.model_config)."""
    fields = [f.name for f in dataclasses.fields(model_lib.GPTConfig)]
    same_name = {name: getattr(args, name) for name in fields if hasattr(args, name)}
    rounding = None if args.round == "auto" else () if args.round == "none" else tuple(args.round.split(","))
    return model_lib.GPTConfig(**{**same_name, "block_n": args.block_n or None, "rounding": rounding,
                                  "qk_norm": qk_norm_from_step_0(args)})


def padded_vocab(n):
    """n tokens padded to a multiple of 64 for faster matmuls; padding rows are never targets."""
    return 64 * math.ceil(n / 64)


class Extension:
    """A plug-in to train.py, train.main(extension=...): here one doing nothing. It may bring flags of its own,
    refuse settings, change the model's config, and act at the places the loop calls it (lab/train_assay.py:
    the lab's assay). The root imports no extension: a command that runs with one imports it."""
    command = "train.py"                                         # how to run with it (its --help, refusals)

    def add_flags(self, parser, add): pass                       # build_parser's add(group, flag, default, help)
    def refusals(self, args, typed): return []                   # (refused, why and what to do instead)
    def check_sizes(self, args, parser): pass                    # once the preset gave the model's sizes
    def model_config(self, args, config): return config          # the GPTConfig of the flags, or its own
    def start(self, args, model, first_batch, autocast): pass    # the model built, before step 0 (or resume)
    def begin_step(self, step): pass                             # before the step's first forward
    def after_micro_backward(self, model, x, y, autocast, micro_steps): pass   # each micro-batch's backward
    def after_backward(self, model, dist): pass                  # the step's gradients, before clipping
    def before_update(self, model): pass                         # around optimizer.step()
    def after_update(self, model): pass
    def log_stats(self): return {}                               # added to the step's log record
    def parts(self): return {}                                   # what the checkpoint keeps, by name


# ----------------------------------------------------------------------------------------------------------------
# Processes, the device, the data

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
        flag = bool(flag)
        return flag if self.world == 1 else bool(self.all_reduce(torch.tensor(float(flag), device=self.device), "max"))

    def check_same(self, value, what):
        """Refuse, before any rank writes, a `value` the ranks do not all share (the run folder: a rank
        writing its own would split one run in two)."""
        if self.world == 1:
            return
        values = [None] * self.world
        torch.distributed.all_gather_object(values, value)
        if len(set(values)) > 1:
            named = ", ".join(sorted(set(values)))
            raise SystemExit(f"error: the {self.world} processes name different {what}s ({named}): give "
                             f"--out-dir")

    def close(self):
        if self.world > 1:
            torch.distributed.destroy_process_group()


def device_name(flag, local_rank=0):
    """--device as a torch device name, or a one-line error saying what this machine has."""
    if flag == "auto":
        flag = "cuda" if torch.cuda.is_available() else "cpu"
    if flag == "cpu":
        return flag
    if not (flag == "cuda" or flag.startswith("cuda:") and flag[5:].isdigit()):
        raise SystemExit(f"error: --device {flag!r}: give auto, cpu, cuda or cuda:N")
    if not torch.cuda.is_available():
        raise SystemExit(f"error: --device {flag}: this machine has no CUDA GPU (or torch no CUDA): use cpu or auto")
    index = local_rank if flag == "cuda" else int(flag[5:])
    if index >= torch.cuda.device_count():
        raise SystemExit(f"error: --device {flag}: this machine has {torch.cuda.device_count()} CUDA devices")
    return f"cuda:{index}"


def tune_cpu_allocator():
    """Keep freed memory in the process (glibc malloc; jemalloc and tcmalloc do by default): past its mmap
    threshold glibc serves each large temporary with fresh pages, whose faults slowed the attention twin
    (lab/MEASUREMENTS.md)."""
    try:
        import ctypes
        libc = ctypes.CDLL("libc.so.6")
    except OSError:   # not glibc (macOS, Windows, musl): nothing to tune
        return
    M_TRIM_THRESHOLD, M_TOP_PAD, M_MMAP_THRESHOLD = -1, -2, -3   # glibc's mallopt parameters
    for param, value in ((M_MMAP_THRESHOLD, 1 << 30), (M_TRIM_THRESHOLD, 1 << 30), (M_TOP_PAD, 64 << 20)):
        libc.mallopt(param, value)


def check_memory(args, device):
    """A rough bound on a CPU run's memory (a few of one key block's attention scores per query row, the
    activations the backward keeps) against what is free: an error, not hours of swapping. A GPU fails fast."""
    if device.type != "cpu" or not hasattr(os, "sysconf"):
        return
    try:
        free = os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (ValueError, OSError):
        return
    B, T, L, C = args.batch_size, args.block_size, args.n_layer, args.n_embd
    need = 4 * 4 * B * args.n_head * T * min(T, args.block_n or 128) + 4 * 20 * B * T * L * C   # fp32 bytes
    if need > free:
        raise SystemExit(f"error: about {need / 2**30:.1f} GiB needed, {free / 2**30:.1f} free: lower "
                         f"--block-size or --batch-size")


def ensure_data(args, dist):
    """Prepare the dataset on first use when prepare_data.py can make it (one process per node),
    into a folder that is new or empty: one that holds anything else is never written over."""
    if os.path.exists(os.path.join(args.data_dir, "meta.json")):
        return
    held = prepare_data.foreign_files(args.data_dir, args.dataset)   # a stopped or killed build's own files aside
    if held:
        shown = ", ".join(held[:4]) + (", ..." if len(held) > 4 else "")
        raise SystemExit(f"error: {args.data_dir} has no meta.json but holds {shown}, left alone: rebuild it (`python "
                         f"prepare_data.py --dataset text --input FILES --tokenizer {args.tokenizer} --out-dir "
                         f"{args.data_dir}`) or give another --data-dir")
    if args.dataset not in ("pycode", "shakespeare"):
        raise SystemExit(f"error: no prepared data in {args.data_dir} (meta.json missing): run `python prepare_data.py "
                         f"--dataset {args.dataset} --tokenizer {args.tokenizer} --out-dir {args.data_dir} ...` first")
    if dist.local_rank == 0:
        print(f"no data in {args.data_dir}: preparing the {args.dataset} dataset, {args.tokenizer} tokens (once)")
        try:
            prepare_data.prepare(dataset=args.dataset, out_dir=args.data_dir, tokenizer=args.tokenizer)
        except prepare_data.DataError as e:
            raise SystemExit(f"error: {e.code}")
    if dist.world > 1:   # the other ranks wait for the data
        torch.distributed.barrier()


# ----------------------------------------------------------------------------------------------------------------
# The run directory

def versions(device):
    """What config.json records to replay a run: software versions, the device, the git commit."""
    import triton
    commit = git("rev-parse", "HEAD") or None
    return {"python": platform.python_version(), "torch": torch.__version__, "triton": triton.__version__,
            "numpy": np.__version__, "device": str(device), "host": platform.node(), "git_commit": commit,
            "git_dirty": bool(git("status", "--porcelain")) if commit else None,
            "gpu": torch.cuda.get_device_name(device) if device.type == "cuda" else None,
            # a CPU's sums follow its thread count and the machine (one seed and packages differed by step 9
            # on two machines: lab/MEASUREMENTS.md); these say whether a replay can be bit for bit
            "torch_threads": torch.get_num_threads(), "cpu": cpu_name(),
            "cpu_capability": torch.backends.cpu.get_cpu_capability()}


def cpu_name():
    """The CPU's model name (Linux's /proc/cpuinfo; elsewhere what platform says, or None)."""
    try:
        with open("/proc/cpuinfo") as f:
            return next((line.split(":", 1)[1].strip() for line in f if line.startswith("model name")), None)
    except OSError:
        return platform.processor() or None


def git(*cmd):
    try:
        return subprocess.run(["git", *cmd], capture_output=True, text=True, timeout=10, cwd=HERE).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return ""


def save_source(out_dir, run_versions):
    """An edited tree cannot be replayed from its commit: save `git diff` with the new files as
    source.diff (`git apply` it on that commit); without git, copy every .py file to source/."""
    if run_versions["git_commit"] is None:
        os.makedirs(os.path.join(out_dir, "source"), exist_ok=True)
        for name in [name for name in sorted(os.listdir(HERE)) if name.endswith(".py")]:
            shutil.copyfile(os.path.join(HERE, name), os.path.join(out_dir, "source", name))
        return
    if not run_versions["git_dirty"]:
        return
    new = git("ls-files", "--others", "--exclude-standard").splitlines()
    patch = git("diff", "--binary", "HEAD") + "".join(
        "\n" + git("diff", "--binary", "--no-index", "/dev/null", path) for path in new)
    with open(os.path.join(out_dir, "source.diff"), "w") as f:
        f.write(patch.strip() + "\n")


def start_run(args, typed, master=True):
    """New run: refuse a folder that holds another. Resume: the saved flags, only safe changes; a
    run without a checkpoint starts over from step 0 with its config.json flags."""
    if os.path.exists(args.out_dir) and not os.path.isdir(args.out_dir):
        raise SystemExit(f"error: --out-dir {args.out_dir} is a file: give a folder")
    paths = {name: os.path.join(args.out_dir, name) for name in ("config.json", "log.jsonl", *CHECKPOINTS)}
    if os.path.exists(paths["log.jsonl"] + ".gz") and not os.path.exists(paths["log.jsonl"]):
        raise SystemExit(f"error: {args.out_dir} holds a kept result (log.jsonl.gz): give another --out-dir")
    if master:
        claim(args)
    held = [p for p in paths.values() if os.path.exists(p)]
    checkpoints = [paths[name] for name in CHECKPOINTS if os.path.exists(paths[name])]
    if not checkpoints and not os.path.exists(paths["config.json"]) and (held or args.resume):   # nothing to resume
        raise SystemExit(f"error: {args.out_dir} holds no run to resume (no config.json, no checkpoint): " + (
            "move its log.jsonl away to start over there, or give another --out-dir" if held else "drop --resume"))
    if not args.resume:
        if held:
            how = "" if checkpoints else " (it saved no checkpoint: it starts over at step 0)"
            raise SystemExit(f"error: {args.out_dir} already holds a run ({', '.join(held)}): continue it with "
                             f"--resume{how}, or choose another --out-dir")
        return args, None, {}
    state = newest_checkpoint(paths["ckpt.pt"]) if checkpoints else None
    saved = state["args"] if state else read_saved_args(paths["config.json"])
    config = read_saved_args(paths["config.json"]) if state and os.path.exists(paths["config.json"]) else saved
    if differ := [f"{k} {saved.get(k)} vs {config.get(k)}" for k in MODEL_SHAPE if config.get(k) != saved.get(k)]:
        raise SystemExit(f"error: the checkpoint and config.json in {args.out_dir} disagree ({', '.join(differ)}): "
                         f"resume a folder whose files are one run's")
    here = prepare_data.default_out_dir(saved["dataset"], saved["tokenizer"])
    if "data_dir" not in typed and os.path.normpath(saved["data_dir"]).split(os.sep)[-2:] == here.split(os.sep)[-2:]:
        saved = {**saved, "data_dir": here}   # the default folder of the checkout it ran in: this checkout's
    used = [f"--{k.replace('_', '-')} {saved[k]}" for k, unused in ASSAY_UNUSED.items()
            if k not in vars(args) and saved.get(k, unused) != unused]
    if used:   # a run that used the assay goes on with it
        raise SystemExit(f"error: this run used the lab's assay ({', '.join(used)}): resume it with "
                         f"`{ASSAY_COMMAND} --resume --out-dir {args.out_dir}`")
    conflicts = [f"--{k.replace('_', '-')} {v} (saved: {saved.get(k)})" for k, v in typed.items() if k in saved
                 and saved[k] != v and k not in RESUMABLE_CHANGES and not (k == "preset" and v == "auto")]
    if conflicts:
        raise SystemExit(f"error: --resume keeps the saved flags, but these differ: {'; '.join(conflicts)}: drop "
                         f"them, or start a new run in another --out-dir")
    changed = {k: [saved.get(k), v] for k, v in typed.items()
               if k in RESUMABLE_CHANGES - {"resume"} and saved.get(k) != v}
    merged = {**vars(args), **saved, **{k: v for k, v in typed.items() if k in RESUMABLE_CHANGES}, "resume": True}
    # a run stopped in its last step or eval (an older train.py called it interrupted) is finished by --resume
    if state is not None and (state["step"] > merged["max_steps"] or state["step"] == merged["max_steps"]
                              and last_status(paths["log.jsonl"]) in ("completed", "collapsed")):
        raise SystemExit(f"error: the run already reached step {state['step']}: give a larger --max-steps")
    return argparse.Namespace(**merged), state, changed


def last_status(log):
    """The status of the log's end record where its last start, resume or end record is one; else None (it
    is running, or stopped without one). A line cut short is skipped."""
    status = None
    try:
        with open(log, "rb") as f:
            for line in f:
                try:
                    record = json.loads(line)
                except ValueError:
                    continue
                if isinstance(record, dict) and record.get("event") in ("start", "resume", "end"):
                    status = record.get("status") if record["event"] == "end" else None
    except OSError:
        return None
    return status


def claim(args):
    """One writer per run folder: a lock on <out_dir>/.lock naming its pid, held till the process ends (kill -9 too)."""
    made, held = not os.path.isdir(args.out_dir), HELD.pop(os.path.realpath(args.out_dir), None)
    held and held.close()   # this process's earlier run of the folder (a resume after it, in one process)
    with writing(args.out_dir):
        os.makedirs(args.out_dir, exist_ok=True)
        lock = HELD[os.path.realpath(args.out_dir)] = open(os.path.join(args.out_dir, ".lock"), "a+")
    try:
        if fcntl is None:   # Windows
            raise OSError("no fcntl")
        fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        raise SystemExit(f"error: {args.out_dir} is in use by process {open(lock.name).read().strip() or '?'} (a run "
                         f"writing it): wait for it to end or stop it, or give another --out-dir") from None
    except OSError:   # a file system without locks (ENOLCK on some NFS mounts): a pid file instead
        claim_by_pid_file(args.out_dir)
    lock.truncate(0)
    print(os.getpid(), file=lock, flush=True)
    if made:   # a folder it made and left holding only its locks (a refusal, Ctrl-C) goes again
        atexit.register(remove_if_only_locks, args.out_dir)


def remove_if_only_locks(out_dir):
    if os.path.isdir(out_dir) and set(os.listdir(out_dir)) <= {".lock", PID_LOCK}:
        shutil.rmtree(out_dir)


PID_LOCK = ".lock.pid"   # the lock where flock fails: a file only one process can create, naming its pid


def claim_by_pid_file(out_dir):
    """One writer without flock: <out_dir>/.lock.pid, made whole by a hard link (which fails where the name
    exists, on NFS too), naming its pid; one whose process is gone (kill -9) is taken over, one whose process
    lives refuses the start. Removed when this process ends."""
    path, mine = os.path.join(out_dir, PID_LOCK), os.path.join(out_dir, f"{PID_LOCK}.{os.getpid()}")
    with writing(out_dir, "this file system has no flock and no hard links to lock it: give an --out-dir on "
                          "another disk"):
        with open(mine, "w") as f:
            f.write(f"{os.getpid()}\n")
        try:
            while True:
                try:
                    os.link(mine, path)
                    break
                except FileExistsError:
                    holder = pid_in(path)
                    if holder not in (None, os.getpid()) and pid_alive(holder):
                        raise SystemExit(f"error: {out_dir} is in use by process {holder} ({path}; this "
                                         f"file system has no flock): wait for it to end or stop it, or give "
                                         f"another --out-dir; if process {holder} is no train.py, remove "
                                         f"{path}") from None
                    with contextlib.suppress(FileNotFoundError):
                        os.remove(path)   # its writer is gone (a kill -9), or it was this process
        finally:
            os.remove(mine)
    atexit.register(release_pid_file, path)


def release_pid_file(path):
    if pid_in(path) == os.getpid():
        os.remove(path)


def pid_in(path):
    try:
        with open(path) as f:
            return int(f.read())
    except (OSError, ValueError):
        return None


def pid_alive(pid):
    if os.name == "nt":   # os.kill would end it: taken as alive, the refusal says how to go on
        return True
    try:
        os.kill(pid, 0)   # signal 0: only whether it exists
    except ProcessLookupError:
        return False
    except PermissionError:   # it exists, under another user
        return True
    return True


def write_whole(path, write):
    """`path` written by write(file) whole or not at all: a temp file, then a rename (a failed write
    removes the temp file and raises)."""
    try:
        with open(path + ".tmp", "w") as f:
            write(f)
        os.replace(path + ".tmp", path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.remove(path + ".tmp")
        raise


def say(line, file=None):
    """print, flushed; on a terminal that closed (SIGHUP: every write to it fails with EIO) the line is
    dropped, so that the run still reaches its checkpoint (the log holds every record)."""
    try:
        print(line, file=file or sys.stdout, flush=True)
    except OSError:
        pass


@contextlib.contextmanager
def writing(path, what="give an --out-dir on a writable disk with free space"):
    try:   # an OSError (a full or read-only disk, a folder under a file) as one line naming the path
        yield
    except OSError as e:
        raise SystemExit(f"error: cannot write {path} ({e.strerror or e}): {what}") from None


class RunDir:
    """The run directory (--out-dir) as the loop sees it: start record, checkpoints, way back."""

    def __init__(self, args, dist, data):   # data: prepare_data.TokenWindows.identity, what the run trains on
        self.args, self.dist, self.data = args, dist, data
        self.ckpt = os.path.join(args.out_dir, "ckpt.pt")

    def start_log(self, params, step, resumed, changed):
        """log.jsonl with a start (or resume) record, returned as the log; a new run saves config.json, source.diff."""
        args, dist, log = self.args, self.dist, os.path.join(self.args.out_dir, "log.jsonl")
        run_versions, config_json = versions(dist.device), os.path.join(args.out_dir, "config.json")
        new = dist.master and not resumed and not os.path.exists(config_json)
        try:
            if new:   # source.diff first: config.json, whole or absent, says a run began here
                with writing(args.out_dir):
                    save_source(args.out_dir, run_versions)
                    write_whole(config_json, lambda f: json.dump(
                        {"args": vars(args), "versions": run_versions, "command": sys.argv, "data": self.data,
                         "world_size": dist.world, "params": params,
                         "key_blocks_per_row": key_blocks_per_row(args),
                         "started": time.strftime("%Y-%m-%d %H:%M:%S %Z")}, f, indent=2))
            self.start_record(log, params, step, resumed, changed, run_versions)
        except SystemExit:   # a full disk at the first write: undo it, so that nothing refuses the next start
            if new:
                for name in ("config.json", "log.jsonl", "source.diff"):
                    with contextlib.suppress(OSError):
                        os.remove(os.path.join(args.out_dir, name))
            raise
        return self

    def start_record(self, log, params, step, resumed, changed, run_versions):
        args, dist = self.args, self.dist
        with writing(log):
            self.file = open(log, "ab+") if dist.master else None
            if self.file and self.file.seek(0, 2) and (self.file.seek(-1, 2), self.file.read(1))[1] != b"\n":
                self.file.write(b"\n")   # a line cut short (kill -9, a full disk): the next record starts a line
        over = " (it had saved no checkpoint: starting over)" if args.resume and not resumed else ""
        self.write({"event": "resume" if args.resume else "start", "step": step, "from_checkpoint": resumed,
                   "versions": run_versions, "world_size": dist.world, "command": sys.argv, "changed": changed,
                   "data": self.data, "key_blocks_per_row": key_blocks_per_row(args)},
                   f"{'resuming' if args.resume else 'starting'} {args.out_dir} at step {step}{over}: {args.preset} "
                   f"preset, {args.arch} {args.n_layer}x{args.n_embd}, {params / 1e6:.2f}M params, {args.tokenizer} "
                   f"tokens, accum {args.accum} with {key_blocks_per_row(args)} key blocks per row (block "
                   f"{args.block_n or BF16_STATE_BLOCK_N} of {args.block_size}), guard {args.guard}, on {dist.device} x{dist.world}")

    def write(self, record, line=None):
        """A record in log.jsonl, for programs (one JSON object a line, flushed), and a line for people."""
        if self.file is None:
            return
        with writing(self.file.name):
            self.file.write((json.dumps(record) + "\n").encode())
            self.file.flush()
        if line:
            say(line)

    def save(self, step, parts):
        """ckpt.pt: all it takes to go on exactly; all ranks take part (RNG states are gathered). Temp file,
        fsync, old one to .prev, rename: a crash at any time leaves a whole checkpoint."""
        state = {"format": CHECKPOINT_FORMAT, "step": step, "args": vars(self.args),
                 **{name: part.state_dict() for name, part in parts.items() if part is not None},
                 "data_content_sha256": self.data["content_sha256"], "rng": rng_state(self.dist)}
        if self.dist.master:
            with writing(self.ckpt + ".tmp", "the previous checkpoint is kept: make room, then --resume"), \
                    open(self.ckpt + ".tmp", "wb") as f:
                torch.save(state, f)
                f.flush()
                os.fsync(f.fileno())
            if os.path.exists(self.ckpt):
                os.replace(self.ckpt, self.ckpt + ".prev")
            os.replace(self.ckpt + ".tmp", self.ckpt)

    def restore(self, state, parts):
        if state.get("data_content_sha256") != self.data["content_sha256"]:
            saved = state.get("data_content_sha256")
            raise SystemExit(f"error: {self.args.data_dir} is not the data this run started with (content hash "
                             f"{self.data['content_sha256']:.12} != {saved!s:.12}): resume on the original data")
        for name, part in parts.items():
            if part is not None:
                part.load_state_dict(state[name])
        set_rng_state(state["rng"], self.dist)
        return state["step"]


def read_saved_args(path):
    try:
        with open(path) as f:
            return json.load(f)["args"]
    except (OSError, ValueError, KeyError) as e:
        raise SystemExit(f"error: cannot read the run's flags from {path} ({type(e).__name__}): start a new run")


def newest_checkpoint(path):
    """The checkpoint to resume from: ckpt.pt; without it, the newest whole one that a crash inside
    RunDir.save left (ckpt.pt.tmp, then ckpt.pt.prev). None loads: refuse, never start over."""
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
    raise SystemExit(f"error: {path} is missing and {' and '.join(found)} cannot be read: the run cannot resume; "
                     f"start a new run in another --out-dir")


def load_checkpoint(path):
    """weights_only=True: tensors, numbers, strings, lists, dicts; a pickle running code fails."""
    try:
        state = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as e:  # a truncated zip, a foreign pickle: many exception types
        hint = f"; the previous checkpoint is {path}.prev: move it to {path} to resume from there" \
            if os.path.exists(path + ".prev") else ""
        why = (str(e).splitlines() or ["empty file" if os.path.getsize(path) == 0 else "no message"])[0][:200]
        raise SystemExit(f"error: cannot read checkpoint {path} ({type(e).__name__}: {why}): it is truncated, from "
                         f"an older train.py, or not a checkpoint{hint}")
    if not isinstance(state, dict) or state.get("format") != CHECKPOINT_FORMAT:
        raise SystemExit(f"error: {path} is not a checkpoint written by this train.py: use the one that wrote it")
    return state


def rng_state(dist):
    """Every rank's RNG states (dropout differs per rank), as tensors and numbers."""
    kind, keys, pos, has_gauss, cached = np.random.get_state()
    cuda = torch.cuda.get_rng_state_all() if torch.cuda.is_available() else None
    state = {"python": random.getstate(), "torch": torch.get_rng_state(), "cuda": cuda,
             "numpy": [kind, torch.from_numpy(keys.astype(np.int64)), pos, has_gauss, cached]}
    if dist.world == 1:
        return [state]
    states = [None] * dist.world
    torch.distributed.all_gather_object(states, state)
    return states


def set_rng_state(states, dist):
    if len(states) != dist.world:   # the weights, optimizer and batches still resume exactly
        print(f"warning: the checkpoint holds {len(states)} processes' RNG states, not {dist.world}: dropout differs")
        return
    state = states[dist.rank]
    random.setstate(state["python"])
    kind, keys, pos, has_gauss, cached = state["numpy"]
    np.random.set_state((kind, keys.numpy().astype(np.uint32), pos, has_gauss, cached))
    torch.set_rng_state(state["torch"])
    if state["cuda"] is not None and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


# Ctrl-C, kill, and a terminal that closed (SIGHUP; none on Windows)
STOP_SIGNALS = [signal.SIGINT, signal.SIGTERM] + ([signal.SIGHUP] if hasattr(signal, "SIGHUP") else [])


class StopSignal:
    """SIGINT / SIGTERM / SIGHUP: the first stops the loop after this step, with a checkpoint; a second
    ends the process at once. Saves are atomic, so `--resume` goes on from the last one."""

    def __init__(self):
        self.signum = None
        for sig in STOP_SIGNALS:
            signal.signal(sig, self._handle)

    def _handle(self, signum, frame):
        self.signum = signum
        for sig in STOP_SIGNALS:
            signal.signal(sig, signal.SIG_DFL)
        say(f"\n{signal.Signals(signum).name}: stopping after this step with a checkpoint; send it again to "
            f"stop at once", file=sys.stderr)

    def __bool__(self):
        return self.signum is not None
