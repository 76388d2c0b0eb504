"""
The verdict rules' numbers, as committed: every threshold a rule compares with, in one place. The rules'
history (what each number was before, and why it moved) is prose in lab/MEASUREMENTS.md, not code.
"""
from guard import ACTIONS, DEFAULT_THRESHOLD
from lab.stats import ALPHA, LOSS_TOL  # noqa: F401  (the statistics' own two: a sign test's level, the tolerance)

FINAL_WINDOW = 5         # final train loss = mean of the last FINAL_WINDOW logged losses
RUNAWAY_LOGIT = 1000.0   # a runaway's max logit, between healthy and runaway peaks (SOURCES.md)
SIGMA_RATIO = 2.0        # "through the QK channel": sigma(W_q or W_k) grew SIGMA_RATIO times as
                         # much as any other weight matrix's, and as the no-error run's
LOGIT_RATIO = 10.0       # "beyond the no-error run": max logit >= LOGIT_RATIO x that run's
LOGIT_GAP = 2.0          # claim 4: one error's max logit "higher" than the other's only by this factor
FIX_TOL = 0.1            # nat: a QK-only fix ends at most FIX_TOL above the no-error run's val loss
RISE_WINDOW = 100        # claim 6 reports whether an action's logits were still rising over its last steps
GUARD_THRESHOLD = DEFAULT_THRESHOLD["max-logit"]     # the guard's default, for a run that gave none
LR_DROP_FACTOR = ACTIONS["lr-drop"].lr_factor        # the lr-drop's default (run.py's flag too; a test checks)

# The Bonferroni corrections count the grid each rule was committed with, not the part of it that ran: a
# rerun of one dose (a fork's natural experiment) is held to the committed thresholds, never looser. Where
# more ran than committed, the count is what ran (stricter). The lab's committed logs ran mlp-out at the
# grid's top three doses (the two below were cut for compute: lab/MEASUREMENTS.md, 2026-12-01), so claim 3
# was judged at ALPHA / 3 there and ALPHA / 5 at delta; the gradient sites never ran: the whole grid.
COMMITTED_DOSES = {"mlp-out": (3.0, 10.0, 30.0), "grad-mlp": (0.3, 1.0, 3.0, 10.0, 30.0),
                   "grad-wv": (0.3, 1.0, 3.0, 10.0, 30.0), "delta": (0.3, 1.0, 3.0, 10.0, 30.0)}
COMMITTED_LRS = (1e-3, 3e-3, 1e-2, 3e-2, 1e-1)   # rule 1p's grid (and 7p's): ALPHA / 5


def tests_counted(committed, run):
    """How many tests a Bonferroni correction divides ALPHA by: the committed grid's, or the part run where
    more ran than committed (a grid rule's tests are those of its committed cells, whatever subset ran)."""
    return max(len(committed), len(run), 1)
