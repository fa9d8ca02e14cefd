"""Benchmark (not a test): is a cheaper search's pick worse than the reference search's, with an interval?

`bench/study_cost.py` compares a reduced-fidelity study's deployed dev score with the reference study's
as two numbers; both are means over ~1,300 dev examples, and the reference's is the best of 24 dev scores
(chosen on the very examples it is reported on), so a few tenths of a point say little by themselves.
This takes a study kept by `bench/study_cost.py --keep DIR` (DIR/featcal: its study.db and summary),
rebuilds its dev-best model as `stages/tune_anchor.py --rescore` does (every example, `featcal.product_dtype`),
writes that model's dev and test predictions and sets them against the reference's committed predictions
(results/predictions/full_search/task_arithmetic-anchor-featcal.parquet: the protocol's TA + FeatCal study
until 12-07, trials on every example in float64, study task_arithmetic-anchor-featcal in results/dev_tuning/study.db): the paired bootstrap difference (pick − reference) of the mean task
accuracy on dev and on test, 95 % intervals, the same resamples for both models (docs/uncertainty.md).
Figures go to --out (default results/bench.json, `pick_vs_reference`):

    python bench/study_cost.py --trial-examples 32 --trial-product-dtype float32 --no-reference --keep /tmp/kept
    python bench/pick_vs_reference.py /tmp/kept/featcal [--reference /tmp/kept/featcal_all_examples]
"""

from __future__ import annotations

import argparse
import datetime
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from alpha_rerun import merge_json  # noqa: E402  (it puts stages/ on the path)
from study_cost import run_tune_anchor  # noqa: E402

from featcal.evaluation.bootstrap import difference_interval, resample_indices, task_sizes  # noqa: E402
from featcal.evaluation.predictions import read_correctness  # noqa: E402

REFERENCE = Path("results/predictions/full_search/task_arithmetic-anchor-featcal.parquet")


def rescored_predictions(kept: Path, folder: Path) -> Path:
    """The kept study's dev-best model rebuilt and scored (`tune_anchor.py --rescore`): its predictions file."""
    if not (kept / "study.db").exists():
        raise SystemExit(f"pick_vs_reference: no study.db in {kept} (bench/study_cost.py --keep DIR: DIR/<study>)")
    run_tune_anchor(["--rescore", "--methods", "featcal", "--out", str(kept), "--predictions", str(folder)],
                    "pick_vs_reference")
    files = [p for p in folder.glob("*.parquet") if p.stem.endswith("-featcal")]
    if len(files) != 1:
        raise SystemExit(f"pick_vs_reference: expected one <study>-featcal.parquet in {folder}, found {files}")
    return files[0]


def only_model(path: Path, split: str) -> dict:
    """The one model's task -> correctness in a predictions file (a study's file holds one)."""
    models = read_correctness([path], split)
    if len(models) != 1:
        raise SystemExit(f"pick_vs_reference: {path} holds {sorted(models)} on {split}, expected one model")
    return next(iter(models.values()))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("kept", type=Path, help="a FeatCal study kept by bench/study_cost.py --keep (DIR/featcal)")
    parser.add_argument("--reference", type=Path, default=REFERENCE,
                        help="the reference's predictions (.parquet), or a study kept the same way (e.g. "
                             "DIR/featcal_all_examples), rebuilt and scored like the pick")
    parser.add_argument("--resamples", type=int, default=4000)
    parser.add_argument("--out", default="results/bench.json")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="featcal-pick-") as tmp:
        pick_file = rescored_predictions(args.kept.resolve(), Path(tmp) / "pick")
        reference_file = args.reference if args.reference.suffix == ".parquet" else \
            rescored_predictions(args.reference.resolve(), Path(tmp) / "reference")
        result = {}
        for split in ("dev", "test"):
            pick, reference = only_model(pick_file, split), only_model(reference_file, split)
            indices = resample_indices(task_sizes({"pick": pick, "reference": reference}), args.resamples, seed=0)
            d = difference_interval(pick, reference, indices, names=("pick", "reference")).mean
            result[split] = {"pick_minus_reference_points": round(100 * d.estimate, 2),
                             "interval_95_points": [round(100 * d.low, 2), round(100 * d.high, 2)],
                             "significant": d.significant}
            print(f"{split}: pick - reference {100 * d.estimate:+.2f} points, 95 % interval "
                  f"[{100 * d.low:+.2f}, {100 * d.high:+.2f}] ({'significant' if d.significant else 'not significant'})")
    merge_json(Path(args.out), {"pick_vs_reference": {
        "command": "python bench/pick_vs_reference.py " + " ".join(sys.argv[1:]),
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "reference": str(args.reference),
        "resamples": args.resamples, **result}})
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
