"""QK-Guard's decisions, under the name the reference's scripts import them by. The code is
qkguard/guard.py, so that `pip install .` installs one package and no module `guard` to shadow a
user's own; every public name is re-exported: train.py and the lab use the very objects (classes,
the ACTIONS registry) that qkguard does.
"""
from qkguard.guard import *  # noqa: F401,F403  (QKGuard, ACTIONS, SpectralMonitor, ...)
