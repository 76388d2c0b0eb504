"""Tests of lab/bench.py: the kernels compile for a GPU without one, every tuning candidate computes
what the default does, and the benchmark's smoke run and targets.

Run: python -m pytest -q lab/test_bench.py
"""
import json
import os
import subprocess
import sys

import pytest

import attention_kernel as ak
from lab import bench
from test_numerics import BF16, need_triton, poison, seed  # noqa: F401 (fixtures: poison autouse)

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))   # the repository root


def test_kernels_compile_for_an_h100_without_spills():
    # Triton compiles for a GPU without one: every kernel a GPU runs at head_dim 64 (GPT-2's), for
    # bf16 and fp32 inputs, must compile for sm_90, spill no registers and fit the 227 KB of shared
    # memory. Slow: real compiles (32 s here without a Triton cache).
    code = ("import json, torch; from lab import bench; print(json.dumps([row for dtype in (torch.bfloat16, "
            "torch.float32) for row in bench.compile_for_gpu([(64, *m) for m in bench.RESOURCE_MODES], "
            "dtype=dtype)]))")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True,
                         cwd=ROOT)
    assert out.returncode == 0, out.stderr[-3000:]
    rows = json.loads(out.stdout.strip().splitlines()[-1])
    assert {(r["kernel"], r["dtype"]) for r in rows} == {(kernel, dtype) for dtype in ("bfloat16", "float32")
                                                         for kernel in ("attn_fwd", "attn_bwd_dkdv", "attn_bwd_dq")}
    for r in rows:
        assert r["spill_bytes"] == 0 and r["shared_kb"] <= 227, r


def test_every_tuning_candidate_gives_the_defaults_results(seed):
    # `bench.py --only tune` times other launch configurations on a GPU; any may become a default,
    # so each must compute the same: bit for bit in the bf16-state forward (its key block is fixed;
    # the rest leaves a row's arithmetic alone), up to summation order elsewhere. Uneven blocks
    # (32 x 128, 128 x 32) take the backward's diagonal and tail loops through their other cases.
    need_triton("triton")
    rows = bench.tune(shapes=[(1, 2, 150, 32)], timer=lambda fn: 0.0)
    assert {(r["kernel"], r["accum"]) for r in rows} == {("fwd", "fp32"), ("dkdv", "fp32"), ("dq", "fp32"),
                                                         ("fwd", "bf16")}
    for r in rows:
        assert "error" not in r, f"seed {seed}: {r}"
        tol = 0.0 if (r["kernel"], r["accum"]) == ("fwd", "bf16") else 2e-3
        assert r["rel_diff"] <= tol, f"seed {seed}: {r}"


def test_the_tuner_catches_a_candidate_that_leaves_outputs_unwritten(monkeypatch):
    need_triton("triton")
    default = ak.bwd_configs(32, BF16)[1]
    real = ak.launch
    monkeypatch.setattr(ak, "launch", lambda kernel, config, *a: None if kernel is ak.attn_bwd_dq and config != default
                        else real(kernel, config, *a))
    rows = bench.tune(shapes=[(1, 2, 40, 32)], timer=lambda fn: 0.0,
                   candidates=lambda kernel, accum, D: [(128, 32, 4, 2)] if kernel == "dq" else [])
    broken = [r for r in rows if r["kernel"] == "dq" and not r["default"]]
    assert len(broken) == 1 and "unwritten" in broken[0].get("error", ""), broken


def test_bench_smoke(tmp_path):
    """bench.py --smoke runs the benchmark's code paths at a tiny size on the CPU (even with a GPU,
    to stay quick): the three training configurations, the monitor cost, the targets, the JSON."""
    out_json = tmp_path / "bench.json"
    env = {**os.environ, "CUDA_VISIBLE_DEVICES": ""}
    out = subprocess.run([sys.executable, "-m", "lab.bench", "--smoke", "--json", str(out_json)],
                         capture_output=True, text=True, timeout=120, cwd=ROOT, env=env)
    assert out.returncode == 0, out.stdout + out.stderr
    lines = out.stdout.splitlines()
    assert any(line.startswith("attention table: skipped") for line in lines)
    for config in ("sdpa", "triton+monitor", "triton"):
        assert any(line.split()[:1] == [config] and len(line.split()) == 5 for line in lines), config
    assert "monitor cost (on - off) / off: " in out.stdout
    summary = lines[lines.index(next(line for line in lines if line.startswith("targets"))):]
    for target in ("attn fp32/cudnn fwd+bwd (16, 12, 1024, 64)", "attn bf16-safemax/fp32, worst of 3 shapes",
                   "train tokens/s, triton+monitor / sdpa", "monitor cost, (on - off) / off"):
        assert any(line.startswith(target) for line in summary), target

    result = json.loads(out_json.read_text())
    assert result["smoke"] is True and result["errors"] == []
    assert set(result["train"]) == {"sdpa", "triton+monitor", "triton"}
    for row in result["train"].values():
        assert row["ms_per_step"] > 0 and row["tokens_per_s"] > 0 and row["steps"] == 2
    assert isinstance(result["monitor_cost"], float)
    assert len(result["targets"]) == 7
    assert all(set(t) == {"target", "measured", "goal", "met"} for t in result["targets"])
    assert [t["met"] for t in result["targets"][:5]] == [None] * 5  # no attention table on the CPU


@pytest.mark.parametrize("x, at_most_met, at_least_met", [(0.99, True, False), (1.0, True, True),
                                                          (1.01, False, True)])
def test_bench_targets_verdicts_at_their_limits(x, at_most_met, at_least_met):
    # x times each limit (at most: fp32 attention / cuDNN or flash 1.0, bf16 modes / fp32 1.25,
    # monitor cost 1%; at least: tokens/s over SDPA's 1.0): met on the right side and at the limit
    att = {s: {"fp32/cudnn": x, "fp32/flash": x, "bf16/fp32": 1.25 * x * w, "bf16-safemax/fp32": 1.25 * x * w}
           for s, w in zip(bench.SHAPES, (0.5, 1.0, 0.8))}  # the worst shape is the second
    s0, s1, s2 = bench.SHAPES
    att[s0]["fp32/flash"] = att[s1]["fp32/cudnn"] = att[s2]["fp32/cudnn"] = 2.0 - x   # not this shape's target
    row = lambda tokens_per_s: {"ms_per_step": 16384 / tokens_per_s * 1e3, "tokens_per_s": tokens_per_s,
                                "steps": 50, "mfu": None, "peak_mem_gib": None}
    train = {"sdpa": row(1e5), "triton+monitor": row(1e5 * x), "triton": row(1.1e5)}
    rows = bench.targets(att, train, 0.01 * x)
    assert [r["met"] for r in rows] == [at_most_met] * 5 + [at_least_met, at_most_met]
    assert [r["measured"] for r in rows] == pytest.approx([x, x, x, 1.25 * x, 1.25 * x, x, 0.01 * x])
    att[s2]["bf16/fp32"] = None                             # a shape not measured: no worst
    rows = bench.targets(att, train, None)                  # and no monitor cost
    assert rows[3]["met"] is None and rows[3]["measured"] is None and rows[6]["met"] is None
