"""Benchmark (not a test): where one trial of a FeatCal study spends its seconds, on the demo.

Replays the first --trials trials of the Task Arithmetic study of the comparison
(`task_arithmetic-anchor-featcal` in results/dev_tuning/study.db: TA's scale searched with α, ρ, λ)
in one process, as `stages/tune.py` runs them: the problem loaded once (setup), then per trial the
anchor merge with the trial's scale, the calibration (split into the walk's phases:
`featcal.profiling.phase`) and the dev scoring; first without the study's expert input cache, then
with it (the first trial captures the experts' side of every block, the later ones read it). Each
trial's dev score must equal the one the study recorded (the replay is the trial). Needs `make repro` and `python stages/tune_anchor.py
task_arithmetic --rescore` (or the study run) first, for the anchor's merge folder under work/anchors.
Figures go to results/bench.json (`trial_cost`). Run on an otherwise idle machine:

    python bench/trial_cost.py --trials 3 [--trial-product-dtype float32] [--on-disk]

`--on-disk` replays them once more with every block past the memory bound (1 byte), so on disk
(`featcal.calibration.spill.BlockSpill`, in params' cache.dtype), as a model whose
experts' side does not fit in `tune.expert_cache_mib` runs.
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import shlex
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

import optuna
import torch
import yaml

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "stages"))
from common import enabled_tasks, get, max_length  # noqa: E402

from featcal.calibration.calibrate import ExpertInputCache  # noqa: E402
from featcal.calibration.spill import BlockSpill  # noqa: E402
from featcal.calibration.config import FeatCalConfig  # noqa: E402
from featcal.profiling import phase_times  # noqa: E402
from featcal.tuning import DEFAULT_EXPERT_CACHE_MIB, AnchorSearch, Range, load_problem  # noqa: E402
from featcal.tuning.objective import config_with  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parent))
from alpha_rerun import merge_json  # noqa: E402

STUDY = "task_arithmetic-anchor-featcal"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--trials", type=int, default=3, help="how many of the study's first trials to replay")
    parser.add_argument("--study-file", default="results/dev_tuning/study.db")
    parser.add_argument("--work", default="work/anchors", help="where tune_anchor keeps the anchor's merge")
    parser.add_argument("--out", default="results/bench.json")
    parser.add_argument("--trial-product-dtype", choices=["float32"],
                        help="also replay with the reduced-precision search's moment products (and the cache)")
    parser.add_argument("--on-disk", action="store_true",
                        help="also replay with every block of the cache on disk (its spill), not in memory")
    parser.add_argument("--expert-cache-mib", type=int, default=DEFAULT_EXPERT_CACHE_MIB,
                        help="the bound of the cached run's expert input cache")
    args = parser.parse_args()
    folder = anchor_folder(args.work, "trial_cost")
    params = anchor_params(folder)
    trials = committed_trials(args.study_file)[:args.trials]
    start = time.perf_counter()
    problem = anchor_problem(params, folder)
    setup_s = time.perf_counter() - start
    base = FeatCalConfig.from_mapping(get(params, "featcal"))
    anchor = AnchorSearch("task_arithmetic", dict(get(params, "merge.options")), {"scale": Range(0.1, 1.0)})
    modes = {}
    # side by side in one run: every trial running the experts' side of each block (the cache off),
    # then the same trials with the study's cache (the first captures, the others read)
    # (--trial-product-dtype float32: then the same with the reduced-precision search's products too)
    runs = [("uncached", False, base), ("cached", True, base)]
    if args.trial_product_dtype:   # a cache of its own: the float64 one is let go first
        runs.append((f"cached_{args.trial_product_dtype}", True,
                     dataclasses.replace(base, product_dtype=args.trial_product_dtype)))
    if args.on_disk:
        runs.append(("on_disk", True, base))
    cached_runs = {}   # mode -> what a cached run held and how its later trials compare
    for mode, cached, config in runs:
        problem.expert_inputs = None   # the last run's cache let go before the next one fills
        if mode == "on_disk":
            problem.expert_inputs = ExpertInputCache(1, BlockSpill(dtype=get(params, "cache.dtype", "float32")))
        elif cached:
            problem.expert_inputs = ExpertInputCache(int(args.expert_cache_mib) * 2**20)
        print(f"-- {mode}", flush=True)
        modes[mode] = [replay(problem, config, anchor, trial) for trial in trials]
        if cached:
            cached_runs[mode] = {"expert_inputs_mib": round(problem.expert_inputs.nbytes / 2**20, 1),
                                 "expert_inputs_disk_mib": round(problem.expert_inputs.disk_nbytes / 2**20, 1)}
    mean = {m: {k: round(statistics.fmean(r[k] for r in rows), 2) for k in ("merge_s", "calibrate_s", "score_s", "total_s")}
            for m, rows in modes.items()}
    uncached_s = statistics.fmean(r["total_s"] for r in modes["uncached"])
    for mode, run in cached_runs.items():
        later = modes[mode][1:] or modes[mode]   # the trials after the capturing one
        run.update(mean=mean[mode], trials=modes[mode],
                   later_trial_over_uncached=round(statistics.fmean(r["total_s"] for r in later) / uncached_s, 3))
    print(f"setup (once per study): {setup_s:.1f} s; per trial, mean of {len(trials)}: {mean}")
    for mode, run in cached_runs.items():
        print(f"{mode}: expert input cache {run['expert_inputs_mib']} MiB in memory, {run['expert_inputs_disk_mib']} MiB "
              "on disk; a trial after the first / a trial "
              f"without the cache: {run['later_trial_over_uncached']:.3f}"
              + (" (dev scores: float32 products', against the study's float64 ones)" if "float32" in mode else ""))
    merge_json(Path(args.out), {"trial_cost": {
        "command": shlex.join(["python", *sys.argv]), "date": datetime.datetime.now().astimezone().isoformat(timespec="seconds"),
        "threads": torch.get_num_threads(), "study": STUDY, "setup_s": round(setup_s, 2), "mean": mean["uncached"],
        "trials": modes["uncached"], **cached_runs}})
    print(f"wrote {args.out}")


def anchor_folder(work: str, script: str) -> Path:
    """The anchor's merge folder `stages/tune_anchor.py task_arithmetic` keeps under `work`: the newest, where
    several are (tune_anchor makes another whenever the merge options or the experts' bytes change)."""
    folders = sorted((p.parent for p in Path(work).glob("task_arithmetic-*/merged")),
                     key=lambda p: ((p / "merged").stat().st_mtime_ns, p.name))
    if not folders:
        raise SystemExit(f"{script}: no task_arithmetic-*/merged under {work}: run "
                         "`python stages/tune_anchor.py task_arithmetic` first")
    return folders[-1]


def anchor_params(folder: Path) -> dict:
    """The params the anchor's studies ran with: its rescore's file where one was written, else the folder's own
    (tune_anchor writes it with the anchor as `merge`; the project's params.yaml may merge another anchor)."""
    for name in ("params-rescore-featcal.yaml", "params.yaml"):
        if (folder / name).exists():
            return yaml.safe_load((folder / name).read_text())
    raise SystemExit(f"no params.yaml in {folder}: not a stages/tune_anchor.py merge folder")


def committed_trials(study_file: str | Path) -> list:
    """The committed study's complete trials by number, read from a copy (opening a study may write)."""
    with tempfile.TemporaryDirectory() as tmp:
        shutil.copyfile(study_file, Path(tmp) / "study.db")
        study = optuna.load_study(study_name=STUDY, storage=f"sqlite:///{Path(tmp) / 'study.db'}")
        return sorted((t for t in study.trials if t.state.name == "COMPLETE"), key=lambda t: t.number)


def anchor_problem(params: dict, folder: Path):
    """The tuning problem on the anchor's merge, loaded as `stages/tune.py` loads it."""
    tasks = enabled_tasks(params)
    return load_problem(base=get(params, "model.base"), tasks=tasks, max_length={t: max_length(params, t) for t in tasks},
                        batch_size=int(get(params, "calibration.batch_size")), merged=folder / "merged",
                        experts_dir="experts", features="features/experts", tasks_dir=get(params, "tasks_dir"),
                        seed=int(get(params, "seed")))


def replay(problem, base: FeatCalConfig, anchor: AnchorSearch, trial) -> dict:
    """One recorded trial again: its merge, calibration (by phase) and dev scoring, timed."""
    config = config_with(base, {k: v for k, v in trial.params.items() if not k.startswith(AnchorSearch.PREFIX)})
    with phase_times() as phases:
        t0 = time.perf_counter()
        merged = problem.merged_with(anchor, anchor.options_of(trial.params))
        t1 = time.perf_counter()
        backbone = problem.calibrate(config, merged=merged)
        t2 = time.perf_counter()
        dev = problem.score(backbone)
        t3 = time.perf_counter()
    same = all(round(v, 6) == trial.user_attrs["dev"][t] for t, v in dev.items())
    row = {"trial": trial.number, "merge_s": round(t1 - t0, 2), "calibrate_s": round(t2 - t1, 2),
           "score_s": round(t3 - t2, 2), "total_s": round(t3 - t0, 2),
           "phases_s": {k: round(v, 2) for k, v in sorted(phases.items(), key=lambda kv: -kv[1])},
           "dev_as_recorded": same}
    print(f"trial {trial.number}: merge {t1 - t0:.1f} s, calibrate {t2 - t1:.1f} s, score dev {t3 - t2:.1f} s "
          f"(dev as the study recorded: {same})", flush=True)
    for name, seconds in row["phases_s"].items():
        print(f"    {name:28s} {seconds:7.2f} s {100 * seconds / (t2 - t1):5.1f} % of the calibration")
    return row


if __name__ == "__main__":
    main()
