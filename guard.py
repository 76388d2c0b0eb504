"""QK-Guard's decisions, under the name the reference's scripts import them by (`from guard import
QKGuard`).

The code is qkguard/guard.py: the drop-in package `qkguard` runs these decisions unchanged, and
keeping them inside it lets `pip install .` install one top-level package, with no module `guard`
that would shadow (or be shadowed by) a user's own guard.py. Every public name is re-exported, so
train.py, run.py and the lab read the very same objects (classes, the ACTIONS registry) that
qkguard does.
"""
from qkguard.guard import *  # noqa: F401,F403  (QKGuard, ACTIONS, SpectralMonitor, ...)
