"""
What the attached guard costs a training step: a table of model size x batch x interval, dormant and
fired, with an A/A row (two copies, neither guarded) for the noise of the measurement itself.

    python -m lab.bench_qkguard                    # the default grid (needs transformers: a Llama)
    python -m lab.bench_qkguard --model nanogpt    # qkguard/example.py's NanoGPT, without transformers
    python -m lab.bench_qkguard --sizes small --batches 2x32 --intervals 1 --steps 5   # a quick look

How: for each cell, two copies of one model from one init take the same AdamW steps on the same
random tokens, turn about (the order swapped each step, so a busy machine and drift hit both alike);
one copy has the guard attached (guard.step() after each update, inside its timed step), the other
none. The cell is the median step time of the guarded copy over the unguarded one's, less 1, in %.
Step time is the CPU time of this thread (time.thread_time, torch on one thread): on a shared machine
the time the process waits for a core is not counted, where wall-clock time would count it.
  dormant  attach(model, threshold=1e30): measuring, never crossing
  fired    attach(model, threshold=1e-30): it crosses at update 0 and acts from update 2 on (QK-norm on
           every layer), then measures as before; timed from the 4th update
  A/A      neither copy guarded: the spread to expect from the machine alone
Host time only (CPU, one thread): on a GPU the guard's launches overlap the model's, and the table
says nothing of it.
"""
import argparse
import statistics
import time

import torch

import qkguard
from qkguard.example import NanoGPT

# name -> (layers, heads, width); head_dim = width / heads
SIZES = {"small": (2, 4, 64), "medium": (4, 8, 256)}
BATCHES = ("2x32", "8x128")       # sequences x tokens: the README snippet's batch, and a larger one
INTERVALS = (1, 4)
VOCAB = 256


def build(kind, size, block, seed=0):
    layers, heads, width = SIZES[size]
    torch.manual_seed(seed)
    if kind == "nanogpt":
        model = NanoGPT(vocab_size=VOCAB, block_size=block, n_layer=layers, n_head=heads, n_embd=width)
        return model, lambda x: model(x, x)[1]
    import transformers
    config = transformers.LlamaConfig(hidden_size=width, intermediate_size=4 * width, num_hidden_layers=layers,
                                      num_attention_heads=heads, num_key_value_heads=heads, vocab_size=VOCAB,
                                      max_position_embeddings=block)
    model = transformers.LlamaForCausalLM(config)
    return model, lambda x: model(input_ids=x, labels=x).loss


def compare(kind, size, batch, interval, mode, steps, warmup=4):
    """Median ms of a step, unguarded copy and the other (guarded as `mode` says, or not for "A/A")."""
    b, t = (int(n) for n in batch.split("x"))
    copies = []
    for guarded in (False, mode != "A/A"):
        model, loss_of = build(kind, size, t)
        threshold = {"dormant": 1e30, "fired": 1e-30}.get(mode)
        guard = qkguard.attach(model, threshold=threshold, interval=interval) if guarded else None
        copies.append((model, loss_of, torch.optim.AdamW(model.parameters(), lr=1e-4), guard))
    tokens = torch.randint(0, VOCAB, (b, t), generator=torch.Generator().manual_seed(1))
    times = ([], [])
    for step in range(warmup + steps):
        for which in (0, 1) if step % 2 else (1, 0):
            model, loss_of, optimizer, guard = copies[which]
            started = time.thread_time()
            loss_of(tokens).backward()
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
            if guard is not None:
                guard.step()
            if step >= warmup:
                times[which].append(time.thread_time() - started)
    guard = copies[1][3]
    if mode == "fired":
        assert guard.triggered, "the fired cell's guard did not fire"
    return [statistics.median(ts) * 1e3 for ts in times]


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0].strip())
    parser.add_argument("--model", choices=("llama", "nanogpt"), default="llama")
    parser.add_argument("--sizes", nargs="+", choices=tuple(SIZES), default=list(SIZES))
    parser.add_argument("--batches", nargs="+", default=list(BATCHES))
    parser.add_argument("--intervals", nargs="+", type=int, default=list(INTERVALS))
    parser.add_argument("--steps", type=int, default=30, help="timed steps per copy, after 4 untimed")
    args = parser.parse_args(argv)
    if args.steps < 1 or any(i < 1 for i in args.intervals):
        parser.error("--steps and --intervals must be >= 1")
    torch.set_num_threads(1)
    print(f"model {args.model}, {args.steps} timed steps per copy; median step (thread CPU time), the guarded copy "
          f"against an unguarded one (%)")
    print("| size (layers, heads, width) | batch | unguarded ms | A/A | interval | dormant | fired |")
    print("|---|---|---|---|---|---|---|")
    for size in args.sizes:
        for batch in args.batches:
            base, other = compare(args.model, size, batch, 1, "A/A", args.steps)
            aa = f"{(other / base - 1) * 100:+.1f}%"
            for interval in args.intervals:
                cells = []
                for mode in ("dormant", "fired"):
                    base_ms, guarded_ms = compare(args.model, size, batch, interval, mode, args.steps)
                    cells.append(f"{(guarded_ms / base_ms - 1) * 100:+.1f}%")
                print(f"| {size} {SIZES[size]} | {batch} | {base:.1f} | {aa} | {interval} | {cells[0]} | {cells[1]} |",
                      flush=True)


if __name__ == "__main__":
    main()
