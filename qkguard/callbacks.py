"""
QKGuardCallback: an attached guard in a Hugging Face Trainer, in one argument.

    guard = qkguard.attach(model)
    trainer = Trainer(model=model, args=args, train_dataset=data, callbacks=[QKGuardCallback(guard)])
    trainer.train()                                   # or train(resume_from_checkpoint=True)

What it does, at each of Trainer's events:
  after each optimizer update (on_step_end)  guard.step(); an event it returns is kept, with its steps
        in Trainer's numbering (global_step: the update's number, counted from 1; the guard counts from
        0), and makes Trainer log at that step
  at each log (on_log)  the guard's signals, and an event since the last log, go into Trainer's logs:
        the console, every report_to tracker and trainer.state.log_history, at Trainer's global step
  at each checkpoint (on_save)  guard.state_dict() into the checkpoint folder, as qkguard.pt
  at a resume (on_train_begin)  that file loaded from the checkpoint Trainer resumes from: the latch,
        the sampling generator and the power iteration's vectors, so the run goes on bit for bit as
        the uninterrupted one (test_callbacks.py checks it)

transformers is imported here, and only here: `import qkguard` works without it.

Trainer calls its callbacks in list order, the report_to trackers first. The guard's values must be in
the logs before the trackers read them, so this callback moves itself to the front of the list when
Trainer is built (on_init_end). Callbacks are handed no Trainer: it is found on the call stack, as
the `self` of the Trainer method that called the event (the same lookup finds the checkpoint a
resume reads). If a later transformers moved those calls, the lookup fails in one line, not silently.
"""
import os
import sys

import torch
from transformers import Trainer, TrainerCallback

from qkguard._loop import GuardLoop
from qkguard.serve import GUARD_FILE as STATE_FILE, read_guard_file, save_guard



def _trainer_frame(has=None):
    """The innermost caller frame whose `self` is a Trainer (and which has the local `has`, if given)."""
    frame = sys._getframe(2)
    while frame is not None:
        if isinstance(frame.f_locals.get("self"), Trainer) and (has is None or has in frame.f_locals):
            return frame
        frame = frame.f_back
    raise RuntimeError("QKGuardCallback: no Trainer on the call stack: pass it to Trainer(callbacks=[...]) and let "
                       "Trainer call it (this transformers may call its callbacks in a way this file does not know)")


class QKGuardCallback(GuardLoop, TrainerCallback):
    """Steps, logs, saves and resumes an AttachedGuard under transformers.Trainer.

    guard       the AttachedGuard of Trainer's model (qkguard.attach(model, ...))
    missing_ok  on a resume from a checkpoint with no qkguard.pt (saved without this callback): False
                refuses in one line; True starts the guard as attached (a fired state is then lost)

    callback.events holds the guard's events with their steps in Trainer's numbering; callback.signals()
    is what goes into a log (both from _loop.GuardLoop, which the Lightning callback shares).
    """

    def on_init_end(self, args, state, control, **kwargs):
        handler = _trainer_frame().f_locals["self"].callback_handler
        # first: the trackers read the logs after this adds to them. (The handler is looping over this list
        # now; a remove before and an insert before leave the callbacks after this one where they were.)
        handler.callbacks.remove(self)
        handler.callbacks.insert(0, self)

    def on_train_begin(self, args, state, control, model=None, **kwargs):
        if model is not None and model is not self.guard.model:
            raise ValueError("QKGuardCallback: the guard is attached to another model than Trainer's: attach it to "
                             "the model you pass to Trainer")
        checkpoint = _trainer_frame(has="resume_from_checkpoint").f_locals["resume_from_checkpoint"]
        if checkpoint is None:
            return
        path = os.path.join(checkpoint, STATE_FILE)
        if os.path.exists(path):
            self.guard.load_state_dict(read_guard_file(path, bare_ok=True)["state"])
        elif not self.missing_ok:
            raise FileNotFoundError(f"QKGuardCallback: the checkpoint {checkpoint} has no {STATE_FILE} (saved without "
                                    f"this callback), so a guard that had fired would run unguarded: pass "
                                    f"QKGuardCallback(guard, missing_ok=True) to start the guard anew")

    def on_step_end(self, args, state, control, **kwargs):
        if self.step_guard(state.global_step) is not None:
            control.should_log = True           # logged at the step it acts, not at the next logging step
        return control

    def on_log(self, args, state, control, logs=None, **kwargs):
        if logs is None or not any(key in logs for key in ("loss", "learning_rate")):
            return                              # an eval or end-of-train log: the signals belong to training logs
        signals = self.signals()
        logs.update(signals)
        if state.log_history and state.log_history[-1].get("step") == state.global_step:
            state.log_history[-1].update(signals)      # Trainer copied the logs into the history before calling us

    def on_save(self, args, state, control, **kwargs):
        folder = os.path.join(args.output_dir, f"checkpoint-{state.global_step}")   # Trainer's own name for it
        if args.should_save:     # save_guard's format, so serve.load_guard reads this folder too
            save_guard(self.guard, folder)
