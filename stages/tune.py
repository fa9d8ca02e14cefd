"""DVC stage `tune@dev`: search FeatCal's α, ρ, λ with Optuna on the dev split (featcal.tuning).

Brings the study (--storage, else $FEATCAL_TUNE_STORAGE, else tune.storage, else sqlite at
tune/study.db) up to tune.n_trials (or --n-trials). The stage (dvc.yaml gives every path) then
writes the best values to --best (read by calibrate-layer@* when featcal.use_tuned: true), a
summary to --summary with its plots (--history-plot: each trial's dev accuracy and the best so far;
--importance-plot: optuna's parameter importances) and, when the study lives in a server database, a
sqlite snapshot at --snapshot. More workers, on this or other machines, run this same script from
the project root without those: `python stages/tune.py --storage URL --n-trials N` adds trials, writes nothing.

`--method surgery|probsurgery` runs the same protocol for a post-merge baseline on the same merged
model, calibration examples and dev data (featcal.tuning.baselines). With --summary and
`--score-test`, any method's best configuration is scored on test once and the summary gets `test`.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import os
from pathlib import Path
from typing import Callable, Mapping

from common import enabled_tasks, get, live_log, load_params, log_step, max_length, positive_int, setup_logging, timed
from params_schema import Tune as TuneParams

from featcal.calibration.config import FeatCalConfig
from featcal.calibration.spill import BlockSpill
from featcal.evaluation.predictions import recording, write_predictions
from featcal.io.models import write_json
from featcal.tuning import (
    DEFAULT_EXPERT_CACHE_MIB, SearchSpace, StudyMismatchError, StudySettings, StudyStorageError, load_problem,
    make_storage, tune, write_best,
)
from featcal.tuning.study import snapshot_to_sqlite

DEFAULT_SQLITE = "tune/study.db"


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--params", default="params.yaml", help="params file (tasks, tokens, calibration, featcal, tune)")
    parser.add_argument("--storage", help="SQLAlchemy URL of the study (default: tune.storage, else sqlite at --snapshot)")
    parser.add_argument("--n-trials", type=positive_int, help="total trials wanted in the study (default: tune.n_trials)")
    parser.add_argument("--study-name", help=f"study name (default: tune.study_name, else {TuneParams().study_name})")
    parser.add_argument("--merged", default="models/merged", help="the merged multi-task model folder")
    parser.add_argument("--experts", default="experts", help="folder of the experts, one sub-folder per task")
    parser.add_argument("--features", default="features/experts", help="the experts' cached states (zarr)")
    parser.add_argument("--best", help="where the best values are written (the stage: tune/best.yaml)")
    parser.add_argument("--summary", help="where the study summary is written (the stage: results/tune.json)")
    parser.add_argument("--snapshot", help="sqlite copy of a server-side study (the stage: tune/study.db)")
    parser.add_argument("--history-plot", help="with --summary: the tuning history's PNG (the stage: "
                                               "results/plots/tune_history.png)")
    parser.add_argument("--importance-plot", help="with --summary: the parameter importances' PNG (the stage: "
                                                  "results/plots/tune_importance.png)")
    parser.add_argument("--method", choices=("featcal", "surgery", "probsurgery"), default="featcal",
                        help="what the study tunes: FeatCal's alpha, rho, ridge, or a post-merge baseline's training knobs")
    parser.add_argument("--score-test", action="store_true",
                        help="with --summary: also the best configuration's test accuracy (test read once)")
    parser.add_argument("--live", help="with --summary: DVCLive folder, each complete trial's dev accuracy and the "
                                        "best so far, in trial order (the stage: results/live/tune)")
    parser.add_argument("--predictions", metavar="DIR",
                        help="with --score-test: also write the per-example dev and test predictions (Parquet) of "
                             "the dev-best model to DIR/<study>.parquet and, for a FeatCal study, of the merge the "
                             "study starts from (DIR/<merge.method>.parquet) and the experts (DIR/experts.parquet)")
    parser.add_argument("--rescore", action="store_true",
                        help="run no trial: the study must be complete; its dev-best model is built and scored "
                             "again (with --predictions, to record what the study's summary reports)")
    args = parser.parse_args(argv)
    if args.predictions and not args.score_test:
        parser.error("--predictions goes with --summary and --score-test (the dev-best model's predictions)")
    if args.live and not args.summary:
        parser.error("--live goes with --summary (the stage writes both)")
    if (args.history_plot or args.importance_plot) and not (args.summary and args.history_plot and args.importance_plot):
        parser.error("--history-plot and --importance-plot go together, with --summary (the stage writes all three)")
    return args


def log_trials(study, directory: str) -> None:
    """Every complete trial of the study (this worker's and the others'), as DVCLive steps numbered
    by trial: `dev_accuracy` (the objective) and `best_dev_accuracy` so far."""
    from optuna.trial import TrialState

    best = None
    with live_log(directory) as live:
        for trial in sorted(study.get_trials(deepcopy=False, states=(TrialState.COMPLETE,)), key=lambda t: t.number):
            best = trial.value if best is None else max(best, trial.value)
            log_step(live, trial.number, {"dev_accuracy": trial.value, "best_dev_accuracy": best})


def test_splits(params: dict, tasks: list[str]) -> dict:
    from featcal.data.splits import read_split

    return {t: read_split(get(params, "tasks_dir"), t, "test") for t in tasks}


def test_summary(scores: dict[str, float]) -> dict[str, float]:
    return {"avg": round(sum(scores.values()) / len(scores), 6), **{t: round(v, 6) for t, v in scores.items()}}


def score_best(summary: dict, study, score: Callable[[Mapping | None], dict[str, float]], params: dict,
               tasks: list[str], predictions: str | None) -> None:
    """The dev-best model scored on test once (`summary["test"]`; `score(None)` scores dev) and on dev:
    `summary["rescored_dev"]` says whether dev scored as the study recorded for that trial (it does
    not when the trials searched in reduced precision or on fewer examples; its `dev` is then the
    deployed model's). With `predictions`, its dev and test predictions go to <predictions>/<study>.parquet."""
    test = test_splits(params, tasks)
    with recording() as records:
        dev = score(None)
        summary["test"] = test_summary(score(test))
    if predictions:
        write_predictions(Path(predictions) / f"{study.study_name}.parquet", {study.study_name: records})
    from featcal.tuning import chosen_trial, reranked_dev

    chosen = chosen_trial(study)   # after a rerank its exact dev is what the deployed model must reproduce
    recorded = reranked_dev(study).get(chosen.number) or chosen.user_attrs.get("dev", {})
    summary["rescored_dev"] = {"dev": test_summary(dev)["avg"],
                               "matches_trial": all(round(dev[t], 6) == recorded.get(t) for t in dev)}


def write_start_predictions(problem, method: str, params: dict, tasks: list[str], predictions: str) -> None:
    """The dev and test predictions of the merge the study starts from (<predictions>/<method>.parquet)
    and of each expert on its own task (<predictions>/experts.parquet)."""
    from featcal.finetune import accuracy

    test = test_splits(params, tasks)
    with recording() as merged:
        problem.score(problem.merged)
        problem.score(problem.merged, test)
    with recording() as experts:
        for task, dev in problem.dev.items():
            for split in (dev.split, test[task]):
                accuracy(problem.experts[task], problem.encoder, split, dev.max_length)
    write_predictions(Path(predictions) / f"{method}.parquet", {method: merged})
    write_predictions(Path(predictions) / "experts.parquet", {"experts": experts})


def trials_so_far(storage: str, study_name: str) -> int:
    """The trials a study counts (`--rescore`); a missing or empty study is an error naming it."""
    import optuna

    from featcal.tuning.study import count_trials, redacted

    try:
        study = optuna.load_study(study_name=study_name, storage=make_storage(storage))
    except (KeyError, StudyStorageError) as err:
        raise SystemExit(f"tune: --rescore: no study {study_name!r} in {redacted(storage)} ({err})") from None
    n = count_trials(study)
    if n == 0:
        raise SystemExit(f"tune: --rescore: study {study_name!r} in {redacted(storage)} has no finished trial")
    return n


def expert_spill(params: dict, settings: dict, defaults: TuneParams) -> BlockSpill | None:
    """Where a study's expert block inputs past `tune.expert_cache_mib` go: a temporary folder (under
    `tune.expert_cache_dir`, else the system's) of at most `tune.expert_cache_disk_mib` (0: none), the
    inputs in `cache.dtype` where it is narrower, as the collected states are."""
    disk_mib = settings.get("expert_cache_disk_mib", defaults.expert_cache_disk_mib)
    if disk_mib == 0 or settings.get("expert_cache_mib", defaults.expert_cache_mib) in (0, None):
        return None   # no cache, or one without a memory bound: nothing goes to disk
    return BlockSpill(settings.get("expert_cache_dir"), None if disk_mib is None else int(disk_mib) * 2**20,
                      get(params, "cache.dtype", "float32"))


def anchor_search(params: dict):
    """`tune.anchor_search` (ranges of merge.method's own options) as an AnchorSearch; None when empty."""
    from featcal.merging import split_options
    from featcal.tuning.objective import AnchorSearch, Range

    ranges = get(params, "tune.anchor_search", {}) or {}
    if not ranges:
        return None
    method = get(params, "merge.method")
    options, data = split_options(method, get(params, "merge.options", {}) or {})
    return AnchorSearch(method, options, {k: Range.parse(f"anchor_search.{k}", v) for k, v in ranges.items()}, data)


def best_merge(problem, anchor, study):
    """The merge of the study's best trial (None without an anchor search: the loaded merged model)."""
    from featcal.tuning import chosen_trial

    return problem.merged_with(anchor, anchor.options_of(chosen_trial(study).params)) if anchor is not None else None


def tune_baseline_and_report(problem, args, storage: str, study_name: str, n_trials: int, params: dict,
                             tasks: list[str], anchor) -> None:
    """A post-merge baseline's study (same problem, same budget), its summary and, once, its test scores."""
    from featcal.tuning.baselines import BaselineProblem, best_config, tune_baseline

    # tune.trial_examples_per_task: the trials read each task's first N calibration examples, as FeatCal's do
    baseline = BaselineProblem(problem, get(params, "tune.trial_examples_per_task", None))
    outcome = tune_baseline(baseline, args.method, storage, study_name, n_trials, seed=int(get(params, "seed")),
                            anchor=anchor, rerank_top_k=int(get(params, "tune.rerank_top_k", 0) or 0))
    if args.summary:
        summary = dict(outcome.summary)
        if args.score_test:   # the best configuration trained once more, on every example (unless the rung did)
            final = baseline.on_every_example()
            if anchor is not None:
                final.use_merged(best_merge(problem, anchor, outcome.study))
            modules = outcome.deployed if outcome.deployed is not None else final.train(best_config(outcome, args.method))
            score_best(summary, outcome.study, lambda splits: final.score(modules, splits), params, tasks,
                       args.predictions)
        write_json(args.summary, summary)
    best = outcome.summary.get("best", {})
    print(f"study {study_name} ({args.method}): ran {len(outcome.ran)} new trials, best trial {best.get('trial')} "
          f"dev {best.get('dev_avg')} {best.get('params')}")


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    setup_logging()
    params = load_params(args.params)   # the whole params file checked before any model loads
    settings = get(params, "tune", {}) or {}
    storage = (args.storage or os.environ.get("FEATCAL_TUNE_STORAGE") or settings.get("storage")
               or f"sqlite:///{args.snapshot or DEFAULT_SQLITE}")
    defaults = TuneParams()   # the schema's defaults, for the keys params.yaml leaves out
    study_name = args.study_name or settings.get("study_name", defaults.study_name)
    n_trials = args.n_trials or int(settings.get("n_trials", defaults.n_trials))
    if args.rescore:   # the study's own count: no trial runs
        n_trials = trials_so_far(storage, study_name)
    base = FeatCalConfig.from_mapping(get(params, "featcal"))
    space = SearchSpace.from_mapping(settings["search"]) if settings.get("search") else SearchSpace()
    tasks = enabled_tasks(params)
    stage = args.best or args.summary or args.snapshot   # the DVC stage, not an extra worker: record timing
    with timed("tune") if stage else contextlib.nullcontext():
        try:
            make_storage(storage)   # an empty or damaged study file fails here, before any model loads
            anchor = anchor_search(params)   # (an unsearchable anchor fails here too)
            problem = load_problem(base=get(params, "model.base"), tasks=tasks,
                                   max_length={t: max_length(params, t) for t in tasks},
                                   batch_size=int(get(params, "calibration.batch_size")), merged=args.merged,
                                   experts_dir=args.experts, features=args.features,
                                   tasks_dir=get(params, "tasks_dir"), seed=int(get(params, "seed")),
                                   expert_cache_mib=settings.get("expert_cache_mib", DEFAULT_EXPERT_CACHE_MIB),
                                   expert_spill=expert_spill(params, settings, defaults))
            if args.method != "featcal":
                return tune_baseline_and_report(problem, args, storage, study_name, n_trials, params, tasks, anchor)
            # the keys params.yaml gives; StudySettings' own defaults for the rest
            given = {f.name: settings[f.name] for f in dataclasses.fields(StudySettings) if f.name in settings}
            given["prune_after_layers"] = tuple(given.get("prune_after_layers") or ())
            try:
                outcome = tune(problem, base, space, storage, study_name, n_trials, StudySettings(**given), anchor)
            except StudyMismatchError as err:
                if not args.rescore:
                    raise
                # an older study, fingerprinted before a change of what the digest covers: rescored all
                # the same, and it counts only if dev and test reproduce its record (rescored_dev, test)
                print(f"tune: --rescore: {err.args[0].split(';')[0]}; re-scoring it unchecked", flush=True)
                outcome = tune(problem, base, space, storage, study_name, n_trials, StudySettings(**given), anchor,
                               check_fingerprint=False)
                outcome.summary["fingerprint_matched"] = False
        except (ValueError, KeyError, OSError, StudyMismatchError, StudyStorageError) as err:
            # a bad input, said in one line (what, where, the fix) instead of a traceback
            raise SystemExit(f"tune: error: {err.args[0] if isinstance(err, KeyError) and err.args else err}") from None
        if args.best:
            write_best(args.best, outcome.study, base)
        if args.summary:
            if args.score_test:   # the dev-best values, calibrated once more and scored on test
                from featcal.tuning import best_values

                config = dataclasses.replace(base, **best_values(outcome.study, base))
                calibrated = outcome.deployed if outcome.deployed is not None else \
                    problem.calibrate(config, merged=best_merge(problem, anchor, outcome.study))   # (the rung built it)
                score_best(outcome.summary, outcome.study, lambda splits: problem.score(calibrated, splits), params,
                           tasks, args.predictions)
                if args.predictions and get(params, "merge.method") != "sigmerge":
                    write_start_predictions(problem, get(params, "merge.method"), params, tasks, args.predictions)
            write_json(args.summary, outcome.summary)
            if args.history_plot:
                from featcal.evaluation.plots import plot_study   # matplotlib: only the stage draws

                plot_study(outcome.study, args.history_plot, args.importance_plot)
        if args.live:
            log_trials(outcome.study, args.live)
        if args.snapshot:
            snapshot_to_sqlite(outcome.study, storage, args.snapshot)
    best = outcome.summary.get("best", {})
    print(f"study {outcome.study.study_name}: ran {len(outcome.ran)} new trials {outcome.ran}, "
          f"{outcome.summary['trials']['complete']} complete; best trial {best.get('trial')} "
          f"dev {best.get('dev_avg')} {best.get('params')}")


if __name__ == "__main__":
    main()
