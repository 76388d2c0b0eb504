# Triton reads TRITON_INTERPRET when a kernel is defined, i.e. when attention_kernel is first imported, so set
# it here, before any test module imports it: without a GPU the Triton kernels then run in the interpreter.
import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
