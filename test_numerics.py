"""Numerics of attention_kernel: accuracy against float64, Triton against its twin, the bf16 fault.

    TRITON_INTERPRET=1 python -m pytest -q test_numerics.py    # -s prints the measured tables

Inputs are fresh random each run; every failure message carries the seed. Outputs start as NaN.
"""
import math
import os

import pytest
import torch

import attention_kernel as ak
from attention_kernel import ACCUM_MODES, ROUNDING_SOURCES, attention

DEV = "cuda" if torch.cuda.is_available() else "cpu"
BF16, FP32 = torch.bfloat16, torch.float32
# False only if attention_kernel was imported on a CPU without TRITON_INTERPRET=1 (conftest.py sets it).
TRITON_OK = DEV == "cuda" or ak.INTERPRET


def need_triton(impl):
    if impl == "triton" and not TRITON_OK:
        pytest.skip("attention_kernel was imported without TRITON_INTERPRET=1; run with TRITON_INTERPRET=1")


@pytest.fixture(autouse=True)
def poison(monkeypatch):
    """Every buffer the kernels write starts as NaN, so an element they leave unwritten shows."""
    for name in ("new_buffer", "new_like"):
        allocate = getattr(ak, name)
        monkeypatch.setattr(ak, name, lambda *a, allocate=allocate, **kw: allocate(*a, **kw).fill_(math.nan))


@pytest.fixture
def seed():
    s = int.from_bytes(os.urandom(4), "little")
    torch.manual_seed(s)
    return s


def rel(a, b):
    """Norm of the difference over the norm of b (the absolute norm where b is exactly zero)."""
    d, n = (a.double() - b.double()).norm(), b.double().norm()
    return (d / n).item() if n > 0 else d.item()


def bias_ratio(o, ref):
    """Mean signed error over rms error: ~0 for unbiased rounding, +-1 for a constant offset."""
    e = o.double() - ref.double()
    return (e.mean() / e.pow(2).mean().sqrt()).item()


def randn(*shape, dtype=BF16, scale=1.0):
    return (scale * torch.randn(*shape, device=DEV)).to(dtype)


def causal(T):
    """(T, T) bool: query i sees key j <= i."""
    return torch.ones(T, T, dtype=torch.bool, device=DEV).tril()


def attention_float64(q, k, v, softcap=0.0, qk_norm=False, return_max_logit=False):
    """The reference: float64 materialized causal softmax, with autograd. Returns o float64, or
    (o, max_logit) with max_logit (batch, heads) float32, as attention() does."""
    if qk_norm:
        q, k = ak._rms_norm(q), ak._rms_norm(k)
    T, scale = q.shape[2], 1.0 / math.sqrt(q.shape[-1])
    s = q.double() @ k.double().mT * scale
    if softcap > 0:
        s = softcap * torch.tanh(s / softcap)
    s = s.masked_fill(~causal(T), float("-inf"))
    o = torch.softmax(s, dim=-1) @ v.double()
    return (o, s.detach().amax(dim=(-2, -1)).float()) if return_max_logit else o


def run(q, k, v, do, **kw):
    """Output and (dq, dk, dv) of attention(**kw) for upstream gradient do; impl="reference" runs
    attention_float64 on float64 copies (autograd returns a leaf's gradient in the leaf's dtype)."""
    reference = kw.get("impl") == "reference"
    if reference:
        del kw["impl"]
        q, k, v, do = (x.double() for x in (q, k, v, do))
    q, k, v = (x.detach().requires_grad_() for x in (q, k, v))
    o = attention_float64(q, k, v, **kw) if reference else attention(q, k, v, **kw)
    return o.detach(), torch.autograd.grad(o, (q, k, v), do.to(o.dtype))


def flat(out):
    """run()'s (o, (dq, dk, dv)) as (o, dq, dk, dv)."""
    o, g = out
    return (o, *g)


def errors(out, ref):
    return [rel(a, b) for a, b in zip(flat(out), flat(ref))]


def all_finite(out):
    return all(torch.isfinite(x).all() for x in flat(out))


def bitwise_equal(out, other):
    return all(torch.equal(a, b) for a, b in zip(flat(out), flat(other)))


# --------------------------------------------------------------------------------------------------
# fp32 state (the repair) against float64: output and all gradients, ragged T, several head sizes.

@pytest.mark.parametrize("impl", ["torch", "triton"])
@pytest.mark.parametrize("dtype,rounding", [(BF16, ()), (BF16, None), (torch.float16, ()), (FP32, ())])
@pytest.mark.parametrize("T,D,block_n", [(1, 32, 16), (37, 64, 32), (130, 128, 64), (200, 64, None)])
def test_fp32_state_matches_float64(impl, dtype, T, D, block_n, rounding, seed):
    # rounding=(): a standard flash kernel; None: with bf16 inputs, logits and P V rounded too.
    need_triton(impl)
    q, k, v, do = (randn(2, 2, T, D, dtype=dtype) for _ in range(4))
    out, ref = run(q, k, v, do, impl=impl, block_n=block_n, rounding=rounding), run(q, k, v, do, impl="reference")
    assert all(x.dtype == torch.float64 for x in flat(ref)), "the reference must not round to the inputs"
    errs = errors(out, ref)
    # 3x to 5x the largest error over 3 seeds (bf16 3.0e-3, 4.0e-3 with logits and P V rounded; fp16
    # 3.6e-4, fp32 2.1e-6). Too loose to tell the bf16 state (4e-3 to 5e-3) from fp32 state:
    # test_bf16_state_error_* does that.
    tol = {BF16: 1e-2, torch.float16: 2e-3, FP32: 1e-5}[dtype]
    assert all_finite(out), f"seed {seed}: unwritten (NaN) or non-finite output"
    assert all(x.dtype == dtype for x in flat(out))
    assert max(errs) < tol, f"seed {seed}: rel errors o, dq, dk, dv = {errs}"


@pytest.mark.parametrize("impl", ["torch", "triton"])
@pytest.mark.parametrize("dtype", [BF16, FP32])
@pytest.mark.parametrize("qk_norm,softcap", [(True, 0.0), (False, 5.0), (True, 5.0)])
def test_qk_norm_and_softcap_match_float64(impl, dtype, qk_norm, softcap, seed):
    need_triton(impl)
    # q is scaled up so that logits pass the cap without qk_norm (with it they reach scale*D = 8).
    q, k, v, do = randn(2, 2, 70, 64, dtype=dtype, scale=3.0), *(randn(2, 2, 70, 64, dtype=dtype) for _ in range(3))
    kw = dict(qk_norm=qk_norm, softcap=softcap)
    out = run(q, k, v, do, impl=impl, block_n=32, **kw)
    errs = errors(out, run(q, k, v, do, impl="reference", **kw))
    tol = 1e-2 if dtype == BF16 else 1e-4
    assert all_finite(out) and max(errs) < tol, f"seed {seed}: rel errors o, dq, dk, dv = {errs}"


# --------------------------------------------------------------------------------------------------
# The Triton kernels and the PyTorch twin implement the same rounding points. They differ only in
# fp32 summation order (~1e-7 relative), which rarely flips a bf16 rounding by one ulp (measured: at
# most 16 of 65536 output elements at T=1024). So their difference must stay under half the mode's
# own error against float64 (+1e-6 for fp32 roundoff). A tenth was too tight: over 120 bf16 runs the
# ratio reached 0.19 (a few flipped roundings of p or ds in one gradient), failing about one suite
# run in ten. A real change shows far above: 1.0 for fp32 state where bf16 was asked, 0.74 on dq, dk
# for key block 32 instead of 64. Almost every bf16 output element must also agree bit for bit.

@pytest.mark.parametrize("accum,rounding", [(a, None) for a in ACCUM_MODES] + [
    ("fp32", ()), ("fp32", ("backward",)), ("bf16", ROUNDING_SOURCES)])
@pytest.mark.parametrize("dtype,softcap", [(BF16, 0.0), (FP32, 0.0), (BF16, 5.0)])
def test_triton_matches_torch_twin(accum, rounding, dtype, softcap, seed):
    need_triton("triton")
    if "backward" in (rounding or ()) and dtype != BF16:
        pytest.skip("the bf16 backward takes bf16 inputs")
    q, k, v, do = (randn(1, 2, 200, 64, dtype=dtype, scale=2.0) for _ in range(4))
    kw = dict(accum=accum, softcap=softcap, block_n=64, rounding=rounding)
    tri, twin = run(q, k, v, do, impl="triton", **kw), run(q, k, v, do, impl="torch", **kw)
    mode_err = errors(twin, run(q, k, v, do, impl="reference", softcap=softcap))
    diff = errors(tri, twin)
    for name, d, e in zip(("o", "dq", "dk", "dv"), diff, mode_err):
        assert d <= 0.5 * e + 1e-6, f"seed {seed}: {name}: triton vs torch {d:.2e}, mode error {e:.2e}"
    if dtype == BF16:
        flipped = (tri[0] != twin[0]).float().mean().item()
        assert flipped < 0.01, f"seed {seed}: {flipped:.2%} of output elements differ"


# --------------------------------------------------------------------------------------------------
# Equalities the code guarantees bit for bit: one backward serves the fp32 and the bf16 rounding, one
# launcher every kernel, and the call's options reach the same arithmetic by any spelling.

def fp32_backward(do, q, k, v, o, lse, scale, softcap, round_logits):
    """The fp32 backward over all (query, key) pairs at once, op for op as the twin's with one key
    block: recompute S and P = exp(S - lse), dV = P^T dO, dS = P (dO V^T - delta) [* (1 - tanh^2)],
    dQ = dS K scale, dK = dS^T Q scale; P and dS enter the matmuls in the input dtype."""
    dtype, T = q.dtype, q.shape[2]
    qf, kf, vf, dof = (x.float() for x in (q, k, v, do))
    r = (lambda x: x.to(BF16).float()) if round_logits else (lambda x: x)
    s, t = r(r(qf @ kf.mT) * scale), None
    if softcap > 0:
        t = 1.0 - 2.0 / (torch.exp(2.0 * (s / softcap)) + 1.0)
        s = r(softcap * t)
    p = torch.where(causal(T), torch.exp(s - lse[..., None]), 0.0)
    ds = p * (dof @ vf.mT - (dof * o.float()).sum(-1)[..., None])
    if softcap > 0:
        ds = ds * (1.0 - t * t)
    ds = ds.to(dtype).float()
    dv = (p.to(dtype).float().mT @ dof).to(dtype)
    return (ds @ kf * scale).to(dtype), (ds.mT @ qf * scale).to(dtype), dv


@pytest.mark.parametrize("accum", ["fp32", "bf16"])
@pytest.mark.parametrize("dtype,rounding", [(BF16, ""), (BF16, "logits,pv"), (FP32, "")])
@pytest.mark.parametrize("softcap", [0.0, 3.0])
def test_twin_backward_without_its_rounding_is_the_fp32_backward(accum, dtype, rounding, softcap, seed):
    # The twin has one backward for both: with "backward" off its rounding points are identities, its
    # tiles one key block by all the rows that see it, its sums fp32. With one key block it must be the
    # materialized fp32 backward exactly (for the bf16 state's o and lse too: delta reads the stored o).
    q, k, v, do = (randn(1, 2, 90, 32, dtype=dtype, scale=2.0) for _ in range(4))
    scale = 32 ** -0.5
    o, lse, _ = torch.ops.qkguard.attn_fwd(q, k, v, scale, softcap, accum, rounding, 2.0, "torch", 128)
    got = torch.ops.qkguard.attn_bwd(do, q, k, v, o, lse, scale, softcap, rounding, "torch", 128)
    want = fp32_backward(do, q, k, v, o, lse, scale, softcap, "logits" in rounding)
    for name, a, b in zip(("dq", "dk", "dv"), got, want):
        assert torch.equal(a, b), f"seed {seed}: {name} differs in {(a != b).sum().item()} elements"


@pytest.mark.parametrize("impl", ["torch", "triton"])
def test_bf16_backward_tiles_do_not_follow_block_n(impl, seed):
    # The bf16 backward rounds its sums once per BF16_BWD_BLOCK tile, whatever the forward's key block:
    # from one forward's o and lse, every block_n gives the same gradients bit for bit.
    need_triton(impl)
    q, k, v, do = (randn(1, 2, 150, 32, scale=2.0) for _ in range(4))
    scale, sources = 32 ** -0.5, "logits,pv,backward"
    o, lse, _ = torch.ops.qkguard.attn_fwd(q, k, v, scale, 0.0, "bf16", sources, 2.0, impl, 64)
    grads = [torch.ops.qkguard.attn_bwd(do, q, k, v, o, lse, scale, 0.0, sources, impl, n)
             for n in (None, 32, 128)]
    assert all_finite((o, grads[0]))
    assert all(torch.equal(a, b) for other in grads[1:] for a, b in zip(grads[0], other)), f"seed {seed}"


@pytest.mark.parametrize("impl", ["torch", "triton"])
@pytest.mark.parametrize("accum", ACCUM_MODES)
def test_equivalent_calls_agree_bit_for_bit(impl, accum, seed):
    # Each pair spells one computation two ways: the default rounding and its sources named (in any
    # order), for bf16 and for fp32 inputs; auto and the twin on a CPU; qk_norm and the normed q, k
    # handed in (output and max logit), with and without the max logit.
    need_triton(impl)
    q, k, v, do = (randn(1, 2, 70, 32, scale=2.0) for _ in range(4))
    kw = dict(accum=accum, impl=impl, block_n=32)
    f32 = [x.float() for x in (q, k, v, do)]
    same = [(run(q, k, v, do, **kw), run(q, k, v, do, rounding=("pv", "logits"), **kw)),
            (run(*f32, **kw), run(*f32, rounding=(), **kw))]
    if impl == "torch" and DEV == "cpu":
        same.append((run(q, k, v, do, **kw), run(q, k, v, do, **{**kw, "impl": "auto"})))
    for i, (a, b) in enumerate(same):
        assert bitwise_equal(a, b), f"seed {seed}: pair {i}"
    o, ml = attention(q, k, v, return_max_logit=True, qk_norm=True, **kw)
    o2, ml2 = attention(ak._rms_norm(q), ak._rms_norm(k), v, return_max_logit=True, **kw)
    assert torch.equal(o, attention(q, k, v, qk_norm=True, **kw)) and torch.equal(o, o2) and torch.equal(ml, ml2), \
        f"seed {seed}: qk_norm, or the max logit, moved o"


# --------------------------------------------------------------------------------------------------
# The fault is emulated for real.

def test_bf16_state_error_is_larger_at_T1024(seed):
    # The state alone, everything else equal (`-s -k T1024` prints the ratios; the measured errors
    # behind the bounds: lab/MEASUREMENTS.md, "the tests' measured bases"). Default rounding: bf16 logits
    # alone nearly double a standard kernel's error, so the state's share is smaller.
    q, k, v, do = (randn(1, 4, 1024, 64) for _ in range(4))
    ref = run(q, k, v, do, impl="reference")
    ratios = {}
    for rounding in ((), None):
        e32, e16 = (errors(run(q, k, v, do, accum=a, impl="torch", rounding=rounding), ref) for a in ("fp32", "bf16"))
        ratios[rounding] = [b / a for a, b in zip(e32, e16)]
        print(f"\nT=1024 rounding {rounding}: bf16/fp32 state error ratio (o, dq, dk, dv): "
              f"{[round(r, 2) for r in ratios[rounding]]}  seed {seed}")
    assert ratios[()][0] > 1.7 and min(ratios[()][1:]) > 1.25, f"seed {seed}: {ratios}"
    assert ratios[None][0] > 1.15 and min(ratios[None][1:]) > 1.05, f"seed {seed}: {ratios}"
    # fp32 inputs: only the state is low precision.
    qf, kf, vf = (x.float() for x in (q, k, v))
    reff = attention_float64(qf, kf, vf)
    f32, f16 = (rel(attention(qf, kf, vf, accum=a, impl="torch"), reff) for a in ("fp32", "bf16"))
    print(f"T=1024 fp32 inputs: o error fp32 state {f32:.2e}, bf16 state {f16:.2e}")
    assert f32 < 1e-5 < 1e-3 < f16, f"seed {seed}"
    # The Triton kernel, forward, one head.
    need_triton("triton")
    q1, k1, v1 = q[:, :1], k[:, :1], v[:, :1]
    ref1 = attention_float64(q1, k1, v1)
    t32, t16 = (rel(attention(q1, k1, v1, accum=a, impl="triton", rounding=()), ref1) for a in ("fp32", "bf16"))
    print(f"T=1024 triton o error fp32 {t32:.2e}, bf16 {t16:.2e}, ratio {t16 / t32:.2f}")
    assert t16 > 1.7 * t32, f"seed {seed}: triton fp32 {t32:.2e}, bf16 {t16:.2e}"


def block_ties(q, k, scale, block_n):
    """Per row: does some key block hold its row max twice, within ak.SAFEMAX_TIE (the prior work's
    rule), in s rounded as the bf16 kernel sees it?"""
    T = q.shape[2]
    s = ((q.float() @ k.float().mT).to(BF16).float() * scale).to(BF16).float()
    s = s.masked_fill(~causal(T), float("-inf"))
    tie = torch.zeros(s.shape[:-1], dtype=torch.bool, device=q.device)
    for j in range(0, T, block_n):
        blk = s[..., j:j + block_n]
        rm = blk.amax(-1, keepdim=True)
        tie |= ((blk >= rm - ak.SAFEMAX_TIE).sum(-1) > 1) & (rm[..., 0] > float("-inf"))
    return tie


def tied_family(B, H, T, D, every=16, sign=1.0):
    """Every `every`-th key (from 0) a copy of one key every query prefers; values of one sign."""
    q, k = torch.randn(B, H, T, D, device=DEV), torch.randn(B, H, T, D, device=DEV)
    u = torch.randn(B, H, 1, D, device=DEV)
    u = u / u.norm(dim=-1, keepdim=True)
    k[:, :, ::every] = 8 * u
    q = q + 12 * u
    v = sign * torch.randn(B, H, T, D, device=DEV).abs()
    return q.to(BF16), k.to(BF16), v.to(BF16)


@pytest.mark.parametrize("impl,T,block_n", [("torch", 512, 64), ("triton", 130, 32)])
def test_safemax_differs_exactly_where_a_block_max_repeats(impl, T, block_n, seed):
    need_triton(impl)
    # Rows are independent, and safemax changes a row's state only in a key block where its max
    # repeats: rows without such a tie must equal "bf16" bit for bit, rows with one differ.
    scale = 64 ** -0.5
    q, k, v = (randn(1, 4, T, 64) for _ in range(3))
    b16, safe = (attention(q, k, v, accum=a, impl=impl, block_n=block_n) for a in ("bf16", "bf16-safemax"))
    tie = block_ties(q, k, scale, block_n)
    same = (b16 == safe).all(-1)
    print(f"\n{impl}: generic inputs, {tie.sum().item()} of {tie.numel()} rows have a repeated block max; "
          f"{(~same & tie).sum().item()} of those differ")
    assert same[~tie].all(), f"seed {seed}: a row without ties differs between bf16 and bf16-safemax"
    q, k, v = tied_family(1, 4, T, 64)
    tie = block_ties(q, k, scale, block_n)
    outs = {a: attention(q, k, v, accum=a, impl=impl, block_n=block_n) for a in ACCUM_MODES}
    differ = ~(outs["bf16"] == outs["bf16-safemax"]).all(-1)
    print(f"{impl}: tied family, {tie.float().mean().item():.0%} of rows tied; safemax differs from bf16 on "
          f"{differ[tie].float().mean().item():.0%} of them")
    # From row 16 on, a row sees two copies (keys 0 and 16) in one key block: nearly all tie.
    assert tie[..., 16:].float().mean() > 0.95 and differ[tie].float().mean() > 0.9, f"seed {seed}"
    assert not torch.equal(outs["fp32"], outs["bf16"]), f"seed {seed}"


def test_safemax_beta_is_honoured_alike_by_both_implementations(seed):
    # Every other test runs safemax at the default beta 2: a kernel ignoring beta would pass them.
    need_triton("triton")
    q, k, v = tied_family(1, 2, 130, 64)
    ref = attention_float64(q, k, v)
    out = {(impl, beta): attention(q, k, v, accum="bf16-safemax", safemax_beta=beta, impl=impl, block_n=32)
           for impl in ("torch", "triton") for beta in (2.0, 4.0)}
    for impl in ("torch", "triton"):
        assert not torch.equal(out[impl, 2.0], out[impl, 4.0]), f"seed {seed}: {impl} ignores beta"
    for beta in (2.0, 4.0):
        diff, mode_err = rel(out["triton", beta], out["torch", beta]), rel(out["torch", beta], ref)
        assert diff <= 0.5 * mode_err, f"seed {seed}: beta {beta}: triton vs torch {diff:.2e}, error {mode_err:.2e}"


def prior_work_bf16(q, k, v, do, n, safemax=False):
    """Qiu & Yao's flash attention, forward and backward, written op by op from their pure-PyTorch
    code: every tensor bf16, so every op rounds once; tiles of n queries by n keys. Tiles wholly
    above the diagonal are skipped: they add nothing in theirs (whose safe-max also shifts a
    negative running max to 0 there, a quirk this test avoids with positive maxima).
    mm() is a bf16 matmul as tensor cores do it: exact products summed in fp32, rounded once. The
    CPU's own bf16 matmul sums in another order and moves elements (lab/MEASUREMENTS.md, "the twin and
    the Triton kernel equal the prior work's bf16 algorithm")."""
    mm = lambda a, b: (a.float() @ b.float()).to(BF16)
    B, H, T, D = q.shape
    scale, neg = D ** -0.5, -torch.finfo(BF16).max
    o = torch.zeros_like(q)
    l, m = torch.zeros(B, H, T, 1, dtype=BF16), torch.full((B, H, T, 1), neg, dtype=BF16)
    masks = {(i, j): torch.arange(j, min(j + n, T))[None, :] > torch.arange(i, min(i + n, T))[:, None]
             for i in range(0, T, n) for j in range(0, i + 1, n)}
    for (i, j), mask in masks.items():
        s = (mm(q[:, :, i:i + n], k[:, :, j:j + n].mT) * scale).masked_fill(mask, neg)
        block_max = s.amax(-1, keepdim=True)
        if safemax:
            tied = (s >= block_max - 1e-3).sum(-1, keepdim=True) > 1
            block_max = torch.where(tied & (block_max > 0), 2.0 * block_max, block_max)
            block_max = torch.where(tied & (block_max < 0), 0, block_max)
        m_old = m[:, :, i:i + n]
        m_new = torch.maximum(block_max, m_old)
        p = torch.exp(s - m_new)
        alpha = torch.exp(m_old - m_new)
        l[:, :, i:i + n] = alpha * l[:, :, i:i + n] + p.sum(-1, keepdim=True).clamp(min=1e-10)
        o[:, :, i:i + n] = o[:, :, i:i + n] * alpha + mm(p, v[:, :, j:j + n])
        m[:, :, i:i + n] = m_new
    o = o / l
    lse = l.log() + m
    dq, dk, dv = torch.zeros_like(q), torch.zeros_like(k), torch.zeros_like(v)
    delta = (do * o).sum(-1, keepdim=True)
    for (i, j), mask in masks.items():
        s = (mm(q[:, :, i:i + n], k[:, :, j:j + n].mT) * scale).masked_fill(mask, float("-inf"))
        p = torch.exp(s - lse[:, :, i:i + n])
        dv[:, :, j:j + n] += mm(p.mT, do[:, :, i:i + n])
        ds = p * scale * (mm(do[:, :, i:i + n], v[:, :, j:j + n].mT) - delta[:, :, i:i + n])
        dq[:, :, i:i + n] += mm(ds, k[:, :, j:j + n])
        dk[:, :, j:j + n] += mm(ds.mT, q[:, :, i:i + n])
    return o, dq, dk, dv


@pytest.mark.skipif(DEV != "cpu", reason="the transcription runs bf16 ops on the CPU")
@pytest.mark.parametrize("impl", ["torch", "triton"])
@pytest.mark.parametrize("accum", ["bf16", "bf16-safemax"])
def test_every_rounding_point_is_the_prior_works(impl, accum, seed):
    # With every source on, both implementations give the transcription's o, dq, dk, dv bit for bit.
    # Without the separate rounding of P V (O = r(r(alpha O) + P V), the old fused form) 12 to 18%
    # of o moves, so losing it fails the test (lab/MEASUREMENTS.md, as for prior_work_bf16).
    need_triton(impl)
    q, k, v, do = (randn(1, 2, 192, 64) for _ in range(4))
    if accum == "bf16-safemax":
        q, k, v = tied_family(1, 2, 192, 64, every=8)
        q = (q.float() * 0.5).to(BF16)  # tied maxima near 6: in the prior work's uncapped regime
    want = prior_work_bf16(q, k, v, do, ak.BF16_BWD_BLOCK, safemax=accum == "bf16-safemax")
    kw = dict(accum=accum, impl=impl, block_n=ak.BF16_BWD_BLOCK)
    full = run(q, k, v, do, rounding=ROUNDING_SOURCES, **kw)
    fused = run(q, k, v, do, rounding=("logits", "backward"), **kw)
    differ = lambda out: [(a != b).float().mean().item() for a, b in zip((out[0], *out[1]), want)]
    assert max(differ(full)) == 0, f"seed {seed}: fraction of o, dq, dk, dv elements that differ {differ(full)}"
    assert differ(fused)[0] > 0.05, f"seed {seed}: the separate P V rounding made no difference {differ(fused)}"


@pytest.mark.parametrize("impl", ["torch", "triton"])
def test_safemax_is_finite_and_accurate_up_to_huge_tied_maxima(impl, seed):
    # The prior work's shift beta*max leaves tied entries at exp(-(beta-1)*max), and its clamp of
    # the block sum at 1e-10 wrecks l from a tied max of about 23 on. Capped, the error stays at the
    # bf16 state's (lab/MEASUREMENTS.md, "which rounding source carries the fault's bias").
    need_triton(impl)
    for top in (50.0, 100.0, 1000.0, 1e30):
        g = torch.Generator(device=DEV).manual_seed(seed % 2**31)
        u = torch.randn(1, 2, 1, 64, device=DEV, generator=g)
        u = u / u.norm(dim=-1, keepdim=True)
        q, k = (x - (x * u).sum(-1, keepdim=True) * u for x in
                (0.3 * torch.randn(1, 2, 130, 64, device=DEV, generator=g) for _ in range(2)))
        a = (top * 8) ** 0.5                  # (a u).(a u) / sqrt(64) = top
        q = q + a * u
        k[:, :, ::8] = a * u                  # every 8th key: tied at logit `top` for every query
        q, k, v = q.to(BF16), k.to(BF16), randn(1, 2, 130, 64)
        ref = attention_float64(q, k, v)
        errs = {accum: rel(attention(q, k, v, accum=accum, impl=impl, block_n=32), ref)
                for accum in ("bf16", "bf16-safemax")}
        assert errs["bf16-safemax"] < 2 * errs["bf16"] + 1e-3 and errs["bf16-safemax"] < 1e-2, \
            f"seed {seed}: tied max {top:g}: errors {errs}"


# --------------------------------------------------------------------------------------------------
# The fault's character: which rounding source carries a bias. Bias ratio = mean signed error / rms
# error of o against float64, on several input families, each source switched on alone.

FAMILIES = {
    "generic": lambda: tuple(randn(1, 4, 1024, 64) for _ in range(3)),
    "tied+": lambda: tied_family(1, 4, 1024, 64),                      # values > 0
    "tied-": lambda: tied_family(1, 4, 1024, 64, sign=-1.0),           # values < 0
    # near-uniform attention over long rows (logits ~ 0.02 * N(0, 1)), values with a positive mean
    "uniform": lambda: (randn(1, 4, 1024, 64, scale=0.02), randn(1, 4, 1024, 64),
                        (torch.randn(1, 4, 1024, 64, device=DEV) + 1).to(BF16)),
}
SOURCE_ARMS = {                       # name: (accum, rounding)
    "none": ("fp32", ()),             # a standard flash kernel, the control
    "logits": ("fp32", ("logits",)),
    "pv": ("fp32", ("pv",)),
    "state": ("bf16", ()),
    "fp32": ("fp32", None),           # the defaults: the prior work's logits and P V roundings
    "bf16": ("bf16", None),           # the prior work's forward
    "bf16-safemax": ("bf16-safemax", None),
}


def test_fault_character_table(seed):
    n_seeds = 4
    stats = {(f, a): [] for f in FAMILIES for a in SOURCE_ARMS}  # (rel error, bias ratio) per seed
    for i in range(n_seeds):
        torch.manual_seed(seed + i)
        for fam, make in FAMILIES.items():
            q, k, v = make()
            ref = attention_float64(q, k, v)
            for name, (accum, rounding) in SOURCE_ARMS.items():
                o = attention(q, k, v, accum=accum, rounding=rounding, impl="torch")
                stats[fam, name].append((rel(o, ref), bias_ratio(o, ref)))
    err = {key: sum(e for e, _ in st) / n_seeds for key, st in stats.items()}
    bias = {key: [b for _, b in st] for key, st in stats.items()}
    mean_abs = {key: sum(map(abs, b)) / n_seeds for key, b in bias.items()}
    print(f"\nbf16 inputs (1, 4, 1024, 64), torch twin, block 128, seeds {seed}..{seed + n_seeds - 1}")
    print(f"{'family':>8} {'source':>13} {'rel err':>9}   bias ratio per seed")
    for fam, a in stats:
        print(f"{fam:>8} {a:>13} {err[fam, a]:9.2e}   " + " ".join(f"{b:+.3f}" for b in bias[fam, a]))
    msg = f"seed {seed}: {bias}"
    # Generic inputs: no source is biased.
    assert all(abs(b) < 0.05 for a in SOURCE_ARMS for b in bias["generic", a]), msg
    for fam, sign in (("tied+", 1), ("tied-", -1)):
        # Tied maxima, values of one sign (measured ratios: lab/MEASUREMENTS.md, "which rounding source
        # carries the fault's bias"). The state's error follows the values' sign in every seed:
        # where a row's max repeats, P holds exact 1s, the block sum lands on the bf16 grid and the
        # other keys' small remainder is rounded away every time, so l comes out low and o high.
        assert all(sign * b > 0.1 for a in ("state", "bf16") for b in bias[fam, a]), msg
        # Rounded logits alone add no bias; P V rounded by itself a little (at most 0.06), under
        # half the state's.
        assert all(abs(b) < 0.03 for a in ("none", "logits") for b in bias[fam, a]), msg
        assert all(abs(b) < 0.1 for a in ("pv", "fp32") for b in bias[fam, a]), msg
        assert mean_abs[fam, "pv"] < 0.5 * mean_abs[fam, "state"], msg
        # Safe-max takes the 1s out of P but not the equal P of tied entries, whose sum still lands
        # on the grid when their count is a power of two (8 per block here): it removes about half.
        assert mean_abs[fam, "bf16-safemax"] < 0.7 * mean_abs[fam, "bf16"], msg
    # Every family: the bf16 state errs more than the fp32 state, and safemax stays near the bf16
    # state, so a safemax that shifts p wrongly cannot hide behind its small bias.
    assert all(err[f, "bf16"] > 1.1 * err[f, "fp32"] for f in FAMILIES), f"seed {seed}: {err}"
    assert all(err[f, "bf16-safemax"] < 2 * err[f, "bf16"] for f in FAMILIES), f"seed {seed}: {err}"


# --------------------------------------------------------------------------------------------------
# max_logit by-product, torch.compile, errors.

def float64_max_logit(q, k, scale, softcap=0.0):
    T = q.shape[2]
    s = q.double() @ k.double().mT * scale
    if softcap:
        s = softcap * torch.tanh(s / softcap)
    return s.masked_fill(~causal(T), float("-inf")).amax((-2, -1))


@pytest.mark.parametrize("impl", ["torch", "triton", "sdpa", "reference"])
@pytest.mark.parametrize("variant", ["plain", "qk_norm", "softcap"])
def test_max_logit(impl, variant, seed):
    need_triton(impl)
    B, H, T, D = 2, 3, 100, 64
    scale = D ** -0.5
    q, k = randn(B, H, T, D, scale=3.0), randn(B, H, T, D)
    if variant == "qk_norm":
        k = q.clone()  # then the diagonal logit is ~ scale * D: the bound is approached
    v = randn(B, H, T, D)
    softcap = 2.0 if variant == "softcap" else 0.0
    if impl == "sdpa" and softcap:
        pytest.skip("sdpa has no softcap")
    modes = ACCUM_MODES if impl in ("torch", "triton") else ("fp32",)
    qn, kn = (ak._rms_norm(q), ak._rms_norm(k)) if variant == "qk_norm" else (q, k)
    want = float64_max_logit(qn, kn, scale, softcap)
    for accum in modes:
        kw = dict(qk_norm=variant == "qk_norm", softcap=softcap, return_max_logit=True)
        if impl == "reference":   # the tests' own, whose max logit the other tests do not read
            o, ml = attention_float64(q, k, v, **kw)
        else:
            o, ml = attention(q, k, v, accum=accum, impl=impl, block_n=32 if impl != "sdpa" else None, **kw)
        assert ml.shape == (B, H) and ml.dtype == torch.float32 and not ml.requires_grad
        tol = 2.0 ** -8 if impl in ("torch", "triton") else 1e-5  # by default s is rounded to bf16
        assert torch.allclose(ml.double(), want, rtol=tol, atol=1e-6), f"seed {seed}: {accum}: {ml} vs {want}"
        if variant == "qk_norm":  # |logit| <= scale * D, up to bf16 rounding of normed q, k and s
            assert (ml <= scale * D * (1 + 2.0 ** -6)).all() and (ml > 0.95 * scale * D).all(), f"seed {seed}: {ml}"
        if variant == "softcap":
            assert (ml <= softcap).all(), f"seed {seed}"


def test_torch_compile_fullgraph_matches_eager(seed):
    def f(x, w, accum):
        B, T, C = x.shape
        q, k, v = (x @ w).view(B, T, 3, 2, C // 2).permute(2, 0, 3, 1, 4)  # non-contiguous views
        o, ml = attention(q, k, v, accum=accum, qk_norm=True, return_max_logit=True, impl="torch", block_n=16)
        return o.transpose(1, 2).reshape(B, T, C).square().mean(), ml

    x = torch.randn(2, 40, 64, device=DEV)
    compiled = torch.compile(f, fullgraph=True, backend="aot_eager")  # any graph break raises
    for accum in ("fp32", "bf16"):
        w = torch.randn(64, 192, device=DEV, requires_grad=True)
        (l1, m1), (l2, m2) = compiled(x, w, accum), f(x, w, accum)
        g1, g2 = (torch.autograd.grad(loss, w)[0] for loss in (l1, l2))
        assert torch.allclose(l1, l2) and torch.equal(m1, m2), f"seed {seed}"
        assert torch.allclose(g1, g2, rtol=1e-5, atol=1e-7), f"seed {seed}: {(g1 - g2).abs().max()}"


@pytest.mark.parametrize("impl,accum", [(i, a) for i in ("torch", "triton") for a in ACCUM_MODES] + [("sdpa", "fp32")])
def test_a_callers_autocast_changes_nothing_inside(impl, accum, seed):
    # train.py runs the model under bf16 autocast, still on inside the custom ops: once it ran the
    # twin's fp32 matmuls in bf16 (fp32 state erred like bf16) and rounded sdpa's max logit.
    need_triton(impl)
    q, k, v, do = (randn(2, 3, 100, 32, dtype=FP32, scale=2.0) for _ in range(4))
    kw = dict(accum=accum, impl=impl)
    plain = attention(q, k, v, return_max_logit=True, **kw)[1], run(q, k, v, do, **kw)
    with torch.autocast(DEV, dtype=BF16):
        autocast = attention(q, k, v, return_max_logit=True, **kw)[1], run(q, k, v, do, **kw)
    assert torch.equal(plain[0], autocast[0]), f"seed {seed}: max logit changed"
    if impl != "sdpa":  # sdpa itself follows autocast (bf16 output); its max logit is ours
        assert bitwise_equal(plain[1], autocast[1]), f"seed {seed}"


@pytest.mark.parametrize("impl", ["torch", "triton"])
@pytest.mark.parametrize("accum", ACCUM_MODES)
def test_strided_inputs_need_no_copies_and_change_nothing(impl, accum, seed):
    # The model hands over (B, T, H, D).transpose(1, 2) views; the kernels read them in place and
    # write o, dq, dk, dv in the same layout (o.transpose(1, 2) is then contiguous). Every result
    # must equal, bit for bit, the one on contiguous copies and on a mixed layout (k, v contiguous).
    need_triton(impl)
    B, T, H, D = 2, 150, 3, 32
    q, k, v, do = (randn(B, T, H, D, scale=2.0).transpose(1, 2) for _ in range(4))
    kw = dict(accum=accum, impl=impl, block_n=32)
    strided = run(q, k, v, do, **kw)
    dense = run(*(x.contiguous() for x in (q, k, v, do)), **kw)
    mixed = run(q, k.contiguous(), v.contiguous(), do, **kw)
    assert all_finite(strided), f"seed {seed}: unwritten (NaN) output"
    assert all(x.stride() == q.stride() for x in flat(strided))
    assert strided[0].transpose(1, 2).is_contiguous()
    assert bitwise_equal(strided, dense) and bitwise_equal(strided, mixed), f"seed {seed}: the layout changed a result"


def test_clear_errors(monkeypatch):
    q = torch.randn(1, 2, 8, 64, device=DEV)
    with pytest.raises(ValueError, match="fp32.*bf16.*bf16-safemax"):
        attention(q, q, q, accum="fp16")
    with pytest.raises(ValueError, match="auto.*triton.*torch.*sdpa"):
        attention(q, q, q, impl="cuda")
    q48 = torch.randn(1, 2, 8, 48, device=DEV)
    with pytest.raises(ValueError, match=r"\(16, 32, 64, 128\)"):
        attention(q48, q48, q48, impl="triton")
    attention(q48, q48, q48, impl="torch")  # any head size is fine for the twin
    with pytest.raises(ValueError, match="4-D"):
        attention(q[0], q[0], q[0])
    with pytest.raises(ValueError, match="one shape"):
        attention(q, q, q[:, :, :4])
    with pytest.raises(ValueError, match="dtype"):
        attention(q.double(), q.double(), q.double())
    with pytest.raises(ValueError, match="accum='fp32'"):
        attention(q, q, q, accum="bf16", impl="sdpa")
    with pytest.raises(ValueError, match="power of two"):
        attention(q, q, q, impl="triton", block_n=48)
    with pytest.raises(ValueError, match="'state'.*not|rounding source 'state'"):
        attention(q, q, q, rounding=("state",))       # the state is accum's
    with pytest.raises(ValueError, match="no rounding sources"):
        attention(q, q, q, impl="sdpa", rounding=("logits",))
    with pytest.raises(ValueError, match="needs bf16 inputs"):
        attention(q, q, q, rounding=("backward",))    # q is fp32 here
    with pytest.raises(ValueError, match="safemax_beta must be finite and > 1"):
        attention(q, q, q, accum="bf16-safemax", safemax_beta=float("nan"))
    if DEV == "cpu":
        monkeypatch.setattr(ak, "INTERPRET", False)
        with pytest.raises(ValueError, match="TRITON_INTERPRET=1.*impl='torch'"):
            attention(q, q, q, impl="triton")


@pytest.mark.parametrize("accum", ["bf16", "bf16-safemax"])
def test_bf16_state_defaults_to_the_same_key_block_in_both_implementations(accum, seed):
    # The bf16 state rounds m, l and acc once per key block, so the block size changes the result,
    # and the default block is part of the fault's definition.
    need_triton("triton")
    q, k, v = (randn(1, 2, 300, 32) for _ in range(3))
    by_default = [attention(q, k, v, accum=accum, impl=impl) for impl in ("torch", "triton")]
    explicit = attention(q, k, v, accum=accum, impl="torch", block_n=ak.BF16_STATE_BLOCK_N)
    other_block = attention(q, k, v, accum=accum, impl="torch", block_n=32)
    assert torch.equal(by_default[0], explicit)
    assert rel(by_default[1], by_default[0]) < 1e-3, f"seed {seed}"
    assert not torch.equal(other_block, explicit), f"seed {seed}: block_n=32 was ignored"


@pytest.mark.parametrize("impl", ["torch", "triton"])
def test_bf16_state_rescale_across_key_blocks_is_exercised(impl, seed):
    # The streaming rescale (alpha = exp(m_old - m_new), O = alpha O + P V) runs only where a row sees a
    # second key block. A row inside one block (rows < block_n) is computed alike at every block size, so
    # neither state can show the rescale there; a row streaming 2-4 blocks of 32 moves with the block in
    # bf16 state by bf16's precision (each rescale is rounded), in fp32 state only by fp32's (the sums'
    # order). fp32 inputs and no other rounding source: the state is the only bf16 in the kernel.
    need_triton(impl)
    B, H, T, D, block = 2, 4, 128, 32, 32
    q, k, v = (randn(B, H, T, D, dtype=FP32) for _ in range(3))
    moved = {}
    for accum in ("fp32", "bf16"):
        streamed, one_block = (attention(q, k, v, accum=accum, impl=impl, block_n=n, rounding=()).double()
                               for n in (block, T))
        moved[accum] = (streamed - one_block).norm(dim=-1) / one_block.norm(dim=-1)    # per row
        assert torch.equal(streamed[..., :block, :], one_block[..., :block, :]), f"seed {seed}: {accum}, rows < {block}"
    by_blocks = [f"{moved['bf16'][..., j:j + block].mean():.1e}" for j in range(0, T, block)]
    print(f"\n{impl}: bf16 state, rows moved by streaming 1-4 key blocks: {by_blocks}; fp32 state at most "
          f"{moved['fp32'].max():.1e}")
    assert moved["fp32"].max() < 1e-5, f"seed {seed}: fp32 state moved {moved['fp32'].max():.2e}"
    # every row that streams 2 or more blocks moves by a bf16 rounding (2^-9 relative) or more, on average
    assert (moved["bf16"][..., block:] > 0).float().mean() > 0.99, f"seed {seed}"
    assert moved["bf16"][..., block:].mean() > 1e-3, f"seed {seed}: {moved['bf16'][..., block:].mean():.2e}"
