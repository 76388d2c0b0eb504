"""Speed against the project's targets (targets() lists them): the attention kernel, then a GPT-2 124M
training step.

    python -m lab.bench                        # CUDA: attention table, training-step table, targets
    python -m lab.bench --json out/bench.json  # the same, and the tables as JSON
    python -m lab.bench --smoke                # CI: tiny sizes, any device (CPU: no attention table)
    python -m lab.bench --only attention       # CUDA: the attention table alone
    python -m lab.bench --only tune            # CUDA: other launch configurations of our kernels, timed
    python -m lab.bench --only resources       # any machine: our kernels' registers and spills on sm_90
    python -m lab.bench --only resources --dtype fp32   # the same for fp32 inputs
    python -m lab.bench --only check           # any machine: every mode's errors against float64
    python -m lab.bench --only cpu-step        # CPU: cpu-model step, byte vs GPT-2 vocab, twin vs SDPA

Training step = the step of train.py's loop: forward and backward under bf16 autocast,
clip_grad_norm_ to 1.0, fused AdamW, zero_grad; with the monitor on, also SpectralMonitor.measure
and a dormant QKGuard.observe_deferred (its one flag reaches the host in the background). Three
configurations, all under torch.compile:
  sdpa            attn_impl="sdpa", no max-logit by-product, no monitor: the nanoGPT-style baseline
  triton+monitor  attn_impl="triton", accum="fp32", no rounding (a standard flash kernel like SDPA),
                  monitor and dormant guard each step (the rounded modes' cost: the attention table)
  triton          the same model with the monitor off
Timing: CUDA events between consecutive steps, one synchronize before and one after (no host sync
that training lacks); the median of the timed steps, warm-up (compilation) excluded. The two triton
configurations share one compiled model and alternate in blocks, so drift hits both alike.
"""
import argparse
import contextlib
import gc
import json
import os
import re
import statistics
import subprocess
import sys
import tempfile
import time
import traceback

import torch
import torch.nn.functional as F
import triton

import attention_kernel as ak
from guard import DEFAULT_THRESHOLD, QKGuard, SpectralMonitor
from lab.sweep import output_problem
from model import MODEL_SIZES, QK_KINDS, GPT, GPTConfig

H200_BF16_PEAK = 989e12    # dense bf16 FLOP/s, the MFU denominator (SOURCES.md, speed anchors)
SHAPES = [(16, 12, 1024, 64), (4, 32, 4096, 64), (4, 16, 4096, 128)]   # attention's (B, H, T, D)
# Our kernel's modes in the attention table, (accum, rounding): "fp32" (a standard flash kernel) is
# the speed target; the rest keep the prior work's logit and P V rounding (train.py's bf16 default).
KERNEL_MODES = {"fp32": ("fp32", ()), "fp32-rounded": ("fp32", None), "bf16": ("bf16", None),
                "bf16-safemax": ("bf16-safemax", None)}
ROUNDS = 2                 # blocks per configuration where two share a model (they alternate)


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--smoke", action="store_true", help="tiny sizes on any device: code paths only")
    p.add_argument("--steps", type=int, help="timed steps per configuration (default 50; smoke 2)")
    p.add_argument("--warmup", type=int, help="untimed warm-up steps (default 10; smoke 1)")
    p.add_argument("--batch-size", type=int, help="sequences per step (default 16; smoke 2)")
    p.add_argument("--compile", action=argparse.BooleanOptionalAction, default=None,
                   help="torch.compile the model (default: on with CUDA, off on CPU)")
    p.add_argument("--json", metavar="PATH", help="also write the tables to this JSON file")
    p.add_argument("--only", choices=["attention", "tune", "resources", "check", "cpu-step"],
                   help="attention: the attention table only; tune: time other launch configurations "
                        "of our kernels; resources: compile them for sm_90, print registers, spills, "
                        "shared memory (no GPU needed); check: every mode's errors against float64 "
                        "(any machine); cpu-step: the cpu model's training step on this CPU")
    p.add_argument("--dtype", choices=["bf16", "fp32"], default="bf16",
                   help="--only resources: the inputs' dtype (fp32 takes IEEE dots, on the FMA units)")
    args = p.parse_args(argv)
    cuda = torch.cuda.is_available()
    if not cuda and not args.smoke and args.only not in ("resources", "check", "cpu-step"):
        p.error("the benchmark needs a CUDA GPU (its targets are for an H200); on CPU run it with --smoke")
    for name, smoke, full in (("steps", 2, 50), ("warmup", 1, 10), ("batch_size", 2, 16)):
        if getattr(args, name) is None:
            setattr(args, name, smoke if args.smoke else full)
    if args.steps < 1 or args.warmup < 0 or args.batch_size < 1:
        p.error("--steps and --batch-size must be at least 1, --warmup at least 0")
    if args.json and output_problem(args.json):   # before the benchmark, not after it
        p.error(f"--json {args.json}: {output_problem(args.json)}")
    args.device = torch.device("cuda" if cuda else "cpu")
    args.compile = cuda if args.compile is None else args.compile
    args.size = dict(n_layer=2, n_head=2, n_embd=64, block_size=64) if args.smoke else MODEL_SIZES["gpt2"]
    # our kernel: Triton on CUDA (or in the interpreter if asked for), else its PyTorch twin
    args.impl = "triton" if cuda or ak.INTERPRET else "torch"
    return args


# --------------------------------------------------------------------------------------------------
# (1) Attention: our kernel in each state beside SDPA's backends, and the ratios the targets need.

def attention_table():
    """Prints the speed table; returns {(B, H, T, D): {kernel: {"fwd_ms", "fwd_bwd_ms"} | None}}."""
    from torch.nn.attention import SDPBackend, sdpa_kernel
    from triton.testing import do_bench
    sdpa = {"sdpa-flash": SDPBackend.FLASH_ATTENTION, "sdpa-cudnn": SDPBackend.CUDNN_ATTENTION,
            "sdpa-memeff": SDPBackend.EFFICIENT_ATTENTION}
    print(f"{'B,H,T,D':>18} {'kernel':>20} {'fwd ms':>8} {'TFLOP/s':>8} {'fwd+bwd ms':>11} {'TFLOP/s':>8}")
    notes, table = [], {}
    for B, H, T, D in SHAPES:
        q, k, v = (torch.randn(B, H, T, D, device="cuda", dtype=torch.bfloat16, requires_grad=True) for _ in range(3))
        do = torch.randn_like(q)
        flops = 4 * B * H * T * T * D / 2
        runs = {f"triton-{name}": (lambda a=a, r=r: ak.attention(q, k, v, accum=a, impl="triton", rounding=r))
                for name, (a, r) in KERNEL_MODES.items()}
        for name, backend in sdpa.items():
            def fn(backend=backend):
                with sdpa_kernel(backend):
                    return F.scaled_dot_product_attention(q, k, v, is_causal=True)
            runs[name] = fn
        for name, fn in runs.items():
            try:
                fn().backward(do)
                t_f = do_bench(fn)
                t_fb = do_bench(lambda: fn().backward(do), grad_to_none=[q, k, v])
                cells = f"{t_f:8.3f} {flops / t_f * 1e-9:8.1f} {t_fb:11.3f} {3.5 * flops / t_fb * 1e-9:8.1f}"
                table.setdefault((B, H, T, D), {})[name] = {"fwd_ms": t_f, "fwd_bwd_ms": t_fb}
            except Exception as e:  # e.g. an SDPA backend unavailable for this shape, GPU or build
                cells = f"{'n/a':>8} {'n/a':>8} {'n/a':>11} {'n/a':>8}"
                table.setdefault((B, H, T, D), {})[name] = None
                notes.append(f"{name} {(B, H, T, D)}: {type(e).__name__}: {str(e).strip()[:160]}")
            print(f"{str((B, H, T, D)):>18} {name:>20} {cells}")
    print("\n".join(notes))
    return table


def ratio(a, b):
    return a / b if a is not None and b is not None else None


def attention_ratios(table):
    """Per shape: fp32 fwd+bwd time over cuDNN's and flash's, each bf16-state mode's over fp32's."""
    out = {}
    for shape in SHAPES:
        t = {kernel: cells and cells["fwd_bwd_ms"] for kernel, cells in table.get(shape, {}).items()}
        fp32 = t.get("triton-fp32")                # the standard kernel
        out[shape] = {"fp32/cudnn": ratio(fp32, t.get("sdpa-cudnn")), "fp32/flash": ratio(fp32, t.get("sdpa-flash")),
                      "bf16/fp32": ratio(t.get("triton-bf16"), fp32),
                      "bf16-safemax/fp32": ratio(t.get("triton-bf16-safemax"), fp32)}
    return out


def fmt(x, spec=".3f", none="n/a"):
    return none if x is None else format(x, spec)


def bench_attention():
    table = attention_table()
    ratios = attention_ratios(table)
    print("\nfwd+bwd time ratios (below 1: the first is faster)")
    names = ["fp32/cudnn", "fp32/flash", "bf16/fp32", "bf16-safemax/fp32"]
    print(f"{'B,H,T,D':>18} " + " ".join(f"{n:>17}" for n in names))
    for shape, r in ratios.items():
        print(f"{str(shape):>18} " + " ".join(f"{fmt(r[n]):>17}" for n in names))
    return table, ratios


# --------------------------------------------------------------------------------------------------
# (2) Training step

def train_flops_per_token(model, T):
    """6 N (forward and backward of every weight; N without position embeddings) plus attention's
    QK^T and PV as nanoGPT and PaLM count them: 12 * n_layer * n_embd * T per token, the full T x T
    (not halved for the causal mask), as SOURCES.md's 41.8% MFU anchor was counted."""
    c = model.config
    return 6 * model.num_params() + 12 * c.n_layer * c.n_embd * T


def build(args, attn_impl, max_logit, **numerics):
    torch.manual_seed(0)
    numerics = {"accum": "fp32", "rounding": (), **numerics}
    config = GPTConfig(**args.size, attn_impl=attn_impl, max_logit=max_logit, **numerics)
    model = GPT(config).to(args.device)
    cuda = args.device.type == "cuda"
    optimizer = model.configure_optimizer(lr=6e-4, weight_decay=0.1, betas=(0.9, 0.95))
    compiled = torch.compile(model) if args.compile else model
    autocast = (lambda: torch.autocast("cuda", dtype=torch.bfloat16)) if cuda else contextlib.nullcontext
    tokens = torch.randint(config.vocab_size, (args.batch_size, config.block_size + 1),
                           device=args.device)
    x, y = tokens[:, :-1], tokens[:, 1:]
    monitor, guard = SpectralMonitor(model), QKGuard(enabled=True, threshold=DEFAULT_THRESHOLD["max-logit"])
    monitor.measure(model, iters=30)   # converged before step 0, as train.py does
    count = [0]

    def step(watch):
        with autocast():
            _, loss, max_logit = compiled(x, y)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        if watch:                  # train.py's place (6) with --monitor-interval 1
            _, sigma_head = monitor.measure(model, kinds=QK_KINDS)   # other kinds: at log steps
            guard.observe_deferred(count[0], max_logit.float(), sigma_head, model)
            guard.after_optimizer_step(model, max_logit.float())
        count[0] += 1
    return model, step, guard


def step_times(step, n, device):
    """Milliseconds of each of n consecutive steps."""
    if device.type != "cuda":
        marks = [time.perf_counter()]
        for _ in range(n):
            step()
            marks.append(time.perf_counter())
        return [1e3 * (b - a) for a, b in zip(marks, marks[1:])]
    torch.cuda.synchronize()
    events = [torch.cuda.Event(enable_timing=True) for _ in range(n + 1)]
    events[0].record()
    for event in events[1:]:
        step()
        event.record()
    torch.cuda.synchronize()
    return [a.elapsed_time(b) for a, b in zip(events, events[1:])]


def bench_model(args, attn_impl, max_logit, configs):
    """configs: {name: monitor on?}, timed on one compiled model, alternating in ROUNDS blocks."""
    model, step, guard = build(args, attn_impl, max_logit)
    tokens = args.batch_size * model.config.block_size
    flops = train_flops_per_token(model, model.config.block_size) * tokens
    cuda = args.device.type == "cuda"
    for watch in configs.values():
        for _ in range(args.warmup):
            step(watch)
    times, peak = {name: [] for name in configs}, {name: 0 for name in configs}
    block = max(1, args.steps // ROUNDS) if len(configs) > 1 else args.steps
    while any(len(t) < args.steps for t in times.values()):
        for name, watch in configs.items():
            if cuda:
                torch.cuda.reset_peak_memory_stats()
            times[name] += step_times(lambda: step(watch), min(block, args.steps - len(times[name])), args.device)
            if cuda:
                peak[name] = max(peak[name], torch.cuda.max_memory_allocated())
    assert not guard.triggered, "the guard must stay dormant in a speed run"
    rows = {}
    for name in configs:
        ms = statistics.median(times[name])
        rows[name] = {"ms_per_step": ms, "tokens_per_s": tokens / ms * 1e3, "steps": len(times[name]),
                      "mfu": flops / (ms * 1e-3) / H200_BF16_PEAK if cuda else None,
                      "peak_mem_gib": peak[name] / 2**30 if cuda else None, "params": model.num_params(),
                      "ms_each_step": [round(t, 4) for t in times[name]]}
    model = step = guard = None   # free the GPU memory before the next model is built
    gc.collect()
    if cuda:
        torch.cuda.empty_cache()
    return rows


def bench_training(args, errors):
    rows = {}
    runs = [("sdpa", False, {"sdpa": False}), (args.impl, True, {"triton+monitor": True, "triton": False})]
    for attn_impl, max_logit, configs in runs:
        try:
            rows.update(bench_model(args, attn_impl, max_logit, configs))
        except Exception:
            traceback.print_exc()
            errors.append(f"training step {'/'.join(configs)}")
    c = args.size
    print(f"\ntraining step: GPT {c['n_layer']}x{c['n_embd']} ({c['n_head']} heads), batch {args.batch_size} x "
          f"{c['block_size']}, our attention impl {args.impl!r}, compile {args.compile}, median of {args.steps} "
          f"steps after {args.warmup} warm-up")
    print(f"{'config':>16} {'ms/step':>9} {'tokens/s':>11} {'MFU':>7} {'peak GiB':>9}")
    for name, r in rows.items():
        print(f"{name:>16} {r['ms_per_step']:9.2f} {r['tokens_per_s']:11,.0f} {fmt(r['mfu'], '7.1%'):>7} "
              f"{fmt(r['peak_mem_gib'], '9.2f'):>9}")
    on, off = rows.get("triton+monitor"), rows.get("triton")
    cost = (on["ms_per_step"] - off["ms_per_step"]) / off["ms_per_step"] if on and off else None
    print(f"monitor cost (on - off) / off: {fmt(cost, '+.2%')}")
    print("MFU: (6 * params + 12 * n_layer * n_embd * T) FLOPs per token (attention counted over the full T x T, "
          "as nanoGPT does) / 989 TFLOP/s bf16 dense")
    return rows, cost


def cpu_step(steps=30, warmup=3, rounds=3):
    """The cpu model's training step as train.py runs it on a CPU (batch 8 x 128, eager, q, k, v
    rounded to bf16 at attention, monitor every step): byte vocabulary against GPT-2's, and the twin
    with bf16 state against SDPA, alternating in `rounds` blocks so drift hits all alike. Prints the
    min, median and max of the steps' milliseconds (MEASUREMENTS.md, 2026-12-01, holds a run; train.py
    no longer tunes glibc's allocator: MEASUREMENTS.md, 2026-12-05, says how to by environment)."""
    args = argparse.Namespace(device=torch.device("cpu"), compile=False, size=MODEL_SIZES["cpu"], batch_size=8)
    configs = {  # name: (attention impl, numerics)
        "twin, bf16 state, byte vocabulary (320)": ("torch", dict(accum="bf16", vocab_size=320)),
        "twin, bf16 state, GPT-2 vocabulary (50,304)": ("torch", dict(accum="bf16", vocab_size=50304)),
        "SDPA, byte vocabulary (320)": ("sdpa", dict(accum="fp32", vocab_size=320)),
        "SDPA, fp32 inputs, byte vocabulary (320)": ("sdpa", dict(accum="fp32", vocab_size=320, attn_dtype="native")),
    }
    steps_of = {name: build(args, impl, True, rounding=None, **{"attn_dtype": "bf16", **kw})[1]
                for name, (impl, kw) in configs.items()}
    times = {name: [] for name in configs}
    for name, step in steps_of.items():
        for _ in range(warmup):
            step(True)
    for _ in range(rounds):
        for name, step in steps_of.items():
            times[name] += step_times(lambda: step(True), max(1, steps // rounds), args.device)
    print(f"training step of the cpu model on this CPU ({torch.get_num_threads()} threads), batch 8 x 128, "
          f"ms per step over {len(next(iter(times.values())))} steps after {warmup} warm-up:")
    print(f"{'configuration':<46} {'min':>7} {'median':>7} {'max':>7}")
    for name, t in times.items():
        print(f"{name:<46} {min(t):7.1f} {statistics.median(t):7.1f} {max(t):7.1f}")
    med = {name: statistics.median(t) for name, t in times.items()}
    names = list(configs)
    print(f"GPT-2 vocabulary / byte vocabulary (median): {med[names[1]] / med[names[0]]:.2f}x; twin / SDPA at "
          f"the byte vocabulary: {med[names[0]] / med[names[2]]:.2f}x (bf16 inputs, as train.py --attn-impl sdpa "
          f"runs), {med[names[0]] / med[names[3]]:.2f}x (fp32 inputs, --attn-dtype native)")
    return times


# --------------------------------------------------------------------------------------------------
# (3) The targets

def targets(att, train, cost):
    """[(target, measured, goal, met)]; met is None where nothing was measured."""
    def row(name, value, limit, at_most, spec):
        met = None if value is None else (value <= limit if at_most else value >= limit)
        return {"target": name, "measured": value, "goal": f"{'<=' if at_most else '>='} {limit:{spec}}",
                "met": met, "spec": spec}
    out = []
    for shape in SHAPES:
        r = (att or {}).get(shape, {})
        key = "fp32/cudnn" if shape == SHAPES[0] else "fp32/flash"
        out.append(row(f"attn {key} fwd+bwd {shape}", r.get(key), 1.0, True, ".2f"))
    for mode in ("bf16", "bf16-safemax"):
        worst = [(att or {}).get(s, {}).get(f"{mode}/fp32") for s in SHAPES]
        out.append(row(f"attn {mode}/fp32, worst of 3 shapes", None if None in worst else max(worst), 1.25, True,
                       ".2f"))
    sdpa, ours = train.get("sdpa"), train.get("triton+monitor")
    speedup = ours["tokens_per_s"] / sdpa["tokens_per_s"] if ours and sdpa else None
    out.append(row("train tokens/s, triton+monitor / sdpa", speedup, 1.0, False, ".2f"))
    out.append(row("monitor cost, (on - off) / off", cost, 0.01, True, ".1%"))
    return out


# --------------------------------------------------------------------------------------------------
# (4) Launch configurations: their registers on sm_90 (any machine), and the tuner (CUDA)

def compile_for_gpu(cases=None, arch=90, dtype=torch.bfloat16):
    """Compile the kernels a call with `dtype` inputs launches for an sm_<arch> GPU on any machine
    (Triton's own ptxas; no GPU or driver). Prints and returns per kernel registers per thread,
    spilled bytes and shared memory: fix spills, and shared memory past the limit, before timing."""
    from triton.backends.compiler import GPUTarget
    from triton.backends.nvidia.compiler import get_ptxas
    if ak.INTERPRET:
        raise SystemExit("--only resources needs TRITON_INTERPRET unset (the interpreter replaces the compiler)")
    cases = cases or [(D, accum, rounding) for D in (64, 128) for accum, rounding in RESOURCE_MODES]
    ptxas = get_ptxas(arch).path
    pointer = {torch.bfloat16: "*bf16", torch.float16: "*fp16", torch.float32: "*fp32"}[dtype]
    print(f"compiled for sm_{arch} by triton {triton.__version__} ({str(dtype)[6:]} inputs, no softcap)")
    print(f"{'kernel':>15} {'D':>4} {'accum':>13} {'rounding':>22} {'BM,BN':>8} {'warps':>5} {'stages':>6} "
          f"{'regs':>5} {'spill B':>8} {'smem KB':>8} {'wgmma wait':>11}")
    rows, backwards = [], set()
    for D, accum, rounding in cases:
        if "backward" in rounding and dtype != torch.bfloat16:
            continue                         # the bf16 backward takes bf16 inputs only
        q = torch.empty(1, 1, 1, D, dtype=dtype)
        fwd, (dkdv, dq) = ak.fwd_config(D, q.dtype, None, accum, rounding), ak.bwd_configs(D, q.dtype, rounding)
        flags = {**ak.kernel_flags(accum, rounding, 0.0), "HEAD_DIM": D}
        launches = [(ak.attn_fwd, fwd)]
        backward = (D, "logits" in rounding, "backward" in rounding)   # what the backward needs
        if backward not in backwards:
            backwards.add(backward)
            launches += [(ak.attn_bwd_dkdv, dkdv), (ak.attn_bwd_dq, dq)]
        for kernel, (block_m, block_n, warps, stages) in launches:
            constexprs = {**flags, "BLOCK_M": block_m, "BLOCK_N": block_n}
            names = kernel.arg_names
            signature = {n: "constexpr" if n in constexprs else "*fp32" if n in ("LSE", "ROWMAX", "DELTA") else
                         pointer if n.isupper() and n != "H" and n != "T" else
                         "fp32" if n in ("scale", "softcap", "beta") else "i32" for n in names}
            # as the runtime sees real calls: 16-byte aligned pointers, strides divisible by 16
            attrs = {(i,): [["tt.divisibility", 16]] for i, n in enumerate(names)
                     if signature[n].startswith("*") or n.startswith("stride")}
            src = triton.compiler.ASTSource(fn=kernel, signature=signature,
                                            constexprs={k: v for k, v in constexprs.items() if k in names},
                                            attrs=attrs)
            compiled = triton.compile(src, target=GPUTarget("cuda", arch, 32),
                                      options=dict(num_warps=warps, num_stages=stages))
            with tempfile.TemporaryDirectory() as tmp:
                path = os.path.join(tmp, "kernel.ptx")
                with open(path, "w") as f:
                    f.write(compiled.asm["ptx"])
                log = subprocess.run([ptxas, "-v", f"--gpu-name=sm_{arch}a", path, "-o", path + ".cubin"],
                                     capture_output=True, text=True, check=True).stderr
            regs = int(re.search(r"Used (\d+) registers", log).group(1))
            spill = sum(int(n) for n in re.findall(r"(\d+) bytes spill (?:stores|loads)", log))
            # ptxas says so where Hopper's asynchronous matmuls wait for registers: slow too
            serialized = "wgmma" in log and "serialized" in log
            row = dict(kernel=kernel.__name__, D=D, accum=accum, rounding=",".join(rounding) or "none",
                       dtype=str(dtype)[6:], block_m=block_m,
                       block_n=block_n, warps=warps, stages=stages, registers=regs, spill_bytes=spill,
                       wgmma_serialized=serialized, shared_kb=compiled.metadata.shared / 1024)
            rows.append(row)
            print(f"{row['kernel']:>15} {D:>4} {accum:>13} {row['rounding']:>22} {f'{block_m},{block_n}':>8} "
                  f"{warps:>5} {stages:>6} "
                  f"{regs:>5} {spill:>8} {row['shared_kb']:>8.1f} {'yes' if serialized else 'no':>11}")
    return rows


# The modes --only resources compiles: the standard kernel, each state's defaults, and everything
# rounded (the bf16 backward has its own fixed tiles).
RESOURCE_MODES = [("fp32", ()), ("fp32", ak.DEFAULT_ROUNDING), ("bf16", ak.DEFAULT_ROUNDING),
                  ("bf16-safemax", ak.DEFAULT_ROUNDING), ("bf16", ak.ROUNDING_SOURCES)]


def tune_candidates(kernel, accum, D):
    """The launch configurations --only tune tries for one kernel, (BLOCK_M, BLOCK_N, num_warps,
    num_stages), besides the default. The rounded forward keeps its key block (part of the fault's
    definition); the backward is tuned once, for the standard kernel (rounded logits only add a
    rounding of s; the bf16 backward's tiles are part of its definition). Tiles that cannot fit the
    registers are left out: counting the fp32 tiles a thread holds (S with o; dk and dv; dq), all 40
    configurations of this grid past 96 elements per thread used 254 or 255 registers on sm_90 under
    triton 3.6 and 34 spilled; none of the 56 at or below 96 spilled (2026-11-30)."""
    if kernel == "fwd":
        block_ns = (64, 128) if accum == "fp32" else (ak.BF16_STATE_BLOCK_N,)
        configs = [(m, n, w, s) for m in (64, 128) for n in block_ns for w in (4, 8) for s in (2, 3)]
    else:
        pairs = ((32, 128), (64, 64), (64, 128)) if kernel == "dkdv" else ((128, 32), (64, 64), (128, 64))
        configs = [(m, n, w, s) for m, n in pairs for w in (4, 8) for s in (2, 3)]

    def per_thread(m, n, w, s):
        return (n * (m + 2 * D) if kernel == "dkdv" else m * (n + D)) / (32 * w)
    return [c for c in configs if per_thread(*c) <= 96]


def _kernel_launches(q, k, v, do, accum, rounding):
    """{kernel: (launch(config), its outputs)}; the backward takes lse and delta from the default
    forward."""
    B, H, T, D = q.shape
    scale = D ** -0.5
    o, lse, _ = torch.ops.qkguard.attn_fwd(q, k, v, scale, 0.0, accum, ",".join(rounding), 2.0, "triton", None)
    delta = ak.bwd_delta(o, do, rounding)
    fwd = (ak.new_like(q), ak.new_buffer((B, H, T), torch.float32, q.device), ak.new_buffer((B, H, T), torch.float32, q.device))
    dkdv, dq = (ak.new_like(q), ak.new_like(q)), (ak.new_like(q),)
    flags = ak.kernel_flags(accum, rounding, 0.0)
    return {"fwd": (lambda c: ak.launch(ak.attn_fwd, c, (q, k, v, *fwd), (scale, 0.0, 2.0), flags), fwd),
            "dkdv": (lambda c: ak.launch(ak.attn_bwd_dkdv, c, (q, k, v, do, lse, delta, *dkdv), (scale, 0.0), flags), dkdv),
            "dq": (lambda c: ak.launch(ak.attn_bwd_dq, c, (q, k, v, do, lse, delta, *dq), (scale, 0.0), flags), dq)}


def tune(shapes=SHAPES, timer=None, candidates=tune_candidates):
    """Time each kernel's candidates against its default per shape (bf16 inputs, the model's
    layout), check they give its results, and print per kernel the default, the fastest and the
    agreement; returns every row. To adopt one, edit attention_kernel.fwd_config or bwd_configs."""
    if timer is None:
        from triton.testing import do_bench
        timer = lambda fn: do_bench(fn, warmup=10, rep=50, return_mode="median")   # noqa: E731 (ms)
    dev = "cuda" if torch.cuda.is_available() else "cpu"
    rows = []
    print(f"{'B,H,T,D':>18} {'kernel':>5} {'state':>5} {'default':>17} {'ms':>7} {'fastest':>17} {'ms':>7} "
          f"{'speedup':>7} {'max rel diff':>12} {'failed':>6}")
    for B, H, T, D in shapes:
        q, k, v, do = (torch.randn(B, T, H, D, device=dev).to(torch.bfloat16).transpose(1, 2) for _ in range(4))
        for accum, rounding in (("fp32", ()), ("bf16", ak.DEFAULT_ROUNDING)):
            launches = _kernel_launches(q, k, v, do, accum, rounding)
            dkdv_default, dq_default = ak.bwd_configs(D, q.dtype, rounding)
            defaults = {"fwd": ak.fwd_config(D, q.dtype, None, accum, rounding), "dkdv": dkdv_default,
                        "dq": dq_default}
            for kernel in ("fwd",) if accum != "fp32" else ("fwd", "dkdv", "dq"):
                launch, outs = launches[kernel]
                tried, reference = [], None
                for config in dict.fromkeys([defaults[kernel], *candidates(kernel, accum, D)]):
                    row = dict(shape=(B, H, T, D), kernel=kernel, accum=accum, config=config,
                               default=config == defaults[kernel])
                    try:
                        for x in outs:       # NaN first, so an unwritten element shows
                            x.fill_(float("nan"))
                        launch(config)
                        if not all(torch.isfinite(x).all() for x in outs):
                            raise RuntimeError("unwritten (NaN) or non-finite output")
                        reference = reference or [x.float().clone() for x in outs]
                        row["rel_diff"] = max(((a.float() - b).norm() / b.norm()).item() for a, b in zip(outs, reference))
                        row["ms"] = timer(lambda: launch(config))
                    except Exception as e:   # e.g. out of shared memory for this block size
                        row["error"] = f"{type(e).__name__}: {str(e)[:120]}"
                    tried.append(row)
                rows += tried
                timed = [r for r in tried if "ms" in r]
                if "error" in tried[0]:
                    print(f"{str((B, H, T, D)):>18} {kernel:>5} {accum:>5} default {tried[0]['config']} failed: "
                          f"{tried[0]['error']}")
                    continue
                base, best = timed[0], min(timed, key=lambda r: r["ms"])
                print(f"{str((B, H, T, D)):>18} {kernel:>5} {accum:>5} {str(base['config']):>17} {base['ms']:7.3f} "
                      f"{str(best['config']):>17} {best['ms']:7.3f} {base['ms'] / max(best['ms'], 1e-9):7.2f} "
                      f"{max(r['rel_diff'] for r in timed):12.1e} {len(tried) - len(timed):>6}")
    return rows


def attention_float64(q, k, v):
    """Causal softmax attention, materialized in float64: what check() measures against."""
    T = q.shape[2]
    s = q.double() @ k.double().mT / q.shape[-1] ** 0.5
    s = s.masked_fill(~torch.ones(T, T, dtype=torch.bool, device=q.device).tril(), float("-inf"))
    return torch.softmax(s, dim=-1) @ v.double()


def check():
    """Relative errors of every mode against the float64 reference on this device: o, dq, dk, dv."""
    dev = "cuda" if torch.cuda.is_available() else "cpu"
    impls = (["triton"] if dev == "cuda" or ak.INTERPRET else []) + ["torch"]
    shapes = ([(4, 12, 1024, 64), (2, 16, 2048, 128), (2, 4, 1000, 64)] if dev == "cuda"
              else [(1, 2, 256, 64), (1, 2, 130, 32)])
    print(f"relative error vs float64 reference on {dev} (norm of difference / norm of reference); "
          f"rounding: the default for the input dtype")
    print(f"{'B,H,T,D':>16} {'dtype':>9} {'impl':>7} {'accum':>13} {'o':>9} {'dq':>9} {'dk':>9} {'dv':>9}")
    for B, H, T, D in shapes:
        for dtype in (torch.bfloat16, torch.float32):
            q, k, v = (torch.randn(B, H, T, D, device=dev, dtype=dtype, requires_grad=True) for _ in range(3))
            do = torch.randn(B, H, T, D, device=dev, dtype=dtype)
            q64, k64, v64 = (x.detach().double().requires_grad_() for x in (q, k, v))
            ref = attention_float64(q64, k64, v64)
            ref_grads = torch.autograd.grad(ref, (q64, k64, v64), do.double())
            for impl in impls:
                for accum in ak.ACCUM_MODES:
                    o = ak.attention(q, k, v, accum=accum, impl=impl)
                    grads = torch.autograd.grad(o, (q, k, v), do)
                    errs = [((a.double() - b).norm() / b.norm()).item()
                            for a, b in zip((o, *grads), (ref, *ref_grads))]
                    print(f"{str((B, H, T, D)):>16} {str(dtype)[6:]:>9} {impl:>7} {accum:>13} "
                          + " ".join(f"{e:9.2e}" for e in errs))


def main(argv=None):
    args = parse_args(argv)
    if args.only:
        dtype = {"bf16": torch.bfloat16, "fp32": torch.float32}[args.dtype]
        {"attention": bench_attention, "tune": tune, "resources": lambda: compile_for_gpu(dtype=dtype),
         "check": check, "cpu-step": cpu_step}[args.only]()
        return 0
    start, errors = time.time(), []
    name = torch.cuda.get_device_name() if args.device.type == "cuda" else "cpu"
    print(f"lab.bench on {name}: torch {torch.__version__}" + (" (smoke run: tiny sizes)" if args.smoke else ""))
    table, att = {}, None
    if args.device.type != "cuda":
        print("\nattention table: skipped (it times the Triton kernels on a CUDA GPU; none here)")
    else:
        print()
        try:
            table, att = bench_attention()
        except Exception:
            traceback.print_exc()
            errors.append("attention table")
        print(f"[{time.time() - start:.0f} s elapsed]")
    train, cost = bench_training(args, errors)
    print(f"[{time.time() - start:.0f} s elapsed]")

    rows = targets(att, train, cost)
    print(f"\ntargets{' (smoke run: verdicts mean nothing at this size and device)' if args.smoke else ''}")
    print(f"{'target':<48} {'measured':>9} {'goal':>9} {'met':>4}")
    for r in rows:
        met = "n/a" if r["met"] is None else ("yes" if r["met"] else "no")
        print(f"{r['target']:<48} {fmt(r['measured'], r['spec']):>9} {r['goal']:>9} {met:>4}")
    if errors:
        print(f"errors in: {', '.join(errors)} (traceback above)")
    if args.json:
        os.makedirs(os.path.dirname(os.path.abspath(args.json)), exist_ok=True)
        result = {"device": name, "torch": torch.__version__, "smoke": args.smoke, "compile": args.compile,
                  "attn_impl": args.impl, "batch_size": args.batch_size, "steps": args.steps, "warmup": args.warmup,
                  "attention": {str(s): kernels for s, kernels in table.items()},
                  "attention_ratios": {str(s): r for s, r in (att or {}).items()}, "train": train,
                  "monitor_cost": cost, "targets": [{k: v for k, v in r.items() if k != "spec"} for r in rows],
                  "errors": errors, "seconds": time.time() - start}
        with open(args.json, "w") as f:
            json.dump(result, f, indent=2)
        print(f"wrote {args.json}")
    return 1 if errors else 0


if __name__ == "__main__":
    sys.exit(main())
