# Triton reads TRITON_INTERPRET when a kernel is defined, i.e. when attention_kernel is first imported, so set
# it here, before any test module imports it: without a GPU the Triton kernels then run in the interpreter.
import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

# A shell starts a background job (`pytest ... &`, nohup) with SIGINT ignored, and its children inherit that:
# the tests that stop a train.py or a data build with Ctrl-C would then see it run on. Python's own handler,
# as in a foreground terminal, so that those tests test the code and not how the suite was launched.
import signal

if signal.getsignal(signal.SIGINT) is signal.SIG_IGN:
    signal.signal(signal.SIGINT, signal.default_int_handler)
