"""
What qkguard's trainer callbacks share: callbacks.py's QKGuardCallback (transformers.Trainer) and
lightning.py's QKGuardLightningCallback (PyTorch Lightning). Torch only, so each callback's module
imports its own framework and nothing else.

  step_guard(global_step)  guard.step() after the optimizer update the trainer numbers global_step (counted
        from 1; the guard counts from 0); its event, if any, kept with its steps in that numbering
  signals()  the guard's last measured values as numbers, and the events not yet logged
"""


class GuardLoop:
    """The bookkeeping of an AttachedGuard under a trainer: its events in the trainer's numbering, and
    its signals for the trainer's logs. A callback subclasses it with its framework's callback class.

    guard       the AttachedGuard of the trainer's model (qkguard.attach(model, ...))
    missing_ok  on a resume from a checkpoint without the guard's state (saved without the callback):
                False refuses in one line; True starts the guard as attached (a fired state is then lost)
    """

    def __init__(self, guard, missing_ok=False):
        self.guard, self.missing_ok = guard, missing_ok
        self.events = []          # the guard's events, steps in the trainer's numbering
        self._unlogged = []       # events since the last log

    def step_guard(self, global_step):
        """guard.step() after the update the trainer numbers `global_step`: its event renumbered, or None."""
        event = self.guard.step()
        if event is not None:
            # this update is the guard's number steps - 1 (it counts from 0) and the trainer's global_step (from
            # 1); the offset also holds for a guard attached mid-run
            offset = global_step - (self.guard.steps - 1)
            event = {**event, "step": event["step"] + offset, "active_from": event["active_from"] + offset}
            self.events.append(event)
            self._unlogged.append(event)
        return event

    def signals(self):
        """The guard's last measured values as numbers (trackers log numbers), and the events since the last
        log. guard.record() refreshes the sigmas the guard does not watch (a host sync, as a log step is)."""
        guard, out = self.guard, {}
        guard.record()
        if guard.max_logit is not None:
            out["qkguard/max_logit"] = guard.max_logit.max().item()
        out["qkguard/sigma_product"] = (guard.sigma_head[:, 0] * guard.sigma_head[:, 1]).max().item()
        out["qkguard/on"] = float(guard.on)
        for event in self._unlogged:            # one per event kind is plenty: a trigger, then extensions
            for key in ("step", "layer", "head", "value", "active_from"):
                out[f"qkguard/{event['event']}/{key}"] = event[key]
        self._unlogged = []
        return out
