"""Causal flash attention with each bf16 rounding point a switch: the fault and its repairs.

The streaming softmax folds each key block into a running max m, a running sum l and an output
accumulator O. Qiu & Yao (arXiv 2510.04212, github.com/ucker/why-low-precision-training-fails) keep
all of it in bf16 and their training collapses; fp32 state repairs it. Each of their rounding points
is a switch here, r(x) meaning "round to bf16 (nearest even)". This table is the one full account
(README.md and run.py's --round help point here). The state and pv are rounded once per key block,
so block_n is part of the fault (BF16_STATE_BLOCK_N where unset):

  source    rounded to bf16 when on                                        switched by
  logits    S = r(r(q k^T) * scale), as out of a bf16 matmul; softcap c:   rounding=("logits", ...)
            S = r(c tanh(S / c))
  state     m = r(max(m_old, block row max, or its safe-max shift));       accum="bf16" or
            alpha = r(exp(r(m_old - m))); P = r(exp(r(S - m)));            "bf16-safemax"
            l = r(r(alpha l) + max(r(rowsum P), 1e-10)); O = r(r(alpha O) + PV); then o = r(O / l)
  pv        each key block's PV = r(P @ V) by itself, before it joins O:   rounding=("pv", ...)
            O = r(r(alpha O) + r(P V)) (O = alpha O + r(P V) in fp32 state)
  backward  lse = r(r(log l) + m); P = r(exp(r(S - lse))); dP = r(dO V^T);  rounding=("backward", ...)
            delta = r(rowsum(r(dO * O))); dS = r(r(P * scale) * r(dP - delta)) [softcap:
            r(dS (1 - tanh^2))]; dq, dk, dv summed as r(sum + r(tile's product)) once per
            BF16_BWD_BLOCK x BF16_BWD_BLOCK (64 x 64) tile. bf16 inputs only

accum="fp32" keeps the state in fp32 (the repair), "bf16" rounds it (the fault); "bf16-safemax" adds
the prior work's fix at the source: where a block's row max repeats (within 1e-3), shift by beta*max
so no P is 1 (capped at SAFEMAX_MAX_SHIFT = 16 above the max, or the tied entries underflow).
rounding=None: "logits" and "pv" for bf16 inputs (the prior work's kernel around its state, so "fp32"
and "bf16" differ only in it), else none; rounding=() is a standard flash kernel; adding "backward"
gives the prior work's bf16 backward (off by default: the forward's error is the subject). With every
source on, forward and backward agree bit for bit with a bf16 transcription of the prior work's
algorithm (test_numerics.py). train.py's --accum is accum; its --round auto is None, none is ().

Two implementations of one algorithm with the same rounding points, behind torch.library custom ops
(a model calling attention() compiles with fullgraph=True): the PyTorch twin, first below, is the
algorithm to read (CPU training, and the kernels' check); the Triton kernels do the same fast (CUDA,
or CPU tensors with TRITON_INTERPRET=1 set before import). "sdpa" (PyTorch's own) is for comparison.
`python -m lab.bench --only check` prints errors against float64 on this device (speed: lab/bench.py).
"""
import functools
import math
import os
from typing import Optional

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

ACCUM_MODES = ("fp32", "bf16", "bf16-safemax")   # the softmax state
ROUNDING_SOURCES = ("logits", "pv", "backward")   # the other rounding points, each on its own
DEFAULT_ROUNDING = ("logits", "pv")               # rounding=None with bf16 inputs
IMPLS = ("auto", "triton", "torch", "sdpa")
TRITON_HEAD_DIMS = (16, 32, 64, 128)
DTYPES = (torch.bfloat16, torch.float16, torch.float32)
# The key block where the state or pv is rounded, unless block_n says otherwise (an H200 emulation of
# the fault used 128; the prior work's model, 512 at context 1024). Elsewhere block_n is a speed choice
# (Triton: fwd_config) and changes only the summation order.
BF16_STATE_BLOCK_N = 128
# The bf16 backward's block: it rounds the dq sums once per key block, dk and dv per query block.
BF16_BWD_BLOCK = 64
# Safe-max: entries within SAFEMAX_TIE of the block max are ties (the prior work's 1e-3). A shift of
# beta*max leaves ties at p = exp(-(beta-1)*max), which underflows past max ~ 87/(beta-1), and the
# prior work's 1e-10 clamp of the block sum then replaces l: either wrecks the output. So the shift
# above the max is capped: exp(-16) = 1.1e-7 keeps the block sum far above the clamp and every entry
# within 20 of the max a normal float.
SAFEMAX_TIE = 1e-3
SAFEMAX_MAX_SHIFT = 16.0
_TIE, _MAX_SHIFT = tl.constexpr(SAFEMAX_TIE), tl.constexpr(SAFEMAX_MAX_SHIFT)  # the kernels' copies
# triton.jit picks the interpreter when the decorator runs, so this is read once, at import. The
# interpreter's tl.dot is wrong on bf16/fp16 operands (triton issue 11584): there _dot upcasts them.
INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"
_DOT_FP32 = tl.constexpr(INTERPRET)


# --------------------------------------------------------------------------------------------------
# The PyTorch twin: the algorithm vectorized over queries, looping over key blocks. Matmuls run in
# fp32 on upcast operands (exact products, as the tensor cores' fp32 accumulation).

def _round(x, dtype=torch.bfloat16):
    """r(x): round fp32 to bf16 (nearest even) and back; with the inputs' dtype, the matmul operand the
    kernel feeds."""
    return x.to(dtype).float()


def _no_round(x):   # a rounding point switched off
    return x


def _logits_torch(qk, scale, softcap, round_logits):
    """S = r(r(q k^T) * scale) [softcap: r(c tanh(S / c))], r if rounded; -> (S, tanh or None)."""
    round_s = _round if round_logits else _no_round
    s, t = round_s(round_s(qk) * scale), None
    if softcap > 0:   # t = tanh(s / c) as Triton can (no portable tl.tanh): saturates cleanly
        t = 1.0 - 2.0 / (torch.exp(2.0 * (s / softcap)) + 1.0)
        s = round_s(softcap * t)
    return s, t


def _safemax_shift_torch(s, block_max, beta):
    """Where the row's block max repeats (within SAFEMAX_TIE), shift by beta*block_max (> 0) or to 0
    (< 0), at most SAFEMAX_MAX_SHIFT above it, so no p is exactly 1: exact in real arithmetic (softmax
    is shift-invariant). No shift where the bf16 m cannot hold it within the cap (|max| past 2**12)."""
    tied = ((s >= (block_max - SAFEMAX_TIE)[..., None]).sum(-1) > 1) & (block_max > float("-inf"))
    shift = block_max + torch.where(block_max > 0, (beta - 1) * block_max, -block_max).clamp(max=SAFEMAX_MAX_SHIFT)
    return torch.where(tied & (_round(shift) <= block_max + SAFEMAX_MAX_SHIFT), shift, block_max)


@functools.lru_cache(maxsize=64)   # the same few blocks each layer and step; callers only read them
def _causal_mask(row0, row1, key0, key1, device):
    """(hidden, seen) for query rows row0..row1-1 and keys key0..key1-1: 0, 1 where row i sees key j
    (j <= i); -inf, 0 where not. The kernels' form is _causal_hide."""
    seen = (torch.arange(key0, key1, device=device)[None, :] <= torch.arange(row0, row1, device=device)[:, None])
    return seen.float().log(), seen.float()   # log(1) = 0, log(0) = -inf


def _exp_seen(x, seen, round_p):
    """round_p(exp(x)) where the row sees the key, else 0: exp of a logit masked to -inf, but no
    exp(-inf) (slow on a CPU, as are other underflows: lab/MEASUREMENTS.md, 2026-12-01, the CPU lab)."""
    return round_p(torch.exp(x * seen)) * seen


def _fwd_torch(q, k, v, scale, softcap, accum, rounding, beta, block_n):
    """Returns o (input dtype), lse and the row max logit (B, H, T) fp32."""
    B, H, T, D = q.shape
    state_bf16 = accum != "fp32"
    round_state = _round if state_bf16 else _no_round   # the state's rounding points
    round_pv = _round if "pv" in rounding else _no_round   # the block product's own rounding
    qf, kf, vf = q.float(), k.float(), v.float()
    m = torch.full((B, H, T), float("-inf"), device=q.device)   # running max (or safe-max shift)
    l = torch.zeros((B, H, T), device=q.device)                  # running sum of P
    acc = torch.zeros((B, H, T, D), device=q.device)             # running sum of P V
    top = torch.full((B, H, T), float("-inf"), device=q.device)  # true max logit (never the shift)
    for j in range(0, T, block_n):
        keys, rows = slice(j, min(j + block_n, T)), slice(j, T)     # rows < j see none of these
        hidden, seen = _causal_mask(j, T, j, keys.stop, q.device)
        s, _ = _logits_torch(qf[:, :, rows] @ kf[:, :, keys].mT, scale, softcap, "logits" in rounding)
        s_seen = s + hidden                                          # -inf past the row's last key
        block_max = s_seen.amax(-1)
        top[..., rows] = torch.maximum(top[..., rows], block_max)
        shift = _safemax_shift_torch(s_seen, block_max, beta) if accum == "bf16-safemax" else block_max
        m_old = m[..., rows]
        m_new = round_state(torch.maximum(m_old, shift))
        alpha = round_state(torch.exp(round_state(m_old - m_new)))
        p = _exp_seen(round_state(s - m_new[..., None]), seen, round_state)   # bf16 state: P = 1 at a repeated max
        block_sum = _round(p.sum(-1)).clamp_min(1e-10) if state_bf16 else p.sum(-1)
        l[..., rows] = round_state(round_state(alpha * l[..., rows]) + block_sum)
        pv = round_pv(_round(p, v.dtype) @ vf[:, :, keys])
        acc[..., rows, :] = round_state(round_state(acc[..., rows, :] * alpha[..., None]) + pv)
        m[..., rows] = m_new
    lse = _round(_round(torch.log(l)) + m) if "backward" in rounding else m + torch.log(l)
    return round_state(acc / l[..., None]).to(q.dtype), lse, top


def _bwd_torch(do, q, k, v, o, lse, scale, softcap, rounding, block_n):
    """Recompute S and P = exp(S - lse); dV = P^T dO; dS = P * (dO V^T - delta); dQ = dS K scale;
    dK = dS^T Q scale. delta = rowsum(dO * O) of the stored o: in bf16 modes the biased O enters the
    gradient here. "backward" on: the module docstring's r() points, tiles summed in the order the
    Triton kernels loop (dq over key blocks, dk and dv over query blocks)."""
    T, dtype = q.shape[2], q.dtype
    bf16 = "backward" in rounding
    r = _round if bf16 else _no_round
    block_m, block_n = (BF16_BWD_BLOCK, BF16_BWD_BLOCK) if bf16 else (T, block_n)   # fp32: all rows at once
    qf, kf, vf, dof = q.float(), k.float(), v.float(), do.float()
    delta = r(r(dof * o.float()).sum(-1))
    dq = torch.zeros(qf.shape, device=q.device)
    # fp32: one tile per key block lands on dk, dv; -0.0 + x is x bit for bit (+0.0 + -0.0 is not)
    dk, dv = (torch.full(qf.shape, 0.0 if bf16 else -0.0, device=q.device) for _ in range(2))
    for j in range(0, T, block_n):
        keys = slice(j, min(j + block_n, T))
        for i in range(j, T, block_m):                 # the query blocks that see key block j
            rows = slice(i, min(i + block_m, T))
            s, t = _logits_torch(qf[:, :, rows] @ kf[:, :, keys].mT, scale, softcap, "logits" in rounding)
            p = _exp_seen(r(s - lse[..., rows, None]), _causal_mask(i, rows.stop, j, keys.stop, q.device)[1], r)
            dv[:, :, keys] = r(dv[:, :, keys] + r(_round(p, dtype).mT @ dof[:, :, rows]))
            dp = r(dof[:, :, rows] @ vf[:, :, keys].mT)
            # the prior work's order puts the scale inside dS
            ds = r(r(p * scale) * r(dp - delta[..., rows, None])) if bf16 else p * (dp - delta[..., rows, None])
            if softcap > 0:
                ds = r(ds * (1.0 - t * t))
            ds = _round(ds, dtype)
            dq[:, :, rows] = r(dq[:, :, rows] + r(ds @ kf[:, :, keys]))
            dk[:, :, keys] = r(dk[:, :, keys] + r(ds.mT @ qf[:, :, rows]))
    if not bf16:
        dq, dk = dq * scale, dk * scale
    return dq.to(dtype), dk.to(dtype), dv.to(dtype)


# --------------------------------------------------------------------------------------------------
# The same algorithm as Triton kernels, one program per (query or key block, batch*head). A call's
# (B, H, T, D) tensors share a layout, passed as (batch, head, time) strides (head_dim unit-stride):
# the model's transposed views as they are. Key blocks left of the diagonal skip the causal mask.
# The switches (kernel_flags) are constexpr, so each combination compiles to its own kernel.

@triton.jit
def _r(x, ON: tl.constexpr = True):
    # r(x), or x where this rounding source is off. Integer ops: the interpreter's float cast truncates,
    # so x.to(tl.bfloat16) would differ between CPU and GPU. Exact for +-inf; NaN is not expected.
    if ON:
        bits = x.to(tl.int32, bitcast=True)
        bits = (bits + 0x7FFF + ((bits >> 16) & 1)) & -65536
        x = bits.to(tl.float32, bitcast=True)
    return x


@triton.jit
def _cast(x, P):
    # fp32 x to P's element type (the input dtype). bf16 is rounded first, so the cast is exact and
    # the interpreter (which truncates) agrees with the GPU.
    return _r(x, P.dtype.element_ty == tl.bfloat16).to(P.dtype.element_ty)


@triton.jit
def _tile(H, T, stride_b, stride_h, stride_t, BLOCK: tl.constexpr, HEAD_DIM: tl.constexpr):
    # This program's BLOCK time rows of head (b, h) = divmod(program_id(1), H): the rows, the head's
    # element offset, the rows' (BLOCK, HEAD_DIM) element offsets in the head, and the head's offset
    # in the contiguous (B, H, T) lse, row max and delta; in int64: B * H * T * D may pass 2**31.
    bh = tl.program_id(1)
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    head = (bh // H).to(tl.int64) * stride_b + (bh % H).to(tl.int64) * stride_h
    tile = head + _rows(offs, stride_t)[:, None] + tl.arange(0, HEAD_DIM)[None, :]
    return offs, head, tile, bh.to(tl.int64) * T


@triton.jit
def _rows(offs, stride_t):
    # Element offsets of time rows, in int64: T * stride_t (n_embd in the model) may pass 2**31.
    return offs.to(tl.int64) * stride_t


@triton.jit
def _load_block(ptrs, in_range, MASK: tl.constexpr):
    # A diagonal key block may run past T: mask it. Those left of it (most loads) lie below T.
    return tl.load(ptrs, mask=in_range, other=0.0) if MASK else tl.load(ptrs)


@triton.jit
def _causal_hide(s, keys, rows):
    # _causal_mask's in-kernel form (a kernel cannot call torch): -inf where a key is past the row.
    return tl.where(keys <= rows, s, float("-inf"))


@triton.jit
def _dot(a, b, acc):
    # acc + a @ b, accumulated in fp32 (_DOT_FP32: upcast for the interpreter). Operands are the input
    # dtype; fp32 ones get IEEE products (TF32 on the GPU would break a 1e-4 tolerance).
    if _DOT_FP32:
        a, b = a.to(tl.float32), b.to(tl.float32)
    return tl.dot(a, b, acc, input_precision="ieee") if a.dtype == tl.float32 else tl.dot(a, b, acc)


@triton.jit
def _mm(a, b):
    return _dot(a, b, tl.zeros([a.shape[0], b.shape[1]], tl.float32))


@triton.jit
def _logits(qk, scale, softcap, ROUND_LOGITS: tl.constexpr, SOFTCAP: tl.constexpr):
    # As _logits_torch: S = r(r(q k^T) * scale) [softcap: r(c tanh(S / c))]; tanh for the backward.
    s = _r(_r(qk, ROUND_LOGITS) * scale, ROUND_LOGITS)
    t = s
    if SOFTCAP:
        t = 1.0 - 2.0 / (tl.exp(2.0 * (s / softcap)) + 1.0)   # tanh(s / c), as in _logits_torch
        s = _r(softcap * t, ROUND_LOGITS)
    return s, t


@triton.jit
def _fwd_block(q, K, V, start_n, offs_m, m_i, l_i, acc, top, stride_t, scale, softcap, beta, T,
               HEAD_DIM: tl.constexpr, BLOCK_N: tl.constexpr, BF16_STATE: tl.constexpr, SAFEMAX: tl.constexpr,
               ROUND_LOGITS: tl.constexpr, ROUND_PV: tl.constexpr, SOFTCAP: tl.constexpr, CAUSAL_MASK: tl.constexpr):
    # One streaming-softmax step (_fwd_torch's loop body): fold key block start_n into (m, l, acc).
    offs_n = start_n + tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, HEAD_DIM)
    kT = _load_block(K + _rows(offs_n, stride_t)[None, :] + offs_d[:, None], offs_n[None, :] < T, CAUSAL_MASK)
    v = _load_block(V + _rows(offs_n, stride_t)[:, None] + offs_d[None, :], offs_n[:, None] < T, CAUSAL_MASK)
    s, t = _logits(_mm(q, kT), scale, softcap, ROUND_LOGITS, SOFTCAP)
    if CAUSAL_MASK:   # for a valid row this also hides keys past T (key <= row < T)
        s = _causal_hide(s, offs_n[None, :], offs_m[:, None])

    block_max = tl.max(s, 1)
    top = tl.maximum(top, block_max)   # the true max logit (never the shift)
    shift = block_max
    if SAFEMAX:   # as _safemax_shift_torch; a row that sees none of these keys (max -inf) stays a no-op
        tied = (tl.sum((s >= (block_max - _TIE)[:, None]).to(tl.int32), 1) > 1) & (block_max > float("-inf"))
        shift = block_max + tl.minimum(tl.where(block_max > 0, (beta - 1.0) * block_max, -block_max), _MAX_SHIFT)
        shift = tl.where(tied & (_r(shift) <= block_max + _MAX_SHIFT), shift, block_max)
    m_new = _r(tl.maximum(m_i, shift), BF16_STATE)
    alpha = _r(tl.exp(_r(m_i - m_new, BF16_STATE)), BF16_STATE)   # rescales l and acc
    p = _r(tl.exp(_r(s - m_new[:, None], BF16_STATE)), BF16_STATE)
    block_sum = tl.sum(p, 1)
    if BF16_STATE:   # clamped where the row sees the block (elsewhere the step must stay a no-op)
        block_sum = _r(block_sum)
        block_sum = tl.where(block_max > float("-inf"), tl.maximum(block_sum, 1e-10), block_sum)
    l_i = _r(_r(l_i * alpha, BF16_STATE) + block_sum, BF16_STATE)
    if BF16_STATE or ROUND_PV:
        pv = _mm(_cast(p, V), v)
        acc = _r(_r(acc * alpha[:, None], BF16_STATE) + _r(pv, ROUND_PV), BF16_STATE)
    else:            # a standard fp32-state kernel: P V accumulates straight into acc
        acc = _dot(_cast(p, V), v, acc * alpha[:, None])
    return m_new, l_i, acc, top


@triton.jit
def attn_fwd(Q, K, V, O, LSE, ROWMAX, stride_b, stride_h, stride_t, H, T, scale, softcap, beta,
             HEAD_DIM: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BF16_STATE: tl.constexpr,
             SAFEMAX: tl.constexpr, ROUND_LOGITS: tl.constexpr, ROUND_PV: tl.constexpr, BWD_BF16: tl.constexpr,
             SOFTCAP: tl.constexpr):
    # One query block per program: fold in the key blocks it sees, then store o, lse, the row max.
    offs_m, head, ptrs, stats = _tile(H, T, stride_b, stride_h, stride_t, BLOCK_M, HEAD_DIM)
    K, V = K + head, V + head
    q = tl.load(Q + ptrs, mask=offs_m[:, None] < T, other=0.0)

    # Streaming state per query row. Rows past T are computed on zeros and never stored.
    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, HEAD_DIM], tl.float32)
    top = tl.full([BLOCK_M], float("-inf"), tl.float32)

    # Causal: key blocks from key 0 to this query block's end, masked on the diagonal only. Each row
    # sees key 0, so m_i is finite after the first block; a later block a row cannot see is a no-op.
    diag = tl.program_id(0) * BLOCK_M // BLOCK_N * BLOCK_N
    for start_n in range(0, diag, BLOCK_N):
        m_i, l_i, acc, top = _fwd_block(q, K, V, start_n, offs_m, m_i, l_i, acc, top, stride_t, scale, softcap,
                                        beta, T, HEAD_DIM, BLOCK_N, BF16_STATE, SAFEMAX, ROUND_LOGITS, ROUND_PV,
                                        SOFTCAP, CAUSAL_MASK=False)
    for start_n in range(diag, (tl.program_id(0) + 1) * BLOCK_M, BLOCK_N):
        m_i, l_i, acc, top = _fwd_block(q, K, V, start_n, offs_m, m_i, l_i, acc, top, stride_t, scale, softcap,
                                        beta, T, HEAD_DIM, BLOCK_N, BF16_STATE, SAFEMAX, ROUND_LOGITS, ROUND_PV,
                                        SOFTCAP, CAUSAL_MASK=True)

    o = _r(acc / l_i[:, None], BF16_STATE)    # the O that the backward's delta sees
    lse = _r(_r(tl.log(l_i)) + m_i) if BWD_BF16 else m_i + tl.log(l_i)
    row_ok = offs_m < T
    tl.store(O + ptrs, _cast(o, O), mask=row_ok[:, None])
    tl.store(LSE + stats + offs_m, lse, mask=row_ok)
    tl.store(ROWMAX + stats + offs_m, top, mask=row_ok)


@triton.jit
def attn_bwd_delta(O, DO, DELTA, stride_b, stride_h, stride_t, H, T, HEAD_DIM: tl.constexpr,
                   BLOCK_M: tl.constexpr, BWD_BF16: tl.constexpr):
    # delta = rowsum(dO * O) of the stored O: biased in bf16 modes, as in the prior work.
    offs_m, _, ptrs, stats = _tile(H, T, stride_b, stride_h, stride_t, BLOCK_M, HEAD_DIM)
    o = tl.load(O + ptrs, mask=offs_m[:, None] < T, other=0.0).to(tl.float32)
    do = tl.load(DO + ptrs, mask=offs_m[:, None] < T, other=0.0).to(tl.float32)
    delta = _r(tl.sum(_r(o * do, BWD_BF16), 1), BWD_BF16)
    tl.store(DELTA + stats + offs_m, delta, mask=offs_m < T)


@triton.jit
def _ds(p, dp, delta, t, scale, SOFTCAP: tl.constexpr, BWD_BF16: tl.constexpr):
    # dS = P * (dP - delta) [* (1 - tanh^2)]; the bf16 backward rounds each product, scale inside.
    ds = _r(_r(p * scale) * _r(dp - delta)) if BWD_BF16 else p * (dp - delta)
    if SOFTCAP:
        ds = _r(ds * (1.0 - t * t), BWD_BF16)
    return ds


@triton.jit
def _add_tile(acc, a, b, BWD_BF16: tl.constexpr):
    # acc + a @ b: accumulated in fp32, or (bf16 backward) r(acc + r(a @ b)) once per tile.
    return _r(acc + _r(_mm(a, b))) if BWD_BF16 else _dot(a, b, acc)


@triton.jit
def _dkdv_block(k, v, dk, dv, Q, DO, LSE, DELTA, start_m, offs_n, stride_t, scale, softcap, T,
                HEAD_DIM: tl.constexpr, BLOCK_M: tl.constexpr, ROUND_LOGITS: tl.constexpr, BWD_BF16: tl.constexpr,
                SOFTCAP: tl.constexpr, CAUSAL_MASK: tl.constexpr):
    # Add query block start_m's share to dk and dv, computed transposed (keys x queries).
    offs_m = start_m + tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, HEAD_DIM)
    row_ok = offs_m < T
    qT = tl.load(Q + _rows(offs_m, stride_t)[None, :] + offs_d[:, None], mask=row_ok[None, :], other=0.0)
    do = tl.load(DO + _rows(offs_m, stride_t)[:, None] + offs_d[None, :], mask=row_ok[:, None], other=0.0)
    lse = tl.load(LSE + offs_m, mask=row_ok, other=float("inf"))   # rows past T: p = 0
    delta = tl.load(DELTA + offs_m, mask=row_ok, other=0.0)
    sT, tT = _logits(_mm(k, qT), scale, softcap, ROUND_LOGITS, SOFTCAP)
    if CAUSAL_MASK:
        sT = _causal_hide(sT, offs_n[:, None], offs_m[None, :])
    pT = _r(tl.exp(_r(sT - lse[None, :], BWD_BF16)), BWD_BF16)
    dv = _add_tile(dv, _cast(pT, DO), do, BWD_BF16)
    dpT = _r(_mm(v, tl.trans(do)), BWD_BF16)
    dsT = _ds(pT, dpT, delta[None, :], tT, scale, SOFTCAP, BWD_BF16)
    dk = _add_tile(dk, _cast(dsT, Q), tl.trans(qT), BWD_BF16)
    return dk, dv


@triton.jit
def attn_bwd_dkdv(Q, K, V, DO, LSE, DELTA, DK, DV, stride_b, stride_h, stride_t, H, T, scale, softcap,
                  HEAD_DIM: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                  ROUND_LOGITS: tl.constexpr, BWD_BF16: tl.constexpr, SOFTCAP: tl.constexpr):
    # One key block per program, dk and dv in registers; loop over the query blocks that see it.
    offs_n, head, kv_ptrs, stats = _tile(H, T, stride_b, stride_h, stride_t, BLOCK_N, HEAD_DIM)
    Q, DO, LSE, DELTA = Q + head, DO + head, LSE + stats, DELTA + stats
    k = tl.load(K + kv_ptrs, mask=offs_n[:, None] < T, other=0.0)
    v = tl.load(V + kv_ptrs, mask=offs_n[:, None] < T, other=0.0)
    dk, dv = tl.zeros([BLOCK_N, HEAD_DIM], tl.float32), tl.zeros([BLOCK_N, HEAD_DIM], tl.float32)

    start_n = tl.program_id(0) * BLOCK_N
    lo = start_n // BLOCK_M * BLOCK_M                                  # earlier queries see none
    full = (start_n + BLOCK_N + BLOCK_M - 1) // BLOCK_M * BLOCK_M      # later queries see them all
    for start_m in range(lo, full, BLOCK_M):
        dk, dv = _dkdv_block(k, v, dk, dv, Q, DO, LSE, DELTA, start_m, offs_n, stride_t, scale, softcap, T,
                             HEAD_DIM, BLOCK_M, ROUND_LOGITS, BWD_BF16, SOFTCAP, CAUSAL_MASK=True)
    for start_m in range(full, T, BLOCK_M):
        dk, dv = _dkdv_block(k, v, dk, dv, Q, DO, LSE, DELTA, start_m, offs_n, stride_t, scale, softcap, T,
                             HEAD_DIM, BLOCK_M, ROUND_LOGITS, BWD_BF16, SOFTCAP, CAUSAL_MASK=False)

    if not BWD_BF16:      # the bf16 backward has the scale inside dS
        dk = dk * scale
    tl.store(DK + kv_ptrs, _cast(dk, DK), mask=offs_n[:, None] < T)
    tl.store(DV + kv_ptrs, _cast(dv, DV), mask=offs_n[:, None] < T)


@triton.jit
def _dq_block(q, do, lse, delta, dq, K, V, start_n, offs_m, stride_t, scale, softcap, T,
              HEAD_DIM: tl.constexpr, BLOCK_N: tl.constexpr, ROUND_LOGITS: tl.constexpr, BWD_BF16: tl.constexpr,
              SOFTCAP: tl.constexpr, CAUSAL_MASK: tl.constexpr):
    # Add key block start_n's share to dq.
    offs_n = start_n + tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, HEAD_DIM)
    kT_offs = _rows(offs_n, stride_t)[None, :] + offs_d[:, None]
    kT = _load_block(K + kT_offs, offs_n[None, :] < T, CAUSAL_MASK)
    vT = _load_block(V + kT_offs, offs_n[None, :] < T, CAUSAL_MASK)
    s, t = _logits(_mm(q, kT), scale, softcap, ROUND_LOGITS, SOFTCAP)
    if CAUSAL_MASK:
        s = _causal_hide(s, offs_n[None, :], offs_m[:, None])
    p = _r(tl.exp(_r(s - lse[:, None], BWD_BF16)), BWD_BF16)
    dp = _r(_mm(do, vT), BWD_BF16)
    ds = _ds(p, dp, delta[:, None], t, scale, SOFTCAP, BWD_BF16)
    return _add_tile(dq, _cast(ds, K), tl.trans(kT), BWD_BF16)


@triton.jit
def attn_bwd_dq(Q, K, V, DO, LSE, DELTA, DQ, stride_b, stride_h, stride_t, H, T, scale, softcap,
                HEAD_DIM: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                ROUND_LOGITS: tl.constexpr, BWD_BF16: tl.constexpr, SOFTCAP: tl.constexpr):
    # One query block per program, looping over the key blocks it sees as the forward does.
    offs_m, head, q_ptrs, stats = _tile(H, T, stride_b, stride_h, stride_t, BLOCK_M, HEAD_DIM)
    K, V = K + head, V + head
    q = tl.load(Q + q_ptrs, mask=offs_m[:, None] < T, other=0.0)
    do = tl.load(DO + q_ptrs, mask=offs_m[:, None] < T, other=0.0)
    lse = tl.load(LSE + stats + offs_m, mask=offs_m < T, other=float("inf"))
    delta = tl.load(DELTA + stats + offs_m, mask=offs_m < T, other=0.0)
    dq = tl.zeros([BLOCK_M, HEAD_DIM], tl.float32)

    diag = tl.program_id(0) * BLOCK_M // BLOCK_N * BLOCK_N
    for start_n in range(0, diag, BLOCK_N):
        dq = _dq_block(q, do, lse, delta, dq, K, V, start_n, offs_m, stride_t, scale, softcap, T,
                       HEAD_DIM, BLOCK_N, ROUND_LOGITS, BWD_BF16, SOFTCAP, CAUSAL_MASK=False)
    for start_n in range(diag, (tl.program_id(0) + 1) * BLOCK_M, BLOCK_N):
        dq = _dq_block(q, do, lse, delta, dq, K, V, start_n, offs_m, stride_t, scale, softcap, T,
                       HEAD_DIM, BLOCK_N, ROUND_LOGITS, BWD_BF16, SOFTCAP, CAUSAL_MASK=True)

    if not BWD_BF16:
        dq = dq * scale
    tl.store(DQ + q_ptrs, _cast(dq, DQ), mask=offs_m[:, None] < T)


# --------------------------------------------------------------------------------------------------
# Launch configurations (BLOCK_M, BLOCK_N, num_warps, num_stages) for an H100/H200, chosen from
# sm_90 compiles to avoid register spills (lab/MEASUREMENTS.md). `python -m lab.bench --only resources`
# prints registers, spills and shared memory; `--only tune` times other configurations on a GPU.

def fwd_config(D, dtype, block_n, accum, rounding):
    es = torch.empty((), dtype=dtype).element_size()
    rounded = accum != "fp32" or "pv" in rounding   # something is rounded once per key block
    if block_n is None:   # part of the fault's definition where rounded, else a speed choice
        block_n = BF16_STATE_BLOCK_N if rounded else (32 if es == 4 else 64)
    if es == 4:
        # fp32 inputs: IEEE dots on the FMA units, operands in registers; larger tiles spill tens of
        # KB per thread (`python -m lab.bench --only resources --dtype fp32`).
        if rounded:      # a second tile (the separate P V), shared by 16 warps
            return 32 if D <= 64 else 16, block_n, 16 if block_n >= 128 else 8, 1
        block_m = 16 if D > 64 else max(16, min(64, 2048 // block_n))
        return block_m, block_n, 16 if D > 64 and block_n >= 128 else 8, 1
    # A thread's registers grow with the S tile (BLOCK_M x BLOCK_N) and accumulator (BLOCK_M x D);
    # the rounded modes add a P V tile: 4 warps spill there (3 KB per thread at D=64), 8 do not.
    block_m = 128 if not rounded or D <= 64 else 64
    warps = 4 if not rounded and block_m * (block_n + D) <= 128 * 128 else 8
    # Each pipeline stage holds a K and a V tile: well inside the 227 KB of shared memory per SM.
    stages = max(1, min(3, (160 * 1024 - block_m * D * es) // (2 * block_n * D * es)))
    return block_m, block_n, warps, stages


def bwd_configs(D, dtype, rounding=()):
    """The dk/dv kernel's configuration, then the dq kernel's."""
    config = (64, 64, 8 if D >= 128 else 4, 2)
    if "backward" in rounding:     # the bf16 sums are rounded once per tile: the tile is fixed
        config = (BF16_BWD_BLOCK, BF16_BWD_BLOCK, 8 if D >= 128 else 4, 1)
    elif dtype == torch.float32:   # IEEE dots on the FMA units, as in fwd_config
        config = (16, 32, 8, 1)
    return config, config


def kernel_flags(accum, rounding, softcap):
    """The kernels' constexpr switches; each kernel takes those among them it has."""
    return dict(BF16_STATE=accum != "fp32", SAFEMAX=accum == "bf16-safemax", ROUND_LOGITS="logits" in rounding,
                ROUND_PV="pv" in rounding, BWD_BF16="backward" in rounding, SOFTCAP=softcap > 0)


def launch(kernel, config, tensors, scalars, flags):
    """Runs one of the kernels with config on tensors (the first (B, H, T, D); every such one shares
    its layout): a program per query block (per key block for dk, dv) and head. The tuner times it."""
    B, H, T, D = tensors[0].shape
    block_m, block_n, warps, stages = config
    constexprs = dict(HEAD_DIM=D, BLOCK_M=block_m, BLOCK_N=block_n, **flags)
    kernel[(triton.cdiv(T, block_n if kernel is attn_bwd_dkdv else block_m), B * H)](
        *tensors, *tensors[0].stride()[:3], H, T, *scalars, num_warps=warps, num_stages=stages,
        **{name: x for name, x in constexprs.items() if name in kernel.arg_names})


def bwd_delta(o, do, rounding):
    delta = new_buffer(o.shape[:3], torch.float32, o.device)
    # 4 warps, 3 stages: what Triton defaults to (BLOCK_N unused)
    launch(attn_bwd_delta, (64, 64, 4, 3), (o, do, delta), (), kernel_flags("fp32", rounding, 0.0))
    return delta


# --------------------------------------------------------------------------------------------------
# Buffers, and the custom ops: opaque to torch.compile (no graph break), with fakes and a backward.

def new_buffer(shape, dtype, device):
    """Allocates every buffer the kernels write (lse, row_max, delta; o, dq, dk, dv via new_like).
    Tests replace it (and new_like) with one that fills NaN, so an element left unwritten shows."""
    return torch.empty(shape, dtype=dtype, device=device)


def new_like(q):
    """A (B, H, T, D) buffer in the layout o, dq, dk, dv (and k, v, do) share with q: q's strides if
    q is dense with unit-stride head_dim (the model's (B, T, H, D).transpose(1, 2) views: no copy),
    else contiguous. The fakes use it too, so torch.compile sees the strides the kernels write."""
    if q.stride(-1) != 1:
        return new_buffer(q.shape, q.dtype, q.device)
    return torch.empty_like(q)       # keeps a dense tensor's strides


def _in_layout(like, *xs):
    """xs with like's strides (the kernels take one set of strides): copies only where unlike."""
    return [x if x.stride() == like.stride() else torch.empty_like(like).copy_(x) for x in xs]


def _no_autocast(x):
    """A caller's autocast stays on inside a custom op: it would run the twin's fp32 matmuls in bf16
    and move its rounding points (every state would then see bf16 logits)."""
    return torch.autocast(x.device.type, enabled=False)


@torch.library.custom_op("qkguard::attn_fwd", mutates_args=())
def _attn_fwd_op(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float, softcap: float, accum: str,
                 rounding: str, beta: float, impl: str,
                 block_n: Optional[int]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    o = new_like(q)
    q, k, v = _in_layout(o, q, k, v)
    sources = tuple(rounding.split(",")) if rounding else ()   # joined: a schema has no tuple of str
    if impl == "triton":   # o in q's layout, as are k and v; lse and the row max logit (B, H, T) fp32
        lse, row_max = (new_buffer(q.shape[:3], torch.float32, q.device) for _ in range(2))
        launch(attn_fwd, fwd_config(q.shape[3], q.dtype, block_n, accum, sources), (q, k, v, o, lse, row_max),
               (scale, softcap, beta), kernel_flags(accum, sources, softcap))
        return o, lse, row_max
    with _no_autocast(q):   # the twin always has a key block
        out, lse, row_max = _fwd_torch(q, k, v, scale, softcap, accum, sources, beta, block_n or BF16_STATE_BLOCK_N)
    return o.copy_(out), lse, row_max


@_attn_fwd_op.register_fake
def _(q, k, v, scale, softcap, accum, rounding, beta, impl, block_n):
    return new_like(q), *(q.new_empty(q.shape[:3], dtype=torch.float32) for _ in range(2))   # o, lse, row max


@torch.library.custom_op("qkguard::attn_bwd", mutates_args=())
def _attn_bwd_op(do: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, o: torch.Tensor,
                 lse: torch.Tensor, scale: float, softcap: float, rounding: str, impl: str,
                 block_n: Optional[int]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    dq, dk, dv = (new_like(q) for _ in range(3))
    do, q, k, v, o = _in_layout(dq, do, q, k, v, o)
    sources = tuple(rounding.split(",")) if rounding else ()
    if impl == "triton":
        delta = bwd_delta(o, do, sources)
        dkdv_config, dq_config = bwd_configs(q.shape[3], q.dtype, sources)
        flags = kernel_flags("fp32", sources, softcap)    # the state's rounding is the forward's alone
        launch(attn_bwd_dkdv, dkdv_config, (q, k, v, do, lse, delta, dk, dv), (scale, softcap), flags)
        launch(attn_bwd_dq, dq_config, (q, k, v, do, lse, delta, dq), (scale, softcap), flags)
        return dq, dk, dv
    with _no_autocast(q):
        grads = _bwd_torch(do, q, k, v, o, lse, scale, softcap, sources, block_n or BF16_STATE_BLOCK_N)
    return tuple(buffer.copy_(g) for buffer, g in zip((dq, dk, dv), grads))


@_attn_bwd_op.register_fake
def _(do, q, k, v, o, lse, scale, softcap, rounding, impl, block_n):
    return new_like(q), new_like(q), new_like(q)


def _setup_context(ctx, inputs, output):
    q, k, v, scale, softcap, accum, rounding, beta, impl, block_n = inputs
    ctx.save_for_backward(q, k, v, *output[:2])                      # o, lse
    ctx.args = (scale, softcap, rounding, impl, block_n)
    ctx.mark_non_differentiable(*output[1:])                         # lse, row max


def _backward(ctx, do, _dlse, _drow_max):
    q, k, v, o, lse = ctx.saved_tensors
    dq, dk, dv = torch.ops.qkguard.attn_bwd(do, q, k, v, o, lse, *ctx.args)
    return dq, dk, dv, None, None, None, None, None, None, None


_attn_fwd_op.register_autograd(_backward, setup_context=_setup_context)


# --------------------------------------------------------------------------------------------------
# Comparison implementations and the public entry point.

@torch.no_grad()
def _max_logit_chunked(q, k, scale, chunk=256):
    T = q.shape[2]
    best = torch.full(q.shape[:2], float("-inf"), device=q.device)
    for i in range(0, T, chunk):
        j = min(i + chunk, T)
        with _no_autocast(q):
            s = q[:, :, i:j].float() @ k[:, :, :j].float().mT * scale
        s = s.masked_fill(_causal_mask(i, j, 0, j, q.device)[1] == 0, float("-inf"))
        best = torch.maximum(best, s.amax(dim=(-2, -1)))
    return best


def _rms_norm(x, eps=1e-6):
    """Parameter-free RMS norm over head_dim in fp32 (float64 stays): |q.k| <= head_dim after it."""
    xf = x.to(torch.promote_types(x.dtype, torch.float32))
    return (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype)


def _checked(q, k, v, accum, impl, softcap, safemax_beta, block_n, rounding):
    """(impl, rounding) resolved ("auto": Triton on CUDA, else the twin), or a ValueError: what to do."""
    if isinstance(rounding, str):
        raise ValueError(f"rounding={rounding!r}: give a tuple of sources such as ('logits', 'pv'), () or None")
    unknown = [s for s in rounding or () if s not in ROUNDING_SOURCES]
    if rounding is None:
        rounding = DEFAULT_ROUNDING if q.dtype == torch.bfloat16 and impl != "sdpa" else ()
    rounding = tuple(s for s in ROUNDING_SOURCES if s in rounding)     # one canonical order
    resolved = ("triton" if q.is_cuda else "torch") if impl == "auto" else impl
    on_triton, D = resolved == "triton", q.shape[-1]
    for refused, why in (   # the first that applies is said
            (unknown, f"unknown rounding source {', '.join(map(repr, unknown))}; use some of {ROUNDING_SOURCES}, "
             "or () for none"),
            (accum not in ACCUM_MODES, f"unknown accum={accum!r}; use one of {ACCUM_MODES}"),
            (impl not in IMPLS, f"unknown impl={impl!r}; use one of {IMPLS}"),
            (q.dim() != 4 or q.shape != k.shape or q.shape != v.shape or q.shape[2] < 1,
             f"q, k, v must be 4-D (batch, heads, time, head_dim) of one shape, time >= 1; got "
             f"{tuple(q.shape)}, {tuple(k.shape)}, {tuple(v.shape)}"),
            (q.dtype not in DTYPES or k.dtype != q.dtype or v.dtype != q.dtype,
             f"q, k, v must share one dtype among {DTYPES}; got {q.dtype}, {k.dtype}, {v.dtype}"),
            (not softcap >= 0 or math.isinf(softcap), f"softcap must be finite and >= 0 (0 = off); got {softcap}"),
            (accum == "bf16-safemax" and not (safemax_beta > 1 and math.isfinite(safemax_beta)),
             f"safemax_beta must be finite and > 1 (the prior work uses 2..8); got {safemax_beta}"),
            ("backward" in rounding and q.dtype != torch.bfloat16,
             f"rounding 'backward' is the prior work's bf16 backward: it needs bf16 inputs; got {q.dtype}"),
            (on_triton and D not in TRITON_HEAD_DIMS,
             f"impl='triton' needs head_dim in {TRITON_HEAD_DIMS}; got {D}. Use impl='torch' for other sizes."),
            (on_triton and not q.is_cuda and not INTERPRET, "impl='triton' on CPU tensors needs TRITON_INTERPRET=1 "
             "in the environment before attention_kernel is imported; or use impl='torch'"),
            (on_triton and block_n is not None and (block_n < 16 or block_n > 128 or block_n & (block_n - 1)),
             f"impl='triton' needs block_n a power of two in [16, 128]; got {block_n}"),
            (block_n is not None and block_n < 1, f"block_n must be a positive integer; got {block_n}"),
            (resolved == "sdpa" and (accum != "fp32" or softcap > 0 or rounding), "impl='sdpa' supports only "
             "accum='fp32', no rounding sources and no softcap; use impl='triton' or 'torch'")):
        if refused:
            raise ValueError(why)
    return resolved, rounding


def attention(q, k, v, accum="fp32", qk_norm=False, return_max_logit=False, *, scale=None, softcap=0.0,
              safemax_beta=2.0, impl="auto", block_n=None, rounding=None):
    """Causal multi-head attention. q, k, v: (batch, heads, time, head_dim), one dtype (bf16,
    fp16, fp32). Returns o (q's shape and dtype), or (o, max_logit): (batch, heads) float32, the
    max of the logits entering the softmax, no gradient. accum, rounding, block_n: the module
    docstring; impl: one of IMPLS. qk_norm: parameter-free RMS norm of q and k (scale unchanged,
    so |logit| <= scale * head_dim). softcap > 0: logits <- softcap * tanh(logits / softcap).
    """
    impl, rounding = _checked(q, k, v, accum, impl, softcap, safemax_beta, block_n, rounding)
    scale = 1.0 / math.sqrt(q.shape[-1]) if scale is None else float(scale)
    if qk_norm:
        q, k = _rms_norm(q), _rms_norm(k)
    if impl == "sdpa":
        o = F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=scale)
        max_logit = _max_logit_chunked(q, k, scale) if return_max_logit else None
    else:
        o, _, row_max = torch.ops.qkguard.attn_fwd(q, k, v, scale, float(softcap), accum, ",".join(rounding),
                                                   float(safemax_beta), impl, block_n)
        max_logit = row_max.detach().amax(dim=-1)
    return (o, max_logit) if return_max_logit else o
