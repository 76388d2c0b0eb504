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
  at each checkpoint  Trainer asks every stateful callback (transformers' ExportableState) for its
        state() and writes it into the checkpoint's trainer_state.json: here the events and a token
        naming this save; then (on_save) the guard itself, as serve.save_guard writes it, into the
        checkpoint folder as qkguard.pt, with that token
  at a resume (on_train_begin)  Trainer has read trainer_state.json back into `state`: the events come
        back from it, and the guard from the qkguard.pt of checkpoint-<global_step>, its token checked
        against the one the state names, so the run goes on bit for bit as the uninterrupted one
        (test_callbacks.py checks it)

transformers is imported here, and only here: `import qkguard` works without it.

Trainer calls its callbacks in list order, the report_to trackers first. The guard's values must be in
the logs before the trackers read them, so this callback moves itself to the front of the list when
Trainer is built (on_init_end). Callbacks are handed no Trainer, and transformers has no way to put a
callback before its trackers, so this one lookup finds the Trainer on the call stack (the `self` of
the method that called on_init_end) and gives it a new list; if a later transformers moved that call,
the lookup fails in one line, not silently.
"""
import os
import sys
import uuid

from transformers import Trainer, TrainerCallback
from transformers.trainer_callback import ExportableState

from qkguard._loop import GuardLoop
from qkguard.serve import GUARD_FILE as STATE_FILE, read_guard_file, save_guard


def _building_trainer():
    """The Trainer whose __init__ calls on_init_end: the `self` of the innermost caller that is one."""
    frame = sys._getframe(2)
    while frame is not None:
        if isinstance(frame.f_locals.get("self"), Trainer):
            return frame.f_locals["self"]
        frame = frame.f_back
    raise RuntimeError("QKGuardCallback: no Trainer on the call stack at on_init_end: pass it to "
                       "Trainer(callbacks=[...]) (this transformers may build its callbacks in a way this file does "
                       "not know)")


class QKGuardCallback(GuardLoop, TrainerCallback, ExportableState):
    """Steps, logs, saves and resumes an AttachedGuard under transformers.Trainer.

    guard       the AttachedGuard of Trainer's model (qkguard.attach(model, ...))
    missing_ok  on a resume from a checkpoint with no guard saved in it (saved without this callback):
                False refuses in one line; True starts the guard as attached (a fired state is then lost)

    callback.events holds the guard's events with their steps in Trainer's numbering; callback.signals()
    is what goes into a log (both from _loop.GuardLoop, which the Lightning callback shares).
    """

    def __init__(self, guard=None, missing_ok=False):
        if guard is None:      # Trainer rebuilds stateful callbacks from JSON where asked to: a guard is not JSON
            raise ValueError("QKGuardCallback needs the attached guard, QKGuardCallback(guard); if Trainer built it, "
                             "leave TrainingArguments(restore_callback_states_from_checkpoint=False): this callback "
                             "restores its own state on a resume")
        super().__init__(guard, missing_ok)
        self._token = None         # names the save whose trainer_state.json and qkguard.pt belong together

    def state(self):
        """What Trainer writes into trainer_state.json at each checkpoint (ExportableState), just before
        on_save writes the guard: the events in Trainer's numbering, and a new token naming this save."""
        self._token = uuid.uuid4().hex
        return {"args": {}, "attributes": {"events": self.events, "token": self._token}}

    def on_init_end(self, args, state, control, **kwargs):
        handler = _building_trainer().callback_handler
        # first, so the trackers read the logs after this adds to them: a new list, since the handler is
        # iterating over the old one now
        handler.callbacks = [self] + [c for c in handler.callbacks if c is not self]

    def on_train_begin(self, args, state, control, model=None, **kwargs):
        if model is not None and model is not self.guard.model:
            raise ValueError("QKGuardCallback: the guard is attached to another model than Trainer's: attach it to "
                             "the model you pass to Trainer")
        if state.global_step == 0:
            return                              # a new run: nothing to resume
        folder = os.path.join(args.output_dir, f"checkpoint-{state.global_step}")
        saved = state.stateful_callbacks.get(type(self).__name__)
        saved = saved[0] if isinstance(saved, list) else saved
        path = os.path.join(folder, STATE_FILE)
        if saved is None or not os.path.exists(path):
            if self.missing_ok:   # the Trainer's next save updates this callback's entry: make one
                state.stateful_callbacks.setdefault(type(self).__name__, self.state())
                return
            raise FileNotFoundError(f"QKGuardCallback: the checkpoint of step {state.global_step} has no {STATE_FILE} "
                                    f"in {folder} (saved without this callback, or resumed from another folder), so a "
                                    f"guard that had fired would run unguarded: resume from a checkpoint in "
                                    f"args.output_dir, or pass QKGuardCallback(guard, missing_ok=True) to start the "
                                    f"guard anew")
        file = read_guard_file(path)
        if file.get("token") != saved["attributes"]["token"]:
            raise ValueError(f"QKGuardCallback: {path} was saved with another checkpoint than the one this run resumes "
                             f"(step {state.global_step}): resume from the checkpoint-{state.global_step} folder in "
                             f"args.output_dir, whose {STATE_FILE} and trainer_state.json were saved together")
        self.guard.load_state_dict(file["state"])
        self.events = [dict(event) for event in saved["attributes"]["events"]]

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

    def on_train_end(self, args, state, control, **kwargs):
        """load_best_model_at_end: Trainer has loaded the best checkpoint's weights (just before this call); the
        guard saved with them comes back too, so the model ends with the action it was trained with there."""
        best = state.best_model_checkpoint
        if args.load_best_model_at_end and best and os.path.exists(os.path.join(best, STATE_FILE)):
            self.guard.load_state_dict(read_guard_file(os.path.join(best, STATE_FILE))["state"])

    def on_save(self, args, state, control, **kwargs):
        folder = os.path.join(args.output_dir, f"checkpoint-{state.global_step}")   # Trainer's own name for it
        if args.should_save:     # save_guard's format, so serve.load_guard reads this folder too
            save_guard(self.guard, folder, token=self._token)
