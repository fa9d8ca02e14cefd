"""Stages `compare`, `sample-efficiency`, `corruption` (compare/dvc.yaml, outside the default run).

compare:            per anchor merge (every registered anchor in compare.anchors: data-free ones, and
                    RegMean, RegMean++, AdaMerging on their own train sample) — merge alone,
                    + Surgery, + ProbSurgery, + FeatCal; accuracy, wall time and peak RSS of each.
sample-efficiency:  the three calibrations at several calibration-set sizes (Task Arithmetic anchor).
corruption:         the three calibrations on corrupted calibration texts, scored on clean test data.
All methods read the same train-split calibration examples; everything is scored on test. Each
method runs at its paper's defaults with compare.<method>'s overrides: FeatCal's α, ρ, λ and pooler
are the spec's, not the default pipeline's dev-tuned `featcal` values (its run settings, e.g.
product_dtype and device, do come from `featcal`).
"""

from __future__ import annotations

import argparse
from pathlib import Path

from common import enabled_tasks, get, load_params, max_length, setup_logging
from tqdm.auto import tqdm

from featcal.evaluation import compare as cmp
from featcal.baselines.surgery import ProbSurgeryConfig, SurgeryConfig
from featcal.calibration.config import HYPER_KEYS, FeatCalConfig
from featcal.io.models import write_json
from featcal.evaluation.plots import plot_compare, plot_corruption, plot_lines


SPEC_KEYS = (*HYPER_KEYS, "calibrate_pooler", "layer_overrides")   # FeatCal's method values, as the spec sets them


def compare_featcal(featcal: dict, overrides: dict) -> FeatCalConfig:
    """FeatCal for the comparison: `featcal`'s run settings, the spec's method values (one α, ρ, λ for
    every block, the pooler as merged) and then `overrides` (compare.featcal)."""
    spec = FeatCalConfig()
    return FeatCalConfig.from_mapping({**featcal, **{k: getattr(spec, k) for k in SPEC_KEYS}, **overrides})


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("what", choices=["compare", "sample-efficiency", "corruption", "sigmerge"])
    parser.add_argument("--experts", required=True, help="folder of the experts, one sub-folder per task")
    parser.add_argument("--out", required=True, help="where the results (JSON) are written")
    parser.add_argument("--detail", help="sample-efficiency: where the per-size detail (JSON) is written")
    parser.add_argument("--plots", required=True,
                        help="compare: the grouped bar chart's PNG; sample-efficiency: the curve's PNG; "
                             "corruption: the bar chart's PNG; sigmerge: the folder of heat maps")
    args = parser.parse_args()
    what = args.what
    setup_logging()
    params = load_params()
    tasks = enabled_tasks(params)
    settings = get(params, "compare")
    bench = cmp.load_workbench(get(params, "model.base"), {t: str(Path(args.experts) / t) for t in tasks},
                               get(params, "tasks_dir"), {t: max_length(params, t) for t in tasks},
                               int(get(params, "seed")), int(get(params, "calibration.batch_size")))
    featcal_config = compare_featcal(get(params, "featcal"), settings.get("featcal", {}))
    surgery = SurgeryConfig(progress=False, **settings.get("surgery", {}))
    probsurgery = ProbSurgeryConfig(progress=False, **settings.get("probsurgery", {}))
    experts = cmp.score_experts(bench)
    experts_avg = sum(experts.values()) / len(experts)
    n = int(settings["examples_per_task"])

    def rows_for(merged, batches, merged_avg):
        rows = cmp.calibrations(bench, merged, batches, featcal_config, surgery, probsurgery)
        return {m: {**r, "scores": cmp.summarise(r["scores"], experts_avg, merged_avg)} for m, r in rows.items()}

    if what == "sigmerge":
        sig = settings["sigmerge"]
        write_json(args.out, cmp.sigmerge_table(
            bench, {a: settings["anchors"][a] for a in sig["anchors"]}, sig["grid"], int(sig["shared_examples_per_task"]),
            featcal_config, experts, cmp.to_batches(bench, cmp.calibration_examples(bench, n)), args.plots))
        return

    if what == "compare":
        batches = cmp.to_batches(bench, cmp.calibration_examples(bench, n))
        out = {"experts": cmp.summarise(experts, experts_avg, experts_avg), "examples_per_task": n, "anchors": {}}
        for anchor, options in tqdm(settings["anchors"].items(), desc="anchors", unit="merge"):
            merged, row = cmp.merge_anchor(bench, anchor, options)
            merged_scores = cmp.score_backbone(bench, merged)
            merged_avg = sum(merged_scores.values()) / len(merged_scores)
            out["anchors"][anchor] = {**row, "merged": cmp.summarise(merged_scores, experts_avg, merged_avg),
                                      **rows_for(merged, batches, merged_avg)}
        write_json(args.out, out)
        plot_compare(out, args.plots)
        return

    anchor, options = "task_arithmetic", settings["anchors"]["task_arithmetic"]
    merged = cmp.merge(bench, anchor, options)
    merged_scores = cmp.score_backbone(bench, merged)
    merged_avg = sum(merged_scores.values()) / len(merged_scores)
    base = {"anchor": anchor, "experts_avg": round(experts_avg, 4), "merged_avg": round(merged_avg, 4)}
    if what == "sample-efficiency":
        out, curve = {**base, "sizes": {}}, []
        for size in tqdm(settings["sample_sizes"], desc="sizes", unit="size"):
            texts = cmp.calibration_examples(bench, int(size))
            short = {t: len(x) for t, x in texts.items() if len(x) < int(size)}
            rows = rows_for(merged, cmp.to_batches(bench, texts), merged_avg)
            out["sizes"][str(size)] = {"fewer_examples": short, **rows}
            curve.append({"examples_per_task": int(size), **{m: r["scores"]["avg"] for m, r in rows.items()}})
        write_json(args.out, curve)
        if args.detail:
            write_json(args.detail, out)
        plot_lines(curve, "examples_per_task", ["featcal", "surgery", "probsurgery"], args.plots,
                   "average test accuracy", log_x=True, hlines={"experts": experts_avg, f"merge ({anchor})": merged_avg})
        return

    rate = float(settings["corruption_rate"])
    out = {**base, "rate": rate, "examples_per_task": n, "clean": {}, "corrupted": {}}
    out["clean"] = rows_for(merged, cmp.to_batches(bench, cmp.calibration_examples(bench, n)), merged_avg)
    for kind in tqdm(settings["corruptions"], desc="corruptions", unit="kind"):
        out["corrupted"][kind] = rows_for(merged, cmp.to_batches(bench, cmp.calibration_examples(bench, n, (kind, rate))),
                                          merged_avg)
    write_json(args.out, out)
    plot_corruption(out, args.plots)


if __name__ == "__main__":
    main()
