"""
Train a GPT and watch (or guard) the query-key channel.

    python train.py --accum bf16 --guard on          # the bf16 fault, with QK-Guard watching
    python train.py --accum bf16 --guard off         # ... and without it
    torchrun --nproc_per_node=8 train.py --preset gpt2 --accum bf16 --guard on

Every choice is a flag (`python train.py --help`; run.py); the run folder is rundir.py's. The loop's
numbered comments mark where the guard acts; at its `extension.` lines a plug-in may act
(run.Extension; `python -m lab.train_assay` is this loop with the lab's assay).
"""
import contextlib
import math
import os
import sys
import time

try:   # Ctrl-C while torch loads (seconds): nothing was started, so one line and no traceback
    import numpy as np
    import torch

    import model as model_lib
    import prepare_data
    import run
    import rundir
    from guard import CollapseDetector, QKGuard, SpectralMonitor
    from model import NON_QK_KINDS, QK_KINDS
    from tokenizer import VOCAB_SIZES
except KeyboardInterrupt:
    print("interrupted while loading torch: nothing was written; run it again", file=sys.stderr)
    sys.exit(130)


def main(argv=None, extension=None):
    # -------------------------------------------------------------------------- configuration, data
    extension = extension or run.Extension()     # a plug-in's flags and hooks (run.Extension: none)
    args, dist, state, changed, batches = configure(argv, extension)
    use_bf16 = run.uses_bf16(args.dtype, dist.device)
    autocast = (lambda: torch.autocast(dist.device.type, dtype=torch.bfloat16)) if use_bf16 \
        else contextlib.nullcontext

    # ------------------------------------------------------------------- model, optimizer, watchers
    model, optimizer, train_model, eval_model = build_model(args, dist, use_bf16, extension)
    monitor = SpectralMonitor(model, seed=args.seed)
    guard = QKGuard.from_args(args)
    detector = CollapseDetector(args.collapse_margin, args.collapse_patience,
                                args.collapse_smoothing)
    extension.start(args, model, lambda: batches.get("train", 0, 0)[0], autocast)
    run_dir = rundir.RunDir(args, dist, batches.windows.identity)
    totals, step = Totals(dist.device), 0
    parts = dict(model=model, optimizer=optimizer, monitor=monitor, detector=detector, guard=guard,
                 totals=totals, **extension.parts())
    if state is None:
        monitor.measure(model, iters=30)         # converged before step 0
    else:
        step = run_dir.restore(state, parts)
        guard.apply_to_model(model)              # a latched action stays on
    saved_step, stop = step, rundir.StopSignal()   # nothing to save before the first update
    log = run_dir.start_log(model.num_params(), step, resumed=state is not None, changed=changed)
    evaluate = lambda: totals.note_eval(
        step, validation_loss(eval_model, batches, step, args, dist, autocast, log))

    # ------------------------------------------------------------------------------------- the loop
    # A record's "step" counts the updates before it: a step record's loss and max logit come from
    # update `step`'s forward; an eval at `step` sees the weights after `step` updates.
    status = "completed"
    totals.start_clock()
    try:
        if state is None:   # a new run's eval at step 0
            evaluate()
        while step < args.max_steps:
            # (1) the learning rate; the lr-drop action scales it
            lr = lr_at(step, args) * guard.lr_scale()
            for group in optimizer.param_groups:
                group["lr"] = lr
            # (2) forward and backward; an extension may act in the model, (3) or on the gradients
            loss, max_logit = forward_backward(train_model, model, batches, step, args, dist,
                                               autocast, extension)
            totals.add(loss, max_logit)
            # (4) clip; the clip action tightens it
            clip = guard.grad_clip(args.grad_clip)
            grad_norm = torch.nn.utils.clip_grad_norm_(model.parameters(),
                                                       clip if clip > 0 else math.inf)
            # (5) the update; an extension may change it (the lab's probe projects it)
            extension.before_update(model)
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
            extension.after_update(model)
            # (6) watch W_q's and W_k's top singular values and the max logit; the guard checks them
            if step % args.monitor_interval == 0:
                watch(step, model, monitor, guard, detector, totals, args, log)
            # (7) act after the update: QK-Clip scales the offending heads' W_q, W_k
            guard.after_optimizer_step(model, max_logit)

            step += 1
            if step % args.log_interval == 0 or step == args.max_steps:
                record = write_interval_record(step, lr, grad_norm, model, args, dist, log, totals,
                                               monitor, guard, extension)
                collapse = collapsed(detector, record, log)
                if collapse and args.on_collapse == "stop":
                    status = "collapsed"
                    break
            if step % args.eval_interval == 0 or step == args.max_steps:
                evaluate()
            if step % args.ckpt_interval == 0:
                run_dir.save(step, parts)
                saved_step = step
            stopping = dist.any(stop)    # every rank stops at the same step
            if stopping and step < args.max_steps:   # in the last step or eval: it completes
                status = "interrupted"
                break
        if status == "collapsed":   # the end record's val loss is the collapsed model's
            evaluate()
        if saved_step != step:
            run_dir.save(step, parts)
    except BaseException as e:
        log.write({"event": "end", "status": "error", "step": step,
                   "error": f"{type(e).__name__}: {e}"})
        raise
    write_end_record(status, step, totals.last_eval, detector, guard, args, log)
    dist.close()


# --------------------------------------------------------------------------------------------------
# Setting up: the flags, the data, the model

def configure(argv, extension):
    """(args, the processes, the checkpoint to resume or None, the flags a resume changed, the
    batches). The data is prepared on first use; the model's vocabulary follows its tokenizer."""
    args, typed, parser = run.parse_args(argv, extension)
    dist = run.Dist(args.device)
    args = run.resolve(args, dist.device, parser, extension)
    dist.check_same(args.out_dir, "run folder")   # a default one: named by the launcher, for all
    args, state, changed = rundir.start_run(args, typed, parser.flag_defaults, dist.master)
    if args.threads:
        torch.set_num_threads(args.threads)
    if args.grad_accum % dist.world:
        raise SystemExit(f"error: --grad-accum {args.grad_accum} must be a multiple of the "
                         f"{dist.world} processes")
    run.check_memory(args, dist.device)
    run.ensure_data(args, dist)
    batches = Batches(args, dist.device)
    args.tokenizer, args.vocab_size = vocabulary(args, typed, batches.windows)
    return args, dist, state, changed, batches


def build_model(args, dist, use_bf16, extension):
    """The model (the same on every rank, checked against the kernel), its optimizer, and the
    --compile'd models to train (DDP with several processes) and to evaluate (no DDP: a rank with
    no eval batch owes no collective)."""
    torch.manual_seed(args.seed)                 # the same initial weights on every rank
    model = model_lib.GPT(extension.model_config(args, run.model_config(args))).to(dist.device)
    check_attention_settings(model, dist.device, args, use_bf16)
    torch.manual_seed(args.seed + dist.rank)     # dropout masks differ per rank
    eval_model = train_model = torch.compile(model) if args.compile else model
    if dist.world > 1:
        train_model = torch.nn.parallel.DistributedDataParallel(
            train_model, device_ids=[dist.device.index] if dist.device.type == "cuda" else None)
    optimizer = model.configure_optimizer(args.lr, args.weight_decay, (args.beta1, args.beta2))
    return model, optimizer, train_model, eval_model


# --------------------------------------------------------------------------------------------------
# The pieces the loop calls

class TokenWindows:
    """Random windows of block_size + 1 tokens of train.bin or val.bin (prepare_data.py's), checked
    against meta.json. Step s's windows depend only on (seed, s): a resumed run sees the batches an
    uninterrupted one would, runs with one seed see one data order, and N processes together see
    the same global batch as one."""

    def __init__(self, data_dir, block_size, batch_size, seed, dataset="pycode", tokenizer="gpt2"):
        meta_path, meta = os.path.join(data_dir, "meta.json"), prepare_data.read_meta(data_dir)
        build = prepare_command(dataset, tokenizer, data_dir)
        redo = f"re-run `{build} --force`"
        if meta is None:   # unreadable, not JSON, not an object: nothing is deleted
            raise SystemExit(f"error: cannot read {meta_path} as a dataset description: move the "
                             f"folder's files away and rebuild it (`{build}`)")
        self.tokenizer = meta.get("tokenizer")   # what the model is sized for, and every lookup
        if (self.tokenizer, meta.get("vocab_size")) not in VOCAB_SIZES.items():
            raise SystemExit(f"error: {meta_path} names no known tokenizer and vocabulary "
                             f"(tokenizer {self.tokenizer!r}, vocab_size "
                             f"{meta.get('vocab_size')!r}; known {VOCAB_SIZES}): {redo}")
        self.vocab_size, self.data = VOCAB_SIZES[self.tokenizer], {}
        for split in prepare_data.SPLITS:
            path = os.path.join(data_dir, f"{split}.bin")
            expected = meta.get("tokens", {}).get(split)
            if not os.path.exists(path):
                raise SystemExit(f"error: {path} is missing although {meta_path} exists: {redo}")
            size = os.path.getsize(path)
            if size % 2 or (expected is not None and size // 2 != expected):
                raise SystemExit(f"error: {path} holds {size} bytes, not the {expected} uint16 "
                                 f"tokens meta.json records: the file is damaged; {redo}")
            if size // 2 <= block_size + 1:
                raise SystemExit(f"error: {path} holds {size // 2} tokens, too few for "
                                 f"--block-size {block_size}")
            self.data[split] = np.memmap(path, dtype=np.uint16, mode="r")
            largest = int(self.data[split].max())   # ~0.1 s per 100M tokens
            if largest >= self.vocab_size:
                raise SystemExit(f"error: {path} holds token {largest}, outside the "
                                 f"{self.tokenizer} vocabulary of {self.vocab_size} that "
                                 f"{meta_path} gives: the file is not of this dataset; {redo}")
        self.block_size, self.batch_size, self.seed = block_size, batch_size, seed
        # what a run records of the data it trained on (config.json, log.jsonl's start record)
        self.identity = {"dataset": meta.get("dataset"), "tokenizer": self.tokenizer,
                         "content_sha256": meta.get("content_sha256"),
                         "train_tokens": len(self.data["train"]),
                         "val_tokens": len(self.data["val"]),
                         "torch": meta.get("versions", {}).get("torch")}

    def get(self, split, step, index):
        """Window `index` of step `step` (val: eval batch `index`, the same at every eval), int64
        (B, T + 1)."""
        data, T = self.data[split], self.block_size
        rng = np.random.default_rng([self.seed, 0 if split == "train" else 1, step, index])
        starts = rng.integers(0, len(data) - T - 1, size=self.batch_size)
        return np.stack([data[s:s + T + 1] for s in starts]).astype(np.int64)


class Batches:
    """The token windows of train.bin and val.bin, as (inputs, next-token targets) on the device."""

    def __init__(self, args, device):
        self.windows = TokenWindows(args.data_dir, args.block_size, args.batch_size, args.seed,
                                    args.dataset, args.tokenizer)
        self.device = device

    def get(self, split, step, index):
        """Window `index` of `step`, set by (seed, step) alone."""
        window = torch.from_numpy(self.windows.get(split, step, index))
        if self.device.type == "cuda":
            window = window.pin_memory().to(self.device, non_blocking=True)
        return window[:, :-1].contiguous(), window[:, 1:].contiguous()


def forward_backward(train_model, model, batches, step, args, dist, autocast, extension):
    """The gradients of one step, summed over its micro-batches (DDP syncs the last one only);
    returns this rank's mean loss and the (n_layer, n_head) max logit over micro-batches and ranks,
    on the device."""
    extension.begin_step(step)
    micro_steps, loss, max_logit = args.grad_accum // dist.world, 0.0, None
    for micro in range(micro_steps):
        x, y = batches.get("train", step, micro * dist.world + dist.rank)
        sync = dist.world == 1 or micro == micro_steps - 1
        with autocast(), (contextlib.nullcontext() if sync else train_model.no_sync()):
            _, micro_loss, micro_max_logit = train_model(x, y)
        (micro_loss / micro_steps).backward()
        loss += micro_loss.detach().float() / micro_steps
        max_logit = running_max(max_logit, micro_max_logit)
        extension.after_micro_backward(model, x, y, autocast, micro_steps)   # (3) its own gradient
    extension.after_backward(model, dist)                                    # (3) an error in one
    return loss, dist.all_reduce(max_logit.float(), "max")


def validation_loss(eval_model, batches, step, args, dist, autocast, log):
    """Mean validation loss over the same eval_iters batches each time, split over ranks; logged."""
    eval_model.eval()
    total = torch.zeros(2, device=dist.device)
    with torch.no_grad():
        for i in range(dist.rank, args.eval_iters, dist.world):
            with autocast():
                loss = eval_model(*batches.get("val", 0, i))[1]
            total += torch.stack([loss.float(), torch.ones((), device=dist.device)])
    eval_model.train()
    total = dist.all_reduce(total, "sum")
    val_loss = (total[0] / total[1]).item()
    log.write({"event": "eval", "step": step, "val_loss": val_loss},
              f"step {step:6d} | val loss {val_loss:.4f}")
    return val_loss


def watch(step, model, monitor, guard, detector, totals, args, log):
    """Measure W_q's and W_k's top singular values, and give them and the max logit since the last
    check to the guard (which acts on a crossing one monitored step later: observe_deferred)."""
    monitor.measure(model, args.power_iters, kinds=QK_KINDS)
    max_logit, totals.monitor_max_logit = totals.monitor_max_logit, None   # since the last check
    event = guard.observe_deferred(step, max_logit, monitor.sigma_head, model)
    if event:
        detector.pause(event["active_from"] + args.collapse_grace)   # the switch is not a collapse
        log.write(event, f"step {event['step']:6d} | QK-Guard {event['event']}: {event['signal']} "
                         f"{event['value']:.1f} > {guard.threshold:g} at layer {event['layer']} "
                         f"head {event['head']}: {guard.action} on in layers {event['layers']} "
                         f"from step {event['active_from']}")


def write_interval_record(step, lr, grad_norm, model, args, dist, log, totals, monitor, guard,
                          extension):
    """Write the record of the interval that ends at `step` (mean loss, max logit and sigmas since
    the last record, at the last update, step - 1) and start the next interval; returns it."""
    # the other weights, for the log only, with the power iterations of every step since the last
    # record (falling behind would understate a growing sigma)
    monitor.measure(model, args.power_iters * args.log_interval, kinds=NON_QK_KINDS)
    interval = totals.take_interval(dist, args.grad_accum * args.batch_size * args.block_size)
    record = {"step": step - 1, "lr": lr, "loss": interval["loss"], "grad_norm": grad_norm.item(),
              "tokens_per_s": interval["tokens_per_s"], "max_logit": interval["max_logit"],
              **monitor.record(),
              "guard": "on" if guard.triggered else ("dormant" if guard.enabled else "off"),
              **extension.log_stats()}
    max_logit = torch.tensor(record["max_logit"])
    layer, head = divmod(int(max_logit.argmax()), max_logit.shape[1])
    log.write(record, f"step {record['step']:6d} | loss {record['loss']:.4f} | lr {lr:.2e} | gnorm "
                      f"{record['grad_norm']:.2f} | max logit {max_logit.max().item():7.1f} "
                      f"(L{layer} H{head}) | sigma(Wq) {max(record['sigma_q']):.2f} | "
                      f"{record['tokens_per_s'] / 1e3:.1f}k tok/s | guard {record['guard']}")
    totals.start_clock()
    return record


def collapsed(detector, record, log):
    """Give the detector the record's loss; on a collapse, log it. Returns whether it collapsed."""
    collapse = detector.update(record["step"], record["loss"])
    if collapse:
        log.write({"event": "collapse", "step": detector.collapsed_at, "loss": record["loss"]},
                  f"step {record['step']:6d} | COLLAPSE detected (first bad step "
                  f"{detector.collapsed_at})")
    return collapse


class Totals:
    """Running totals, kept on the device so that only a log record syncs with the host."""

    def __init__(self, device):
        self.loss_sum, self.steps, self.max_logit = 0.0, 0, None   # since the last log record
        self.monitor_max_logit = None                               # since the last monitored step
        self.last_eval = None    # [step, val loss] of the last eval: the end record's
        self.device = device
        self.start_clock()

    def note_eval(self, step, val_loss):
        self.last_eval = [step, val_loss]
        return val_loss

    def start_clock(self):
        """The clock of tokens_per_s: started before the first step and after each record (a resumed
        interval's steps before the stop are not timed by it)."""
        self.started, self.clock_steps = time.time(), self.steps

    def add(self, loss, max_logit):
        self.loss_sum, self.steps = self.loss_sum + loss, self.steps + 1
        self.max_logit = running_max(self.max_logit, max_logit)
        self.monitor_max_logit = running_max(self.monitor_max_logit, max_logit)

    def take_interval(self, dist, tokens_per_step):
        """The interval's tokens/s, mean loss (all ranks) and max logit; the sums start over."""
        elapsed = time.time() - self.started
        interval = {"loss": dist.all_reduce(torch.as_tensor(self.loss_sum / self.steps)).item(),
                    "tokens_per_s": tokens_per_step * (self.steps - self.clock_steps) / elapsed,
                    "max_logit": self.max_logit.tolist()}
        self.loss_sum, self.steps, self.max_logit = 0.0, 0, None
        return interval

    def state_dict(self):   # the sums and maxima (None between intervals); main restarts the clock
        return {k: v.cpu() if torch.is_tensor(v) else v for k, v in vars(self).items()
                if k != "device"}

    def load_state_dict(self, state):
        vars(self).update({k: v.to(self.device) if torch.is_tensor(v) else v
                           for k, v in state.items()})


def running_max(running, new):   # None before the first value
    return new if running is None else torch.maximum(running, new)


def lr_at(step, args):
    """Linear warmup to --lr, then constant or a cosine down to --min-lr at --decay-steps."""
    if step < args.warmup_steps:
        return args.lr * (step + 1) / args.warmup_steps
    if args.schedule == "constant":
        return args.lr
    progress = min(1.0, (step - args.warmup_steps) / max(1, args.decay_steps - args.warmup_steps))
    return args.min_lr + 0.5 * (1.0 + math.cos(math.pi * progress)) * (args.lr - args.min_lr)


def write_end_record(status, step, last_eval, detector, guard, args, log):
    """The end record and the run's last line; guard_pending: a crossing the last check left no step
    to act on; val_loss, val_step: the last eval run (last_eval: [step, val loss] or None)."""
    val_step, val_loss = last_eval or (None, None)
    end = {"event": "end", "status": status, "step": step, "collapse_step": detector.collapsed_at,
           "guard_trigger": guard.trigger, "guard_pending": guard.pending_crossing(),
           "val_loss": val_loss, "val_step": val_step}
    what = [f"run {status} at step {step}"]
    if guard.trigger:
        what.append(f"QK-Guard fired at step {guard.trigger['step']} ({guard.signal} "
                    f"{guard.trigger['value']:.1f} > {guard.threshold:g}, layer "
                    f"{guard.trigger['layer']} head {guard.trigger['head']}) and {guard.action} "
                    f"stayed on")
    elif guard.pending_crossing() is not None:
        what.append(f"QK-Guard saw {guard.signal} cross {guard.threshold:g} at step "
                    f"{guard.pending_crossing()} with no step left to act on (a resume with more "
                    f"steps acts on it)")
    elif guard.enabled:
        what.append(f"QK-Guard stayed dormant ({guard.signal} never crossed {guard.threshold:g})")
    if detector.collapsed_at is not None:
        what.append(f"the loss collapsed from step {detector.collapsed_at}")
    if val_loss is not None:
        what.append(f"val loss {val_loss:.4f} at step {val_step}")
    log.write(end, "; ".join(what) + f". Log and checkpoint in {args.out_dir}")


def prepare_command(dataset, tokenizer, out_dir):
    """The prepare_data.py command that builds this data into out_dir (the errors quote it)."""
    inputs = " --input YOUR_FILES" if dataset == "text" else ""
    return (f"python prepare_data.py --dataset {dataset} --tokenizer {tokenizer}{inputs} --out-dir "
            f"{out_dir}")


def padded_vocab(n):
    """n tokens padded to a multiple of 64 for faster matmuls; padding rows are never targets."""
    return 64 * math.ceil(n / 64)


def vocabulary(args, typed, windows):
    """(tokenizer, model vocabulary) from the data's meta.json. Refused: data of another tokenizer
    than --tokenizer names or the resumed run trained on (its embedding would not fit)."""
    vocab = padded_vocab(windows.vocab_size)
    holds = f"{args.data_dir} holds {windows.tokenizer} tokens (its meta.json)"
    if args.resume and (args.tokenizer, args.vocab_size) != (windows.tokenizer, vocab):
        build = prepare_command(args.dataset, args.tokenizer, "NEW_FOLDER")
        raise SystemExit(f"error: this run was trained on {args.tokenizer} tokens (vocabulary "
                         f"{args.vocab_size}) and {holds}: resume it with the --data-dir it "
                         f"started with (or rebuild that data into a new folder: `{build}`), or "
                         f"start a new run")
    if "tokenizer" in typed and not args.resume and typed["tokenizer"] != windows.tokenizer:
        raise SystemExit(f"error: --tokenizer {typed['tokenizer']}, but {holds}: give --tokenizer "
                         f"{windows.tokenizer}, or a --data-dir prepared with --tokenizer "
                         f"{typed['tokenizer']}")
    return windows.tokenizer, vocab


def check_attention_settings(model, device, args, use_bf16):
    """Fail before training, in the kernel's words, on a setting it cannot run (head dim, impl)."""
    attn = model.attentions[0]
    dtype = torch.bfloat16 if use_bf16 or attn.attn_dtype is not None else torch.float32   # q, k, v
    qkv = torch.zeros(1, 1, 1, attn.head_dim, device=device, dtype=dtype)
    softcap = args.softcap_value if args.guard == "on" and args.guard_action == "softcap" \
        else attn.softcap
    try:
        attn.attend(qkv, qkv, qkv, softcap=softcap, return_max_logit=False)
    except ValueError as e:
        raise SystemExit(f"error: the attention settings cannot run: {e}")


def command_line(extension=None):
    """main() as a command runs it (this file, lab/train_assay.py)."""
    try:
        main(extension=extension)
    except KeyboardInterrupt:   # before the loop (StopSignal takes Ctrl-C from then on): no write
        print("interrupted before training started", file=sys.stderr)
        sys.exit(130)


if __name__ == "__main__":
    command_line()
