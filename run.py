"""
The run around train.py's loop, which its reader can skip: the flags, the presets and refusals,
the processes and the device, the data on first use (the run folder is rundir.py's). A value comes
from the command line, else from --preset, else from the flag's default.
"""
import argparse
import dataclasses
import math
import os
import sys
import time

import torch

import model as model_lib
import prepare_data
import tokenizer
from attention_kernel import ACCUM_MODES, BF16_STATE_BLOCK_N, ROUNDING_SOURCES
from guard import ACTIONS, DEFAULT_ACTION, DEFAULT_THRESHOLD, SCOPES, SIGNALS

# Training defaults per preset, a column per flag; the model sizes are model.MODEL_SIZES[size].
PRESET_COLUMNS = ("size", "tokenizer", "batch_size", "grad_accum", "max_steps", "lr", "min_lr",
                  "warmup_steps", "schedule", "log_interval", "eval_interval", "eval_iters",
                  "ckpt_interval", "block_n")
PRESETS = {name: dict(zip(PRESET_COLUMNS, row)) for name, row in {
    # block_n: the key block where the bf16 state is rounded (0: the kernel's, 128). The fault
    # lives in the streaming rescale across key blocks, so a preset that shows it streams 4 per row
    # (the H200 collapse's 512 / 128, SOURCES.md): 32-key blocks at the CPU model's context of 128.
    # The lab preset keeps one 128-key block per row: the claims 3-6 assay injects its own error.
    # demo (auto's pick on a CPU): the cpu model at an lr that makes its logits run away (README)
    "demo":   ("cpu", "byte", 8, 1, 300, 3e-2, 3e-2, 20, "constant", 10, 100, 4, 100, 32),
    "cpu":    ("cpu", "byte", 8, 1, 100, 3e-3, 3e-4, 10, "cosine", 10, 50, 4, 50, 32),
    # lab (the claims sweeps of RESULTS.md): the cpu model at a healthy lr, held constant so that
    # an injected error meets the same optimizer all run long
    "lab":    ("cpu", "byte", 8, 1, 300, 3e-3, 3e-3, 20, "constant", 10, 100, 4, 100, 0),
    # stream (claim 1 at CPU scale, lab/preregistered/claim1-stream.md): the lab's model and lr
    # with 4 key blocks per row, long enough for a slow drift; the final val loss on 16 batches
    "stream": ("cpu", "byte", 8, 1, 4000, 3e-3, 3e-3, 20, "constant", 10, 500, 16, 500, 32),
    "assay":  ("assay", "gpt2", 32, 1, 2000, 2e-3, 2e-3, 200, "constant", 10, 250, 20, 500, 0),
    "gpt2":   ("gpt2", "gpt2", 16, 32, 60000, 1e-3, 1e-4, 2000, "cosine", 10, 1000, 50, 1000, 0),
    "gpt2-medium": ("gpt2-medium", "gpt2", 8, 64, 60000, 6e-4, 6e-5, 2000, "cosine", 10, 1000,
                    50, 1000, 0),
}.items()}
PRESET_KEYS = {k for rows in (PRESETS, model_lib.MODEL_SIZES) for row in rows.values() for k in row}
# Flags that may change when a run is resumed; any other difference from the saved run is an error.
RESUMABLE_CHANGES = {"max_steps", "log_interval", "eval_interval", "eval_iters", "ckpt_interval",
                     "compile", "on_collapse", "resume", "device", "out_dir", "data_dir"}
# The lab's assay runs as ASSAY_COMMAND, train.py with its extension (lab/train_assay.py). Its
# flags, typed to train.py or set (to other than these unused values) in a run resumed here, get
# one line naming that command: the root knows their names, and imports nothing from lab/.
ASSAY_COMMAND = "python -m lab.train_assay"
ASSAY_UNUSED = {"inject_site": "none", "inject_scale": None, "inject_coherence": None,
                "inject_layers": "all", "qk_fix": "off", "probe": "off", "probe_k": 3}


class Extension:
    """A plug-in to train.py (train.main(extension=...)), here one doing nothing: it may add flags
    and refusals, change the model's config, and act where the loop calls it. The root imports
    none: a command that runs with one imports it (lab/train_assay.py: the lab's assay)."""
    command = "train.py"                                  # how to run with it: --help, refusals

    def add_flags(self, parser, add): pass                # add: build_parser's, below
    def refusals(self, args, typed): return []            # (refused, why, what to do): a new run's
    def check_sizes(self, args, parser): pass             # with the preset's sizes; a new run's too
    def model_config(self, args, config): return config   # the GPTConfig of the flags, or another
    def start(self, args, model, first_batch, autocast): pass   # the model built, before step 0
    def begin_step(self, step): pass                      # before the step's first forward
    def after_micro_backward(self, model, x, y, autocast, micro_steps): pass   # each micro-batch's
    def after_backward(self, model, dist): pass           # the step's gradients, before clipping
    def before_update(self, model): pass                  # around optimizer.step()
    def after_update(self, model): pass
    def log_stats(self): return {}                        # added to the step's log record
    def parts(self): return {}                            # what the checkpoint keeps, by name


# ------------------------------------------------------------------------------------------------
# The flags. Value types refuse nonsense in argparse's "argument --flag: ..." line; the parser's
# flag_defaults keeps each flag's default (None: the preset's).

def number(kind=float, low=None, high=None, above=False, below=False):
    """A parser of int or finite float values in [low, high] (above / below: bound excluded)."""
    def parse(text):
        try:
            x = kind(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text!r} is not an integer" if kind is int else
                                             f"{text!r} is not a number")
        if not math.isfinite(x):
            raise argparse.ArgumentTypeError(f"{text!r}: give a finite number")
        if low is not None and (x < low or above and x == low):
            bound = f"{'>' if above else '>='} {low}"
            raise argparse.ArgumentTypeError(f"{text} is too small: give a value {bound}")
        if high is not None and (x > high or below and x == high):
            bound = f"{'<' if below else '<='} {high}"
            raise argparse.ArgumentTypeError(f"{text} is too large: give a value {bound}")
        return x
    return parse


COUNT, SIZE = number(int, 1), number(int, 0)                  # at least 1; at least 0
POSITIVE, NONNEGATIVE = number(low=0, above=True), number(low=0)
FRACTION, PROBABILITY = number(low=0, high=1, below=True), number(low=0, high=1)


def rounding_sources(text):
    """--round: auto, none, or a comma-separated list of the kernel's rounding sources."""
    unknown = [s for s in text.split(",") if s not in ROUNDING_SOURCES]
    if text not in ("auto", "none") and unknown:
        raise argparse.ArgumentTypeError(f"{unknown[0]!r} is not a rounding source: give auto, "
                                         f"none, or some of {','.join(ROUNDING_SOURCES)}")
    return text


def build_parser(extension=None):
    extension = extension or Extension()
    p = argparse.ArgumentParser(prog=extension.command, allow_abbrev=False,
                                description="Train a GPT and watch (or guard) its QK channel.",
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.flag_defaults = {}

    def add(group, flag, default, help, **kw):
        # argparse's default stays None, which tells what was typed (a resume keeps the saved ones)
        name = flag[2:].replace("-", "_")
        p.flag_defaults[name] = default
        if name in PRESET_KEYS:
            help += " (default: from --preset)"
        elif default not in (None, False):
            help += f" (default: {default})"
        group.add_argument(flag, default=None, help=help, **kw)

    g = p.add_argument_group("data")
    add(g, "--dataset", "pycode", "pycode (torch's own .py files, prepared on first use) or text "
        "(prepared first: prepare_data.py)")
    add(g, "--tokenizer", None, "byte (the CPU presets) or gpt2 (GPT-2's BPE: the GPU presets); "
        "the vocabulary follows the data's meta.json", choices=list(tokenizer.TOKENIZERS))
    add(g, "--data-dir", "", "folder of train.bin, val.bin and meta.json, which names the "
        "tokenizer (empty: data/<dataset>, or data/<dataset>-byte for byte, beside train.py)")
    g = p.add_argument_group("model (sizes come from --preset unless given)")
    add(g, "--preset", "auto", "model and training defaults (auto: demo on a CPU, assay on a GPU)",
        choices=["auto", *PRESETS])
    add(g, "--arch", "gpt2", "gpt2: LayerNorm/GELU/learned positions; llama: "
        "RMSNorm/SwiGLU/rotary", choices=["gpt2", "llama"])
    add(g, "--n-layer", None, "layers", type=COUNT)
    add(g, "--n-head", None, "attention heads", type=COUNT)
    add(g, "--n-embd", None, "model width", type=COUNT)
    add(g, "--block-size", None, "context length", type=COUNT)
    add(g, "--dropout", 0.0, "dropout probability", type=FRACTION)
    g = p.add_argument_group("attention numerics (attention_kernel.py's docstring: the rounding)")
    add(g, "--attn-impl", "auto", "auto: the Triton kernel on CUDA, its PyTorch twin on a CPU; "
        "sdpa: PyTorch SDPA (fp32 only)", choices=["auto", "triton", "torch", "sdpa"])
    add(g, "--accum", "fp32", "the streaming-softmax state (m, l, O): fp32 (the repair), bf16 "
        "(the fault), bf16-safemax (the prior work's fix at the source)", choices=list(ACCUM_MODES))
    add(g, "--round", "auto", "the other bf16 rounding points, comma-separated: logits, pv, "
        "backward; none; or auto: logits,pv for bf16 inputs, so --accum changes the state alone",
        type=rounding_sources)
    add(g, "--attn-dtype", "bf16", "q, k, v enter attention in bf16 (as under a GPU's autocast), "
        "or native: in the dtype they were computed in", choices=["bf16", "native"])
    add(g, "--block-n", None, "key block of the streaming loop, where the bf16 state is rounded "
        "(0: the kernel's default, 128); context / block-n is the key blocks per row", type=SIZE)
    add(g, "--safemax-beta", 2.0, "bf16-safemax: shift repeated maxima by beta*max",
        type=number(low=1, above=True))
    add(g, "--qknorm", "off", "parameter-free QK-norm from step 0 (the always-on baseline)",
        choices=["off", "always"])
    add(g, "--softcap", 0.0, "tanh soft-cap of the logits from step 0 (0: off)", type=NONNEGATIVE)
    add(g, "--attn-scale", 0.0, "logit scale (0: 1/sqrt(head_dim)), often fixed with QK-norm",
        type=NONNEGATIVE)
    g = p.add_argument_group("monitor and QK-Guard (guard.py)")
    add(g, "--guard", "off", "QK-Guard: dormant until the signal first crosses --guard-threshold, "
        "then --guard-action stays on", choices=["on", "off"])
    add(g, "--guard-signal", "max-logit", "the signal, per layer and head", choices=list(SIGNALS))
    add(g, "--guard-threshold", None, "trigger level (default: the signal's, " + ", ".join(
        f"{s} {v:g}" for s, v in DEFAULT_THRESHOLD.items()) + "; see the README)", type=POSITIVE)
    add(g, "--guard-action", DEFAULT_ACTION, "qknorm (the paper's), qkclip (weight-side QK), or "
        "the non-QK controls lr-drop, clip, softcap, fp32-accum", choices=list(ACTIONS))
    add(g, "--guard-scope", "all", "act on every layer, or on crossed layers", choices=list(SCOPES))
    add(g, "--qkclip-tau", ACTIONS["qkclip"].tau, "qkclip: cap on each head's max logit",
        type=POSITIVE)
    add(g, "--lr-drop-factor", ACTIONS["lr-drop"].lr_factor, "lr-drop: multiply the lr by this",
        type=number(low=0, high=1, above=True))
    add(g, "--clip-tight", ACTIONS["clip"].clip_norm, "clip: gradient-norm clip after the trigger",
        type=POSITIVE)
    add(g, "--softcap-value", ACTIONS["softcap"].softcap, "softcap action: the cap c (Gemma 2: 50)",
        type=POSITIVE)
    add(g, "--monitor-interval", 1, "monitor (sigmas, guard check) every N steps", type=COUNT)
    add(g, "--power-iters", 1, "power iterations per monitored step", type=COUNT)
    add(g, "--collapse-margin", 1.0, "collapse: loss above its running min by this", type=POSITIVE)
    add(g, "--collapse-patience", 5, "... for this many logged steps in a row", type=COUNT)
    add(g, "--collapse-smoothing", 0.9, "EMA factor applied to logged losses first", type=FRACTION)
    add(g, "--collapse-grace", 100, "steps after the guard acts in which a loss transient is no "
        "collapse (a non-finite loss always is)", type=SIZE)
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
    g = p.add_argument_group("run (run.py, rundir.py)")
    add(g, "--out-dir", "", "run folder (empty: runs/<date>-<time>-<accum>-guard-<on|off>-<pid>)")
    add(g, "--resume", False, "continue the run in --out-dir from ckpt.pt", action="store_true")
    add(g, "--seed", 1337, "seed of the weights and batch order", type=number(int, 0, 2**63 - 1))
    add(g, "--device", "auto", "auto, cpu, cuda, cuda:N")
    add(g, "--dtype", "auto", "autocast (auto: bf16 on CUDA)", choices=["auto", "bf16", "fp32"])
    add(g, "--compile", False, "torch.compile the model", action="store_true")
    add(g, "--threads", 0, "CPU threads of torch's sums (0: torch's own, OMP_NUM_THREADS): their "
        "order follows the count, so runs at 1 and 2 differ in rounding order alone (the lab's "
        "A/A)", type=SIZE)
    add(g, "--log-interval", None, "steps between log records", type=COUNT)
    add(g, "--eval-interval", None, "steps between validation losses", type=COUNT)
    add(g, "--eval-iters", None, "batches per validation loss", type=COUNT)
    add(g, "--ckpt-interval", None, "steps between checkpoints", type=COUNT)
    p.epilog = "presets (set what the command line leaves unset):\n" + "\n".join(
        f"  {name:12s} " + " ".join(f"{k}={x}" for k, x in {**model_lib.MODEL_SIZES[row["size"]],
                                                             **row}.items() if k != "size")
        for name, row in PRESETS.items())
    return p


def parse_args(argv=None, extension=None):
    """(args with the flags' defaults, the flags typed, the parser); resolve() adds the preset's."""
    extension = extension or Extension()
    parser = build_parser(extension)
    for flag in [f.split("=", 1)[0] for f in (sys.argv[1:] if argv is None else argv)]:
        name = flag[2:].replace("-", "_") if flag.startswith("--") else None
        if name in ASSAY_UNUSED and name not in parser.flag_defaults:
            parser.error(f"{flag} is a flag of the lab's assay: run `{ASSAY_COMMAND}` with the "
                         f"same flags (lab/train_assay.py)")
    typed = {k: v for k, v in vars(parser.parse_args(argv)).items() if v is not None}
    args = argparse.Namespace(**{**parser.flag_defaults, **typed})
    if args.guard_threshold is None:   # the signal's default, as a number: config.json records it
        args.guard_threshold = DEFAULT_THRESHOLD[args.guard_signal]
    # a resumed run passed every refusal as it started, and may change only RESUMABLE_CHANGES
    checks = [("out_dir" not in typed, "--resume needs the --out-dir of the run")] if args.resume \
        else refusals(args, typed) + extension.refusals(args, typed)
    for refused, message in checks:
        if refused:
            parser.error(message)
    ignored = " ".join(f"--{k.replace('_', '-')}" for k in typed if k.startswith("guard_") or k in (
        "qkclip_tau", "lr_drop_factor", "clip_tight", "softcap_value"))
    if ignored and args.guard == "off" and not args.resume:   # a note: the lab's sweep gives its
        print(f"note: {ignored} act only with --guard on, and this run's guard is off",   # arms one
              file=sys.stderr)                                                 # set of extra flags
    return args, typed, parser


def refusals(args, typed):
    """(refused, why and what to do instead): settings that would do nothing or fail later."""
    guard_on, action = args.guard == "on", args.guard_action
    return [
        (guard_on and action == "qknorm" and args.qknorm == "always",
         "--guard-action qknorm has nothing to switch when --qknorm always is set"),
        (guard_on and action == "fp32-accum" and args.accum == "fp32",
         "--guard-action fp32-accum has nothing to switch when --accum is already fp32"),
        (args.guard_scope == "crossed" and action in ("lr-drop", "clip"),
         f"--guard-scope crossed: --guard-action {action} acts on the whole model; use "
         f"--guard-scope all"),
        (args.attn_impl == "sdpa" and ("block_n" in typed or "safemax_beta" in typed),
         "--block-n and --safemax-beta belong to the streaming-softmax kernel, not to --attn-impl "
         "sdpa"),
    ]


def uses_bf16(dtype_flag, device):
    """Whether a run's --dtype puts its forward under bf16 autocast (auto: on CUDA)."""
    return dtype_flag == "bf16" or (dtype_flag == "auto" and device.type == "cuda")


def auto_preset(device_type):
    return "demo" if device_type == "cpu" else "assay"


def launcher_pid():
    """This process's pid; under torchrun the launcher's, which every rank shares: one folder."""
    return os.getppid() if "TORCHELASTIC_RUN_ID" in os.environ else os.getpid()


def resolve(args, device, parser, extension=None):
    """Fill what the command line left to the preset, then check what needs the sizes."""
    args.preset = args.preset if args.preset != "auto" else auto_preset(device.type)
    preset = PRESETS[args.preset]
    for key, value in {**preset, **model_lib.MODEL_SIZES[preset["size"]]}.items():
        if key != "size" and getattr(args, key) is None:
            setattr(args, key, value)
    args.data_dir = args.data_dir or prepare_data.default_out_dir(args.dataset, args.tokenizer)
    args.decay_steps = args.decay_steps or args.max_steps
    name = f"{time.strftime('%Y%m%d-%H%M%S')}-{args.accum}-guard-{args.guard}-{launcher_pid()}"
    args.out_dir = args.out_dir or os.path.join("runs", name)   # two started at once: two names
    if args.resume:   # the run passed the checks below as it started, with its own sizes
        return args
    (extension or Extension()).check_sizes(args, parser)
    if args.schedule == "cosine" and args.min_lr > args.lr:
        parser.error(f"--min-lr {args.min_lr:g} is above --lr {args.lr:g}: the cosine would climb; "
                     f"lower --min-lr")
    if args.n_embd % args.n_head:
        parser.error(f"--n-embd {args.n_embd} is not a multiple of --n-head {args.n_head}")
    block = key_block(args)
    if args.block_n and args.block_n not in (16, 32, 64, 128):
        parser.error(f"--block-n {args.block_n}: the kernel's Triton path (a GPU) runs key blocks "
                     f"of 16, 32, 64 or 128; give one of them (or 0, the kernel's 128)")
    if args.block_size > block and args.block_size % block:
        parser.error(f"--block-size {args.block_size} is not a whole number of --block-n {block} "
                     f"key blocks: the last block of a row would be partial; give a multiple of "
                     f"{block}")
    capped = args.qknorm == "always" and qk_norm_bound(args) <= args.guard_threshold
    if args.guard == "on" and args.guard_signal == "max-logit" and (
            capped or 0 < args.softcap <= args.guard_threshold):
        parser.error("--guard-signal max-logit cannot cross --guard-threshold under QK-norm or a "
                     "smaller --softcap: use --guard-signal sigma-product")
    return args


def qk_norm_bound(args):
    """The largest |logit| under QK-norm: scale * head_dim (|q.k| <= head_dim, both RMS-normed)."""
    head_dim = args.n_embd // args.n_head
    return (args.attn_scale or head_dim ** -0.5) * head_dim


def key_block(args):
    """The key block where the bf16 state is rounded: --block-n, or the kernel's own."""
    return args.block_n or BF16_STATE_BLOCK_N


def key_blocks_per_row(args):
    """How many key blocks the longest row streams through, each rounding the bf16 state once: the
    rescale across blocks (alpha = exp(m_old - m_new)) happens only where there are 2 or more."""
    return max(1, args.block_size // key_block(args))


def model_config(args):
    """The GPTConfig of the flags: a field takes its own-named flag (a new model option is a flag
    and a field: README, "Fork it"); block_n 0 and --round auto become None (the kernel's
    defaults), --qknorm always qk_norm. An extension may change it (Extension.model_config)."""
    fields = [f.name for f in dataclasses.fields(model_lib.GPTConfig)]
    same_name = {name: getattr(args, name) for name in fields if hasattr(args, name)}
    rounding = {"auto": None, "none": ()}.get(args.round, tuple(args.round.split(",")))
    return model_lib.GPTConfig(**{**same_name, "block_n": args.block_n or None,
                                  "rounding": rounding, "qk_norm": args.qknorm == "always"})


# ------------------------------------------------------------------------------------------------
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
        if self.world == 1:
            return bool(flag)
        return bool(self.all_reduce(torch.tensor(float(bool(flag)), device=self.device), "max"))

    def check_same(self, value, what):
        """Refuse, before any rank writes, a `value` the ranks do not all share (the run folder: a
        rank writing its own would split one run in two)."""
        values = [value] * self.world
        if self.world > 1:
            torch.distributed.all_gather_object(values, value)
        if len(set(values)) > 1:
            raise SystemExit(f"error: the {self.world} processes name different {what}s "
                             f"({', '.join(sorted(set(values)))}): give --out-dir")

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
        raise SystemExit(f"error: --device {flag}: this machine has no CUDA GPU (or torch no "
                         f"CUDA): use cpu or auto")
    index = local_rank if flag == "cuda" else int(flag[5:])
    if index >= torch.cuda.device_count():
        raise SystemExit(f"error: --device {flag}: this machine has {torch.cuda.device_count()} "
                         f"CUDA devices")
    return f"cuda:{index}"


def check_memory(args, device):
    """A rough bound on a CPU run's memory (a few of one key block's attention scores per query
    row, the activations the backward keeps) against what is free: an error, not hours of swap."""
    try:
        free = os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (AttributeError, ValueError, OSError):   # no sysconf (Windows), or not this value
        free = math.inf
    B, T, L, C, H = args.batch_size, args.block_size, args.n_layer, args.n_embd, args.n_head
    need = 4 * (4 * B * H * T * min(T, key_block(args)) + 20 * B * T * L * C)   # fp32 bytes
    if device.type == "cpu" and need > free:   # a GPU fails fast by itself
        raise SystemExit(f"error: about {need / 2**30:.1f} GiB needed, {free / 2**30:.1f} free: "
                         f"lower --block-size or --batch-size")


def ensure_data(args, dist):
    """Prepare pycode on first use (one process per node), into a folder that is new or empty: one
    that holds anything else is never written over."""
    if os.path.exists(os.path.join(args.data_dir, "meta.json")):
        return
    held = prepare_data.foreign_files(args.data_dir)   # a stopped or killed build's own aside
    command = f"python prepare_data.py --tokenizer {args.tokenizer} --out-dir {args.data_dir}"
    if held:
        shown = ", ".join(held[:4]) + (", ..." if len(held) > 4 else "")
        raise SystemExit(f"error: {args.data_dir} has no meta.json but holds {shown}, left alone: "
                         f"move them away, or give another --data-dir")
    if args.dataset != "pycode":
        raise SystemExit(f"error: no prepared data in {args.data_dir} (meta.json missing): run "
                         f"`{command} --dataset {args.dataset} ...` first")
    if dist.local_rank == 0:
        print(f"no data in {args.data_dir}: preparing pycode, {args.tokenizer} tokens (once)")
        try:
            prepare_data.prepare(dataset="pycode", out_dir=args.data_dir, tokenizer=args.tokenizer)
        except prepare_data.DataError as e:
            raise SystemExit(f"error: {e.code}")
    if dist.world > 1:   # the other ranks wait for the data
        torch.distributed.barrier()
