"""QK-Guard for a PyTorch model that is not this project's: `from qkguard import attach`.

    guard = attach(model)      # dormant; call guard.step() after each optimizer update

The code is qkguard/hooks.py (adapters, signals, the hooks); qkguard/example.py runs it on a
nanoGPT-style GPT; qkguard/README.md is the documentation. Its guard.py holds the decisions (torch
alone), which the reference's root guard.py re-exports; it imports neither triton nor the training
code. callbacks.py (the Trainer callback), lightning.py (the Lightning callback) and serve.py (a fired model served) are imported where used: transformers and
Lightning stay optional.
"""
from qkguard.hooks import (ADAPTERS, ATTACH_ACTIONS, AttachedGuard, Layer, attach, attached, detach, find_layers,
                           hf_gpt2, hf_llama, nanogpt, qkguard_gpt)

__all__ = ["attach", "attached", "detach", "AttachedGuard", "Layer", "ADAPTERS", "ATTACH_ACTIONS", "find_layers",
           "qkguard_gpt", "nanogpt", "hf_gpt2", "hf_llama"]
