"""QK-Guard for a PyTorch model that is not this project's: `from qkguard import attach`.

    guard = attach(model)      # dormant; call guard.step() after each optimizer update

The code is qkguard/hooks.py (adapters, signals, the hooks); qkguard/example.py runs it on a
nanoGPT-style GPT; qkguard/README.md is the documentation. It uses the reference's guard.py (the
decisions) and attention_kernel.py (the QK-norm), imported from the repository root, where it runs.
"""
from qkguard.hooks import (ADAPTERS, ATTACH_ACTIONS, AttachedGuard, Layer, attach, find_layers, hf_gpt2, hf_llama,
                           nanogpt, qkguard_gpt)

__all__ = ["attach", "AttachedGuard", "Layer", "ADAPTERS", "ATTACH_ACTIONS", "find_layers",
           "qkguard_gpt", "nanogpt", "hf_gpt2", "hf_llama"]
