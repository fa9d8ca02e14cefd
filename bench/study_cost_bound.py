"""Benchmark arithmetic (not a test; reads files, runs nothing): how fast FeatCal's calibration would have to
be for its study to cost no more than Surgery's, and what the arithmetic floor would give.

Reads a pair of studies kept by `python bench/study_cost.py --keep DIR` (DIR/featcal/study.db,
DIR/surgery/study.db) and their walls from results/bench.json's `study_cost` (the run that kept them:
its picks must match the kept studies'). A FeatCal study's seconds split into its calibrations (the trials'
recorded `calibrate_s`; the rung's walks: each rung entry less the trials' mean merge and dev scoring) and
everything else (setup, merges, dev scorings). The calibrations are then scaled from the measured cost (×
the bare forwards: `calibration_cost`'s float32 ratio for the trials, float64's for the rung) to the
arithmetic floor (`--floor`: ~2.2× the bare forwards, the issue's figure: three forward passes where the bare
forwards are two, plus flop-bound moments). Run:

    python bench/study_cost_bound.py results/study_cost_exact_crosses [--floor 2.2] [--trial-ratio 3.33]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

import optuna

from featcal.tuning.study import RERANK, complete_trials


def kept_study(path: Path) -> optuna.Study:
    summaries = optuna.get_all_study_summaries(f"sqlite:///{path}")
    if len(summaries) != 1:
        raise SystemExit(f"{path}: expected one study, found {len(summaries)}")
    return optuna.load_study(study_name=summaries[0].study_name, storage=f"sqlite:///{path}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("kept", type=Path, help="a folder `bench/study_cost.py --keep` wrote")
    parser.add_argument("--bench", type=Path, default=Path("results/bench.json"))
    parser.add_argument("--floor", type=float, default=2.2, help="a calibration's floor, × the bare forwards")
    parser.add_argument("--trial-ratio", type=float, help="the trials' calibration ÷ the bare forwards at their size "
                        "(default: calibration_cost's, on every example)")
    args = parser.parse_args()
    optuna.logging.set_verbosity(optuna.logging.WARNING)
    bench = json.loads(args.bench.read_text())
    measured = bench["study_cost"]["studies"]
    cost = bench["calibration_cost"]
    featcal, surgery = (kept_study(args.kept / m / "study.db") for m in ("featcal", "surgery"))
    for name, study in (("featcal", featcal), ("surgery", surgery)):
        chosen = study.user_attrs.get(RERANK, {}).get("chosen")
        if chosen != measured[name]["best_trial"]:
            raise SystemExit(f"{args.kept / name}: chose trial {chosen}, {args.bench}'s study_cost "
                             f"{measured[name]['best_trial']}: not the run that kept these studies")
    trials = complete_trials(featcal)
    calibrate = sum(t.user_attrs["calibrate_s"] for t in trials)
    per_other = statistics.fmean(t.user_attrs["merge_s"] + t.user_attrs["score_s"] for t in trials)
    rung = featcal.user_attrs[RERANK]["wall_s"]
    rung_walks = sum(rung.values()) - per_other * len(rung)
    walls = {m: measured[m]["wall_s"] for m in ("featcal", "surgery")}
    rest = walls["featcal"] - calibrate - rung_walks
    allowed = walls["surgery"] - rest
    trial_ratio = args.trial_ratio or cost["float32_products_over_forwards"] if measured["featcal"]["trial_product_dtype"] == "float32" \
        else args.trial_ratio or cost["featcal_over_forwards"]
    at_floor = calibrate * args.floor / trial_ratio + rung_walks * args.floor / bench["featcal_over_forwards"]
    print(f"FeatCal study {walls['featcal']:.1f} s: trials' calibrations {calibrate:.1f} s, the rung's {len(rung)} walks "
          f"~{rung_walks:.1f} s (its {sum(rung.values()):.1f} s less {per_other:.2f} s merge + dev scoring each), "
          f"the rest {rest:.1f} s; Surgery study {walls['surgery']:.1f} s")
    print(f"without any calibration: {rest:.1f} s = {rest / walls['surgery']:.3f}x Surgery's")
    print(f"for <= 1.0 the calibrations may take {allowed:.1f} s of their {calibrate + rung_walks:.1f} s: "
          f"{(calibrate + rung_walks) / allowed:.2f}x faster")
    print(f"at the floor ({args.floor}x the bare forwards; now {trial_ratio}x the trials', "
          f"{bench['featcal_over_forwards']}x the rung's): {at_floor:.1f} s of calibration, a study of "
          f"{rest + at_floor:.1f} s = {(rest + at_floor) / walls['surgery']:.3f}x Surgery's")


if __name__ == "__main__":
    sys.exit(main())
