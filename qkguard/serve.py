"""
Serving a model the guard fired on. Why it matters: under action="qknorm" the guard normalizes q and k
in its hooks, so after the trigger the model's function is its weights *and* that norm. Saved with
save_pretrained and loaded bare with from_pretrained, the weights come back without the norm: another
function, whose logits were never trained (test_callbacks.py shows the logits apart). Two ways to serve it, both tested in test_callbacks.py:

  to_qwen3(model, guard)   a Llama (LlamaForCausalLM) the guard fired on, as a Qwen3ForCausalLM with
        the same weights and q_norm = k_norm = 1: Qwen3's attention is Llama's with an RMS norm of q
        and k per head after the projections, before the rotation, which is where and how the guard
        normalizes them (hooks._rms_norm: fp32, eps 1e-6, cast back). Same logits and generate(), bit
        for bit; no qkguard, no triton, only transformers, to serve it (vLLM and others run Qwen3).
  save_guard(guard, folder) and load_guard(model, folder)   any model: the guard's state and settings
        beside save_pretrained's files, and after from_pretrained one call that attaches the guard
        again with them and loads the state, so the action is on from the first forward. Needs
        qkguard importable (pip install . from a clone: no triton, no training code).

Under action="qkclip" the action is in the weights (each clip rescales W_q and W_k): the model saved
and loaded bare is the function that was trained, and needs neither.
"""
import os

import torch

from qkguard.hooks import attach

GUARD_FILE = "qkguard.pt"        # save_guard's file in a save_pretrained folder
QK_NORM_EPS = 1e-6               # hooks._rms_norm's eps: Qwen3's q_norm and k_norm are bit for bit the guard's at it
# Llama's rms_norm_eps values (Llama 3's and 2's 1e-5, others' 1e-6). Qwen3 takes one eps for every norm, so
# at 1e-5 its q_norm, k_norm add 1e-5 where the guard adds 1e-6: close, not bit for bit (README: Serving)
LLAMA_EPS = (1e-6, 1e-5)


def _fired_qknorm(guard):
    """Whether the guard's QK-norm is on in every layer, or a one-line refusal that says what to do."""
    g = guard.qkguard
    if not g.triggered:
        raise ValueError("serve: the guard has not fired, so the model is its weights alone: save_pretrained serves "
                         "it as it is")
    if g.action != "qknorm":
        raise ValueError(f"serve: the guard's action is {g.action}, which is in the weights already: save_pretrained "
                         f"serves the model as it is")
    if len(g.layers) != len(guard.layers):
        raise ValueError(f"serve: QK-norm is on in layers {g.layers} of {len(guard.layers)} (scope='crossed'), and "
                         f"Qwen3 normalizes every layer: use save_guard() and load_guard() instead")


def to_qwen3(model, guard, strict=True):
    """A Qwen3ForCausalLM computing what `model`, a LlamaForCausalLM with `guard` fired (qknorm, every
    layer), computes: the same weights, q_norm and k_norm of weight 1. Then qwen3.save_pretrained(folder).
    Bit for bit where the Llama's rms_norm_eps is 1e-6; at Llama 3's 1e-5, Qwen3 uses that eps in q_norm
    and k_norm too, which changes each head's norm by a factor 1 + (1e-5 - 1e-6) / (2 mean(q^2)) at most:
    close, not bit for bit. strict: refuse another eps (strict=False exports it all the same)."""
    import transformers
    config = model.config
    if getattr(config, "model_type", None) != "llama":
        raise ValueError(f"serve: to_qwen3 takes a LlamaForCausalLM, not {type(model).__name__}: for other models "
                         f"use save_guard() beside save_pretrained and load_guard() after from_pretrained")
    if getattr(guard, "model", None) is not model or len(guard.layers) != config.num_hidden_layers:
        raise ValueError("serve: to_qwen3 takes the guard attached to this model, covering all of its "
                         f"{config.num_hidden_layers} layers: pass the model's own guard")
    _fired_qknorm(guard)
    if getattr(config, "mlp_bias", False):
        raise ValueError("serve: this Llama has mlp_bias=True, which Qwen3's MLP lacks: use save_guard() and "
                         "load_guard() instead")
    if strict and config.rms_norm_eps not in LLAMA_EPS:
        raise ValueError(f"serve: this Llama's rms_norm_eps is {config.rms_norm_eps}, not one of Llama's "
                         f"{LLAMA_EPS}, and Qwen3 would use it in q_norm and k_norm, where the guard uses {QK_NORM_EPS}: "
                         f"pass strict=False to export it all the same (logits close, not bit for bit), or use "
                         f"save_guard() and load_guard()")
    same = ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
            "num_key_value_heads", "head_dim", "hidden_act", "max_position_embeddings", "initializer_range",
            "rms_norm_eps", "use_cache", "tie_word_embeddings", "rope_parameters", "attention_bias",
            "attention_dropout", "pad_token_id", "bos_token_id", "eos_token_id")
    qwen3_config = transformers.Qwen3Config(**{key: getattr(config, key) for key in same}, use_sliding_window=False)
    weight = next(model.parameters())
    qwen3 = transformers.Qwen3ForCausalLM(qwen3_config).to(device=weight.device, dtype=weight.dtype)
    missing, unexpected = qwen3.load_state_dict(model.state_dict(), strict=False)
    if unexpected or any(not key.endswith(("q_norm.weight", "k_norm.weight")) for key in missing):
        raise ValueError(f"serve: the Llama's weights do not map onto Qwen3's (missing {missing[:3]}, unexpected "
                         f"{unexpected[:3]}): use save_guard() and load_guard() instead")
    with torch.no_grad():
        for layer in qwen3.model.layers:             # parameter-free, as the guard's norm is: weight 1
            layer.self_attn.q_norm.weight.fill_(1.0)
            layer.self_attn.k_norm.weight.fill_(1.0)
    qwen3.generation_config = model.generation_config
    return qwen3.train(model.training)


def _attach_settings(guard):
    g = guard.qkguard
    return {"signal": g.signal, "action": g.action, "threshold": float(g.threshold), "scope": g.scope,
            "enabled": g.enabled or guard.always, "tau": float(g.tau) if g.action == "qkclip" else None,
            "interval": guard.interval, "seqs": guard.seqs, "rows": guard.rows, "always": guard.always,
            "alpha": guard.alpha}


def guard_file(guard, **extra):
    """What qkguard.pt holds, wherever it is written (save_guard's folder, the Trainer callback's
    checkpoint-<step>): the settings attach() takes and the guard's state (and the callback's `extra`
    keys). One format, so load_guard reads either folder."""
    return {"attach": _attach_settings(guard), "state": guard.state_dict(), **extra}


def read_guard_file(path):
    """qkguard.pt as guard_file() wrote it, or a one-line refusal naming the file: a half-written or
    foreign file, or a bare guard.state_dict() (no attach settings)."""
    try:
        saved = torch.load(path, weights_only=True)
    except (OSError, RuntimeError, EOFError, ValueError) as error:       # a truncated zip, a foreign pickle
        raise ValueError(f"serve: {path} cannot be read as a guard file ({type(error).__name__}: "
                         f"{str(error).splitlines()[0][:120]}): it may be half-written; use the one from an earlier "
                         f"checkpoint, or save it again with save_guard(guard, folder)") from None
    if not (isinstance(saved, dict) and {"attach", "state"} <= saved.keys()):
        raise ValueError(f"serve: {path} is not a guard file (no 'attach' settings and 'state'): if it is a bare "
                         f"guard.state_dict(), attach(model, ...) with the run's settings and call "
                         f"guard.load_state_dict(torch.load(path)); else save it with save_guard(guard, folder)")
    return saved


def save_guard(guard, folder, **extra):
    """The guard's settings and state into `folder` (save_pretrained's), as qkguard.pt: written whole
    (a temporary file, then renamed), so an interrupted save leaves the previous file or none."""
    os.makedirs(folder, exist_ok=True)
    path = os.path.join(folder, GUARD_FILE)
    torch.save(guard_file(guard, **extra), path + ".tmp")
    os.replace(path + ".tmp", path)


def load_guard(model, folder, adapter="auto"):
    """After model = from_pretrained(folder): attach a guard with the saved settings and load its state,
    so the action the saved model was trained with is on from the next forward. Returns the guard.
    `folder` may also be a Trainer checkpoint-<step> folder that QKGuardCallback saved the guard in."""
    path = os.path.join(folder, GUARD_FILE)
    if not os.path.exists(path):
        raise FileNotFoundError(f"serve: {folder} has no {GUARD_FILE}: save it with save_guard(guard, folder) beside "
                                f"save_pretrained (a model the guard never fired on needs none)")
    saved = read_guard_file(path)
    settings = saved["attach"]     # an always-on guard's file of before 2026-12-05 says enabled=False: it acted
    guard = attach(model, adapter, **{**settings, "enabled": settings["enabled"] or settings.get("always", False)})
    try:
        guard.load_state_dict(saved["state"])
    except Exception:
        guard.detach()                               # all or nothing: no guard half-attached
        raise
    return guard
