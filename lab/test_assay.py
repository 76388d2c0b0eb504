"""Tests of the assay: injected error sizes and sign statistics, where the error lands, the QK probe
and its equal-energy control, the matched fault, the flag checks. Fresh random inputs each run."""
import contextlib
import os
import subprocess
import sys

import pytest
import torch

import model
import run
import rundir
from attention_kernel import attention
from lab.assay import (ACTIVATION_SITES, Assay, ErrorInjector, Probe, attention_with_delta_error, clean_qk_grads,
                       fault_free, measure_fault)
from test_numerics import DEV, causal, need_triton, randn, rel, seed  # noqa: F401 (seed: a fixture)
from test_training import (ROOT, TINY, TRAIN, ZERO_MEANS, check_numeric_flags, check_resume_with_repeated_flags,
                           check_sigterm_then_resume, data_dir, read_log, root_without_lab, step_losses,
                           tiny_model)  # noqa: F401 (data_dir: a fixture)

TRAIN_ASSAY = [sys.executable, "-m", "lab.train_assay"]


def train(out_dir, data_dir, *args, timeout=300):
    """test_training.train through the lab's entry point: train.py with the assay (lab/train_assay.py)."""
    cmd = [*TRAIN_ASSAY, "--data-dir", data_dir, "--out-dir", str(out_dir), *TINY, *args]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, cwd=ROOT)


def parse_args(argv):
    return run.parse_args(argv, Assay())


def tiny_gpt(**kw):
    cfg = dict(n_layer=2, n_head=2, n_embd=32, block_size=16, vocab_size=128, attn_impl="torch")
    return model.GPT(model.GPTConfig(**{**cfg, **kw}))


def head_rms(t, n_head):
    """rms of each of n_head channel groups (last dim) or row groups (dim 0 of a 2-d weight)."""
    groups = t.reshape(-1, t.shape[-1]).T.tensor_split(n_head) if t.dim() == 3 else t.tensor_split(n_head)
    return torch.stack([g.float().pow(2).mean().sqrt() for g in groups])


# --------------------------------------------------------------------------------------------------
# Size of the error.

@pytest.mark.parametrize("site", ACTIVATION_SITES)
@pytest.mark.parametrize("scale", [0.05, 0.7])
def test_activation_error_has_requested_rms_ratio(site, scale):
    n_head, head_dim = 4, 8
    inj = ErrorInjector(site, scale, 1.0, n_layer=3, n_head=n_head, n_embd=n_head * head_dim, seed=7)
    inj.begin_step(0)
    # heads of very different sizes: the error must follow each head's own rms
    x = torch.randn(3, 10, n_head * head_dim) * torch.tensor([0.1, 1.0, 3.0, 10.0]).repeat_interleave(head_dim)
    x.requires_grad_(True)
    y = inj(x, site, 1)
    ratio = head_rms(y.detach() - x.detach(), n_head) / head_rms(x.detach(), n_head)
    torch.testing.assert_close(ratio, torch.full((n_head,), scale), rtol=0.02, atol=0)
    assert inj.last_stats["inject_rms_ratio"] == pytest.approx(scale, rel=0.02)
    # the error is one vector at every token, and detached: the gradient passes through unchanged
    err = (y - x).detach()
    torch.testing.assert_close(err, err[:1, :1].expand_as(err))
    y.sum().backward()
    torch.testing.assert_close(x.grad, torch.ones_like(x))


@pytest.mark.parametrize("site, arch, n_head, n_embd", [("grad-wv", "gpt2", 2, 32), ("grad-mlp", "gpt2", 2, 32),
                                                        ("grad-mlp", "llama", 3, 48)])   # 128 rows in 3 groups
def test_gradient_error_has_requested_rms_ratio(site, arch, n_head, n_embd):
    gpt = tiny_gpt(arch=arch, n_head=n_head, n_embd=n_embd)
    idx = torch.randint(0, 128, (2, 16))
    gpt(idx, idx)[1].backward()
    weight = lambda layer: (gpt.blocks[layer].attn.v_proj if site == "grad-wv" else gpt.blocks[layer].mlp.up_proj).weight
    clean = [weight(i).grad.clone() for i in range(2)]
    other = gpt.blocks[0].attn.q_proj.weight.grad.clone()
    inj = ErrorInjector(site, 0.3, 1.0, n_layer=2, n_head=n_head, n_embd=n_embd, layers=[1])
    inj.begin_step(0)
    inj.inject_grads(gpt)
    ratio = head_rms(weight(1).grad - clean[1], n_head) / head_rms(clean[1], n_head)
    torch.testing.assert_close(ratio, torch.full((n_head,), 0.3), rtol=0.02, atol=0)
    assert inj.last_stats["inject_rms_ratio"] == pytest.approx(0.3, rel=0.02)
    torch.testing.assert_close(weight(0).grad, clean[0], rtol=0, atol=0)      # layer 0 not selected
    torch.testing.assert_close(gpt.blocks[0].attn.q_proj.weight.grad, other, rtol=0, atol=0)


# --------------------------------------------------------------------------------------------------
# Sign statistics over steps.

def sign_history(coherence, steps=range(400), seed=0, state=None):
    inj = ErrorInjector("attn-out", 0.1, coherence, n_layer=2, n_head=2, n_embd=8, seed=seed)
    if state is not None:
        inj.load_state_dict(state)
    history = []
    for step in steps:
        inj.begin_step(step)
        history.append(inj.signs.clone())
    return torch.stack(history), inj   # (steps, n_layer, n_head)


@pytest.mark.parametrize("coherence", [1.0, 0.8, 0.3, 0.0])
def test_sign_persistence_matches_coherence(coherence):
    signs, _ = sign_history(coherence, seed=int(torch.randint(0, 10**6, ())))
    kept = (signs[1:] == signs[:-1]).float()
    n = kept.numel()
    if coherence in (0.0, 1.0):
        assert kept.mean().item() == coherence
    else:
        assert abs(kept.mean().item() - coherence) < 4 * (coherence * (1 - coherence) / n) ** 0.5


def test_incoherent_signs_average_out():
    signs, _ = sign_history(0.5, seed=int(torch.randint(0, 10**6, ())))
    assert signs.mean(dim=0).abs().max().item() < 4 / 400 ** 0.5
    coherent, _ = sign_history(1.0)
    assert (coherent.mean(dim=0).abs() == 1).all()


def test_signs_resume_exactly():
    first, inj = sign_history(0.7, steps=range(100), seed=3)
    state = inj.state_dict()
    straight_on = []
    for step in range(99, 150):        # the same injector carrying on
        inj.begin_step(step)
        straight_on.append(inj.signs.clone())
    straight_on = torch.stack(straight_on)
    resumed, _ = sign_history(0.7, steps=range(99, 150), seed=99, state=state)  # the state wins
    torch.testing.assert_close(resumed, straight_on, rtol=0, atol=0)
    torch.testing.assert_close(resumed[0], first[-1], rtol=0, atol=0)  # step 99 again: no change
    assert (resumed[1:] != resumed[:-1]).any()
    again, _ = sign_history(0.7, steps=range(100), seed=3)
    torch.testing.assert_close(again, first, rtol=0, atol=0)  # deterministic given the seed


# --------------------------------------------------------------------------------------------------
# Where the error lands in the model.

def block_outputs(gpt, idx):
    outs = []
    hooks = [b.register_forward_hook(lambda m, i, o: outs.append(o[0].detach().clone())) for b in gpt.blocks]
    with torch.no_grad():
        logits = gpt(idx)[0]
    for h in hooks:
        h.remove()
    return logits, outs


@pytest.mark.parametrize("site", ACTIVATION_SITES)
def test_injection_changes_only_selected_layers(site):
    gpt = tiny_gpt()
    idx = torch.randint(0, 128, (2, 16))
    logits, outs = block_outputs(gpt, idx)
    inj = ErrorInjector(site, 0.5, 1.0, n_layer=2, n_head=2, n_embd=32, layers=[1]).attach(gpt)
    inj.begin_step(0)
    logits_inj, outs_inj = block_outputs(gpt, idx)
    torch.testing.assert_close(outs_inj[0], outs[0], rtol=0, atol=0)          # layer 0 untouched
    assert (outs_inj[1] - outs[1]).abs().max() > 1e-3
    assert (logits_inj - logits).abs().max() > 1e-3
    with inj.paused():                                                        # fault-free passes
        torch.testing.assert_close(block_outputs(gpt, idx)[0], logits, rtol=0, atol=0)
    inj.detach()
    torch.testing.assert_close(block_outputs(gpt, idx)[0], logits, rtol=0, atol=0)
    ErrorInjector(site, 0.5, 1.0, n_layer=2, n_head=2, n_embd=32).attach(gpt)   # all layers
    assert (block_outputs(gpt, idx)[1][0] - outs[0]).abs().max() > 1e-3


def test_delta_site_changes_only_the_qk_gradients_of_its_layers():
    # The backward-side site: the forward is untouched, and in the selected layer only W_q and W_k
    # (through dq, dk) get another gradient; W_v, W_o, the MLP of that layer keep theirs. Layers
    # below see the change too (dq, dk flow into their output): that is the fault's own path.
    gpt = tiny_gpt()
    idx = torch.randint(0, 128, (2, 16))

    def grads():
        gpt.zero_grad(set_to_none=True)
        logits, loss, _ = gpt(idx, idx)
        loss.backward()
        return logits.detach(), {n: p.grad.clone() for n, p in gpt.named_parameters()}
    logits, clean = grads()
    inj = ErrorInjector("delta", 0.5, 1.0, n_layer=2, n_head=2, n_embd=32, layers=[1]).attach(gpt)
    inj.begin_step(0)
    assert set(inj.delta_errors) == {1} and inj.delta_errors[1].shape == (2, 16)
    logits_inj, faulty = grads()
    torch.testing.assert_close(logits_inj, logits, rtol=0, atol=0)
    moved = {n for n in clean if not torch.equal(clean[n], faulty[n])}
    assert {"blocks.1.attn.q_proj.weight", "blocks.1.attn.k_proj.weight"} <= moved
    assert not moved & {f"blocks.1.{w}.weight" for w in ("attn.v_proj", "attn.o_proj", "mlp.up_proj", "mlp.down_proj")}
    assert inj.last_stats["inject_rms_ratio"] == pytest.approx(0.5)
    with inj.paused():
        assert not inj.enabled
        assert all(torch.equal(clean[n], g) for n, g in grads()[1].items())
    assert inj.enabled and set(inj.delta_errors) == {1}
    # clean-grad for the delta site: W_q, W_k get exactly the error-free gradient
    qk = clean_qk_grads(gpt, idx, idx, contextlib.nullcontext, 1.0, inj)
    for name, g in zip(("blocks.0.attn.q_proj.weight", "blocks.0.attn.k_proj.weight",
                        "blocks.1.attn.q_proj.weight", "blocks.1.attn.k_proj.weight"), qk):
        torch.testing.assert_close(g, clean[name], rtol=1e-5, atol=1e-8)


def run_delta(q, k, v, do, error, **kw):
    """test_numerics.run: o and (dq, dk, dv), through the kernel's attention() (error None) or the assay's."""
    q, k, v = (x.detach().requires_grad_() for x in (q, k, v))
    o = attention(q, k, v, **kw) if error is None else attention_with_delta_error(q, k, v, error, **kw)
    return o.detach(), torch.autograd.grad(o, (q, k, v), do.to(o.dtype))


@pytest.mark.parametrize("impl", ["torch", "triton"])
def test_the_delta_wrapper_is_the_kernel_at_error_0_and_checks_the_errors_shape(impl):
    need_triton(impl)
    q, k, v, do = (randn(1, 2, 70, 16) for _ in range(4))
    for accum, rounding in (("bf16", None), ("fp32", ("logits", "pv", "backward"))):
        kw = dict(accum=accum, impl=impl, rounding=rounding, block_n=32)
        plain, zero = run_delta(q, k, v, do, None, **kw), run_delta(q, k, v, do, torch.zeros(2, 16, device=DEV), **kw)
        assert all(torch.equal(a, b) for a, b in zip((plain[0], *plain[1]), (zero[0], *zero[1]))), (accum, rounding)
    with pytest.raises(ValueError, match=r"delta error must be \(heads, head_dim\)"):
        attention_with_delta_error(q, k, v, torch.zeros(3, 16, device=DEV), impl=impl)
    with pytest.raises(ValueError, match="use impl='torch' or 'triton'"):
        attention_with_delta_error(q.float(), k.float(), v.float(), torch.zeros(2, 16, device=DEV), impl="sdpa")


@pytest.mark.parametrize("impl", ["torch", "triton"])
def test_delta_error_moves_only_dq_and_dk_by_the_expected_amount(impl, seed):
    # The assay's backward-side site, its own wrapper of the kernel's ops (moved here from test_numerics.py
    # with it): delta = rowsum(dO * (O + e)), e_h = error[h] * rms(O_h).
    # The forward and dv stay as they were; dS changes by -P * rowsum(dO * e), so dq and dk move by
    # exactly what a float64 materialized backward with that delta gives.
    need_triton(impl)
    q, k, v, do = (randn(1, 3, 90, 32, scale=1.5) for _ in range(4))
    err = torch.randn(3, 32, device=DEV) * 0.3
    kw = dict(accum="fp32", impl=impl, rounding=(), block_n=32)
    (o0, g0), (o1, g1) = run_delta(q, k, v, do, None, **kw), run_delta(q, k, v, do, err, **kw)
    assert torch.equal(o0, o1) and torch.equal(g0[2], g1[2]), f"seed {seed}: the forward or dv changed"
    # float64: the shift of dq, dk that a delta larger by rowsum(dO * e) makes
    qd, kd, vd, dod = (x.double() for x in (q, k, v, do))
    T = q.shape[2]
    s = (qd @ kd.mT / 32 ** 0.5).masked_fill(~causal(T), float("-inf"))
    p = torch.softmax(s, -1)
    rms = (p @ vd).pow(2).mean(dim=(0, 2, 3)).sqrt()
    shift = (dod * (err.double() * rms[:, None])[None, :, None, :]).sum(-1, keepdim=True)
    dds = -p * shift / 32 ** 0.5
    for name, got, want in (("dq", g1[0].double() - g0[0].double(), dds @ kd),
                            ("dk", g1[1].double() - g0[1].double(), dds.mT @ qd)):
        assert rel(got, want) < 0.05, f"seed {seed}: {name} moved by {got.norm():.3e}, expected {want.norm():.3e}"



# --------------------------------------------------------------------------------------------------
# The QK probe.

def probe_step(mode, gpt, updates, k=3):
    """Run one probe step around a fake optimizer step that adds `updates` to W_q and W_k. Returns
    the weights before, the log, and the top-k singular vectors of each weight before the step."""
    weights = [w for a in gpt.attentions for w in (a.q_proj.weight, a.k_proj.weight)]
    before = [w.detach().clone() for w in weights]
    svds = [torch.linalg.svd(w, full_matrices=False) for w in before]
    probe = Probe(mode, k=k, seed=int(torch.randint(0, 10**6, ())))
    probe.before_step(gpt)
    with torch.no_grad():
        for w, dW in zip(weights, updates):
            w += dW
    log = probe.after_step(gpt)
    applied = [w.detach() - b for w, b in zip(weights, before)]
    tops = [(U[:, :k], Vh[:k].T) for U, _, Vh in svds]
    return applied, log, tops


def topk_removed(dW, U, V):
    """What qk-topk removes from dW: dW - (I - UU^T) dW (I - VV^T)."""
    kept = dW - U @ (U.T @ dW)
    return dW - (kept - (kept @ V) @ V.T)


def random_updates(gpt, size=3e-3):
    return [size * torch.randn(32, 32) for _ in range(2 * len(gpt.attentions))]


def test_qk_topk_update_is_orthogonal_to_top_singular_directions():
    gpt = tiny_gpt()
    updates = random_updates(gpt)
    applied, log, tops = probe_step("qk-topk", gpt, updates)
    for dW, new, (U, V) in zip(updates, applied, tops):
        scale = dW.norm()
        assert (U.T @ new).norm() / scale < 1e-4 and (new @ V).norm() / scale < 1e-4
        torch.testing.assert_close(dW - new, topk_removed(dW, U, V), rtol=0, atol=1e-4 * scale.item())
    # the logged energy against our own SVD: the norm of the removed part
    for name, dWs, t in (("q", updates[0::2], tops[0::2]), ("k", updates[1::2], tops[1::2])):
        energy = [topk_removed(dW, U, V).norm().item() for dW, (U, V) in zip(dWs, t)]
        assert log[f"{name}_update"] == pytest.approx([dW.norm().item() for dW in dWs], rel=1e-4)
        assert log[f"{name}_removed"] == pytest.approx(energy, rel=1e-3)
        assert log[f"{name}_target"] == pytest.approx(energy, rel=1e-3)


@pytest.mark.parametrize("seed", [None, 730])
def test_equal_energy_removes_the_same_energy_elsewhere(seed):
    if seed is not None:   # 730: a complement projected off once leaked 2.5% of the removed norm into V
        torch.manual_seed(seed)
    gpt = tiny_gpt()
    updates = random_updates(gpt)
    applied, log, tops = probe_step("equal-energy", gpt, updates)
    for dW, new, (U, V) in zip(updates, applied, tops):
        removed = dW - new
        target = topk_removed(dW, U, V).norm()
        assert removed.norm().item() == pytest.approx(target.item(), rel=1e-4)
        # fp32 roundoff: at most 3e-7 of the removed norm over 1,500 seeds (projected off twice)
        assert (U.T @ removed).norm() / target < 1e-5 and (removed @ V).norm() / target < 1e-5
        assert (dW - new).norm() > 0.1 * dW.norm()   # it did remove something
    assert log["q_removed"] == pytest.approx(log["q_target"], rel=1e-4)
    assert log["k_removed"] == pytest.approx(log["k_target"], rel=1e-4)


def test_equal_energy_takes_all_it_can_when_the_update_is_in_the_top_directions():
    gpt = tiny_gpt()
    weights = [w for a in gpt.attentions for w in (a.q_proj.weight, a.k_proj.weight)]
    updates = []
    for w in weights:   # an update almost entirely along the top singular pair: the runaway's shape
        U, _, Vh = torch.linalg.svd(w.detach())
        updates.append(1e-2 * torch.outer(U[:, 0], Vh[0]) + 1e-5 * torch.randn(32, 32))
    applied, log, tops = probe_step("equal-energy", gpt, updates)
    for dW, new, (U, V) in zip(updates, applied, tops):
        outside = dW - topk_removed(dW, U, V)
        torch.testing.assert_close(new, dW - outside, rtol=0, atol=1e-7)  # all of the outside gone
    assert all(r < t for r, t in zip(log["q_removed"], log["q_target"]))  # logged as a shortfall
    shares = [r / t for name in "qk" for r, t in zip(log[f"{name}_removed"], log[f"{name}_target"])]
    assert log["removed_fraction_min"] == pytest.approx(min(shares)) and log["removed_fraction_min"] < 0.95, \
        "the smallest share reaches the log, where report.py refuses a control that fell short"


def test_the_smallest_removed_share_is_kept_over_a_log_interval_and_reset_after_it():
    gpt = tiny_gpt()
    weights = [w for a in gpt.attentions for w in (a.q_proj.weight, a.k_proj.weight)]
    probe = Probe("equal-energy", k=3, seed=0)

    def step(along_top):
        probe.before_step(gpt)
        with torch.no_grad():
            for w in weights:
                U, _, Vh = torch.linalg.svd(w.detach())
                w += 1e-2 * torch.outer(U[:, 0], Vh[0]) if along_top else 3e-3 * torch.randn(32, 32)
        return probe.after_step(gpt)["removed_fraction_min"]
    assert step(False) == pytest.approx(1.0, abs=1e-4), "a random update has energy enough outside the top-k"
    short = step(True)
    assert short < 0.95
    assert step(False) == short, "a later full step does not hide the interval's shortfall"
    probe.reset_interval()
    assert step(False) == pytest.approx(1.0, abs=1e-4)
    state = probe.state_dict()
    assert Probe("equal-energy", k=3).load_state_dict(state) is None and state["fraction_min"] <= 1.0


def test_qk_fixed_removes_the_same_random_subspace_every_step():
    # A control that cannot average out: (U, V) drawn once per weight, kept, unlike equal-energy's.
    gpt = tiny_gpt()
    probe = Probe("qk-fixed", k=3, seed=5)
    bases = []
    for _ in range(2):
        probe.before_step(gpt)
        bases.append([(U, V) for *_, U, V in probe.saved])
        with torch.no_grad():
            for a in gpt.attentions:
                a.q_proj.weight += 1e-2 * torch.randn(32, 32)
        probe.after_step(gpt)
    for (U1, V1), (U2, V2) in zip(*bases):
        torch.testing.assert_close(U1, U2, rtol=0, atol=0)
        torch.testing.assert_close(U1.T @ U1, torch.eye(3), rtol=0, atol=1e-5)
    W, (U, V) = gpt.attentions[0].q_proj.weight, bases[0][0]
    top = torch.linalg.svd(W.detach(), full_matrices=False)[0][:, :3]
    assert (top.T @ U).abs().max() < 0.9, "a random subspace, not the top singular directions"


def test_qk_shrink_leaves_qk_topks_norm_in_every_direction():
    # The step-size control: the applied update is dW itself, scaled to what qk-topk would leave,
    # so a runaway it stops too is stopped by step size, not by the top directions.
    gpt = tiny_gpt()
    updates = random_updates(gpt)
    applied, log, tops = probe_step("qk-shrink", gpt, updates)
    for dW, new, (U, V) in zip(updates, applied, tops):
        left = (dW - topk_removed(dW, U, V)).norm()
        torch.testing.assert_close(new, dW * left / dW.norm(), rtol=0, atol=1e-4 * dW.norm().item())
        assert (U.T @ new).norm() > 0.05 * new.norm(), "the top directions are not taken out"
    kept = [(dW - topk_removed(dW, U, V)).norm().item() for dW, (U, V) in zip(updates[0::2], tops[0::2])]
    assert log["q_kept"] == pytest.approx(kept, rel=1e-3)
    assert log["q_target"] == pytest.approx([topk_removed(dW, U, V).norm().item()
                                             for dW, (U, V) in zip(updates[0::2], tops[0::2])], rel=1e-3)


def test_qk_nextk_removes_singular_directions_k_plus_1_to_2k():
    gpt = tiny_gpt()
    updates = random_updates(gpt)
    weights = [w.detach().clone() for a in gpt.attentions for w in (a.q_proj.weight, a.k_proj.weight)]
    applied, log, _ = probe_step("qk-nextk", gpt, updates, k=3)
    for w, dW, new in zip(weights, updates, applied):
        U, _, Vh = torch.linalg.svd(w, full_matrices=False)
        nxt, top = (U[:, 3:6], Vh[3:6].T), (U[:, :3], Vh[:3].T)
        torch.testing.assert_close(dW - new, topk_removed(dW, *nxt), rtol=0, atol=1e-4 * dW.norm().item())
        assert (top[0].T @ new).norm() > 0.05 * new.norm(), "the top k are left alone"
    assert log["q_removed"] == pytest.approx([(u - a).norm().item() for u, a in zip(updates[0::2], applied[0::2])],
                                             rel=1e-3)


@pytest.mark.parametrize("mode, probed, untouched", [
    ("v-topk", "attn.v_proj", ("attn.q_proj", "attn.k_proj")),
    ("mlp-topk", "mlp.up_proj", ("attn.q_proj", "attn.k_proj", "attn.v_proj")),
])
def test_non_qk_controls_project_their_own_weight_only(mode, probed, untouched):
    gpt = tiny_gpt()
    params = dict(gpt.named_parameters())
    probe = Probe(mode, k=2, seed=1)
    before = {n: p.detach().clone() for n, p in params.items()}
    probe.before_step(gpt)
    updates = {n: 1e-2 * torch.randn_like(p) for n, p in params.items()}
    with torch.no_grad():
        for n, p in params.items():
            p += updates[n]
    log = probe.after_step(gpt)
    for layer in range(2):
        name = f"blocks.{layer}.{probed}.weight"
        U, _, Vh = torch.linalg.svd(before[name], full_matrices=False)
        applied = params[name].detach() - before[name]
        torch.testing.assert_close(updates[name] - applied, topk_removed(updates[name], U[:, :2], Vh[:2].T),
                                   rtol=0, atol=1e-5)
        for other in untouched:
            n = f"blocks.{layer}.{other}.weight"
            torch.testing.assert_close(params[n].detach() - before[n], updates[n], rtol=0, atol=1e-7)
    assert len(log[f"{'v' if mode == 'v-topk' else 'mlp_in'}_removed"]) == 2


def test_probe_off_changes_nothing():
    gpt = tiny_gpt()
    updates = random_updates(gpt)
    applied, log, _ = probe_step("off", gpt, updates)
    assert log == {}
    for dW, new in zip(updates, applied):
        torch.testing.assert_close(new, dW, rtol=0, atol=1e-7)


# --------------------------------------------------------------------------------------------------
# The matched fault.

def test_measure_fault_and_matched_injector():
    gpt = tiny_gpt()
    idx = torch.randint(0, 128, (4, 16))
    fault = measure_fault(gpt, idx, accum="bf16")
    for key in ("error_ratio", "bias_ratio"):
        assert fault[key].shape == (2, 2) and torch.isfinite(fault[key]).all() and (fault[key] > 0).all()
    assert measure_fault(gpt, idx, accum="fp32")["error_ratio"].abs().max() == 0
    # the same numbers here: each layer's q, k, v from its input, attention with bf16 vs fp32 state
    inputs = {}
    hooks = [a.register_forward_pre_hook(lambda m, args: inputs.__setitem__(m.layer_idx, args[0]))
             for a in gpt.attentions]
    with torch.no_grad():
        gpt(idx)
        for h in hooks:
            h.remove()
        for layer, a in enumerate(gpt.attentions):
            q, k, v = (p(inputs[layer]).view(4, 16, 2, 16).transpose(1, 2).to(torch.bfloat16)
                       for p in (a.q_proj, a.k_proj, a.v_proj))
            o32, o16 = (attention(q, k, v, accum=acc, impl="torch").float() for acc in ("fp32", "bf16"))
            err = o16 - o32                               # (B, H, T, head_dim)
            ref_rms = o32.pow(2).mean(dim=(0, 2, 3)).sqrt()
            bias = err.mean(dim=(0, 2))                   # signed mean over batch and tokens
            assert (bias > 0).any() and (bias < 0).any()  # so a sign error would show
            torch.testing.assert_close(fault["bias_dir"][layer], bias, rtol=1e-5, atol=1e-8)
            torch.testing.assert_close(fault["error_ratio"][layer], err.pow(2).mean(dim=(0, 2, 3)).sqrt() / ref_rms)
            torch.testing.assert_close(fault["bias_ratio"][layer], bias.pow(2).mean(dim=1).sqrt() / ref_rms)

    for site in ("attn-out", "residual"):
        inj = ErrorInjector.matched(gpt, idx, site=site, fault=fault).attach(gpt)
        inj.begin_step(0)
        seen = {}

        def keep(key, x):        # a hook that returns None leaves the activation as it is
            seen[key] = x.detach()
        handles = []
        for layer, block in enumerate(gpt.blocks):  # before and after the injector, at the site
            for when in (0, 1):
                if site == "attn-out":
                    handles.append(block.attn.o_proj.register_forward_pre_hook(
                        lambda m, args, key=(layer, when): keep(key, args[0]), prepend=when == 0))
                else:
                    handles.append(block.register_forward_hook(
                        lambda m, args, out, key=(layer, when): keep(key, out[0]), prepend=when == 0))
        with torch.no_grad():
            gpt(idx)
        inj.detach()
        for handle in handles:
            handle.remove()
        for layer in range(2):
            x, err = seen[layer, 0], seen[layer, 1] - seen[layer, 0]
            ratio = head_rms(err, 2) / head_rms(x, 2)
            torch.testing.assert_close(ratio, fault["bias_ratio"][layer], rtol=0.03, atol=0)
            # and it points along the measured bias, with its sign
            cos = torch.nn.functional.cosine_similarity(err[0, 0].view(2, -1), fault["bias_dir"][layer], dim=1)
            assert (cos > 0.999).all()


# --------------------------------------------------------------------------------------------------
# Flag checks (train.py's parser, lab/assay.py's flags in it: argparse's choices and types, then the refusals).

ASSAY_FLAGS = dict(site="--inject-site", scale="--inject-scale", coherence="--inject-coherence", probe="--probe",
                   probe_k="--probe-k", qk_fix="--qk-fix", accum="--accum")


def assay_argv(flags):
    return [arg for name, value in flags.items() if value is not None for arg in (ASSAY_FLAGS[name], str(value))]


@pytest.mark.parametrize("flags, names", [
    (dict(site="mlp"), "--inject-site"),
    (dict(site="attn-out", scale=0.0), "--inject-scale"),
    (dict(site="attn-out", scale=-1.0), "--inject-scale"),
    (dict(site="attn-out", scale=None), "--inject-scale"),
    (dict(site="attn-out", scale="big"), "--inject-scale"),
    (dict(scale=0.1), "--inject-scale"),
    (dict(coherence=0.9), "--inject-coherence"),
    (dict(site="residual", scale=0.1, coherence=1.5), "--inject-coherence"),
    (dict(site="residual", scale=0.1, coherence=-0.1), "--inject-coherence"),
    (dict(probe="topk"), "--probe"),
    (dict(probe="qk-topk", probe_k=0), "--probe-k"),
    (dict(qk_fix="qknorm"), "--qk-fix"),
    (dict(accum="fp16"), "--accum"),
    (dict(site="mlp-out", scale=0.1, qk_fix="clean-grad"), "--qk-fix qknorm"),
])
def test_assay_flags_reject_nonsense(flags, names, capsys):
    with pytest.raises(SystemExit):
        parse_args(assay_argv(flags))
    assert names in capsys.readouterr().err.strip().splitlines()[-1]


@pytest.mark.parametrize("flags", [
    dict(),
    dict(site="grad-wv", scale=0.1, coherence=0.5),
    dict(site="attn-out", scale="matched", qk_fix="qknorm"),
    dict(accum="bf16", qk_fix="qknorm", probe="equal-energy", probe_k=1),
    dict(site="delta", scale=0.1, coherence=1.0, qk_fix="clean-grad"),
    dict(accum="bf16", probe="qk-fixed"),
    dict(probe="qk-nextk"),
    dict(probe="qk-shrink"),
])
def test_assay_flags_accept_sense(flags):
    parse_args(assay_argv(flags))


def test_run_py_knows_the_assays_flags_and_their_defaults():
    # run.ASSAY_UNUSED: what train.py refuses by name, and reads a saved run's assay flags against
    defaults = run.build_parser(Assay()).flag_defaults
    assert run.ASSAY_UNUSED == {name: default for name, default in defaults.items()
                                if name not in run.build_parser().flag_defaults}
    assert Assay.command == run.ASSAY_COMMAND == "python -m lab.train_assay"


def test_the_assays_numeric_flags_refuse_nonsense_in_one_line():
    # test_training's check of train.py's numeric flags, on the assay's (moved here with them)
    assay_flags = run.build_parser(Assay())
    for action in list(assay_flags._actions):
        if action.dest in run.build_parser().flag_defaults:
            assay_flags._remove_action(action)
    assert check_numeric_flags(assay_flags, parse_args, ZERO_MEANS | {"--inject-coherence"}) == 4 * 3


# --------------------------------------------------------------------------------------------------
# The assay wired into train.py (run.Extension): end to end, through train.py's command line

def test_qk_fix_clean_grad_replaces_only_the_qk_gradients():
    torch.manual_seed(0)
    model = tiny_model(accum="bf16")
    injector = ErrorInjector("delta", 0.5, 1.0, 2, 2, 32, seed=0).attach(model)  # two faults
    injector.begin_step(0)
    idx = torch.randint(0, 128, (4, 16))
    x, y = idx[:, :-1], idx[:, 1:]
    model(x, y)[1].backward()                           # the unmodified, faulty step
    faulty = {name: p.grad.clone() for name, p in model.named_parameters()}
    clean = clean_qk_grads(model, x, y, contextlib.nullcontext, 1.0, injector)
    for name, p in model.named_parameters():           # nothing but the returned tensors changed
        assert torch.equal(p.grad, faulty[name]), name
    assert all(a.accum == "bf16" for a in model.attentions) and injector.enabled, "faults restored"
    model.zero_grad()
    with fault_free(model, injector):
        model(x, y)[1].backward()
    for w, g in zip(model.qk_weights(), clean):
        assert torch.allclose(g, w.grad, rtol=1e-5, atol=1e-8), "clean-grad must equal the fault-free gradient"
    names = {id(p): n for n, p in model.named_parameters()}
    assert all(not torch.allclose(faulty[names[id(w)]], w.grad) for w in model.qk_weights()), \
        "the fault should change the QK gradient, or the test shows nothing"


def top_part(dW, W, k):
    """dW's part in W's top-k singular directions, on either side (topk_removed)."""
    U, _, Vh = torch.linalg.svd(W)
    return topk_removed(dW, U[:, :k], Vh[:k].T)


@pytest.mark.parametrize("argv", [
    ["--inject-site", "attn-out", "--inject-scale", "0.1"],
    ["--inject-site", "mlp-out", "--inject-scale", "0.1", "--inject-coherence", "0.5", "--qk-fix", "qknorm"],
    ["--inject-site", "delta", "--inject-scale", "0.3", "--qk-fix", "clean-grad"],
    ["--inject-site", "grad-wv", "--inject-scale", "0.2", "--inject-layers", "1"],
    ["--inject-site", "residual", "--inject-scale", "matched", "--probe", "qk-topk"],
    ["--accum", "bf16", "--probe", "equal-energy", "--probe-k", "4"],  # k != 3 (default) or n_layer
    ["--accum", "bf16", "--probe", "qk-fixed"],
])
def test_assay_runs_log_what_they_did(tmp_path, data_dir, argv):
    out = tmp_path / "run"
    result = train(out, data_dir, "--max-steps", "3", "--ckpt-interval", "1", *argv)
    assert result.returncode == 0, result.stderr
    steps = [r for r in read_log(out) if "loss" in r and "event" not in r]
    assert len(steps) == 3
    if "--inject-site" in argv:
        assert all(r["inject_rms_ratio"] > 0 for r in steps)
        assert all(len(r["inject_signs"]) == (1 if "--inject-layers" in argv else 2) for r in steps)
    if "--probe" in argv:
        # the last update, ckpt.pt.prev (after step 2) to ckpt.pt, against an SVD done here
        k = int(argv[argv.index("--probe-k") + 1]) if "--probe-k" in argv else 3
        before, after = (torch.load(out / name, weights_only=False)["model"] for name in ("ckpt.pt.prev", "ckpt.pt"))
        probe = steps[-1]["probe"]
        for name in ("q", "k"):
            assert len(probe[f"{name}_target"]) == 2
            for layer, target in enumerate(probe[f"{name}_target"]):
                W = before[f"blocks.{layer}.attn.{name}_proj.weight"]
                dW = after[f"blocks.{layer}.attn.{name}_proj.weight"] - W
                if "qk-topk" in argv:   # nothing left in the top k; the (k+1)-th still moves
                    assert top_part(dW, W, k).norm() < 1e-3 * dW.norm()
                    assert top_part(dW, W, k + 1).norm() > 0.05 * dW.norm()
                elif "qk-fixed" in argv:   # its own subspace, not the top k: they keep moving
                    assert top_part(dW, W, k).norm() > 0.05 * dW.norm() and probe[f"{name}_removed"][layer] > 0
                else:                   # the control: the top k keep what qk-topk removes
                    assert top_part(dW, W, k).norm().item() == pytest.approx(target, rel=1e-3)
                    assert probe[f"{name}_removed"][layer] > 0


def test_clean_grad_and_inject_layers_move_exactly_the_weights_they_should(tmp_path, data_dir):
    # One step, same seed, no clipping (it would couple all gradients). clean-grad: W_q, W_k as in
    # the fault-free run, all else as in the faulty run (the delta site's error is backward-side, so
    # its clean gradient is the fault-free one). --inject-layers 1: only layer 1's W_v moves.
    def one_step(name, *argv):
        result = train(tmp_path / name, data_dir, "--max-steps", "1", "--grad-clip", "0", *argv)
        assert result.returncode == 0, result.stderr
        return torch.load(tmp_path / name / "ckpt.pt", weights_only=False)["model"]

    fault = ["--inject-site", "delta", "--inject-scale", "0.5"]
    clean, faulty = one_step("clean"), one_step("faulty", *fault)
    fixed = one_step("fixed", *fault, "--qk-fix", "clean-grad")
    qk = {name for name in clean if name.endswith(("q_proj.weight", "k_proj.weight"))}
    assert len(qk) == 4
    for name in clean:
        torch.testing.assert_close(fixed[name], (clean if name in qk else faulty)[name], rtol=0, atol=1e-7, msg=name)
    assert all(not torch.allclose(faulty[name], clean[name], rtol=0, atol=1e-6) for name in qk), \
        "the fault should change the QK update, or the test shows nothing"
    wv = one_step("wv", "--inject-site", "grad-wv", "--inject-scale", "0.5", "--inject-layers", "1")
    assert {name for name in clean if not torch.equal(wv[name], clean[name])} == {"blocks.1.attn.v_proj.weight"}


@pytest.mark.parametrize("argv, flag", [
    (["--inject-site", "attn-out"], "--inject-scale"),
    (["--inject-site", "mlp-out", "--inject-scale", "-1"], "--inject-scale"),
    (["--inject-site", "mlp-out", "--inject-scale", "0.1", "--inject-coherence", "1.5"], "--inject-coherence"),
    (["--inject-scale", "0.1"], "--inject-scale"),
    (["--qk-fix", "clean-grad"], "--qk-fix"),
    (["--inject-site", "mlp-out", "--inject-scale", "0.1", "--qk-fix", "clean-grad"], "--qk-fix qknorm"),
    (["--probe", "qk-topk", "--probe-k", "0"], "--probe-k"),
    (["--inject-site", "mlp-out", "--inject-scale", "0.1", "--inject-layers", "1,x"], "--inject-layers"),
    # from test_training's test_flags_that_would_silently_do_nothing_or_crash_later_are_refused, with their flags
    (["--inject-site", "mlp-out", "--inject-scale", "0.1", "--inject-layers", "5"], "layers 0..1"),
    (["--probe-k", "2"], "--probe-k has no effect"),
    (["--inject-site", "grad-wv", "--inject-scale", "0.1", "--qk-fix", "clean-grad"], "never touches the forward"),
    (["--inject-site", "delta", "--inject-scale", "0.1", "--attn-impl", "sdpa", "--attn-dtype", "native"],
     "not with --attn-impl sdpa"),
    (["--qk-fix", "qknorm", "--accum", "bf16", "--guard", "on", "--guard-signal", "sigma-product"],
     "--guard-action qknorm has nothing to switch when --qk-fix qknorm is set"),
    (["--qk-fix", "qknorm", "--accum", "bf16", "--guard", "on", "--guard-action", "clip"],
     "--guard-signal max-logit cannot cross --guard-threshold under QK-norm (--qk-fix qknorm)"),
])
def test_assay_flag_combinations_that_make_no_sense_are_refused(tmp_path, data_dir, argv, flag):
    result = train(tmp_path / "run", data_dir, *argv)
    assert result.returncode != 0 and flag in result.stderr, result.stderr
    assert not (tmp_path / "run").exists()


def test_sigterm_then_resume_matches_an_uninterrupted_run_with_an_injected_error_and_the_probe(tmp_path, data_dir):
    # test_training's test, through the lab's command: the injector's and the probe's state resume too
    check_sigterm_then_resume(tmp_path, data_dir, "--inject-site", "mlp-out", "--inject-scale", "0.1",
                              "--inject-coherence", "0.8", "--probe", "qk-topk", command=TRAIN_ASSAY)


def test_resume_with_the_assays_flags_repeated(tmp_path, data_dir):
    check_resume_with_repeated_flags(tmp_path / "run", data_dir, "--inject-site", "mlp-out", "--inject-scale", "0.05",
                                     command=TRAIN_ASSAY)


def test_an_assay_flag_typed_on_resuming_a_run_made_without_it_is_refused(tmp_path, data_dir):
    # a run train.py made saved no assay flag, so a typed one was neither refused nor recorded: --qk-fix qknorm
    # switched QK-norm on mid-run, --inject-site and --probe crashed in the restore (KeyError)
    out = tmp_path / "run"
    made = subprocess.run([*TRAIN, "--data-dir", data_dir, "--out-dir", str(out), *TINY, "--max-steps", "2",
                           "--accum", "bf16"], capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert made.returncode == 0, made.stderr
    before = (out / "ckpt.pt").read_bytes()
    for flags in (["--qk-fix", "qknorm"], ["--inject-site", "attn-out", "--inject-scale", "1"], ["--probe", "qk-topk"]):
        # train.configure's first steps, in this process (master=False: no lock for the resume below to meet)
        args, typed, parser = parse_args(["--data-dir", data_dir, "--out-dir", str(out), *TINY, "--accum", "bf16",
                                          "--max-steps", "4", "--resume", *flags])
        args = run.resolve(args, torch.device("cpu"), parser, Assay())
        with pytest.raises(SystemExit, match=f"^error: --resume keeps the saved flags, but these differ: "
                                             f"{flags[0]} {flags[1]} "):
            rundir.start_run(args, typed, parser.flag_defaults, master=False)
    assert (out / "ckpt.pt").read_bytes() == before
    assert train(out, data_dir, "--accum", "bf16", "--max-steps", "4", "--resume").returncode == 0
    assert not any("qk_fix" in r or "attn_gain_rms" in r for r in read_log(out)), "no assay, no gains logged"


def test_the_assay_logs_the_attention_gains_only_where_a_flag_set_it_on(tmp_path, data_dir):
    logs = {}
    for name, flags in (("none", []), ("probe", ["--probe", "qk-topk"])):
        assert train(tmp_path / name, data_dir, "--max-steps", "2", *flags).returncode == 0
        logs[name] = [r for r in read_log(tmp_path / name) if "event" not in r]
    assert not any("attn_gain_rms" in r for r in logs["none"]), "without a flag the assay is a no-op"
    gains = [r for r in logs["probe"] if "attn_gain_rms" in r]
    assert len(gains) == 2 and all(len(r["sigma_q_gain_head"]) == 2 and len(r["sigma_q_gain_head"][0]) == 2
                                   for r in gains)   # (layer, head)
    assert all(g == pytest.approx(1.0, abs=0.05) for r in gains for g in r["attn_gain_rms"]), "LayerNorm's 1s"


def test_a_run_that_used_the_assay_resumes_here_and_train_py_names_this_command(tmp_path, data_dir):
    # train.py, with or without lab/ beside it (`rm -r lab`), refuses in one line; the lab's command goes on
    reference = root_without_lab(tmp_path / "reference")
    for name, argv in (("plain", []), ("probed", ["--probe", "qk-topk"])):
        assert train(tmp_path / name, data_dir, "--max-steps", "1", *argv).returncode == 0
    resume = lambda name, command, steps="2": subprocess.run(
        [*command, "--data-dir", data_dir, "--out-dir", str(tmp_path / name), "--max-steps", steps, "--resume"],
        capture_output=True, text=True, timeout=300, cwd=ROOT)
    without_lab = [sys.executable, str(reference / "train.py")]
    assert resume("plain", without_lab).returncode == 0, "a run that used no assay flag goes on without lab/"
    for command in (without_lab, [sys.executable, os.path.join(ROOT, "train.py")]):
        lines = resume("probed", command).stderr.strip().splitlines()
        assert lines == [f"error: this run used the lab's assay (--probe qk-topk): resume it with `python -m "
                         f"lab.train_assay --resume --out-dir {tmp_path / 'probed'}`"], lines
    assert resume("probed", TRAIN_ASSAY).returncode == 0
    assert sorted(step_losses(read_log(tmp_path / "probed"))) == [0, 1]
    assert resume("plain", TRAIN_ASSAY, "3").returncode == 0, "and a run train.py made goes on here too"
    assert sorted(step_losses(read_log(tmp_path / "plain"))) == [0, 1, 2]


@pytest.mark.parametrize("probe", ["qk-topk", "qk-shrink", "qk-fixed", "equal-energy", "v-topk", "mlp-topk"])
def test_a_probe_k_as_large_as_the_matrix_is_refused(tmp_path, data_dir, probe):
    result = train(tmp_path / "run", data_dir, "--probe", probe, "--probe-k", "32", "--max-steps", "2")
    assert result.returncode != 0 and "--probe-k 32" in result.stderr and "Traceback" not in result.stderr
    assert train(tmp_path / "ok", data_dir, "--probe", probe, "--probe-k", "31", "--max-steps", "1").returncode == 0


def test_qk_nextk_needs_2k_directions(tmp_path, data_dir):
    # directions k+1..2k of the 32-wide test model: k = 17 asks for 18..34
    result = train(tmp_path / "run", data_dir, "--probe", "qk-nextk", "--probe-k", "17", "--max-steps", "2")
    assert result.returncode != 0 and "--probe-k of at most 16" in result.stderr.splitlines()[-1]
    assert train(tmp_path / "ok", data_dir, "--probe", "qk-nextk", "--probe-k", "16", "--max-steps", "1").returncode == 0
