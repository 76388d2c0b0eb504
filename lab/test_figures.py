"""Tests of report.py's figures: the data each panel draws, and, where matplotlib is installed, the axes it
draws them on (titles, x limits, tick labels), never pixels.

Run: python -m pytest -q lab/test_figures.py   (a few seconds; the figure tests skip without matplotlib)
"""
import pytest

from lab import assay, figures, sweep, tables
from lab.rules import injection as rule34
from lab.test_tools import COLLAPSE, OK, RUNAWAY, arm, inject, write_arms

NOERR = {sweep.NO_ERROR: arm(0, OK)}
LOW_COLLAPSE = {**COLLAPSE, "logit": 10.0}   # a loss collapse whose logits stay those of the no-error run


@pytest.fixture
def drawn(monkeypatch):
    """The figures a plot function made, kept open to be read: [matplotlib Figure], closed afterwards."""
    pytest.importorskip("matplotlib")
    plt = figures._pyplot()
    made = []
    monkeypatch.setattr(plt, "close", made.append)
    yield made
    monkeypatch.undo()
    for fig in made:
        plt.close(fig)


# --------------------------------------------------------------------------------------------------
# dose_response.png

def test_the_dose_figures_lower_panel_keeps_collapsed_runs(tmp_path):
    groups = write_arms(tmp_path, {**NOERR, inject("mlp-out", 3.0): arm(5, {"logit": 100.0}, rest=COLLAPSE),
                                   inject("delta", 10.0): arm(8, COLLAPSE)})
    logits = tables.dose_logits(groups)
    assert logits["mlp-out", "coherence 1"][3.0] == ([10.0] * 5, 3)   # the logit scale, and 3 off it
    assert logits["delta", "coherence 1"][10.0] == ([], 8), "a dose where every run collapsed is still drawn"
    assert logits["delta", "coherence 1"][30.0] == ([], 0)   # not run: nothing
    assert tables.dose_ratios(groups)["mlp-out", "coherence 1"][3.0] == [10.0] * 5   # the table's view: finite


def test_the_dose_figures_top_panel_splits_logit_runaways_from_loss_collapses(tmp_path):
    fix = inject("delta", 10.0, fix=True)
    groups = write_arms(tmp_path, {**NOERR, fix: [RUNAWAY] * 3 + [LOW_COLLAPSE] * 4 + [OK]})
    assert tables.dose_outcomes(groups)["delta", tables.FIX_LABEL] == [(0, 0, 0)] * 3 + [(3, 4, 8), (0, 0, 0)]
    ref = {r.seed: r for r in groups[sweep.NO_ERROR]}
    beyond = sum(rule34.beyond(r, ref[r.seed]) for r in groups[fix])
    assert tables.dose_response(groups)["delta", tables.FIX_LABEL][3] == (beyond, 8) == (7, 8), \
        "the two kinds add up to the table's 'ran away beyond the no-error run'"


def test_each_site_names_its_own_qk_only_fix():
    assert set(sweep.SITES.values()) <= set(tables.FIX_WORDS) <= set(assay.QK_FIXES)
    mlp, delta = (tables.curve_words(site, tables.FIX_LABEL) for site in ("mlp-out", "delta"))
    assert mlp == "sign-coherent error, fixed by QK-norm from step 0"
    assert delta == "sign-coherent error, fixed by W_q, W_k trained on the error-free gradient"
    assert "QK-only" not in mlp + delta and tables.curve_words("delta", "coherence 0.5") == \
        "error of a random sign each step"


def test_the_dose_figure_labels_its_off_scale_row_and_each_columns_fix(tmp_path, drawn):
    groups = write_arms(tmp_path, {**NOERR, inject("mlp-out", 3.0, fix=True): arm(0, OK),
                                   inject("delta", 10.0): arm(8, COLLAPSE)})
    assert figures.plot_claims(groups, str(tmp_path / "p")) == [str(tmp_path / "p" / "dose_response.png")]
    top_left, top_right, bottom_left, bottom_right = drawn[-1].axes[:4]
    assert "QK-norm from step 0" in top_left.get_title()
    assert "error-free gradient" in top_right.get_title()
    assert "collapsed" in [t.get_text() for t in bottom_left.get_yticklabels()], "the row above the scale, named"
    assert "8/8" in [t.get_text() for t in bottom_right.texts]


# --------------------------------------------------------------------------------------------------
# claim figures: arms of different horizons

SHORT, LONG = 20, 60


def horizon_arms(tmp_path):
    steps = lambda n: {"steps": n, "args": {"max_steps": n}}
    return write_arms(tmp_path, {"assay": arm(2, steps(SHORT))[:2], "assay-guard": arm(2, steps(SHORT))[:2],
                                 "assay-guard-long": arm(2, steps(LONG))[:2]})


def test_arms_of_a_longer_horizon_get_a_column_of_their_own(tmp_path):
    groups = horizon_arms(tmp_path)
    arms = ["assay", "assay-guard", "assay-guard-long"]
    assert figures.horizon_columns(groups, arms) == [(SHORT, arms), (LONG, ["assay-guard-long"])]
    assert figures.horizon_columns(groups, arms[:2]) == [(SHORT, arms[:2])]


def test_the_claim_figure_draws_the_long_arms_over_their_whole_horizon(tmp_path, drawn):
    groups = horizon_arms(tmp_path)
    figures.plot_claim(figures._pyplot(), groups, "6 (assay)", ["assay", "assay-guard", "assay-guard-long"],
                      str(tmp_path / "claim6.png"))
    axes = drawn[-1].axes   # row by row: left column (every arm), right column (the long arm)
    assert [ax.get_xlim() for ax in axes[-2:]] == [(0, SHORT), (0, LONG)]
    assert [len(ax.get_lines()) for ax in axes[:2]] == [3, 1]
    assert f"the whole {LONG}" in drawn[-1]._suptitle.get_text()


# --------------------------------------------------------------------------------------------------
# lr-gpt2.png, lr-llama.png: the horizon and the paired gap rule 2p judges

def lr_cells_with_gaps():
    """bf16 runs away at lr 0.03 (so rule 2p compares the guard there), not at 0.001; bf16-qknorm-always
    lacks seed 4 and has a seed 5 bf16-guard lacks; the A/A pair ran seeds 1, 2."""
    lr = lambda x, kw: {**kw, "args": {"lr": x, "min_lr": x, "max_steps": 20, **kw.get("args", {})}}
    val = lambda v: lr(0.03, {"val": v})
    return {"bf16-lr0.03": [lr(0.03, RUNAWAY)] * 5, "bf16-lr0.001": [lr(0.001, OK)] * 5,
            "bf16-guard-lr0.03": [val(3.0), val(3.1), val(3.2), val(3.3)],
            "bf16-qknorm-always-lr0.03": [val(3.0), val(3.0), val(3.0), None, val(3.0)],
            "bf16-guard-lr0.001": [lr(0.001, OK)] * 2, "bf16-qknorm-always-lr0.001": [lr(0.001, OK)] * 2,
            figures.AA_TWIN + "-lr0.03": [val(2.95), val(3.05)], figures.AA_AGAIN + "-lr0.03": [val(3.0), val(3.0)]}


def test_the_paired_gap_pairs_only_seeds_both_arms_ran(tmp_path):
    guard, aa = figures.lr_gaps(write_arms(tmp_path, lr_cells_with_gaps()))
    assert list(guard) == [0.03], "only where bf16 ran away in a majority of seeds"
    assert [(s, round(g, 6)) for s, g in guard[0.03]] == [("seed1", 0.0), ("seed2", 0.1), ("seed3", 0.2)]
    assert [(s, round(g, 6)) for s, g in aa[0.03]] == [("seed1", -0.05), ("seed2", 0.05)]
    assert figures.lr_gaps(write_arms(tmp_path / "none", {}), "llama-") == ({}, {})


def test_the_lr_figure_says_its_horizon_and_draws_the_gaps(tmp_path, drawn):
    groups = write_arms(tmp_path, lr_cells_with_gaps())
    assert figures.plot_lr_study(groups, str(tmp_path / "p")) == [str(tmp_path / "p" / "lr-gpt2.png")]
    loss, logit, gap = drawn[-1].axes
    assert "20 steps per run" in loss.get_title()
    assert "A/A: QK-norm always at 2 less 1 CPU threads: one seed" in [t.get_text() for t in gap.get_legend().texts]
    assert "rule 2p" in gap.get_title() and gap.get_xscale() == "log"
