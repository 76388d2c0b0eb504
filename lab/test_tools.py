"""Tests of sweep.py (launching the claims) and report.py (reading them back and judging them).

Run: python -m pytest -q lab/test_tools.py   (CPU; the rules take seconds, end-to-end and bench longer)

Every rule of verdicts.RULES is tested on synthetic runs over sweep.SEEDS seeds: a case that must
pass it, and cases that each remove one of its conditions and must fail it.
"""
import glob
import importlib.util
import json
import math
import os
import random
import re
import shlex
import subprocess
import sys

import pytest
from pytest import param

from lab import figures, loading, report, stats, summary, sweep, tables, thresholds, verdicts
from lab import records as docs
from lab.rules import actions as claim6, common, injection as claim34, lr_study as lr_rules, probe as claim5
from model import NON_QK_KINDS, WEIGHT_KINDS

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))   # the repository root
N = sweep.SEEDS                    # 8: every arm runs seeds 1..N
R = thresholds.RUNAWAY_LOGIT
TOL = thresholds.LOSS_TOL
KINDS = WEIGHT_KINDS


# --------------------------------------------------------------------------------------------------
# Synthetic run folders, written the way train.py writes them

def write_run(root, arm, seed, steps=20, collapse=None, trigger=None, logit=10.0, growth=None, loss=3.0, val=None,
              end="completed", probe_share=None, args=None, data=None, init=10.0, probe=None, qk=None):
    """A run of `arm` logging every step: 2 layers of 2 heads, sigma of every weight kind per layer.

    logit: the max attention logit of each step; logit and loss: a number or a function of the step.
    growth: kind -> how many times sigma(W_kind) grows from the first logged step to the last
    (geometrically; 1 if not given, None if not logged). args: more of config.json's flags.
    collapse: the loss is 8 from that step on; a collapse event, and the run stops 2 steps later.
    trigger: a guard_trigger event at that step. val: the final val loss (2.9, or 8 if collapsed).
    end: the end record's status; None leaves the run in progress (no end record), "" an empty log.
    probe_share: the equal-energy probe's smallest removed share, logged at every step; probe: more of
    the probe's log record ({q,k}_{update,removed,kept}, per layer), at every step.
    qk: (step, factor): from that step on, every head's sigma(W_q,h) sigma(W_k,h) grows geometrically to
    factor times its value there by the last step (None: per-head sigmas not logged).
    data: the content hash in config.json's record of the data (None: no record, as older runs).
    init: the val loss of the eval at step 0, before the first update."""
    path = os.path.join(str(root), arm, f"seed{seed}")
    os.makedirs(path)
    with open(os.path.join(path, "config.json"), "w") as f:
        record = {"dataset": "pycode", "tokenizer": "byte", "content_sha256": data, "train_tokens": 900,
                  "val_tokens": 100}
        json.dump({"args": {"seed": seed, **(args or {})}, "command": ["train.py", "--seed", str(seed), "--out-dir", path],
                   "versions": {"gpu": "NVIDIA H200", "device": "cuda:0", "torch": "2.11.0+cu130"},
                   **({"data": record} if data else {})}, f)
    growth = {**dict.fromkeys(KINDS, 1.0), **(growth or {})}
    last = steps - 1 if collapse is None else collapse + 2
    val = (2.9 if collapse is None else 8.0) if val is None else val
    records = [{"event": "start", "step": 0}, {"event": "eval", "step": 0, "val_loss": init}]
    for step in range(last + 1):
        top = logit(step) if callable(logit) else logit
        if step == trigger:
            records.append({"event": "guard_trigger", "step": step, "layer": 1, "head": 0, "value": top,
                            "signal": "max-logit", "layers": [1], "active_from": step + 1})
        step_loss = loss(step) if callable(loss) else loss
        records.append({"step": step, "lr": 1e-3, "loss": 8.0 if collapse is not None and step >= collapse else step_loss,
                        "grad_norm": 1.0, "max_logit": [[1.0, 2.0], [top, 3.0]],
                        **{f"sigma_{k}": [0.5, g ** (step / last)] for k, g in growth.items() if g is not None},
                        "guard": "on" if trigger is not None and step > trigger else "dormant",
                        **({"probe": {**({"removed_fraction_min": probe_share} if probe_share is not None else {}),
                                      **(probe or {})}} if probe_share is not None or probe else {}),
                        **(qk_heads(step, last, *qk) if qk else {})})
        if step == collapse:
            records.append({"event": "collapse", "step": collapse, "loss": 8.0})
    records.append({"event": "eval", "step": last + 1, "val_loss": val})
    if end:
        records.append({"event": "end", "status": "collapsed" if collapse is not None and end == "completed"
                        else end, "step": last + 1, "collapse_step": collapse, "guard_pending": None,
                        "guard_trigger": None if trigger is None else {"step": trigger, "layer": 1, "head": 0},
                        "val_loss": val})
    with open(os.path.join(path, "log.jsonl"), "w") as f:
        f.write("".join(json.dumps(r) + "\n" for r in records) if end != "" else "")
    return path


def qk_heads(step, last, start, factor):
    """sigma_q_head, sigma_k_head (2 layers, 2 heads) whose products are 1 up to `start`, then grow
    geometrically to `factor` at step `last` (sigma_k_head stays 1)."""
    grown = factor ** (max(0, step - start) / max(1, last - start))
    return {"sigma_q_head": [[grown, grown], [grown, grown]], "sigma_k_head": [[1.0, 1.0], [1.0, 1.0]]}


OK = {}                                        # healthy: max logit 10, sigmas flat, val 2.9
COLLAPSE = {"collapse": 10}
UNFINISHED = {"end": None}                     # in progress: no end record
RUNAWAY = {"logit": 2 * R}                     # logit past RUNAWAY_LOGIT, no collapse, sigmas flat
QK_RUNAWAY = {"logit": 2 * R, "growth": {"q": 8.0}}  # ... through QK: sigma(W_q) x8, others flat
TRIG = {"trigger": 5}                          # guarded: triggered at step 5, healthy


def arm(k, kw, edits=None, rest=OK):
    """An arm's runs by seed: seeds 1..k with keywords kw, the others `rest`; edits: {seed:
    keywords, or None for no folder at all}."""
    runs = [kw] * k + [rest] * (N - k)
    for seed, e in (edits or {}).items():
        runs[seed - 1] = e
    return runs


def write_arms(root, arms):
    """arm -> its runs by seed (write_run keywords); an empty list writes no folder of that arm."""
    for name, runs in arms.items():
        for seed, kw in enumerate(runs, 1):
            if kw is not None:
                write_run(root, name, seed, **kw)
    return loading.load_runs(str(root))


def rows(root, arms):
    """rule -> [rule, verdict, text], judged on the arms written under root."""
    return {row[0]: row for row in verdicts.verdicts(write_arms(root, arms))}


def text_report(groups, root, **inputs):
    """The report lab.report prints on the console (lab/records.py's console), of these runs."""
    return docs.console(docs.Judged(groups, root, **inputs))


def judge(root, rule, arms):
    return rows(root, arms)[rule][1]


# --------------------------------------------------------------------------------------------------
# Statistics, against exact values

def test_binom_tail_and_sign_test():
    assert stats.binom_tail(5, 5) == 1 / 32 and stats.binom_tail(4, 4) == 1 / 16
    assert stats.binom_tail(5, 6) == pytest.approx(7 / 64) and stats.binom_tail(7, 8) == pytest.approx(9 / 256)
    assert stats.binom_tail(0, 3) == 1.0 and stats.binom_tail(0, 0) == 1.0
    T, F = True, False
    assert stats.sign_test([(T, F)] * 5) == (5, 0, 0.03125)
    assert stats.sign_test([(T, F)] * 4 + [(F, F)] * 4) == (4, 0, 0.0625)
    assert stats.sign_test([(T, F)] * 5 + [(T, T)] * 2 + [(F, F)]) == (5, 0, 0.03125)    # ties ignored
    assert stats.sign_test([(T, F)] * 5 + [(F, T)]) == (5, 1, pytest.approx(7 / 64))
    assert stats.sign_test([(F, T)] * 5) == (0, 5, 1.0)                                 # one-sided
    assert stats.sign_test([]) == (0, 0, 1.0)


@pytest.mark.parametrize("k, n, lower, upper", [(0, 8, 0.0, 0.3694), (8, 8, 0.6306, 1.0), (3, 10, 0.0667, 0.6525),
                                                (6, 8, 0.3491, 0.9681), (0, 0, 0.0, 1.0)])
def test_clopper_pearson(k, n, lower, upper):
    assert stats.clopper_pearson(k, n) == pytest.approx((lower, upper), abs=1e-4)


# --------------------------------------------------------------------------------------------------
# Reading runs

def test_run_reads_a_log(tmp_path):
    groups = write_arms(tmp_path, {"bf16": [{"collapse": 10, "growth": {"q": 8.0, "v": 2.0}, "logit": 2 * R}],
                                   "bf16-guard": [{"trigger": 7, "val": 2.95}],
                                   "fp32": [UNFINISHED, {"end": ""}, {"end": "interrupted"}, {"end": "error"}]})
    bad, guard = groups["bf16"][0], groups["bf16-guard"][0]
    assert bad.status == "collapsed" and bad.finished and bad.collapsed and bad.collapse_step == 10
    assert bad.steps == list(range(13)) and bad.final_train == pytest.approx((3 + 3 + 8 + 8 + 8) / 5)   # last 5
    assert bad.final_val == 8.0 and bad.max_logit == 2 * R and bad.trigger is None
    assert bad.growth("q") == pytest.approx(8.0) and bad.growth("v") == pytest.approx(2.0)
    assert bad.growth("mlp_out") == pytest.approx(1.0) and bad.max_sigma == pytest.approx(8.0)
    assert guard.trigger == 7 and not guard.collapsed and guard.final_val == 2.95 and guard.final_train == 3.0
    assert [r.status for r in groups["fp32"]] == ["in progress", "empty log", "interrupted", "error"]
    assert not any(r.finished for r in groups["fp32"])
    assert groups["fp32"][1].max_sigma is None and groups["fp32"][1].final_train is None


def test_trigger_and_val_from_the_end_record_and_half_written_lines(tmp_path):
    path = write_run(tmp_path, "fp32-guard", 1, steps=3, trigger=1)
    with open(os.path.join(path, "log.jsonl")) as f:
        records = [r for r in map(json.loads, f) if r.get("event") not in ("guard_trigger", "eval")]
    losses = iter([5.0, 4.0, 3.0])
    for r in records:
        if "loss" in r:
            r["loss"] = next(losses)
    with open(os.path.join(path, "log.jsonl"), "w") as f:
        f.write("".join(json.dumps(r) + "\n" for r in records) + '{"step": 9, "lo')   # a half-written line
    run = loading.load_runs(str(tmp_path))["fp32-guard"][0]
    assert run.loss == [5.0, 4.0, 3.0] and run.final_train == pytest.approx(4.0)
    assert run.trigger == 1 and run.final_val == 2.9 and run.finished  # from the end record


@pytest.mark.parametrize("growth, specific", [
    ({"q": 8.0}, True), ({"k": 8.0}, True),
    ({"q": 8.0, "v": 8.0}, False),                          # grew as much elsewhere
    ({"q": 8.0, "mlp_out": 4.0}, False),                    # exactly SIGMA_RATIO times: not more
    ({"q": 8.0, "mlp_out": 3.9}, True),
    ({"q": 8.0, "o": 5.0, "mlp_in": 1.5}, False),           # the most-grown other kind counts
    ({"q": 8.0, **dict.fromkeys(NON_QK_KINDS, None)}, False),   # the others not logged: no evidence
])
def test_qk_specific(tmp_path, growth, specific):
    run = write_arms(tmp_path, {"bf16": [{"growth": growth}]})["bf16"][0]
    assert thresholds.SIGMA_RATIO == 2.0 and claim34.qk_specific(run) is specific


def test_the_other_kinds_are_read_from_the_log():
    # a real run's log: its other kinds are the model's, and its per-head sigma_q_head is not one
    path = os.path.join(ROOT, "lab", "results", "lab", "assay", "seed1")
    assert any("sigma_q_head" in r for r in sweep.read_log(path))
    assert loading.Run(path).other_kinds == sorted(NON_QK_KINDS)



# --------------------------------------------------------------------------------------------------
# Rule 1: bf16 collapses where fp32 does not, and where bf16-safemax does not

RULE1 = {"bf16": arm(6, COLLAPSE), "fp32": arm(0, OK), "bf16-safemax": arm(0, OK)}


@pytest.mark.parametrize("changes, expected", [
    param({}, "reproduced", id="6 of 8"),
    param({"bf16": arm(5, COLLAPSE)}, "reproduced", id="5 of 8, p=1/32"),
    param({"bf16": arm(4, COLLAPSE)}, "not reproduced", id="4 of 8, p=1/16"),
    param({"bf16-safemax": arm(6, COLLAPSE)}, "not reproduced", id="safemax collapses in the same seeds"),
    param({"fp32": arm(0, OK, {7: COLLAPSE})}, "not reproduced", id="fp32 collapses elsewhere: 6 vs 1"),
    param({"bf16": arm(5, COLLAPSE), "fp32": arm(0, OK, {1: UNFINISHED})}, "not reproduced",
          id="fp32 unfinished at the margin"),
    param({"bf16": arm(5, COLLAPSE), "fp32": arm(0, OK, {1: {"end": "interrupted"}})}, "not reproduced",
          id="fp32 interrupted at the margin"),
    param({"bf16": arm(5, COLLAPSE), "fp32": arm(0, OK, {1: None})}, "not reproduced",
          id="fp32 seed missing at the margin"),
    param({"bf16": arm(5, COLLAPSE, {1: {"collapse": 10, "end": None}})}, "not reproduced",
          id="bf16 in progress with a logged collapse: not counted"),
    param({"bf16": arm(5, COLLAPSE), "bf16-safemax": arm(0, OK, {8: UNFINISHED})}, "not reproduced",
          id="safemax unfinished where bf16 did not collapse: 5 vs 1"),
    param({"bf16-safemax": []}, "not run", id="no bf16-safemax runs"),
])
def test_rule_1(tmp_path, changes, expected):
    assert judge(tmp_path, "1", {**RULE1, **changes}) == expected


def test_rule_1_text_counts_intervals_and_unfinished(tmp_path):
    text = rows(tmp_path, {**RULE1, "fp32": arm(0, OK, {1: UNFINISHED, 8: UNFINISHED})})["1"][2]
    assert "bf16: collapsed 6/8 [95% CI 0.35-0.97]" in text
    assert "fp32: collapsed 2/8 [95% CI 0.03-0.65] (2 unfinished, counted against)" in text
    assert "sign test, bf16 over fp32: 5 seeds one way, 1 the other, p = 0.109 -> fails" in text   # a tie, a loss
    assert "sign test, bf16 over bf16-safemax: 6 seeds one way, 0 the other, p = 0.0156 -> holds" in text
    row = rows(tmp_path / "b", {**RULE1, "bf16-safemax": [], "fp32": []})["1"]
    assert row[1] == "not run" and "no runs of fp32, bf16-safemax" in row[2]


# --------------------------------------------------------------------------------------------------
# Rule 2: bf16-guard never collapses, fewer than bf16, triggers before each bf16 collapse, ends
# within LOSS_TOL of bf16-qknorm-always in every seed. bf16 collapses at step 10 in seeds 1-7.

RULE2 = {"bf16": arm(7, COLLAPSE), "bf16-guard": arm(8, TRIG), "bf16-qknorm-always": arm(0, OK)}


@pytest.mark.parametrize("changes, expected", [
    param({}, "reproduced", id="7 of 8 prevented"),
    param({"bf16": arm(5, COLLAPSE)}, "reproduced", id="5 of 8, p=1/32"),
    param({"bf16": arm(4, COLLAPSE)}, "not reproduced", id="4 of 8, p=1/16"),
    param({"bf16-guard": arm(8, TRIG, {1: {"trigger": 5, "collapse": 12}}),  # 6 vs 0 still holds,
           "bf16-qknorm-always": arm(0, OK, {1: {"collapse": 12}})},         # the losses match:
          "not reproduced", id="guard collapses in one seed"),               # only "never" fails
    param({"bf16-guard": arm(8, TRIG, {1: {"trigger": 12}})}, "not reproduced", id="trigger after the collapse"),
    param({"bf16-guard": arm(8, TRIG, {1: {"trigger": 10}})}, "not reproduced", id="trigger at the collapse step"),
    param({"bf16-guard": arm(8, TRIG, {1: {"trigger": 8}})}, "reproduced", id="the action starts a step before"),
    param({"bf16-guard": arm(8, TRIG, {1: {"trigger": 9}})}, "not reproduced",
          id="the action starts at the collapse step"),
    param({"bf16-guard": arm(8, TRIG, {1: OK})}, "not reproduced", id="never triggers in one seed"),
    param({"bf16-guard": arm(8, TRIG, {8: OK})}, "reproduced", id="no trigger where bf16 did not collapse"),
    param({"bf16-guard": arm(8, TRIG, {3: {**TRIG, "val": 2.9 + TOL + 0.01}})}, "not reproduced",
          id="val gap LOSS_TOL+0.01 in one seed"),
    param({"bf16-guard": arm(8, TRIG, {3: {**TRIG, "val": 2.9 - TOL - 0.01}})}, "not reproduced",
          id="val gap -(LOSS_TOL+0.01) in one seed"),
    param({"bf16-guard": arm(8, {**TRIG, "val": 2.9 + TOL - 0.01, "loss": 3.0 - TOL + 0.01})}, "reproduced",
          id="gaps LOSS_TOL-0.01 in every seed"),
    param({"bf16-guard": arm(8, TRIG, {3: {**TRIG, "loss": 3.0 + TOL + 0.01}})}, "not reproduced",
          id="train gap LOSS_TOL+0.01 in one seed"),
    param({"bf16-qknorm-always": arm(0, OK, {8: UNFINISHED})}, "not reproduced", id="reference unfinished"),
    param({"bf16-qknorm-always": arm(0, OK, {8: None})}, "not reproduced", id="reference seed missing"),
    param({"bf16-guard": arm(8, TRIG, {8: None})}, "not reproduced", id="guard seed missing"),
    param({"bf16-qknorm-always": []}, "not run", id="no reference runs"),
])
def test_rule_2(tmp_path, changes, expected):
    assert judge(tmp_path, "2", {**RULE2, **changes}) == expected


def test_rule_2_text(tmp_path):
    text = rows(tmp_path, {**RULE2, "bf16-guard": arm(8, TRIG, {1: {"trigger": 12}, 8: {**TRIG, "val": 2.95}})})["2"][2]
    assert "steps from the guard's action to the unguarded collapse, by seed: seed1 -3, seed2 4, " in text
    assert "largest gap to bf16-qknorm-always: train 0.000, val 0.050 nat (tolerance 0.03)" in text
    text = rows(tmp_path / "b", {**RULE2, "bf16-qknorm-always": arm(0, OK, {8: UNFINISHED})})["2"][2]
    assert "train inf, val inf" in text


# --------------------------------------------------------------------------------------------------
# Rule 2v: on healthy training fp32-guard never triggers, and dormant ends within LOSS_TOL of fp32

RULE2V = {"fp32": arm(0, OK), "fp32-guard": arm(0, OK)}


@pytest.mark.parametrize("changes, expected", [
    param({}, "reproduced", id="dormant, same val loss"),
    param({"fp32-guard": arm(0, OK, {3: TRIG})}, "not reproduced", id="triggers in one seed"),
    param({"fp32-guard": arm(0, OK, {3: {"val": 2.9 + TOL + 0.01}})}, "not reproduced", id="val +LOSS_TOL+0.01"),
    param({"fp32-guard": arm(0, OK, {3: {"val": 2.9 - TOL - 0.01}})}, "not reproduced", id="val -LOSS_TOL-0.01"),
    param({"fp32-guard": arm(8, {"val": 2.9 + TOL - 0.01})}, "reproduced", id="val +LOSS_TOL-0.01 everywhere"),
    param({"fp32-guard": arm(0, OK, {3: UNFINISHED})}, "not reproduced", id="guard run unfinished"),
    param({"fp32-guard": arm(0, OK, {3: None})}, "not reproduced", id="guard seed missing"),
    param({"fp32": []}, "not run", id="no fp32 runs"),
])
def test_rule_2v(tmp_path, changes, expected):
    assert judge(tmp_path, "2v", {**RULE2V, **changes}) == expected


@pytest.mark.parametrize("fp32_seed8", [UNFINISHED, None], ids=["unfinished", "missing"])
def test_rule_2v_counts_an_unfinished_reference_against_it(tmp_path, fp32_seed8):
    # fp32-guard's seed 8 ended 1 nat above the others, and its fp32 run is unfinished or missing:
    # its dormant cost is unknown, scored the way that hurts the claim, so the rule must fail
    arms = {"fp32": arm(0, OK, {8: fp32_seed8}), "fp32-guard": arm(0, OK, {8: {"val": 3.9}})}
    assert judge(tmp_path, "2v", arms) == "not reproduced"


# --------------------------------------------------------------------------------------------------
# Rules 3 and 3+: at some dose, the coherent error runs away through QK; its QK-only fix does not

def inject(site, dose, coherence=1.0, fix=False):
    return sweep.inject_arm(site, dose, coherence, fix)[0]


def grid(sites, coherences, fix):
    """Every arm of a dose grid, healthy."""
    return {inject(s, d, c, f): arm(0, OK) for s in sites for d in sweep.DOSES for c in coherences
            for f in ((False, True) if fix else (False,))}


# The paired no-error arm: max logit 10, sigmas flat. An error arm runs away beyond it: max logit >=
# RUNAWAY_LOGIT and LOGIT_RATIO x its own; through QK: sigma(W_q or W_k) x8 (SIGMA_RATIO x the
# no-error run's 1 and x the others').
NOERR = {sweep.NO_ERROR: arm(0, OK)}


def rule3(site, dose=3.0, k=7, **changes):
    """`site`'s grid and no-error, healthy but for coherence 1 at `dose`: QK runaway in k seeds."""
    return {**grid([site], [1.0], fix=True), **NOERR, sweep.QKNORM_ALONE: arm(0, OK),
            inject(site, dose): arm(k, QK_RUNAWAY), **changes}


@pytest.mark.parametrize("rule, site", [("3", "mlp-out"), ("3 (grad-mlp)", "grad-mlp"), ("3 (grad-wv)", "grad-wv"),
                                        ("3+", "delta")])
@pytest.mark.parametrize("changes, expected", [
    param(lambda s: rule3(s), "reproduced", id="7 of 8 at dose 3"),
    param(lambda s: rule3(s, 0.3, 8), "reproduced", id="8 of 8 at dose 0.3"),
    param(lambda s: rule3(s, **{inject(s, 3.0): arm(7, {"collapse": 10, "growth": {"k": 8.0}})}), "reproduced",
          id="collapses where no-error does not, through W_k"),
    param(lambda s: rule3(s, **{inject(s, 3.0): arm(7, {"collapse": 10, "growth": {"k": 8.0}}),
                                inject(s, 3.0, fix=True): arm(7, {"val": 7.9, "init": 5.6})}), "not reproduced",
          id="the error collapsed (val 8) and the fix never trained (7.9, above its 5.6 at init)"),
    param(lambda s: rule3(s, **{inject(s, 3.0): arm(7, {"collapse": 10, "growth": {"k": 8.0}}),
                                inject(s, 3.0, fix=True): arm(7, {"val": 4.6, "init": 5.6})}), "reproduced",
          id="the error collapsed (val 8), the fix ends 3.4 nat below it, trained: judged against its own error "
             "(the last rule held it to no-error + FIX_TOL)"),
    param(lambda s: rule3(s, **{inject(s, 3.0): arm(7, {**QK_RUNAWAY, "val": float("nan")}),
                                inject(s, 3.0, fix=True): arm(7, {"val": 9.0, "init": 5.6})}), "not reproduced",
          id="the error's val loss NaN, the fix's 9 above its init: the bar is not infinite"),
    param(lambda s: rule3(s, 0.3, 8, **{inject(s, 0.3, fix=True): arm(1, RUNAWAY)}), "not reproduced",
          id="the fix fails in 1 of the 8 seeds where the error ran away: counted against (7 vs 1), not a tie"),
    param(lambda s: rule3(s, **{inject(s, 3.0): arm(7, {"logit": 0.99 * R, "growth": {"q": 8.0}})}),
          "not reproduced", id="max logit just below RUNAWAY_LOGIT"),
    param(lambda s: rule3(s, **{sweep.NO_ERROR: arm(8, {"logit": 2 * R})}), "not reproduced",
          id="the no-error run's logits run away too (the old rule passed this)"),
    param(lambda s: rule3(s, **{sweep.NO_ERROR: arm(8, {"logit": 0.25 * R})}), "not reproduced",
          id="max logit under LOGIT_RATIO x the no-error run's"),
    param(lambda s: rule3(s, **{sweep.NO_ERROR: arm(8, {"growth": {"q": 4.0}})}), "reproduced",
          id="QK growth exactly SIGMA_RATIO x the no-error run's"),
    param(lambda s: rule3(s, **{sweep.NO_ERROR: arm(8, {"growth": {"q": 4.1}})}), "not reproduced",
          id="QK growth under SIGMA_RATIO x the no-error run's (the old rule passed this)"),
    param(lambda s: rule3(s, **{inject(s, 3.0): arm(7, {"logit": 2 * R, "growth": {"q": 8.0, "v": 8.0}})}),
          "reproduced", id="sigma_v grows as much: QK is a channel all the same (the last rule asked for the only one)"),
    param(lambda s: rule3(s, k=4), "not reproduced", id="4 of 8"),
    param(lambda s: rule3(s, k=6), "not reproduced", id="6 of 8: p=1/64 > ALPHA/5"),
    param(lambda s: rule3(s, **{inject(s, 3.0, fix=True): arm(2, RUNAWAY)}), "not reproduced",
          id="the fix runs away in two of those seeds: 5 vs 0"),
    param(lambda s: rule3(s, **{inject(s, 3.0, fix=True): arm(2, {"val": 2.9 + thresholds.FIX_TOL + 0.01})}),
          "not reproduced", id="the fix ends FIX_TOL above the error run in two"),
    param(lambda s: rule3(s, **{inject(s, 3.0, fix=True): arm(8, {"val": 2.9 + thresholds.FIX_TOL - 0.01})}),
          "reproduced", id="the fix within FIX_TOL"),
    param(lambda s: rule3(s, **{inject(s, 3.0): arm(7, {**QK_RUNAWAY, "val": 3.5}),
                                inject(s, 3.0, fix=True): arm(7, {"val": 3.45})}), "reproduced",
          id="the error also harms through other channels; the fix ends below it, 0.55 above no-error "
             "(the old rule, against no-error, failed this)"),
    param(lambda s: rule3(s, **{inject(s, 3.0, fix=True): arm(8, {"logit": 0.3 * R})}), "not reproduced",
          id="the fix keeps the runaway's scale, a third of RUNAWAY_LOGIT (the old rule, beyond no-error only, "
             "passed this)"),
    param(lambda s: rule3(s, **{inject(s, 3.0, fix=True): arm(2, UNFINISHED)}), "not reproduced",
          id="the fix unfinished in two of those seeds"),
    param(lambda s: rule3(s, **{sweep.NO_ERROR: arm(0, OK, {1: UNFINISHED})}), "not reproduced",
          id="the no-error run unfinished in one of those seeds"),
    param(lambda s: rule3(s, **{sweep.NO_ERROR: []}), "not run",
          id="no no-error runs: an arm the rule reads never ran, so it is not run (it said not reproduced)"),
    param(lambda s: rule3(s, k=7, **{sweep.NO_ERROR: arm(0, OK) + [OK] * 4}), "reproduced",
          id="the no-error arm's extra seeds (runs of claims 1, 2v) are not the rule's"),
    param(lambda s: rule3(s, **{inject(s, 30.0, fix=True): arm(8, RUNAWAY)}), "reproduced",
          id="the fix runs away at another dose"),
    param(lambda s: rule3(s, k=4, **{inject(s, 30.0): arm(0, OK, dict.fromkeys(range(5, 9), QK_RUNAWAY))}),
          "not reproduced", id="4 seeds at one dose, 4 at another"),
    param(lambda s: rule3(s, **{inject(s, 30.0, fix=True): []}), "reproduced",
          id="a missing fix arm counts against its own dose only"),
    param(lambda s: rule3(s, **{inject(s, 3.0, fix=True): []}), "not reproduced",
          id="the fix arm missing at the dose that ran away"),
])
def test_rules_3_and_3plus(tmp_path, rule, site, changes, expected):
    assert judge(tmp_path, rule, changes(site)) == expected


@pytest.mark.parametrize("doses, runaways, expected", [
    param((3.0, 30.0), 6, "reproduced", id="6 of 8 with 2 doses run (p = 1/64 < 0.05 / 2)"),
    param(sweep.DOSES, 6, "not reproduced", id="6 of 8 with 5 doses run (1/64 > 0.05 / 5)"),
    param((), 0, "not run", id="no dose of the site run"),
])
def test_rule_3_judges_the_doses_that_were_run(tmp_path, doses, runaways, expected):
    arms = {inject("mlp-out", d, 1.0, f): arm(runaways if d == 3.0 and not f else 0, QK_RUNAWAY if not f else OK)
            for d in doses for f in (False, True)}
    assert judge(tmp_path, "3", {**arms, **NOERR} if arms else {"bf16": arm(0, OK)}) == expected


def test_a_rules_doses_are_those_its_own_arms_ran(tmp_path):
    # claim 4's random-sign arm at dose 0.3 is not a dose of claim 3, whose arms ran at 3 and 30 only
    arms = {inject("mlp-out", d, 1.0, f): arm(6 if d == 3.0 and not f else 0, QK_RUNAWAY if not f else OK)
            for d in (3.0, 30.0) for f in (False, True)}
    groups = write_arms(tmp_path, {**arms, **NOERR, inject("mlp-out", 0.3, 0.5): arm(0, OK)})
    assert "mlp-out: doses run 3, 30; " in text_report(groups, str(tmp_path))



def test_rule_3_uses_the_bonferroni_threshold_and_lists_the_fix_gaps(tmp_path):
    assert thresholds.ALPHA / len(sweep.DOSES) == pytest.approx(0.05 / 5)
    text = rows(tmp_path, {**rule3("mlp-out"), inject("mlp-out", 30.0): arm(6, QK_RUNAWAY),
                           inject("mlp-out", 30.0, fix=True): arm(8, {"val": 2.95}),
                           sweep.QKNORM_ALONE: arm(8, {"val": 2.97})})["3"][2]
    assert "7 seeds one way, 0 the other, p = 0.00781 (threshold 0.01) -> holds" in text
    assert "6 seeds one way, 0 the other, p = 0.0156 (threshold 0.01) -> fails" in text
    assert text.count("sign test, ") == len(sweep.DOSES)
    assert "mlp-out 30: fix's val loss - the error's, median +0.050 (+0.050 to +0.050); - no-error's, median " \
           "+0.050 (+0.050 to +0.050) (FIX_TOL 0.1)" in text
    assert "QK-norm's own cost, fp32-qknorm-always val loss - fp32's: median +0.070 (+0.070 to +0.070)" in text


def test_an_underpowered_dose_rule_is_inconclusive_at_its_own_threshold(tmp_path):
    # 5 seeds: all one way gives p = 1/32 < ALPHA but > ALPHA / 5, the dose grid's threshold, so no
    # dose can hold and the failed rule is inconclusive (before: "not reproduced")
    five = lambda runs: runs[:5]
    arms = {name: five(runs) for name, runs in rule3("mlp-out", k=5).items()}
    row = rows(tmp_path, arms)["3"]
    assert row[1] == "inconclusive" and "this rule's threshold; run at least 7" in row[2]
    # rule 1 (no grid): 5 seeds can reach p < ALPHA, so a failure there is a refutation
    assert judge(tmp_path / "r1", "1", {"bf16": [OK] * 5, "fp32": [OK] * 5, "bf16-safemax": [OK] * 5}) == \
        "not reproduced"


# --------------------------------------------------------------------------------------------------
# Rule 4: at each site and dose, seed by seed, the coherent error's max logit against the random-sign
# one's; coherence must raise it at some dose of both sites and reverse it at none

def rule4(mlp_out=3.0, delta=3.0, **cells):
    """The grid, healthy (max logit 10), but coherence 1 at the given dose of each site (None: none):
    max logit 2 x RUNAWAY_LOGIT in 7 of 8 seeds (p = 1/128 < ALPHA / 5)."""
    arms = {**grid(sweep.CLAIM4_SITES, sweep.COHERENCES, fix=False), **NOERR}
    for site, dose in (("mlp-out", mlp_out), ("delta", delta)):
        if dose is not None:
            arms[inject(site, dose)] = arm(7, RUNAWAY)
    return {**arms, **cells}


@pytest.mark.parametrize("arms, expected", [
    param(rule4(), "reproduced", id="coherent higher at dose 3 of both sites"),
    param(rule4(delta=30.0), "reproduced", id="each site at its own dose"),
    param(rule4(**{inject("delta", 3.0, 0.5): arm(7, RUNAWAY)}), "not reproduced",
          id="random signs as high at the only dose where coherent ones rise"),
    param(rule4(delta=None), "not reproduced", id="only mlp-out"),
    param(rule4(mlp_out=None), "not reproduced", id="only delta"),
    param(rule4(**{inject("mlp-out", 3.0): arm(6, RUNAWAY)}), "not reproduced",
          id="6 of 8: p = 1/64 > ALPHA / 5"),
    param(rule4(**{inject("mlp-out", 0.3, 0.5): arm(8, {"logit": 400.0}),
                   inject("mlp-out", 0.3): arm(0, {"logit": 150.0})}), "refuted",
          id="random signs higher below RUNAWAY_LOGIT at a dose where neither runs away "
             "(the old rule, thresholded at a runaway, passed this)"),
    param(rule4(**{inject("mlp-out", 30.0, 0.5): arm(8, RUNAWAY)}), "refuted",
          id="random signs run away at a dose where coherent ones do not"),
    param(rule4(**{inject("mlp-out", 0.3, 0.5): arm(7, {"logit": 400.0})}), "reproduced",
          id="random signs higher in 7 of 8: p = 1/128, not a reversal at ALPHA / 10 cells"),
    param(rule4(**{inject("mlp-out", 0.3, 0.5): arm(8, {"logit": 10.01})}), "reproduced",
          id="random signs higher by 0.1%: under LOGIT_GAP, no reversal"),
    param(rule4(**{inject("mlp-out", 0.3, 0.5): arm(8, {"logit": 400.0}),
                   inject("mlp-out", 0.3): arm(8, {"logit": 150.0, "collapse": 10})}), "reproduced",
          id="coherent errors collapse below the random-sign logits: a collapse ranks above (not a reversal)"),
    param(rule4(**{inject("mlp-out", 3.0): arm(7, {"collapse": 5}), inject("mlp-out", 3.0, 0.5): arm(7, {"collapse": 12})}),
          "reproduced", id="both collapse in 7 seeds, the coherent ones earlier: decided, not tied (the last rule "
                           "tied them)"),
    param(rule4(**{inject("mlp-out", 3.0): arm(7, {"collapse": 12}), inject("mlp-out", 3.0, 0.5): arm(8, {"collapse": 12})}),
          "not reproduced", id="both collapse at the same step: tied"),
    param(rule4(**{inject("mlp-out", 3.0): arm(8, {"collapse": 12}), inject("mlp-out", 3.0, 0.5): arm(8, {"collapse": 5})}),
          "refuted", id="both collapse, the random-sign ones earlier in every seed: a reversal"),
    param(rule4(**{inject("mlp-out", 3.0, 0.5): arm(0, OK, {8: RUNAWAY})}), "not reproduced",
          id="random signs higher in the one other seed: 7 vs 1, p = 0.035 > ALPHA / 5"),
    param(rule4(**{inject("mlp-out", 3.0, 0.5): arm(0, OK, {8: RUNAWAY}), inject("mlp-out", 3.0): arm(7, RUNAWAY,
                   {8: UNFINISHED})}), "not reproduced",
          id="... and the coherent run of that seed unfinished: counted against raising, not dropped"),
    param(rule4(**{inject("mlp-out", 3.0, 0.5): arm(0, OK, {1: UNFINISHED, 2: UNFINISHED})}),
          "not reproduced", id="random signs unfinished in two of the seven: 5 left, p = 1/32 > ALPHA / 5"),
    param(rule4(**{inject("mlp-out", 3.0): arm(0, OK, dict.fromkeys(range(1, 8), UNFINISHED))}),
          "not reproduced", id="coherent unfinished: it cannot support the claim, nor refute it"),
    param(rule4(**{inject("delta", d, c): [] for d in sweep.DOSES for c in sweep.COHERENCES}), "not run",
          id="no dose of one site run: not run (it said not reproduced)"),
    param(rule4(**{inject("delta", d, 0.5): [] for d in sweep.DOSES}), "not run",
          id="no random-sign arm at one site: not run"),
    param({inject(s, d, c): [] for s in sweep.CLAIM4_SITES for d in sweep.DOSES for c in sweep.COHERENCES},
          "not run", id="nothing of the grid run"),
])
def test_rule_4(tmp_path, arms, expected):
    assert judge(tmp_path, "4", arms) == expected


def test_rule_4_says_which_arms_of_a_site_not_run_make_it_not_run(tmp_path):
    # a site whose arms never ran is no evidence against the claim: the rule is not run, naming them (it counted
    # the site against the claim, "not reproduced")
    row = rows(tmp_path, rule4(**{inject("delta", d, c): [] for d in sweep.DOSES for c in sweep.COHERENCES}))["4"]
    assert row[1] == "not run"
    assert row[2].splitlines()[1] == "no runs of inject-delta-0.3-c1, inject-delta-0.3-c0.5, inject-delta-1-c1 and 7 " \
                                     "more arms"


# --------------------------------------------------------------------------------------------------
# A fork's natural experiment: one claim rerun, part of its grid. The committed rule's thresholds hold
# whatever ran, and a rule whose arms never ran is not run, not refuted.

def one_dose(site, dose, k, seeds=N, **changes):
    """Claim 3 rerun at one dose of one site: its error runs away through QK in k seeds (the rest healthy), its
    fix and the no-error runs healthy."""
    return {inject(site, dose): arm(k, QK_RUNAWAY)[:seeds], inject(site, dose, fix=True): arm(0, OK)[:seeds],
            sweep.NO_ERROR: arm(0, OK)[:seeds], **changes}


@pytest.mark.parametrize("site, dose, k, expected, threshold", [
    param("delta", 3.0, 6, "not reproduced", "0.01", id="delta, 6 of 8 (p = 1/64): ALPHA / 5, as committed (the "
          "old rule divided by the one dose run and passed it)"),
    param("delta", 3.0, 8, "reproduced", "0.01", id="delta, 8 of 8 (p = 1/256) passes ALPHA / 5"),
    param("mlp-out", 10.0, 5, "not reproduced", "0.0167", id="mlp-out, 5 of 8 (p = 1/32): ALPHA / 3, the committed "
          "grid's three doses"),
    param("mlp-out", 10.0, 6, "reproduced", "0.0167", id="mlp-out, 6 of 8 (p = 1/64) passes ALPHA / 3"),
])
def test_a_rerun_of_one_dose_is_judged_at_the_committed_threshold(tmp_path, site, dose, k, expected, threshold):
    label = {"delta": "3+", "mlp-out": "3"}[site]
    row = rows(tmp_path, one_dose(site, dose, k))[label]
    assert row[1] == expected
    assert f"p = {stats.binom_tail(k, k):.3g} (threshold {threshold}) -> " in row[2]
    assert f"{site}: doses run {dose:g}; each tested at ALPHA / {len(thresholds.COMMITTED_DOSES[site])}, " in row[2]
    assert thresholds.COMMITTED_DOSES == {"mlp-out": (3.0, 10.0, 30.0), "grad-mlp": sweep.DOSES,
                                          "grad-wv": sweep.DOSES, "delta": sweep.DOSES}, "the committed grids"


def test_more_doses_than_committed_divide_by_the_doses_run(tmp_path):
    # mlp-out committed three doses; the whole grid run (five) is held to ALPHA / 5, never looser
    arms = {**one_dose("mlp-out", 3.0, 6), **{inject("mlp-out", d, 1.0, f): arm(0, OK) for d in (0.3, 1.0, 10.0, 30.0)
                                              for f in (False, True)}}
    row = rows(tmp_path, arms)["3"]
    assert row[1] == "not reproduced" and "(threshold 0.01) -> fails" in row[2]


def test_an_aa_rerun_of_one_dose_does_not_pass(tmp_path):
    # A/A: the "error" arm's runs are the no-error arm's own (the same logs), its fix healthy: no effect to find
    runs = [{"logit": 10.0 + seed, "growth": {"q": 1.5}} for seed in range(N)]
    for label, site in (("3", "mlp-out"), ("3+", "delta")):
        arms = {inject(site, 10.0): runs, inject(site, 10.0, fix=True): arm(0, OK), sweep.NO_ERROR: runs}
        assert judge(tmp_path / site, label, arms) == "not reproduced", site
    # claim 4's A/A: the coherent and the random-sign error the same runs at both sites: no raise, no reversal
    same = {inject(s, 3.0, c): [RUNAWAY] * 4 + [OK] * 4 for s in sweep.CLAIM4_SITES for c in sweep.COHERENCES}
    assert judge(tmp_path / "c4", "4", {**same, **NOERR}) == "not reproduced"


def test_a_rerun_of_one_claim_leaves_every_other_rule_not_run(tmp_path):
    # claim 3's arms at one dose: claim 4, whose random-sign arms never ran, is not run (it said not reproduced:
    # the coherent arms ran, so its grid counted the missing ones against it); so is every other rule
    got = {label: row[1] for label, row in rows(tmp_path, one_dose("mlp-out", 10.0, 8)).items()}
    assert got.pop("3") == "reproduced"
    assert set(got.values()) == {"not run"}, got
    # claim 4 with its coherent arms at both sites and no random-sign one: not run, naming them
    coherent = {**{inject(s, 3.0): arm(7, RUNAWAY) for s in sweep.CLAIM4_SITES}, **NOERR}
    row = rows(tmp_path / "c4", coherent)["4"]
    assert row[1] == "not run" and row[2].splitlines()[1].startswith("no runs of inject-mlp-out-3-c0.5, ")


def test_rule_4_reports_each_dose_on_a_scale_and_the_dose_response(tmp_path):
    arms = rule4(**{inject("delta", 30.0, 0.5): arm(8, {"logit": 100.0, "growth": {"q": 3.0}})})
    row = rows(tmp_path, arms)["4"]
    assert "mlp-out: doses run 0.3, 1, 3, 10, 30 (thresholds: raises ALPHA / 5, reverses ALPHA / 10, the committed " \
           "grid's counts or the doses run where more ran)" in row[2]
    assert "mlp-out 3: max logit / no-error's, median coherent 200 vs random sign 1 (collapsed, seed and step: " \
           "coherent none; random sign none); coherent 2x higher or earlier collapsed in 7 seeds, random sign in 0 " \
           "(0 unfinished or missing, counted against raising); p = 0.00781 (raises), 1 (reverses) -> raises" in row[2]
    assert "delta 30: max logit / no-error's, median coherent 1 vs random sign 10 (collapsed, seed and step: " \
           "coherent none; random sign none); coherent 2x higher or earlier collapsed in 0 seeds, random sign in 8 " \
           "(0 unfinished or missing, counted against raising); p = 1 (raises), 0.00391 (reverses) -> reverses; " \
           "sigma(W_q, W_k) growth / no-error's higher for coherent in 0, random sign in 8" in row[2]
    assert row[1] == "refuted" and "refuted: random-sign errors run away further than coherent ones at delta 30" \
        in row[2]
    table = tables.dose_table(loading.load_runs(str(tmp_path)))
    assert ["delta", "coherence 1", "-", "-", "0/8", "-", "-"] not in table   # every dose has runs
    assert ["mlp-out", "coherence 1", "0/8", "0/8", "7/8", "0/8", "0/8"] in table


# --------------------------------------------------------------------------------------------------
# Rule 5: the source and each control that can always be carried out run away where the top-k probe
# does not

def rule5(source="bf16"):
    judged = {f"{source}-probe-{name}": arm(7, RUNAWAY) for name in claim5.PROBE_CONTROLS}
    return {source: arm(7, RUNAWAY), f"{source}-probe-topk": arm(0, OK), **judged,
            f"{source}-probe-equal": arm(7, {**RUNAWAY, "probe_share": 1.0}, rest={"probe_share": 1.0}),
            f"{source}-probe-v-topk": arm(7, COLLAPSE), f"{source}-probe-mlp-topk": arm(7, RUNAWAY), **NOERR}


@pytest.mark.parametrize("changes, expected", [
    param({}, "reproduced", id="7 of 8, each control 7 of 8"),
    param({"bf16-probe-shrink": arm(0, OK)}, "not reproduced",
          id="the same shrink of the whole update stops it too: step size (the old rule did not test it)"),
    param({"bf16-probe-nextk": arm(0, OK)}, "not reproduced", id="the next k directions stop it too"),
    param({"bf16-probe-fixed": arm(0, OK)}, "not reproduced",
          id="a fixed random subspace stops it too (the old rule only reported it)"),
    param({"bf16-probe-equal": arm(0, {"probe_share": 0.5})}, "reproduced",
          id="the equal-energy control fell short and did not run away: reported (the old rule could not pass "
             "where the update's energy sits in its top-k)"),
    param({"bf16-probe-fixed": arm(4, RUNAWAY)}, "not reproduced", id="a control 4 of 8"),
    *(param({c: arm(0, OK)}, "reproduced", id=f"{c} does not run away: reported, not judged")
      for c in ("bf16-probe-v-topk", "bf16-probe-mlp-topk")),
    param({"bf16-probe-topk": arm(3, RUNAWAY)}, "not reproduced", id="topk runs away too: 4 vs 0"),
    param({"bf16-probe-topk": arm(3, UNFINISHED)}, "not reproduced", id="topk unfinished in 3 seeds"),
    param({"bf16": arm(4, RUNAWAY)}, "not reproduced", id="bf16 4 of 8"),
    param({"bf16-probe-shrink": []}, "not run", id="the shrink control not run"),
    param({"bf16-probe-equal": []}, "reproduced", id="a reported control not run"),
])
def test_rule_5(tmp_path, changes, expected):
    assert judge(tmp_path, "5", {**rule5(), **changes}) == expected


PROBE_LONG = {"args": {"max_steps": sweep.LONG_STEPS}}   # claim 5's -long arms set their own horizon
KEPT = {"q_update": [1.0, 1.0], "q_removed": [0.8, 0.8], "q_kept": [0.6, 0.6],
        "k_update": [1.0, 1.0], "k_removed": [0.8, 0.8], "k_kept": [0.6, 0.6]}   # the shrink left 0.6 of the norm


@pytest.mark.parametrize("changes, expected, says", [
    param({"bf16-probe-shrink-long": arm(7, {**RUNAWAY, **PROBE_LONG}, rest=PROBE_LONG)}, "reproduced",
          "sign test, bf16-probe-shrink-long over bf16-probe-topk-long: 7 seeds one way, 0 the other",
          id="the shrink runs away at the long horizon where top-k does not"),
    param({"bf16-probe-shrink-long": arm(7, {**RUNAWAY, **PROBE_LONG}, rest=PROBE_LONG), "bf16-probe-shrink": arm(0, OK)},
          "reproduced", "(at 2500 steps below: reported, not judged)",
          id="the 600-step shrink's holds no longer decide where the long arms ran"),
    param({"bf16-probe-shrink-long": arm(0, PROBE_LONG, rest=PROBE_LONG)}, "not reproduced",
          "the shrink alone stopped the runaway (7 seeds, p = 0.00781)",
          id="the shrink holds at the long horizon, its logits never past the threshold: step size"),
    param({"bf16-probe-shrink-long": arm(7, {**RUNAWAY, **PROBE_LONG}, rest=PROBE_LONG),
           "bf16-probe-topk-long": arm(5, {**RUNAWAY, **PROBE_LONG}, rest=PROBE_LONG)}, "not reproduced",
          "not reproduced at this scale: the top-k probe itself ran away by 2500 steps in 5 of 8 seeds",
          id="the probe itself runs away at the long horizon: it delays, it does not stop"),
    param({"bf16-probe-shrink-long": arm(7, {**RUNAWAY, **PROBE_LONG}, rest=PROBE_LONG),
           "bf16-probe-topk-long": arm(5, {**RUNAWAY, **PROBE_LONG}, rest=PROBE_LONG)}, "not reproduced",
          "bf16-probe-topk-long's runaway began later than bf16-probe-shrink-long's in 2 of 8 seeds (one that never "
          "ran away counted as later), earlier in 0 (sign test p = 0.25), by a median 0 steps over the 5 seeds where "
          "both ran away",
          id="the delay is reported: a run that never ran away began its runaway later than any that did"),
    param({"bf16-probe-shrink-long": arm(7, {**RUNAWAY, **PROBE_LONG}, rest=PROBE_LONG),
           "bf16-probe-topk-long": arm(5, {**COLLAPSE, **PROBE_LONG}, rest=PROBE_LONG)}, "not reproduced",
          "ran away by 2500 steps in 5 of 8 seeds (it delays the runaway; it does not stop it); in 5 of them by a "
          "collapse, its max logit under RUNAWAY_LOGIT",
          id="a probe run that ran away by collapsing, its logits low, is said to have"),
    param({"bf16-probe-shrink-long": arm(5, {**RUNAWAY, **PROBE_LONG}, rest=PROBE_LONG,
                                         edits={3: {**UNFINISHED, **PROBE_LONG}})},
          "not reproduced", "4 seeds one way, 0 the other, p = 0.0625",
          id="a long shrink unfinished counts against the claim (5 would pass, 4 do not)"),
])
def test_rule_5_judges_the_shrink_at_the_long_horizon(tmp_path, changes, expected, says):
    arms = {**rule5(), "bf16-probe-topk-long": arm(0, PROBE_LONG, rest=PROBE_LONG), **changes}
    row = rows(tmp_path, arms)["5"]
    assert row[1] == expected and says in row[2], row[2]


def test_rule_5_calls_a_late_shrink_hold_too_short(tmp_path):
    # the source takes 10 steps from the threshold (200) to RUNAWAY_LOGIT; a shrink that left 0.6 of the norm
    # needs 10 / 0.6 = 17 steps after its own first crossing: crossing at step 15 of 20 leaves 5, too short
    short = {"args": {"max_steps": 20}}   # the long arms' horizon, here the 20 steps the runs log
    climb = {"logit": lambda step: 2 * R if step >= 12 else 300.0 if step >= 2 else 10.0}
    late = {"logit": lambda step: 300.0 if step >= 15 else 10.0, "probe": KEPT, **short}
    arms = {**rule5(), "bf16": arm(7, climb), "bf16-probe-topk-long": arm(0, short, rest=short),
            "bf16-probe-shrink-long": arm(8, late)}
    text = rows(tmp_path, arms)["5"][2]
    assert "(needing 10 steps / its update norm left after its first logit past the threshold): seed1 too short" in text
    assert "the shrink alone stopped the runaway" not in text
    early = {**late, "logit": lambda step: 300.0 if step >= 1 else 10.0}   # 19 steps after: enough
    text = rows(tmp_path / "b", {**arms, "bf16-probe-shrink-long": arm(8, early)})["5"][2]
    assert "threshold): seed1 held" in text and "the shrink alone stopped the runaway (7 seeds" in text


def with_gain(path, gain, sigma):
    """Rewrite a write_run log as train.py logs the pre-attention gain: every head's sigma(W_q,h) =
    sigma(step), sigma(W_k,h) = 1, and W_q,h diag(g), W_k,h diag(g) each `gain(step)` times those
    (attn_gain_rms = gain)."""
    log = os.path.join(path, "log.jsonl")
    records = [json.loads(line) for line in open(log)]
    for r in records:
        if "event" not in r:
            q, g = sigma(r["step"]), gain(r["step"])
            r.update(sigma_q_head=[[q, q], [q, q]], sigma_k_head=[[1.0, 1.0], [1.0, 1.0]],
                     sigma_q_gain_head=[[q * g, q * g], [q * g, q * g]], sigma_k_gain_head=[[g, g], [g, g]],
                     attn_gain_rms=[g, g])
    with open(log, "w") as f:
        f.write("".join(json.dumps(r) + "\n" for r in records))


@pytest.mark.parametrize("gain, sigma, escapes", [
    param(lambda s: 1.0 + s / 5, lambda s: 1.0, True, id="the gain grows 3x, sigma flat: escapes through the "
                                                         "gain"),
    param(lambda s: 1.0, lambda s: 1.0 + s, False, id="sigma grows, the gain flat: no escape through it"),
])
def test_claim_5s_escape_route_splits_the_logit_into_sigma_gain_and_rest(tmp_path, gain, sigma, escapes):
    climb = {"logit": lambda step: 10.0 * 1.7 ** step}   # past 1000 at step 9
    arm_ = "bf16-probe-topk-long-gain"
    for seed in range(1, N + 1):
        with_gain(write_run(tmp_path, arm_, seed, **climb), gain, sigma)
        write_run(tmp_path, "bf16-probe-topk-long", seed, **climb)
    groups = loading.load_runs(str(tmp_path))
    text = "\n".join(claim5.escape_lines(common.Claim(groups, [arm_, "bf16-probe-topk-long"]), "bf16"))
    assert "their logged losses bit for bit bf16-probe-topk-long's in 8/8; ran away in 8" in text
    if escapes:   # 1.7^9 = 119x: the gain's part (1 + 9/5)^2 = 7.84x, the rest 15.1x
        assert ("seed1 logit x119 = sigma product x1, gain x7.84, rest x15.1 (layer 1, gain rms 1.00 -> "
                "2.80, to step 9)") in text
        assert ("in 8 of 8 seeds that ran away, less in 0: sign test p = 0.00391 -> the logit escapes "
                "through the gain") in text
    else:
        assert ("in 0 of 8 seeds that ran away, less in 8: sign test p = 1 -> no escape through the gain "
                "shown") in text
    del groups[arm_]
    assert claim5.escape_lines(common.Claim(groups, ["bf16-probe-topk-long"]), "bf16") == []   # none rerun


def test_claim_5s_sigma_share_from_logs_without_the_gain(tmp_path):
    # the max logit x1.7 a step (x119 by step 9, past RUNAWAY_LOGIT); every head's sigma product x10 over the
    # run's 19 steps (x10^(9/19) = 2.97 by step 9): the sigma product explains ln 2.97 / ln 119 = 0.23
    for seed in range(1, 4):
        write_run(tmp_path, "bf16-probe-topk-long", seed, logit=lambda step: 10.0 * 1.7 ** step, qk=(0, 10.0))
    write_run(tmp_path, "bf16-probe-topk-long", 4)   # no runaway: not counted
    c = common.Claim(loading.load_runs(str(tmp_path)), ["bf16-probe-topk-long"])
    line, = claim5.sigma_share_line(c, ["bf16-probe-topk-long", "bf16"])
    assert line.endswith("bf16-probe-topk-long 0.23 (0.23 to 0.23, 3 runaways)")


def test_rule_5_says_step_size_and_reports_energy_and_cost(tmp_path):
    norms = {"q_update": [1.0, 2.0], "q_removed": [0.8, 1.6], "q_kept": [0.6, 1.2],
             "k_update": [1.0, 1.0], "k_removed": [0.8, 0.8], "k_kept": [0.6, 0.6]}
    shrunk = {**norms, "q_removed": [0.4, 0.8], "k_removed": [0.4, 0.4]}   # ||dW|| - ||kept||: not orthogonal
    arms = {**rule5("assay"), "assay-probe-topk": arm(8, {"val": 2.95, "probe": norms}),
            "assay-probe-shrink": arm(8, {"probe": shrunk})}
    table = rows(tmp_path, arms)
    assert "5" not in table and table["5 (assay)"][1] == "not reproduced"
    text = table["5 (assay)"][2]
    assert "an injected coherent error at the backward's delta" in text
    assert "the shrink alone stopped the runaway (7 seeds, p = 0.00781): the probe works through step size" in text
    assert "assay-probe-topk: share of the W_q, W_k update energy removed, median over seeds 0.640; update norm " \
           "left, 0.600" in text
    assert "assay-probe-shrink: share of the W_q, W_k update energy removed, median over seeds 0.640" in text
    assert "assay-probe-fixed: share" not in text   # nothing logged, nothing said
    missing = {**arms, "assay-probe-shrink": arm(0, OK, dict.fromkeys(range(1, 8)))}   # seed 8 only
    text = rows(tmp_path / "missing", missing)["5 (assay)"][2]
    assert "the shrink alone" not in text, "missing shrink runs are no evidence of step size"
    assert "assay-probe-equal: ran away 7/8" in text and "(a control, reported, not judged)" in text
    assert "loss cost, median final val loss - fp32's: assay-probe-topk +0.050" in text


# --------------------------------------------------------------------------------------------------
# Rule 6: on seeds where the source ran away with enough steps after the trigger (step 5), lr-drop,
# clip and softcap each fail (break down, or let QK grow SIGMA_RATIO x QK-norm's) where QK-norm does
# not, and QK-Clip fails by that same measure in no seed

AFTER = lambda step: 2 * R if step > 6 else 10.0    # logits past RUNAWAY_LOGIT once action is on
BEFORE = lambda step: 2 * R if step <= 5 else 10.0  # ... only up to the trigger, its step included
SOURCE = {"logit": lambda step: 10.0 if step < 5 else 300.0 if step < 8 else 2 * R}   # 200 -> 1000 in 3 steps
COLLAPSED_AFTER = {**TRIG, "collapse": 10}
RAN_AWAY_AFTER = {**TRIG, "logit": AFTER}
WORSE = {**TRIG, "val": 2.9 + TOL + 0.01}
QK_HELD, QK_GROWN = {**TRIG, "qk": (5, 1.5)}, {**TRIG, "qk": (5, 4.0)}   # QK-norm's x1.5; 4 >= 2 x 1.5
ACTIONS = ("bf16-guard-lr-drop", "bf16-guard-clip", "bf16-guard-softcap")
RULE6 = {"bf16": arm(8, SOURCE), "bf16-guard": arm(0, TRIG), "bf16-guard-lr-drop": arm(7, COLLAPSED_AFTER, rest=TRIG),
         "bf16-guard-clip": arm(7, RAN_AWAY_AFTER, rest=TRIG), "bf16-guard-softcap": arm(7, COLLAPSED_AFTER, rest=TRIG),
         "bf16-guard-qkclip": arm(0, TRIG)}
SLOW = {"logit": lambda step: 10.0 if step < 5 else 300.0 if step < 15 else 2 * R}   # 200 -> 1000 in 10 steps
LATE = {"trigger": 18}            # 2 steps after the trigger (of 20), fewer than the source's 3


@pytest.mark.parametrize("changes, expected", [
    param({}, "reproduced", id="each breaks down in 7 of 8"),
    param({"bf16-guard-softcap": arm(8, WORSE)}, "not reproduced",
          id="softcap stays stable, 0.04 nat worse: not a failure"),
    param({"bf16-guard-clip": arm(7, {**TRIG, "logit": BEFORE}, rest=TRIG)}, "not reproduced",
          id="clip's logits past RUNAWAY_LOGIT only up to the trigger"),
    param({"bf16-guard": arm(8, {**TRIG, "logit": BEFORE})}, "reproduced",
          id="QK-norm's logits past RUNAWAY_LOGIT only up to the trigger"),
    param({"bf16-guard": arm(3, RAN_AWAY_AFTER, rest=TRIG)}, "not reproduced", id="QK-norm runs away in 3: 4 vs 0"),
    param({"bf16-guard": arm(8, QK_HELD), "bf16-guard-clip": arm(7, QK_GROWN, rest=QK_HELD)}, "reproduced",
          id="clip holds the logits but lets QK grow 4x where QK-norm's grew 1.5x (the old rule called it working)"),
    param({"bf16-guard": arm(8, QK_HELD), "bf16-guard-clip": arm(7, {**TRIG, "qk": (5, 2.9)}, rest=QK_HELD)},
          "not reproduced", id="QK growth under SIGMA_RATIO x QK-norm's"),
    param({"bf16-guard-clip": arm(7, QK_GROWN, rest=TRIG)}, "not reproduced",
          id="QK-norm's growth not logged: growth cannot fail an action"),
    param({"bf16": arm(4, SOURCE)}, "inconclusive",
          id="the source ran away in 4 seeds: the others reported, 4 too few (the old rule refuted it on all 8)"),
    param({name: arm(6, runs[0], rest=LATE) for name, runs in RULE6.items() if name != "bf16"}, "reproduced",
          id="2 seeds with too few steps after the trigger: reported, 6 judged"),
    param({name: arm(4, runs[0], rest=LATE) for name, runs in RULE6.items() if name != "bf16"}, "inconclusive",
          id="4 seeds with too few steps after the trigger: 4 judged"),
    param({"bf16": arm(4, SOURCE, rest=UNFINISHED), **{a: arm(8, COLLAPSED_AFTER) for a in ACTIONS}},
          "not reproduced", id="the source unfinished in 4 seeds: judged and counted against (4 vs 0 of 8), "
                               "not dropped (4 seeds: inconclusive)"),
    param({"bf16": arm(8, SLOW), "bf16-guard": arm(0, TRIG, dict.fromkeys((7, 8), {**COLLAPSED_AFTER,
                                                                                   "args": {"max_steps": 20}}))},
          "not reproduced", id="QK-norm collapses in seeds 7, 8 and stops at step 12: judged by its 20 planned "
                               "steps, 6 vs 1 (the first version dropped them as too short: 6 vs 0)"),
    param({"bf16-guard": arm(0, TRIG, {8: OK}), **{a: arm(7, RULE6[a][0], {8: OK}) for a in ACTIONS}},
          "reproduced", id="the guard never fired in one seed: a tie there"),
    param({"bf16-guard-qkclip": arm(1, COLLAPSED_AFTER, rest=TRIG)}, "not reproduced",
          id="QK-Clip breaks down in a seed"),
    param({"bf16-guard-qkclip": arm(0, TRIG, {3: UNFINISHED})}, "not reproduced", id="QK-Clip unfinished in a seed"),
    param({"bf16-guard": arm(8, QK_HELD), "bf16-guard-qkclip": arm(8, QK_GROWN)}, "reproduced",
          id="QK-Clip lets QK grow 2x QK-norm's in every seed: reported, not judged (QK-norm's sigma grows "
             "freely "
             "outside its logits; the 2026-12-03 rule failed it)"),
    param({"bf16-guard-qkclip": arm(1, {**TRIG, "val": 2.9 + thresholds.FIX_TOL + 0.01}, rest=TRIG)},
          "not reproduced",
          id="QK-Clip ends FIX_TOL+0.01 above QK-norm's val loss in one seed"),
    param({"bf16-guard-qkclip": arm(8, {**TRIG, "val": 2.9 + thresholds.FIX_TOL - 0.01})}, "reproduced",
          id="QK-Clip ends FIX_TOL-0.01 above QK-norm's in every seed: within its bar"),
    param({"bf16-guard": arm(8, QK_HELD), "bf16-guard-qkclip": arm(8, QK_HELD)}, "reproduced",
          id="QK-Clip's QK growth as QK-norm's"),
    param({"bf16-guard-qkclip": []}, "not run", id="QK-Clip not run"),
    param({"bf16": []}, "not run", id="the source not run"),
    param({"bf16-guard-softcap": arm(4, COLLAPSED_AFTER, rest=TRIG)}, "not reproduced", id="softcap 4 of 8"),
    param({"bf16-guard-lr-drop": []}, "not run", id="lr-drop not run"),
])
def test_rule_6(tmp_path, changes, expected):
    assert judge(tmp_path, "6", {**RULE6, **changes}) == expected


def test_claim_6s_actions_share_one_table_and_its_measures(tmp_path):
    arms = {**RULE6, "bf16-guard": arm(8, QK_HELD), "bf16-guard-qkclip": arm(2, {**QK_GROWN, "val": 3.2},
                                                                               rest=QK_HELD)}
    table = {row[0]: row for row in claim6.action_rows(write_arms(tmp_path, arms), "bf16")}
    assert table["bf16-guard-qkclip"] == ["bf16-guard-qkclip", "QK-side", "2/8", "0/8", "2/8", "1.5", "+0.000"]
    assert table["bf16-guard-clip"][1:4] == ["non-QK", "7/8", "7/8"]
    assert table["bf16-guard"][2] == "0/8" and table["bf16-guard"][-1] == "-"
    arms["bf16-guard-qkclip"] = arm(2, QK_GROWN, rest=QK_HELD)   # grown, not worse: judged on neither
    table = {row[0]: row for row in claim6.action_rows(write_arms(tmp_path / "b", arms), "bf16")}
    assert table["bf16-guard-qkclip"][2:5] == ["0/8", "0/8", "2/8"]


def test_a_qk_side_action_is_held_to_qk_norms_loss_only_where_qk_norm_held(tmp_path):
    groups = write_arms(tmp_path, {"qkclip": [{**TRIG, "val": 4.0}, {**TRIG, "val": 4.0}, COLLAPSED_AFTER],
                                   "qknorm": [TRIG, COLLAPSED_AFTER, TRIG]})
    (worse, level, broke), (held, fell, _) = groups["qkclip"], groups["qknorm"]
    assert claim6.qk_side_failed(worse, held)          # 1.1 nat above QK-norm's
    assert not claim6.qk_side_failed(level, fell)      # QK-norm collapsed: no loss bar, no breakdown
    assert claim6.qk_side_failed(broke, held)          # its own collapse


def test_rule_6s_row_shows_each_half_and_the_part_that_decided_it(tmp_path):
    arms = {**RULE6, "bf16-guard-qkclip": arm(8, {**TRIG, "val": 3.5})}
    row = rows(tmp_path, arms)["6"]
    assert row[1] == "not reproduced"
    assert "part the non-QK actions fail: holds" in row[2]
    assert "part the QK-side actions hold: fails" in row[2]
    label, verdict, scale, key, why = summary.summary_row(*row, "scale", N)
    assert verdict == "NOT REPRODUCED"
    assert why == "the non-QK actions fail as claimed, but a QK-side action failed too"
    assert key.splitlines()[0].startswith("the non-QK actions fail: `bf16-guard-")
    assert key.splitlines()[1] == ("the QK-side actions hold: `bf16-guard-qkclip` (QK-side) failed in 8 of 8 "
                                   "seeds: "
                                   "broke down, or ended more than FIX_TOL (0.1 nat) above QK-norm's val "
                                   "loss (the claim wants 0)")
    row = rows(tmp_path / "b", RULE6)["6"]   # both halves hold: reproduced, each half's weakest test shown
    assert row[1] == "reproduced" and "QK-side) failed in 0 of 8" in summary.summary_row(*row, "scale", N)[3]


def test_rule_6_reports_logits_still_rising_after_the_trigger(tmp_path):
    # an action that slows the runaway (lr-drop: 100 + step, past the trigger at 5, still climbing at 249)
    # against one that holds it (qkclip: 150 from step 50); the rule reports both, the horizon's caveat
    long = {name: [{**kw, "steps": 250} for kw in runs] for name, runs in RULE6.items()}
    arms = {**long, "bf16-guard-lr-drop": arm(8, {**TRIG, "steps": 250, "logit": lambda s: 100.0 + s}),
            "bf16-guard-qkclip": arm(8, {**TRIG, "steps": 250, "logit": lambda s: 100.0 if s < 50 else 150.0})}
    text = rows(tmp_path, arms)["6"][2]
    assert "max logit of the last 100 steps over the trigger's, median, and seeds where it was still rising " \
           "(above the 100 steps before): bf16-guard-lr-drop 3.32, still rising in 8/8" in text
    assert "bf16-guard-qkclip 1.5, still rising in 0/8" in text
    assert "fp32 over the same steps (no error, no action) n/a" in text      # no fp32 runs here


# The lr-drop cuts the step 10x, so a runaway it only slows needs 10x the source's slowest runaway (3
# steps here) after the trigger (5) to show: RULE6's 20-step runs give it 14. Its long-horizon arms run 40.
LONG = lambda **kw: {**TRIG, "steps": 40, "args": {"max_steps": 40, "decay_steps": 40}, **kw}
LATE_RUNAWAY = lambda step: 2 * R if step >= 30 else 10.0        # past RUNAWAY_LOGIT 25 steps after the trigger
SHORT_TEXT = ("bf16-guard-lr-drop: held in 8 of 8 seeds with fewer than 30 steps after the trigger (the slowest "
              "runaway's 3 at its 0.1x step): too short to tell a delayed runaway from a prevented one (its "
              "long-horizon arm bf16-guard-lr-drop-long was not run)")


@pytest.mark.parametrize("changes, expected, says, not_says", [
    param({}, "inconclusive", SHORT_TEXT, "sign test, bf16-guard-lr-drop-long",
          id="held for 14 steps where a 10x slower runaway needs 30: too short, not evidence that it held "
             "(the old rule: not reproduced)"),
    param({"bf16-guard-long": arm(8, LONG()), "bf16-guard-lr-drop-long": arm(8, LONG(logit=LATE_RUNAWAY))},
          "reproduced", "bf16-guard-lr-drop-long: failed (broke down, or QK grew SIGMA_RATIO x QK-norm's) 8/8",
          "too short", id="run 40 steps it runs away at step 30, where the old rule's 20 steps saw it hold"),
    param({"bf16-guard-long": arm(8, LONG()), "bf16-guard-lr-drop-long": arm(8, LONG())}, "not reproduced",
          "sign test, bf16-guard-lr-drop-long over bf16-guard-long: 0 seeds one way, 0 the other", "too short",
          id="run 40 steps it holds: judged, against QK-norm's 40 steps"),
    param({"bf16-guard-long": arm(8, LONG(steps=30, args={"max_steps": 30, "decay_steps": 30})),
           "bf16-guard-lr-drop-long": arm(8, LONG(steps=30, args={"max_steps": 30, "decay_steps": 30}))},
          "inconclusive",
          "bf16-guard-lr-drop-long: held in 8 of 8 seeds with fewer than 30 steps", "was not run",
          id="its long arm run 30 steps, 25 after the trigger: still too short"),
    param({"bf16-guard-lr-drop": arm(8, {**TRIG, "args": {"lr_drop_factor": 0.5}})}, "not reproduced",
          "sign test, bf16-guard-lr-drop over bf16-guard: 0 seeds one way", "too short",
          id="an lr halved needs 6 steps: its 14 are enough to judge it held"),
    param({"bf16-guard-lr-drop": arm(8, COLLAPSED_AFTER)}, "reproduced", "bf16-guard-lr-drop: failed", "too short",
          id="a breakdown inside the short horizon fails it: the horizon only matters for a hold"),
    param({"bf16-guard-clip": arm(8, TRIG)}, "not reproduced", SHORT_TEXT, "inconclusive",
          id="clip holds over a long enough horizon: not reproduced whatever the lr-drop would do"),
    param({"bf16-guard-lr-drop-long": arm(8, LONG(logit=LATE_RUNAWAY))}, "not run", "no runs of bf16-guard-long",
          "too short", id="the long QK-norm arm missing: the long lr-drop has nothing to be judged against"),
    param({"bf16-guard-long": arm(8, LONG()), "bf16-guard-lr-drop-long": arm(8, LONG(logit=LATE_RUNAWAY))
                                                                    + [LONG(logit=LATE_RUNAWAY)]},
          "reproduced", "seeds judged: 8 of 8", "seed9", id="a long arm's extra seed is not a seed of the rule"),
])
def test_rule_6_gives_an_lr_drop_the_horizon_of_a_slowed_runaway(tmp_path, changes, expected, says, not_says):
    arms = {**RULE6, "bf16-guard-lr-drop": arm(8, TRIG), **changes}
    verdict, text = rows(tmp_path, arms)["6"][1:]
    assert verdict == expected and says in text and not_says not in text, text


def test_rule_6_refuses_a_long_arm_run_at_another_horizon(tmp_path):
    # one seed of the long lr-drop resumed to 30 steps: it would be judged over other steps than QK-norm's 40
    arms = {**RULE6, "bf16-guard-long": arm(8, LONG()),
            "bf16-guard-lr-drop-long": arm(7, LONG(), {8: LONG(args={"max_steps": 30, "decay_steps": 30})})}
    with pytest.raises(SystemExit, match=re.escape("ran other horizons in the arms that set their own, max_steps 40 "
                                                   "(bf16-guard-long, bf16-guard-lr-drop-long), 30 "
                                                   "(bf16-guard-lr-drop-long)")):
        verdicts.verdicts(write_arms(tmp_path, arms))


def test_rule_6_reports_the_long_arms_beside_the_short_ones(tmp_path):
    arms = {**RULE6, "bf16-guard-long": arm(8, LONG(val=3.0)),
            "bf16-guard-lr-drop-long": arm(8, LONG(logit=LATE_RUNAWAY, val=3.5))}
    text = rows(tmp_path, arms)["6"][2]
    assert "bf16-guard-lr-drop-long +0.500 (against bf16-guard-long)" in text
    assert "bf16-guard-lr-drop-long 200, still rising in 0/8; bf16-guard-long 1, still rising in 0/8" in text
    assert figures.arm_words("bf16-guard-lr-drop-long") == "bf16 state: QK-Guard's trigger, then the lr cut 10x, " \
        f"{sweep.LONG_STEPS} steps"


def test_rule_6_says_what_a_softcap_under_the_runaway_bar_can_judge(tmp_path):
    for cap, words in ((150.0, "not above the trigger"), (500.0, "above the trigger but under RUNAWAY_LOGIT"),
                       (2000.0, None)):
        arms = {**RULE6, "bf16-guard-softcap": arm(7, {**COLLAPSED_AFTER, "args": {"softcap_value": cap}},
                                                   rest={**TRIG, "args": {"softcap_value": cap}})}
        text = rows(tmp_path / str(cap), arms)["6"][2]
        assert (f"the softcap ran at {cap:g}, {words}" in text) if words else "the softcap ran at" not in text


def test_rule_6_says_which_seeds_it_judged_and_why(tmp_path):
    arms = {**RULE6, **{name: arm(6, runs[0], rest=LATE) for name, runs in RULE6.items() if name != "bf16"},
            "bf16": arm(7, SOURCE)}
    text = rows(tmp_path, arms)["6"][2]
    assert "bf16: steps from the threshold 200 to RUNAWAY_LOGIT, by seed: seed1 3," in text
    assert "a judged seed needs 3 steps after its trigger" in text
    assert "seeds judged: 6 of 8; reported, not counted: seed7 (2 steps after the trigger at 18), seed8 (the " \
           "source did not run away)" in text


def test_rule_6_per_source_with_gaps_triggers_and_the_grace_window(tmp_path):
    lab = {name.replace("bf16", "lr", 1): runs for name, runs in RULE6.items()}
    # QK-norm's loss jumps by 1.5 right after it acts (step 6) and recovers: inside a grace of 100,
    # past the margin of 1: shown as a transient the grace hid
    lab["lr-guard"] = arm(8, {**TRIG, "loss": lambda s: 4.5 if 6 <= s <= 8 else 3.0, "args": {"collapse_grace": 100}})
    lab["lr-guard-qkclip"] = arm(8, {**TRIG, "val": 3.0})
    table = rows(tmp_path, lab)
    assert "6" not in table and table["6 (lr)"][1] == "reproduced"
    text = table["6 (lr)"][2]
    assert "the demo's learning-rate runaway" in text and "lr-guard-qkclip +0.100" in text
    assert "lr-guard: trigger step by seed: seed1 5" in text
    assert "lr-guard: worst smoothed loss in the grace window above the pre-trigger best, by seed: seed1 +0." in text
    run = loading.Run(os.path.join(str(tmp_path), "lr-guard", "seed1"))
    ema = [3.0] * 6
    for s in range(6, 20):
        ema.append(0.9 * ema[-1] + 0.1 * (4.5 if s <= 8 else 3.0))
    assert run.grace_excess == pytest.approx(max(ema[6:]) - 3.0)
    tight = arm(8, {**TRIG, "loss": lambda s: 9.0 if s >= 6 else 3.0, "args": {"collapse_grace": 100}})
    text = rows(tmp_path / "b", {**lab, "lr-guard": tight})["6 (lr)"][2]
    assert "(past the margin: would have counted)" in text


def test_too_few_seeds_give_inconclusive_not_a_refutation(tmp_path):
    # 4 seeds all one way: p = 1/16 > 0.05, so the rule cannot hold and says so; 5 seeds can (1/32)
    four = {"bf16": [COLLAPSE] * 4, "fp32": [OK] * 4, "bf16-safemax": [OK] * 4}
    row = rows(tmp_path / "four", four)["1"]
    assert row[1] == "inconclusive" and "4 seeds: even all of them one way give p = 0.0625" in row[2]
    assert judge(tmp_path / "five", "1", {k: v + [v[0]] for k, v in four.items()}) == "reproduced"
    # with 5 or more seeds a failed rule is a refutation
    assert judge(tmp_path / "against", "1", {"bf16": [OK] * 5, "fp32": [OK] * 5, "bf16-safemax": [OK] * 5}) == \
        "not reproduced"


@pytest.mark.parametrize("n, expected", [(2, "inconclusive"), (4, "inconclusive"), (5, "reproduced"),
                                         (8, "reproduced")])
def test_a_rule_that_passes_on_too_few_seeds_is_inconclusive(tmp_path, n, expected):
    # rule 2v has no sign test of its own and passes on any seeds; on fewer than 5 (p = 1/32) the
    # report's sign tests cannot reach ALPHA, so a pass says as little as a failure would
    row = rows(tmp_path, {"fp32": [OK] * n, "fp32-guard": [OK] * n})["2v"]
    assert row[1] == expected
    assert (f"{n} seeds: even all of them one way give p = {stats.binom_tail(n, n):.3g} >= 0.05, this rule's "
            f"threshold; run at least 5" in row[2]) == (expected == "inconclusive")


# --------------------------------------------------------------------------------------------------
# Rule 7: rules 1 and 2 on the llama arms

RULE7 = {"llama-bf16": arm(6, COLLAPSE), "llama-fp32": arm(0, OK), "llama-bf16-guard": arm(8, TRIG),
         "llama-bf16-qknorm-always": arm(0, OK), "llama-fp32-guard": arm(0, OK)}


@pytest.mark.parametrize("changes, expected", [
    param({}, "reproduced", id="as rules 1 and 2"),
    param({"llama-fp32": arm(6, COLLAPSE)}, "not reproduced", id="llama-fp32 collapses as often"),
    param({"llama-bf16": arm(4, COLLAPSE)}, "not reproduced", id="llama-bf16 4 of 8"),
    param({"llama-bf16-guard": arm(8, TRIG, {2: {"trigger": 11}})}, "not reproduced", id="a late trigger"),
    param({"llama-bf16-guard": arm(8, TRIG, {8: {**TRIG, "val": 2.9 + TOL + 0.01}})}, "not reproduced",
          id="a val gap past LOSS_TOL"),
    param({"llama-bf16-qknorm-always": []}, "not run", id="no reference runs"),
    param({"llama-fp32-guard": arm(1, TRIG)}, "not reproduced", id="the guard fires on healthy llama"),
    param({"llama-fp32-guard": []}, "not run", id="no dormancy runs"),
])
def test_rule_7(tmp_path, changes, expected):
    assert judge(tmp_path, "7", {**RULE7, **changes}) == expected


def test_every_rule_passes_on_its_own_runs_together(tmp_path):
    """The passing cases in one root: shared arms (bf16, fp32, bf16-guard) agree; all reproduce."""
    arms = {**RULE1, **RULE2V, **RULE6, **RULE7, **rule4(),
            **{k: v for k, v in rule5().items() if k != "bf16"}, "bf16": RULE2["bf16"],    # bf16 collapses: ran away
            "bf16-guard": RULE2["bf16-guard"], "bf16-qknorm-always": RULE2["bf16-qknorm-always"]}
    for site in sweep.SITES:
        arms.update({inject(site, d, 1.0, True): arm(0, OK) for d in sweep.DOSES})
        for d in sweep.DOSES:  # through QK from 3 up (rule 4's coherent arms ran away from 3 too)
            arms[inject(site, d)] = arm(7, QK_RUNAWAY) if d >= 3.0 else arm(0, OK)
    got = {rule: row[1] for rule, row in rows(tmp_path, arms).items()}
    assert got == dict.fromkeys(["1", "2", "2v", "3", "3 (grad-mlp)", "3 (grad-wv)", "3+", "4", "5", "6", "7"],
                                     "reproduced")


# --------------------------------------------------------------------------------------------------
# The learning-rate study (report --lr-study): rules 1p, 2p and 7p on synthetic runs of every arm of
# sweep.LR_STUDY_ARMS at every lr of sweep.LRS, in <arm>-lr<lr>/ folders whose config.json records the
# lr as sweep.at_lrs sets it (lr and min_lr differ across lrs: the arms' own flags, not a mix)

TOP = sweep.LRS[-1]                     # the passing case's bf16 runs away at the grid's top lr
AWAY = {"logit": lambda step: 2 * R if step >= 10 else 10.0, "val": 4.0}   # from step 10; ends 1.1 nat worse


def lr_study(cells=None, prefix=""):
    """The study's arms (with prefix, "llama-" for llama) at every lr, healthy, but: bf16 runs away at TOP in
    seeds 1-7, where bf16-guard triggers at step 5 in every seed (it passes 1p and 2p); cells: {(arm without
    prefix, lr): runs} changes some."""
    arms = {(a, lr): arm(0, OK) for a in sweep.LR_STUDY_ARMS for lr in sweep.LRS}
    arms.update({("bf16", TOP): arm(7, AWAY), ("bf16-guard", TOP): arm(8, TRIG), **(cells or {})})
    with_lr = lambda kw, lr: None if kw is None else {**kw, "args": {"lr": lr, "min_lr": lr, **kw.get("args", {})}}
    return {sweep.lr_name(prefix + a, lr): [with_lr(kw, lr) for kw in runs] for (a, lr), runs in arms.items()}


def lr_rows(root, arms):
    """rule -> [rule, verdict, text] of the lr study's rules, judged on the arms written under root."""
    return {row[0]: row for row in verdicts.lr_verdicts(write_arms(root, arms))}


def lr_judge(root, rule, arms):
    return lr_rows(root, arms)[rule][1]


def test_run_reads_the_lr_studys_numbers(tmp_path):
    climb = lambda step: 2 * R if step >= 12 else 300.0 if step >= 6 else 10.0
    groups = write_arms(tmp_path, {"bf16-lr0.1": [{"logit": climb, "init": 5.5}, {"loss": lambda s: (
        float("nan") if s == 7 else 3.0)}, {"collapse": 10}, OK]})
    climbed, nan, collapsed, healthy = groups["bf16-lr0.1"]
    assert climbed.init_val == 5.5 and climbed.final_val == 2.9 and climbed.max_logit == 2 * R
    assert climbed.first_past(thresholds.GUARD_THRESHOLD) == 6 and climbed.first_past(R, inclusive=True) == 12
    assert climbed.first_past(2 * R) is None and climbed.first_past(2 * R, inclusive=True) == 12
    assert loading.lr_ran_away(climbed) and climbed.runaway_from() == 12 and not climbed.nonfinite
    assert nan.nonfinite and loading.lr_ran_away(nan) and not loading.ran_away(nan) and nan.runaway_from() == 7
    assert loading.lr_ran_away(collapsed) and collapsed.runaway_from() == 10
    assert not loading.lr_ran_away(healthy) and healthy.runaway_from() is None and healthy.init_val == 10.0
    assert climbed.guard_threshold() == thresholds.GUARD_THRESHOLD
    # a record sums the updates since the one before: a runaway first logged at step 29 may have begun at 20
    path = tmp_path / "fp32-lr0.1" / "seed1"
    os.makedirs(path)
    lines = [{"event": "start", "step": 0}, {"event": "eval", "step": 0, "val_loss": 5.0},
             *({"step": s, "loss": 3.0, "max_logit": [[2 * R if s == 29 else 10.0]]} for s in (9, 19, 29)),
             {"event": "eval", "step": 30, "val_loss": 3.5}, {"event": "end", "status": "completed", "step": 30,
                                                              "val_loss": 3.25}]
    (path / "log.jsonl").write_text("".join(json.dumps(r) + "\n" for r in lines))
    run = loading.Run(str(path))
    assert run.runaway_from() == 20 and run.first_past(R, inclusive=True) == 29
    assert run.final_val == 3.25, "the end record's val loss first"
    (path / "log.jsonl").write_text("".join(json.dumps(r) + "\n" for r in lines[:-1]))
    assert loading.Run(str(path)).final_val == 3.5 and loading.Run(str(path)).init_val == 5.0


@pytest.fixture
def new_action():
    """A made-up non-QK control, added the one way a new action is: a subclass of guard.Action."""
    import guard

    class Halve(guard.Action):
        name, kind, words = "halve", "non-qk", "the lr halved"

        def lr_scale(self):
            return 0.5
    yield Halve
    del guard.ACTIONS["halve"]


def test_an_action_a_fork_adds_changes_no_claim_6_arm_or_verdict(tmp_path, new_action):
    # claim 6's arms are the lab's list (sweep.CLAIM6_ACTIONS): guard.py's registry may grow in a fork
    import guard
    arms = sweep.action_arms("bf16")
    assert {a for a in arms if a.startswith("bf16-guard-") and not a.endswith("-long")} == \
        {f"bf16-guard-{a}" for kind in sweep.CLAIM6_ACTIONS.values() for a in kind}
    assert "bf16-guard-halve" not in arms and "halve" in guard.ACTIONS
    for kind, names in sweep.CLAIM6_ACTIONS.items():   # each is a real action of its kind
        assert all(guard.ACTIONS[name].kind == kind for name in names), kind
    assert "assay-guard-fp32-accum" not in sweep.action_arms("assay"), "a fix at the source runs only on bf16 state"
    assert figures.arm_words("bf16-guard-halve") == "bf16 state: QK-Guard's trigger, then the lr halved"
    # the rule judges the arms it always did: a halve arm on disk is not one of them
    assert judge(tmp_path / "held", "6", {**RULE6, "bf16-guard-halve": arm(0, TRIG)}) == "reproduced"


def test_an_action_added_to_claim_6s_list_is_judged_like_the_others(tmp_path, new_action, monkeypatch):
    monkeypatch.setitem(sweep.CLAIM6_ACTIONS, "non-qk", (*sweep.CLAIM6_ACTIONS["non-qk"], "halve"))
    arms = sweep.action_arms("bf16")
    assert arms["bf16-guard-halve"] == "--accum bf16 --guard on --guard-action halve"
    # rule 6 judges it as it does the other non-QK controls: it must fail too
    assert judge(tmp_path / "held", "6", {**RULE6, "bf16-guard-halve": arm(0, TRIG)}) == "not reproduced"
    assert judge(tmp_path / "failed", "6", {**RULE6, "bf16-guard-halve": arm(7, COLLAPSED_AFTER, rest=TRIG)}) == \
        "reproduced"


def test_the_lr_drop_factor_is_train_pys_default():
    import run
    assert thresholds.LR_DROP_FACTOR == run.parse_args([])[0].lr_drop_factor


def test_an_lr_arms_own_flags_are_its_base_arms_and_the_lr():
    assert loading.arm_flags("bf16-guard-lr0.03") == {"accum", "guard", "lr", "min_lr"}
    assert loading.arm_flags("llama-fp32-lr0.001") == {"arch", "accum", "lr", "min_lr"}
    assert loading.arm_flags("lr-guard-lr-drop") == loading.OWN_FLAGS["lr-guard-lr-drop"]   # a source arm, as before
    assert loading.arm_flags("nobody-lr0.1") == set() and loading.arm_flags("bf16") == {"accum"}


# Rule 1p: at some lr bf16 is worse than fp32 (val + LOSS_TOL, or a runaway fp32 did not have) by a sign
# test at ALPHA / 5 lrs = 0.01 (7 of 8 seeds: 1/128 holds, 6 of 8: 1/64 does not); bf16-safemax at no lr

@pytest.mark.parametrize("cells, expected", [
    param({}, "reproduced", id="bf16 ran away at the top lr in 7 of 8"),
    param({("bf16", TOP): arm(6, AWAY)}, "not reproduced", id="6 of 8: p = 1/64 > ALPHA / 5 lrs"),
    param({("bf16", TOP): arm(0, OK)}, "not reproduced", id="the same curve"),
    param({("bf16", TOP): arm(7, {"val": 2.9 + TOL + 0.01})}, "reproduced", id="val LOSS_TOL+0.01 worse, no runaway"),
    param({("bf16", TOP): arm(7, {"val": 2.9 + TOL - 0.01})}, "not reproduced", id="val LOSS_TOL-0.01 worse"),
    param({("bf16", 1e-3): arm(7, AWAY), ("bf16", TOP): arm(0, OK)}, "reproduced", id="at another lr"),
    param({("bf16", 1e-3): arm(4, AWAY), ("bf16", TOP): arm(3, AWAY, rest=OK)}, "not reproduced",
          id="4 seeds at one lr, 3 at another"),
    param({("fp32", TOP): arm(7, AWAY)}, "not reproduced", id="fp32 runs away as bf16 does"),
    param({("fp32", TOP): arm(0, OK, {1: UNFINISHED})}, "not reproduced", id="fp32 unfinished in one of its seeds"),
    param({("fp32", TOP): arm(0, OK, {1: None})}, "not reproduced", id="fp32 seed missing in one of its seeds"),
    param({("bf16", TOP): arm(7, AWAY, {1: {**AWAY, "end": None}})}, "not reproduced",
          id="bf16 in progress in one seed"),
    param({("bf16-safemax", TOP): arm(7, AWAY)}, "not reproduced", id="safemax worse at the top lr too"),
    param({("bf16-safemax", 1e-2): arm(7, {"val": 3.5})}, "not reproduced", id="safemax worse at another lr"),
    param({("bf16-safemax", TOP): arm(6, AWAY)}, "reproduced", id="safemax worse in 6 of 8: its test fails"),
    param({("bf16-safemax", TOP): arm(0, OK, dict.fromkeys(range(1, 8), UNFINISHED))}, "not reproduced",
          id="safemax unfinished in 7 seeds counts as worse"),
    param({**{("bf16-safemax", lr): [] for lr in sweep.LRS}}, "not run", id="no safemax runs at any lr"),
])
def test_rule_1p(tmp_path, cells, expected):
    assert lr_judge(tmp_path, "1p", lr_study(cells)) == expected


def test_rule_1p_text_bonferroni_and_the_same_curve(tmp_path):
    text = lr_rows(tmp_path, lr_study())["1p"][2]
    assert ("lrs run: 0.001, 0.003, 0.01, 0.03, 0.1 (Bonferroni: threshold ALPHA / 5, the committed grid's count (5 "
            "lrs) or the lrs run where more ran)") in text
    assert ("sign test, bf16-lr0.1 worse than fp32-lr0.1: 7 seeds one way, 0 the other of 8, p = 0.00781 "
            "(threshold 0.01) -> holds") in text
    assert ("sign test, bf16-safemax-lr0.1 worse than fp32-lr0.1: 0 seeds one way, 0 the other of 8, p = 1 "
            "(threshold 0.01) -> fails (the claim wants it to fail)") in text
    assert "lr 0.1: fp32 median final val 2.900, ran away 0/8 finished, bf16 median final val 4.000, ran away 7/8" \
        in text
    assert "same curve" not in text
    # two lrs of the grid rerun: 6 of 8 (p = 1/64) fails ALPHA / 5, the committed grid's count (the old rule
    # divided by the two lrs run and passed it); 8 of 8 (p = 1/256) passes
    two = lambda k: {name: runs for name, runs in lr_study({("bf16", TOP): arm(k, AWAY)}).items()
                     if sweep.split_lr(name)[1] in (1e-3, TOP)}
    assert lr_judge(tmp_path / "two", "1p", two(6)) == "not reproduced"
    assert lr_judge(tmp_path / "two8", "1p", two(8)) == "reproduced"
    row = lr_rows(tmp_path / "same", lr_study({("bf16", TOP): arm(0, OK)}))["1p"]
    assert row[1] == "not reproduced"
    assert "not reproduced at this scale: bf16 and fp32 state give the same curve" in row[2]
    fp32_unfinished = lr_study({("bf16", TOP): arm(0, OK), ("fp32", 1e-3): arm(0, OK, {2: UNFINISHED})})
    text = lr_rows(tmp_path / "unknown", fp32_unfinished)["1p"][2]
    assert "same curve" not in text and "(1 seeds with a run unfinished or missing, counted against)" in text


def test_rule_1p_on_too_few_seeds_is_inconclusive(tmp_path):
    # 6 seeds all one way: p = 1/64 >= ALPHA / 5; 7 can reach it
    six = {name: runs[:6] for name, runs in lr_study({("bf16", TOP): arm(6, AWAY)}).items()}
    row = lr_rows(tmp_path, six)["1p"]
    assert row[1] == "inconclusive" and "6 seeds: even all of them one way give p = 0.0156 >= 0.01" in row[2]
    assert "run at least 7" in row[2]


# Rule 2p: where bf16 runs away in a majority of seeds (TOP), bf16-guard does not, ends within LOSS_TOL of
# bf16-qknorm-always and acts before bf16's runaway (step 10; the trigger at 5 acts from 6); where fp32 and
# bf16 are healthy (the other lrs) bf16-guard and fp32-guard never fire and log the unguarded losses exactly

@pytest.mark.parametrize("cells, expected", [
    param({}, "reproduced", id="prevented at the top lr, dormant at the others"),
    param({("bf16-guard", TOP): arm(8, TRIG, {1: {**TRIG, "logit": lambda s: 2 * R if s >= 10 else 10.0}})},
          "not reproduced", id="the guard runs away in one seed"),
    param({("bf16-guard", TOP): arm(8, TRIG, {1: {**TRIG, "loss": lambda s: float("nan") if s == 15 else 3.0}})},
          "not reproduced", id="the guard's loss not finite in one seed"),
    param({("bf16-guard", TOP): arm(8, {**TRIG, "val": 2.9 + TOL + 0.01})}, "not reproduced",
          id="val LOSS_TOL+0.01 above always-on QK-norm in every seed: the interval wholly past the margin"),
    param({("bf16-guard", TOP): arm(8, TRIG, {3: {**TRIG, "val": 2.9 + TOL + 0.01}})}, "reproduced",
          id="one seed LOSS_TOL+0.01 above, the rest level: the mean's interval inside the margin"),
    param({("bf16-guard", TOP): arm(8, TRIG, {s: {**TRIG, "val": 2.9 + (-1) ** s * 0.05} for s in range(1, 9)})},
          "inconclusive", id="seeds +-0.05 about a mean gap of 0: the interval covers 0 and reaches past the margin"),
    param({("bf16-guard", TOP): arm(8, TRIG, {s: {**TRIG, "val": 2.9 + 0.02 + (-1) ** s * 0.001}
                                              for s in range(1, 9)})}, "reproduced",
          id="a steady gap of 0.02, inside the margin"),
    param({("bf16-guard", TOP): arm(8, {**TRIG, "val": 2.9 - TOL + 0.01})}, "reproduced",
          id="val LOSS_TOL-0.01 below it in every seed"),
    # the lower one-sided test: a guard that ends well below QK-norm is not "within" it either
    param({("bf16-guard", TOP): arm(8, {**TRIG, "val": 2.9 - TOL - 0.01})}, "not reproduced",
          id="val LOSS_TOL+0.01 below it in every seed: the interval wholly past the lower margin"),
    param({("bf16-guard", TOP): arm(8, TRIG, {s: {**TRIG, "val": 2.9 - TOL + (-1) ** s * 0.05}
                                              for s in range(1, 9)})},
          "inconclusive", id="seeds +-0.05 about a mean gap of -LOSS_TOL: the interval straddles its margin"),
    param({("bf16-guard", TOP): arm(8, TRIG, {2: {"trigger": 10, "logit": AWAY["logit"]}})}, "not reproduced",
          id="triggers at the runaway step, reading a runaway's logit"),
    param({("bf16-guard", TOP): arm(8, TRIG, {2: {"trigger": 11}})}, "not reproduced",
          id="triggers after the runaway showed"),
    param({("bf16-guard", TOP): arm(8, TRIG, {2: {"trigger": 9}})}, "reproduced",
          id="triggers the step before the runaway"),
    param({("bf16-guard", TOP): arm(8, TRIG, {2: OK})}, "not reproduced", id="never triggers where bf16 ran away"),
    param({("bf16-guard", TOP): arm(8, TRIG, {8: OK})}, "reproduced", id="no trigger where bf16 did not run away"),
    param({("bf16-guard", TOP): arm(8, TRIG, {8: UNFINISHED})}, "not reproduced", id="the guard unfinished"),
    param({("bf16-qknorm-always", TOP): arm(0, OK, {8: None})}, "not reproduced", id="reference seed missing"),
    param({("bf16", TOP): arm(7, AWAY, {1: {**AWAY, "end": None}})}, "not reproduced",
          id="bf16 unfinished where it must be prevented"),
    param({("bf16", TOP): arm(4, AWAY), ("bf16-guard", TOP): arm(4, TRIG)}, "not reproduced",
          id="bf16 runs away in half the seeds at most: nothing to prevent"),
    param({("bf16", TOP): arm(5, AWAY)}, "reproduced", id="a majority, 5 of 8"),
    param({("fp32", lr): arm(0, OK, {1: AWAY}) for lr in sweep.LRS[:-1]}, "not reproduced",
          id="fp32 runs away somewhere at every other lr: no healthy lr"),
    param({("bf16-guard", 1e-3): arm(0, OK, {4: TRIG})}, "not reproduced", id="bf16-guard fires at a healthy lr"),
    # logits past the guard's threshold, short of RUNAWAY_LOGIT (growing within the horizon): the guard
    # fires, as it should, and this lr is reported, not judged as healthy
    param({("fp32", 1e-2): arm(0, {"logit": 300.0}), ("bf16", 1e-2): arm(0, {"logit": 300.0}),
           ("bf16-guard", 1e-2): arm(0, TRIG), ("fp32-guard", 1e-2): arm(0, TRIG)}, "reproduced",
          id="the guard fires where the logits grew past its threshold short of a runaway: not judged"),
    param({("fp32-guard", 3e-2): arm(0, OK, {4: TRIG})}, "not reproduced", id="fp32-guard fires at a healthy lr"),
    param({("fp32-guard", TOP): arm(0, OK, {4: TRIG})}, "reproduced", id="fp32-guard fires where bf16 ran away"),
    param({("fp32-guard", 1e-3): arm(0, OK, {4: {"loss": lambda s: 3.0 + 1e-12 * (s == 3)}})}, "not reproduced",
          id="a dormant loss 1e-12 off the unguarded run's"),
    param({("bf16-guard", 1e-2): arm(0, OK, {4: {"val": 2.9 + 1e-9}})}, "not reproduced",
          id="a dormant val loss 1e-9 off"),
    param({("bf16-guard", 1e-2): arm(0, OK, {4: UNFINISHED})}, "not reproduced", id="dormant run unfinished"),
    param({("fp32", 1e-2): arm(0, OK, {4: None})}, "not reproduced", id="the unguarded seed missing"),
    param({("bf16-qknorm-always", lr): [] for lr in sweep.LRS}, "not run", id="no reference runs"),
])
def test_rule_2p(tmp_path, cells, expected):
    assert lr_judge(tmp_path, "2p", lr_study(cells)) == expected


def test_rule_2p_judges_the_trigger_against_a_coarse_log_by_its_value(tmp_path):
    # bf16 logged every 10 steps shows its runaway first in the record of step 19 (updates 10..19); the
    # guard, which checks every step, crossed at step 12 reading 300, so bf16 was still short of a runaway
    # there (the two runs are one until the guard acts): it came first. The first 2p, which wanted the
    # action (step 14) no later than the interval's first update (10), failed this run.
    climb = lambda step: 2 * R if step >= 15 else 300.0 if step >= 12 else 10.0
    cells = {("bf16", TOP): arm(7, {**AWAY, "logit": climb}),
             ("bf16-guard", TOP): arm(8, {"trigger": 12, "logit": lambda s: 300.0 if s == 12 else 10.0})}
    arms = lr_study(cells)
    write_arms(tmp_path, arms)
    for seed in range(1, 8):   # keep every 10th step record, each with its interval's max logit
        path = tmp_path / sweep.lr_name("bf16", TOP) / f"seed{seed}" / "log.jsonl"
        records, kept, top = [json.loads(line) for line in path.read_text().splitlines()], [], 0.0
        for r in records:
            if "event" in r:
                kept.append(r)
                continue
            top = max(top, r["max_logit"][1][0])
            if r["step"] % 10 == 9:
                kept.append({**r, "max_logit": [[1.0, 2.0], [top, 3.0]]})
                top = 0.0
        path.write_text("".join(json.dumps(r) + "\n" for r in kept))
    row = {r[0]: r for r in verdicts.lr_verdicts(loading.load_runs(str(tmp_path)))}["2p"]
    assert row[1] == "reproduced", row[2]
    assert "seed1 7, seed2 7" in row[2]   # the trigger at 12, the runaway first shown at 19


def test_rule_2p_text_per_lr(tmp_path):
    cells = {("bf16-guard", TOP): arm(8, TRIG, {2: {"trigger": 12}}), ("bf16", 1e-2): arm(2, AWAY)}
    text = lr_rows(tmp_path, lr_study(cells))["2p"][2]
    assert ("at lr 0.1: bf16 ran away in 7/8 seeds, so the guard must prevent it: bf16-guard ran away in 0/8, "
            "acted too late in 1; final val - bf16-qknorm-always's: mean +0.000 nat, 90% interval [+0.000, +0.000], "
            "sd 0.000, n 8 (two one-sided tests at +-LOSS_TOL: within) -> fails") in text
    assert ("lr 0.1: steps from bf16-guard's trigger to the logged step where bf16 first showed its runaway, by "
            "seed: seed1 5, seed2 -2, seed3 5") in text
    assert ("at lr 0.001: fp32 and bf16 healthy in every seed, so the guard must stay dormant: fired in 0/8 "
            "(bf16-guard), 0/8 (fp32-guard); logged losses bit for bit the unguarded run's in 8/8 (bf16-guard vs "
            "bf16), 8/8 (fp32-guard vs fp32) (unfinished counted against) -> holds") in text
    assert ("at lr 0.01: neither (bf16 ran away in 2/8 seeds, fp32 in 0/8; their max logits passed the guard's "
            "threshold short of a runaway): not judged; bf16-guard fired in ") in text
    text = lr_rows(tmp_path / "b", lr_study({("bf16", TOP): arm(0, OK)}))["2p"][2]
    assert ("at lr none: no lr of the grid where bf16 ran away in a majority of seeds: nothing for the guard to "
            "prevent -> fails") in text


def test_rule_2p_judges_each_lr_on_the_seeds_its_arms_ran_and_reports_the_aa_floor(tmp_path):
    """Guard and always-on QK-norm at 16 seeds where the unguarded arms ran 8: the gap is judged on 16, what the
    first 8 gave is said, the lead on the seeds bf16 ran; the A/A pair's spread is reported beside it."""
    more = {("bf16-guard", TOP): arm(16, TRIG), ("bf16-qknorm-always", TOP): arm(16, OK)}
    arms = lr_study(more)
    one, two = sweep.AA_ARMS["bf16-qknorm-always"]
    args = lambda threads: {"lr": TOP, "min_lr": TOP, "threads": threads}
    arms[sweep.lr_name(two, TOP)] = [{"val": 2.9 + (0.01 if s % 2 else -0.01), "args": args(2)}
                                     for s in range(1, 17)]
    arms[sweep.lr_name(one, TOP)] = [{"val": 2.9 if s > 1 else 2.95, "args": args(1)} for s in range(1, 17)]
    row = lr_rows(tmp_path, arms)["2p"]
    assert row[1] == "reproduced", row[2]
    assert "bf16 ran away in 7/8 seeds, so the guard must prevent it: bf16-guard ran away in 0/16" in row[2]
    assert "lr 0.1, seeds seed1 to seed8 alone (the first sweep): mean +0.000 nat" in row[2]
    assert ("A/A at lr 0.1, bf16-qknorm-always-t2 - bf16-qknorm-always-t1 (the same arm at 2 and 1 CPU "
            "threads, run "
            "side by side in one sweep: fp32 sums in another order, no rounding point moved): mean -0.003 "
            "nat") in row[2]
    assert "-> no gap; per seed -0.040, -0.010, +0.010" in row[2]
    assert ("lr 0.1, bf16-qknorm-always-t1 - bf16-qknorm-always (the same flags at one thread, run on a "
            "later day: what the code's changes since moved): identical in 15/16 seeds") in row[2]
    again = sweep.TILE_ARMS["bf16-qknorm-always"][0]   # the same flags on 2026-12-04: a replay, said too
    assert f"bf16-qknorm-always-t1 - {again} (" not in row[2]
    arms[sweep.lr_name(again, TOP)] = [{"val": 2.9, "args": args(1)} for s in range(1, 9)]
    assert (f"lr 0.1, bf16-qknorm-always-t1 - {again} (the same flags at one thread, run on a later day: what "
            "the code's changes since moved): identical in 7/8 seeds") in lr_rows(tmp_path / "d", arms)["2p"][2]
    del arms[sweep.lr_name(one, TOP)]   # the twin alone: no pair run side by side, no floor said
    assert "A/A" not in lr_rows(tmp_path / "c", arms)["2p"][2]
    arms[sweep.lr_name("bf16-qknorm-always", TOP)] = arm(15, OK)   # seed 16 of the reference missing: against it
    assert lr_rows(tmp_path / "b", arms)["2p"][1] == "not reproduced"


def aa_pair(shift, spread=0.01, n=8):
    """The A/A arms at TOP: the 2-thread arm's val loss `shift` above the 1-thread arm's, +-spread by seed."""
    one, two = sweep.AA_ARMS["bf16-qknorm-always"]
    val = lambda s: 2.9 + shift + (spread if s % 2 else -spread) * (1 + s / 10)
    return {sweep.lr_name(one, TOP): [{"args": {"lr": TOP, "min_lr": TOP, "threads": 1}} for _ in range(n)],
            sweep.lr_name(two, TOP): [{"val": val(s), "args": {"lr": TOP, "min_lr": TOP, "threads": 2}}
                                      for s in range(1, n + 1)]}


@pytest.mark.parametrize("shift, expected", [
    param(0.0, "reproduced", id="A/A: no gap, spread about 0: the guard's verdict stands"),
    param(0.02, "inconclusive", id="A/A: a steady 0.02 between the thread counts: no telling noise"),
])
def test_rule_2p_needs_an_aa_pair_without_a_gap(tmp_path, shift, expected):
    row = lr_rows(tmp_path, {**lr_study(), **aa_pair(shift)})["2p"]
    assert row[1] == expected, row[2]
    said = "a gap where none should be" in row[2]
    assert said == (expected == "inconclusive")
    if said:
        assert "the A/A pair showed a gap where none should be (lr 0.1)" in row[2]


def test_rule_2p_reports_the_old_tile_pair_as_what_it_is(tmp_path):
    arms = lr_study()
    again, tile = sweep.TILE_ARMS["bf16-qknorm-always"]
    arms[sweep.lr_name(tile, TOP)] = [{"val": 2.88, "args": {"lr": TOP, "min_lr": TOP, "block_n": 64}}] * N
    arms[sweep.lr_name(again, TOP)] = [{"args": {"lr": TOP, "min_lr": TOP}}] * N
    row = lr_rows(tmp_path, arms)["2p"]
    assert row[1] == "reproduced"   # not an A/A: its gap judges nothing
    assert ("bf16-qknorm-always-tile64 - bf16-qknorm-always-aa (the 2026-12-03 pair, not an A/A: the 64-key "
            "tile "
            "rounds the bf16 state twice per row") in row[2]


def test_rule_2p_reports_the_late_switchs_cost_against_the_trigger_step(tmp_path):
    # the guard's gap grows with its trigger step: 0.001 nat a step, exactly, from triggers at 2..9
    cells = {("bf16-guard", TOP): [{"trigger": t, "val": 2.9 + 0.001 * t} for t in range(2, 10)]}
    row = lr_rows(tmp_path, lr_study(cells))["2p"]
    assert ("lr 0.1, the late switch's cost (a finding, reported not judged): bf16-guard - "
            "bf16-qknorm-always final val, mean +0.005 nat, 95% interval [+0.003, +0.008], paired t p = "
            "0.00038, n 8 (a cost)") in row[2]
    assert "against the trigger step (median 5.5, 2 to 9): slope +0.100 nat per 100 steps" in row[2]
    assert "r = +1.00" in row[2]
    assert "lr 0.1: bf16-guard's trigger inside the 0 warmup steps in 0/8 seeds\n" in row[2]
    cells = {("bf16-guard", TOP): [{"trigger": t, "args": {"warmup_steps": 6}} for t in range(2, 10)]}
    text = lr_rows(tmp_path / "w", lr_study(cells))["2p"][2]
    assert "lr 0.1: bf16-guard's trigger inside the 6 warmup steps in 4/8 seeds (there the guard is QK-norm" \
        in text
    assert "(no gap shown)" in text


def test_paired_t_slope_and_power_by_hand():
    mean, lo, hi, p = stats.paired_t([1.0, 2.0, 3.0, 4.0])   # t = 2.5 / (1.291 / 2) = 3.873, df 3
    assert p == pytest.approx(0.0305, abs=2e-4) and lo > 0
    assert stats.paired_t([0.1, -0.1, 0.1, -0.1])[3] == pytest.approx(1.0)
    slope, lo, hi, r = stats.slope_interval([1, 2, 3, 4, 5], [2.0, 4.1, 5.9, 8.2, 9.8])
    assert slope == pytest.approx(1.97) and r == pytest.approx(0.9988, abs=1e-4) and lo < 1.97 < hi
    assert math.isnan(stats.slope_interval([1, 1, 1], [1.0, 2.0, 3.0])[0])
    # power of two one-sided tests: sd 0.03 at n 16 (se 0.0075, t 1.753): 2 Phi(4 - 1.753) - 1 = 0.975
    assert stats.equivalence_power(0.03, 16) == pytest.approx(0.9754, abs=1e-3)
    assert stats.equivalence_power(0.09, 8) == 0.0 and stats.seeds_for_power(0.03) == 10
    rng = random.Random(1)   # the approximation against simulation at sd 0.06, n 24
    sims = [stats.equivalence([rng.gauss(0, 0.06) for _ in range(24)])[0] == "within" for _ in range(2000)]
    assert abs(sum(sims) / len(sims) - stats.equivalence_power(0.06, 24)) < 0.05


def test_student_t_quantiles_and_the_equivalence_test():
    for df, q95, q975 in [(1, 6.3138, 12.7062), (7, 1.8946, 2.3646), (15, 1.7531, 2.1314), (60, 1.6706, 2.0003)]:
        assert stats.t_quantile(0.95, df) == pytest.approx(q95, abs=1e-4)
        assert stats.t_quantile(0.975, df) == pytest.approx(q975, abs=1e-4)
    mean, lo, hi = stats.mean_interval([1.0, 2.0, 3.0, 4.0], 0.95)   # sd 1.291, t(0.975, 3) 3.1824
    assert (mean, lo, hi) == pytest.approx((2.5, 2.5 - 3.1824 * 1.291 / 2, 2.5 + 3.1824 * 1.291 / 2), abs=1e-3)
    assert stats.equivalence([0.0]) [0] == "inconclusive"        # one seed: no interval
    # both one-sided tests, each on its side of the margin: wholly past it above or below is "beyond", an
    # interval straddling -0.03 or +0.03 "inconclusive" (a test dropped on either side reads these otherwise)
    spread = (-0.005, 0.005, -0.003, 0.003)
    for side in (1, -1):
        assert stats.equivalence([side * 0.1 + d for d in spread])[0] == "beyond"
        assert stats.equivalence([side * 0.03 + 2 * d for d in spread])[0] == "inconclusive"
        assert stats.equivalence([side * 0.02 + d for d in spread])[0] == "within"
    rng = random.Random(0)
    # A/A sets (a true gap of 0) at a paired spread of this lab's order (the guard's gaps: sd 0.02 to 0.09):
    # never "beyond"; sets shifted 0.1 past 0: "beyond" nearly always; the 90% interval covers the true mean
    # about 90% of the time
    aa = [stats.equivalence([rng.gauss(0, 0.047) for _ in range(16)]) for _ in range(1000)]
    shifted = [stats.equivalence([rng.gauss(0.1, 0.047) for _ in range(16)])[0] for _ in range(300)]
    assert sum(v == "beyond" for v, *_ in aa) == 0 and shifted.count("beyond") > 0.95 * len(shifted)
    assert 0.86 < sum(lo < 0 < hi for _, _, lo, hi in aa) / len(aa) < 0.94


def test_rule_2p_on_too_few_seeds_is_inconclusive(tmp_path):
    four = {name: runs[:4] for name, runs in lr_study({("bf16", TOP): arm(4, AWAY)}).items()}
    row = lr_rows(tmp_path, four)["2p"]
    assert row[1] == "inconclusive" and "4 seeds: even all of them one way give p = 0.0625 >= 0.05" in row[2]


# Rule 7p: 1p and 2p on the llama- arms

@pytest.mark.parametrize("cells, expected", [
    param({}, "reproduced", id="as 1p and 2p"),
    param({("bf16-safemax", TOP): arm(7, AWAY)}, "not reproduced", id="1p fails: safemax as bad"),
    param({("bf16", TOP): arm(0, OK)}, "not reproduced", id="1p and 2p fail: the same curve"),
    param({("bf16-guard", TOP): arm(8, TRIG, {2: {"trigger": 11}})}, "not reproduced", id="2p fails: late"),
    param({("fp32-guard", 1e-3): arm(0, OK, {4: TRIG})}, "not reproduced", id="2p fails: fires on healthy llama"),
    param({("bf16-safemax", lr): [] for lr in sweep.LRS}, "not run", id="no llama-bf16-safemax runs"),
])
def test_rule_7p(tmp_path, cells, expected):
    assert lr_judge(tmp_path, "7p", lr_study(cells, prefix="llama-")) == expected


def test_rule_7p_shows_each_parts_lines_and_reads_only_llama(tmp_path):
    arms = {**lr_study(prefix="llama-"), **lr_study({("bf16", TOP): arm(0, OK)})}   # gpt2: the same curve
    table = lr_rows(tmp_path, arms)
    assert table["7p"][1] == "reproduced" and table["1p"][1] == table["2p"][1] == "not reproduced"
    text = table["7p"][2]
    assert "part 1p on llama: holds" in text and "part 2p on llama: holds" in text
    assert "sign test, llama-bf16-lr0.1 worse than llama-fp32-lr0.1: 7 seeds one way" in text
    assert "at lr 0.1: llama-bf16 ran away in 7/8 seeds" in text and "fp32-lr" not in text.replace("llama-fp32", "")
    text = lr_rows(tmp_path / "b", lr_study({("bf16", TOP): arm(0, OK)}, prefix="llama-"))["7p"][2]
    assert "part 1p on llama: fails" in text and "give the same curve on llama" in text


def test_rule_7p_judges_1p_on_the_seeds_bf16_and_fp32_ran(tmp_path):
    """The guard arms' extra seeds (rule 2p's 16) are not 1p's: 7p judges both parts in one claim, and a
    seed bf16 and fp32 never ran must not count against 1p, nor a 1p row say 16 seeds."""
    more = {("bf16-guard", TOP): arm(16, TRIG), ("bf16-qknorm-always", TOP): arm(16, OK)}
    table = lr_rows(tmp_path, lr_study(more, prefix="llama-"))
    text = table["7p"][2]
    assert "part 1p on llama: holds" in text and "unfinished or missing" not in text
    assert "sign test, llama-bf16-lr0.1 worse than llama-fp32-lr0.1: 7 seeds one way, 0 the other of 8" in text
    opening = summary.summary({}, [], write_arms(tmp_path / "b", lr_study(more, prefix="llama-")),
                              [row for row in table.values()])
    seven = next(row for row in opening if row[0] == "7p")
    assert "of 8 seeds" in seven[3] and "of 16" not in seven[3] and "8-16 seeds x 5 lrs (16 for some arms at lr 0.1)" in seven[2]


def test_the_lr_study_refuses_a_mix_and_a_missing_folder(tmp_path):
    arms = lr_study()
    for name in arms:
        if name.startswith("bf16-guard-"):   # bf16-guard run on another preset
            arms[name] = [{**kw, "args": {**kw["args"], "preset": "demo"}} for kw in arms[name]]
        else:
            arms[name] = [{**kw, "args": {**kw["args"], "preset": "lab"}} for kw in arms[name]]
    write_arms(tmp_path / "study", arms)
    write_arms(tmp_path / "root", RULE1)
    out = report_cmd(tmp_path / "root", "--lr-study", tmp_path / "study", "--markdown", tmp_path / "R.md")
    assert out.returncode != 0 and "Traceback" not in out.stderr and out.stdout == ""
    assert out.stderr.splitlines() == ['error: rule 2p\'s runs differ in flags that its arms do not set, preset '
                                       '"lab" (bf16-lr0.001, bf16-qknorm-always-lr0.001, fp32-lr0.001, '
                                       'fp32-guard-lr0.001, bf16-lr0.003, bf16-qknorm-always-lr0.003, fp32-lr0.003, '
                                       'fp32-guard-lr0.003, bf16-lr0.01, bf16-qknorm-always-lr0.01, fp32-lr0.01, '
                                       'fp32-guard-lr0.01, bf16-lr0.03, bf16-qknorm-always-lr0.03, fp32-lr0.03, '
                                       'fp32-guard-lr0.03, bf16-lr0.1, bf16-qknorm-always-lr0.1, fp32-lr0.1, '
                                       'fp32-guard-lr0.1), "demo" (bf16-guard-lr0.001, bf16-guard-lr0.003, '
                                       'bf16-guard-lr0.01, bf16-guard-lr0.03, bf16-guard-lr0.1)' + ADVICE]
    assert not (tmp_path / "R.md").exists()
    out = report_cmd(tmp_path / "root", "--lr-study", tmp_path / "nowhere")
    assert out.returncode != 0 and "Traceback" not in out.stderr
    assert out.stderr.strip().splitlines()[-1] == (f"report.py: error: --lr-study {tmp_path / 'nowhere'} is not a "
                                                   "folder: give the study's runs, <DIR>/<arm>-lr<lr>/seed<k>/")


def test_lr_sensitivity_by_hand(tmp_path):
    # seed 1: best 3.0 (fp32 at 1e-3); fp32 (3.0 + 4.0) / 2 - 3 = 0.5; bf16 (3.5 + min(12, init 10)) / 2 - 3 = 3.75
    # seed 2: best 3.0 (bf16 at 1e-3); fp32 (3.2 + 4.0) / 2 - 3 = 0.6; bf16 (3.0 + min(9, init 8)) / 2 - 3 = 2.5
    # seed 3: best 2.8 (bf16 at 1e-3); fp32 (3.0 + 4.0) / 2 - 2.8 = 0.7; bf16 unfinished at 0.1: left out
    groups = write_arms(tmp_path, {"fp32-lr0.001": [{"val": 3.0}, {"val": 3.2}, {"val": 3.0}],
                                   "fp32-lr0.1": [{"val": 4.0}] * 3,
                                   "bf16-lr0.001": [{"val": 3.5}, {"val": 3.0}, {"val": 2.8}],
                                   "bf16-lr0.1": [{**COLLAPSE, "val": 12.0}, {**RUNAWAY, "val": 9.0, "init": 8.0},
                                                  UNFINISHED]})
    out = lr_rules.lr_sensitivity(groups)
    assert list(out) == ["fp32", "bf16"]
    assert out["fp32"][0] == pytest.approx([0.5, 0.6, 0.7]) and out["fp32"][1] is None
    assert out["bf16"][0] == pytest.approx([3.75, 2.5]) and out["bf16"][1] == 0.1   # ran away in 2 of 3 seeds
    assert lr_rules.lr_sensitivity(groups, "llama-") == {}
    text = text_report({}, "r", study=("s", groups))
    assert re.search(r"^fp32 +0\.600 \[0\.500, 0\.700\] +3 +none in the grid$", text, re.M), text
    assert re.search(r"^bf16 +3\.125 \[2\.500, 3\.750\] +2 +0\.1$", text, re.M)


def plots_or_a_clear_skip(plot, groups, folder, monkeypatch, capsys):
    """plot(groups, folder) without matplotlib: nothing, and a line that says so; with it: its files."""
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # as if it were not installed
    assert plot(groups, folder) == []
    assert "plots skipped" in capsys.readouterr().out
    monkeypatch.undo()
    pytest.importorskip("matplotlib")
    return plot(groups, folder)


def test_lr_study_figures_or_a_clear_skip(tmp_path, monkeypatch, capsys):
    groups = write_arms(tmp_path, {**lr_study(), **lr_study(prefix="llama-")})
    saved = plots_or_a_clear_skip(figures.plot_lr_study, groups, str(tmp_path / "p"), monkeypatch, capsys)
    assert saved == [str(tmp_path / "p" / "lr-gpt2.png"), str(tmp_path / "p" / "lr-llama.png")]
    assert all(os.path.getsize(p) > 1000 for p in saved)


def read_report(md):
    """A report's Markdown files: RESULTS.md's text, and {claim: (its record, its runs)} from claims/ beside it."""
    records = md.parent / "claims"
    return md.read_text(), {n: ((records / str(n) / "README.md").read_text(), (records / str(n) / "runs.md").read_text())
                            for n in sweep.CLAIMS}


def test_markdown_with_the_lr_study(tmp_path):
    write_arms(tmp_path / "runs", RULE1)
    study = {name: [{**kw, "data": H1, "args": {**kw["args"], "preset": "lab", "arch": "gpt2", "n_layer": 4,
                                                "n_embd": 128, "n_head": 4, "max_steps": 20}} for kw in runs]
             for name, runs in lr_study().items()}
    write_arms(tmp_path / "study", study)
    md, plots = tmp_path / "RESULTS.md", tmp_path / "plots"
    assert report.main([str(tmp_path / "runs"), "--lr-study", str(tmp_path / "study"), "--markdown", str(md),
                        "--plots", str(plots)]) == 0
    text, claims = read_report(md)
    command = text.split("```bash\n")[1].split("\n```")[0].replace(" \\\n    ", " ")
    assert command == (f"python -m lab.report {tmp_path / 'runs'} --lr-study {tmp_path / 'study'} --markdown {md} "
                       f"--plots {plots}")
    index = (tmp_path / "claims" / "README.md").read_text()
    section = index.split(f"## The learning-rate study ({tmp_path / 'study'}): claims 1, 2 and 7 as a proxy at CPU "
                          "scale\n\n")[1]
    assert section.startswith(lr_rules.PROXY + " Scale: preset lab; models gpt2 (4 layers of width 128, 4 heads, "
                              "240 runs); ")
    assert ("20 steps per run" in section and "learning rates 0.001, 0.003, 0.01, 0.03, 0.1 (each run's lr and "
            "min_lr); 8 seeds (seed1 to seed8), 240 runs; data pycode in byte tokens, content_sha256 " + H1 +
            ", 900 train and 100 val tokens") in section
    assert "The learning-rate study's rules: a run ran away if it collapsed" in index
    for rule, n in (("1p", 1), ("2p", 2)):
        record, runs = claims[n]
        assert re.search(rf"^\| {rule} \| REPRODUCED \| gpt2 4x128, 20 steps, 8 seeds x 5 lrs \| ", opening(text), re.M)
        assert f"| {rule} | REPRODUCED | gpt2 4x128, 20 steps, 8 seeds x 5 lrs |" in record
        assert f"## Rule {rule}: claim {n} as a proxy: " in record and "**REPRODUCED**, by these tests" in record
        assert f"\n\nThe rule: {verdicts.LR_RULES[n - 1][1]}.\n\n" in record
        assert "## The learning-rate study, gpt2: LR sensitivity, and where each arm starts to run away" in record
        assert "| bf16 | 0.220 [0.000, 0.220] | 8 | 0.1 |" in record   # (2.9 * 4 + 4.0) / 5 - 2.9 = 0.22
        assert "| fp32 | 0.000 [0.000, 0.000] | 8 | none in the grid |" in record
        assert "| bf16 | 2.900 (0/8) | 2.900 (0/8) | 2.900 (0/8) | 2.900 (0/8) | 4.000 (7/8) |" in record
        assert "## Runs of the learning-rate study" in runs and "## Commands\n\n```bash\npython train.py --seed 1 " in runs
        assert "| bf16 | 0.1 | seed1 | completed | 10.0000 | 4.0000 | 2000 | yes | - | 10 | 10 |" in runs
        assert "llama" not in record + runs
    assert "- sign test, bf16-lr0.1 worse than fp32-lr0.1: 7 seeds" in claims[1][0]
    assert "- at lr 0.001: fp32 and bf16 healthy in every seed" in claims[2][0]
    assert "| bf16-guard | 0.1 | seed1 | completed | 10.0000 | 2.9000 | 10 | no | 5 | - | - |" in claims[2][1]
    assert "bf16-guard" not in claims[1][1]   # claim 1's runs are 1p's arms
    assert "| 7p | NOT RUN | - | - | no runs of " in text and "| 7p | NOT RUN | - | - | no runs of " in claims[7][0]
    assert "## Runs of the learning-rate study" not in claims[7][1]
    if importlib.util.find_spec("matplotlib"):
        assert "![lr-gpt2](../../plots/lr-gpt2.png)" in claims[2][0] and (plots / "lr-gpt2.png").exists()
        assert not (plots / "lr-llama.png").exists()
    # without the study: no section, and the command as before (--force: it judges the study's rules no more)
    assert report.main([str(tmp_path / "runs"), "--markdown", str(md), "--plots", str(plots), "--force"]) == 0
    text, claims = read_report(md)
    assert "--lr-study" not in text and "## The learning-rate study" not in (tmp_path / "claims" / "README.md").read_text()
    assert "## Runs of the learning-rate study" not in claims[1][1] + claims[2][1]


# --------------------------------------------------------------------------------------------------
# Runs a rule may not judge together: other flags than its arms' own, other data

def healthy_2v(fp32_kw, guard_kw):
    """Rule 2v's arms, healthy (it reproduces), each arm's runs with the given write_run keywords."""
    return {"fp32": [fp32_kw] * N, "fp32-guard": [guard_kw] * N}


def refusal(root, arms):
    """The line verdicts refuses the runs with, or None if it judges them (then rule 2v must pass)."""
    groups = write_arms(root, arms)
    try:
        verdict = {row[0]: row[1] for row in verdicts.verdicts(groups)}["2v"]
    except SystemExit as e:
        return str(e)
    assert verdict == "reproduced"
    return None


ADVICE = ": put each kind in a folder of its own and report them apart"


@pytest.mark.parametrize("fp32, guard, differ", [
    param({"preset": "lab", "lr": 0.003}, {"preset": "demo", "lr": 0.03},
          'preset "lab" (fp32), "demo" (fp32-guard); lr 0.003 (fp32), 0.03 (fp32-guard)',
          id="the lab's preset and lr against the demo's (2v blamed the guard for the gap)"),
    param({"max_steps": 300}, {"max_steps": 3}, "max_steps 300 (fp32), 3 (fp32-guard)",
          id="max_steps, which a resume may change, arms must share"),
    param({"guard_threshold": 200.0}, {"guard_threshold": 0.01}, "guard_threshold 200.0 (fp32), 0.01 (fp32-guard)",
          id="a flag only one arm acts on is still not the arm's own"),
    param({"device": "cpu", "eval_iters": 4, "log_interval": 10, "out_dir": "a", "compile": False},
          {"device": "cuda", "eval_iters": 8, "log_interval": 1, "out_dir": "b", "compile": True}, None,
          id="run-specific flags may differ"),
    param({}, {"collapse_grace": 50}, None, id="a flag only some runs record is compared among those"),
])
def test_a_rule_refuses_runs_that_differ_in_more_than_their_arms_flags(tmp_path, fp32, guard, differ):
    arms = healthy_2v({"args": {"guard": "off", **fp32}}, {"args": {"guard": "on", **guard}})
    expected = f"error: rule 2v's runs differ in flags that its arms do not set, {differ}{ADVICE}" if differ else None
    assert refusal(tmp_path, arms) == expected


H1, H2 = "1" * 64, "2" * 64


@pytest.mark.parametrize("fp32, guard, differ", [
    param(H1, H2, "content_sha256 111111111111 (fp32), 222222222222 (fp32-guard)", id="two datasets"),
    param(H1, None, "content_sha256 111111111111 (fp32), unrecorded (fp32-guard)", id="recorded and unrecorded"),
    param(H1, H1, None, id="the same data from two folders"),
    param(None, None, 'differ in flags that its arms do not set, data_dir "/a/pycode-byte" (fp32), "/b/pycode-byte" '
          '(fp32-guard)', id="unrecorded: only the folder tells"),
])
def test_a_rule_refuses_runs_trained_on_different_data(tmp_path, fp32, guard, differ):
    arms = healthy_2v({"data": fp32, "args": {"guard": "off", "data_dir": "/a/pycode-byte"}},
                      {"data": guard, "args": {"guard": "on", "data_dir": "/b/pycode-byte"}})
    line = refusal(tmp_path, arms)
    if differ is None:
        assert line is None
    else:
        words = differ if differ.startswith("differ") else f"trained on different data, {differ}"
        assert line == f"error: rule 2v's runs {words}{ADVICE}"


def test_a_refusal_is_one_line_and_names_every_mixed_rule(tmp_path):
    arms = {**RULE1, **RULE2V}
    arms["fp32"] = [{"args": {"preset": "demo"}}] * N     # fp32 is an arm of rules 1 and 2v
    arms["bf16"] = arms["bf16-safemax"] = arms["fp32-guard"] = [{"args": {"preset": "lab"}}] * N
    write_arms(tmp_path / "runs", arms)
    out = report_cmd(tmp_path / "runs", "--markdown", tmp_path / "R.md")
    assert out.returncode != 0 and "Traceback" not in out.stderr and out.stdout == ""
    assert out.stderr.splitlines() == ['error: rule 1\'s runs differ in flags that its arms do not set, preset "lab" '
                                       '(bf16, bf16-safemax), "demo" (fp32) (and rule 2v too)' + ADVICE]
    assert not (tmp_path / "R.md").exists()


def test_the_flags_a_rules_arms_may_differ_in():
    import run
    # a resume may change these (run.py's list); max_steps, though, the arms must share
    # data_dir too: where a run recorded its data's content hash, the hash decides; else only the folder tells
    assert loading.RUN_SPECIFIC == (run.RESUMABLE_CHANGES - {"max_steps", "data_dir"}) | {"seed"}
    from lab.assay import Assay
    flags = set(run.build_parser(Assay()).flag_defaults)   # lab.train_assay's: train.py's and the assay's
    assert all(loading.OWN_FLAGS[name] <= flags for name in loading.OWN_FLAGS)
    assert loading.OWN_FLAGS["fp32-guard"] == {"accum", "guard"}
    assert loading.OWN_FLAGS["lr-guard-clip"] == {"accum", "lr", "min_lr", "warmup_steps", "schedule", "guard",
                                                 "guard_action"}
    assert set(loading.OWN_FLAGS) >= {n for s in sweep.SOURCES for n in sweep.experiments([5, 6], source=s)}


@pytest.mark.parametrize("root", ["lab", "lr"])
def test_the_committed_runs_are_judged_not_refused(root):
    # every committed run records the one dataset it trained on (the same bytes on every machine)
    groups = loading.load_runs(os.path.join(ROOT, "lab", "results", root))
    rows = verdicts.verdicts(groups) if root == "lab" else verdicts.lr_verdicts(groups)
    assert [r[0] for r in rows if r[1] != "not run"] == (["3", "3+", "4", "5 (assay)", "6 (assay)"] if root == "lab" else
                                                         ["1p", "2p", "7p"]), "judged, not refused"
    datasets = {json.dumps(r.config["data"], sort_keys=True) for rs in groups.values() for r in rs}
    assert len(datasets) == 1 and json.loads(datasets.pop())["dataset"] == "pycode"


# --------------------------------------------------------------------------------------------------
# Report helpers: survival curves, the dose table, the text and Markdown tables

def test_survival_kaplan_meier(tmp_path):
    runs = write_arms(tmp_path, {"bf16": [{"collapse": 10}, {"collapse": 20, "steps": 40}, {"steps": 31},
                                          {"steps": 31}]})["bf16"]
    assert figures.survival(runs) == [(0, 1.0), (10, 0.75), (20, 0.5)]
    assert figures.survival(runs[2:]) == [(0, 1.0)]


def test_survival_counts_a_run_censored_at_a_collapse_step_at_risk(tmp_path):
    runs = write_arms(tmp_path, {"bf16": [{"collapse": 10}, {"steps": 11}]})["bf16"]   # censored at step 10
    assert figures.survival(runs) == [(0, 1.0), (10, 0.5)]


def test_dose_table_counts_finished_runs(tmp_path):
    # against the same seed's no-error run; unfinished: seed 5's no-error run, seed 4's error run
    groups = write_arms(tmp_path, {inject("mlp-out", 3.0): [RUNAWAY, COLLAPSE, OK, {**RUNAWAY, "end": None},
                                                            RUNAWAY],
                                   inject("mlp-out", 3.0, fix=True): [OK, OK],
                                   inject("delta", 30.0, 0.5): [{"logit": 0.99 * R}],
                                   sweep.NO_ERROR: [OK, OK, OK, OK, UNFINISHED]})
    table = {(site, label): cells for site, label, *cells in tables.dose_table(groups)}
    assert set(table) == {("mlp-out", "coherence 1"), ("mlp-out", "coherence 1 + QK-only fix"),
                          ("delta", "coherence 0.5")}, "only what ran"
    assert sweep.DOSES == (0.3, 1.0, 3.0, 10.0, 30.0)   # the columns below
    assert table["mlp-out", "coherence 1"] == ["-", "-", "2/3", "-", "-"]
    assert table["mlp-out", "coherence 1 + QK-only fix"] == ["-", "-", "0/2", "-", "-"]
    assert table["delta", "coherence 0.5"] == ["-", "-", "-", "-", "0/1"]


def test_build_text_has_every_rule_and_the_dose_table(tmp_path):
    groups = write_arms(tmp_path, {**RULE1, inject("delta", 3.0): [RUNAWAY]})
    text = text_report(groups, str(tmp_path))
    for rule, words, _, _ in verdicts.RULES:
        assert re.search(rf"^{re.escape(rule)} +(REPRODUCED|NOT REPRODUCED|INCONCLUSIVE|NOT RUN) ", text, re.M), rule
        assert f"{rule}. {words}." in text
    assert re.search(r"^1 +REPRODUCED ", text, re.M) and re.search(r"^2 +NOT RUN ", text, re.M)
    assert "== Dose-response (claims 3 and 4)" in text and "dose 0.3  dose 1  dose 3  dose 10  dose 30" in text
    assert "== bf16 ==" in text and "bf16: 6/8 collapsed (median step 10)" in text
    assert "Dose-response" not in text_report(write_arms(tmp_path / "b", RULE1), "b")


def test_markdown_has_tables_hardware_and_commands(tmp_path):
    write_arms(tmp_path / "runs", {**RULE1, inject("mlp-out", 30.0): [RUNAWAY, OK]})
    md = tmp_path / "RESULTS.md"
    assert report.main([str(tmp_path / "runs"), "--markdown", str(md), "--plots", str(tmp_path / "plots")]) == 0
    text, claims = read_report(md)
    index = (tmp_path / "claims" / "README.md").read_text()
    assert "| claim | verdict |" in text and "| 1 | REPRODUCED |" in text and "| 2 | NOT RUN |" in text
    assert "| [1](1/README.md) | bf16 softmax state collapses" in index and "| 1: REPRODUCED |" in index
    assert "| mlp-out | coherence 1 | - | - | - | - | 1/2 |" in claims[3][0] + claims[4][0]
    record, runs = claims[1]
    assert "### bf16-safemax" in runs and "| seed2 | collapsed | 10 |" in runs
    assert "| bf16 | 10 / 8.000, collapsed at 10 | " in record   # the seed table: max logit / final val
    assert "machine NVIDIA H200 (torch 2.11.0+cu130, triton ?)" in index and "8 seeds (seed1 to seed8)" in index
    assert "Not run (cut from the sweep" in index and "bf16-guard" in index.split("Not run (cut")[1].split("\n")[0]
    assert "## Commands\n\n```bash\npython train.py --seed 1 --out-dir " in runs
    command = text.split("```bash\n")[1].split("\n```")[0].replace(" \\\n    ", " ")
    assert command == f"python -m lab.report {tmp_path / 'runs'} --markdown {md} --plots {tmp_path / 'plots'}"
    assert f"python train.py --seed 2 --out-dir {tmp_path / 'runs' / 'bf16' / 'seed2'}" in runs
    assert "python train.py" not in text + record and "| seed2 | collapsed" not in text + record
    assert ("No run of it was made by lab.sweep (the commands of its 24 runs: [runs.md](runs.md)); the sweep's own\n"
            "command for the claim") in record
    if importlib.util.find_spec("matplotlib"):  # the plots, linked relative to each record
        assert "![claim1](../../plots/claim1.png)" in record and (tmp_path / "plots" / "claim1.png").exists()
        # without --plots they go into plots/ beside the Markdown file (its folder made if need be), the records
        # into claims/ beside it, or --records
        assert report.main([str(tmp_path / "runs"), "--markdown", str(tmp_path / "out" / "R.md")]) == 0
        assert "![claim1](../../plots/claim1.png)" in (tmp_path / "out" / "claims" / "1" / "README.md").read_text()
        assert (tmp_path / "out" / "plots" / "claim1.png").exists()
        assert report.main([str(tmp_path / "runs"), "--markdown", str(tmp_path / "out" / "R.md"), "--records",
                            str(tmp_path / "out" / "lab" / "claims")]) == 0
        record = (tmp_path / "out" / "lab" / "claims" / "1" / "README.md").read_text()
        assert "![claim1](../../../plots/claim1.png)" in record and "[RESULTS.md](../../../R.md)" in record
        assert "[claim 1](lab/claims/1/README.md)" in (tmp_path / "out" / "R.md").read_text()


def test_plots_or_a_clear_skip(tmp_path, monkeypatch, capsys):
    groups = write_arms(tmp_path, {**RULE1, "bf16-guard": [TRIG], inject("delta", 3.0): [RUNAWAY, OK]})
    saved = plots_or_a_clear_skip(figures.plot_claims, groups, str(tmp_path / "p"), monkeypatch, capsys)
    # the judged rules' plots (claim 2 has no reference arm: not drawn), dose-response curves
    assert saved == [str(tmp_path / "p" / name) for name in ("claim1.png", "dose_response.png")]
    assert all(os.path.getsize(p) > 1000 for p in saved)


# --------------------------------------------------------------------------------------------------
# report.py as a command

def report_cmd(*args):
    return subprocess.run([sys.executable, "-m", "lab.report", *map(str, args)], capture_output=True,
                          text=True, timeout=120, cwd=ROOT)


def test_report_command_markdown_and_runs_figure(tmp_path):
    write_arms(tmp_path / "runs", RULE2)
    out = report_cmd(tmp_path / "runs", "--markdown", tmp_path / "R.md", "--plots", tmp_path / "plots")
    assert out.returncode == 0 and "Traceback" not in out.stderr, out.stderr
    assert re.search(r"^2 +REPRODUCED ", out.stdout, re.M) and f"markdown: {tmp_path / 'R.md'}" in out.stdout
    assert "| 2 | REPRODUCED |" in (tmp_path / "R.md").read_text()

    bad = report_cmd("--runs", tmp_path / "runs" / "bf16" / "seed1", tmp_path / "runs", "--png", tmp_path / "x.png")
    assert bad.returncode != 0 and "Traceback" not in bad.stderr and not (tmp_path / "x.png").exists()
    assert bad.stderr.strip().splitlines()[-1] == (f"report.py: error: no log.jsonl in {tmp_path / 'runs'}: give "
                                                   "run folders that train.py wrote")
    pytest.importorskip("matplotlib")
    png = tmp_path / "fig.png"
    out = report_cmd("--runs", tmp_path / "runs" / "bf16" / "seed1", tmp_path / "runs" / "bf16-guard" / "seed1",
                     "--png", png)
    assert out.returncode == 0, out.stderr
    assert f"plot: {png}" in out.stdout and png.stat().st_size > 1000


def test_a_few_runs_figure_says_what_drives_them(tmp_path):
    # the demo's figure: legends say guard off / on and from which step its action acts, the title the learning
    # rate and whether a run ran away, and it promises only the marks it draws
    demo = {"preset": "demo", "accum": "bf16", "lr": 0.03}
    off = loading.Run(write_run(tmp_path, "off", 1, logit=2 * R, args={**demo, "guard": "off"}))
    on = loading.Run(write_run(tmp_path, "on", 1, trigger=5, args={**demo, "guard": "on", "guard_action": "qknorm"}))
    assert [figures.describe(off), figures.describe(on)] == ["guard off", "guard on (QK-norm from step 6)"]
    assert figures.runs_title([off, on]) == ("a max-logit runaway at lr 0.03 (demo preset, bf16 state); dotted line: "
                                            "the guard's trigger")
    fell = loading.Run(write_run(tmp_path, "fell", 1, collapse=10, args={**demo, "lr": 0.003, "guard": "off"}))
    assert figures.runs_title([fell]) == ("a max-logit runaway at lr 0.003 (demo preset, bf16 state); x: a collapse")
    calm = loading.Run(write_run(tmp_path, "calm", 1, args={**demo, "guard": "off"}))
    assert figures.runs_title([calm]) == "training at lr 0.03 (demo preset, bf16 state)"
    other = loading.Run(write_run(tmp_path, "other", 1, trigger=5, args={"lr": 0.03, "guard": "on"}))   # no preset
    assert figures.runs_title([other]) == "training at lr 0.03; dotted line: the guard's trigger"


def test_report_survives_nothing(tmp_path, capsys):
    assert report.main([str(tmp_path)]) == 0                           # an empty folder
    out = capsys.readouterr().out
    # every rule not run, in the opening table and in the claims' table
    assert f"no runs under {tmp_path}" in out and out.count("NOT RUN") == 2 * len(verdicts.RULES) == 22
    os.makedirs(tmp_path / "bf16" / "seed1")                           # a folder without any file
    assert report.main([str(tmp_path), "--plots", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    assert "empty log" in out and out.count("NOT RUN") == 22
    out = report_cmd(tmp_path / "nowhere")
    assert out.returncode != 0 and "Traceback" not in out.stderr and "is not a folder" in out.stderr


def gzip_log(path):
    """A run folder's log.jsonl as results/ keeps it: log.jsonl.gz, the plain one removed."""
    import gzip
    import shutil
    with open(path / "log.jsonl", "rb") as f, gzip.open(path / "log.jsonl.gz", "wb") as g:
        shutil.copyfileobj(f, g)
    os.remove(path / "log.jsonl")
    return path / "log.jsonl.gz"


def test_report_runs_reads_a_gzipped_log_and_refuses_a_missing_pilot(tmp_path):
    write_arms(tmp_path / "runs", RULE2)
    gzip_log(tmp_path / "runs" / "bf16" / "seed1")
    out = report_cmd("--runs", tmp_path / "runs" / "bf16" / "seed1", tmp_path / "runs" / "bf16-guard" / "seed1",
                     "--png", tmp_path / "fig.png")
    assert out.returncode == 0 and "Traceback" not in out.stderr, out.stderr
    if importlib.util.find_spec("matplotlib"):
        assert (tmp_path / "fig.png").stat().st_size > 1000
    out = report_cmd(tmp_path / "runs", "--pilot", tmp_path / "nowhere", "--markdown", tmp_path / "R.md")
    assert out.returncode != 0 and "Traceback" not in out.stderr and out.stdout == ""
    assert out.stderr.strip().splitlines()[-1] == (f"report.py: error: --pilot {tmp_path / 'nowhere'} is not a "
                                                   "folder: give a pilot's runs, <DIR>/<experiment>/seed<k>/")
    assert not (tmp_path / "R.md").exists()


def spoil(path, how):
    """Spoil a run folder as a cut copy or a crash might; returns the file spoiled."""
    if how == "config not JSON":
        (path / "config.json").write_text('{"args": {"seed": 1')
        return path / "config.json"
    log = gzip_log(path)
    data = log.read_bytes()
    log.write_bytes(data[:len(data) // 2] if how == "gzip cut short" else b"a plain text log, not gzip")
    return log


@pytest.mark.parametrize("how", ["gzip cut short", "not gzip", "config not JSON"])
def test_an_unreadable_run_is_named_and_counted_against_its_claim(tmp_path, capsys, how):
    root = tmp_path / "runs"
    write_arms(root, {**RULE1, "bf16": arm(5, COLLAPSE)})   # 5 of 8: p = 1/32, at the margin
    bad = spoil(root / "bf16" / "seed1", how)
    groups = loading.load_runs(str(root))
    warning = capsys.readouterr().err.splitlines()
    assert len(warning) == 1 and warning[0].startswith(f"warning: {bad}: ") and "unreadable" in warning[0]
    run = groups["bf16"][0]
    assert run.status == "unreadable" and not run.finished and run.seed == "seed1"
    assert verdicts.verdicts(groups)[0][:2] == ["1", "not reproduced"]   # seed 1 counted against: 4 of 8
    out = report_cmd(root, "--markdown", tmp_path / "R.md")
    assert out.returncode == 0 and "Traceback" not in out.stderr, out.stderr
    assert [line for line in out.stderr.splitlines() if line.startswith("warning")] == warning
    assert "| seed1 | unreadable |" in (tmp_path / "claims" / "1" / "runs.md").read_text()
    if how != "config not JSON":   # sweep.py reads the log, not the config
        state = sweep.run_state(str(bad.parent))
        assert state.startswith(f"unreadable log {bad}: ")
        assert sweep.outcome(str(bad.parent), 0) == (False, f"ERROR: {state}; see {bad.parent / 'stderr.log'}")
        out = sweep_cmd("--dry-run", "--claims", "1", "--only", "bf16", "--seeds", "2", "--out-root", str(root),
                        "--resume")
        assert out.returncode == 0 and "Traceback" not in out.stderr, out.stderr
        assert out.stdout.splitlines() == [f"skip {bad.parent}: unfinished ({state}): delete {bad.parent} to run it "
                                           "again", f"skip {root / 'bf16' / 'seed2'}: collapsed"]


def test_report_refuses_an_unwritable_markdown_path_before_the_work(tmp_path):
    write_arms(tmp_path / "runs", RULE1)
    (tmp_path / "a-file").write_text("")
    for path, why in [(tmp_path / "a-file" / "R.md", f"not a folder: {tmp_path / 'a-file'}"),
                      (tmp_path / "a-file" / "sub" / "R.md", f"not a folder: {tmp_path / 'a-file' / 'sub'}"),
                      (tmp_path, f"Is a directory: {tmp_path}")]:
        out = report_cmd(tmp_path / "runs", "--markdown", path)
        assert out.returncode != 0 and "Traceback" not in out.stderr and out.stdout == "", path   # no work done
        assert out.stderr.strip().splitlines()[-1] == (f"report.py: error: --markdown {path}: cannot write it "
                                                       f"({why}): give a writable path")
    # the check truncates nothing: a report refused later leaves the old file as it was
    old = tmp_path / "old.md"
    old.write_text("the last report\n")
    write_arms(tmp_path / "mixed", {"bf16": arm(N, {"args": {"lr": 0.1}}), "fp32": arm(N, {"args": {"lr": 0.2}}),
                                    "bf16-safemax": arm(0, OK)})
    out = report_cmd(tmp_path / "mixed", "--markdown", old)
    assert out.returncode != 0 and out.stderr.startswith("error: rule 1's runs differ in flags")
    assert old.read_text() == "the last report\n"


# --------------------------------------------------------------------------------------------------
# sweep.py

def sweep_cmd(*args, timeout=60):
    return subprocess.run([sys.executable, "-m", "lab.sweep", *args], capture_output=True, text=True,
                          timeout=timeout, cwd=ROOT)


def test_sweep_dry_run_default_seeds_seed_major(tmp_path):
    root = str(tmp_path)
    out = sweep_cmd("--dry-run", "--claims", "1", "--only", "bf16,fp32", "--out-root", root, "--", "--max-steps", "5")
    assert out.returncode == 0, out.stderr
    expected = [shlex.join([sys.executable, "train.py", "--accum", name, "--max-steps", "5", "--seed", str(k),
                            "--out-dir", f"{root}/{name}/seed{k}"]) for k in range(1, N + 1) for name in ("bf16", "fp32")]
    assert out.stdout.splitlines() == expected and len(expected) == 2 * sweep.SEEDS == 16
    out = sweep_cmd("--dry-run", "--claims", "1", "--only", "fp32", "--seeds", "9-11", "--out-root", root)
    assert [line.split("--seed ")[1].split()[0] for line in out.stdout.splitlines()] == ["9", "10", "11"]


def test_sweep_refuses_extra_flags_that_would_change_an_arm(tmp_path):
    # the flags after `--` come last, so --max-steps there would silently cut claim 6's long-horizon arms
    out = sweep_cmd("--dry-run", "--claims", "6", "--source", "assay", "--out-root", str(tmp_path), "--",
                    "--max-steps", "600")
    assert out.returncode == 2 and out.stdout == "" and out.stderr.splitlines()[-1] == (
        "sweep.py: error: --max-steps after `--` would override what arm assay-guard-long sets itself (and 1 more "
        "arms): drop it there, or leave those arms out of --only")
    out = sweep_cmd("--dry-run", "--claims", "6", "--source", "assay", "--only", "assay-guard-lr-drop-long",
                    "--seeds", "1", "--out-root", str(tmp_path))
    assert out.returncode == 0 and "--guard-action lr-drop" in out.stdout and \
        f"--max-steps {sweep.LONG_STEPS}" in out.stdout, out.stderr
    out = sweep_cmd("--dry-run", "--claims", "1", "--only", "bf16", "--seeds", "1", "--out-root", str(tmp_path),
                    "--", "--accum=fp32")
    assert out.returncode == 2 and "--accum after `--` would override what arm bf16 sets itself:" in out.stderr


def test_the_readme_lab_sweep_commands_name_real_arms(tmp_path, capsys):
    # every lab.sweep command of lab/README.md's CPU lab block, dry-run as written (a typo in an --only list, or
    # an extra flag an arm sets itself, would stop it)
    with open(os.path.join(ROOT, "lab", "README.md")) as f:
        block = f.read().split("The CPU lab's claims 3 to 6")[1].split("```bash")[1].split("```")[0]
    block = block.replace("\\\n", "")       # bash's line continuation
    extra = re.search(r'^X="([^"]*)"', block, re.M).group(1)
    commands = [shlex.split(line.split("#")[0].replace("$X", extra))[3:] for line in block.splitlines()
                if line.startswith("python -m lab.sweep")]
    assert len(commands) >= 8
    for argv in commands:
        argv[argv.index("--out-root") + 1] = str(tmp_path)
        assert sweep.main(["--dry-run", *argv]) == 0, argv
        assert re.search(r"train\.py|lab\.train_assay", capsys.readouterr().out)   # the commands it planned


def test_the_readme_stream_study_commands_plan_what_its_rule_names(tmp_path, capsys):
    # lab/README.md's claim-1 stream study, dry-run as written: the arms, seeds and preset its pre-registered
    # rule (lab/preregistered/claim1-stream.md) names
    with open(os.path.join(ROOT, "lab", "README.md")) as f:
        block = f.read().split("Claim 1 at CPU scale, with the bf16 state")[1].split("```bash")[1].split("```")[0]
    commands = [shlex.split(line.split("#")[0])[3:] for line in block.replace("\\\n", "").splitlines()
                if line.startswith("python -m lab.sweep")]
    planned = []
    for argv in commands:
        argv[argv.index("--out-root") + 1] = str(tmp_path)
        assert sweep.main(["--dry-run", *argv]) == 0, argv
        planned += [line for line in capsys.readouterr().out.splitlines() if "train.py" in line]
    assert len(planned) == 3 * 8 + 8 and all("--preset stream" in line for line in planned)
    from lab import claim1
    seeds = {int(line.split("--seed ")[1].split()[0]) for line in planned}
    assert seeds == set(claim1.SEEDS) | set(claim1.AA_SEEDS)


def test_sweep_shared_arm_runs_once():
    chosen = sweep.experiments([1, 2, 5])
    assert chosen["bf16"] == ["--accum", "bf16"] and list(chosen).count("bf16") == 1
    out = sweep_cmd("--dry-run", "--claims", "1,2,5", "--only", "bf16", "--seeds", "2", "--out-root", "r")
    assert out.returncode == 0 and len(out.stdout.splitlines()) == 2
    # an arm in several claims is one set of runs: its flags must be the same in each
    for name in {n for _, arms in sweep.CLAIMS.values() for n in arms}:
        assert len({arms[name] for _, arms in sweep.CLAIMS.values() if name in arms}) == 1, name


@pytest.mark.parametrize("args, message", [
    (["--seeds", "0"], "argument --seeds: '0': seeds start at 1 and A-B needs A <= B, e.g. 9-16"),
    (["--seeds", "x"], "argument --seeds: 'x': give N (seeds 1..N) or A-B, e.g. 16 or 9-16"),
    (["--parallel", "0"], "--parallel must be at least 1"),
    (["--claims", "1,8"], "--claims '1,8': give some of 1,2,3,4,5,6,7"),
    (["--claims", "1", "--only", "bf16,nope"], "--only: nope not in claims 1"),
])
def test_sweep_refuses_bad_arguments(tmp_path, args, message):
    out = sweep_cmd("--dry-run", "--out-root", str(tmp_path), *args)
    assert out.returncode != 0 and "Traceback" not in out.stderr and out.stdout == ""
    assert out.stderr.strip().splitlines()[-1] == f"sweep.py: error: {message}"


def test_sweep_dry_run_skips_and_resumes(tmp_path):
    root = str(tmp_path)
    write_run(root, "fp32", 1)                     # ended: skipped
    write_run(root, "bf16", 2, collapse=10)        # collapsed: ended, skipped
    write_run(root, "bf16", 1, end=None)           # unfinished: skipped unless --resume
    write_run(root, "fp32", 2, end="interrupted")  # unfinished, no checkpoint
    args = ("--dry-run", "--claims", "1", "--only", "bf16,fp32", "--seeds", "2", "--out-root", root)
    out = sweep_cmd(*args)
    assert f"skip {root}/fp32/seed1: completed" in out.stdout and f"skip {root}/bf16/seed2: collapsed" in out.stdout
    assert f"skip {root}/bf16/seed1: unfinished (no end record): pass --resume" in out.stdout
    assert f"skip {root}/fp32/seed2: unfinished (interrupted): pass --resume" in out.stdout
    assert sum("train.py" in line for line in out.stdout.splitlines()) == 0
    open(os.path.join(root, "bf16", "seed1", "ckpt.pt"), "w").close()
    out = sweep_cmd(*args, "--resume")  # with a checkpoint or without (then train.py starts over)
    assert [line for line in out.stdout.splitlines() if "train.py" in line] == [
        shlex.join([sys.executable, "train.py", "--accum", accum, "--seed", seed, "--out-dir",
                    f"{root}/{accum}/seed{seed}", "--resume"]) for seed, accum in (("1", "bf16"), ("2", "fp32"))]


def test_the_assays_arms_launch_and_resume_through_its_command(tmp_path):
    # train.py imports nothing from lab/: an arm with an assay flag runs (and resumes) as lab.train_assay
    from lab.assay import Assay
    import run
    assert set(sweep.ASSAY_FLAGS) == {f"--{k.replace('_', '-')}" for k in run.ASSAY_UNUSED} == {
        a.option_strings[0] for a in run.build_parser(Assay())._actions if a.dest in run.ASSAY_UNUSED}
    root = str(tmp_path)
    args = ("--dry-run", "--claims", "5", "--source", "assay", "--only", "assay-probe-topk,fp32", "--seeds", "1",
            "--out-root", root)
    out = sweep_cmd(*args)
    assert out.returncode == 0, out.stderr
    probe, fp32 = (shlex.split(line) for line in out.stdout.splitlines())
    assert probe[1:3] == ["-m", "lab.train_assay"] and "--probe" in probe and probe[-1] == f"{root}/assay-probe-topk/seed1"
    assert fp32[1] == "train.py" and fp32[-1] == f"{root}/fp32/seed1"
    write_run(root, "assay-probe-topk", 1, end="interrupted", args={"probe": "qk-topk"})
    out = sweep_cmd(*args, "--resume")
    assert [shlex.split(line)[1:3] + shlex.split(line)[-1:] for line in out.stdout.splitlines() if "probe" in line] \
        == [["-m", "lab.train_assay", "--resume"]], out.stdout



def test_a_records_commands_type_an_assay_run_as_its_command_today():
    # runs made before the assay left train.py recorded train.py with the assay's flags, which train.py now
    # refuses; runs lab.train_assay made record its file's path: both are typed as `python -m lab.train_assay`
    from lab.tables import typed_again
    old = ["train.py", "--accum", "fp32", "--inject-site", "delta", "--seed", "1", "--out-dir", "runs/a/s1"]
    new = ["/home/x/qk/lab/train_assay.py", "--probe", "qk-topk", "--seed", "2"]
    assert typed_again(old) == ["python", "-m", "lab.train_assay", *old[1:]]
    assert typed_again(new) == ["python", "-m", "lab.train_assay", "--probe", "qk-topk", "--seed", "2"]
    assert typed_again(["train.py", "--inject-scale=3"])[:3] == ["python", "-m", "lab.train_assay"]
    plain = ["train.py", "--accum", "bf16", "--guard", "on"]
    assert typed_again(plain) == ["python", *plain]
    assert typed_again(["-m", "lab.fault_size"]) == ["python", "-m", "lab.fault_size"]

def test_sweep_runs_every_arm_the_rules_read():
    """Every arm a rule of report.py judges is launched by that rule's claim in sweep.py; claims 3
    and 4 are the dose grid at both sites."""
    for source in sweep.SOURCES:
        ran = {name: ["a run"] for name in {**sweep.probe_arms(source), **sweep.action_arms(source)}}
        for label, claim, arms, _ in verdicts.expanded_rules(ran):
            launched = sweep.experiments([int(claim[0])], source=source)
            arms = arms({name: ["a run"] for name in launched}) if callable(arms) else arms
            assert set(arms) <= set(launched), (label, source)
    assert set(sweep.experiments([4])) == {inject(s, d, c) for s in ("mlp-out", "delta") for d in sweep.DOSES
                                           for c in sweep.COHERENCES} | {sweep.NO_ERROR}
    assert set(sweep.experiments([3])) == {inject(s, d, 1.0, f) for s in sweep.SITES for d in sweep.DOSES
                                           for f in (False, True)} | {sweep.NO_ERROR, sweep.QKNORM_ALONE}
    assert sweep.experiments([3])[inject("delta", 3.0, 1.0, True)] == [
        "--accum", "fp32", "--inject-site", "delta", "--inject-scale", "3", "--inject-coherence", "1",
        "--qk-fix", "clean-grad"]
    assert sweep.experiments([3])[inject("grad-wv", 30.0, 1.0, True)][-2:] == ["--qk-fix", "qknorm"]
    assert "assay-probe-equal" in sweep.experiments([5], source="assay")
    assert "assay-guard-fp32-accum" not in sweep.experiments([6], source="assay"), "fp32 state: nothing to switch"


def test_sweep_launches_every_arm_the_lr_rules_read():
    """The lr study's arms are claims 1, 2 and 7's (sweep.LR_STUDY_ARMS, on gpt2 and llama)."""
    launched = sweep.experiments([1, 2, 7])
    for label, _, arms, _ in verdicts.LR_RULES:
        assert set(arms) <= set(launched) and label in verdicts.LR_TITLES, label
    assert {a for _, _, arms, _ in verdicts.LR_RULES for a in arms} == {
        prefix + a for prefix in lr_rules.ARCHS.values() for a in sweep.LR_STUDY_ARMS}
    pairs = (*sweep.AA_ARMS.values(), *sweep.TILE_ARMS.values())
    assert set(figures.LR_WORDS) == set(sweep.LR_STUDY_ARMS) | {a for pair in pairs for a in pair}


def test_experiment_table_is_valid_train_flags():
    """Every experiment's flags parse in train.py, or (the assay's arms) in lab.train_assay: no run of the GPU
    session dies on a typo."""
    import train
    from lab.assay import Assay
    parse_args = train.run.parse_args    # train.py's own flag parser, with the assay's extension or without
    for number in sweep.CLAIMS:
        for name, flags in sweep.experiments([number]).items():
            assay = Assay() if set(flags) & set(sweep.ASSAY_FLAGS) else None
            args = parse_args(flags + ["--max-steps", "1"], assay)[0]
            assert (args.guard == "on") == ("-guard" in name), name  # only guard arms are guarded


def test_report_reads_gzipped_logs_as_results_keeps_them(tmp_path):
    import gzip
    import shutil
    write_arms(tmp_path / "runs", RULE1)
    for path in (tmp_path / "runs").glob("*/seed*"):
        with open(path / "log.jsonl", "rb") as f, gzip.open(path / "log.jsonl.gz", "wb") as g:
            shutil.copyfileobj(f, g)
        os.remove(path / "log.jsonl")
    groups = loading.load_runs(str(tmp_path / "runs"))
    assert {r.status for rs in groups.values() for r in rs} == {"completed", "collapsed"}
    assert judge(tmp_path / "again", "1", RULE1) == verdicts.verdicts(groups)[0][1] == "reproduced"
    assert sweep.run_state(str(tmp_path / "runs" / "bf16" / "seed1")) == "collapsed"


def test_read_log_drops_the_records_a_resume_replays(tmp_path):
    lines = [{"event": "start", "step": 0}, {"event": "eval", "step": 0, "val_loss": 9.0},
             *({"step": s, "loss": 10.0 - s} for s in range(6)), {"event": "eval", "step": 4, "val_loss": 7.0},
             {"event": "guard_trigger", "step": 5}, {"event": "resume", "step": 4},
             *({"step": s, "loss": 20.0 - s} for s in range(4, 8)), {"event": "end", "status": "completed", "step": 8}]
    (tmp_path / "log.jsonl").write_text("".join(json.dumps(r) + "\n" for r in lines))
    records = sweep.read_log(str(tmp_path))
    assert [r["loss"] for r in records if "loss" in r] == [10, 9, 8, 7, 16, 15, 14, 13]
    assert [r["step"] for r in records if r.get("event") == "eval"] == [0, 4], "the eval at the checkpoint stays"
    assert not any(r.get("event") == "guard_trigger" for r in records), "a trigger after the checkpoint is replayed"
    assert sweep.replayed({"step": 4}, 4) and not sweep.replayed({"step": 3}, 4)
    assert not sweep.replayed({"event": "eval", "step": 4}, 4) and sweep.replayed({"event": "eval", "step": 5}, 4)


def test_read_log_drops_everything_before_a_resume_that_starts_over(tmp_path):
    # killed before its first checkpoint: --resume starts it over at step 0 (from_checkpoint false)
    lines = [{"event": "start", "step": 0}, {"event": "eval", "step": 0, "val_loss": 9.0},
             *({"step": s, "loss": 10.0 - s} for s in range(3)),
             {"event": "resume", "step": 0, "from_checkpoint": False}, {"event": "eval", "step": 0, "val_loss": 9.5},
             *({"step": s, "loss": 20.0 - s} for s in range(4)), {"event": "end", "status": "completed", "step": 4}]
    (tmp_path / "log.jsonl").write_text("".join(json.dumps(r) + "\n" for r in lines))
    records = sweep.read_log(str(tmp_path))
    assert [r["loss"] for r in records if "loss" in r] == [20, 19, 18, 17]
    assert [r["val_loss"] for r in records if r.get("event") == "eval"] == [9.5]
    assert records[0]["event"] == "start"


# --------------------------------------------------------------------------------------------------
# sweep then report, on real tiny CPU runs

@pytest.fixture(scope="module")
def data_dir(tmp_path_factory):
    import sysconfig
    import prepare_data
    stdlib = sysconfig.get_paths()["stdlib"]
    out = tmp_path_factory.mktemp("data")
    prepare_data.prepare(dataset="text", out_dir=str(out), val_fraction=0.2, tokenizer="byte",
                         inputs=[os.path.join(stdlib, n + ".py") for n in ("abc", "argparse", "ast", "bisect",
                                                                           "calendar", "contextlib", "copy", "csv")])
    return str(out)


def test_sweep_and_report_end_to_end(tmp_path, data_dir):
    root = str(tmp_path / "runs")
    arms = ("bf16", "fp32", "bf16-safemax")
    cmd = ["--claims", "1", "--only", ",".join(arms), "--seeds", "1", "--parallel", "3", "--out-root", root, "--",
           "--max-steps", "4", "--n-layer", "1", "--n-head", "2", "--n-embd", "32", "--block-size", "32",
           "--batch-size", "2", "--attn-impl", "torch", "--device", "cpu", "--eval-iters", "1", "--log-interval", "1",
           "--data-dir", data_dir]
    out = sweep_cmd(*cmd, timeout=300)
    assert out.returncode == 0, out.stdout + out.stderr
    assert out.stdout.count("[end ") == 3 and "ERROR" not in out.stdout
    for name in arms:
        assert sweep.run_state(os.path.join(root, name, "seed1")) == "completed"
        assert os.path.getsize(os.path.join(root, name, "seed1", "stdout.log")) > 0
    assert "nothing to run" in sweep_cmd(*cmd).stdout

    groups = loading.load_runs(root)                  # what train.py logged is what report.py reads
    for name in arms:
        run = groups[name][0]
        assert run.finished and not run.collapsed and run.steps == [0, 1, 2, 3] and run.final_val is not None
        assert all(run.growth(kind) > 0 for kind in KINDS), "every weight kind's sigma is logged"
    rep = report_cmd(root, "--markdown", tmp_path / "R.md")
    assert rep.returncode == 0 and "Traceback" not in rep.stderr, rep.stderr
    for name in arms:
        assert f"== {name} ==" in rep.stdout and f"{name}: 0/1 collapsed" in rep.stdout
    # one seed: judged (all its arms ran) and inconclusive (no sign test on 1 seed reaches p < 0.05)
    assert re.search(r"^1 +INCONCLUSIVE ", rep.stdout, re.M), rep.stdout
    assert "| 1 | INCONCLUSIVE |" in (tmp_path / "R.md").read_text()


def test_lr_study_sweep_and_report_end_to_end(tmp_path, data_dir):
    """lab.sweep --lrs at a tiny size, then lab.report --lr-study reads what train.py logged."""
    study, root = str(tmp_path / "study"), tmp_path / "runs"
    write_arms(root, RULE1)
    out = sweep_cmd("--claims", "1,2", "--only", "fp32,bf16", "--lrs", "1e-3,1e-1", "--seeds", "1", "--parallel", "2",
                    "--out-root", study, "--", "--max-steps", "4", "--n-layer", "1", "--n-head", "2", "--n-embd", "32",
                    "--block-size", "32", "--batch-size", "2", "--attn-impl", "torch", "--device", "cpu",
                    "--eval-iters", "1", "--log-interval", "1", "--data-dir", data_dir, timeout=300)
    assert out.returncode == 0 and out.stdout.count("[end ") == 4 and "ERROR" not in out.stdout, out.stdout + out.stderr
    groups = loading.load_runs(study)
    assert sorted(groups) == ["bf16-lr0.001", "bf16-lr0.1", "fp32-lr0.001", "fp32-lr0.1"]
    for name, runs in groups.items():
        run = runs[0]
        assert run.finished and run.init_val is not None and run.final_val is not None and run.max_logit > 0, name
        assert run.config["args"]["lr"] == run.config["args"]["min_lr"] == sweep.split_lr(name)[1]
    rep = report_cmd(root, "--lr-study", study, "--markdown", tmp_path / "R.md", "--plots", tmp_path / "plots")
    assert rep.returncode == 0 and "Traceback" not in rep.stderr, rep.stderr
    assert f"== Learning-rate study ({study}): claims 1, 2 and 7 as a proxy at CPU scale ==" in rep.stdout
    assert re.search(r"^1p +NOT RUN +claim 1 as a proxy", rep.stdout, re.M)   # no bf16-safemax runs
    text, claims = read_report(tmp_path / "R.md")
    record, runs = claims[1]
    assert f"--lr-study {study} --markdown" in text.replace(" \\\n    ", " ")
    assert "learning rates 0.001, 0.1 (each run's lr and min_lr)" in (tmp_path / "claims" / "README.md").read_text()
    assert re.search(r"^\| bf16 \| 0\.1 \| seed1 \| completed \| \d", runs, re.M)
    assert "| 2p | NOT RUN |" in text and "## The learning-rate study, gpt2: LR sensitivity" in record
    if importlib.util.find_spec("matplotlib"):
        assert (tmp_path / "plots" / "lr-gpt2.png").stat().st_size > 1000 and "![lr-gpt2](../../plots/lr-gpt2.png)" in record


def test_every_arm_of_every_claim_runs_end_to_end_and_is_judged(tmp_path, data_dir):
    """A tiny sweep of every arm (run in this process, 3 steps each, one seed): each run ends, and
    every rule of report.py reads them and gives a verdict, none of them "not run"."""
    import train
    root = tmp_path / "runs"
    tiny = ["--max-steps", "3", "--n-layer", "2", "--n-head", "2", "--n-embd", "32", "--block-size", "32",
            "--batch-size", "2", "--attn-impl", "torch", "--device", "cpu", "--eval-iters", "1", "--log-interval",
            "1", "--data-dir", data_dir, "--guard-threshold", "0.01", "--seed", "1"]   # a low threshold: triggers
    arms = {**sweep.experiments(list(sweep.CLAIMS)),
            **{name: flags for source in ("assay", "lr") for name, flags in sweep.experiments([5, 6], source=source)
               .items()}}   # claims 5 and 6 on the CPU lab's runaways too
    assert len(arms) > 70
    from lab.assay import Assay
    for name, flags in arms.items():
        out = root / name / "seed1"
        assay = Assay() if set(flags) & set(sweep.ASSAY_FLAGS) else None   # as the sweep runs it
        train.main(flags + tiny + ["--out-dir", str(out)], extension=assay)
        assert sweep.run_state(str(out)) == "completed", name
    groups = loading.load_runs(str(root))
    assert set(groups) == set(arms)
    triggered = {name for name, runs in groups.items() if runs[0].trigger is not None}
    assert "bf16-guard" in triggered and triggered <= {n for n in arms if "guard" in n}
    rows = verdicts.verdicts(groups)
    per_source = lambda claim: [claim] + [f"{claim} ({s})" for s in ("assay", "lr")]
    assert [row[0] for row in rows] == [label for rule in verdicts.RULES for label in (
        per_source(rule[0]) if rule[0] in verdicts.SOURCE_RULES else [rule[0]])]
    assert all(verdict == "inconclusive" for _, verdict, _ in rows), rows     # one seed: judged, not decided


def test_the_lab_scripts_numeric_flags_refuse_nonsense_in_one_line():
    """0, -1, nan and inf through the numeric flags of lab.sweep and lab.bench, as a user runs them."""
    from test_training import assert_numeric_flags_refuse_nonsense
    assert_numeric_flags_refuse_nonsense([("-m lab.sweep", ["--dry-run", "--claims", "1"], ["--seeds", "--parallel"]),
                                          ("-m lab.bench", ["--smoke"], ["--steps", "--warmup", "--batch-size"])], ROOT)


# --------------------------------------------------------------------------------------------------
# The doses in the bf16 state's own units (lab.fault_size, read by lab.report)

def test_fault_size_measures_the_bf16_states_error_and_report_prints_the_doses_in_its_units(tmp_path, data_dir):
    from lab import fault_size
    out = tmp_path / "runs" / "fault_size.json"
    out.parent.mkdir()
    fault_size.main(["--seeds", "2", "--out", str(out), "--n-layer", "2", "--n-head", "2", "--n-embd", "32",
                     "--block-size", "32", "--batch-size", "2", "--attn-impl", "torch", "--device", "cpu",
                     "--data-dir", data_dir])
    fault = json.loads(out.read_text())
    assert [r["seed"] for r in fault["per_seed"]] == [1, 2]
    error = fault["median"]["error_ratio_median"]
    # bf16 state's error: above fp32 roundoff, far below the signal; its mean (bias) is a part of it
    assert 1e-5 < error < 0.1 and 0 < fault["median"]["bias_ratio_median"] <= fault["median"]["error_ratio_max"]
    assert fault["command"][:3] == ["python", "-m", "lab.fault_size"]
    groups = write_arms(out.parent, {inject("mlp-out", 3.0): [RUNAWAY], **NOERR})
    text = text_report(groups, str(out.parent))
    assert f"dose 0.3 is {0.3 / error:.3g}x, dose 1 is {1 / error:.3g}x" in text and "initial models of 2 seeds" in text
    out.write_text("{not json")
    broken = text_report(groups, str(out.parent))
    assert "The doses in units" in text and "The doses in units" not in broken


def test_fault_size_without_a_device_measures_on_the_cpu(tmp_path, data_dir):
    """--device auto (the default) reached torch as the device "auto": a traceback."""
    from lab import fault_size
    out = tmp_path / "made" / "fault_size.json"          # its folder made
    fault_size.main(["--seeds", "1", "--out", str(out), "--n-layer", "1", "--n-head", "2", "--n-embd", "32",
                     "--block-size", "32", "--batch-size", "2", "--attn-impl", "torch", "--data-dir", data_dir])
    assert [r["seed"] for r in json.loads(out.read_text())["per_seed"]] == [1]


def test_pilot_rows_give_the_steps_a_horizon_is_chosen_from(tmp_path):
    # the max logit climbs 100 a step: past the guard's 200 first at step 3, at RUNAWAY_LOGIT (1000) at 10
    write_run(tmp_path, "assay", 101, steps=20, logit=lambda s: 100.0 * s)
    write_run(tmp_path, "fp32", 101, steps=20)
    rows_ = {r[0]: r for r in tables.pilot_rows(loading.load_runs(str(tmp_path)))}
    assert rows_["assay"][4] == "3 / 10" and rows_["fp32"][4] == "- / -"


FOLDER_WORD = re.compile(r"\b(probe|guard|qknorm|llama|fp32|bf16|logits|pv|state)-[a-z]")   # an arm name's piece


def test_every_claim_arm_has_a_legend_in_words():
    # a figure reads without the code: no arm's legend is its folder name, or ends in one ("probe-shrink")
    for claim, (_, arms) in sweep.CLAIMS.items():
        for name in arms:
            words = figures.arm_words(name)
            assert words != name and not FOLDER_WORD.search(words), (claim, name, words)
    for source in sweep.SOURCES:
        for name in {**sweep.probe_arms(source), **sweep.action_arms(source)}:
            words = figures.arm_words(name)
            assert words != name and not FOLDER_WORD.search(words), (source, name, words)


def test_the_committed_rules_numbers_and_their_history():
    # the rules' numbers, as committed (the records print them: the index's shared terms); how they came to be is
    # prose in lab/MEASUREMENTS.md, no longer constants printed into the results
    assert (thresholds.ALPHA, thresholds.LOSS_TOL, thresholds.FINAL_WINDOW, thresholds.RUNAWAY_LOGIT,
            thresholds.SIGMA_RATIO, thresholds.LOGIT_RATIO, thresholds.LOGIT_GAP, thresholds.FIX_TOL) == \
        (0.05, 0.03, 5, 1000.0, 2.0, 10.0, 2.0, 0.1)
    assert thresholds.COMMITTED_LRS == sweep.LRS and all(set(d) <= set(sweep.DOSES)
                                                         for d in thresholds.COMMITTED_DOSES.values())
    with open(os.path.join(ROOT, "lab", "claims", "README.md")) as f:
        index = f.read()
    assert ("ALPHA=0.05, FINAL_WINDOW=5, LOSS_TOL=0.03, RUNAWAY_LOGIT=1000, SIGMA_RATIO=2, LOGIT_RATIO=10, LOGIT_GAP=2, "
            "FIX_TOL=0.1 (lab/thresholds.py)") in index
    assert "mlp-out 3 doses, grad-mlp 5 doses, grad-wv 5 doses, delta 5 doses, the learning-rate study 5 lrs" in index
    with open(os.path.join(ROOT, "lab", "MEASUREMENTS.md")) as f:
        history = f.read().split(f"## {docs.HISTORY}\n")[1].split("\n## ")[0]
    for said in ("What the first rules said on the first, 300-step logs (commit 988d81c",
                 "What the rules before (commit 8f7ffca) said on the logs they had: 2p: not reproduced",
                 "What the rules before (commit b823d3f) said on the logs they had: 2p: inconclusive",
                 "**2026-12-05 (issue 54): a partial rerun keeps the committed thresholds; arms not run make a rule"):
        assert said in history, said
    assert [line[2:].split(":")[0] for line in history.splitlines() if re.match(r"- \d", line)] == \
        ["2p", "5", "6", "1p", "2p", "3+", "4", "3", "4", "5", "6", "3", "4", "5", "6"], "each change and verdict, by claim"
    import lab.report as cli
    with open(cli.__file__) as f:
        assert not re.search(r"RULE_CHANGES|V\d_CHANGES|V\d_VERDICTS|FIRST_VERDICTS", f.read())


def regenerate(tmp_path, committed):
    """Run the one command on RESULTS.md's first lines, in a copy of the repository's layout whose lab/results
    is the committed one: {path from the root: bytes} of every file it wrote."""
    block = committed.split("```bash\n", 1)[1].split("\n```", 1)[0]
    argv = shlex.split(block.replace("\\\n", " "))
    assert argv[:3] == ["python", "-m", "lab.report"], argv
    os.makedirs(tmp_path / "lab")
    os.symlink(os.path.join(ROOT, "lab", "results"), tmp_path / "lab" / "results")
    cwd = os.getcwd()
    os.chdir(tmp_path)
    try:
        assert report.main(argv[3:]) == 0
    finally:
        os.chdir(cwd)
    return {os.path.relpath(os.path.join(d, f), tmp_path): open(os.path.join(d, f), "rb").read()
            for d, _, files in os.walk(tmp_path) for f in files}


def test_results_and_every_record_are_what_the_committed_logs_give(tmp_path):
    # RESULTS.md, every claim's record and runs, the index and the figures regenerate byte for byte from
    # lab/results/ by the one command on RESULTS.md's first lines; nothing else is in lab/claims/ (a figure's
    # bytes depend on matplotlib's version: compared where the installed one drew the committed figure)
    matplotlib = pytest.importorskip("matplotlib")
    with open(os.path.join(ROOT, "RESULTS.md")) as f:
        committed = f.read()
    again = regenerate(tmp_path, committed)
    written = {path for path in again if path.endswith(".md")}
    kept = {os.path.relpath(p, ROOT) for p in glob.glob(os.path.join(ROOT, "lab", "claims", "**", "*"), recursive=True)
            if os.path.isfile(p)} | {"RESULTS.md"}
    assert written == kept, "lab/claims/ holds files the command does not write, or lacks some"
    assert len(written) == 2 + 2 * len(sweep.CLAIMS)
    for path in sorted(written):
        with open(os.path.join(ROOT, path), "rb") as f:
            assert again[path] == f.read(), f"{path} is stale: rerun the command on RESULTS.md's first lines"
    pngs = [p for p in again if p.endswith(".png")]
    assert pngs and all(p.startswith(os.path.join("lab", "plots", "")) for p in pngs)
    for path in pngs:
        with open(os.path.join(ROOT, path), "rb") as f:
            old = f.read()
        drawn_by = re.search(rb"Matplotlib version([\d.]+)", old)
        if drawn_by and drawn_by.group(1).decode() == matplotlib.__version__:
            assert again[path] == old, f"{path} is stale: rerun the command on RESULTS.md's first lines"


def test_each_records_rerun_commands_plan_the_runs_it_read(tmp_path, monkeypatch, capsys):
    # a record's "Rerun it": its sweep commands, dry run, plan exactly the runs of its runs.md, each with the flags
    # its config.json recorded (but the out-dir: a rerun writes into runs/<the kept folder's name>)
    monkeypatch.chdir(tmp_path)
    as_run = lambda cmd: tuple(cmd[:-1] + ["/".join(cmd[-1].split("/")[-2:])])   # the out-dir's arm/seed only
    for n in sweep.CLAIMS:
        with open(os.path.join(ROOT, "lab", "claims", str(n), "README.md")) as f:
            block = f.read().split("## Rerun it\n")[1].split("```bash\n")[1].split("\n```")[0]
        with open(os.path.join(ROOT, "lab", "claims", str(n), "runs.md")) as f:
            runs = f.read().split("## Commands\n\n```bash\n")[1].split("\n```")[0].splitlines()
        recorded = {as_run(shlex.split(line)[2:]) for line in runs}
        planned = set()
        for line in block.replace("\\\n", "").splitlines():
            words = shlex.split(line)
            if words[:3] == ["python", "-m", "lab.sweep"]:
                capsys.readouterr()
                assert sweep.main(["--dry-run", *words[3:]]) == 0
                planned |= {as_run(shlex.split(cmd)[2:]) for cmd in capsys.readouterr().out.splitlines()}
        assert planned == recorded and len(planned) == len(runs), n


def opening(text, lines=40):
    """A report's first lines: where a reader finds every verdict."""
    return "\n".join(text.splitlines()[:lines])


SUMMARY_ROW = re.compile(r"^\| ([^|]+) \| (REPRODUCED|NOT REPRODUCED|REFUTED|INCONCLUSIVE|NOT RUN) \| ([^|]+) \| "
                         r"((?:[^|]|\\\|)+) \| ([^|]+) \| \[claim (\d)\]\(lab/claims/(\d)/README\.md\) \|$", re.M)


def test_results_md_is_the_verdict_table_and_links():
    # RESULTS.md: at most 150 lines, its command on its first lines in readable lines, then one row per rule (the
    # sweep's and the lr study's, in order), in capitals, with its scale, the test that decided it, why in at most
    # 20 words, and a link to its claim's record, whose table says the same; no run table, no command of a run
    with open(os.path.join(ROOT, "RESULTS.md")) as f:
        text = f.read()
    lines = text.splitlines()
    assert len(lines) <= 150 and max(map(len, lines[:12])) <= 110
    assert lines[5:7] == ["```bash", "python -m lab.report lab/results/lab --pilot lab/results/pilot --pilot "
                                     "lab/results/pilot-horizon \\"]
    rows = {m.group(1): m.groups()[1:] for m in SUMMARY_ROW.finditer(opening(text))}
    labels = [f"{label} (assay)" if label in verdicts.SOURCE_RULES else label for label, _, _, _ in verdicts.RULES]
    assert list(rows) == labels + [label for label, _, _, _ in verdicts.LR_RULES], list(rows)
    for label, (verdict, scale, key, why, claim, path) in rows.items():
        assert claim == path == label[0], label
        assert len(why.split()) <= 20, (label, why)
        if verdict == "NOT RUN":
            assert (scale, key) == ("-", "-") and why.startswith("no runs of "), label
            continue
        assert re.match(r"(gpt2|llama) \d+x\d+, ([\d/]+ steps, \d+ seeds|\d+ steps x \d+ seeds(, \d+ steps x \d+ "
                        r"seeds)+|[\d/]+ steps, \d+-\d+ seeds x \d+ lrs \(\d+ for some arms at lr [\d., ]+\))", scale), \
            (label, scale)
        assert re.search(r" of \d+ seeds.*p = |\d+ nat \(tolerance |mean gap .* nat, 90% interval \[.*\] \(margin ",
                         key), (label, key)
        with open(os.path.join(ROOT, "lab", "claims", claim, "README.md")) as f:
            record = f.read()
        assert f"| {label} | {verdict} | {scale} | {key} | {why} |" in record, label   # the record says the same
        assert re.search(rf"^## Rule {re.escape(label)}: .*\n\nThe rule: ", record, re.M) or label == "1", label
        assert f"**{verdict}**" in record, label
    assert "| seed |" not in text and "python train.py" not in text
    assert not re.search(r"\*\*[^*]*: (reproduced|not reproduced|inconclusive|refuted)\*\*", text)


def test_the_readme_claims_table_says_what_results_md_says():
    # the README's table of the claims: every rule of RESULTS.md's opening rows, with its verdict
    with open(os.path.join(ROOT, "RESULTS.md")) as f:
        results = {m.group(1): m.group(2) for m in SUMMARY_ROW.finditer(opening(f.read()))}
    with open(os.path.join(ROOT, "README.md")) as f:
        table = f.read().split("## The claims this code tests")[1].split("\n\n| claim |")[1].split("\n\n")[0]
    readme = {label: cells[2] for line in table.splitlines()[2:] for cells in [line.strip("| ").split(" | ")]
              for label in cells[0].split(", ")}
    assert readme == results and len(results) == 14


def test_the_readme_gives_each_injected_errors_dose_in_the_faults_units():
    # an injected error's row says its dose as a multiple of the bf16 state's own error (lab.fault_size's
    # measurement, three figures): the delta source and 3+ at dose 3, the grids at their ends
    with open(os.path.join(ROOT, "lab", "results", "lab", "fault_size.json")) as f:
        error = json.load(f)["median"]["error_ratio_median"]
    times = lambda dose: f"{float(f'{dose / error:.3g}'):,.0f}x"
    with open(os.path.join(ROOT, "README.md")) as f:
        table = f.read().split("## The claims this code tests")[1].split("\n\n| claim |")[1].split("\n\n")[0]
    rows_ = [line.strip("| ").split(" | ") for line in table.splitlines()[2:]]
    scale = {cells[0]: cells[3] for cells in rows_}
    assert f"about {times(3)} the fault's own error" in scale["3+"] and times(3) == "1,040x"
    assert f"about {times(3)}-{times(30)} the fault's own error" in scale["3"]
    assert f"about {times(0.3)}-{times(30)} the fault's own error" in scale["4"]
    for claim in ("5 (assay)", "6 (assay)"):
        assert f"a delta error about {times(3)} the fault's" in scale[claim]
    assert all(cells == "-" for label, cells in scale.items() if label in ("2", "2v", "7"))
    assert scale["1"].startswith("gpt2 0.83M, 4000 steps, 8 seeds; 4 key blocks per row")   # claim 1 at CPU scale
    # and RESULTS.md's rows say the same, from the runs' config.json and lab/results/lab/fault_size.json
    with open(os.path.join(ROOT, "RESULTS.md")) as f:
        results = {m.group(1): m.group(3) for m in SUMMARY_ROW.finditer(opening(f.read()))}
    assert results["3"].endswith(f"; doses 3-30, about {times(3)}-{times(30)} the fault's own error")
    for label in ("3+", "4"):
        assert results[label].endswith(f"; doses 0.3-30, about {times(0.3)}-{times(30)} the fault's own error")
    for label in ("5 (assay)", "6 (assay)"):
        assert results[label].endswith(f"; a delta error at dose 3, about {times(3)} the fault's own error")


@pytest.mark.parametrize("arms, verdict, key, why", [
    param({**RULE1, "bf16-safemax": arm(1, COLLAPSE)}, "REPRODUCED",   # over fp32: 6 vs 0, p = 0.016
          "`bf16` over `bf16-safemax` in 5 of 8 seeds, the reverse in 0: sign test p = 0.031 (< 0.05)",
          "bf16 collapsed 6/8; bf16-safemax collapsed 1/8", id="reproduced: the weakest passing test"),
    param({**RULE1, "bf16-safemax": arm(6, COLLAPSE)}, "NOT REPRODUCED", "`bf16` over `bf16-safemax` in 0 of 8 "
          "seeds, the reverse in 0: sign test p = 1 (>= 0.05)", "bf16 collapsed 6/8; bf16-safemax collapsed 6/8",
          id="not reproduced: the failing test"),
    param({**RULE1, "bf16": arm(2, COLLAPSE)}, "INCONCLUSIVE", None, None, id="too few seeds"),
])
def test_the_opening_row_shows_the_test_that_decided(tmp_path, arms, verdict, key, why):
    if verdict == "INCONCLUSIVE":   # one seed: no sign test can pass
        arms = {name: runs[:1] for name, runs in arms.items()}
    groups = write_arms(tmp_path, arms)
    row = summary.summary(groups, verdicts.verdicts(groups))[0]
    assert row[:3] == ["1", verdict, "1 seed" if key is None else "8 seeds"], row   # no model or steps recorded
    if key is None:
        assert row[4] == "too few seeds for any sign test to reach its threshold"
    else:
        assert row[3:] == [key, why]


MD_LINK = re.compile(r"\[[^\]]*\]\(([^)\s]+)\)")


def test_every_relative_link_in_the_docs_resolves():
    # README.md, SOURCES.md, RESULTS.md, lab/ and qkguard/ docs and the claims' records: a relative link names a
    # file or folder of the repo
    found = [os.path.join(d, f) for d in (ROOT, os.path.join(ROOT, "lab"), os.path.join(ROOT, "qkguard"))
             if os.path.isdir(d) for f in sorted(os.listdir(d)) if f.endswith(".md")]
    found += sorted(glob.glob(os.path.join(ROOT, "lab", "claims", "**", "*.md"), recursive=True))
    assert {"README.md", "SOURCES.md", "RESULTS.md"} <= {os.path.basename(d) for d in found}
    assert os.path.join(ROOT, "lab", "README.md") in found
    assert {os.path.join(ROOT, "lab", "claims", str(n), name) for n in sweep.CLAIMS
            for name in ("README.md", "runs.md")} <= set(found)
    broken = []
    for doc in found:
        with open(doc) as f:
            text = re.sub(r"```.*?```", "", f.read(), flags=re.S)    # code blocks hold no links
        for target in MD_LINK.findall(text):
            if re.match(r"[a-z]+:", target) or target.startswith("#"):
                continue                                              # a web address, an anchor
            path = os.path.normpath(os.path.join(os.path.dirname(doc), target.split("#")[0]))
            if not os.path.exists(path):
                broken.append(f"{os.path.relpath(doc, ROOT)}: {target}")
    assert not broken, broken


def test_dose_ratios_give_the_figures_scale(tmp_path):
    # each finished run's max logit over its seed's no-error run's; a collapse (inf) has no place on the axis
    groups = write_arms(tmp_path, {**NOERR, inject("mlp-out", 3.0): arm(7, {"logit": 100.0}, rest=COLLAPSE),
                                   inject("mlp-out", 3.0, fix=True): arm(8, {"logit": 5.0}),
                                   inject("mlp-out", 10.0): arm(7, {"logit": 30.0}, {8: UNFINISHED})})
    ratios = tables.dose_ratios(groups)
    assert ratios["mlp-out", "coherence 1"][3.0] == [10.0] * 7
    assert ratios["mlp-out", "coherence 1 + QK-only fix"][3.0] == [0.5] * 8
    assert ratios["mlp-out", "coherence 1"][10.0] == [3.0] * 7, "the unfinished run left out"
    assert ratios["delta", "coherence 0.5"][3.0] == []


def test_a_log_cut_mid_line_keeps_the_resume_fused_onto_it_and_skips_non_objects(tmp_path):
    """kill -9 or a full disk cuts a line; the resumed process's first record then shares that line. The
    reader must keep the resume (else the replayed steps count twice) and skip JSON that is no object."""
    import json as _json
    lines = [_json.dumps({"event": "start", "step": 0}), _json.dumps({"step": 9, "loss": 3.0}),
             '{"step": 19, "loss": 2.', _json.dumps({"event": "resume", "step": 10}), "[1, 2]", "7",
             _json.dumps({"step": 19, "loss": 2.5}), _json.dumps({"event": "end", "step": 20, "status": "completed"})]
    text = lines[0] + "\n" + lines[1] + "\n" + lines[2] + lines[3] + "\n" + "\n".join(lines[4:]) + "\n"
    (tmp_path / "log.jsonl").write_text(text)
    records = sweep.read_log(str(tmp_path))
    assert [r.get("event", r.get("step")) for r in records] == ["start", 9, "resume", 19, "end"]
    assert sweep.run_state(str(tmp_path)) == "completed"


def test_a_markdown_report_of_an_empty_folder_is_refused_and_the_file_kept(tmp_path):
    """`lab.report <empty folder> --markdown RESULTS.md` once replaced the committed file with "not run" lines."""
    results = tmp_path / "RESULTS.md"
    results.write_text("the committed verdicts\n")
    (tmp_path / "empty").mkdir()
    out = report_cmd(tmp_path / "empty", "--markdown", results)
    assert out.returncode != 0 and "Traceback" not in out.stderr and "no runs under" in out.stderr
    assert results.read_text() == "the committed verdicts\n"


def test_the_sweep_takes_no_abbreviation_of_its_own_flags(capsys):
    """`lab.sweep ... --seed 3` (a train.py flag put before `--`) was read as --seeds 3."""
    with pytest.raises(SystemExit):
        sweep.main(["--claims", "2", "--seed", "3", "--dry-run"])
    assert "unrecognized arguments: --seed 3" in capsys.readouterr().err


# --------------------------------------------------------------------------------------------------
# Issue 44: runs that cannot collide, results that cannot be written over, one line for every bad input

@pytest.mark.parametrize("extra, message", [
    (["--inject-sc", "99"], "--inject-sc after `--` is not a train.py flag (it abbreviates --inject-scale): give "
                            "the flag's full name"),
    (["--max-step=600"], "--max-step after `--` is not a train.py flag (it abbreviates --max-steps): give the "
                         "flag's full name"),
    (["--no-such-flag"], "--no-such-flag after `--` is not a train.py flag: see python train.py --help"),
    (["--lr", "abc"], "after `--`: argument --lr: 'abc' is not a number"),
])
def test_the_sweep_refuses_an_extra_flag_that_is_not_a_train_flag_by_its_full_name(tmp_path, capsys, extra, message):
    """argparse takes a prefix for the flag: `-- --inject-sc 99` ran the "dose 3" arm at dose 99, `-- --max-step
    600` cut a 2500-step arm to 600, both past the clash check, which compared the names as typed."""
    with pytest.raises(SystemExit):
        sweep.main(["--dry-run", "--claims", "3,6", "--source", "assay", "--seeds", "1", "--out-root",
                    str(tmp_path), "--", *extra])
    assert capsys.readouterr().err.splitlines()[-1].endswith(f".py: error: {message}")


def test_the_sweeps_clash_check_compares_what_the_flags_set(tmp_path, capsys, monkeypatch):
    """The clash check reads both flag lists through train.py's parser: with abbreviations let through (as
    argparse's default does), --inject-sc still clashes with the arm's --inject-scale."""
    import run
    build_parser = run.build_parser

    def with_prefixes(*extension):   # train.py's parser refuses them (allow_abbrev=False): the check must not rely on that
        parser = build_parser(*extension)
        parser.allow_abbrev = True
        return parser
    monkeypatch.setattr(run, "build_parser", with_prefixes)
    parser = sweep.train_flag_parser(sweep.argparse.ArgumentParser(prog="sweep.py"))
    assert sweep.typed_flags(parser, ["--inject-sc", "99"]) == {"inject_scale": 99.0}   # argparse's prefix
    monkeypatch.setattr(sweep, "unknown_flag", lambda parser, flags: None)
    with pytest.raises(SystemExit):
        sweep.main(["--dry-run", "--claims", "3", "--seeds", "1", "--out-root", str(tmp_path), "--",
                    "--inject-sc", "99"])
    assert "--inject-scale after `--` would override what arm inject-mlp-out-0.3-c1 sets itself" in \
        capsys.readouterr().err


def test_the_sweep_refuses_a_finished_run_made_with_other_flags(tmp_path, capsys):
    """A sweep launched again with another --max-steps or --lr skipped the runs made with the old ones as
    "completed"; it names the folder and what differs. A --resume may change what train.py lets it."""
    root = str(tmp_path)
    write_run(root, "fp32", 1, args={"accum": "fp32", "max_steps": 600, "lr": 1e-3})
    common = ["--dry-run", "--claims", "1", "--only", "fp32", "--seeds", "1", "--out-root", root, "--"]
    assert sweep.main([*common, "--max-steps", "600", "--lr", "1e-3"]) == 0
    assert f"skip {root}/fp32/seed1: completed" in capsys.readouterr().out
    with pytest.raises(SystemExit) as e:
        sweep.main([*common, "--max-steps", "300", "--lr", "3e-3"])
    assert str(e.value) == (f"error: {root}/fp32/seed1 was run with other flags than planned: --max-steps 300 (the "
                            f"run's: 600); --lr 0.003 (the run's: 0.001). Give the flags it was run with, or another "
                            f"--out-root (or delete it to run it again)")
    write_run(root, "bf16", 1, end=None, args={"accum": "bf16", "max_steps": 600, "lr": 1e-3})   # unfinished
    common[common.index("fp32")] = "bf16"
    assert sweep.main(["--resume", *common, "--max-steps", "900", "--lr", "1e-3"]) == 0   # may train on
    assert "--max-steps 900 --lr 1e-3 --seed 1 --out-dir" in capsys.readouterr().out
    with pytest.raises(SystemExit, match=r"seed1 was run with other flags than planned: --lr 0.003 \(the run's: "):
        sweep.main(["--resume", *common, "--lr", "3e-3"])


def test_the_sweep_compares_every_flag_a_finished_run_recorded_not_only_those_typed_now(tmp_path, capsys):
    """A completed run made with extra flags (--lr 1e-2, or --guard on in the fp32 arm) was skipped as done
    and read as the planned arm: only the flags typed now were compared. Now its config.json is, in full."""
    root = str(tmp_path)
    lab = {"preset": "lab", "accum": "fp32", "lr": 3e-3, "min_lr": 3e-3, "max_steps": 300, "guard": "off",
           "block_size": 128, "n_layer": 4, "guard_threshold": 200.0}
    write_run(root, "fp32", 1, args=lab)
    common = ["--dry-run", "--claims", "1", "--only", "fp32", "--seeds", "1", "--out-root", root, "--",
              "--preset", "lab"]
    assert sweep.main(common) == 0 and f"skip {root}/fp32/seed1: completed" in capsys.readouterr().out
    for changed, words in [({"lr": 1e-2}, "--lr 0.003 (the run's: 0.01)"),
                           ({"guard": "on"}, "--guard off (the run's: on)"),
                           ({"n_layer": 2, "block_size": 64},
                            "--n-layer 4 (the run's: 2); --block-size 128 (the run's: 64)")]:
        os.remove(os.path.join(root, "fp32", "seed1", "config.json"))
        with open(os.path.join(root, "fp32", "seed1", "config.json"), "w") as f:
            json.dump({"args": {**lab, "seed": 1, **changed}, "versions": {"device": "cpu"}}, f)
        with pytest.raises(SystemExit) as e:
            sweep.main(common)
        assert str(e.value).startswith(f"error: {root}/fp32/seed1 was run with other flags than planned: "
                                       f"{words}. "), str(e.value)


def test_the_sweeps_stop_signals_its_children_before_printing_to_a_gone_terminal(tmp_path, monkeypatch):
    """On a real hangup the sweep's first print in stop() raised OSError [Errno 5] before any child was
    signalled: a traceback, and the children ran on, orphaned."""
    import errno
    import io
    child = subprocess.Popen([sys.executable, "-c", "import signal, sys, time\nsignal.signal(signal.SIGINT, "
                              "lambda *a: sys.exit(7))\nprint('ready', flush=True)\ntime.sleep(60)"],
                             stdout=subprocess.PIPE, text=True)
    assert child.stdout.readline() == "ready\n"   # its handler is set

    class Gone(io.TextIOBase):
        def write(self, text):
            raise OSError(errno.EIO, "Input/output error")
    monkeypatch.setattr(sys, "stdout", Gone())
    try:
        sweep.stop({child: (str(tmp_path), 0.0)})
    finally:
        child.kill() if child.poll() is None else None
    assert child.wait(timeout=30) == 7


def test_an_out_root_on_a_read_only_disk_ends_in_one_line(tmp_path, monkeypatch, capsys):
    import errno

    def read_only(path, *args, **kwargs):
        raise OSError(errno.EROFS, "Read-only file system", path)
    monkeypatch.setattr(os, "makedirs", read_only)
    root = tmp_path / "ro"
    with pytest.raises(SystemExit):
        sweep.main(["--claims", "1", "--only", "fp32", "--seeds", "1", "--out-root", str(root), "--",
                    "--data-dir", str(tmp_path)])
    assert capsys.readouterr().err.splitlines()[-1].endswith(
        f"error: --out-root {root}: cannot write there (Read-only file system): give a folder on a writable "
        f"disk")


FAKE_TRAIN = """import os, signal, sys, time
out = sys.argv[sys.argv.index("--out-dir") + 1]
def stop(*_):
    open(os.path.join(out, "stopped"), "w").close()
    sys.exit(0)
signal.signal(signal.SIGINT, stop)
with open(os.path.join(out, "log.jsonl"), "w") as f:
    f.write('{"event": "start", "step": 0}\\n')
time.sleep(120)
"""


def fake_sweep(tmp_path, *args):
    """lab.sweep launching a stand-in train.py (it logs a start, sleeps, and notes a SIGINT in <run>/stopped)."""
    (tmp_path / "fake").mkdir(exist_ok=True)
    (tmp_path / "fake" / "train.py").write_text(FAKE_TRAIN)
    code = "import sys; from lab import sweep; sweep.ROOT = sys.argv[1]; sys.exit(sweep.main(sys.argv[2:]))"
    return subprocess.Popen([sys.executable, "-c", code, str(tmp_path / "fake"), "--claims", "1", "--only", "fp32",
                             "--seeds", "1", "--parallel", "1", "--out-root", str(tmp_path / "runs"), *args,
                             "--", "--data-dir", str(tmp_path / "data")], cwd=ROOT, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)


def wait_for(path, timeout=60):
    import time
    deadline = time.time() + timeout
    while not os.path.exists(path):
        assert time.time() < deadline, f"{path} did not appear"
        time.sleep(0.1)


def test_the_sweep_stops_its_children_on_sighup(tmp_path):
    """A closed terminal (SIGHUP) killed the sweep and left its children, in their own sessions, running."""
    import signal
    proc = fake_sweep(tmp_path)
    run = tmp_path / "runs" / "fp32" / "seed1"
    wait_for(run / "log.jsonl")
    proc.send_signal(signal.SIGHUP)
    out, err = proc.communicate(timeout=60)
    assert proc.returncode == 130 and "sweep interrupted" in out, err
    assert (run / "stopped").exists() and not (run / sweep.PID_FILE).exists()


def test_a_sweep_launched_again_beside_an_orphaned_run_does_not_start_a_second_writer(tmp_path):
    """After kill -9 of a sweep its train.py children live on; `lab.sweep --resume` started a second writer
    of the same folder (96 steps logged twice)."""
    import signal
    proc = fake_sweep(tmp_path)
    run = tmp_path / "runs" / "fp32" / "seed1"
    wait_for(run / "log.jsonl")
    wait_for(run / sweep.PID_FILE)
    proc.kill()
    proc.communicate(timeout=60)
    orphan = int((run / sweep.PID_FILE).read_text())
    try:
        again = fake_sweep(tmp_path, "--resume")
        out, err = again.communicate(timeout=120)
        assert again.returncode == 0, err
        assert f"skip {run}: unfinished: process {orphan} is still writing it; wait for it, or stop it (kill -INT " \
               f"{orphan}) and launch again" in out and "[start" not in out
    finally:
        os.kill(orphan, signal.SIGKILL)
    import time
    deadline = time.time() + 30
    while sweep.live_writer(str(run)) and time.time() < deadline:   # gone (a zombie until init reaps it)
        time.sleep(0.1)
    assert sweep.live_writer(str(run)) is None


def test_the_sweep_refuses_a_file_for_its_out_root(tmp_path):
    (tmp_path / "file").write_text("")
    for root in (tmp_path / "file", tmp_path / "file" / "below"):
        out = sweep_cmd("--dry-run", "--claims", "1", "--seeds", "1", "--out-root", str(root))
        assert out.returncode == 2 and "Traceback" not in out.stderr and out.stderr.splitlines()[-1] == (
            f"sweep.py: error: --out-root {root}: {tmp_path / 'file'} is a file, not a folder: give a folder")


def copy_of_the_record(tmp_path):
    """RESULTS.md and lab/claims/ as committed, copied into tmp_path's lab/ layout: RESULTS.md's path there."""
    import shutil
    shutil.copytree(os.path.join(ROOT, "lab", "claims"), tmp_path / "lab" / "claims")
    shutil.copy(os.path.join(ROOT, "RESULTS.md"), tmp_path / "RESULTS.md")
    return tmp_path / "RESULTS.md"


def test_a_markdown_that_judges_fewer_claims_than_the_file_it_replaces_is_refused_unless_forced(tmp_path, capsys):
    """A report of a folder holding part of the runs (a typo in the root, a half-kept sweep) replaced the committed
    RESULTS.md with one that judges fewer claims: the runs every record was made from, arm by arm and seed by
    seed, and the opening table's judged rows are compared with the new report's."""
    results = copy_of_the_record(tmp_path)
    committed = results.read_text()
    before = {p: p.read_bytes() for p in (tmp_path / "lab" / "claims").rglob("*.md")}
    judged = report.judged_claims(committed)
    assert judged == sum(row[1] != "NOT RUN" for row in markdown_summary(committed)) >= 2
    write_arms(tmp_path / "runs", RULE1)      # rule 1's runs alone
    argv = [str(tmp_path / "runs"), "--markdown", str(results), "--records", str(tmp_path / "lab" / "claims"),
            "--plots", str(tmp_path / "plots")]
    with pytest.raises(SystemExit):
        report.main(argv)
    assert re.search(f"error: --markdown {re.escape(str(results))}: it was made from runs this report lacks: "
                     r"\S+ \([\w -]+\): \d+ seeds, here 0; .* and \d+ more arms: left as it is, with its records and "
                     r"figures; give the folders its opening lines name, or pass --force to write it anyway$",
                     capsys.readouterr().err.splitlines()[-1])
    assert results.read_text() == committed and {p: p.read_bytes() for p in before} == before
    assert not (tmp_path / "plots").exists() and not list(tmp_path.glob("**/*.tmp"))
    assert report.main([*argv, "--force"]) == 0 and report.judged_claims(str(results)) == 1
    assert report.main(argv) == 0             # as many runs and claims as the files: written without --force
    # the same runs, fewer claims judged (a rule that would judge less): refused too
    texts = {str(p): p.read_text() for p in [results, *(tmp_path / "lab" / "claims").rglob("*.md")]}
    texts[str(results)] = texts[str(results)].replace("| 1 | REPRODUCED |", "| 1 | NOT RUN |")
    assert report.lost_evidence(texts, str(results)) == "it judges 1 claims, this report 0"
    # and a record that lost a seed: refused
    runs = str(tmp_path / "lab" / "claims" / "1" / "runs.md")
    texts = {str(results): results.read_text(), runs: re.sub(r"\n\| seed8 \|[^\n]*", "", open(runs).read())}
    assert report.lost_evidence(texts, str(results)) == ("it was made from runs this report lacks: bf16 (Runs): 8 "
                                                         "seeds, here 7; fp32 (Runs): 8 seeds, here 7; bf16-safemax "
                                                         "(Runs): 8 seeds, here 7")


def test_one_seed_copies_of_a_reports_folders_are_refused_before_any_file_is_written(tmp_path, capsys):
    """One-seed copies of a report's folders: its claims still judged (a one-seed INCONCLUSIVE counts), so the
    Markdown was replaced and its figures before that, drawn ahead of the check. Now the runs per arm and seed
    are compared, before anything is drawn, and every file is left as it was."""
    runs, one, plots, results = tmp_path / "runs", tmp_path / "one", tmp_path / "plots", tmp_path / "R.md"
    write_arms(runs, RULE1)
    argv = ["--markdown", str(results), "--plots", str(plots)]
    assert report.main([str(runs), *argv]) == 0
    listed = lambda: ((sorted(plots.iterdir()) if plots.is_dir() else [])   # no figures without matplotlib
                      + [results] + sorted((tmp_path / "claims").rglob("*.md")))
    files = listed()
    before = [(f.read_bytes(), f.stat().st_mtime_ns) for f in files]
    assert len(files) > 2 + 2 * len(sweep.CLAIMS) or figures._pyplot(quiet=True) is None
    for name in RULE1:
        write_run(one, name, 1, **RULE1[name][0])
    capsys.readouterr()
    with pytest.raises(SystemExit):
        report.main([str(one), *argv])
    assert capsys.readouterr().err.splitlines()[-1].endswith(
        f"error: --markdown {results}: it was made from runs this report lacks: bf16 (Runs): 8 seeds, here "
        f"1; fp32 (Runs): 8 seeds, here 1; bf16-safemax (Runs): 8 seeds, here 1: left as it is, with its records "
        f"and figures; give the folders its opening lines name, or pass --force to write it anyway")
    assert [(f.read_bytes(), f.stat().st_mtime_ns) for f in files] == before
    assert listed() == files
    assert not list(tmp_path.glob("**/*.tmp"))
    assert report.main([str(one), *argv, "--force"]) == 0
    assert len(report.evidence(str(tmp_path / "claims" / "1" / "runs.md"))) == 3


def test_a_failed_figure_leaves_every_file_of_the_report_as_it_was(tmp_path, monkeypatch):
    runs, plots, results = tmp_path / "runs", tmp_path / "plots", tmp_path / "R.md"
    write_arms(runs, RULE1)
    results.write_text("an older report\n")

    def fails(*args, **kwargs):
        raise RuntimeError("the figure failed")
    monkeypatch.setattr(report, "plot_lr_study", fails)
    with pytest.raises(RuntimeError):
        report.main([str(runs), "--markdown", str(results), "--plots", str(plots), "--lr-study", str(runs)])
    assert results.read_text() == "an older report\n" and not (tmp_path / "claims").exists()
    assert not plots.exists() or not list(plots.iterdir())   # the figure drawn before the failure is not kept


def test_the_runs_figure_of_a_run_whose_sigmas_are_all_nan_is_drawn(tmp_path):
    """Its log-scale sigma panel had no value to scale: a traceback from matplotlib."""
    path = write_run(tmp_path, "bf16", 1)
    log = os.path.join(path, "log.jsonl")
    with open(log) as f:
        records = [json.loads(line) for line in f]
    with open(log, "w") as f:
        f.write("".join(json.dumps({**r, "sigma_q": [math.nan, math.nan]} if "sigma_q" in r else r) + "\n"
                        for r in records))
    png = tmp_path / "runs.png"
    assert report.main(["--runs", path, "--png", str(png)]) == 0
    assert png.exists() or figures._pyplot(quiet=True) is None


def markdown_summary(text):
    """The opening table's rows, split into cells."""
    lines = text.split("| claim | verdict |", 1)[1].split("\n\n", 1)[0].splitlines()[2:]
    return [[cell.strip() for cell in line.strip("|").split("|")] for line in lines]


def test_the_report_says_in_one_line_where_a_folder_is_a_file_and_makes_a_missing_png_folder(tmp_path, capsys):
    write_arms(tmp_path / "runs", RULE2)
    write_run(tmp_path / "one", "bf16", 1)
    (tmp_path / "file").write_text("")
    for argv, message in [
            (["--plots", tmp_path / "file"], f"--plots {tmp_path / 'file'}: {tmp_path / 'file'} is a file"),
            (["--plots", tmp_path / "file" / "below"], f"--plots {tmp_path / 'file' / 'below'}: {tmp_path / 'file'} is a file"),
            (["--pilot", tmp_path / "file"], f"--pilot {tmp_path / 'file'} is not a folder"),
            (["--lr-study", tmp_path / "file"], f"--lr-study {tmp_path / 'file'} is not a folder"),
            (["--markdown", tmp_path / "R.md", "--records", tmp_path / "file" / "claims"],
             f"--records {tmp_path / 'file' / 'claims'}: {tmp_path / 'file'} is a file"),
            (["--records", tmp_path / "claims"], "--records: give --markdown too"),
            (["--runs", tmp_path / "one" / "bf16" / "seed1", "--png", tmp_path / "file" / "x.png"],
             f"--png {tmp_path / 'file' / 'x.png'}: {tmp_path / 'file'} is a file")]:
        with pytest.raises(SystemExit):
            report.main([str(tmp_path / "runs"), *map(str, argv)])
        err = capsys.readouterr().err
        assert message in err.splitlines()[-1] and "Traceback" not in err, argv
    with pytest.raises(SystemExit):
        report.main([str(tmp_path / "file")])
    assert f"{tmp_path / 'file'} is not a folder" in capsys.readouterr().err
    png = tmp_path / "new" / "folder" / "runs.png"    # a folder not made yet is made
    assert report.main(["--runs", str(tmp_path / "one" / "bf16" / "seed1"), "--png", str(png)]) == 0
    assert png.parent.is_dir() and (png.exists() or figures._pyplot(quiet=True) is None)


def test_the_lab_tools_output_flags_refuse_a_file_for_a_folder_before_the_work(tmp_path, capsys):
    """lab.fault_size --out, lab.bench --json, lab.attach_demo --out-dir/--png/--json: a traceback at the end of
    the work once; now one line before it, and a missing folder above an output file is made."""
    from lab import attach_demo, bench, fault_size
    (tmp_path / "file").write_text("")
    below, folder = str(tmp_path / "file" / "x.json"), str(tmp_path)
    cases = [(fault_size.main, ["--out", below], f"--out {below}: {tmp_path / 'file'} is a file, not a folder"),
             (fault_size.main, ["--out", folder], f"--out {folder}: {folder} is a folder: give a file's name"),
             (bench.main, ["--smoke", "--json", below], f"--json {below}: {tmp_path / 'file'} is a file, not a folder"),
             (attach_demo.main, ["--out-dir", str(tmp_path / "file")],
              f"--out-dir {tmp_path / 'file'}: {tmp_path / 'file'} is a file, not a folder"),
             (attach_demo.main, ["--png", below], f"--png {below}: {tmp_path / 'file'} is a file, not a folder"),
             (attach_demo.main, ["--json", folder], f"--json {folder}: {folder} is a folder: give a file's name")]
    for main, argv, message in cases:
        with pytest.raises(SystemExit):
            main(argv)
        assert f"error: {message}" in capsys.readouterr().err.splitlines()[-1], argv
    assert sweep.output_problem(str(tmp_path / "new" / "x.json")) is None
    assert sweep.output_problem(str(tmp_path / "file" / "d"), folder=True) == \
        f"{tmp_path / 'file'} is a file, not a folder: give another path"
