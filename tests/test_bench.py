"""The benchmark scripts of `make bench`, end to end on the tiny project.

Their figures mean something on the demo only (a benchmark measures alone, on an idle machine); here
they are only checked to be there and sane, so a script that stopped running is found by `make test`,
not by the next benchmark run (bench/calibration_cost.py once stopped at its merge when the demo's
anchor became a data method, cf41bc4).
"""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest
import yaml
from conftest import copy_project
from tiny_project import project_env

REPO = Path(__file__).resolve().parents[1]


def run_bench(script: str, args: list[str], project: Path, timeout: float = 900) -> str:
    """bench/<script> run in `project`; it must succeed; its stdout."""
    done = subprocess.run([sys.executable, str(REPO / "bench" / script), *args], cwd=project, env=project_env(),
                          capture_output=True, text=True, timeout=timeout)
    assert done.returncode == 0, (done.stdout + done.stderr)[-4000:]
    return done.stdout


def test_calibration_cost_runs_on_a_project_and_writes_the_median_of_its_repeats(tiny_project, tmp_path):
    project = copy_project(tiny_project.full, tmp_path / "project")
    out = tmp_path / "bench.json"
    said = run_bench("calibration_cost.py", ["--repeats", "3", "--examples-per-task", "4", "--out", str(out)], project,
                     timeout=600)
    figures = json.loads(out.read_text())
    cost = figures["calibration_cost"]
    assert cost["repeats"] == 3 and len(cost["ratios"]) == 3 and cost["examples_per_task"] == 4
    assert figures["featcal_over_forwards"] == round(sorted(cost["ratios"])[1], 3)   # the median repeat
    assert math.isfinite(figures["max_rel_diff_vs_float64"]) and 0 <= figures["max_rel_diff_vs_float64"] < 1e-3
    assert {"moments", "solve", "capture forwards", "advance forwards"} <= set(cost["phases_s"])
    assert "featcal_over_forwards" in said and "median of 3" in said


def test_moments_breakdown_replays_one_blocks_accumulation_and_splits_products_from_the_rest(tiny_project, tmp_path):
    project = copy_project(tiny_project.full, tmp_path / "project")
    out = tmp_path / "bench.json"
    said = run_bench("moments_breakdown.py", ["--block", "1", "--repeats", "2", "--out", str(out)], project)
    figures = json.loads(out.read_text())["moments_breakdown"]
    assert figures["block"] == 1 and figures["product_dtype"] == "float32" and len(figures["replay_s"]) == 2
    assert figures["batches"] > 0 and figures["rows"] > 0
    assert 0 < figures["mm_s"] <= figures["profiled_s"] and figures["other_s"] > 0
    assert figures["operators_s"]["aten::mm"] == figures["mm_s"]
    assert "aten::mm" in said
    done = subprocess.run([sys.executable, str(REPO / "bench" / "moments_breakdown.py"), "--block", "7", "--out",
                           str(tmp_path / "none.json")], cwd=project, env=project_env(), capture_output=True, text=True,
                          timeout=600)
    assert done.returncode != 0 and "the walk has no block 7" in done.stderr
    assert not (tmp_path / "none.json").exists()


@pytest.mark.slow(60)
def test_study_cost_times_three_studies_keeps_them_and_the_pick_is_set_against_the_reference(tiny_project, tmp_path):
    """bench/study_cost.py: a reduced-fidelity FeatCal study, the every-example reference and Surgery's,
    timed in one run, each kept (study and summary) with its best values; bench/pick_vs_reference.py then
    rebuilds the cheap study's pick and the reference's and gives their paired dev and test differences."""
    project = copy_project(tiny_project.full, tmp_path / "project")
    out, kept = tmp_path / "bench.json", tmp_path / "kept"
    said = run_bench("study_cost.py", ["--n-trials", "2", "--trial-examples", "4", "--trial-product-dtype", "float32",
                                       "--keep", str(kept), "--out", str(out)], project)
    figures = json.loads(out.read_text())
    studies = figures["study_cost"]["studies"]
    assert set(studies) == {"featcal", "featcal_all_examples", "surgery"}, studies
    assert studies["featcal"]["trial_examples_per_task"] == 4 and studies["featcal"]["trial_product_dtype"] == "float32"
    assert studies["featcal_all_examples"]["trial_examples_per_task"] is None
    for name, study in studies.items():
        assert study["trials"]["complete"] == 2 and study["wall_s"] > 0, (name, study)
        assert set(study["best_params"]) >= {"anchor.scale"} and 0 <= study["best_dev"] <= 1, (name, study)
        assert (kept / name / "study.db").exists(), name
    assert figures["featcal_study_over_surgery_study"] == round(studies["featcal"]["wall_s"] / studies["surgery"]["wall_s"], 3)
    assert figures["study_best_dev"] == studies["featcal"]["best_dev"] and "best dev (deployed)" in said

    run_bench("pick_vs_reference.py", [str(kept / "featcal"), "--reference", str(kept / "featcal_all_examples"),
                                       "--resamples", "200", "--out", str(out)], project)
    pick = json.loads(out.read_text())["pick_vs_reference"]
    for split, key in (("dev", "best_dev"), ("test", "best_test")):
        low, high = pick[split]["interval_95_points"]
        estimate = pick[split]["pick_minus_reference_points"]
        assert low <= estimate <= high, pick
        # the rebuilt models score as the studies' deployed ones did
        deployed = 100 * (studies["featcal"][key] - studies["featcal_all_examples"][key])
        assert abs(estimate - deployed) < 0.01, (split, estimate, deployed)


@pytest.mark.slow(60)
def test_trial_cost_and_fidelity_ranking_replay_the_ta_study_that_tune_anchor_ran(tiny_project, tmp_path):
    """bench/trial_cost.py replays a Task Arithmetic study's first trials (uncached, cached, float32, on disk)
    and bench/fidelity_ranking.py recalibrates them on fewer examples, both from the study and the merge folder
    stages/tune_anchor.py left; the uncached replays score dev as the study recorded. A second merge folder
    (tune_anchor makes one whenever the experts' files change) and the project's params.yaml merging another
    anchor must not matter: the scripts take the newest folder and its own params."""
    project = copy_project(tiny_project.full, tmp_path / "project")
    done = subprocess.run([sys.executable, str(REPO / "stages" / "tune_anchor.py"), "task_arithmetic", "--methods",
                           "featcal", "--anchor-search", "scale=0.1:1.0", "--n-trials", "3"],
                          cwd=project, env=project_env(), capture_output=True, text=True, timeout=900)
    assert done.returncode == 0, (done.stdout + done.stderr)[-4000:]
    [merged] = (project / "work" / "anchors").glob("task_arithmetic-*/merged")
    (project / "work" / "anchors" / "task_arithmetic-00000000" / "merged").mkdir(parents=True)   # an older one
    os.utime(merged, None)   # the real merge is the newest
    params = yaml.safe_load((project / "params.yaml").read_text())
    params["merge"] = {"method": "regmean", "options": {"off_diagonal": 0.95, "examples_per_task": 4}}
    (project / "params.yaml").write_text(yaml.safe_dump(params, sort_keys=False))

    out = tmp_path / "bench.json"
    said = run_bench("trial_cost.py", ["--trials", "2", "--trial-product-dtype", "float32", "--on-disk",
                                       "--out", str(out)], project)
    cost = json.loads(out.read_text())["trial_cost"]
    assert [t["trial"] for t in cost["trials"]] == [0, 1] and all(t["dev_as_recorded"] for t in cost["trials"]), cost
    assert set(cost) >= {"cached", "cached_float32", "on_disk"}
    assert cost["on_disk"]["expert_inputs_disk_mib"] > 0 and cost["on_disk"]["expert_inputs_mib"] == 0
    assert cost["cached"]["expert_inputs_mib"] > 0 and all(t["dev_as_recorded"] for t in cost["cached"]["trials"])
    assert "a trial after the first" in said

    ranking = tmp_path / "fidelity.json"
    said = run_bench("fidelity_ranking.py", ["--examples", "4", "--out", str(ranking)], project)
    figures = json.loads(ranking.read_text())
    assert figures["examples_per_task"] == 4 and len(figures["trials"]) == 3
    for name in ("scaled", "unscaled"):
        assert -1 <= figures[name]["spearman"] <= 1 and figures[name]["picks_trial"] in {0, 1, 2}
    assert "Spearman" in said
