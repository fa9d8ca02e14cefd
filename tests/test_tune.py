"""Optuna tuning of α, ρ, λ on the dev split: resumable studies, workers sharing a PostgreSQL study,
and the tuned values reaching the calibrated model through `dvc repro`."""

from __future__ import annotations

import dataclasses
import json
import os
import re
import shutil
import statistics
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import optuna
import pytest
import torch
import yaml
from optuna.trial import TrialState
from safetensors.torch import load_file

from featcal import tuning as tune
from featcal.tuning import objective
from featcal.calibration.config import FeatCalConfig, LayerHyper
from featcal.data.encoders import TextEncoder
from featcal.data.splits import TaskSplit
from conftest import DVC, WARM_ENV_KEY, copy_project, stages_run
from featcal.evaluation.predictions import read_correctness
from featcal.finetune import accuracy
from pg_server import postgres_server
from tiny_project import ROOT, run

sys.path.insert(0, str(ROOT / "stages"))
import tune as tune_stage  # noqa: E402  stages/tune.py


def edit_params(project: Path, **sections) -> dict:
    params = yaml.safe_load((project / "params.yaml").read_text())
    for dotted, value in sections.items():
        node = params
        *parents, last = dotted.split("__")
        for part in parents:
            node = node[part]
        node[last] = value
    (project / "params.yaml").write_text(yaml.safe_dump(params, sort_keys=False))
    return params


def trials_of(storage: str, name: str) -> list[optuna.trial.FrozenTrial]:
    return sorted(optuna.load_study(study_name=name, storage=storage).get_trials(), key=lambda t: t.number)


@pytest.fixture(scope="module")
def project(tiny_project, tmp_path_factory):
    """A copy of the session's reproduced tiny project (tuning reads its experts, merge and expert
    features; switching tuning on then re-runs only what the tuned values reach)."""
    return copy_project(tiny_project.full, tmp_path_factory.mktemp("tune") / "project")


@pytest.fixture(scope="session")
def postgres():
    """One server for the session (the tests on the tiny project run apart from the others: see conftest)."""
    with postgres_server() as server:
        yield server


# --- fast: parsing, dev hygiene, trial accounting ---------------------------------------------------


def test_search_space_and_settings_are_validated():
    space = tune.SearchSpace.from_mapping({"alpha": [0, 1], "ridge": {"low": 1e-3, "high": 1, "log": True}})
    assert space.ranges["ridge"].log and not space.ranges["alpha"].log
    assert space.contains({"alpha": 0.25, "ridge": 0.05}) and not space.contains({"alpha": 1.5, "ridge": 0.05})
    for bad in ({"gamma": [0, 1]}, {"alpha": [1, 0]}, {"ridge": {"low": 0, "high": 1, "log": True}},
                {"alpha": {"lo": 0, "high": 1}}, {"alpha": 0.5}):
        with pytest.raises(ValueError):
            tune.SearchSpace.from_mapping(bad)
    # the pipeline switch is not a FeatCal knob
    assert FeatCalConfig.from_mapping({"alpha": 0.3, "use_tuned": True}).alpha == 0.3
    # per-block keys: KEY@BLOCK goes to that block's override, the plain key holds for the rest
    per_block = tune.SearchSpace.from_mapping({"alpha@0": [0, 1], "alpha@1": [0, 1], "rho": [0.5, 3]})
    base = FeatCalConfig(alpha=0.25, layer_overrides={1: {"alpha": 0.4, "ridge": 0.2}})
    assert per_block.blocks() == {0, 1} and per_block.defaults(base) == {"alpha@0": 0.25, "alpha@1": 0.4, "rho": 2.2}
    config = objective.config_with(base, {"alpha@0": 0.1, "alpha@1": 0.7, "rho": 1.5})
    assert config.layer_overrides == {0: {"alpha": 0.1}, 1: {"alpha": 0.7, "ridge": 0.2}}
    assert (config.for_layer(0), config.for_layer(1), config.for_layer(2)) == (
        LayerHyper(0.1, 1.5, 0.05), LayerHyper(0.7, 1.5, 0.2), LayerHyper(0.25, 1.5, 0.05))
    for bad in ({"alpha@x": [0, 1]}, {"gamma@0": [0, 1]}):
        with pytest.raises(ValueError, match="KEY@BLOCK"):
            tune.SearchSpace.from_mapping(bad)


def test_dev_examples_seen_by_calibration_are_not_scored():
    class Tok:
        def __call__(self, texts, truncation, max_length):
            return {"input_ids": [[101] + [len(w) for w in t.split()][: max_length - 2] + [102] for t in texts]}

    split = TaskSplit("t", "dev", ["a bb", "ccc", "dd e"], torch.tensor([0, 1, 0]))
    calib_ids = torch.tensor([[101, 3, 102, 0], [101, 2, 1, 102]])     # "ccc" and "dd e" (padded rows)
    mask = torch.tensor([[1, 1, 1, 0], [1, 1, 1, 1]])
    kept, dropped = tune.drop_calibration_overlap(split, TextEncoder(Tok()), 8,
                                                  {"input_ids": calib_ids, "attention_mask": mask})
    assert dropped == 2 and kept.examples == ["a bb"] and kept.labels.tolist() == [0]


@pytest.mark.filterwarnings("ignore:Heartbeat of storage")
def test_dead_or_interrupted_trials_are_rerun_but_failing_objectives_count(tmp_path):
    url = f"sqlite:///{tmp_path / 'study.db'}"
    study = tune.open_study(tune.make_storage(url, heartbeat_s=1, grace_s=1), "s")
    dead = study.ask()                                  # a worker that died mid-trial
    study._storage.record_heartbeat(dead._trial_id)
    time.sleep(2.5)
    calls = []

    def objective(trial):
        x = trial.suggest_float("x", 0, 1)
        calls.append(trial.number)
        if len(calls) == 1:
            raise ValueError("a genuine failure")
        if len(calls) == 2:
            raise KeyboardInterrupt
        return x

    with pytest.raises(KeyboardInterrupt):
        tune.run_trials(study, objective, 3, lock=tune.ClaimLock(url, "s"))
    ran = tune.run_trials(study, objective, 3, lock=tune.ClaimLock(url, "s"))
    states = {t.number: t.state for t in study.get_trials()}
    assert states[dead.number] == TrialState.FAIL                       # heartbeat stopped: failed...
    failed = [t for t in study.get_trials() if t.state == TrialState.FAIL]
    assert [("error" in t.user_attrs, t.user_attrs.get("interrupted", False)) for t in failed] == \
        [(False, False), (True, False), (False, True)]
    assert tune.count_trials(study) == 3 and len(ran) == 2                 # ...and both replaced
    assert all(t.user_attrs["wall_s"] >= 0 for t in study.get_trials() if t.state == TrialState.COMPLETE)


# --- slow: the tiny project -----------------------------------------------------------------------------


@pytest.mark.slow(15)   # as long as use_tuned: kept before it (it needs the project untuned)
def test_second_run_adds_only_the_new_trials(project, monkeypatch):
    assert yaml.safe_load((project / "stages/chain.yaml").read_text())["tune_stage"] == []   # no tune stage
    edit_params(project, featcal__use_tuned=True, tune__n_trials=2, tune__startup_trials=2)
    run([sys.executable, "stages/gen_chain.py"], project)
    storage = f"sqlite:///{project / 'tune/study.db'}"

    first = run([*DVC, "repro", "tune"], project)
    assert stages_run(first) == {"tune@dev"}, first
    before = trials_of(storage, "featcal-dev")
    assert [t.state for t in before] == [TrialState.COMPLETE] * 2
    defaults = yaml.safe_load((project / "params.yaml").read_text())["featcal"]
    assert before[0].params == {k: defaults[k] for k in ("alpha", "rho", "ridge")}   # params.yaml's values go first
    assert all(t.user_attrs["wall_s"] > 0 and set(t.user_attrs["dev"]) == {"sentiment", "topic"} for t in before)
    # the stage keeps the experts' block inputs for later trials (tune.expert_cache_mib's default) and says how much
    assert before[0].user_attrs["expert_inputs_mib"] == before[1].user_attrs["expert_inputs_mib"] > 0

    # every block past a 1 MiB memory bound: on disk (tune.expert_cache_dir), the same trials
    edit_params(project, tune__n_trials=4, tune__expert_cache_mib=1, tune__expert_cache_dir=str(project / "spill"))
    second = run([*DVC, "repro", "tune"], project)
    assert stages_run(second) == {"tune@dev"}, second
    assert "ran 2 new trials [2, 3]" in second, second
    after = trials_of(storage, "featcal-dev")
    assert len(after) == 4 and all(t.state == TrialState.COMPLETE for t in after)
    for old, new in zip(before, after):                       # the first two were not run again
        assert (old.params, old.value, old.datetime_start) == (new.params, new.value, new.datetime_start)
    # the blocks that fit in the 1 MiB (of the 1.3 the tiny project's take) in memory, the others on disk
    assert all(t.user_attrs["expert_inputs_mib"] <= 1 and t.user_attrs["expert_inputs_disk_mib"] > 0 for t in after[2:])
    assert list((project / "spill").iterdir()) == []   # the study's folder went when the stage ended
    summary = json.loads((project / "results/tune.json").read_text())
    assert summary["trials"]["complete"] == 4 and summary["ran_now"] == 2 and summary["trial_wall_s"]["mean"] > 0

    # in process, four trials in one go: the same trials (seeded per trial number); never the test split
    splits_read = []
    real_read_split = objective.read_split
    monkeypatch.setattr(objective, "read_split", lambda d, t, s: splits_read.append(s) or real_read_split(d, t, s))
    params = yaml.safe_load((project / "params.yaml").read_text())
    problem, base = problem_of(project, params), FeatCalConfig.from_mapping(params["featcal"])
    straight = f"sqlite:///{project.parent / 'straight.db'}"
    tune.tune(problem, base, tune.SearchSpace(), straight, "featcal-dev", 4, tune.StudySettings(startup_trials=2))
    assert set(splits_read) == {"dev"}
    assert [(t.params, t.value) for t in trials_of(straight, "featcal-dev")] == [(t.params, t.value) for t in after]
    # a study scored on other inputs is refused
    with pytest.raises(tune.StudyMismatchError):
        tune.tune(problem, dataclasses.replace(base, pooled_token_weight=0.5), tune.SearchSpace(), storage,
                  "featcal-dev", 4)

    best = yaml.safe_load((project / "tune/best.yaml").read_text())
    study = optuna.load_study(study_name="featcal-dev", storage=storage)
    assert best["featcal"] == {k: float(f"{v:.12g}") for k, v in study.best_trial.params.items()}
    assert best["study"]["best_trial"] == study.best_trial.number


def problem_of(project: Path, params: dict) -> tune.TuneProblem:
    """The tiny project's tuning problem, loaded the way stages/tune.py loads it."""
    return tune.load_problem(
        base=params["model"]["base"], tasks=["sentiment", "topic"], max_length={"sentiment": 16, "topic": 16},
        batch_size=params["calibration"]["batch_size"], merged=project / "models/merged",
        experts_dir=project / "experts", features=project / "features/experts", tasks_dir=project / "data/tasks",
        seed=int(params["seed"]))


def test_a_reduced_precision_search_ranks_in_float32_and_its_best_is_calibrated_again_exactly(project, tmp_path):
    """tune.trial_product_dtype: float32: each trial's moment products in float32; the best trial's
    values, written to tune/best.yaml, are calibrated in the float64 path, reproducibly."""
    params = yaml.safe_load((project / "params.yaml").read_text())
    problem = problem_of(project, params)
    base = FeatCalConfig.from_mapping({**params["featcal"], "product_dtype": "float64"})
    storage = f"sqlite:///{tmp_path / 'study.db'}"
    settings = tune.StudySettings(startup_trials=2, trial_product_dtype="float32")
    outcome = tune.tune(problem, base, tune.SearchSpace(), storage, "search32", 3, settings)
    tune.write_best(tmp_path / "best.yaml", outcome.study, base)
    values = yaml.safe_load((tmp_path / "best.yaml").read_text())["featcal"]
    exact = dataclasses.replace(base, **values)
    assert exact.product_dtype == "float64"
    first, again = problem.calibrate(exact).state_dict(), problem.calibrate(exact).state_dict()
    assert all(torch.equal(first[n], again[n]) for n in first)          # the exact path reproduces bit for bit
    fast = problem.calibrate(dataclasses.replace(exact, product_dtype="float32"))
    best = outcome.study.best_trial
    assert statistics.fmean(problem.score(fast).values()) == best.value   # what the trial scored: float32 products
    fast = fast.state_dict()
    worst = max(float((fast[n] - first[n]).abs().max() / first[n].abs().max()) for n in first if first[n].is_floating_point())
    assert 0 < worst < 1e-2, worst   # float32's distance grows as λ shrinks (9.4e-5 on the demo at λ 0.0021)
    with pytest.raises(tune.StudyMismatchError):   # one study, one precision
        tune.tune(problem, base, tune.SearchSpace(), storage, "search32", 4, tune.StudySettings(startup_trials=2))


def test_a_reduced_fidelity_search_calibrates_trials_on_the_first_examples_and_its_best_on_all(project, tmp_path):
    """tune.trial_examples_per_task: N: each trial's walk reads each task's first N calibration examples
    (and the experts' states and cached inputs of those only), with λ scaled to the whole sample's weight
    against the data; the best trial's values are calibrated on every example, as a fresh problem
    calibrates them; one study holds one fidelity."""
    params = yaml.safe_load((project / "params.yaml").read_text())
    problem = problem_of(project, params)
    base = FeatCalConfig.from_mapping({**params["featcal"], "product_dtype": "float64"})
    storage = f"sqlite:///{tmp_path / 'study.db'}"
    settings = tune.StudySettings(startup_trials=2, trial_examples_per_task=12)   # of 24, batches of 8: 8 + 4
    outcome = tune.tune(problem, base, tune.SearchSpace(), storage, "few", 3, settings)
    assert outcome.summary["trial_examples_per_task"] == 12
    config = dataclasses.replace(base, **tune.best_values(outcome.study, base))
    few = problem.calibrate(config, examples_per_task=12)
    assert statistics.fmean(problem.score(few).values()) == outcome.study.best_trial.value
    cut = problem_of(project, params)   # the same walk on a problem that only has those examples, no cache
    cut.batches, cut.expert_inputs = {t: objective.leading_examples(b, 12) for t, b in cut.batches.items()}, None
    states = cut._expert_states
    cut._expert_states = lambda layer: {k: v[:12] for k, v in states(layer).items()}
    assert [len(b["input_ids"]) for b in cut.batches["topic"]] == [8, 4]
    # the trial's λ is the whole sample's: on 12 of 24 examples the walk weighs 2λ against the rows' means
    few, alone = few.state_dict(), cut.calibrate(dataclasses.replace(config, ridge=2 * config.ridge)).state_dict()
    assert all(torch.equal(few[n], alone[n]) for n in few)
    unscaled = cut.calibrate(config).state_dict()
    assert not all(torch.equal(few[n], unscaled[n]) for n in few)
    full = problem.calibrate(config).state_dict()   # after trials that filled the cache with 12 examples' inputs
    fresh = problem_of(project, params).calibrate(config).state_dict()
    assert all(torch.equal(full[n], fresh[n]) for n in full)
    assert not all(torch.equal(full[n], few[n]) for n in full)
    with pytest.raises(tune.StudyMismatchError):   # one study, one fidelity
        tune.tune(problem, base, tune.SearchSpace(), storage, "few", 4, tune.StudySettings(startup_trials=2))
    with pytest.raises(ValueError, match=r"tune.trial_examples_per_task: 25 calibration examples per task asked"):
        tune.tune(problem, base, tune.SearchSpace(), storage, "more", 1, tune.StudySettings(trial_examples_per_task=25))


def test_a_reduced_search_reranks_its_best_trials_exactly_and_the_best_of_those_leaves_the_study(project, tmp_path,
                                                                                                   monkeypatch):
    """tune.rerank_top_k: K: a reduced search's K best trials (by the float32, 12-example score they were
    searched with) are calibrated again on every example in the exact path and scored on dev; the best of
    those is what the summary, best_values and a resumed study name; no trial is scored twice; without the
    rung the best trial leaves again."""
    params = yaml.safe_load((project / "params.yaml").read_text())
    problem = problem_of(project, params)
    base = FeatCalConfig.from_mapping({**params["featcal"], "product_dtype": "float64"})
    exact_walks = []
    calibrate = problem.calibrate

    def recorded(config, after_block=None, merged=None, examples_per_task=None):
        if examples_per_task is None:   # a walk on every example: what the rung runs
            exact_walks.append(config)
        return calibrate(config, after_block, merged, examples_per_task)

    problem.calibrate = recorded
    storage = f"sqlite:///{tmp_path / 'study.db'}"
    settings = tune.StudySettings(startup_trials=2, trial_product_dtype="float32", trial_examples_per_task=12,
                                  rerank_top_k=3)
    outcome = tune.tune(problem, base, tune.SearchSpace(), storage, "rung", 5, settings)
    trials = [t for t in outcome.study.trials if t.state == TrialState.COMPLETE]
    top = sorted(trials, key=lambda t: (-t.value, t.number))[:3]
    exact = tune.reranked_dev(outcome.study)
    assert set(exact) == {t.number for t in top} and len(exact_walks) == 3
    for trial, config in zip(top, exact_walks):   # each the exact path on every example, scored on dev
        assert config == objective.config_with(base, trial.params) and config.product_dtype == "float64"
        assert exact[trial.number] == {t: round(v, 6) for t, v in problem.score(calibrate(config)).items()}
    chosen = max(top, key=lambda t: (statistics.fmean(exact[t.number].values()), t.value, -t.number))
    assert tune.chosen_trial(outcome.study).number == chosen.number == outcome.summary["best"]["trial"]
    assert outcome.summary["rerank"]["chosen"] == chosen.number
    seconds = outcome.study.user_attrs["rerank"]["wall_s"]   # each exact rebuild's seconds: a search's cost
    assert set(seconds) == {str(t.number) for t in top} and all(s > 0 for s in seconds.values())
    assert outcome.summary["rerank"]["wall_s"] == pytest.approx(sum(seconds.values()), abs=1e-3)
    assert [r["trial"] for r in outcome.summary["rerank"]["trials"]] == [t.number for t in top]
    assert tune.best_values(outcome.study, base) == {k: float(getattr(objective.config_with(base, chosen.params), k))
                                                       for k in ("alpha", "rho", "ridge")}
    exact_walks.clear()
    again = tune.tune(problem, base, tune.SearchSpace(), storage, "rung", 5, settings)   # resumed: nothing to do
    assert exact_walks == [] and again.summary["best"]["trial"] == chosen.number
    plain = tune.tune(problem, base, tune.SearchSpace(), storage, "rung", 5, dataclasses.replace(settings, rerank_top_k=0))
    assert "rerank" not in plain.summary and plain.summary["best"]["trial"] == plain.study.best_trial.number
    with pytest.raises(ValueError, match="tune.rerank_top_k must be an integer >= 1"):
        tune.rerank(plain.study, 0, lambda trial: None, lambda model: {})

    # stages/tune.py: the rung from params.yaml; tune/best.yaml and the deployed model are the chosen trial's,
    # and the deployed model, the one the rung built (no third walk on every example), reproduces its exact dev score
    reduced = dict(params, tune={**params["tune"], "trial_examples_per_task": 12, "trial_product_dtype": "float32",
                                 "rerank_top_k": 2, "startup_trials": 2})
    (tmp_path / "params.yaml").write_text(yaml.safe_dump(reduced, sort_keys=False))
    stage_storage = f"sqlite:///{tmp_path / 'stage.db'}"
    walks = []
    monkeypatch.setattr(objective.TuneProblem, "calibrate", lambda self, config, after_block=None, merged=None,
                        examples_per_task=None: (walks.append(examples_per_task),
                                                 calibrate.__func__(self, config, after_block, merged, examples_per_task))[1])
    monkeypatch.chdir(project)
    tune_stage.main(["--params", str(tmp_path / "params.yaml"), "--storage", stage_storage, "--study-name", "rung",
                     "--n-trials", "4", "--summary", str(tmp_path / "rung.json"), "--score-test",
                     "--best", str(tmp_path / "best.yaml")])
    assert walks == [12] * 4 + [None] * 2, walks
    written = json.loads((tmp_path / "rung.json").read_text())
    study = optuna.load_study(study_name="rung", storage=stage_storage)
    chosen = tune.chosen_trial(study)
    assert written["best"]["trial"] == written["rerank"]["chosen"] == chosen.number
    assert written["rescored_dev"]["matches_trial"] is True   # the rung's exact dev, rebuilt for test
    best = yaml.safe_load((tmp_path / "best.yaml").read_text())
    assert best["study"]["best_trial"] == chosen.number
    assert best["featcal"]["ridge"] == pytest.approx(chosen.params["ridge"], rel=1e-11)


def test_a_reduced_fidelity_baseline_study_trains_on_the_first_examples_and_its_best_on_all(project, tmp_path,
                                                                                                 monkeypatch):
    """tune.trial_examples_per_task reaches Surgery's and ProbSurgery's studies too: a trial trains on the
    representations of each task's first N calibration examples, as FeatCal's trials calibrate on them; the
    best configuration is trained on every example for what leaves the study; one study, one fidelity."""
    from featcal.baselines.surgery import SurgeryConfig, train_surgery
    from featcal.tuning import baselines

    params = yaml.safe_load((project / "params.yaml").read_text())
    problem = problem_of(project, params)
    few = baselines.BaselineProblem(problem, 12)   # of 24 per task
    full = few.on_every_example()
    assert full.examples_per_task is None and full.on_every_example() is full
    for task in problem.dev:
        assert len(few.expert_feats[task]) == len(few.merged_feats[task]) == 12
        assert len(full.expert_feats[task]) == 24
        torch.testing.assert_close(few.expert_feats[task], full.expert_feats[task][:12], rtol=1e-5, atol=1e-5)
    storage = f"sqlite:///{tmp_path / 'few.db'}"
    outcome = baselines.tune_baseline(few, "surgery", storage, "few", 2, startup_trials=2)
    assert outcome.summary["trial_examples_per_task"] == 12
    default = train_surgery(few.merged_feats, few.expert_feats, SurgeryConfig(progress=False), split="train")
    assert trials_of(storage, "few")[0].value == pytest.approx(statistics.fmean(few.score(default).values()), abs=1e-9)
    with pytest.raises(tune.StudyMismatchError):   # the same study on every example
        baselines.tune_baseline(full, "surgery", storage, "few", 3, startup_trials=2)

    # stages/tune.py takes the fidelity from params.yaml and trains the dev-best on every example for test
    reduced = dict(params, tune={**params["tune"], "trial_examples_per_task": 12})
    (tmp_path / "params.yaml").write_text(yaml.safe_dump(reduced, sort_keys=False))
    monkeypatch.chdir(project)
    trained_on = []   # rows per task of every training the stage runs (a tiny model's dev scores may not tell)
    train = baselines.BaselineProblem.train
    monkeypatch.setattr(baselines.BaselineProblem, "train", lambda self, config: (
        trained_on.append({t: len(f) for t, f in self.expert_feats.items()}), train(self, config))[1])
    tune_stage.main(["--params", str(tmp_path / "params.yaml"), "--method", "surgery", "--storage", storage,
                     "--study-name", "few", "--n-trials", "2", "--summary", str(tmp_path / "few.json"), "--score-test"])
    written = json.loads((tmp_path / "few.json").read_text())
    assert written["ran_now"] == 0 and written["trial_examples_per_task"] == 12
    assert trained_on == [{task: 24 for task in problem.dev}]   # no trial ran; the best trained on every example
    config = baselines.best_config(outcome, "surgery")
    dev = full.score(train(full, config))
    assert written["rescored_dev"]["dev"] == round(sum(dev.values()) / len(dev), 6)

    # a rung: the 2 best configurations trained again on every example, the best of those leaves
    monkeypatch.setattr(baselines.BaselineProblem, "train", train)
    ranked = baselines.tune_baseline(few, "surgery", f"sqlite:///{tmp_path / 'rung.db'}", "rung", 3, startup_trials=2,
                                     rerank_top_k=2)
    top = sorted((t for t in ranked.study.trials if t.state == TrialState.COMPLETE), key=lambda t: (-t.value, t.number))[:2]
    exact = tune.reranked_dev(ranked.study)
    assert set(exact) == {t.number for t in top}
    for trial in top:
        assert exact[trial.number] == {t: round(v, 6) for t, v in
                                       full.score(full.train(baselines.config_of(trial.params, "surgery"))).items()}
    chosen = max(top, key=lambda t: (statistics.fmean(exact[t.number].values()), t.value, -t.number))
    assert ranked.summary["best"]["trial"] == chosen.number
    assert baselines.best_config(ranked, "surgery") == baselines.config_of(chosen.params, "surgery")


@pytest.mark.slow(10)
def test_a_baseline_study_tunes_surgery_on_dev_by_the_same_protocol_then_reads_test_once(project, monkeypatch):
    """`stages/tune.py --method surgery`: the same problem as FeatCal's study (merged model, calibration
    examples, dev without their look-alikes), the paper's defaults first, seeded and resumable."""
    from featcal.baselines.surgery import SurgeryClassifier, SurgeryConfig, train_surgery
    from featcal.tuning import baselines

    storage = f"sqlite:///{project.parent / 'baselines.db'}"
    summary = project.parent / "surgery.json"
    splits_read = []
    real_read_split = objective.read_split
    monkeypatch.setattr(objective, "read_split", lambda d, t, s: splits_read.append(s) or real_read_split(d, t, s))
    monkeypatch.chdir(project)
    args = ["--method", "surgery", "--storage", storage, "--study-name", "surgery-dev", "--n-trials", "3",
            "--summary", str(summary), "--score-test"]
    tune_stage.main(args)
    assert set(splits_read) == {"dev"}   # the study itself scores dev only; the test split is read apart, once
    trials = trials_of(storage, "surgery-dev")
    assert [t.state for t in trials] == [TrialState.COMPLETE] * 3
    assert trials[0].params == {"lr": 1e-3, "rank": 16, "iterations": 500}   # the paper's defaults go first
    assert len({tuple(sorted(t.params.items())) for t in trials}) == 3

    # the default trial's dev score is the deployed form's, computed here from the same problem
    params = yaml.safe_load((project / "params.yaml").read_text())
    problem = baselines.BaselineProblem(problem_of(project, params))
    modules = train_surgery(problem.merged_feats, problem.expert_feats, SurgeryConfig(progress=False), split="train")
    dev = {t: accuracy(SurgeryClassifier(problem.merged_models[t], modules[t]).eval(), problem.encoder, d.split,
                       d.max_length) for t, d in problem.dev.items()}
    assert trials[0].value == pytest.approx(sum(dev.values()) / len(dev), abs=1e-9)
    written = json.loads(summary.read_text())
    assert written["method"] == "surgery" and written["best"]["dev_avg"] == round(max(t.value for t in trials), 6)
    assert set(written["test"]) == {"avg", "sentiment", "topic"}

    tune_stage.main([*args[:-3], "--n-trials", "4"])   # resumed: one more trial, the first three kept
    again = trials_of(storage, "surgery-dev")
    assert len(again) == 4 and [(t.params, t.value) for t in again[:3]] == [(t.params, t.value) for t in trials]

    # FeatCal's study reads test the same way: once, for its best values
    tune_stage.main(["--storage", storage, "--study-name", "featcal-dev", "--n-trials", "1", "--summary",
                     str(summary), "--score-test"])
    written = json.loads(summary.read_text())
    assert written["best"]["params"] == {k: params["featcal"][k] for k in ("alpha", "rho", "ridge")}
    assert set(written["test"]) == {"avg", "sentiment", "topic"}
    assert written["test"]["avg"] == pytest.approx((written["test"]["sentiment"] + written["test"]["topic"]) / 2, abs=1e-6)


def test_the_anchors_own_knob_is_searched_and_each_trial_calibrates_its_own_merge(project, tmp_path, monkeypatch):
    """tune.anchor_search: a trial merges base and experts with its anchor.* values, then calibrates
    (FeatCal) or trains (Surgery) on that merge; the params' options go first; data methods are refused."""
    from featcal.merging.in_memory import merge_models
    from featcal.tuning import baselines

    params = yaml.safe_load((project / "params.yaml").read_text())
    method, options = params["merge"]["method"], params["merge"]["options"]
    assert method == "task_arithmetic"
    problem, base = problem_of(project, params), FeatCalConfig.from_mapping(params["featcal"])
    anchor = tune.AnchorSearch(method, options, {"scale": tune.Range(0.1, 1.0)})
    storage = f"sqlite:///{tmp_path / 'anchor.db'}"
    tune.tune(problem, base, tune.SearchSpace(), storage, "anchor", 3, tune.StudySettings(startup_trials=2), anchor)
    trials = trials_of(storage, "anchor")
    assert trials[0].params == {**{k: params["featcal"][k] for k in ("alpha", "rho", "ridge")},
                                "anchor.scale": options["scale"]}
    assert len({t.params["anchor.scale"] for t in trials}) == 3 and all(t.user_attrs["merge_s"] > 0 for t in trials)
    last = trials[-1]
    merged = merge_models(problem.base, problem.experts, method, {**options, "scale": last.params["anchor.scale"]})
    config = dataclasses.replace(base, **{k: last.params[k] for k in ("alpha", "rho", "ridge")})
    dev = problem.score(problem.calibrate(config, merged=problem.family.backbone(merged)))
    assert last.value == pytest.approx(sum(dev.values()) / len(dev), abs=1e-12)
    assert anchor.options_of(last.params) == {**options, "scale": last.params["anchor.scale"]}
    assert problem.fingerprint(base, tune.SearchSpace()) != problem.fingerprint(base, tune.SearchSpace(), anchor)

    surgery = baselines.BaselineProblem(problem)
    outcome = baselines.tune_baseline(surgery, "surgery", storage, "anchor-surgery", 2, anchor=anchor)
    first, second = trials_of(storage, "anchor-surgery")
    assert first.params == {"lr": 1e-3, "rank": 16, "iterations": 500, "anchor.scale": options["scale"]}
    assert second.params["anchor.scale"] != options["scale"] and surgery.merged_feats is not None
    assert baselines.best_config(outcome, "surgery").rank in (first.params["rank"], second.params["rank"])

    # stages/tune.py reads tune.anchor_search and scores the best trial's own merge on test
    searched = dict(params, tune={**params["tune"], "anchor_search": {"scale": [0.1, 1.0]}})
    (tmp_path / "params.yaml").write_text(yaml.safe_dump(searched, sort_keys=False))
    summary = tmp_path / "anchor.json"
    monkeypatch.chdir(project)
    tune_stage.main(["--params", str(tmp_path / "params.yaml"), "--storage", storage, "--study-name", "anchor", "--n-trials", "3", "--summary", str(summary),
                     "--score-test"])
    written = json.loads(summary.read_text())
    assert written["ran_now"] == 0 and "anchor.scale" in written["best"]["params"] and "avg" in written["test"]

    with pytest.raises(ValueError, match="unknown option 'scal'"):
        tune.AnchorSearch(method, options, {"scal": tune.Range(0.1, 1.0)})


def test_sigmerge_repairs_the_anchor_in_each_trial_with_its_own_capacities_from_what_the_problem_holds(project, tmp_path):
    """SigMerge(anchor) + FeatCal: (c_min, c_max) searched per trial; its dev deficits come from the
    problem's dev scoring (the inner anchor scored once for all trials, each expert once on its own
    task) and its shared examples are each task's first calibration examples."""
    from featcal.merging.in_memory import merge_models
    from featcal.merging.registry import MergeContext

    params = yaml.safe_load((project / "params.yaml").read_text())
    problem, base = problem_of(project, params), FeatCalConfig.from_mapping(params["featcal"])
    options = {"anchor": "task_arithmetic", "anchor_options": {"scale": 0.02}}   # far from the experts: deficits
    anchor = tune.AnchorSearch("sigmerge", options, {"c_min": tune.Range(0.005, 0.05), "c_max": tune.Range(0.05, 0.3)},
                               {"shared_examples_per_task": 5})
    # the tiny experts are at chance on dev like the anchor: they score perfectly here, so that every
    # task has a deficit and SigMerge admits coordinates
    scored, score = [], problem.score
    expert_backbones = {id(problem.family.backbone(m)) for m in problem.experts.values()}

    def counted_score(backbone, splits=None):
        scored.append(1)
        return {t: 1.0 for t in problem.dev} if id(backbone) in expert_backbones else score(backbone, splits)

    problem.score = counted_score
    storage = f"sqlite:///{tmp_path / 'sigmerge.db'}"
    tune.tune(problem, base, tune.SearchSpace(), storage, "sigmerge", 3, tune.StudySettings(startup_trials=2), anchor)
    trials = trials_of(storage, "sigmerge")
    assert {k: trials[0].params[k] for k in ("anchor.c_min", "anchor.c_max")} == {"anchor.c_min": 0.02, "anchor.c_max": 0.2}
    assert len({(t.params["anchor.c_min"], t.params["anchor.c_max"]) for t in trials}) == 3
    # 3 trials: 2 experts + the inner TA anchor once + 3 calibrated models, not 3 x (2 + 1) + 3
    assert len(scored) == 2 + 1 + 3

    context = problem.merge_context(anchor)
    # what the capacity range does not change was computed once and kept for every trial
    assert {"anchor", "outputs", ("signals", 0.2)} <= set(context.cache)
    shared = context.shared_batches
    assert sum(len(b["input_ids"]) for b in shared) == 2 * 5
    first = problem.batches["sentiment"][0]
    assert torch.equal(shared[0]["input_ids"], first["input_ids"][:5])
    ta = merge_models(problem.base, problem.experts, "task_arithmetic", {"scale": 0.02})
    assert context.score_dev(problem.family.backbone(ta)) == score(problem.family.backbone(ta))
    assert context.expert_dev == {t: 1.0 for t in problem.experts}

    # the trial's merge (from the kept inner anchor, outputs and signals) is SigMerge's own, computed
    # afresh, with the trial's capacities, and it moves the anchor
    last = trials[-1]
    wanted = {**options, "c_min": last.params["anchor.c_min"], "c_max": last.params["anchor.c_max"]}
    record = MergeContext(score_dev=score, expert_dev=context.expert_dev, shared_batches=shared)
    reference = merge_models(problem.base, problem.experts, "sigmerge", wanted, record)
    merged = problem.merged_with(anchor, anchor.options_of(last.params))
    assert all(torch.equal(a, b) for a, b in zip(merged.state_dict().values(), reference.state_dict().values()))
    assert record.record["total_admitted"] > 0
    assert not all(torch.equal(a, b) for a, b in zip(merged.state_dict().values(), ta.state_dict().values()))


def test_a_data_anchor_inside_a_trial_reads_the_merge_stages_train_sample(project, monkeypatch):
    """SigMerge(RegMean) searched per trial: RegMean's train batches are the merge stage's sample
    (same split, seed, encoding), built once per size; a problem without them says so."""
    from featcal.evaluation import compare as cmp

    params = yaml.safe_load((project / "params.yaml").read_text())
    problem = problem_of(project, params)
    anchor = tune.AnchorSearch("sigmerge", {"anchor": "regmean", "anchor_options": {}},
                               {"c_min": tune.Range(0.005, 0.05)}, {"shared_examples_per_task": 5, "examples_per_task": 6})
    context = problem.merge_context(anchor)
    data = cmp.TaskData(["sentiment", "topic"], problem.encoder, str(project / "data/tasks"),
                        {"sentiment": 16, "topic": 16}, int(params["seed"]))   # what stages/merge.py builds
    expected = cmp.to_batches(data, cmp.calibration_examples(data, 6))
    assert list(context.batches) == list(expected)
    for task, wanted in expected.items():
        assert sum(len(b["input_ids"]) for b in wanted) == 6
        assert all(torch.equal(b[k], w[k]) for b, w in zip(context.batches[task], wanted, strict=True) for k in w)
    assert problem.merge_context(anchor).batches is context.batches
    problem._train_batches, problem._train_of = None, {}
    with pytest.raises(ValueError, match="'sigmerge' .* reads train batches; this problem was built without them"):
        problem.merge_context(anchor)
    monkeypatch.setattr(objective, "SUPPLIED_NEEDS", frozenset({"dev_scores", "shared_examples"}))
    with pytest.raises(ValueError, match=r"'sigmerge' needs data \(activations\) a trial cannot supply"):
        tune.AnchorSearch("sigmerge", {"anchor": "regmean"}, {"c_min": tune.Range(0.005, 0.05)})
    tune.AnchorSearch("sigmerge", {"anchor": "ties"}, {"c_min": tune.Range(0.005, 0.05)})


@pytest.mark.slow(35)
def test_one_command_runs_an_anchor_through_the_protocol_and_resumes_it(project, tmp_path):
    """stages/tune_anchor.py: the anchor merged once from compare.anchors' options, a scored study per
    method whose first trial is the spec's (FeatCal) or the paper's (Surgery) defaults, summaries with
    test read once; a larger --n-trials adds trials to the same studies and reuses the merge."""
    cmd = [sys.executable, "stages/tune_anchor.py", "task_arithmetic", "--methods", "featcal", "surgery",
           "--anchor-search", "scale=0.1:1.0", "--out", str(tmp_path / "dev"), "--work", str(tmp_path / "work")]
    first = run([*cmd, "--n-trials", "2"], project)
    assert "merging" in first, first
    storage = f"sqlite:///{tmp_path / 'dev/study.db'}"
    featcal_trials = trials_of(storage, "task_arithmetic-anchor-featcal")
    assert featcal_trials[0].params == {"alpha": 0.25, "rho": 2.2, "ridge": 0.05, "anchor.scale": 0.3}
    assert trials_of(storage, "task_arithmetic-anchor-surgery")[0].params["rank"] == 16
    for method in ("featcal", "surgery"):
        summary = json.loads((tmp_path / f"dev/task_arithmetic_{method}.json").read_text())
        assert summary["trials"]["complete"] == 2 and set(summary["test"]) == {"avg", "sentiment", "topic"}
    (merged,) = (tmp_path / "work").glob("task_arithmetic-*/merged")
    params = yaml.safe_load((merged.parent / "params.yaml").read_text())
    assert params["merge"] == {"method": "task_arithmetic", "options": {"scale": 0.3}}
    assert params["featcal"]["calibrate_pooler"] is True

    again = run([*cmd, "--n-trials", "3", "--methods", "featcal"], project)
    assert "merging" not in again and len(trials_of(storage, "task_arithmetic-anchor-featcal")) == 3
    assert [t.params for t in trials_of(storage, "task_arithmetic-anchor-featcal")[:2]] == \
        [t.params for t in featcal_trials]
    # the same experts elsewhere (a byte-identical copy, new mtimes) are served the same merge; other
    # experts' files (the copy, one file changed) are merged again, never served the first experts' merge
    copy = tmp_path / "experts-copy"
    shutil.copytree(project / "experts", copy, copy_function=shutil.copy)
    same = run([*cmd, "--n-trials", "3", "--methods", "featcal", "--experts", str(copy)], project)
    assert "merging" not in same and len(list((tmp_path / "work").glob("task_arithmetic-*/merged"))) == 1, same
    config = copy / "topic" / "config.json"
    config.write_text(config.read_text() + "\n")
    other = run([*cmd, "--n-trials", "3", "--methods", "featcal", "--experts", str(copy)], project)
    assert "merging" in other and len(list((tmp_path / "work").glob("task_arithmetic-*/merged"))) == 2, other

    # a study beside the protocol's (per-layer α): its own name, summary and params file
    protocol = (tmp_path / "dev/task_arithmetic_featcal.json").read_text()
    run([*cmd[:4], "featcal", *cmd[6:], "--n-trials", "1", "--variant", "per_layer",
         "--search", "alpha@0=0:1", "alpha@1=0:1", "ridge=1e-4:1:log"], project)
    (trial,) = trials_of(storage, "task_arithmetic-anchor-featcal-per_layer")
    assert trial.params == {"alpha@0": 0.25, "alpha@1": 0.25, "ridge": 0.05, "anchor.scale": 0.3}
    assert json.loads((tmp_path / "dev/task_arithmetic_featcal_per_layer.json").read_text())["trials"]["complete"] == 1
    assert (tmp_path / "dev/task_arithmetic_featcal.json").read_text() == protocol
    variant = yaml.safe_load((merged.parent / "params-per_layer.yaml").read_text())
    assert variant["tune"]["search"] == {"alpha@0": [0.0, 1.0], "alpha@1": [0.0, 1.0],
                                         "ridge": {"low": 1e-4, "high": 1.0, "log": True}}
    assert "alpha@0" not in yaml.safe_load((merged.parent / "params.yaml").read_text())["tune"]["search"]

    # SigMerge(anchor) + FeatCal: SigMerge's defaults first, (c_min, c_max) over compare.sigmerge.grid's span
    run([sys.executable, "stages/tune_anchor.py", "task_arithmetic", "--sigmerge", "--n-trials", "1",
         "--out", str(tmp_path / "dev"), "--work", str(tmp_path / "work")], project)
    (trial,) = trials_of(storage, "task_arithmetic-sigmerge-featcal")
    assert trial.params == {"alpha": 0.25, "rho": 2.2, "ridge": 0.05, "anchor.c_min": 0.02, "anchor.c_max": 0.2}
    summary = json.loads((tmp_path / "dev/task_arithmetic_sigmerge_featcal.json").read_text())
    assert set(summary["test"]) == {"avg", "sentiment", "topic"}
    (sigmerged,) = (tmp_path / "work").glob("task_arithmetic-sigmerge-*/merged")
    params = yaml.safe_load((sigmerged.parent / "params.yaml").read_text())
    assert params["merge"] == {"method": "sigmerge", "options": {
        "anchor": "task_arithmetic", "anchor_options": {"scale": 0.3}, "shared_examples_per_task": 4}}
    assert params["tune"]["anchor_search"] == {"c_min": [0.01, 0.05], "c_max": [0.05, 0.3]}

    # rescoring runs no trial and writes nothing into the studies or their summaries: each dev-best
    # model is built again, its dev scores are the trial's and its test scores the summary's
    study_file, summaries = (tmp_path / "dev/study.db").read_bytes(), {
        p.name: p.read_text() for p in (tmp_path / "dev").glob("*.json")}
    trials = {name: len(trials_of(storage, name)) for name in ("task_arithmetic-anchor-featcal",
                                                               "task_arithmetic-anchor-surgery")}
    predictions = tmp_path / "predictions"
    rescore = ["--rescore", "--out", str(tmp_path / "dev"), "--work", str(tmp_path / "work"),
               "--predictions", str(predictions)]
    said = run([*cmd[:6], *rescore], project)
    run([sys.executable, "stages/tune_anchor.py", "task_arithmetic", "--sigmerge", *rescore], project)
    assert "merging" not in said and "DIFFERS" not in said, said
    assert (tmp_path / "dev/study.db").read_bytes() == study_file
    assert {p.name: p.read_text() for p in (tmp_path / "dev").glob("*.json")} == summaries
    assert {name: len(trials_of(storage, name)) for name in trials} == trials
    checks = json.loads((predictions / "rescored.json").read_text())
    assert set(checks) == {"task_arithmetic/featcal", "task_arithmetic/surgery", "task_arithmetic/sigmerge_featcal"}
    assert all(c["same_trial"] and c["dev_matches"] and c["test_matches"] for c in checks.values()), checks
    assert sorted(p.name for p in predictions.glob("*.parquet")) == [
        "experts.parquet", "task_arithmetic-anchor-featcal.parquet", "task_arithmetic-anchor-surgery.parquet",
        "task_arithmetic-sigmerge-featcal.parquet", "task_arithmetic.parquet"]
    test = read_correctness(sorted(predictions.glob("*.parquet")), "test")
    for key, study in (("featcal", "task_arithmetic-anchor-featcal"), ("surgery", "task_arithmetic-anchor-surgery"),
                       ("sigmerge_featcal", "task_arithmetic-sigmerge-featcal")):
        summary = json.loads(summaries[f"task_arithmetic_{key}.json"])
        assert {t: round(float(c.mean()), 6) for t, c in test[study].items()} == \
            {t: v for t, v in summary["test"].items() if t != "avg"}
    dev = read_correctness(sorted(predictions.glob("*.parquet")), "dev")
    assert set(dev) == set(test) == {"experts", "task_arithmetic", "task_arithmetic-anchor-featcal",
                                     "task_arithmetic-anchor-surgery", "task_arithmetic-sigmerge-featcal"}
    assert all(c["fingerprint_matched"] for c in checks.values())

    # a study fingerprinted by older code: rescored unchecked, and it counts by reproducing its record
    optuna.load_study(study_name="task_arithmetic-sigmerge-featcal", storage=storage).set_user_attr("fingerprint", "0" * 40)
    said = run([sys.executable, "stages/tune_anchor.py", "task_arithmetic", "--sigmerge", *rescore], project)
    assert "re-scoring it unchecked" in (tmp_path / "work").joinpath(
        next(p.name for p in (tmp_path / "work").glob("task_arithmetic-sigmerge-*")), "rescore-featcal.log").read_text()
    check = json.loads((predictions / "rescored.json").read_text())["task_arithmetic/sigmerge_featcal"]
    assert check["fingerprint_matched"] is False and check["dev_matches"] and check["test_matches"], said


def assert_layers_equal(project: Path, calibrated: dict, equal: bool = True) -> None:
    same = []
    for layer in ("L00", "L01"):
        for name, value in load_file(project / f"calib/layers/{layer}.safetensors").items():
            same.append(torch.allclose(value, calibrated[name], rtol=1e-5, atol=1e-6))
    assert all(same) if equal else not all(same)


@pytest.mark.slow(15)
def test_with_use_tuned_dvc_repro_calibrates_with_the_best_values(project):
    # a study of its own without the defaults as trial 0, so the best values are not the defaults
    params = edit_params(project, featcal__use_tuned=True, tune__study_name="wiring", tune__n_trials=2,
                         tune__startup_trials=2, tune__enqueue_defaults=False)
    run([sys.executable, "stages/gen_chain.py"], project)
    third = run([*DVC, "repro"], project)
    assert stages_run(third) == {"tune@dev", "calibrate-layer@L00", "calibrate-layer@L01", "evaluate"}, third
    best = yaml.safe_load((project / "tune/best.yaml").read_text())
    assert best["study"]["name"] == "wiring"
    # DVCLive's log: one step per complete trial, numbered by trial, with the best so far
    trials = trials_of(f"sqlite:///{project / 'tune/study.db'}", "wiring")
    rows = [line.split("\t") for line in (project / "results/live/tune/plots/metrics/dev_accuracy.tsv").read_text().splitlines()]
    assert rows[0] == ["step", "dev_accuracy"]
    assert [(int(step), float(value)) for step, value in rows[1:]] == [(t.number, t.value) for t in trials]
    best_rows = (project / "results/live/tune/plots/metrics/best_dev_accuracy.tsv").read_text().splitlines()[1:]
    assert [float(r.split("\t")[1]) for r in best_rows] == [max(t.value for t in trials[:i + 1]) for i in range(len(trials))]
    assert json.loads((project / "results/live/tune/metrics.json").read_text())["best_dev_accuracy"] == \
        max(t.value for t in trials)
    lock = yaml.safe_load((project / "dvc.lock").read_text())
    assert lock["stages"]["calibrate-layer@L01"]["params"]["tune/best.yaml"] == \
        {f"featcal.{k}": v for k, v in best["featcal"].items()}
    assert best["featcal"]["ridge"] < 1e-4   # (written in exponent form: the case DVC's lock used to round)
    assert "Data and pipelines are up to date" in run([*DVC, "status", "dvc.yaml"], project)   # once reproduced, nothing changed
    # the saved layers are exactly an in-process calibration with the best values, not the defaults
    problem = problem_of(project, params)
    defaults = FeatCalConfig.from_mapping(params["featcal"])
    assert_layers_equal(project, problem.calibrate(FeatCalConfig.from_mapping({**params["featcal"], **best["featcal"]}))
                        .state_dict())
    with_defaults = problem.calibrate(defaults).state_dict()
    assert_layers_equal(project, with_defaults, equal=False)
    assert "up to date" in run([*DVC, "status", "dvc.yaml"], project).lower()

    edit_params(project, featcal__use_tuned=False)      # back to params.yaml's values, no tune stage
    run([sys.executable, "stages/gen_chain.py"], project)
    fourth = run([*DVC, "repro"], project)
    # evaluate may come back from DVC's run cache: the project was evaluated with these values before
    restored = set(re.findall(r"Stage '([^']+)' is cached - skipping run", fourth))
    assert stages_run(fourth) | restored == {"calibrate-layer@L00", "calibrate-layer@L01", "evaluate"}, fourth
    assert "calibrate-layer@L01" in stages_run(fourth), fourth
    lock = yaml.safe_load((project / "dvc.lock").read_text())
    assert "tune/best.yaml" not in lock["stages"]["calibrate-layer@L00"]["params"]
    assert_layers_equal(project, with_defaults)


@pytest.mark.slow(15)
def test_two_workers_share_one_postgres_study(project, postgres, tmp_path):
    """Two `stages/tune.py` worker processes on one PostgreSQL study: every trial lands once, the total is exact."""
    cmd = [sys.executable, "stages/tune.py", "--storage", postgres.url, "--study-name", "shared",
           "--n-trials", "8"]
    env = dict(os.environ, HF_HUB_OFFLINE="1")
    env.pop(WARM_ENV_KEY, None)   # cold processes: the trials' worker ids name these pids
    workers = [subprocess.Popen(cmd, cwd=project, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                text=True) for _ in range(2)]
    outputs = [w.communicate(timeout=300)[0] for w in workers]
    assert [w.returncode for w in workers] == [0, 0], "\n".join(o[-3000:] for o in outputs)

    ran = [set(json.loads(re.search(r"ran \d+ new trials (\[[\d, ]*\])", o).group(1))) for o in outputs]
    trials = trials_of(postgres.url, "shared")
    assert [t.number for t in trials] == list(range(8))                       # none lost, none duplicated
    assert all(t.state == TrialState.COMPLETE and t.value is not None for t in trials)
    assert ran[0].isdisjoint(ran[1]) and ran[0] | ran[1] == set(range(8))
    assert all(ran), f"one worker ran every trial: {ran}"      # they really worked at the same time
    print("trials per worker:", ran, [round(t.user_attrs["wall_s"], 2) for t in trials])
    pids = {int(t.user_attrs["worker"].rsplit(":", 1)[1]) for t in trials}
    assert pids <= {w.pid for w in workers}
    by_worker = {w.pid: {t.number for t in trials if t.user_attrs["worker"].endswith(f":{w.pid}")} for w in workers}
    assert [by_worker[w.pid] for w in workers] == ran
    assert len({tuple(sorted(t.params.items())) for t in trials}) == 8       # workers sample different points
    # what the DVC stage keeps of a server-side study: a sqlite snapshot
    tune.copy_to_sqlite(optuna.load_study(study_name="shared", storage=postgres.url), tmp_path / "snapshot.db")
    copied = trials_of(f"sqlite:///{tmp_path / 'snapshot.db'}", "shared")
    assert [(t.number, t.params, t.value) for t in copied] == [(t.number, t.params, t.value) for t in trials]


WORKER = textwrap.dedent("""
    import os, sys, time
    from pathlib import Path
    from featcal import tuning as tune
    url, name, go, ready = sys.argv[1], sys.argv[2], Path(sys.argv[3]), Path(sys.argv[4])
    study = tune.open_study(url, name)
    (ready / str(os.getpid())).touch()
    while not go.exists():
        time.sleep(0.01)
    def objective(trial):
        time.sleep(0.02)
        return trial.suggest_float("x", 0, 1)
    print(tune.run_trials(study, objective, 40, lock=tune.ClaimLock(url, name)))
""")


@pytest.mark.slow(7)
@pytest.mark.parametrize("backend", ["postgresql", "sqlite"])
def test_claims_meet_the_total_exactly_under_contention(backend, request, tmp_path):
    url = request.getfixturevalue("postgres").url if backend == "postgresql" else f"sqlite:///{tmp_path / 's.db'}"
    go, ready = tmp_path / "go", tmp_path / "ready"
    ready.mkdir()
    tune.open_study(url, "race")     # create the schema once
    workers = [subprocess.Popen([sys.executable, "-c", WORKER, url, "race", str(go), str(ready)],
                                stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=ROOT) for _ in range(3)]
    # all three hold the study open before any starts claiming (not a fixed sleep: imports take a while)
    deadline = time.monotonic() + 240
    while len(list(ready.iterdir())) < 3 and time.monotonic() < deadline \
            and all(w.poll() is None for w in workers):
        time.sleep(0.05)
    go.touch()
    outputs = [w.communicate(timeout=240) for w in workers]
    assert [w.returncode for w in workers] == [0, 0, 0], [o[1][-2000:] for o in outputs]
    ran = [json.loads(o[0].strip().splitlines()[-1]) for o in outputs]
    trials = trials_of(url, "race")
    assert sorted(n for r in ran for n in r) == [t.number for t in trials] == list(range(40))
    assert all(t.state == TrialState.COMPLETE for t in trials)


def test_sigmerge_over_a_data_anchor_takes_the_anchors_data_options_as_its_own(project):
    """tune_anchor --sigmerge on RegMean: compare.anchors' examples_per_task moves next to `anchor`,
    where SigMerge's data options are (inside anchor_options it would be refused)."""
    import tune_anchor   # stages/tune_anchor.py

    params = yaml.safe_load((project / "params.yaml").read_text())
    params["compare"]["anchors"]["regmean"] = {"off_diagonal": 0.9, "examples_per_task": 8}
    local = tune_anchor.anchor_params(params, "regmean", {"c_min": [0.01, 0.05]}, pooler=True, sigmerge=True)
    assert local["merge"] == {"method": "sigmerge", "options": {
        "anchor": "regmean", "anchor_options": {"off_diagonal": 0.9}, "examples_per_task": 8,
        "shared_examples_per_task": params["compare"]["sigmerge"]["shared_examples_per_task"]}}
    from featcal.merging import split_options

    assert split_options("sigmerge", local["merge"]["options"])[1]["examples_per_task"] == 8


def test_a_per_block_search_calibrates_each_block_with_its_own_value_and_writes_them_out(project, tmp_path):
    """alpha@0, alpha@1 (per-layer α): trial 0 is the defaults, a trial's score is the model calibrated
    with its per-block values, and tune/best.yaml carries them as layer_overrides, which the params
    check accepts (calibrate-layer@* reads them with featcal.use_tuned)."""
    from common import load_params   # stages/common.py: what every stage reads params files with

    params = yaml.safe_load((project / "params.yaml").read_text())
    problem, base = problem_of(project, params), FeatCalConfig.from_mapping(params["featcal"])
    space = tune.SearchSpace.from_mapping({"alpha@0": [0, 1], "alpha@1": [0, 1], "ridge": {"low": 1e-4, "high": 1, "log": True}})
    storage = f"sqlite:///{tmp_path / 'per_block.db'}"
    outcome = tune.tune(problem, base, space, storage, "per-block", 3, tune.StudySettings(startup_trials=2))
    trials = trials_of(storage, "per-block")
    assert trials[0].params == {"alpha@0": base.alpha, "alpha@1": base.alpha, "ridge": base.ridge}
    last = trials[-1]
    assert last.params["alpha@0"] != last.params["alpha@1"]
    config = objective.config_with(base, last.params)
    scores = problem.score(problem.calibrate(config))
    assert last.value == pytest.approx(sum(scores.values()) / len(scores), abs=1e-12)
    best = tune.write_best(tmp_path / "best.yaml", outcome.study, base)
    wanted = {b: {"alpha": float(f"{outcome.study.best_trial.params[f'alpha@{b}']:.12g}")} for b in (0, 1)}
    assert best["featcal"]["layer_overrides"] == wanted
    assert load_params(tmp_path / "best.yaml")["featcal"]["layer_overrides"] == wanted
    with pytest.raises(ValueError, match="no block 2; the model has 2 blocks"):
        tune.tune(problem, base, tune.SearchSpace.from_mapping({"alpha@2": [0, 1]}), storage, "per-block-2", 1)


def test_tune_anchor_makes_a_relative_sqlite_storage_absolute_since_its_studies_run_in_the_anchors_folder(
        tmp_path, monkeypatch):
    import tune_anchor   # stages/tune_anchor.py

    monkeypatch.chdir(tmp_path)
    assert tune_anchor.absolute_storage("sqlite:///work/study.db") == f"sqlite:///{tmp_path / 'work/study.db'}"
    assert tune_anchor.absolute_storage(f"sqlite:///{tmp_path}/s.db") == f"sqlite:///{tmp_path}/s.db"
    for other in ("postgresql://featcal@db-host/optuna", "sqlite:///:memory:", None):
        assert tune_anchor.absolute_storage(other) == other


def test_tune_anchor_names_a_merge_by_the_experts_content_not_their_file_times(tmp_path):
    """The same expert bytes written again (a new `make repro`: new mtimes) keep their merge folder;
    one changed byte or a new file names another."""
    import os

    import tune_anchor   # stages/tune_anchor.py

    experts = tmp_path / "experts"
    (experts / "a").mkdir(parents=True)
    (experts / "a" / "model.safetensors").write_bytes(b"\x00" * 64)
    (experts / "a" / "config.json").write_text("{}")
    before = tune_anchor.experts_identity(experts)
    weights = experts / "a" / "model.safetensors"
    weights.write_bytes(b"\x00" * 64)   # rewritten: same bytes, another mtime (set: the clock is coarse)
    os.utime(weights, ns=(1, 1))
    assert tune_anchor.experts_identity(experts) == before
    weights.write_bytes(b"\x00" * 63 + b"\x01")
    changed = tune_anchor.experts_identity(experts)
    assert changed != before
    (experts / "a" / "extra.txt").write_text("")
    assert tune_anchor.experts_identity(experts) not in (before, changed)
