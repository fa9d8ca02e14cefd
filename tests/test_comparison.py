"""The dev-tuned comparison's rows: gaps, costs and extra parameters from the studies' summaries."""

import numpy as np
import pytest

from featcal.evaluation.bootstrap import accuracy_intervals, resample_indices
from featcal.tuning.comparison import (FEATCAL_PIPELINES, as_mapping, comparison_rows, dev_best, extra_parameters, gap,
                                       markdown_table, per_task_groups, with_uncertainty,
                                       detectable, significance_markdown)

TASKS = ["a", "b"]


def summary(dev: float, test: float, params: dict, trial_s: float = 10.0, trials: int = 24) -> dict:
    return {"study": "s", "best": {"trial": 3, "dev_avg": dev, "params": params},
            "trials": {"complete": trials}, "trial_wall_s": {"mean": trial_s},
            "test": {"avg": test, "a": test + 0.01, "b": test - 0.01}}


def test_rows_put_each_study_next_to_its_anchor_alone_with_both_gaps():
    alone = {"task_arithmetic": {"avg": 0.60, "a": 0.6, "b": 0.6}, "ties": {"avg": 0.70, "a": 0.7, "b": 0.7}}
    studies = {("ties", "featcal"): summary(0.75, 0.72, {"alpha": 0.3, "rho": 1.0, "ridge": 0.01}),
               ("ties", "surgery"): summary(0.76, 0.71, {"lr": 1e-3, "rank": 4, "iterations": 100}, trial_s=5.0),
               ("task_arithmetic", "probsurgery"): summary(0.74, 0.70, {"lr": 1e-3, "hidden": 8, "iterations": 10})}
    rows = comparison_rows(0.80, alone, studies, width=16, n_tasks=2)
    assert [(r.anchor, r.method) for r in rows] == [("ties", "alone"), ("ties", "featcal"), ("ties", "surgery"),
                                                    ("task_arithmetic", "alone"), ("task_arithmetic", "probsurgery")]
    featcal = rows[1]
    assert featcal.gap_closed == pytest.approx(0.2) and featcal.gap_closed_vs_ta == pytest.approx(0.6)
    assert featcal.dev_avg == 0.75 and featcal.extra_parameters == 0 and featcal.search_s == 240.0
    assert rows[2].extra_parameters == 2 * 2 * 16 * 4 and rows[2].search_s == 120.0
    assert rows[4].extra_parameters == 2 * (3 * 16 * 8 + 2 * 16)
    assert rows[0].dev_avg is None and rows[0].gap_closed == 0.0 and rows[0].gap_closed_vs_ta == pytest.approx(0.5)
    table = as_mapping(rows)
    assert table["ties"]["surgery"]["hyperparameters"] == {"lr": 1e-3, "rank": 4, "iterations": 100}
    assert set(table["ties"]["featcal"]) >= {"test_avg", "dev_avg", "gap_closed", "hyperparameters"}
    lines = markdown_table(rows, TASKS).splitlines()
    assert len(lines) == 2 + len(rows) and "| ties | featcal | 73.0 | 71.0 | 72.0 | 20.0 | 60.0 | 75.0 | 240 | 0 |" in lines


def test_a_reduced_search_is_reported_with_its_deployed_dev_and_its_rung_in_the_search_seconds():
    """The trial's searched score (fewer examples, float32) is not the deployed model's dev; the rung's
    exact rebuilds are part of what the search cost."""
    alone = {"task_arithmetic": {"avg": 0.60, "a": 0.6, "b": 0.6}}
    reduced = summary(0.70, 0.72, {"alpha": 0.3, "rho": 1.0, "ridge": 0.01})
    reduced.update({"rescored_dev": {"dev": 0.749, "matches_trial": True}, "rerank": {"top_k": 5, "wall_s": 100.0}})
    row = comparison_rows(0.80, alone, {("task_arithmetic", "featcal"): reduced}, width=16, n_tasks=2)[1]
    assert row.dev_avg == 0.749 and row.search_s == 24 * 10.0 + 100.0


def test_a_study_without_test_scores_or_an_anchor_without_its_own_scores_is_refused():
    alone = {"ties": {"avg": 0.7}}
    no_test = summary(0.75, 0.72, {"alpha": 0.3})
    del no_test["test"]
    with pytest.raises(ValueError, match="ties/featcal .* has no test scores"):
        comparison_rows(0.8, alone, {("ties", "featcal"): no_test}, 16, 2)
    with pytest.raises(ValueError, match=r"no test scores of the anchor alone for \['wudi'\]"):
        comparison_rows(0.8, alone, {("wudi", "featcal"): summary(0.75, 0.72, {})}, 16, 2)


def test_the_table_rounds_a_studys_test_scores_and_gaps_once():
    """0.638522 is 63.9 %, not 63.85 % rounded again to 63.8: a test score and a gap closed alike."""
    study = summary(0.75, 0.72, {})
    study["test"]["a"] = 0.638522
    rows = comparison_rows(0.8, {"ties": {"avg": 0.7, "a": 0.7, "b": 0.7}}, {("ties", "featcal"): study}, 16, 2)
    assert rows[1].test["a"] == 0.638522
    assert "| ties | featcal | 63.9 | 71.0 |" in markdown_table(rows, TASKS)
    study["test"]["avg"] = 0.7638522   # the gap closed, 0.638522 of 0.1, is 63.9 % too
    rows = comparison_rows(0.8, {"ties": {"avg": 0.7, "a": 0.7, "b": 0.7}}, {("ties", "featcal"): study}, 16, 2)
    assert rows[1].gap_closed == pytest.approx(0.638522)
    assert "| 76.4 | 63.9 |" in markdown_table(rows, TASKS)


def test_gap_and_extra_parameters():
    assert gap(0.7, 0.6, 0.8) == pytest.approx(0.5) and gap(0.7, 0.8, 0.8) is None
    assert extra_parameters("featcal", {}, 384, 6) == 0
    assert extra_parameters("surgery", {"rank": 10}, 384, 6) == 6 * 2 * 384 * 10


def test_dev_picks_the_best_dev_row_and_on_a_tie_the_one_adding_fewer_parameters():
    alone = {"ties": {"avg": 0.7, "a": 0.7, "b": 0.7}, "wudi": {"avg": 0.72, "a": 0.72, "b": 0.72}}
    studies = {("ties", "featcal"): summary(0.751, 0.74, {}),
               ("wudi", "probsurgery"): summary(0.76, 0.70, {"hidden": 8}),
               ("wudi", "surgery"): summary(0.76, 0.69, {"rank": 4})}
    rows = comparison_rows(0.8, alone, studies, width=16, n_tasks=2)
    best = dev_best(rows)
    assert (best.anchor, best.method) == ("wudi", "surgery")          # equal dev, 128 < 800 parameters added
    assert dev_best(rows, ("featcal",)).anchor == "ties"
    groups = per_task_groups(rows, {"a": 0.9, "b": 0.8}, TASKS)
    assert list(groups["a"]) == ["experts", "wudi alone", "wudi + surgery (dev-best)", "ties + featcal (dev-best FeatCal)"]
    assert groups["b"]["wudi + surgery (dev-best)"] == pytest.approx(68.0) and groups["a"]["experts"] == pytest.approx(90.0)


def test_sigmerge_featcal_is_a_row_of_its_anchor_and_a_featcal_pipeline_for_the_default():
    alone = {"ties": {"avg": 0.7, "a": 0.7, "b": 0.7}}
    studies = {("ties", "featcal"): summary(0.751, 0.74, {"alpha": 0.3}),
               ("ties", "sigmerge_featcal"): summary(0.755, 0.73, {"alpha": 0.3, "anchor.c_min": 0.02, "anchor.c_max": 0.2}),
               ("ties", "surgery"): summary(0.76, 0.69, {"rank": 4})}
    rows = comparison_rows(0.8, alone, studies, width=16, n_tasks=2)
    assert [r.method for r in rows] == ["alone", "featcal", "surgery", "sigmerge_featcal"]
    assert rows[3].extra_parameters == 0 and rows[3].hyperparameters["anchor.c_max"] == 0.2
    assert dev_best(rows).method == "surgery"
    assert (dev_best(rows, FEATCAL_PIPELINES).method, dev_best(rows, ("featcal",)).dev_avg) == ("sigmerge_featcal", 0.751)
    groups = per_task_groups(rows, {"a": 0.9, "b": 0.8}, TASKS)
    assert list(groups["a"])[-1] == "ties + sigmerge_featcal (dev-best FeatCal)"


def correctness(n: int, right: int, seed: int) -> np.ndarray:
    out = np.zeros(n, dtype=bool)
    out[np.random.default_rng(seed).permutation(n)[:right]] = True
    return out


def test_every_row_gets_its_paired_interval_its_difference_to_the_anchors_best_and_the_honest_dev_pick():
    """Synthetic predictions: FeatCal right on 80 % of test, Surgery on 2 examples fewer (the same ones
    otherwise), the anchor alone far below. Dev: Surgery one example ahead, a tie the rule breaks by
    FeatCal's zero added parameters."""
    n = 300
    featcal = {t: correctness(n, 240, seed) for seed, t in enumerate(TASKS)}
    surgery = {t: v.copy() for t, v in featcal.items()}
    for t in TASKS:
        surgery[t][np.flatnonzero(featcal[t])[:2]] = False
    alone = {t: correctness(n, 150, 10 + seed) for seed, t in enumerate(TASKS)}
    experts = {t: correctness(n, 270, 20 + seed) for seed, t in enumerate(TASKS)}
    dev_f = {t: correctness(100, 70, 30 + seed) for seed, t in enumerate(TASKS)}
    dev_s = {t: v.copy() for t, v in dev_f.items()}
    dev_s["a"][np.flatnonzero(~dev_f["a"])[0]] = True

    def scores(correct):
        per = {t: round(float(c.mean()), 6) for t, c in correct.items()}
        return {"avg": round(sum(per.values()) / len(per), 6), **per}

    def study(name, test, dev, params):
        return {"study": name, "best": {"trial": 1, "dev_avg": scores(dev)["avg"], "params": params},
                "trials": {"complete": 4}, "trial_wall_s": {"mean": 10.0}, "test": scores(test)}

    rows = comparison_rows(0.9, {"ties": scores(alone)},
                           {("ties", "featcal"): study("f", featcal, dev_f, {"alpha": 0.3}),
                            ("ties", "surgery"): study("s", surgery, dev_s, {"rank": 4})}, width=8, n_tasks=2)
    models = {("ties", "alone"): "ties", ("ties", "featcal"): "f", ("ties", "surgery"): "s"}
    test = {"ties": alone, "f": featcal, "s": surgery, "experts": experts}
    dev = {"f": dev_f, "s": dev_s}
    measured = with_uncertainty(rows, models, scores(experts), test, dev, n_resamples=500, seed=0)
    again = with_uncertainty(rows, models, scores(experts), test, dev, n_resamples=500, seed=0)
    assert measured == again   # the same seed, the same intervals

    by_method = {r.method: r for r in measured.rows}
    indices = resample_indices({t: n for t in TASKS}, 500, 0)
    direct = accuracy_intervals(featcal, indices)
    assert by_method["featcal"].ci95["avg"] == [direct.mean.low, direct.mean.high]
    assert by_method["featcal"].ci95["a"] == [direct.tasks["a"].low, direct.tasks["a"].high]
    assert by_method["featcal"].vs_best["best"] == "featcal"
    assert by_method["surgery"].vs_best["difference"] == pytest.approx(-2 / 300)
    assert by_method["surgery"].vs_best["significant"] is False   # 4 discordant examples: p = 0.125
    assert by_method["alone"].vs_best["significant"] is True
    assert measured.significant_vs_best == {"ties": {"best": "featcal", "rows": {"alone": True, "surgery": False}}}
    assert measured.selection["overall"]["best"] == "ties/surgery"
    assert measured.selection["overall"]["chosen"] == "ties/featcal"   # tied on dev, adds no parameters
    assert measured.selection["featcal"]["chosen"] == "ties/featcal"
    assert measured.experts_ci95["avg"][0] < 0.9 < measured.experts_ci95["avg"][1]
    lines = markdown_table(measured.rows, TASKS)
    assert "| 95 % CI | vs anchor's best (95 % CI) |" in lines and "n.s." in lines and "| best |" in lines

    resolved = detectable(rows, models, test)   # the one pair of tuned rows disagrees on 2 of 300 examples a task
    assert resolved["discordant"] == {"a": pytest.approx(2 / 300), "b": pytest.approx(2 / 300)}
    z = 1.959963984540054 + 0.8416212335729143
    assert resolved["mdd"]["a"] == pytest.approx(z * (2 / 300 / 300) ** 0.5)
    assert resolved["mdd"]["avg"] == pytest.approx(z * (2 * 2 / 300 / 300) ** 0.5 / 2)

    text = significance_markdown(measured, {"test": resolved}, TASKS)
    assert "| ties | surgery (70.50) | featcal | surgery, featcal | featcal (80.0) | it is the best |" in text
    assert "| test: MDD, paired (points) |" in text

    wrong = {**test, "s": featcal}   # another model's predictions under Surgery's name
    with pytest.raises(ValueError, match="row ties/surgery: its predictions give 0.800000 on 'a' where the table has"):
        with_uncertainty(rows, models, scores(experts), wrong, dev, n_resamples=50)
    with pytest.raises(ValueError, match="row ties/featcal: no dev predictions"):
        with_uncertainty(rows, models, scores(experts), test, {"s": dev_s}, n_resamples=50)


def test_a_row_names_the_commit_that_wrote_its_summary_and_how_its_study_searched(tmp_path):
    """Rows measured by other code versions (or other searches) sit in one table: each says which."""
    import subprocess
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "stages"))
    from compare_tuned import written_by
    from featcal.tuning.comparison import search_of

    def git(*args):
        subprocess.run(["git", "-c", "user.name=t", "-c", "user.email=t@t", *args], cwd=tmp_path, check=True,
                       capture_output=True)

    git("init", "-q")
    path = tmp_path / "ta_featcal.json"
    path.write_text("{}")
    assert written_by(path) == {"commit": "uncommitted"}
    git("add", path.name)
    git("commit", "-q", "-m", "a study")
    head = subprocess.run(["git", "log", "-1", "--format=%h"], cwd=tmp_path, capture_output=True, text=True).stdout.strip()
    assert written_by(path)["commit"] == head and written_by(path)["date"]
    path.write_text('{"changed": 1}')
    assert written_by(path) == {"commit": "uncommitted"}
    reduced = {"trial_examples_per_task": 32, "trial_product_dtype": "float32", "rerank": {"top_k": 5}}
    assert search_of(reduced) == {"trial_examples_per_task": 32, "trial_product_dtype": "float32", "rerank_top_k": 5}
    assert search_of({}) == {"trial_examples_per_task": None, "trial_product_dtype": "float64", "rerank_top_k": 0}
