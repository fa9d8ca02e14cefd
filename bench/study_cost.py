"""Benchmark (not a test): a FeatCal study's wall time against a Surgery study's, same anchor, same trials.

Runs the tuning protocol's Task Arithmetic studies afresh, one after the other in this run
(`stages/tune_anchor.py task_arithmetic --methods <m> --anchor-search scale=0.1:1.0 --n-trials N`,
each into a temporary study file and output folder of its own; the anchor's merge folder under
work/anchors is reused), each as the project's params configure it (`tune.*`: the expert input
cache, `trial_product_dtype`, `trial_examples_per_task`, pruning), `--trial-examples N|all`
overriding `trial_examples_per_task` for the FeatCal study and the Surgery study alike (the same
saving reaches both, so the comparison stays fair), `--trial-product-dtype float32` the FeatCal
trials' products. Where the FeatCal study's trials calibrate on fewer examples or in float32, a
reference FeatCal study with every example in float64 runs too (`--no-reference`: not), so the best
dev scores compare in one run. Prints each study's wall time, its best trial's dev score as
the trial scored it and as the deployed model (calibrated on every example) scores it, that model's
test score, and FeatCal ÷ Surgery; the figures go to results/bench.json
(`featcal_study_over_surgery_study`, `study_best_dev`: the deployed dev score, and `study_cost`
with the details). The committed studies in results/dev_tuning are not touched. The first study's
time includes the anchor's merge where work/anchors does not hold it yet (seconds). Needs `make repro`
first (the experts' cached features). Run on an otherwise idle machine (24 trials each: ~25 min on
the demo, ~15 min more with the reference):

    python bench/study_cost.py [--n-trials 24] [--trial-examples 64] [--trial-product-dtype float32] [--no-reference]
                               [--keep DIR]
"""

from __future__ import annotations

import argparse
import datetime
import json
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(Path(__file__).resolve().parent))
from alpha_rerun import merge_json, verdict  # noqa: E402  (it puts stages/ on the path)
from common import get, load_params  # noqa: E402
from tune_anchor import examples_or_all  # noqa: E402

ANCHOR = "task_arithmetic"
GOAL = 1.0   # issue: FeatCal's study costs no more than Surgery's
DEV_DROP_GOAL = 0.1   # issue: a cheaper search keeps the best dev within 0.1 points


def run_tune_anchor(args: list[str], script: str) -> list[str]:
    """`stages/tune_anchor.py <anchor> args` in the project run from (its data); a failure stops `script`
    with the command and the end of its output. Returns the command."""
    command = [sys.executable, str(ROOT / "stages" / "tune_anchor.py"), ANCHOR, *args]
    done = subprocess.run(command, capture_output=True, text=True)
    if done.returncode != 0:
        raise SystemExit(f"{script}: {' '.join(command)} failed:\n{(done.stdout + done.stderr)[-3000:]}")
    return command


def run_study(method: str, n_trials: int, folder: Path, extra: list[str]) -> dict:
    """One fresh study of `method` on the anchor, in `folder`: its wall time and its summary."""
    start = time.perf_counter()
    command = run_tune_anchor(["--methods", method, "--anchor-search", "scale=0.1:1.0", "--n-trials", str(n_trials),
                               "--out", str(folder / "dev"), "--storage", f"sqlite:///{folder / 'study.db'}", *extra],
                              "study_cost")
    wall = time.perf_counter() - start
    summary = json.loads((folder / "dev" / f"{ANCHOR}_{method}.json").read_text())
    return {"wall_s": round(wall, 2), "trials": summary["trials"], "trial_wall_s": summary.get("trial_wall_s"),
            "trial_examples_per_task": summary.get("trial_examples_per_task"),
            "trial_product_dtype": summary.get("trial_product_dtype"),
            "best_trial": summary["best"]["trial"], "best_params": summary["best"].get("params"),
            "best_dev_as_trial": round(summary["best"]["dev_avg"], 6),
            "best_dev": summary["rescored_dev"]["dev"], "best_test": summary["test"]["avg"], "rerank": summary.get("rerank"),
            "command": " ".join(command[1:])}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--n-trials", type=int, default=24, help="trials per study (the comparison's protocol: 24)")
    parser.add_argument("--trial-examples", type=examples_or_all, metavar="N|all",
                        help="the FeatCal and Surgery studies' tune.trial_examples_per_task (default: params.yaml's)")
    parser.add_argument("--trial-product-dtype", choices=["float32", "float64"],
                        help="the FeatCal study's tune.trial_product_dtype (default: params.yaml's)")
    parser.add_argument("--rerank-top-k", type=int, metavar="K",
                        help="both studies' tune.rerank_top_k: the K best cheap trials calibrated (trained) again on "
                             "every example, the best on dev chosen (default: params.yaml's)")
    parser.add_argument("--no-reference", action="store_true",
                        help="no FeatCal study on every example beside one on fewer")
    parser.add_argument("--out", default="results/bench.json")
    parser.add_argument("--keep", metavar="DIR", help="copy each study (study.db and its summary) to DIR/<study>")
    args = parser.parse_args()
    params = load_params("params.yaml")
    fewer = args.trial_examples or get(params, "tune.trial_examples_per_task", None)
    dtype = args.trial_product_dtype or get(params, "tune.trial_product_dtype", None)
    fidelity = ["--trial-examples-per-task", str(args.trial_examples)] if args.trial_examples else []
    precision = ["--trial-product-dtype", args.trial_product_dtype] if args.trial_product_dtype else []
    rung = ["--rerank-top-k", str(args.rerank_top_k)] if args.rerank_top_k is not None else []
    fidelity += rung   # the reference (every example, float64) has nothing to rerank
    runs = {"featcal": ("featcal", fidelity + precision)}
    if (fewer not in (None, "all") or dtype == "float32") and not args.no_reference:
        runs["featcal_all_examples"] = ("featcal", ["--trial-examples-per-task", "all", "--trial-product-dtype", "float64"])
    runs["surgery"] = ("surgery", fidelity)
    with tempfile.TemporaryDirectory(prefix="featcal-study-cost-") as tmp:
        studies = {name: run_study(method, args.n_trials, Path(tmp) / name, extra)
                   for name, (method, extra) in runs.items()}
        for name in studies if args.keep else ():
            kept = Path(args.keep) / name
            kept.mkdir(parents=True, exist_ok=True)
            shutil.copyfile(Path(tmp) / name / "study.db", kept / "study.db")
            for summary in (Path(tmp) / name / "dev").glob("*.json"):
                shutil.copyfile(summary, kept / summary.name)
    ratio = round(studies["featcal"]["wall_s"] / studies["surgery"]["wall_s"], 3)
    for name, s in studies.items():
        examples = s["trial_examples_per_task"] or "all"
        print(f"{name:20s} {args.n_trials} trials ({examples} examples a task, {s['trial_product_dtype'] or 'float64'} "
              f"products): {s['wall_s']:8.1f} s; best trial "
              f"{s['best_trial']}: dev {100 * s['best_dev_as_trial']:.2f} as the trial scored it, "
              f"{100 * s['best_dev']:.2f} deployed; test {100 * s['best_test']:.2f}")
    print(f"featcal_study_over_surgery_study {ratio} ({verdict(ratio, GOAL)})")
    if "featcal_all_examples" in studies:
        drop = round(100 * (studies["featcal_all_examples"]["best_dev"] - studies["featcal"]["best_dev"]), 2)
        print(f"best dev (deployed), trials on every example in float64 - on {fewer or 'all'} a task in "
              f"{dtype or 'float64'}: {drop} points "
              f"({verdict(drop, DEV_DROP_GOAL)})")
    merge_json(Path(args.out), {
        "featcal_study_over_surgery_study": ratio, "study_best_dev": studies["featcal"]["best_dev"],
        "study_cost": {"command": "python bench/study_cost.py " + " ".join(sys.argv[1:]),
                       "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
                       "threads": torch.get_num_threads(), "anchor": ANCHOR, "studies": studies,
                       "goals": {"featcal_study_over_surgery_study": GOAL, "best_dev_drop_points": DEV_DROP_GOAL}}})


if __name__ == "__main__":
    main()
