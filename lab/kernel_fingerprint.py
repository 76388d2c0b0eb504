"""A bit-for-bit fingerprint of every path through attention_kernel.py, for refactoring the kernel.

    python -m lab.kernel_fingerprint > after.txt                 # this tree's kernel
    python -m lab.kernel_fingerprint --tree OLD_CHECKOUT > before.txt && diff before.txt after.txt

Each case (impl torch or triton, softmax state, rounding sources, softcap, QK-norm, block sizes, dtypes,
strided inputs, the assay's delta error through lab/assay.py's wrapper of the kernel's ops, logits so far
apart that P underflows, uneven Triton tiles) runs on fixed-seed inputs; one sha256 over its forward
output, max logit and dq, dk, dv is printed, then one over all. Triton runs in its interpreter (TRITON_INTERPRET=1, set here), so this checks the kernels' arithmetic
on a CPU, not the GPU's. Two trees agree bit for bit when every line does; a refactor that changes one
rounding or one signed zero changes its case's line.
"""
import argparse
import hashlib
import inspect
import os
import sys
import time

os.environ["TRITON_INTERPRET"] = "1"

import torch  # noqa: E402

BF16, FP16, FP32 = torch.bfloat16, torch.float16, torch.float32
ALL = ("logits", "pv", "backward")
ak = None   # attention_kernel, of the tree main() is given


def digest(*xs):
    h = hashlib.sha256()
    for x in xs:
        if x is None:
            h.update(b"None")
            continue
        x = x.detach().contiguous()
        h.update(f"{x.dtype}{tuple(x.shape)}".encode())
        h.update(x.view(torch.uint8).numpy().tobytes() if x.dtype != torch.bool else x.numpy().tobytes())
    return h.hexdigest()


def inputs(seed, T, D, dtype, B=1, H=2, scale=2.0, tied=False, strided=False):
    g = torch.Generator().manual_seed(seed)
    shape = (B, T, H, D) if strided else (B, H, T, D)
    q, k, v, do = (scale * torch.randn(*shape, generator=g) for _ in range(4))
    if tied:   # repeated block maxima: safe-max shifts
        u = torch.randn(D, generator=g)
        u = u / u.norm() * (8 * D ** 0.5) ** 0.5
        if strided:
            k[:, ::8] = u
            q = q + u
        else:
            k[:, :, ::8] = u
            q = q + u
    xs = [x.to(dtype) for x in (q, k, v, do)]
    if strided:
        xs = [x.transpose(1, 2) for x in xs]
    return xs


def run_case(impl, dtype, T=100, D=16, seed=0, tied=False, strided=False, grads=True, input_scale=2.0,
             delta_error=None, **kw):
    q, k, v, do = inputs(seed, T, D, dtype, tied=tied, strided=strided, scale=input_scale)
    q, k, v = (x.detach().requires_grad_() for x in (q, k, v))
    if delta_error is None:
        out = ak.attention(q, k, v, impl=impl, **kw)
    elif "delta_error" in inspect.signature(ak.attention).parameters:   # a tree from before lab/assay.py held it
        out = ak.attention(q, k, v, impl=impl, delta_error=delta_error, **kw)
    else:
        from lab.assay import attention_with_delta_error
        out = attention_with_delta_error(q, k, v, delta_error, impl=impl, **kw)
    o, ml = out if kw.get("return_max_logit") else (out, None)
    g = torch.autograd.grad(o, (q, k, v), do.to(o.dtype)) if grads else ()
    return digest(o, ml, *g)


CASES = []


def case(name, **kw):
    CASES.append((name, kw))


def build_cases():
    """The cases, from the loaded kernel's ACCUM_MODES."""
    ROUNDINGS = [(), ("logits",), ("pv",), ("backward",), ("logits", "pv"), ("logits", "backward"),
                 ("pv", "backward"), ALL, None]
    for impl in ("torch", "triton"):
        for accum in ak.ACCUM_MODES:
            for r in ROUNDINGS:
                case(f"{impl} bf16 {accum} r={r} bn=32", impl=impl, dtype=BF16, accum=accum, rounding=r, block_n=32,
                     return_max_logit=True, tied=accum == "bf16-safemax")
            for r in ((), None, ALL):
                case(f"{impl} bf16 {accum} r={r} softcap", impl=impl, dtype=BF16, accum=accum, rounding=r,
                     softcap=3.0, block_n=32, return_max_logit=True)
                case(f"{impl} bf16 {accum} r={r} default block", impl=impl, dtype=BF16, accum=accum, rounding=r,
                     return_max_logit=True, T=150)
            case(f"{impl} bf16 {accum} qk_norm", impl=impl, dtype=BF16, accum=accum, qk_norm=True, block_n=32,
                 return_max_logit=True)
            case(f"{impl} bf16 {accum} qk_norm softcap", impl=impl, dtype=BF16, accum=accum, qk_norm=True, softcap=2.0,
                 block_n=64, return_max_logit=True)
            for dtype in (FP16, FP32):
                for r in ((), ("logits",), ("pv",), ("logits", "pv"), None):
                    case(f"{impl} {dtype} {accum} r={r}", impl=impl, dtype=dtype, accum=accum, rounding=r, block_n=32,
                         return_max_logit=True)
                case(f"{impl} {dtype} {accum} softcap qk_norm default block", impl=impl, dtype=dtype, accum=accum,
                     softcap=4.0, qk_norm=True, return_max_logit=True, T=90)
            case(f"{impl} bf16 {accum} strided", impl=impl, dtype=BF16, accum=accum, block_n=32, strided=True,
                 return_max_logit=True)
            case(f"{impl} bf16 {accum} T=1", impl=impl, dtype=BF16, accum=accum, T=1, block_n=16, return_max_logit=True)
            case(f"{impl} fp32 {accum} T=37 D=64", impl=impl, dtype=FP32, accum=accum, T=37, D=64, block_n=16,
                 rounding=())
        for bn in (16, 64, 128):
            for accum, r in (("fp32", ()), ("bf16", None), ("bf16", ALL)):
                case(f"{impl} bf16 {accum} r={r} bn={bn}", impl=impl, dtype=BF16, accum=accum, rounding=r, block_n=bn,
                     T=140)
        for r in ((), None, ALL):
            case(f"{impl} bf16 delta_error r={r}", impl=impl, dtype=BF16, accum="bf16", rounding=r, block_n=32,
                 delta_error=True)
        case(f"{impl} fp32 delta_error", impl=impl, dtype=FP32, accum="fp32", block_n=32, delta_error=True)
        case(f"{impl} safemax beta 4", impl=impl, dtype=BF16, accum="bf16-safemax", safemax_beta=4.0, block_n=32,
             tied=True, return_max_logit=True)
        for accum in ak.ACCUM_MODES:   # logits far apart: P underflows to 0, signed zeros in the sums
            for dtype, r in ((BF16, None), (BF16, ALL), (FP32, ()), (FP16, ())):
                case(f"{impl} {dtype} {accum} r={r} huge logits", impl=impl, dtype=dtype, accum=accum, rounding=r,
                     block_n=32, input_scale=6.0, return_max_logit=True)
        case(f"{impl} bf16 no max logit", impl=impl, dtype=BF16, accum="bf16", block_n=32)
        case(f"{impl} bf16 scale", impl=impl, dtype=BF16, accum="fp32", scale=0.3, block_n=32, return_max_logit=True)
    for dtype in (BF16, FP32):
        case(f"sdpa {dtype}", impl="sdpa", dtype=dtype, return_max_logit=True)
        case(f"sdpa {dtype} qk_norm", impl="sdpa", dtype=dtype, qk_norm=True, return_max_logit=True, T=300)


# The Triton launch configurations the tuner may adopt: uneven tiles take the diagonal and tail loops
# through their other cases. Patched through the module's config functions.
TILES = [((32, 128, 4, 2), (32, 128, 4, 2), (128, 32, 4, 2)), ((128, 32, 4, 1), (64, 64, 4, 2), (64, 64, 4, 2)),
         ((16, 64, 4, 1), (64, 128, 4, 2), (128, 64, 4, 2))]


def main(argv=None):
    global ak
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--tree", default=os.path.dirname(os.path.dirname(os.path.abspath(__file__))),
                   help="the checkout whose attention_kernel.py to fingerprint (default: this one)")
    p.add_argument("--only", default="", help="only the cases whose name holds this text")
    args = p.parse_args(argv)
    tree, only = args.tree, args.only
    if not os.path.isfile(os.path.join(tree, "attention_kernel.py")):
        p.error(f"--tree {tree}: no attention_kernel.py there; give a checkout of this project")
    torch.set_num_threads(1)
    sys.path.insert(0, tree)
    import attention_kernel
    ak = attention_kernel
    CASES.clear()
    build_cases()
    t0 = time.time()
    total = hashlib.sha256()
    for name, kw in [(n, kw) for n, kw in CASES if only in n]:
        kw = dict(kw)
        if kw.pop("delta_error", False):
            kw["delta_error"] = torch.linspace(-0.5, 0.5, 2 * kw.get("D", 16)).reshape(2, -1)
        h = run_case(**kw)
        total.update(h.encode())
        print(f"{h}  {name}", flush=True)
    real_fwd, real_bwd = ak.fwd_config, ak.bwd_configs
    for fwd, dkdv, dq in TILES:
        ak.fwd_config = lambda *a, fwd=fwd: fwd
        ak.bwd_configs = lambda *a, dkdv=dkdv, dq=dq: (dkdv, dq)
        for dtype, accum, r in ((BF16, "fp32", ()), (BF16, "bf16", None), (FP32, "fp32", ()),
                                (BF16, "fp32", ("logits",))):
            if only not in "triton tiles":
                continue
            name = f"triton tiles {fwd} {dkdv} {dq} {dtype} {accum} r={r}"
            h = run_case("triton", dtype, T=150, D=32, accum=accum, rounding=r, return_max_logit=True,
                         block_n=fwd[1])
            total.update(h.encode())
            print(f"{h}  {name}", flush=True)
    ak.fwd_config, ak.bwd_configs = real_fwd, real_bwd
    print(f"{total.hexdigest()}  OVERALL")
    print(f"{time.time() - t0:.0f} s", file=sys.stderr)


if __name__ == "__main__":
    main()
