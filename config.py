"""
The configuration of a training run: train.py's flags with their defaults and allowed values, the
presets, and the combinations refused before anything runs.

A value comes from the command line, else from --preset (auto: demo on a CPU, assay on a GPU), else
from the flag's default. Numbers are checked as parsed: a bad one fails in one line naming the flag.
"""
import argparse
import dataclasses
import math
import os
import time

import model as model_lib
import prepare_data
from assay import ACTIVATION_SITES, GRAD_SITES, INJECT_SITES, PROBE_MODES
from attention_kernel import ACCUM_MODES, ROUNDING_SOURCES
from guard import ACTIONS, DEFAULT_THRESHOLD, SCOPES, SIGNALS

# Training defaults per preset; the model sizes are model.MODEL_SIZES[preset["size"]].
PRESETS = {
    # demo (auto's pick on a CPU): the cpu model at an lr that makes its logits run away (README)
    "demo": dict(size="cpu", tokenizer="byte", batch_size=8, grad_accum=1, max_steps=300, lr=3e-2, min_lr=3e-2,
                 warmup_steps=20, schedule="constant", log_interval=10, eval_interval=100, eval_iters=4, ckpt_interval=100),
    "cpu": dict(size="cpu", tokenizer="byte", batch_size=8, grad_accum=1, max_steps=100, lr=3e-3, min_lr=3e-4,
                warmup_steps=10, schedule="cosine", log_interval=10, eval_interval=50, eval_iters=4, ckpt_interval=50),
    # lab (the claims sweeps of RESULTS.md): the cpu model at a healthy lr, held constant so that
    # an injected error meets the same optimizer all run long
    "lab": dict(size="cpu", tokenizer="byte", batch_size=8, grad_accum=1, max_steps=300, lr=3e-3, min_lr=3e-3,
                warmup_steps=20, schedule="constant", log_interval=10, eval_interval=100, eval_iters=4,
                ckpt_interval=100),
    "assay": dict(size="assay", tokenizer="gpt2", batch_size=32, grad_accum=1, max_steps=2000, lr=2e-3, min_lr=2e-3,
                  warmup_steps=200, schedule="constant", log_interval=10, eval_interval=250, eval_iters=20,
                  ckpt_interval=500),
    "gpt2": dict(size="gpt2", tokenizer="gpt2", batch_size=16, grad_accum=32, max_steps=60000, lr=1e-3, min_lr=1e-4,
                 warmup_steps=2000, schedule="cosine", log_interval=10, eval_interval=1000, eval_iters=50,
                 ckpt_interval=1000),
    "gpt2-medium": dict(size="gpt2-medium", tokenizer="gpt2", batch_size=8, grad_accum=64, max_steps=60000, lr=6e-4,
                        min_lr=6e-5, warmup_steps=2000, schedule="cosine", log_interval=10, eval_interval=1000,
                        eval_iters=50, ckpt_interval=1000),
}
def padded_vocab(n):
    """n tokens padded to a multiple of 64 for faster matmuls; padding rows are never targets."""
    return 64 * math.ceil(n / 64)


# Flags that may change when a run is resumed; any other difference from the saved run is an error.
RESUMABLE_CHANGES = {"max_steps", "log_interval", "eval_interval", "eval_iters", "ckpt_interval", "compile",
                     "on_collapse", "resume", "device", "out_dir"}
QK_FIXES = ("off", "clean-grad", "qknorm")
PRESET_KEYS = {key for values in (*PRESETS.values(), *model_lib.MODEL_SIZES.values()) for key in values}


# ----------------------------------------------------------------------------------------------------------------
# Value types: each refuses nonsense with a message argparse prints as "argument --flag: ...".

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


def injection_scale(text):
    """--inject-scale: a number > 0, or 'matched'."""
    return text if text == "matched" else POSITIVE(text)


def rounding_sources(text):
    """--round: auto, none, or a comma-separated list of the kernel's rounding sources."""
    unknown = [s for s in text.split(",") if s not in ROUNDING_SOURCES] if text not in ("auto", "none") else []
    if unknown:
        raise argparse.ArgumentTypeError(f"{unknown[0]!r} is not a rounding source: give auto, none, or some of "
                                         f"{','.join(ROUNDING_SOURCES)} separated by commas")
    return text


# ----------------------------------------------------------------------------------------------------------------
# The flags. The parser keeps each flag's default in p.flag_defaults, where None means "from the preset".

def build_parser():
    p = argparse.ArgumentParser(prog="train.py", description=__doc__.split("\n\n")[0].strip(),
                                formatter_class=argparse.RawDescriptionHelpFormatter)
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
    add(g, "--dataset", "pycode", "dataset name (pycode: this Python's own sources, prepared on "
        "first use; others: see prepare_data.py)")
    add(g, "--tokenizer", None, "byte (the CPU presets) or gpt2 (GPT-2's BPE: the GPU presets); "
        "the vocabulary follows the data's meta.json", choices=list(prepare_data.TOKENIZERS))
    add(g, "--data-dir", "", "folder of train.bin, val.bin and meta.json, which names the "
        "tokenizer (empty: data/<dataset>, or data/<dataset>-byte for byte, beside train.py)")

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

    g = p.add_argument_group("attention numerics (attention_kernel.py; the README has the table)")
    add(g, "--attn-impl", "auto", "auto: the Triton kernel on CUDA, its PyTorch twin on a CPU; "
        "sdpa: PyTorch SDPA (fp32 only)", choices=["auto", "triton", "torch", "sdpa"])
    add(g, "--accum", "fp32", "the streaming-softmax state (m, l, O): fp32 (the repair), bf16 (the "
        "fault), bf16-safemax (the prior work's fix at the source)", choices=list(ACCUM_MODES))
    add(g, "--round", "auto", "the other bf16 rounding points, comma-separated: logits, pv, backward "
        "(what each rounds: attention_kernel.py's docstring); none; or auto: logits,pv for bf16 "
        "inputs, so that --accum changes the state alone", type=rounding_sources)
    add(g, "--attn-dtype", "bf16", "q, k, v enter attention in bf16 (as under a GPU's autocast), "
        "or native: in the dtype they were computed in", choices=["bf16", "native"])
    add(g, "--block-n", 0, "key block of the streaming loop (0: the kernel's default)", type=SIZE)
    add(g, "--safemax-beta", 2.0, "bf16-safemax: shift repeated maxima by beta*max", type=number(low=1, above=True))
    add(g, "--qknorm", "off", "parameter-free QK-norm from step 0 (the always-on baseline)",
        choices=["off", "always"])
    add(g, "--softcap", 0.0, "tanh soft-cap of the logits from step 0 (0: off)", type=NONNEGATIVE)
    add(g, "--attn-scale", 0.0, "logit scale (0: 1/sqrt(head_dim)), often fixed with QK-norm",
        type=NONNEGATIVE)

    g = p.add_argument_group("monitor and QK-Guard (guard.py)")
    add(g, "--guard", "off", "QK-Guard: dormant until the signal first crosses --guard-threshold, "
        "then --guard-action stays on", choices=["on", "off"])
    add(g, "--guard-signal", "max-logit", "the signal, per layer and head", choices=list(SIGNALS))
    add(g, "--guard-threshold", 0.0, "trigger level (0: the signal's default, " + ", ".join(
        f"{s} {v:g}" for s, v in DEFAULT_THRESHOLD.items()) + "; see the README)", type=NONNEGATIVE)
    add(g, "--guard-action", "qknorm", "qknorm (the paper's), qkclip (weight-side QK), or the "
        "non-QK controls lr-drop, clip, softcap, fp32-accum", choices=list(ACTIONS))
    add(g, "--guard-scope", "all", "act on every layer, or on crossed layers", choices=list(SCOPES))
    add(g, "--qkclip-tau", 100.0, "qkclip: cap on each head's max logit", type=POSITIVE)
    add(g, "--lr-drop-factor", 0.1, "lr-drop: multiply the lr by this", type=number(low=0, high=1,
                                                                                    above=True))
    add(g, "--clip-tight", 0.1, "clip: gradient-norm clip after the trigger", type=POSITIVE)
    add(g, "--softcap-value", 50.0, "softcap action: the cap c (Gemma 2 uses 50)", type=POSITIVE)
    add(g, "--monitor-interval", 1, "monitor (sigmas, guard check) every N steps", type=COUNT)
    add(g, "--power-iters", 1, "power iterations per monitored step", type=COUNT)
    add(g, "--collapse-margin", 1.0, "collapse: loss above its running min by this", type=POSITIVE)
    add(g, "--collapse-patience", 5, "... for this many logged steps in a row", type=COUNT)
    add(g, "--collapse-smoothing", 0.9, "EMA factor applied to logged losses first", type=FRACTION)
    add(g, "--collapse-grace", 100, "steps after the guard acts in which a loss transient is no "
        "collapse (a non-finite loss always is)", type=SIZE)
    add(g, "--on-collapse", "stop", "what to do at a collapse", choices=["stop", "continue"])

    g = p.add_argument_group("the assay: a controlled error at any source, the QK-only fix, the causal probe "
                             "(assay.py)")
    add(g, "--inject-site", "none", "where the error enters: attn-out, mlp-in, mlp-out, residual "
        "(the forward: the model changes), delta (the backward: only dq, dk change), grad-wv, "
        "grad-mlp (W_v's, W_up's gradient)", choices=list(INJECT_SITES))
    add(g, "--inject-scale", None, "error rms over the rms of the signal it joins, or 'matched' "
        "(the bf16 fault's bias, per head, measured on the first batch)", type=injection_scale)
    add(g, "--inject-coherence", None, "probability that a head's error sign persists to the next "
        "step (1, the default: sign-coherent; 0.5: a random sign each step)", type=PROBABILITY)
    add(g, "--inject-layers", "all", "comma-separated layer indices, or all")
    add(g, "--qk-fix", "off", "QK-only fix, the fault left on: clean-grad (fault-free W_q, W_k "
        "gradients; backward sites) or qknorm (from step 0; forward sites)", choices=list(QK_FIXES))
    add(g, "--probe", "off", "project each step's W_q/W_k update off its top-k singular directions "
        "(qk-topk); controls: the whole update shrunk to the norm qk-topk leaves (qk-shrink), the next "
        "k directions (qk-nextk), a fixed random subspace (qk-fixed), W_v's or the MLP's top-k "
        "(v-topk, mlp-topk), equal energy elsewhere (equal-energy)", choices=list(PROBE_MODES))
    add(g, "--probe-k", 3, "singular directions the probe removes", type=COUNT)

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

    g = p.add_argument_group("run (runtime.py)")
    add(g, "--out-dir", "", "run directory (empty: runs/<date>-<time>-<accum>-guard-<on|off>)")
    add(g, "--resume", False, "continue the run in --out-dir from ckpt.pt", action="store_true")
    add(g, "--seed", 1337, "seed of the weights and of the batch order", type=SIZE)
    add(g, "--device", "auto", "auto, cpu, cuda, cuda:N")
    add(g, "--dtype", "auto", "autocast (auto: bf16 on CUDA)", choices=["auto", "bf16", "fp32"])
    add(g, "--compile", False, "torch.compile the model", action="store_true")
    add(g, "--log-interval", None, "steps between log records", type=COUNT)
    add(g, "--eval-interval", None, "steps between validation losses", type=COUNT)
    add(g, "--eval-iters", None, "batches per validation loss", type=COUNT)
    add(g, "--ckpt-interval", None, "steps between checkpoints", type=COUNT)
    p.epilog = "presets (set what the command line leaves unset):\n" + "\n".join(
        f"  {name:12s} " + " ".join(f"{k}={x}" for k, x in {**model_lib.MODEL_SIZES[v['size']], **v}.items()
                                    if k != "size") for name, v in PRESETS.items())
    return p


def parse_args(argv=None):
    """(args with the flags' defaults, the flags typed, the parser); resolve() adds the preset's."""
    parser = build_parser()
    typed = {k: v for k, v in vars(parser.parse_args(argv)).items() if v is not None}
    args = argparse.Namespace(**{**parser.flag_defaults, **typed})
    for refused, message in refusals(args, typed):
        if refused:
            parser.error(message)
    return args, typed, parser


def refusals(args, typed):
    """(refused, why and what to do instead): settings that would do nothing or fail later."""
    guard_on, action = args.guard == "on", args.guard_action
    qk_normed = args.qknorm == "always" or args.qk_fix == "qknorm"
    site, scale, fix = args.inject_site, args.inject_scale, args.qk_fix
    return [
        (site == "none" and scale is not None,
         "--inject-scale was given with --inject-site none: pick a site or drop the scale"),
        (site == "none" and args.inject_coherence is not None,
         "--inject-coherence was given with --inject-site none: pick a site or drop it"),
        (site != "none" and scale is None,
         f"--inject-site {site} needs --inject-scale (error rms / signal rms, or 'matched')"),
        (fix == "clean-grad" and site in GRAD_SITES and args.accum == "fp32",
         f"--qk-fix clean-grad recomputes the forward without the fault, but --inject-site {site} never touches "
         "the forward: the clean QK gradient would be the faulty one"),
        (fix == "clean-grad" and site in ACTIVATION_SITES,
         f"--qk-fix clean-grad with --inject-site {site} trains W_q, W_k on the model without the error, a "
         "different objective rather than a QK-only fix: use --qk-fix qknorm for a forward site (clean-grad is "
         "for the backward sites delta, grad-wv, grad-mlp)"),
        (fix != "off" and site == "none" and args.accum == "fp32",
         "--qk-fix corrects the QK channel while a fault is active, but there is none: set --inject-site or a "
         "faulty --accum"),
        (args.inject_layers != "all" and not all(i.strip().isdigit() for i in args.inject_layers.split(",")),
         f"--inject-layers {args.inject_layers!r}: give comma-separated layer indices, or all"),
        (guard_on and action == "qknorm" and qk_normed,
         "--guard-action qknorm has nothing to switch when --qknorm always or --qk-fix qknorm is set"),
        (guard_on and action == "fp32-accum" and args.accum == "fp32",
         "--guard-action fp32-accum has nothing to switch when --accum is already fp32"),
        (guard_on and args.guard_signal == "max-logit" and (qk_normed or 0 < args.softcap <= guard_threshold(args)),
         "--guard-signal max-logit can never cross --guard-threshold when QK-norm or a smaller --softcap bounds "
         "the logits: use --guard-signal sigma-product"),
        (args.guard_scope == "crossed" and action in ("lr-drop", "clip"),
         f"--guard-scope crossed: --guard-action {action} acts on the whole model; use --guard-scope all"),
        (args.resume and "out_dir" not in typed, "--resume needs the --out-dir of the run to continue"),
        ("probe_k" in typed and args.probe == "off",
         "--probe-k has no effect with --probe off: choose a --probe mode"),
        ("inject_layers" in typed and args.inject_site == "none",
         "--inject-layers has no effect with --inject-site none"),
        (args.attn_impl == "sdpa" and ("block_n" in typed or "safemax_beta" in typed),
         "--block-n and --safemax-beta belong to the streaming-softmax kernel, not to --attn-impl sdpa"),
    ]


def guard_threshold(args):
    """--guard-threshold, where 0 means the signal's default (guard.DEFAULT_THRESHOLD)."""
    return args.guard_threshold or DEFAULT_THRESHOLD[args.guard_signal]


def auto_preset(device_type):
    """--preset auto: demo on a CPU, assay on a GPU."""
    return "demo" if device_type == "cpu" else "assay"


def resolve(args, device, parser):
    """Fill what the command line left to the preset, then check what needs the sizes."""
    args.preset = args.preset if args.preset != "auto" else auto_preset(device.type)
    for key, value in {**PRESETS[args.preset], **model_lib.MODEL_SIZES[PRESETS[args.preset]["size"]]}.items():
        if key != "size" and getattr(args, key) is None:
            setattr(args, key, value)
    args.data_dir = args.data_dir or prepare_data.default_out_dir(args.dataset, args.tokenizer)
    args.decay_steps = args.decay_steps or args.max_steps
    args.guard_threshold = guard_threshold(args)
    args.out_dir = args.out_dir or os.path.join("runs", f"{time.strftime('%Y%m%d-%H%M%S')}-{args.accum}-guard-"
                                                        f"{args.guard}")
    if args.inject_layers != "all" and max(map(int, args.inject_layers.split(","))) >= args.n_layer:
        parser.error(f"--inject-layers {args.inject_layers}: the model has layers 0..{args.n_layer - 1}")
    if args.n_embd % args.n_head:
        parser.error(f"--n-embd {args.n_embd} is not a multiple of --n-head {args.n_head}")
    if args.probe != "off" and args.probe_k >= args.n_embd:   # every probed matrix has n_embd columns
        parser.error(f"--probe-k {args.probe_k} would remove every direction of the {args.n_embd}-wide weights "
                     f"(the whole update, freezing them): give a k below --n-embd {args.n_embd}")
    if args.probe == "qk-nextk" and 2 * args.probe_k > args.n_embd:   # directions k+1..2k must exist
        parser.error(f"--probe qk-nextk removes directions {args.probe_k + 1}..{2 * args.probe_k}, past the "
                     f"{args.n_embd}-wide weights: give a --probe-k of at most {args.n_embd // 2}")
    return args


def model_config(args):
    """The GPTConfig of the flags. A field takes the flag of its own name, so a new model option is
    a flag and a field (README, "Fork it"); the rest are translated here: block_n 0 and --round auto
    become None (the kernel's defaults), --qknorm always and --qk-fix qknorm become qk_norm."""
    fields = [f.name for f in dataclasses.fields(model_lib.GPTConfig)]
    same_name = {name: getattr(args, name) for name in fields if hasattr(args, name)}
    return model_lib.GPTConfig(**{**same_name, "block_n": args.block_n or None,
                                  "rounding": kernel_rounding(args.round),
                                  "qk_norm": args.qknorm == "always" or args.qk_fix == "qknorm"})


def kernel_rounding(flag):
    """--round for the kernel: None (its default for the input dtype) or a tuple of sources."""
    return None if flag == "auto" else () if flag == "none" else tuple(flag.split(","))
