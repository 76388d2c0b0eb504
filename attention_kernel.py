"""Causal flash attention with a switchable streaming-softmax state: the fault and its repairs.

accum="fp32"          the repair: running max m, running sum l and output accumulator acc kept in fp32.
accum="bf16"          the fault (after Qiu & Yao, arXiv 2510.04212): S, m, l and acc rounded to bf16.
accum="bf16-safemax"  the prior work's fix at the source: as "bf16", but a repeated row max is shifted away.

Two implementations of the same algorithm with the same rounding points:
  - Triton kernels (CUDA, or CPU tensors under TRITON_INTERPRET=1, set before this module is imported);
  - a PyTorch twin that loops over key blocks in Python (CPU training, and to cross-check the kernels).
Both sit behind torch.library custom ops, so a model calling attention() compiles with fullgraph=True.
"sdpa" (PyTorch's fused kernels) and "reference" (float64, materialized) are there to compare against.

    python attention_kernel.py --check     # errors against the float64 reference on this device
    (speed: bench.py times, tunes and compiles these kernels for a GPU)
"""
import math
import os
import sys

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

ACCUM_MODES = ("fp32", "bf16", "bf16-safemax")
IMPLS = ("auto", "triton", "torch", "sdpa", "reference")
TRITON_HEAD_DIMS = (16, 32, 64, 128)
DTYPES = (torch.bfloat16, torch.float16, torch.float32)
# Key block of the bf16-state modes when none is given: the state is rounded once per block, so the block is part
# of the fault's definition; both implementations use this one (the prior work and REFERENCE.md use 128).
BF16_STATE_BLOCK_N = 128
POISON_OUTPUTS = False  # tests set this: every output buffer starts as NaN, so an unwritten element shows
# triton.jit picks the interpreter when the decorator runs, so this is read once, at import.
_INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"


def _new(shape, dtype, device):
    """The allocator of every buffer the kernels write (lse, row_max, delta; o, dq, dk, dv through _new_like)."""
    if POISON_OUTPUTS:
        return torch.full(shape, float("nan"), dtype=dtype, device=device)
    return torch.empty(shape, dtype=dtype, device=device)


def _new_like(q):
    """A (B, H, T, D) buffer in the one layout that o, dq, dk, dv, and the k, v, do they are computed from, share
    with q: q's own strides when q is dense with a unit-stride head_dim (the model's (B, T, H, D).transpose(1, 2)
    views, so that nothing is copied on the way in or out), else contiguous. The custom ops' fakes use it too,
    so torch.compile sees the strides the kernels write."""
    if q.stride(-1) != 1:
        return _new(q.shape, q.dtype, q.device)
    x = torch.empty_like(q)          # keeps a dense tensor's strides
    return x.fill_(float("nan")) if POISON_OUTPUTS else x


def _in_layout(like, *xs):
    """xs with like's strides (the kernels take one set of strides for all): copies only where they differ."""
    return [x if x.stride() == like.stride() else torch.empty_like(like).copy_(x) for x in xs]


# ----------------------------------------------------------------------------------------------------------------
# Triton kernels. One program per (query or key block, batch*head). Every (B, H, T, D) tensor of a call shares
# one layout, passed as (batch, head, time) strides with head_dim unit-stride: the model's transposed views as they
# are. Key blocks left of the diagonal are wholly visible and skip the causal mask (most of the work at large T).

@triton.jit
def _round_bf16(x):
    # r(x): fp32 -> nearest-even bf16 -> fp32, with integer ops. The interpreter's float cast truncates instead
    # of rounding, so x.to(tl.bfloat16) would disagree between CPU and GPU. Exact for +-inf; NaN is not expected.
    bits = x.to(tl.int32, bitcast=True)
    bits = (bits + 0x7FFF + ((bits >> 16) & 1)) & -65536
    return bits.to(tl.float32, bitcast=True)


@triton.jit
def _cast(x, P):
    # fp32 x to the element type of pointer P (the input dtype). A bf16 target is rounded to nearest even first,
    # so that the cast itself is exact and the interpreter (which truncates) agrees with the GPU.
    if P.dtype.element_ty == tl.bfloat16:
        x = _round_bf16(x)
    return x.to(P.dtype.element_ty)


@triton.jit
def _head(bh, H, stride_b, stride_h):
    # Element offset of head (b, h) = divmod(bh, H), in int64: B * H * T * D may pass 2**31.
    return (bh // H).to(tl.int64) * stride_b + (bh % H).to(tl.int64) * stride_h


@triton.jit
def _rows(offs, stride_t):
    # Element offsets of time rows, in int64: the model's layout has stride_t = n_embd, so T * stride_t passes
    # 2**31 for long sequences of wide models.
    return offs.to(tl.int64) * stride_t


@triton.jit
def _load_block(ptrs, in_range, MASK: tl.constexpr):
    # A key block on the diagonal may run past T: mask it. One left of the diagonal lies wholly below T, and its
    # loads (most of them at large T) skip the mask.
    if MASK:
        x = tl.load(ptrs, mask=in_range, other=0.0)
    else:
        x = tl.load(ptrs)
    return x


@triton.jit
def _dot(a, b, acc, DOT_FP32: tl.constexpr, IEEE: tl.constexpr):
    # acc + a @ b with fp32 accumulation. DOT_FP32: the interpreter's tl.dot is wrong on bf16/fp16 operands
    # (triton issue 11584); a product of two bf16/fp16 numbers is exact in fp32, so upcasting loses nothing.
    # IEEE: fp32 operands must not go through TF32 on the GPU (it would break a 1e-4 tolerance).
    if DOT_FP32:
        a = a.to(tl.float32)
        b = b.to(tl.float32)
    if IEEE:
        acc = tl.dot(a, b, acc, input_precision="ieee")
    else:
        acc = tl.dot(a, b, acc)
    return acc


@triton.jit
def _tanh(x):
    # No portable tl.tanh; this form saturates cleanly to +-1 (exp overflow gives 1, underflow gives -1).
    return 1.0 - 2.0 / (tl.exp(2.0 * x) + 1.0)


@triton.jit
def _logits(qk, scale, softcap, BF16_STATE: tl.constexpr, SOFTCAP: tl.constexpr):
    # s = q.k * scale, rounded to bf16 in the bf16 modes (the prior work's S comes out of a bf16 matmul);
    # softcap: s = c * tanh(s / c), rounded again. Returns (s, t) with t = tanh(.) for the backward.
    s = qk * scale
    if BF16_STATE:
        s = _round_bf16(s)
    t = s
    if SOFTCAP:
        t = _tanh(s / softcap)
        s = softcap * t
        if BF16_STATE:
            s = _round_bf16(s)
    return s, t


@triton.jit
def _fwd_block(q, K, V, start_n, offs_m, m_i, l_i, acc, top, stride_t, scale, softcap, beta, T,
               HEAD_DIM: tl.constexpr, BLOCK_N: tl.constexpr, CAUSAL_MASK: tl.constexpr,
               BF16_STATE: tl.constexpr, SAFEMAX: tl.constexpr, SOFTCAP: tl.constexpr,
               DOT_FP32: tl.constexpr, IEEE: tl.constexpr):
    # One step of the streaming softmax: fold key block [start_n, start_n + BLOCK_N) into (m, l, acc).
    offs_n = start_n + tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, HEAD_DIM)
    kT = _load_block(K + _rows(offs_n, stride_t)[None, :] + offs_d[:, None], offs_n[None, :] < T, CAUSAL_MASK)
    v = _load_block(V + _rows(offs_n, stride_t)[:, None] + offs_d[None, :], offs_n[:, None] < T, CAUSAL_MASK)
    s, t = _logits(_dot(q, kT, tl.zeros([q.shape[0], BLOCK_N], tl.float32), DOT_FP32, IEEE),
                   scale, softcap, BF16_STATE, SOFTCAP)
    if CAUSAL_MASK:   # for a valid row this also hides keys past T (key <= row < T)
        s = tl.where(offs_n[None, :] <= offs_m[:, None], s, float("-inf"))

    rm = tl.max(s, 1)
    top = tl.maximum(top, rm)
    shift = rm
    if SAFEMAX:
        # A row max that repeats in this block (count > 1) makes p = exp(s - m) hold exact 1s, whose bf16
        # P@V sums round with a bias. Shift by beta*rm (rm > 0) or 0 (rm <= 0) so every p < 1 (p = 1 only
        # survives for a tie at exactly 0). Exact in real arithmetic (softmax is shift-invariant), but a
        # large shift underflows: exp(-(beta-1)*rm) < 1e-38 once rm > ~87/(beta-1), and l can reach 0.
        count = tl.sum((s == rm[:, None]).to(tl.int32), 1)
        tied = (count > 1) & (rm > float("-inf"))  # rm = -inf: the row sees no key here, keep the no-op
        shift = tl.where(tied, tl.where(rm > 0, beta * rm, 0.0), rm)
    m_new = tl.maximum(m_i, shift)

    if BF16_STATE:
        # The fault. r() = round to bf16 and back. s = r(q.k * scale) [softcap, r() again] (_logits);
        #   m_new = r(max(m, shift));  alpha = exp(r(m - m_new));  p = exp(r(s - m_new))
        #   (exp in fp32 of a bf16 argument: a tie at the row max gives p = exactly 1)
        #   l = r(l*alpha + rowsum(p));  acc = r(acc*alpha + r(p) @ v)
        m_new = _round_bf16(m_new)
        alpha = tl.exp(_round_bf16(m_i - m_new))
        p = tl.exp(_round_bf16(s - m_new[:, None]))
        l_i = _round_bf16(l_i * alpha + tl.sum(p, 1))
        p = _round_bf16(p)
        acc = _round_bf16(_dot(_cast(p, V), v, acc * alpha[:, None], DOT_FP32, IEEE))
    else:
        # The repair: s, m, l, acc in fp32; only P is cast to v's dtype for the P@V matmul (fp32 accumulate).
        alpha = tl.exp(m_i - m_new)
        p = tl.exp(s - m_new[:, None])
        l_i = l_i * alpha + tl.sum(p, 1)
        acc = _dot(_cast(p, V), v, acc * alpha[:, None], DOT_FP32, IEEE)
    return m_new, l_i, acc, top


@triton.jit
def _attn_fwd(Q, K, V, O, LSE, ROWMAX, stride_b, stride_h, stride_t, H, T, scale, softcap, beta,
              HEAD_DIM: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
              BF16_STATE: tl.constexpr, SAFEMAX: tl.constexpr, SOFTCAP: tl.constexpr,
              DOT_FP32: tl.constexpr, IEEE: tl.constexpr):
    pid_m = tl.program_id(0)
    bh = tl.program_id(1)
    head = _head(bh, H, stride_b, stride_h)
    Q += head
    K += head
    V += head
    O += head
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, HEAD_DIM)
    q = tl.load(Q + _rows(offs_m, stride_t)[:, None] + offs_d[None, :], mask=offs_m[:, None] < T, other=0.0)

    # Streaming state per query row. Rows past T are computed on zeros and never stored.
    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)      # running shift (the max, or the safemax shift)
    l_i = tl.zeros([BLOCK_M], tl.float32)                    # running sum of exp(s - m)
    acc = tl.zeros([BLOCK_M, HEAD_DIM], tl.float32)          # running sum of exp(s - m) * v
    top = tl.full([BLOCK_M], float("-inf"), tl.float32)      # true max logit, for max_logit (never the shift)

    # Causal: this query block sees the key blocks up to its own end, in order from key 0 (which every row
    # sees, so m_i is finite after the first block; a later block that a row cannot see is an exact no-op).
    # The blocks left of the diagonal need no mask; the same blocks, in the same order, in both loops.
    diag = pid_m * BLOCK_M // BLOCK_N * BLOCK_N
    for start_n in range(0, diag, BLOCK_N):
        m_i, l_i, acc, top = _fwd_block(q, K, V, start_n, offs_m, m_i, l_i, acc, top, stride_t, scale, softcap,
                                        beta, T, HEAD_DIM, BLOCK_N, False, BF16_STATE, SAFEMAX, SOFTCAP,
                                        DOT_FP32, IEEE)
    for start_n in range(diag, (pid_m + 1) * BLOCK_M, BLOCK_N):
        m_i, l_i, acc, top = _fwd_block(q, K, V, start_n, offs_m, m_i, l_i, acc, top, stride_t, scale, softcap,
                                        beta, T, HEAD_DIM, BLOCK_N, True, BF16_STATE, SAFEMAX, SOFTCAP,
                                        DOT_FP32, IEEE)

    # o = acc / l, cast once to the input dtype; lse = m + log(l) in fp32 (from the bf16 m and l in bf16 mode:
    # the backward recomputes p = exp(s - lse)).
    o = acc / l_i[:, None]
    if BF16_STATE:
        o = _round_bf16(o)           # the bf16 O that the backward's delta = rowsum(dO * O) then sees
    row_ok = offs_m < T
    rows = bh.to(tl.int64) * T + offs_m                       # LSE, ROWMAX: contiguous (B, H, T)
    tl.store(O + _rows(offs_m, stride_t)[:, None] + offs_d[None, :], _cast(o, O), mask=row_ok[:, None])
    tl.store(LSE + rows, m_i + tl.log(l_i), mask=row_ok)
    tl.store(ROWMAX + rows, top, mask=row_ok)


@triton.jit
def _attn_bwd_delta(O, DO, DELTA, stride_b, stride_h, stride_t, H, T, HEAD_DIM: tl.constexpr,
                    BLOCK_M: tl.constexpr):
    # delta = rowsum(dO * O) with the STORED O: in bf16 mode the biased O enters the gradient, as in the prior work.
    pid_m = tl.program_id(0)
    bh = tl.program_id(1)
    head = _head(bh, H, stride_b, stride_h)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, HEAD_DIM)
    ptrs = head + _rows(offs_m, stride_t)[:, None] + offs_d[None, :]
    o = tl.load(O + ptrs, mask=offs_m[:, None] < T, other=0.0).to(tl.float32)
    do = tl.load(DO + ptrs, mask=offs_m[:, None] < T, other=0.0).to(tl.float32)
    tl.store(DELTA + bh.to(tl.int64) * T + offs_m, tl.sum(o * do, 1), mask=offs_m < T)


# The backward (all modes, fp32 math): recompute s with the forward's rounding, p = exp(s - lse),
#   dv = p^T @ dO;  dp = dO @ v^T;  ds = p * (dp - delta)  [softcap: ds *= 1 - tanh^2];
#   dq = ds @ k * scale;  dk = ds^T @ q * scale.  p and ds are cast to the input dtype for the matmuls.
# Query rows past T load lse = +inf, so their p, and with it every contribution they make, is exactly 0.

@triton.jit
def _dkdv_block(k, v, dk, dv, Q, DO, LSE, DELTA, start_m, offs_n, stride_t, scale, softcap, T,
                HEAD_DIM: tl.constexpr, BLOCK_M: tl.constexpr, CAUSAL_MASK: tl.constexpr,
                BF16_STATE: tl.constexpr, SOFTCAP: tl.constexpr,
                DOT_FP32: tl.constexpr, IEEE: tl.constexpr):
    # Add query block [start_m, start_m + BLOCK_M)'s share to dk and dv, in transposed form (keys x queries).
    offs_m = start_m + tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, HEAD_DIM)
    row_ok = offs_m < T
    qT = tl.load(Q + _rows(offs_m, stride_t)[None, :] + offs_d[:, None], mask=row_ok[None, :], other=0.0)
    do = tl.load(DO + _rows(offs_m, stride_t)[:, None] + offs_d[None, :], mask=row_ok[:, None], other=0.0)
    lse = tl.load(LSE + offs_m, mask=row_ok, other=float("inf"))
    delta = tl.load(DELTA + offs_m, mask=row_ok, other=0.0)
    sT, tT = _logits(_dot(k, qT, tl.zeros([k.shape[0], BLOCK_M], tl.float32), DOT_FP32, IEEE),
                     scale, softcap, BF16_STATE, SOFTCAP)
    if CAUSAL_MASK:
        sT = tl.where(offs_n[:, None] <= offs_m[None, :], sT, float("-inf"))
    pT = tl.exp(sT - lse[None, :])
    dv = _dot(_cast(pT, DO), do, dv, DOT_FP32, IEEE)
    dpT = _dot(v, tl.trans(do), tl.zeros([k.shape[0], BLOCK_M], tl.float32), DOT_FP32, IEEE)
    dsT = pT * (dpT - delta[None, :])
    if SOFTCAP:
        dsT = dsT * (1.0 - tT * tT)
    dk = _dot(_cast(dsT, Q), tl.trans(qT), dk, DOT_FP32, IEEE)
    return dk, dv


@triton.jit
def _attn_bwd_dkdv(Q, K, V, DO, LSE, DELTA, DK, DV, stride_b, stride_h, stride_t, H, T, scale, softcap,
                   HEAD_DIM: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                   BF16_STATE: tl.constexpr, SOFTCAP: tl.constexpr,
                   DOT_FP32: tl.constexpr, IEEE: tl.constexpr):
    # One key block per program, dk and dv accumulating in registers; loop over the query blocks that see it.
    pid_n = tl.program_id(0)
    bh = tl.program_id(1)
    head = _head(bh, H, stride_b, stride_h)
    Q += head
    DO += head
    LSE += bh.to(tl.int64) * T
    DELTA += bh.to(tl.int64) * T
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, HEAD_DIM)
    kv_ptrs = head + _rows(offs_n, stride_t)[:, None] + offs_d[None, :]
    k = tl.load(K + kv_ptrs, mask=offs_n[:, None] < T, other=0.0)
    v = tl.load(V + kv_ptrs, mask=offs_n[:, None] < T, other=0.0)
    dk = tl.zeros([BLOCK_N, HEAD_DIM], tl.float32)
    dv = tl.zeros([BLOCK_N, HEAD_DIM], tl.float32)

    lo = pid_n * BLOCK_N // BLOCK_M * BLOCK_M                          # earlier queries cannot see these keys
    full = ((pid_n + 1) * BLOCK_N + BLOCK_M - 1) // BLOCK_M * BLOCK_M  # from here on, every query sees them all
    for start_m in range(lo, full, BLOCK_M):
        dk, dv = _dkdv_block(k, v, dk, dv, Q, DO, LSE, DELTA, start_m, offs_n, stride_t, scale, softcap, T,
                             HEAD_DIM, BLOCK_M, True, BF16_STATE, SOFTCAP, DOT_FP32, IEEE)
    for start_m in range(full, T, BLOCK_M):
        dk, dv = _dkdv_block(k, v, dk, dv, Q, DO, LSE, DELTA, start_m, offs_n, stride_t, scale, softcap, T,
                             HEAD_DIM, BLOCK_M, False, BF16_STATE, SOFTCAP, DOT_FP32, IEEE)

    dk = dk * scale
    tl.store(DK + kv_ptrs, _cast(dk, DK), mask=offs_n[:, None] < T)
    tl.store(DV + kv_ptrs, _cast(dv, DV), mask=offs_n[:, None] < T)


@triton.jit
def _dq_block(q, do, lse, delta, dq, K, V, start_n, offs_m, stride_t, scale, softcap, T,
              HEAD_DIM: tl.constexpr, BLOCK_N: tl.constexpr, CAUSAL_MASK: tl.constexpr,
              BF16_STATE: tl.constexpr, SOFTCAP: tl.constexpr,
              DOT_FP32: tl.constexpr, IEEE: tl.constexpr):
    # Add key block [start_n, start_n + BLOCK_N)'s share to dq.
    offs_n = start_n + tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, HEAD_DIM)
    kT_offs = _rows(offs_n, stride_t)[None, :] + offs_d[:, None]
    kT = _load_block(K + kT_offs, offs_n[None, :] < T, CAUSAL_MASK)
    vT = _load_block(V + kT_offs, offs_n[None, :] < T, CAUSAL_MASK)
    s, t = _logits(_dot(q, kT, tl.zeros([q.shape[0], BLOCK_N], tl.float32), DOT_FP32, IEEE),
                   scale, softcap, BF16_STATE, SOFTCAP)
    if CAUSAL_MASK:
        s = tl.where(offs_n[None, :] <= offs_m[:, None], s, float("-inf"))
    p = tl.exp(s - lse[:, None])
    dp = _dot(do, vT, tl.zeros([q.shape[0], BLOCK_N], tl.float32), DOT_FP32, IEEE)
    ds = p * (dp - delta[:, None])
    if SOFTCAP:
        ds = ds * (1.0 - t * t)
    return _dot(_cast(ds, K), tl.trans(kT), dq, DOT_FP32, IEEE)


@triton.jit
def _attn_bwd_dq(Q, K, V, DO, LSE, DELTA, DQ, stride_b, stride_h, stride_t, H, T, scale, softcap,
                 HEAD_DIM: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                 BF16_STATE: tl.constexpr, SOFTCAP: tl.constexpr,
                 DOT_FP32: tl.constexpr, IEEE: tl.constexpr):
    # One query block per program; loop over the key blocks it sees, unmasked left of the diagonal (as forward).
    pid_m = tl.program_id(0)
    bh = tl.program_id(1)
    head = _head(bh, H, stride_b, stride_h)
    K += head
    V += head
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, HEAD_DIM)
    q_ptrs = head + _rows(offs_m, stride_t)[:, None] + offs_d[None, :]
    rows = bh.to(tl.int64) * T + offs_m
    q = tl.load(Q + q_ptrs, mask=offs_m[:, None] < T, other=0.0)
    do = tl.load(DO + q_ptrs, mask=offs_m[:, None] < T, other=0.0)
    lse = tl.load(LSE + rows, mask=offs_m < T, other=float("inf"))
    delta = tl.load(DELTA + rows, mask=offs_m < T, other=0.0)
    dq = tl.zeros([BLOCK_M, HEAD_DIM], tl.float32)

    diag = pid_m * BLOCK_M // BLOCK_N * BLOCK_N
    for start_n in range(0, diag, BLOCK_N):
        dq = _dq_block(q, do, lse, delta, dq, K, V, start_n, offs_m, stride_t, scale, softcap, T,
                       HEAD_DIM, BLOCK_N, False, BF16_STATE, SOFTCAP, DOT_FP32, IEEE)
    for start_n in range(diag, (pid_m + 1) * BLOCK_M, BLOCK_N):
        dq = _dq_block(q, do, lse, delta, dq, K, V, start_n, offs_m, stride_t, scale, softcap, T,
                       HEAD_DIM, BLOCK_N, True, BF16_STATE, SOFTCAP, DOT_FP32, IEEE)

    dq = dq * scale
    tl.store(DQ + q_ptrs, _cast(dq, DQ), mask=offs_m[:, None] < T)


def _fwd_config(D, dtype, block_n, accum):
    """(BLOCK_M, BLOCK_N, num_warps, num_stages) for an H100/H200, chosen so that no kernel spills registers on
    sm_90: `python bench.py --only resources` prints registers, spills and shared memory per kernel."""
    es = torch.empty((), dtype=dtype).element_size()
    if not block_n:   # fp32 state: a speed choice; bf16 state: part of the fault's definition
        block_n = (32 if es == 4 else 64) if accum == "fp32" else BF16_STATE_BLOCK_N
    if es == 4:
        # fp32 inputs: IEEE dots run on the FMA units, not the tensor cores, with their operands in registers.
        # Larger tiles spill tens of KB per thread: `python bench.py --only resources --dtype fp32`.
        block_m = 16 if D > 64 else max(16, min(64, 2048 // block_n))
        return block_m, block_n, 16 if D > 64 and block_n >= 128 else 8, 1
    # Registers grow with the S tile (BLOCK_M x BLOCK_N) and the accumulator (BLOCK_M x D) per thread, and the
    # bf16 state's rounding needs more temporaries: 4 warps spill there (3 KB per thread at D=64), 8 do not.
    block_m = 128 if accum == "fp32" or D <= 64 else 64
    warps = 4 if accum == "fp32" and block_m * (block_n + D) <= 128 * 128 else 8
    # Pipeline stages: each holds one K and one V tile; stay well inside ~227 KB of shared memory.
    stages = max(1, min(3, (160 * 1024 - block_m * D * es) // (2 * block_n * D * es)))
    return block_m, block_n, warps, stages


def _bwd_configs(D, dtype):
    """(BLOCK_M, BLOCK_N, num_warps, num_stages) of the dk/dv kernel, then of the dq kernel."""
    if dtype == torch.float32:   # IEEE dots on the FMA units, as in _fwd_config
        return (16, 32, 8, 1), (16, 32, 8, 1)
    config = (64, 64, 8 if D >= 128 else 4, 2)
    return config, config


def _mode_flags(accum, q):
    return dict(BF16_STATE=accum != "fp32", DOT_FP32=_INTERPRET,
                IEEE=q.dtype == torch.float32 or _INTERPRET)


def _layout_args(x):
    """The kernels' layout arguments: (batch, head, time) strides of x, and the number of heads."""
    return (*x.stride()[:3], x.shape[1])


# One launcher per kernel, each taking its (BLOCK_M, BLOCK_N, num_warps, num_stages): the tuner times them alone.

def _launch_fwd(config, q, k, v, o, lse, row_max, scale, softcap, accum, beta):
    B, H, T, D = q.shape
    block_m, block_n, warps, stages = config
    _attn_fwd[(triton.cdiv(T, block_m), B * H)](
        q, k, v, o, lse, row_max, *_layout_args(q), T, scale, softcap, beta, HEAD_DIM=D, BLOCK_M=block_m,
        BLOCK_N=block_n, SAFEMAX=accum == "bf16-safemax", SOFTCAP=softcap > 0, **_mode_flags(accum, q),
        num_warps=warps, num_stages=stages)


def _launch_dkdv(config, q, k, v, do, lse, delta, dk, dv, scale, softcap, accum):
    B, H, T, D = q.shape
    block_m, block_n, warps, stages = config
    _attn_bwd_dkdv[(triton.cdiv(T, block_n), B * H)](
        q, k, v, do, lse, delta, dk, dv, *_layout_args(q), T, scale, softcap, HEAD_DIM=D, BLOCK_M=block_m,
        BLOCK_N=block_n, SOFTCAP=softcap > 0, **_mode_flags(accum, q), num_warps=warps, num_stages=stages)


def _launch_dq(config, q, k, v, do, lse, delta, dq, scale, softcap, accum):
    B, H, T, D = q.shape
    block_m, block_n, warps, stages = config
    _attn_bwd_dq[(triton.cdiv(T, block_m), B * H)](
        q, k, v, do, lse, delta, dq, *_layout_args(q), T, scale, softcap, HEAD_DIM=D, BLOCK_M=block_m,
        BLOCK_N=block_n, SOFTCAP=softcap > 0, **_mode_flags(accum, q), num_warps=warps, num_stages=stages)


def _fwd_triton(q, k, v, o, scale, softcap, accum, beta, block_n):
    """Writes o (q's layout, as are k and v); returns lse and the row max logit, (B, H, T) fp32."""
    B, H, T, D = q.shape
    lse = _new((B, H, T), torch.float32, q.device)
    row_max = _new((B, H, T), torch.float32, q.device)
    _launch_fwd(_fwd_config(D, q.dtype, block_n, accum), q, k, v, o, lse, row_max, scale, softcap, accum, beta)
    return lse, row_max


def _bwd_delta(o, do):
    B, H, T, D = o.shape
    delta = _new((B, H, T), torch.float32, o.device)
    _attn_bwd_delta[(triton.cdiv(T, 64), B * H)](o, do, delta, *_layout_args(o), T, HEAD_DIM=D, BLOCK_M=64)
    return delta


def _bwd_triton(do, q, k, v, o, lse, dq, dk, dv, scale, softcap, accum):
    """Writes dq, dk, dv; every (B, H, T, D) tensor here shares q's layout."""
    delta = _bwd_delta(o, do)
    dkdv_config, dq_config = _bwd_configs(q.shape[3], q.dtype)
    _launch_dkdv(dkdv_config, q, k, v, do, lse, delta, dk, dv, scale, softcap, accum)
    _launch_dq(dq_config, q, k, v, do, lse, delta, dq, scale, softcap, accum)


# ----------------------------------------------------------------------------------------------------------------
# The PyTorch twin: the same algorithm and rounding points, vectorized over all queries, looping over key blocks.
# Matmuls run in fp32 on upcast operands (exact products, like the tensor cores' fp32 accumulation).

def _r(x):
    return x.to(torch.bfloat16).float()


def _as(x, dtype):  # round fp32 to the input dtype and back (the matmul operand the kernel feeds)
    return x.to(dtype).float()


def _logits_torch(qk, scale, softcap, bf16):
    s = qk * scale
    if bf16:
        s = _r(s)
    t = None
    if softcap > 0:
        t = 1.0 - 2.0 / (torch.exp(2.0 * (s / softcap)) + 1.0)  # tanh, same formula as the kernel
        s = softcap * t
        if bf16:
            s = _r(s)
    return s, t


def _fwd_torch(q, k, v, scale, softcap, accum, beta, block_n):
    B, H, T, D = q.shape
    bf16 = accum != "fp32"
    r = _r if bf16 else (lambda x: x)
    qf, kf, vf = q.float(), k.float(), v.float()
    m = torch.full((B, H, T), float("-inf"), device=q.device)
    l = torch.zeros((B, H, T), device=q.device)
    acc = torch.zeros((B, H, T, D), device=q.device)
    top = torch.full((B, H, T), float("-inf"), device=q.device)
    pos = torch.arange(T, device=q.device)
    for j in range(0, T, block_n):
        keys, rows = slice(j, min(j + block_n, T)), slice(j, T)  # rows < j see none of these keys: a no-op
        s, _ = _logits_torch(qf[:, :, rows] @ kf[:, :, keys].mT, scale, softcap, bf16)
        s = s.masked_fill(pos[keys][None, :] > pos[rows][:, None], float("-inf"))
        rm = s.amax(-1)
        top[..., rows] = torch.maximum(top[..., rows], rm)
        shift = rm
        if accum == "bf16-safemax":  # see the kernel for the rule and its underflow caveat
            tied = ((s == rm[..., None]).sum(-1) > 1) & (rm > float("-inf"))
            shift = torch.where(tied, torch.where(rm > 0, beta * rm, 0.0), rm)
        m_old = m[..., rows]
        m_new = r(torch.maximum(m_old, shift))
        alpha = torch.exp(r(m_old - m_new))
        p = torch.exp(r(s - m_new[..., None]))
        l[..., rows] = r(l[..., rows] * alpha + p.sum(-1))
        acc[..., rows, :] = r(acc[..., rows, :] * alpha[..., None] + _as(r(p), v.dtype) @ vf[:, :, keys])
        m[..., rows] = m_new
    return r(acc / l[..., None]).to(q.dtype), m + torch.log(l), top


def _bwd_torch(do, q, k, v, o, lse, scale, softcap, accum, block_n):
    T, dt = q.shape[2], q.dtype
    qf, kf, vf, dof = q.float(), k.float(), v.float(), do.float()
    delta = (dof * o.float()).sum(-1)  # the stored (in bf16 mode: biased) O
    dq = torch.zeros(qf.shape, device=q.device)
    dk, dv = _new(q.shape, dt, q.device), _new(q.shape, dt, q.device)
    pos = torch.arange(T, device=q.device)
    for j in range(0, T, block_n):
        keys, rows = slice(j, min(j + block_n, T)), slice(j, T)
        s, t = _logits_torch(qf[:, :, rows] @ kf[:, :, keys].mT, scale, softcap, accum != "fp32")
        s = s.masked_fill(pos[keys][None, :] > pos[rows][:, None], float("-inf"))
        p = torch.exp(s - lse[..., rows, None])
        dv[:, :, keys] = (_as(p, dt).mT @ dof[:, :, rows]).to(dt)
        ds = p * (dof[:, :, rows] @ vf[:, :, keys].mT - delta[..., rows, None])
        if softcap > 0:
            ds = ds * (1.0 - t * t)
        ds = _as(ds, dt)
        dk[:, :, keys] = (ds.mT @ qf[:, :, rows] * scale).to(dt)
        dq[:, :, rows] += ds @ kf[:, :, keys]
    return (dq * scale).to(dt), dk, dv   # dk, dv are written block by block: poisoned buffers


# ----------------------------------------------------------------------------------------------------------------
# Custom ops: opaque to torch.compile (no graph break), with a fake for shapes and a registered backward.

def _no_autocast(x):
    """A caller's autocast stays on inside a custom op: it would run the twin's fp32 matmuls in bf16 and move
    its rounding points (every state would then see bf16 logits)."""
    return torch.autocast(x.device.type, enabled=False)


@torch.library.custom_op("qkguard::attn_fwd", mutates_args=())
def _attn_fwd_op(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float, softcap: float, accum: str,
                 beta: float, impl: str, block_n: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    o = _new_like(q)
    q, k, v = _in_layout(o, q, k, v)
    if impl == "triton":
        return o, *_fwd_triton(q, k, v, o, scale, softcap, accum, beta, block_n or None)
    with _no_autocast(q):
        out, lse, row_max = _fwd_torch(q, k, v, scale, softcap, accum, beta, block_n or BF16_STATE_BLOCK_N)
    return o.copy_(out), lse, row_max


@_attn_fwd_op.register_fake
def _(q, k, v, scale, softcap, accum, beta, impl, block_n):
    rows = q.shape[:3]
    return _new_like(q), q.new_empty(rows, dtype=torch.float32), q.new_empty(rows, dtype=torch.float32)


@torch.library.custom_op("qkguard::attn_bwd", mutates_args=())
def _attn_bwd_op(do: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, o: torch.Tensor,
                 lse: torch.Tensor, scale: float, softcap: float, accum: str, impl: str,
                 block_n: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    dq, dk, dv = (_new_like(q) for _ in range(3))
    do, q, k, v, o = _in_layout(dq, do, q, k, v, o)
    if impl == "triton":
        _bwd_triton(do, q, k, v, o, lse, dq, dk, dv, scale, softcap, accum)
        return dq, dk, dv
    with _no_autocast(q):
        grads = _bwd_torch(do, q, k, v, o, lse, scale, softcap, accum, block_n or BF16_STATE_BLOCK_N)
    return tuple(buffer.copy_(g) for buffer, g in zip((dq, dk, dv), grads))


@_attn_bwd_op.register_fake
def _(do, q, k, v, o, lse, scale, softcap, accum, impl, block_n):
    return _new_like(q), _new_like(q), _new_like(q)


def _setup_context(ctx, inputs, output):
    q, k, v, scale, softcap, accum, beta, impl, block_n = inputs
    o, lse, row_max = output
    ctx.save_for_backward(q, k, v, o, lse)
    ctx.args = (scale, softcap, accum, impl, block_n)
    ctx.mark_non_differentiable(lse, row_max)


def _backward(ctx, do, _dlse, _drow_max):
    q, k, v, o, lse = ctx.saved_tensors
    dq, dk, dv = torch.ops.qkguard.attn_bwd(do, q, k, v, o, lse, *ctx.args)
    return dq, dk, dv, None, None, None, None, None, None


_attn_fwd_op.register_autograd(_backward, setup_context=_setup_context)


# ----------------------------------------------------------------------------------------------------------------
# Comparison implementations and the public entry point.

def _attn_reference(q, k, v, scale, softcap):
    """float64, materialized causal softmax, with autograd. Returns (o float64, max_logit float32)."""
    T = q.shape[2]
    s = q.double() @ k.double().mT * scale
    if softcap > 0:
        s = softcap * torch.tanh(s / softcap)
    s = s.masked_fill(~torch.ones(T, T, dtype=torch.bool, device=q.device).tril(), float("-inf"))
    return torch.softmax(s, dim=-1) @ v.double(), s.detach().amax(dim=(-2, -1)).float()


@torch.no_grad()
def _max_logit_chunked(q, k, scale, chunk=256):
    T = q.shape[2]
    best = torch.full(q.shape[:2], float("-inf"), device=q.device)
    for i in range(0, T, chunk):
        j = min(i + chunk, T)
        with _no_autocast(q):
            s = q[:, :, i:j].float() @ k[:, :, :j].float().mT * scale
        causal = torch.arange(j, device=q.device)[None, :] <= torch.arange(i, j, device=q.device)[:, None]
        best = torch.maximum(best, s.masked_fill(~causal, float("-inf")).amax(dim=(-2, -1)))
    return best


def _rms_norm(x, eps=1e-6):
    """Parameter-free RMS norm over head_dim in fp32 (float64 stays), cast back: |q.k| <= head_dim afterwards."""
    xf = x.to(torch.promote_types(x.dtype, torch.float32))
    return (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype)


def _validate(q, k, v, accum, impl, softcap, safemax_beta, block_n):
    if accum not in ACCUM_MODES:
        raise ValueError(f"unknown accum={accum!r}; use one of {ACCUM_MODES}")
    if impl not in IMPLS:
        raise ValueError(f"unknown impl={impl!r}; use one of {IMPLS}")
    if q.dim() != 4 or q.shape != k.shape or q.shape != v.shape:
        raise ValueError(f"q, k, v must be 4-D (batch, heads, time, head_dim) of one shape; got "
                         f"{tuple(q.shape)}, {tuple(k.shape)}, {tuple(v.shape)}")
    if q.shape[2] < 1:
        raise ValueError("time dimension is empty")
    dtypes = DTYPES + ((torch.float64,) if impl == "reference" else ())   # float64 leaves: float64 gradients
    if q.dtype not in dtypes or k.dtype != q.dtype or v.dtype != q.dtype:
        raise ValueError(f"q, k, v must share one dtype among {dtypes}; got {q.dtype}, {k.dtype}, {v.dtype}")
    if softcap < 0:
        raise ValueError(f"softcap must be >= 0 (0 = off); got {softcap}")
    if accum == "bf16-safemax" and not safemax_beta > 1:
        raise ValueError(f"safemax_beta must be > 1 (the prior work uses 2..8); got {safemax_beta}")
    if impl == "auto":
        impl = "triton" if q.is_cuda else "torch"
    if impl == "triton":
        if q.shape[3] not in TRITON_HEAD_DIMS:
            raise ValueError(f"impl='triton' needs head_dim in {TRITON_HEAD_DIMS}; got {q.shape[3]}. "
                             f"Use impl='torch' for other sizes.")
        if not q.is_cuda and not _INTERPRET:
            raise ValueError("impl='triton' on CPU tensors needs TRITON_INTERPRET=1 in the environment before "
                             "attention_kernel is imported; or use impl='torch'")
        if block_n is not None and (block_n < 16 or block_n > 128 or block_n & (block_n - 1)):
            raise ValueError(f"impl='triton' needs block_n a power of two in [16, 128]; got {block_n}")
    if block_n is not None and block_n < 1:
        raise ValueError(f"block_n must be a positive integer; got {block_n}")
    if impl == "sdpa" and (accum != "fp32" or softcap > 0):
        raise ValueError("impl='sdpa' supports only accum='fp32' and softcap=0; use impl='triton' or 'torch'")
    return impl


def attention(q, k, v, accum="fp32", qk_norm=False, return_max_logit=False, *,
              scale=None, softcap=0.0, safemax_beta=2.0, impl="auto", block_n=None):
    """Causal multi-head attention. q, k, v: (batch, heads, time, head_dim), same dtype (bf16, fp16 or fp32; also
    float64 for impl="reference").
    Returns o (same shape and dtype as q), or (o, max_logit) with max_logit (batch, heads) float32 when asked.

    accum: streaming-softmax state precision, one of ACCUM_MODES. qk_norm: parameter-free RMS norm of q and k
    (scale unchanged, so |logit| <= scale * head_dim). softcap > 0: logits <- softcap * tanh(logits / softcap).
    max_logit: max over the unmasked logits entering the softmax (after scale, qk_norm, softcap); no gradient.
    impl: one of IMPLS ("reference" returns float64). block_n: key block size of the streaming loop.
    """
    impl = _validate(q, k, v, accum, impl, softcap, safemax_beta, block_n)
    scale = 1.0 / math.sqrt(q.shape[-1]) if scale is None else float(scale)
    if qk_norm:
        q, k = _rms_norm(q), _rms_norm(k)
    if impl == "reference":
        o, max_logit = _attn_reference(q, k, v, scale, softcap)
    elif impl == "sdpa":
        o = F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=scale)
        max_logit = _max_logit_chunked(q, k, scale) if return_max_logit else None
    else:
        o, _, row_max = torch.ops.qkguard.attn_fwd(q, k, v, scale, float(softcap), accum, float(safemax_beta),
                                                   impl, int(block_n or 0))
        max_logit = row_max.detach().amax(dim=-1)
    return (o, max_logit) if return_max_logit else o


# ----------------------------------------------------------------------------------------------------------------
# Command line: --check, the errors against float64 on this device.

def check():
    dev = "cuda" if torch.cuda.is_available() else "cpu"
    impls = (["triton"] if dev == "cuda" or _INTERPRET else []) + ["torch"]
    shapes = ([(4, 12, 1024, 64), (2, 16, 2048, 128), (2, 4, 1000, 64)] if dev == "cuda"
              else [(1, 2, 256, 64), (1, 2, 130, 32)])
    print(f"relative error vs float64 reference on {dev} (norm of difference / norm of reference)")
    print(f"{'B,H,T,D':>16} {'dtype':>9} {'impl':>7} {'accum':>13} {'o':>9} {'dq':>9} {'dk':>9} {'dv':>9}")
    for B, H, T, D in shapes:
        for dtype in (torch.bfloat16, torch.float32):
            q, k, v = (torch.randn(B, H, T, D, device=dev, dtype=dtype, requires_grad=True) for _ in range(3))
            do = torch.randn(B, H, T, D, device=dev, dtype=dtype)
            q64, k64, v64 = (x.detach().double().requires_grad_() for x in (q, k, v))   # float64 gradients too
            ref = attention(q64, k64, v64, impl="reference")
            ref_grads = torch.autograd.grad(ref, (q64, k64, v64), do.double())
            for impl in impls:
                for accum in ACCUM_MODES:
                    o = attention(q, k, v, accum=accum, impl=impl)
                    grads = torch.autograd.grad(o, (q, k, v), do)
                    errs = [((a.double() - b).norm() / b.norm()).item() for a, b in zip((o, *grads), (ref, *ref_grads))]
                    print(f"{str((B, H, T, D)):>16} {str(dtype)[6:]:>9} {impl:>7} {accum:>13} "
                          + " ".join(f"{e:9.2e}" for e in errs))


if __name__ == "__main__":
    if "--check" in sys.argv:
        check()
    else:
        print(__doc__)
