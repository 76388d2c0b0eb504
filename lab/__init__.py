"""The lab: what reproduces and measures the paper's claims, beside the reference at the root.

    python -m lab.sweep ...     # the claims' runs (train.py or lab.train_assay subprocesses)
    python -m lab.train_assay   # train.py with the assay's flags (--inject-*, --qk-fix, --probe*)
    python -m lab.report ...    # their verdicts: RESULTS.md, each claim's record (lab/claims/), the plots
    python -m lab.bench ...     # speed and kernel tuning
    python -m lab.fault_size    # the bf16 state's own error, in the units of the assay's doses
    python -m lab.attach_demo   # QK-Guard attached to other models (qkguard/), unguarded and guarded

It imports the reference (model.py, attention_kernel.py, ...) from the repository root, where these
commands run. The reference imports nothing from the lab: the assay plugs into train.py's loop as an
extension (run.Extension) through its own command, `python -m lab.train_assay`; `rm -r lab` leaves the
reference whole.
"""
