"""qkguard as a drop-in: installed and imported without triton or the training code, bad input refused in
one line, QK-Clip's split between W_q and W_k, and torch.compile without graph breaks from the guard.
"""
import gc
import math
import os
import shutil
import subprocess
import sys

import pytest
import torch

import qkguard
from qkguard import hooks
from qkguard.example import NanoGPT
from qkguard.test_attach import ROOT, batch, build, inflate_qk, qk_rows, train_steps

ENV = {**os.environ, "OMP_NUM_THREADS": "1"}

# --------------------------------------------------------------------------------------------------
# Imports and installation

# A fresh interpreter where triton and the reference's training modules cannot be imported, as on a
# machine where triton does not install (macOS, Windows) with only qkguard.
BLOCKED = ("triton", "attention_kernel", "model", "train", "run", "sample", "prepare_data")
BLOCK = f"""
import sys
class Blocked:
    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] in {BLOCKED!r}:
            raise ImportError(f"blocked in this test: {{name}}")
sys.meta_path.insert(0, Blocked())
"""


def test_qkguard_imports_and_acts_without_triton_or_the_training_code():
    code = BLOCK + """
import torch, qkguard
from qkguard.example import NanoGPT
model = NanoGPT(vocab_size=64, block_size=16)
with torch.no_grad():
    model.transformer.h[0].attn.c_attn.weight.mul_(30.0)
guard = qkguard.attach(model, threshold=1.0)
x = torch.randint(0, 64, (2, 16))
for _ in range(2):
    model(x, x)[1].backward(); guard.step()
assert guard.triggered and not any(m in sys.modules for m in ("triton", "attention_kernel", "model"))
print("ok")
"""
    result = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=ENV, capture_output=True, text=True, timeout=120)
    assert result.returncode == 0 and result.stdout.strip() == "ok", result.stderr[-2000:]


def test_pip_install_of_the_clone_installs_only_qkguard_beside_a_users_own_guard_py(tmp_path):
    """pyproject.toml's distribution `qkguard`, built from a copy of its files (a build writes into its
    source folder) and installed into a folder of its own, offline: it installs the package qkguard and
    no other top-level name, so a script beside the user's own guard.py imports both (about 2 s)."""
    pytest.importorskip("setuptools")
    src = tmp_path / "src"
    shutil.copytree(os.path.join(ROOT, "qkguard"), src / "qkguard", ignore=shutil.ignore_patterns("__pycache__"))
    shutil.copy(os.path.join(ROOT, "pyproject.toml"), src)
    install = [sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--no-build-isolation", "--no-index",
               "--target", str(tmp_path / "site"), str(src)]
    result = subprocess.run(install, env=ENV, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-2000:]
    installed = sorted(p.name for p in (tmp_path / "site").iterdir() if not p.name.endswith((".dist-info", "__pycache__")))
    assert installed == ["qkguard"], installed
    user = tmp_path / "user"                     # the user's project: a guard.py of their own beside their script
    user.mkdir()
    (user / "guard.py").write_text("MINE = True\n")
    code = BLOCK + """
import guard, qkguard, qkguard.guard
assert guard.MINE and not hasattr(guard, "QKGuard")        # the user's own module, untouched
print(qkguard.__file__, qkguard.guard.QKGuard.__module__)
"""
    env = {**ENV, "PYTHONPATH": str(tmp_path / "site")}
    result = subprocess.run([sys.executable, "-c", code], cwd=user, env=env, capture_output=True, text=True,
                            timeout=120)
    assert result.returncode == 0, result.stderr[-2000:]
    assert result.stdout.split() == [str(tmp_path / "site" / "qkguard" / "__init__.py"), "qkguard.guard"]


def test_the_qk_norm_is_the_kernels_bit_for_bit():
    """hooks._rms_norm is written out, not imported from attention_kernel (which imports triton): the same values."""
    import attention_kernel
    gen = torch.Generator().manual_seed(0)
    for dtype in (torch.float32, torch.bfloat16, torch.float64):
        x = (torch.randn(3, 5, 4, 16, generator=gen) * 40).to(dtype)
        assert torch.equal(hooks._rms_norm(x), attention_kernel._rms_norm(x)), dtype


# --------------------------------------------------------------------------------------------------
# Bad input: refused at attach or load in one line, or made to work

@pytest.mark.parametrize("kwargs, message", [
    ({"threshold": math.nan}, "threshold must be a finite number > 0 in the signal's units, not nan"),
    ({"threshold": math.inf}, "threshold must be a finite number > 0 in the signal's units, not inf"),
    ({"threshold": "200"}, "threshold must be a finite number > 0 in the signal's units, not '200'"),
    ({"threshold": 0.0}, r"threshold must be a finite number > 0 .*not 0.0: .*always=True"),   # fires at once
    ({"threshold": -1}, r"threshold must be a finite number > 0 .*not -1: "),
    ({"always": True}, r"always=True is QK-Clip at every update .*not 'qknorm': pass action='qkclip'"),
    ({"action": "qkclip", "always": True, "alpha": 1.0}, r"alpha, W_q's share .* in \(0, 1\), not 1.0"),
    ({"action": "qkclip", "alpha": 0}, r"alpha, W_q's share .* in \(0, 1\), not 0"),
    ({"action": "qkclip", "tau": 0.0}, r"tau must be a finite number > 0 .*not 0.0"),
    ({"action": "qkclip", "tau": -5.0}, r"tau must be a finite number > 0 .*not -5.0"),
    ({"log_every": 0}, r"log_every \(0\) must be integers >= 1"),
])
def test_bad_settings_are_refused_at_attach_in_one_line(kwargs, message):
    model, _ = build("nanogpt")
    with pytest.raises(ValueError, match=message):
        qkguard.attach(model, **kwargs)
    assert not qkguard.attached(model)


def test_a_model_name_in_place_of_a_model_is_refused_in_one_line():
    with pytest.raises(TypeError, match=r"model must be a torch.nn.Module, not a str \('gpt2'\): load it first"):
        qkguard.attach("gpt2")


def fired_nanogpt(**kwargs):
    model, loss_of = build("nanogpt")
    inflate_qk(model)
    guard = qkguard.attach(model, "nanogpt", threshold=1.0, **kwargs)
    train_steps(model, loss_of, guard, 2)
    assert guard.triggered
    return guard


def test_a_watcher_refuses_a_fired_state_and_never_acts():
    state = fired_nanogpt().state_dict()
    model, _ = build("nanogpt")
    watcher = qkguard.attach(model, "nanogpt", enabled=False, threshold=1.0)
    x = batch()[0]
    before = model(x)[0]
    with pytest.raises(ValueError, match=r"this state fired \(at step 0\) and this guard is a watcher.*attach with "
                                         r"enabled=True to resume it"):
        watcher.load_state_dict(state)
    assert not watcher.triggered and torch.equal(model(x)[0], before)


def test_another_models_state_is_refused_and_nothing_changes():
    """The same layer count, another width: refused before the first change (the latch, the vectors)."""
    state = fired_nanogpt().state_dict()
    other = NanoGPT(n_embd=32, n_head=2)
    guard = qkguard.attach(other, "nanogpt", threshold=1.0)
    before = guard.state_dict()
    with pytest.raises(ValueError, match=r"this state is of a model with \(layers, heads, key heads, head_dim, width\) "
                                         r"\[2, 4, 4, 16, 64\], not \[2, 2, 2, 16, 32\]: load the guard state saved"):
        guard.load_state_dict(state)
    after = guard.state_dict()
    assert not guard.triggered and after["guard"] == before["guard"] and after["steps"] == before["steps"]
    assert all(torch.equal(after["sigma_v"][k], before["sigma_v"][k]) for k in before["sigma_v"])
    other(batch()[0][:, :16], batch()[1][:, :16])[1].backward()
    guard.step()
    assert guard.record()["guard"] == "dormant"


def test_a_guard_whose_name_was_lost_is_found_and_detached():
    """A notebook cell `guard = attach(model)` run twice: the first guard still hooks the model."""
    model, loss_of = build("nanogpt")
    guard = qkguard.attach(model, "nanogpt")
    del guard
    gc.collect()
    with pytest.raises(ValueError, match=r"already has a QK-Guard attached.*or qkguard.detach\(model\) if you no longer "
                                         r"hold it"):
        qkguard.attach(model, "nanogpt")
    (lost,) = qkguard.attached(model)
    assert qkguard.detach(model) == 1 and not lost.handles and not qkguard.attached(model)
    guard = qkguard.attach(model, "nanogpt")
    assert len(model.transformer.h[0].attn.c_attn._forward_hooks) == 1
    loss_of(model, *batch()).backward()
    guard.step()


# --------------------------------------------------------------------------------------------------
# QK-Clip: each head's factor split between W_q and W_k

TAU = 2.0
S = torch.tensor([8.0, 1.0, 4.0, 18.0])        # per head: factors tau / S = 1/4, 1 (under tau), 1/2, 1/9


@pytest.mark.parametrize("name, q_factor, k_factor", [
    # no GQA: sqrt(f) each, Kimi K2's split and train.py's QK-Clip
    ("nanogpt", [1 / 2, 1, 2 ** -0.5, 1 / 3], [1 / 2, 1, 2 ** -0.5, 1 / 3]),
    ("hf-gpt2", [1 / 2, 1, 2 ** -0.5, 1 / 3], [1 / 2, 1, 2 ** -0.5, 1 / 3]),   # W stored (in, out)
    # GQA, heads (0, 1) read key head 0 and (2, 3) key head 1: W_k takes sqrt of the group's least f
    # (1/4: 1/2; 1/9: 1/3), W_q the rest, so head 1 (f = 1) keeps its logits
    ("hf-llama", [1 / 2, 2, 3 / 2, 1 / 3], [1 / 2, 1 / 3]),
])
def test_qkclip_scales_w_q_and_w_k_each_by_the_square_root_of_the_heads_factor(name, q_factor, k_factor):
    model, _ = build(name)
    with torch.no_grad():       # biases away from 0 (Hugging Face starts them at 0), so their scaling shows
        for n, p in model.named_parameters():
            if n.endswith(("c_attn.bias", "q_proj.bias", "k_proj.bias")):
                p.normal_(0.0, 0.1, generator=torch.Generator().manual_seed(2))
    guard = qkguard.attach(model, action="qkclip", tau=TAU)
    guard.qkguard.layers = [0, 1]                   # as the trigger leaves them (scope "all")
    before = [qk_rows(layer) for layer in guard.layers]
    guard._clip(torch.stack([S, S * 0.5]))          # layer 1: factors 1/2, 1, 1, 2/9
    expected = {"q": torch.tensor(q_factor), "k": torch.tensor(k_factor)}
    for role, tensors in qk_rows(guard.layers[0]).items():
        for after, prior in zip(tensors, before[0][role]):      # the weight's rows, then the bias's
            torch.testing.assert_close(after, prior * expected[role].view(-1, *[1] * (after.dim() - 1)),
                                       msg=f"{name} W_{role}")


TAU_ON = 9.0        # between the heads' max logits of the models below (W_q, W_k times 10: 7 to 11)


@pytest.mark.parametrize("name, alpha", [("nanogpt", 0.5), ("nanogpt", 0.25), ("hf-gpt2", 0.75)])
def test_always_on_qkclip_clips_every_update_from_the_first_with_megatrons_alpha_split(name, alpha):
    """always=True, Megatron-LM's --qk-clip: no trigger, no event; after the first update (no optimizer
    step, so only the clip moves the weights) each head over tau has W_q's rows times f^alpha and W_k's
    times f^(1 - alpha), f = tau / S (its max over the batch); a head under tau is untouched."""
    model, loss_of = build(name)
    inflate_qk(model, 10.0)
    default = qkguard.attach(model, action="qkclip", always=True)
    assert default.qkguard.tau == 100.0 and default.alpha == 0.5 and default.record()["guard"] == "on"   # Megatron's
    default.detach()
    guard = qkguard.attach(model, action="qkclip", always=True, alpha=alpha, tau=TAU_ON)
    before = [qk_rows(layer) for layer in guard.layers]
    loss_of(model, *batch()).backward()
    assert guard.step() is None and guard.events == [] and not guard.triggered
    S = guard.max_logit                                                           # every row: (layer, head)
    assert (S > TAU_ON).any() and (S < TAU_ON).any(), "the check needs heads on each side of tau"
    f = torch.where(S > TAU_ON, TAU_ON / S, torch.ones_like(S))
    for i, layer in enumerate(guard.layers):
        for role, share in (("q", alpha), ("k", 1 - alpha)):
            for after, prior in zip(qk_rows(layer)[role], before[i][role]):
                factor = f[i] ** share
                torch.testing.assert_close(after, prior * factor.view(-1, *[1] * (after.dim() - 1)))
    loss_of(model, *batch()).backward()
    guard.step()
    # layer 0, whose input the clip leaves as it was (layer 1's moved with layer 0's output): at most tau
    torch.testing.assert_close(guard.max_logit[0].clamp_max(TAU_ON), guard.max_logit[0], rtol=1e-5, atol=1e-5)


# --------------------------------------------------------------------------------------------------
# torch.compile

def test_the_guard_adds_no_graph_break_under_torch_compile():
    """torch._dynamo.explain of a compiled step: as many graphs with the guard, dormant or fired, as without
    (timing=True's clock reads in the hooks would add breaks; the sample's draw is tensor arithmetic)."""
    import torch._dynamo as dynamo
    counts = {}
    for case in ("bare", "dormant", "fired"):
        model, loss_of = build("nanogpt")
        if case == "fired":
            inflate_qk(model)
        guard = None if case == "bare" else qkguard.attach(model, "nanogpt", threshold=1.0 if case == "fired" else None)
        if case == "fired":
            train_steps(model, loss_of, guard, 2)
            assert guard.triggered
        x, y = batch()
        dynamo.reset()
        counts[case] = dynamo.explain(lambda x: loss_of(model, x, y))(x).graph_count
    assert counts == {"bare": 1, "dormant": 1, "fired": 1}


def test_a_compiled_model_compiles_at_most_three_graphs_over_dormant_steps_and_a_fire():
    """torch.compile of the model, trained 12 dormant steps, then its W_q and W_k inflated so the guard
    fires, then 4 steps fired: the guard's per-step sample seed is a tensor the graph reads, not a
    constant it is specialised on, so a dormant step compiles nothing new (before, each step recompiled
    until dynamo's limit of 8, and the model then ran eager without a word). The fire switches QK-norm
    on in the hooks: one more graph."""
    import torch._dynamo as dynamo
    graphs = []

    def backend(gm, example_inputs):              # counts each graph dynamo compiles, runs it as it is
        graphs.append(gm)
        return gm.forward
    dynamo.reset()
    model, _ = build("nanogpt")
    guard = qkguard.attach(model, "nanogpt", threshold=100.0)
    compiled = torch.compile(model, backend=backend)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    for step in range(16):
        if step == 12:
            inflate_qk(model)                     # the logits pass 100: the check at step 12 acts at step 13
        compiled(*batch(seed=step))[1].backward()
        optimizer.step()
        optimizer.zero_grad()
        guard.step()
        if step == 11:
            dormant = len(graphs)
    assert dormant == 1 and guard.triggered and guard.events[0]["active_from"] == 14
    assert len(graphs) <= 3, f"{len(graphs)} graphs compiled"
    dynamo.reset()
