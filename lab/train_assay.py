"""
train.py with the lab's assay plugged in (lab/assay.py's Assay, a run.Extension): its flags --inject-*,
--qk-fix, --probe* and the hooks they switch on, beside every flag of train.py.

    python -m lab.train_assay --preset lab --device cpu --accum fp32 --inject-site delta --inject-scale 3
    python -m lab.train_assay --resume --out-dir runs/lab/assay/seed1     # a run made here resumes here

The root imports nothing from lab/: train.py refuses an assay flag, and the resume of a run that used one,
in one line naming this command.
"""
import train
from lab.assay import Assay

if __name__ == "__main__":
    train.command_line(Assay())
