"""
Print what a trained model writes: sample from a run directory's checkpoint with the run's own
numerics and, if its guard fired, with the guard's action on (as the model was when it stopped).

    python sample.py runs/<run>                  # 3 samples of 200 tokens after a newline
    python sample.py runs/<run> --prompt "def " --num-samples 5 --max-new-tokens 100
"""
import argparse
import contextlib
import dataclasses
import os

import torch

import model as model_lib
import run
import rundir
import tokenizer
from guard import QKGuard

# below it logits / temperature can overflow float32, and a logit gap of 0.05 is e^50 already
MIN_TEMPERATURE = 1e-3


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, allow_abbrev=False,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("run_dir", help="a run directory that holds ckpt.pt")
    p.add_argument("--prompt", default="\n", help="text to continue (default: a newline; empty: "
                   "from the end-of-text token, as at the start of a document)")
    p.add_argument("--num-samples", type=run.COUNT, default=3)
    p.add_argument("--max-new-tokens", type=run.COUNT, default=200)
    p.add_argument("--temperature", type=run.number(low=MIN_TEMPERATURE), default=0.8,
                   help=f"at least {MIN_TEMPERATURE:g}; --top-k 1 always takes the likeliest token")
    p.add_argument("--top-k", type=run.COUNT, default=200)
    p.add_argument("--seed", type=run.SIZE, default=0)
    p.add_argument("--device", default="auto", help="auto, cpu, cuda, cuda:N")
    args = p.parse_args(argv)
    path = os.path.join(args.run_dir, "ckpt.pt")
    if not os.path.exists(path):
        p.error(f"{path} does not exist: give a run directory that saved a checkpoint")
    device = torch.device(run.device_name(args.device))
    saved, state, model, guard = load_run(path, device)
    enc = tokenizer.get_tokenizer(saved.tokenizer)
    prompt = enc.encode(args.prompt) or [enc.eot_token]
    idx = torch.tensor([prompt] * args.num_samples, device=device)
    torch.manual_seed(args.seed)
    bf16 = torch.autocast(device.type, dtype=torch.bfloat16) if run.uses_bf16(saved.dtype, device) \
        else contextlib.nullcontext()   # the run's own numerics
    with bf16:
        out = model.generate(idx, args.max_new_tokens, args.temperature, args.top_k)
    what = f"step {state['step']}, accum {saved.accum}, guard " + (
        f"fired at step {guard.trigger['step']} ({guard.action} on)" if guard.triggered
        else saved.guard)
    for i, row in enumerate(out.tolist()):
        print(f"---------------- sample {i + 1} of {args.run_dir} ({what})\n{enc.decode(row)}")


def load_run(path, device):
    """(the run's flags, its checkpoint, the model in eval mode as it was when it stopped, its
    guard). The model's config is the one the checkpoint records (an extension may have changed
    the flags' own: lab/train_assay.py's --qk-fix qknorm)."""
    state = rundir.load_checkpoint(path)
    if not all(w.isfinite().all() for w in state["model"].values() if w.is_floating_point()):
        raise SystemExit(f"error: the model's weights in {path} (step {state['step']}) are not "
                         f"finite (NaN or inf): the run diverged before it saved them; sample an "
                         f"earlier run or checkpoint")
    saved = argparse.Namespace(**state["args"])
    config = model_lib.GPTConfig(**state["model_config"]) if "model_config" in state \
        else run.model_config(saved)
    if config.attn_impl == "triton" and device.type != "cuda":   # the twin: the same algorithm
        config = dataclasses.replace(config, attn_impl="auto")
    model = model_lib.GPT(config).to(device)
    model.load_state_dict(state["model"])
    guard = QKGuard.from_args(saved)
    guard.load_state_dict(state["guard"])
    guard.apply_to_model(model)   # a fired guard's attention-side action stays on
    return saved, state, model.eval(), guard


if __name__ == "__main__":
    main()
