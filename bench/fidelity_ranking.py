"""Benchmark (not a test): does a reduced-fidelity trial rank FeatCal's values like the whole sample?

Takes trials of the committed Task Arithmetic study (`results/dev_tuning/study.db`, every trial on all
calibration examples in float64: its dev scores are the reference ranking), recalibrates each on each
task's first `--examples` calibration examples (float32 products, as the cheap search's trials), with λ
scaled by N/n as `TuneProblem.calibrate` does and with λ as it is, scores dev, and prints the Spearman
rank correlation of each with the whole sample's dev scores and which trial each would pick. Needs
`make repro` and the anchor's merge under work/anchors (`stages/tune_anchor.py task_arithmetic`).
Figures: results/fidelity_ranking.json. Run: python bench/fidelity_ranking.py [--examples 32]
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import json
import shlex
import statistics
import sys
from pathlib import Path

import optuna
import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "stages"))
from common import get  # noqa: E402

from featcal.calibration.config import FeatCalConfig  # noqa: E402
from featcal.tuning import AnchorSearch, Range  # noqa: E402
from featcal.tuning.objective import config_with, ridge_scaled  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parent))
from trial_cost import STUDY, anchor_folder, anchor_params, anchor_problem, committed_trials  # noqa: E402


def ranks(values: list[float]) -> list[float]:
    order = sorted(range(len(values)), key=values.__getitem__)
    out = [0.0] * len(values)
    for rank, i in enumerate(order):
        out[i] = float(rank)
    return out


def spearman(a: list[float], b: list[float]) -> float:
    return statistics.correlation(ranks(a), ranks(b))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--examples", type=int, default=32, help="calibration examples per task of a cheap trial")
    parser.add_argument("--out", default="results/fidelity_ranking.json")
    args = parser.parse_args()
    optuna.logging.set_verbosity(optuna.logging.WARNING)
    folder = anchor_folder("work/anchors", "fidelity_ranking")
    params = anchor_params(folder)
    trials = sorted(committed_trials("results/dev_tuning/study.db"), key=lambda t: -t.value)   # stable: ties by number
    picked = trials[:5] + trials[5::4][:5]   # the five best and five spread over the rest
    problem = anchor_problem(params, folder)
    base = dataclasses.replace(FeatCalConfig.from_mapping(get(params, "featcal")), product_dtype="float32")
    anchor = AnchorSearch("task_arithmetic", dict(get(params, "merge.options")), {"scale": Range(0.1, 1.0)})
    whole = int(get(params, "calibration.examples_per_task"))
    rows = []
    for trial in picked:
        merged = problem.merged_with(anchor, anchor.options_of(trial.params))
        config = config_with(base, {k: v for k, v in trial.params.items() if not k.startswith(AnchorSearch.PREFIX)})
        row = {"trial": trial.number, "dev_all_examples": round(trial.value, 6), "ridge": trial.params["ridge"]}
        for name, values in (("scaled", config), ("unscaled", ridge_scaled(config, args.examples / whole))):
            backbone = problem.calibrate(values, merged=merged, examples_per_task=args.examples)   # λ·N/n inside
            row[f"dev_{name}"] = round(statistics.fmean(problem.score(backbone).values()), 6)
        rows.append(row)
        print(row, flush=True)
    full = [r["dev_all_examples"] for r in rows]
    summary = {}
    for name in ("scaled", "unscaled"):
        cheap = [r[f"dev_{name}"] for r in rows]
        pick = max(rows, key=lambda r: r[f"dev_{name}"])
        summary[name] = {"spearman": round(spearman(cheap, full), 3), "picks_trial": pick["trial"],
                         "its_dev_all_examples": pick["dev_all_examples"]}
        print(f"λ {name}: Spearman with the whole sample's dev {summary[name]['spearman']}; picks trial "
              f"{pick['trial']} (dev {100 * pick['dev_all_examples']:.2f} on every example)")
    Path(args.out).write_text(json.dumps({
        "command": shlex.join(["python", *sys.argv]),
        "date": datetime.datetime.now().astimezone().isoformat(timespec="seconds"),
        "threads": torch.get_num_threads(), "study": STUDY, "examples_per_task": args.examples,
        "whole_sample": whole, "trials": rows, **summary}, indent=1) + "\n")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
