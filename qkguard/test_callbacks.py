"""qkguard/callbacks.py and qkguard/serve.py: the guard under transformers.Trainer, and a fired model served.

Needs transformers (and accelerate, which Trainer needs); skipped without them. A tiny Llama on fixed
random tokens, its W_q and W_k inflated so that the guard fires within the first updates.
"""
import math
import os

import pytest
import torch

pytest.importorskip("accelerate")
transformers = pytest.importorskip("transformers")

import qkguard                                            # noqa: E402
from qkguard.callbacks import STATE_FILE, QKGuardCallback  # noqa: E402
from qkguard.test_attach import VOCAB, build, inflate_qk  # noqa: E402

STEPS, SAVE_AT = 6, 3         # the uninterrupted run's updates, and the checkpoint the resumed one starts from


class Tokens(torch.utils.data.Dataset):
    def __init__(self, n=64, t=16):
        self.x = torch.randint(0, VOCAB, (n, t), generator=torch.Generator().manual_seed(3))

    def __len__(self):
        return len(self.x)

    def __getitem__(self, i):
        return {"input_ids": self.x[i], "labels": self.x[i]}


class Tracker(transformers.TrainerCallback):
    """A report_to tracker's place in the list (before the user's callbacks): what it is handed to log."""
    def __init__(self):
        self.logged = []

    def on_log(self, args, state, control, logs=None, **kwargs):
        self.logged.append((state.global_step, dict(logs)))


class Stop(transformers.TrainerCallback):
    """The interruption: training ends after update `at` (and its checkpoint), as a killed job would."""
    def __init__(self, at):
        self.at = at

    def on_step_end(self, args, state, control, **kwargs):
        control.should_training_stop = state.global_step >= self.at


def train(out, stop=STEPS, resume=None, **guard_settings):
    """A Trainer run of STEPS updates, ended after `stop` or resumed from the checkpoint `resume`: its logs
    and guard. (STEPS for all: the learning rate schedule follows max_steps.)"""
    transformers.set_seed(0)
    model, _ = build("hf-llama")
    inflate_qk(model, 8.0)
    guard = qkguard.attach(model, **{"threshold": 5.0, **guard_settings})
    tracker = Tracker()
    args = transformers.TrainingArguments(output_dir=str(out), max_steps=STEPS, per_device_train_batch_size=4,
                                          learning_rate=1e-3, logging_steps=1, save_steps=SAVE_AT, save_strategy="steps",
                                          report_to="none", use_cpu=True, seed=0, disable_tqdm=True,
                                          dataloader_num_workers=0, save_only_model=False)
    callback = QKGuardCallback(guard)
    trainer = transformers.Trainer(model=model, args=args, train_dataset=Tokens(), callbacks=[tracker, callback, Stop(stop)])
    trainer.train(resume_from_checkpoint=resume)
    losses = {e["step"]: e["loss"] for e in trainer.state.log_history if "loss" in e}
    return losses, guard, callback, tracker, trainer


def test_a_resumed_trainer_run_is_the_uninterrupted_one_bit_for_bit(tmp_path):
    """6 updates in one go, against 3, a checkpoint, and a new Trainer resumed from it for the other 3:
    the same losses and the same guard state bit for bit, the guard having fired before the checkpoint."""
    whole, guard, callback, tracker, _ = train(tmp_path / "whole")
    assert guard.triggered and callback.events[0]["active_from"] <= SAVE_AT, "the check needs a fire before the save"
    train(tmp_path / "parts", stop=SAVE_AT)
    saved = tmp_path / "parts" / f"checkpoint-{SAVE_AT}"
    assert (saved / STATE_FILE).exists()
    later, resumed, _, _, _ = train(tmp_path / "parts", resume=str(saved))
    assert resumed.triggered and resumed.steps == guard.steps == STEPS
    assert later == whole and set(whole) == set(range(1, STEPS + 1))   # the resumed history holds steps 1-3 too
    a, b = guard.state_dict(), resumed.state_dict()
    assert a["guard"]["trigger"] == b["guard"]["trigger"] and torch.equal(a["generator"], b["generator"])
    assert all(torch.equal(a["sigma_v"][k], b["sigma_v"][k]) for k in a["sigma_v"])
    assert torch.equal(guard.max_logit, resumed.max_logit)


def test_events_and_signals_reach_the_trackers_at_trainers_global_step(tmp_path):
    """The guard counts updates from 0, Trainer from 1: the event is logged in Trainer's numbering, at the
    step the guard acts, in the logs a tracker listed before the callback is handed, and in log_history."""
    _, guard, callback, tracker, trainer = train(tmp_path, stop=4)
    (event,) = guard.events
    (logged,) = callback.events
    assert logged["step"] == event["step"] + 1 and logged["active_from"] == event["active_from"] + 1
    at = {step: logs for step, logs in tracker.logged if "loss" in logs}    # not the end-of-training summary
    acted = logged["active_from"] - 1                          # the update after which guard.step() acted
    assert at[acted]["qkguard/guard_trigger/step"] == logged["step"] and at[acted]["qkguard/on"] == 1.0
    assert all("qkguard/max_logit" in at[s] for s in range(1, 5))
    history = {e["step"]: e for e in trainer.state.log_history if "loss" in e}
    assert history[acted]["qkguard/guard_trigger/value"] == pytest.approx(logged["value"])
    assert math.isfinite(history[4]["qkguard/sigma_product"])


def test_a_resume_from_a_checkpoint_without_the_guards_state_is_refused_in_one_line(tmp_path):
    train(tmp_path, stop=SAVE_AT)
    saved = tmp_path / f"checkpoint-{SAVE_AT}"
    os.remove(saved / STATE_FILE)
    with pytest.raises(FileNotFoundError, match=rf"has no {STATE_FILE} .*QKGuardCallback\(guard, missing_ok=True\)"):
        train(tmp_path, resume=str(saved))
