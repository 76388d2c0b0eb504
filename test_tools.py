"""Tests of sweep.py (launching the claims) and report.py (reading them back and judging them).

Run: python -m pytest -q test_tools.py   (CPU; well under a minute)
"""
import importlib.util
import json
import math
import os
import subprocess
import sys

import pytest

import report
import sweep

ROOT = os.path.dirname(os.path.abspath(__file__))


# ---------------------------------------------------------------------------------------------------------------
# Synthetic run folders, written the way train.py writes them

def write_run(root, group, seed, steps=20, sigma=1.0, growth=1.0, loss=3.0, collapse=None, trigger=None,
              val=2.9, end="completed", command=None):
    """A run logging every step. sigma(W_q) of layer 1 grows by `growth` per step (layer 0 stays at 0.5), the
    max logit is 10 sigma^2; from `collapse` on the loss jumps to 8; `trigger` adds a guard_trigger event.
    end=None leaves the run in progress (no end record); end="" writes an empty log."""
    path = os.path.join(root, group, f"seed{seed}")
    os.makedirs(path)
    command = command or ["train.py", "--accum", group, "--seed", str(seed), "--out-dir", path]
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump({"args": {"seed": seed}, "command": command,
                   "versions": {"gpu": "NVIDIA H200", "device": "cuda:0", "torch": "2.11.0+cu130"}}, f)
    records = [{"event": "start", "step": 0}, {"event": "eval", "step": 0, "val_loss": 10.0}]
    for step in range(steps):
        s = sigma * growth ** step
        bad = collapse is not None and step >= collapse
        records.append({"step": step, "lr": 1e-3, "loss": 8.0 if bad else loss, "grad_norm": 1.0,
                        "max_logit": [[1.0, 2.0], [10 * s * s, 3.0]], "sigma_q": [0.5, s], "sigma_k": [0.5, s],
                        "guard": "on" if trigger is not None and step > trigger else "off"})
        if step == trigger:
            records.append({"event": "guard_trigger", "step": step, "layer": 1, "head": 0, "value": 10 * s * s,
                            "signal": "max-logit", "threshold": 200.0, "action": "qknorm"})
        if collapse is not None and step == collapse + 4:
            records.append({"event": "collapse", "step": collapse, "loss": 8.0})
            break
    records.append({"event": "eval", "step": records[-1]["step"] + 1, "val_loss": 8.0 if collapse else val})
    if end:
        records.append({"event": "end", "status": "collapsed" if collapse is not None else end,
                        "step": records[-1]["step"], "collapse_step": collapse,
                        "guard_trigger": None if trigger is None else {"step": trigger}, "val_loss": val})
    with open(os.path.join(path, "log.jsonl"), "w") as f:
        if end != "":
            f.write("".join(json.dumps(r) + "\n" for r in records))
    return path


def verdict(root, claim):
    return report.verdicts(report.load_runs(str(root)))[claim - 1][1]


def claim1_runs(root, safemax_collapses=False):
    write_run(root, "bf16", 1, growth=1.2, collapse=10)
    write_run(root, "bf16", 2, growth=1.2, collapse=14)
    write_run(root, "bf16", 3)
    for seed in (1, 2, 3):
        write_run(root, "fp32", seed)
        write_run(root, "bf16-safemax", seed, collapse=12 if safemax_collapses and seed == 2 else None)
    write_run(root, "fp32", 4, collapse=12, end=None)   # in progress, a collapse logged: must not count yet
    write_run(root, "fp32", 5, end="")          # an empty log


# ---------------------------------------------------------------------------------------------------------------
# report.py

def test_group_numbers_from_logs(tmp_path):
    claim1_runs(tmp_path)
    write_run(tmp_path, "bf16-guard", 1, steps=20, growth=1.1, trigger=7, loss=3.0)
    groups = report.load_runs(str(tmp_path))
    bf16 = {r.seed: r for r in groups["bf16"]}
    assert [bf16[s].collapsed for s in ("seed1", "seed2", "seed3")] == [True, True, False]
    assert bf16["seed1"].collapse_step == 10 and bf16["seed1"].status == "collapsed"
    assert bf16["seed1"].max_sigma == pytest.approx(1.2 ** 14)             # last logged step: collapse + 4
    assert bf16["seed1"].max_logit == pytest.approx(10 * 1.2 ** 28)
    assert bf16["seed1"].final_train == pytest.approx(8.0)
    assert bf16["seed3"].final_train == pytest.approx(3.0) and bf16["seed3"].final_val == pytest.approx(2.9)
    fp32 = {r.seed: r for r in groups["fp32"]}
    assert fp32["seed4"].status == "in progress" and not fp32["seed4"].finished
    assert fp32["seed5"].status == "empty log" and fp32["seed5"].max_sigma is None
    guard = groups["bf16-guard"][0]
    assert guard.trigger == 7 and not guard.collapsed and guard.max_sigma == pytest.approx(1.1 ** 19)

    assert report.group_line("bf16", groups["bf16"]).startswith("bf16: 2/3 collapsed (median step 12)")  # 10, 14
    assert "guard triggered at 7" in report.group_line("bf16-guard", groups["bf16-guard"])
    assert report.group_line("fp32", groups["fp32"]).startswith("fp32: 0/3 collapsed")     # finished runs only
    assert report.group_line("fp32", groups["fp32"], finished_only=False).startswith("fp32: 1/5 collapsed")
    text = report.build(groups, str(tmp_path), markdown=False)
    assert "in progress" in text and "empty log" in text and "bf16-qknorm-always: no runs" in text


def test_final_loss_is_mean_of_last_logged_losses(tmp_path):
    path = write_run(tmp_path, "fp32", 1, steps=3)
    with open(os.path.join(path, "log.jsonl")) as f:
        records = [json.loads(line) for line in f]
    losses = iter([5.0, 4.0, 3.0, 2.0, 1.0, 0.0, 1.0])
    for r in records:
        if "loss" in r:
            r["loss"] = next(losses)
    with open(os.path.join(path, "log.jsonl"), "w") as f:
        f.write("".join(json.dumps(r) + "\n" for r in records) + '{"step": 9, "lo')   # a half-written line
    run = report.load_runs(str(tmp_path))["fp32"][0]
    assert run.loss == [5.0, 4.0, 3.0] and run.final_train == pytest.approx(4.0)


def test_claim_1_verdict_follows_the_rule(tmp_path):
    claim1_runs(tmp_path / "a")
    assert verdict(tmp_path / "a", 1) == "reproduced"
    row = report.verdicts(report.load_runs(str(tmp_path / "a")))[0]
    assert "2 unfinished runs left out" in row[2] and "bf16: 2/3 collapsed" in row[2]
    claim1_runs(tmp_path / "b", safemax_collapses=True)
    assert verdict(tmp_path / "b", 1) == "not reproduced"
    write_run(tmp_path / "c", "bf16", 1, collapse=10)
    write_run(tmp_path / "c", "fp32", 1)
    assert verdict(tmp_path / "c", 1) == "not run"                       # no bf16-safemax run
    assert verdict(tmp_path / "c", 2) == "not run"


@pytest.mark.parametrize("gap, trigger, expected", [(0.02, 5, "reproduced"), (0.05, 5, "not reproduced"),
                                                    (0.0, None, "not reproduced")])
def test_claim_2_guard_within_tolerance_of_qknorm(tmp_path, gap, trigger, expected):
    for seed in (1, 2):
        write_run(tmp_path, "bf16-guard", seed, loss=3.0 + gap, val=2.9 - gap, trigger=trigger)
        write_run(tmp_path, "bf16-qknorm-always", seed, loss=3.0, val=2.9)
    assert verdict(tmp_path, 2) == expected


# Runs for claims 3 to 7, as write_run keywords (20 steps each; max logit = 10 sigma^2, sigma constant unless grown)
S_RUNAWAY = math.sqrt(report.RUNAWAY_LOGIT / 10)   # the sigma whose max logit is RUNAWAY_LOGIT exactly
CALM = {}                                          # sigma 1, max logit 10: healthy
RAN_AWAY = dict(sigma=S_RUNAWAY)                   # max logit RUNAWAY_LOGIT: ran away (>=) without collapsing
NEARLY = dict(sigma=0.9 * S_RUNAWAY)               # max logit 0.81 RUNAWAY_LOGIT: large, not a runaway
COLLAPSED = dict(collapse=10)                      # sigma 1, but collapsed: ran away
# claim 6. GREW and HELD trigger at step 9, then sigma grows growth^10 times to the last step (max logit < 400)
FAILED = dict(trigger=3, growth=1.3, collapse=12)                 # triggered, then collapsed
GREW = dict(trigger=9, growth=(1.1 * report.SIGMA_RATIO) ** 0.1)   # sigma x 1.1 SIGMA_RATIO after the trigger
HELD = dict(trigger=9, growth=(0.9 * report.SIGMA_RATIO) ** 0.1)   # sigma x 0.9 SIGMA_RATIO: stopped
UNGUARDED = dict(growth=1.3, collapse=12)                         # collapsed, but the guard never triggered


def write_groups(root, groups):
    """group -> list of write_run keywords, one per seed."""
    for group, runs in groups.items():
        for seed, kw in enumerate(runs, 1):
            write_run(root, group, seed, **kw)


@pytest.mark.parametrize("claim, group, control", [(3, "inject-mlp-out", "inject-mlp-out-qkfix"),
                                                   (4, "inject-coherent", "inject-random")])
@pytest.mark.parametrize("runs, controls, expected", [
    ([RAN_AWAY, dict(collapse=10, sigma=S_RUNAWAY), CALM], [CALM, CALM], "reproduced"),  # 2/3 ran away, ratio 10
    ([RAN_AWAY, NEARLY], [CALM, CALM], "not reproduced"),                # 1 of 2 ran away: no majority
    ([RAN_AWAY, RAN_AWAY], [CALM, CALM, RAN_AWAY], "not reproduced"),    # the control ran away once
    ([dict(collapse=10, sigma=report.SIGMA_RATIO)] * 2, [CALM], "not reproduced"),          # ratio = SIGMA_RATIO
    ([dict(collapse=10, sigma=1.01 * report.SIGMA_RATIO)] * 2, [CALM], "reproduced"),       # just above it
])
def test_claims_3_and_4_runaway_vs_control(tmp_path, claim, group, control, runs, controls, expected):
    # majority ran away (collapse or max logit >= RUNAWAY_LOGIT), control none, median sigma ratio > SIGMA_RATIO
    write_groups(tmp_path, {group: runs, control: controls})
    assert verdict(tmp_path, claim) == expected


@pytest.mark.parametrize("topk, equal, expected", [
    ([CALM, CALM], [dict(sigma=1.01 * report.SIGMA_RATIO)] * 2, "reproduced"),    # ratio just above SIGMA_RATIO
    ([CALM, CALM], [dict(sigma=report.SIGMA_RATIO)] * 2, "not reproduced"),       # exactly SIGMA_RATIO
    ([CALM, COLLAPSED], [RAN_AWAY, RAN_AWAY], "not reproduced"),                  # ratio 10, but top-k collapsed
    ([RAN_AWAY, RAN_AWAY], [dict(sigma=3 * S_RUNAWAY)] * 2, "reproduced"),        # a large logit is no collapse
    ([dict(steps=0)] * 2, [dict(steps=0)] * 2, "not reproduced"),                 # no sigma logged: no evidence
])
def test_claim_5_probe(tmp_path, topk, equal, expected):
    # equal-energy's median max sigma(W_q) > SIGMA_RATIO x top-k's, and top-k collapsed in no seed
    write_groups(tmp_path, {"bf16-probe-topk": topk, "bf16-probe-equal": equal})
    assert verdict(tmp_path, 5) == expected


@pytest.mark.parametrize("odd, runs, expected", [
    ("bf16-guard-softcap", [FAILED, GREW], "reproduced"),
    ("bf16-guard-softcap", [HELD, HELD], "not reproduced"),                 # the non-QK action worked
    ("bf16-guard-clip", [GREW, HELD], "not reproduced"),                    # failed in 1 of 2: no majority
    ("bf16-guard-lr-drop", [UNGUARDED, UNGUARDED], "not reproduced"),       # failed, but without a trigger
])
def test_claim_6_non_qk_actions_fail(tmp_path, odd, runs, expected):
    # each group: a majority triggered, then ran away or grew sigma > SIGMA_RATIO x; the others fail in 2/3 seeds
    # (one collapsed, one only grew), so both ways of failing must count
    write_groups(tmp_path, {g: runs if g == odd else [FAILED, GREW, HELD]
                            for g in ("bf16-guard-lr-drop", "bf16-guard-clip", "bf16-guard-softcap")})
    assert verdict(tmp_path, 6) == expected


def guard(gap=0.0, val_gap=None, **kw):
    """A guarded llama run that triggered, its train (and val) loss `gap` off the reference's 3.0 (2.9)."""
    return {"trigger": 5, "loss": 3.0 + gap, "val": 2.9 + (gap if val_gap is None else val_gap), **kw}


@pytest.mark.parametrize("changes, expected", [
    ({}, "reproduced"),
    ({"llama-bf16": [COLLAPSED, CALM]}, "not reproduced"),                       # collapsed in 1 of 2
    ({"llama-fp32": [CALM, COLLAPSED]}, "not reproduced"),                       # fp32 collapsed too
    ({"llama-bf16-guard": [guard(), guard(collapse=10)],                        # the guard collapsed (its reference
      "llama-bf16-qknorm-always": [CALM, COLLAPSED]}, "not reproduced"),          # too: the losses still match)
    ({"llama-bf16-guard": [guard(), CALM]}, "not reproduced"),                   # triggered in 1 of 2
    ({"llama-bf16-guard": [guard(0.9 * report.LOSS_TOL)] * 2}, "reproduced"),
    ({"llama-bf16-guard": [guard(1.1 * report.LOSS_TOL, val_gap=0.0)] * 2}, "not reproduced"),   # train gap
    ({"llama-bf16-guard": [guard(0.0, val_gap=-1.1 * report.LOSS_TOL)] * 2}, "not reproduced"),  # val gap
    ({"llama-bf16-guard": [guard(2 * report.LOSS_TOL), guard()],                # equal medians, but seed by seed
      "llama-bf16-qknorm-always": [CALM, guard(2 * report.LOSS_TOL, trigger=None)]}, "not reproduced"),
])
def test_claim_7_second_architecture(tmp_path, changes, expected):
    # claim 1's rule on llama-bf16 / llama-fp32 and claim 2's on llama-bf16-guard / llama-bf16-qknorm-always
    groups = {"llama-bf16": [COLLAPSED, dict(collapse=14)], "llama-fp32": [CALM, CALM],
              "llama-bf16-guard": [guard(), guard()], "llama-bf16-qknorm-always": [CALM, CALM]}
    write_groups(tmp_path, {**groups, **changes})
    assert verdict(tmp_path, 7) == expected


def test_markdown_has_tables_hardware_and_commands(tmp_path):
    claim1_runs(tmp_path / "runs")
    md = tmp_path / "RESULTS.md"
    assert report.main([str(tmp_path / "runs"), "--markdown", str(md), "--plots", str(tmp_path / "plots")]) == 0
    text = md.read_text()
    assert "| claim | verdict |" in text and "| 1 | reproduced |" in text and "| 2 | not run |" in text
    assert "### bf16-safemax" in text and "| seed2 | collapsed | 14 |" in text
    assert "NVIDIA H200" in text
    assert f"python train.py --accum bf16 --seed 2 --out-dir {tmp_path / 'runs' / 'bf16' / 'seed2'}" in text
    if importlib.util.find_spec("matplotlib"):       # the plots, linked relative to the Markdown file
        assert "![claim1](plots/claim1.png)" in text and (tmp_path / "plots" / "claim1.png").exists()
        # without --plots they go into plots/ beside the Markdown file (its folder made if need be)
        assert report.main([str(tmp_path / "runs"), "--markdown", str(tmp_path / "out" / "R.md")]) == 0
        assert "![claim1](plots/claim1.png)" in (tmp_path / "out" / "R.md").read_text()
        assert (tmp_path / "out" / "plots" / "claim1.png").exists()


def test_plots_or_a_clear_skip(tmp_path, monkeypatch, capsys):
    claim1_runs(tmp_path)
    groups = report.load_runs(str(tmp_path))
    monkeypatch.setitem(sys.modules, "matplotlib", None)                # as if it were not installed
    assert report.plot_claims(groups, str(tmp_path / "p")) == []
    assert "plots skipped" in capsys.readouterr().out
    monkeypatch.undo()
    pytest.importorskip("matplotlib")
    saved = report.plot_claims(groups, str(tmp_path / "p"))
    assert saved == [str(tmp_path / "p" / "claim1.png")] and os.path.getsize(saved[0]) > 1000


def test_report_survives_nothing(tmp_path, capsys):
    os.makedirs(tmp_path / "bf16" / "seed1")                           # a folder without any file
    assert report.main([str(tmp_path), "--plots", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    assert "empty log" in out and out.count("not run") == 7


# ---------------------------------------------------------------------------------------------------------------
# sweep.py

def dry_run(*args):
    return subprocess.run([sys.executable, os.path.join(ROOT, "sweep.py"), "--dry-run", *args],
                          capture_output=True, text=True, timeout=60, cwd=ROOT)


def test_sweep_dry_run_commands_and_skips(tmp_path):
    root = str(tmp_path)
    out = dry_run("--claims", "1", "--seeds", "2", "--out-root", root, "--", "--max-steps", "50")
    assert out.returncode == 0, out.stderr
    lines = out.stdout.strip().splitlines()
    assert len(lines) == 6
    for name, flags in (("bf16", "--accum bf16 --guard off"), ("fp32", "--accum fp32 --guard off"),
                        ("bf16-safemax", "--accum bf16-safemax --guard off")):
        for seed in (1, 2):
            expected = f"{flags} --max-steps 50 --seed {seed} --out-dir {root}/{name}/seed{seed}"
            assert sum(expected in line for line in lines) == 1, (expected, lines)

    write_run(root, "fp32", 1)                                           # ended: skipped
    write_run(root, "bf16", 2, end=None)                                 # unfinished: skipped unless --resume
    out = dry_run("--claims", "1", "--seeds", "2", "--out-root", root)
    assert f"skip {root}/fp32/seed1: completed" in out.stdout
    assert f"skip {root}/bf16/seed2: unfinished" in out.stdout
    assert sum("train.py" in line for line in out.stdout.splitlines()) == 4
    open(os.path.join(root, "bf16", "seed2", "ckpt.pt"), "w").close()
    out = dry_run("--claims", "1", "--seeds", "2", "--out-root", root, "--resume")
    assert f"--out-dir {root}/bf16/seed2 --resume" in out.stdout


def test_experiment_table_is_valid_train_flags():
    """Every experiment's flags parse in train.py (so no run of the GPU session dies on a typo)."""
    import train
    for number in sweep.CLAIMS:
        for name, flags in sweep.experiments([number]).items():
            train.parse_args(flags + ["--max-steps", "1"])


@pytest.fixture(scope="module")
def data_dir(tmp_path_factory):
    import sysconfig
    import prepare_data
    stdlib = sysconfig.get_paths()["stdlib"]
    out = tmp_path_factory.mktemp("data")
    prepare_data.prepare(dataset="text", out_dir=str(out), val_fraction=0.2,
                         inputs=[os.path.join(stdlib, n + ".py") for n in ("abc", "argparse", "ast", "bisect",
                                                                           "calendar", "contextlib", "copy", "csv")])
    return str(out)


def test_sweep_and_report_end_to_end(tmp_path, data_dir):
    root = str(tmp_path / "runs")
    cmd = [sys.executable, os.path.join(ROOT, "sweep.py"), "--claims", "1", "--seeds", "1", "--parallel", "3",
           "--out-root", root, "--", "--max-steps", "4", "--n-layer", "1", "--n-head", "2", "--n-embd", "32",
           "--block-size", "32", "--batch-size", "2", "--attn-impl", "torch", "--device", "cpu",
           "--eval-iters", "1", "--log-interval", "1", "--data-dir", data_dir]
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert out.returncode == 0, out.stdout + out.stderr
    assert out.stdout.count("[end ") == 3 and "ERROR" not in out.stdout
    for name in ("bf16", "fp32", "bf16-safemax"):
        assert sweep.run_state(os.path.join(root, name, "seed1")) == "completed"
        assert os.path.getsize(os.path.join(root, name, "seed1", "stdout.log")) > 0
    again = subprocess.run(cmd, capture_output=True, text=True, timeout=60, cwd=ROOT)
    assert "nothing to run" in again.stdout

    rep = subprocess.run([sys.executable, os.path.join(ROOT, "report.py"), root, "--markdown",
                          str(tmp_path / "R.md")], capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert rep.returncode == 0, rep.stderr
    for name in ("bf16", "fp32", "bf16-safemax"):
        assert f"== {name} ==" in rep.stdout and f"{name}: 0/1 collapsed" in rep.stdout
    assert "Traceback" not in rep.stderr


def test_read_log_drops_the_records_a_resume_replays(tmp_path):
    import sweep
    lines = [{"event": "start", "step": 0}, {"event": "eval", "step": 0, "val_loss": 9.0},
             *({"step": s, "loss": 10.0 - s} for s in range(6)), {"event": "eval", "step": 4, "val_loss": 7.0},
             {"event": "guard_trigger", "step": 5}, {"event": "resume", "step": 4},
             *({"step": s, "loss": 20.0 - s} for s in range(4, 8)), {"event": "end", "status": "completed", "step": 8}]
    (tmp_path / "log.jsonl").write_text("".join(json.dumps(r) + "\n" for r in lines))
    records = sweep.read_log(str(tmp_path))
    assert [r["loss"] for r in records if "loss" in r] == [10, 9, 8, 7, 16, 15, 14, 13]
    assert [r["step"] for r in records if r.get("event") == "eval"] == [0, 4], "the eval at the checkpoint stays"
    assert not any(r.get("event") == "guard_trigger" for r in records), "a trigger after the checkpoint is replayed"


# ---------------------------------------------------------------------------------------------------------------
# bench.py

def test_bench_smoke(tmp_path):
    """bench.py --smoke runs the benchmark's code paths at a tiny size on the CPU (even where a GPU is present,
    so the test stays quick): the three training configurations, the monitor cost, the targets, the JSON."""
    out_json = tmp_path / "bench.json"
    env = {**os.environ, "CUDA_VISIBLE_DEVICES": ""}
    out = subprocess.run([sys.executable, os.path.join(ROOT, "bench.py"), "--smoke", "--json", str(out_json)],
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
    assert [t["met"] for t in result["targets"][:5]] == [None] * 5        # no attention table on the CPU


@pytest.mark.parametrize("x, at_most_met, at_least_met", [(0.99, True, False), (1.0, True, True),
                                                          (1.01, False, True)])
def test_bench_targets_verdicts_at_their_limits(x, at_most_met, at_least_met):
    # every measurement x times its limit (at-most: fp32 attention / cuDNN or flash 1.0, bf16 modes / fp32 1.25,
    # monitor cost 1%; at-least: tokens/s over SDPA's 1.0): met on the right side, and at the limit itself
    import bench
    att = {s: {"fp32/cudnn": x, "fp32/flash": x, "bf16/fp32": 1.25 * x * w, "bf16-safemax/fp32": 1.25 * x * w}
           for s, w in zip(bench.SHAPES, (0.5, 1.0, 0.8))}                 # the worst shape is the second
    s0, s1, s2 = bench.SHAPES
    att[s0]["fp32/flash"] = att[s1]["fp32/cudnn"] = att[s2]["fp32/cudnn"] = 2.0 - x   # not this shape's target
    row = lambda tokens_per_s: {"ms_per_step": 16384 / tokens_per_s * 1e3, "tokens_per_s": tokens_per_s,
                                "steps": 50, "mfu": None, "peak_mem_gib": None}
    train = {"sdpa": row(1e5), "triton+monitor": row(1e5 * x), "triton": row(1.1e5)}
    rows = bench.targets(att, train, 0.01 * x)
    assert [r["met"] for r in rows] == [at_most_met] * 5 + [at_least_met, at_most_met]
    assert [r["measured"] for r in rows] == pytest.approx([x, x, x, 1.25 * x, 1.25 * x, x, 0.01 * x])
    att[s2]["bf16/fp32"] = None                                            # a shape not measured: no worst
    rows = bench.targets(att, train, None)                                 # and no monitor cost
    assert rows[3]["met"] is None and rows[3]["measured"] is None and rows[6]["met"] is None
