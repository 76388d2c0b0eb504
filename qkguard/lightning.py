"""
QKGuardLightningCallback: an attached guard under PyTorch Lightning, in one argument.

    guard = qkguard.attach(module.model)              # the model inside your LightningModule (or the module)
    trainer = pl.Trainer(..., callbacks=[QKGuardLightningCallback(guard)])
    trainer.fit(module)                               # or trainer.fit(module, ckpt_path=...)

What it does, at each of Lightning's hooks (the same loop as callbacks.py's QKGuardCallback, whose
bookkeeping it shares through _loop.GuardLoop):
  after each optimizer update (on_train_batch_end where trainer.global_step advanced, so once per update
        under accumulate_grad_batches)  guard.step(); an event it returns is kept in callback.events,
        its steps in Lightning's numbering (global_step after the update, counted from 1; the guard
        counts from 0)
  at the updates Lightning writes its logs (global_step a multiple of log_every_n_steps, or the trainer
        stopping) and the update the guard acts on  the guard's signals through pl_module.log: into
        trainer.callback_metrics and, on Lightning's log steps, every logger, in the row of that update's
        own metrics. An event's fields go straight to trainer.loggers at that row's step, once (logged
        through pl_module.log they would repeat in every later row of the epoch)
  at each checkpoint (on_save_checkpoint)  guard.state_dict() into the checkpoint dict, under "qkguard"
  at a resume (on_load_checkpoint, in fit(ckpt_path=...))  that state loaded: the latch, the sampling
        generator and the power iteration's vectors, so the run goes on bit for bit as the uninterrupted
        one (test_lightning.py checks it)

Lightning is imported here, and only here: `import qkguard` works without it. Either distribution serves:
`lightning` (import lightning.pytorch) or `pytorch_lightning`. Where both are installed (`pip install
lightning` installs both), the callback is a Callback of each, so either's Trainer takes it: each Trainer
checks its callbacks against its own Callback class.
"""
import importlib

from qkguard._loop import GuardLoop


def _lightning():
    """The Lightning packages installed, lightning.pytorch (the `lightning` distribution) first, then
    pytorch_lightning; neither: one line. (A package that is there but lacks one of its own dependencies
    raises as itself.)"""
    found = []
    for name in ("lightning.pytorch", "pytorch_lightning"):
        try:
            found.append(importlib.import_module(name))
        except ModuleNotFoundError as e:
            if e.name not in (name, name.split(".")[0]):
                raise
    if not found:
        raise ImportError("qkguard.lightning needs PyTorch Lightning: pip install lightning (or pytorch-lightning)")
    return found


PACKAGES = _lightning()   # `lightning` depends on `pytorch_lightning`, so most installs have both

STATE_KEY = "qkguard"     # in Lightning's checkpoint dict, beside "state_dict", "optimizer_states", ...
EVENTS_KEY = "qkguard_events"     # callback.events, kept across a resume
SIGNALS = ("qkguard/max_logit", "qkguard/sigma_product", "qkguard/on")


class QKGuardLightningCallback(GuardLoop, *(package.Callback for package in PACKAGES)):
    """Steps, logs, saves and resumes an AttachedGuard under a PyTorch Lightning Trainer (lightning.pytorch's
    or pytorch_lightning's).

    guard       the AttachedGuard of the LightningModule's model (qkguard.attach(model, ...)): the module
                itself or one of its submodules
    missing_ok  on fit(ckpt_path=...) from a checkpoint with no "qkguard" entry (saved without this
                callback): False refuses in one line; True starts the guard as attached (a fired state is
                then lost)
    """

    def __init__(self, guard, missing_ok=False):
        GuardLoop.__init__(self, guard, missing_ok)
        self._stepped = None      # trainer.global_step at the last update the guard stepped on

    def setup(self, trainer, pl_module, stage):
        if stage == "fit" and not any(m is self.guard.model for m in pl_module.modules()):
            raise ValueError("QKGuardLightningCallback: the guard is attached to a model that is not in the "
                             "LightningModule: attach it to the module you train (or the model inside it)")

    def on_train_start(self, trainer, pl_module):
        self._stepped = trainer.global_step     # 0, or a resumed checkpoint's

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        if trainer.global_step == self._stepped:
            return                              # a micro-batch of an accumulation: no update yet
        self._stepped = trainer.global_step
        event = self.step_guard(trainer.global_step)
        # the step Lightning writes this update's row at, its count of updates before this one (global_step
        # N's row is N - 1), and whether it writes one now: Lightning's own test (LoggerConnector's
        # should_update_logs, which reads this count plus 1)
        row, every = trainer.fit_loop.epoch_loop._batches_that_stepped, trainer.log_every_n_steps
        logs_now = trainer.should_stop or (every > 0 and (row + 1) % every == 0)
        if not (logs_now or event is not None):
            return                              # signals cost a host sync: only where they are read
        out = self.signals()
        for key in SIGNALS:
            if key in out:
                pl_module.log(key, out[key], on_step=True, on_epoch=False, batch_size=1)
        if event is not None:
            # the event once (and, off Lightning's log steps, the signals beside it) straight to the loggers
            direct = {key: value for key, value in out.items() if not logs_now or key not in SIGNALS}
            for logger in trainer.loggers:
                logger.log_metrics(direct, step=row)

    def on_save_checkpoint(self, trainer, pl_module, checkpoint):
        checkpoint[STATE_KEY] = self.guard.state_dict()                  # the guard's own events inside
        checkpoint[EVENTS_KEY] = [dict(event) for event in self.events]   # the callback's, in Lightning's numbering

    def on_load_checkpoint(self, trainer, pl_module, checkpoint):
        if STATE_KEY in checkpoint:
            self.guard.load_state_dict(checkpoint[STATE_KEY])
            self.events = [dict(event) for event in checkpoint.get(EVENTS_KEY, [])]
        elif not self.missing_ok:
            raise ValueError(f"QKGuardLightningCallback: the checkpoint {trainer.ckpt_path} has no {STATE_KEY!r} entry "
                             f"(saved without this callback), so a guard that had fired would run unguarded: pass "
                             f"QKGuardLightningCallback(guard, missing_ok=True) to start the guard anew")
