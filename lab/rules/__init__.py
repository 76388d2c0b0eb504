"""
The verdict rules, one file per claim, each a check that can fail and only on evidence (lab/test_tools.py
gives every rule synthetic runs that must fail it):

    common.py      what every rule shares: the runs by arm and seed (Claim), judge_rule, mixed
    collapse.py    claims 1, 2, 2v and 7: the natural fault's collapse, and the guard against it
    injection.py   claims 3, 3+ and 4: an injected error's dose grid
    probe.py       claim 5: the causal probe and its controls
    actions.py     claim 6: the guard's other actions at its trigger
    lr_study.py    1p, 2p and 7p: claims 1, 2 and 7 as a learning-rate proxy

Their numbers are lab/thresholds.py's; lab/verdicts.py lists the rules in order and judges them all.
"""
