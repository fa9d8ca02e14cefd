"""Benchmark (not a test): a FeatCal study's wall time against a Surgery study's, same anchor, same trials.

Runs the tuning protocol's Task Arithmetic studies afresh, one after the other in this run
(`stages/tune_anchor.py task_arithmetic --methods featcal surgery --anchor-search scale=0.1:1.0
--n-trials N`, into a temporary study file and output folder; the anchor's merge folder under
work/anchors is reused), each as the project's params configure it (`tune.*`: the expert input
cache, `trial_product_dtype`, pruning). Prints each study's wall time, best dev score and that
trial's test score, and FeatCal ÷ Surgery; the figures go to results/bench.json
(`featcal_study_over_surgery_study`, `study_best_dev`, and `study_cost` with the details). The
committed studies in results/dev_tuning are not touched. The FeatCal study runs first, so its time
includes the anchor's merge where work/anchors does not hold it yet (seconds). Needs `make repro`
first (the experts' cached features). Run on an otherwise idle machine (24 trials each: ~25 min on the demo):

    python bench/study_cost.py [--n-trials 24]
"""

from __future__ import annotations

import argparse
import datetime
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(Path(__file__).resolve().parent))
from alpha_rerun import merge_json, verdict  # noqa: E402

ANCHOR = "task_arithmetic"
METHODS = ("featcal", "surgery")
GOAL = 1.0   # issue: FeatCal's study costs no more than Surgery's


def run_study(method: str, n_trials: int, folder: Path) -> dict:
    """One fresh study of `method` on the anchor: its wall time and its summary."""
    command = [sys.executable, "stages/tune_anchor.py", ANCHOR, "--methods", method, "--anchor-search",
               "scale=0.1:1.0", "--n-trials", str(n_trials), "--out", str(folder / "dev"),
               "--storage", f"sqlite:///{folder / 'study.db'}"]
    start = time.perf_counter()
    done = subprocess.run(command, cwd=ROOT, capture_output=True, text=True)
    wall = time.perf_counter() - start
    if done.returncode != 0:
        raise SystemExit(f"study_cost: {' '.join(command)} failed:\n{(done.stdout + done.stderr)[-3000:]}")
    summary = json.loads((folder / "dev" / f"{ANCHOR}_{method}.json").read_text())
    return {"wall_s": round(wall, 2), "trials": summary["trials"], "trial_wall_s": summary.get("trial_wall_s"),
            "best_trial": summary["best"]["trial"], "best_dev": round(summary["best"]["dev_avg"], 6),
            "best_test": summary["test"]["avg"], "command": " ".join(command[1:])}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--n-trials", type=int, default=24, help="trials per study (the comparison's protocol: 24)")
    parser.add_argument("--out", default=str(ROOT / "results" / "bench.json"))
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="featcal-study-cost-") as tmp:
        studies = {m: run_study(m, args.n_trials, Path(tmp)) for m in METHODS}
    ratio = round(studies["featcal"]["wall_s"] / studies["surgery"]["wall_s"], 3)
    for method, s in studies.items():
        print(f"{method:8s} {args.n_trials} trials: {s['wall_s']:8.1f} s; best trial {s['best_trial']}: "
              f"dev {100 * s['best_dev']:.2f}, test {100 * s['best_test']:.2f}")
    print(f"featcal_study_over_surgery_study {ratio} ({verdict(ratio, GOAL)})")
    merge_json(Path(args.out), {
        "featcal_study_over_surgery_study": ratio, "study_best_dev": studies["featcal"]["best_dev"],
        "study_cost": {"command": f"python bench/study_cost.py --n-trials {args.n_trials}",
                       "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
                       "threads": torch.get_num_threads(), "anchor": ANCHOR, "studies": studies,
                       "goals": {"featcal_study_over_surgery_study": GOAL}}})


if __name__ == "__main__":
    main()
