"""QK-Guard attached to someone else's model, on a CPU: a tiny model trained at a learning rate that
makes its attention logits run away, once watched only and once guarded.

    python -m lab.attach_demo --model hf-gpt2      # Hugging Face GPT2LMHeadModel, from a config
    python -m lab.attach_demo --model hf-llama     # Hugging Face LlamaForCausalLM (rotary, GQA)
    python -m lab.attach_demo --model nanogpt      # a nanoGPT-style GPT (qkguard.example.NanoGPT)
    python -m lab.attach_demo --model nanogpt --cost-only   # just the monitor's cost

Each model is built from a config (nothing is downloaded) and trained on the byte-level data of
prepare_data.py (data/pycode-byte). Per model, two runs from the same init on the same batches:
  guard off   attach(..., enabled=False): the same hooks measure and log, the guard never acts
  guard on    attach(..., threshold=--threshold, by default the guard's own: max logit 200): dormant,
              then QK-norm from one step after the first crossing
Each writes <out-dir>/<model>/<run>/log.jsonl (train.py's records and events where they apply) and
config.json; the figure is lab/plots/attach-<model>.png, in the demo's style (lab.figures' plot_some_runs).

The unguarded run also carries a second watcher that reads every row of the batch, to show how the
guard's sampled signal (every row of one sequence of the batch) compares with the whole batch's.

Then the monitor's cost with the guard dormant (measure_cost): two copies of the model from one init,
one without a guard and one with a dormant guard, take the same steps turn about. The table gives the
time inside the guard (its hooks and step()) per step, and the median step time of each copy, wall
clock and CPU; an A/A row (no guard in either copy) shows how much of a difference is noise. The
copies' parameters must end bit for bit equal (torch.equal): the dormant guard changed nothing.
"""
import argparse
import json
import math
import os
import statistics
import sys
import time

import torch

import prepare_data
import qkguard
from lab.sweep import output_problem
from train import TokenWindows

HERE = os.path.dirname(os.path.abspath(__file__))
MODELS = ("hf-gpt2", "hf-llama", "nanogpt")
VOCAB = 320                         # the byte tokenizer's 257 tokens padded to a multiple of 64


def build(name, block_size, seed):
    """(model, loss(model, x, y)) at the size of this project's cpu preset: 4 layers, 4 heads, width 128."""
    torch.manual_seed(seed)
    if name == "nanogpt":
        from qkguard.example import NanoGPT     # qkguard's nanoGPT-style GPT: one fused c_attn, SDPA
        return NanoGPT(vocab_size=VOCAB, block_size=block_size, n_layer=4, n_head=4, n_embd=128), \
            lambda m, x, y: m(x, y)[1]
    try:
        import transformers
    except ImportError:
        raise SystemExit(f"error: --model {name} needs the transformers package: pip install transformers "
                         f"(or run --model nanogpt)")
    transformers.logging.set_verbosity_error()   # a config built here has no tokenizer: no warnings about it
    if name == "hf-gpt2":
        config = transformers.GPT2Config(n_layer=4, n_head=4, n_embd=128, n_positions=block_size, vocab_size=VOCAB,
                                         resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, bos_token_id=256,
                                         eos_token_id=256)
        model = transformers.GPT2LMHeadModel(config)
    else:
        config = transformers.LlamaConfig(hidden_size=128, intermediate_size=384, num_hidden_layers=4,
                                          num_attention_heads=4, num_key_value_heads=2, vocab_size=VOCAB,
                                          max_position_embeddings=block_size, tie_word_embeddings=True,
                                          bos_token_id=256, eos_token_id=256, pad_token_id=256)
        model = transformers.LlamaForCausalLM(config)
    # Hugging Face shifts the labels itself: the labels are the inputs
    return model, lambda m, x, y: m(input_ids=x, labels=x).loss


class Data:
    """prepare_data's byte-level windows: step s's batch depends on (seed, s) alone, so both runs see the same."""

    def __init__(self, args):
        data_dir = args.data_dir or prepare_data.default_out_dir("pycode", "byte")
        if not os.path.exists(os.path.join(data_dir, "meta.json")):
            raise SystemExit(f"error: no data in {data_dir}: run `python prepare_data.py --tokenizer byte` first")
        self.windows = TokenWindows(data_dir, args.block_size, args.batch_size, args.seed, "pycode", "byte")
        if self.windows.tokenizer != "byte":
            raise SystemExit(f"error: {data_dir} holds {self.windows.tokenizer} tokens; the demo's models read bytes: "
                             f"give a --data-dir prepared with `python prepare_data.py --tokenizer byte`")

    def get(self, split, step):
        window = torch.from_numpy(self.windows.get(split, step, 0))
        return window[:, :-1].contiguous(), window[:, 1:].contiguous()


def sampling(args):
    return dict(interval=args.interval, seqs=args.seqs or None, rows=args.rows or None)   # 0: all


def lr_at(step, args):
    return args.lr * min(1.0, (step + 1) / args.warmup_steps)       # linear warmup, then constant


def one_step(model, loss_of, optimizer, data, step, args):
    for group in optimizer.param_groups:
        group["lr"] = lr_at(step, args)
    loss = loss_of(model, *data.get("train", step))
    loss.backward()
    torch.nn.utils.clip_grad_norm_(model.parameters(), args.grad_clip)
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    return loss.detach()


def optimizer_for(model, args):
    return torch.optim.AdamW(model.parameters(), lr=args.lr, betas=(0.9, 0.95), weight_decay=0.0)


@torch.no_grad()
def val_loss(model, loss_of, data, batches=4):
    model.eval()
    loss = sum(loss_of(model, *data.get("val", i)).item() for i in range(batches)) / batches
    model.train()
    return loss


def run(name, guarded, args, data, out_dir):
    """One run; returns its summary. The log holds train.py's step records (one per step here) and events."""
    model, loss_of = build(name, args.block_size, args.seed)
    guard = qkguard.attach(model, threshold=args.threshold, enabled=guarded, action=args.action, **sampling(args))
    threshold = guard.qkguard.threshold          # --threshold, or the guard's default where it is None
    # the unguarded run also watches every row of the batch: how the sampled signal compares with it
    full = None if guarded else qkguard.attach(model, enabled=False, seqs=None, rows=None)
    optimizer = optimizer_for(model, args)
    os.makedirs(out_dir, exist_ok=True)
    label = "guard on" if guarded else "guard off"
    with open(os.path.join(out_dir, "config.json"), "w") as f:
        json.dump({"args": {**vars(args), "model": name, "guard": "on" if guarded else "off",
                            "guard_action": args.action, "guard_threshold": threshold}}, f, indent=1)
    losses, max_logits, full_max, started = [], [], [], time.time()
    with open(os.path.join(out_dir, "log.jsonl"), "w") as log:
        for step in range(args.steps):
            t0 = time.perf_counter()
            loss = one_step(model, loss_of, optimizer, data, step, args)
            event = guard.step()
            step_ms = (time.perf_counter() - t0) * 1e3
            if full is not None:
                full.step()
                full_max.append(float(full.max_logit.max()))
            if event:
                log.write(json.dumps(event) + "\n")
                print(f"  {label}: step {event['step']}: QK-Guard {event['event']}: max logit {event['value']:.1f} > "
                      f"{threshold:g} at layer {event['layer']} head {event['head']}: {event['action']} on from "
                      f"step {event['active_from']}")
            record = {"step": step, "lr": lr_at(step, args), "loss": loss.item(), **guard.record(), "step_ms": step_ms}
            if full is not None:
                record["max_logit_all_rows"] = full_max[-1]
            log.write(json.dumps(record) + "\n")
            losses.append(record["loss"])
            max_logits.append(max(max(h) for h in record["max_logit"]))
            if not math.isfinite(record["loss"]):
                break
        end = {"event": "end", "status": "completed" if math.isfinite(losses[-1]) else "collapsed", "step": step + 1,
               "collapse_step": None if math.isfinite(losses[-1]) else step, "guard_trigger": guard.qkguard.trigger,
               "guard_pending": guard.qkguard.pending_crossing(), "val_loss": val_loss(model, loss_of, data)}
        log.write(json.dumps(end) + "\n")
    tail = losses[-20:]
    first_past = lambda values: next((i for i, v in enumerate(values) if v > threshold), None)
    return {"label": label, "dir": out_dir, "threshold": threshold, "losses": losses, "max_logits": max_logits,
            "trigger": guard.qkguard.trigger, "first_past": first_past(max_logits),
            "first_past_all_rows": first_past(full_max) if full_max else None,
            "sampled_over_all": [m / f for m, f in zip(max_logits, full_max)],
            "final_train": sum(tail) / len(tail), "val_loss": end["val_loss"], "seconds": time.time() - started}


def measure_cost(name, args, data):
    """The dormant guard's cost, two ways: the time inside its hooks and step() (guard.seconds: on a
    CPU, all of its work), against the median step; and the median step time, wall clock and this
    thread's CPU time, of a copy with it against one without, the copies taking the same steps turn
    about (the order swapped each step, so drift and a busy machine hit both alike). At a healthy
    learning rate, nothing runs away. And whether the copies end bit for bit equal."""
    copies = []
    for guarded in (False, args.interval is not None):     # interval None: no guard in either (A/A: the noise)
        model, loss_of = build(name, args.block_size, args.seed)
        # a threshold never crossed (attach refuses inf, which would never fire unnoticed): the dormant cost alone;
        # timing=True: guard.seconds counts the host time in its hooks and step()
        guard = qkguard.attach(model, threshold=1e30, timing=True, **sampling(args)) if guarded else None
        copies.append((model, loss_of, optimizer_for(model, args), guard))
    cost_args = argparse.Namespace(**{**vars(args), "lr": args.cost_lr})
    warmup, wall, cpu = 3, ([], []), ([], [])
    guard = copies[1][3]
    for step in range(warmup + args.cost_steps):
        if step == warmup and guard is not None:
            guard.seconds = 0.0
        for which in (0, 1) if step % 2 else (1, 0):
            model, loss_of, optimizer, g = copies[which]
            t0, c0 = time.perf_counter(), time.thread_time()
            one_step(model, loss_of, optimizer, data, step, cost_args)
            if g is not None:
                g.step()
            if step >= warmup:
                wall[which].append(time.perf_counter() - t0)
                cpu[which].append(time.thread_time() - c0)
    (base, guarded), (base_cpu, guarded_cpu) = ([statistics.median(t) * 1e3 for t in ts] for ts in (wall, cpu))
    inside = guard.seconds / args.cost_steps * 1e3 if guard is not None else None
    equal = all(torch.equal(a, b) for a, b in zip(copies[0][0].parameters(), copies[1][0].parameters()))
    return {"model": name, "steps_timed": args.cost_steps, "no_guard_ms": base, "dormant_ms": guarded,
            "no_guard_cpu_ms": base_cpu, "dormant_cpu_ms": guarded_cpu,
            "difference_pct": 100 * (guarded - base) / base, "cpu_difference_pct": 100 * (guarded_cpu - base_cpu) / base_cpu,
            "in_guard_ms": inside, "in_guard_pct": None if inside is None else 100 * inside / base, "bit_for_bit": equal,
            "threads": torch.get_num_threads(),
            "sample": f"every {args.interval}, {args.seqs or 'all'} seq x {args.rows or 'all'} rows"
                      if guard is not None else "none in either copy (A/A: the noise)"}


def plot(name, runs, png):
    try:
        from lab.figures import plot_some_runs
    except ImportError as e:
        print(f"plot skipped: {e}")
        return None
    return plot_some_runs([r["dir"] for r in runs], png, labels=[r["label"] for r in runs])


def intervals(text):
    try:
        return [int(i) for i in text.split(",")]
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r}: give whole numbers separated by commas, e.g. 1,4") from None


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model", choices=MODELS, default="hf-gpt2")
    p.add_argument("--steps", type=int, default=150)
    p.add_argument("--lr", type=float, default=3e-2, help="the demo preset's rate; all three models' logits run away "
                   "at it")
    p.add_argument("--warmup-steps", type=int, default=20)
    p.add_argument("--grad-clip", type=float, default=1.0)
    p.add_argument("--batch-size", type=int, default=8)
    p.add_argument("--block-size", type=int, default=128)
    p.add_argument("--threshold", type=float, default=None,
                   help="the max logit that fires the guard (default: the guard's own, 200)")
    p.add_argument("--action", choices=qkguard.ATTACH_ACTIONS, default="qknorm")
    p.add_argument("--interval", type=int, default=1, help="monitor every N steps")
    p.add_argument("--seqs", type=int, default=1, help="sequences of the batch the monitor reads (0: all)")
    p.add_argument("--rows", type=int, default=0, help="positions of each it reads (0: all)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--data-dir", default=None, help="byte-level data (default: data/pycode-byte)")
    p.add_argument("--out-dir", default="runs/attach")
    p.add_argument("--png", default=None, help="default: lab/plots/attach-<model>.png")
    p.add_argument("--cost-only", action="store_true", help="only the monitor's cost table")
    p.add_argument("--cost-lr", type=float, default=3e-3, help="the cost runs' (healthy) learning rate")
    p.add_argument("--cost-steps", type=int, default=30, help="steps timed per copy")
    p.add_argument("--cost-intervals", type=intervals, default=[1, 4],
                   help="the monitor intervals whose cost is measured (default 1,4), after an A/A row (no guard in "
                        "either copy) that shows the timing's noise")
    p.add_argument("--json", default=None, help="also write the summary as JSON here")
    args = p.parse_args(argv)
    bad_threshold = args.threshold is not None and args.threshold <= 0          # None: the guard's default
    if min(args.steps, args.batch_size, args.block_size, args.interval, args.cost_steps, args.warmup_steps,
           *args.cost_intervals) < 1 or min(args.seqs, args.rows) < 0 or args.lr <= 0 or bad_threshold:
        p.error("--steps, --batch-size, --block-size, --interval, --cost-*, --warmup-steps must be >= 1, "
                "--seqs and --rows >= 0, --threshold and --lr > 0")
    for flag, path, folder in (("--out-dir", args.out_dir, True), ("--png", args.png, False),
                               ("--json", args.json, False)):
        if path and output_problem(path, folder):    # before the runs, not after them
            p.error(f"{flag} {path}: {output_problem(path, folder)}")
        if path and not folder:
            os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    build(args.model, args.block_size, args.seed)        # fails now, in one line, without transformers
    data = Data(args)
    summary = {"model": args.model, "args": vars(args)}
    if not args.cost_only:
        threshold = "the default threshold" if args.threshold is None else f"threshold {args.threshold:g}"
        print(f"{args.model}: {args.steps} steps at lr {args.lr:g}, guard off and on ({threshold}, {args.action})")
        runs = [run(args.model, guarded, args, data, os.path.join(args.out_dir, args.model, d))
                for guarded, d in ((False, "guard-off"), (True, "guard-on"))]
        off, on = runs
        same = next((i for i, (a, b) in enumerate(zip(off["losses"], on["losses"])) if a != b), None)
        ratio = off.pop("sampled_over_all")
        on.pop("sampled_over_all")
        print(f"  guard off: the sampled max logit (one sequence) first passed {off['threshold']:g} at step "
              f"{off['first_past']}, the whole batch's at step {off['first_past_all_rows']}; sampled / whole: median "
              f"{statistics.median(ratio):.3f}, min {min(ratio):.3f}")
        for r in runs:
            trig = f"fired at step {r['trigger']['step']}" if r["trigger"] else "never fired"
            print(f"  {r['label']}: max logit {max(r['max_logits']):.1f} (last {r['max_logits'][-1]:.1f}), guard {trig}, "
                  f"train loss (last 20 steps) {r['final_train']:.4f}, val loss {r['val_loss']:.4f}, {r['seconds']:.0f} s")
        print(f"  the two runs' losses are equal bit for bit up to step {same - 1 if same else len(off['losses']) - 1}"
              f" (the guard dormant until it acts)")
        png = plot(args.model, runs, args.png or os.path.join(HERE, "plots", f"attach-{args.model}.png"))
        if png:
            print(f"  plot: {png}")
        summary["runs"] = [{k: v for k, v in r.items() if k not in ("losses", "max_logits")} |
                           {"max_logit": max(r["max_logits"]), "last_max_logit": r["max_logits"][-1]} for r in runs]
        summary["equal_until"] = same - 1 if same else len(off["losses"]) - 1
    summary["cost"] = []
    for interval in [None, *args.cost_intervals]:
        summary["cost"].append(measure_cost(args.model, argparse.Namespace(**{**vars(args), "interval": interval}), data))
    print("\n| model | threads | monitor | steps timed | step, no guard (ms) | step, dormant guard (ms) | difference | "
          "in the guard (ms/step) | bit for bit |\n|---|---|---|---|---|---|---|---|---|")
    for c in summary["cost"]:
        inside = "-" if c["in_guard_ms"] is None else f"{c['in_guard_ms']:.2f} ({c['in_guard_pct']:.2f}%)"
        print(f"| {c['model']} | {c['threads']} | {c['sample']} | {c['steps_timed']} | {c['no_guard_ms']:.1f} (CPU "
              f"{c['no_guard_cpu_ms']:.1f}) | {c['dormant_ms']:.1f} (CPU {c['dormant_cpu_ms']:.1f}) | "
              f"{c['difference_pct']:+.1f}% (CPU {c['cpu_difference_pct']:+.1f}%) | {inside} | "
              f"{'yes' if c['bit_for_bit'] else 'NO'} |")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(summary, f, indent=1)
    return 0 if all(c["bit_for_bit"] for c in summary["cost"]) else 1

if __name__ == "__main__":
    sys.exit(main())
