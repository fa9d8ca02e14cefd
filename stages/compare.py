"""Stages `compare`, `sample-efficiency`, `corruption` (compare/dvc.yaml, outside the default run).

compare:            per anchor merge (every registered anchor in compare.anchors: data-free ones, and
                    RegMean, RegMean++, AdaMerging on their own train sample) — merge alone,
                    + Surgery, + ProbSurgery, + FeatCal; accuracy, wall time and peak RSS of each.
sample-efficiency:  the three calibrations at several calibration-set sizes (Task Arithmetic anchor).
corruption:         the three calibrations on corrupted calibration texts, scored on clean test data.
All methods read the same train-split calibration examples; everything is scored on test.
"""

from __future__ import annotations

import argparse
import gc

from common import enabled_tasks, get, load_params, max_length, setup_logging
from torch import nn
from tqdm.auto import tqdm

from featcal import compare as cmp
from featcal.baselines import ProbSurgeryConfig, SurgeryConfig
from featcal.calibrate import FeatCalConfig
from featcal.merging import split_options
from featcal.merging.sigmerge import plot_admitted
from featcal.modeling import write_json
from featcal.plots import plot_lines
from featcal.profiling import measure


def methods(bench, merged, batches, settings, featcal_config):
    """Scores and costs of FeatCal, Surgery and ProbSurgery on one merged backbone."""
    rows = {}
    calibrated, cost = cmp.run_featcal(bench, merged, batches, featcal_config)
    rows["featcal"] = {"scores": cmp.score_backbone(bench, calibrated), "cost": cost.as_dict()}
    del calibrated
    for kind, config in (("surgery", SurgeryConfig(progress=False, **settings.get("surgery", {}))),
                         ("probsurgery", ProbSurgeryConfig(progress=False, **settings.get("probsurgery", {})))):
        modules, total, training = cmp.run_surgery(bench, merged, batches, kind, config)
        rows[kind] = {"scores": cmp.score_surgery(bench, merged, modules), "cost": total.as_dict(),
                      "training_only_cost": training.as_dict()}
    gc.collect()
    return rows


def merge_anchor(bench: cmp.Workbench, anchor: str, options: dict) -> tuple[nn.Module, dict]:
    """The anchor merge and its row: options, data options, the merge's cost (a data method's
    train sample and context included) and the method's summary."""
    method_options, data = split_options(anchor, options)
    with measure() as cost:
        context = cmp.merge_context(bench, anchor, data)
        merged = cmp.merge(bench, anchor, method_options, context)
    row = {"options": method_options, "merge_cost": cost.as_dict()}
    if data:
        row["data"] = data
    if "summary" in context.record:
        row["merge_summary"] = context.record["summary"]
    return merged, row


def residual_gap(scores, experts) -> float:
    """Mean over tasks of expert accuracy − model accuracy (points)."""
    return round(100 * sum(experts[t] - scores[t] for t in experts) / len(experts), 2)


def sigmerge_table(bench, settings, featcal_config, experts, n):
    """Per anchor: anchor, SigMerge(anchor) with (c_min, c_max) chosen on dev, and each + FeatCal."""
    sig = settings["sigmerge"]
    batches = cmp.to_batches(bench, cmp.calibration_texts(bench, n))
    out = {"experts_avg": round(sum(experts.values()) / len(experts), 4), "anchors": {}}
    context = cmp.merge_context(bench, "sigmerge", {"shared_examples_per_task": int(sig["shared_examples_per_task"])})
    for anchor in sig["anchors"]:
        anchor_options = settings["anchors"][anchor]
        candidates = []
        for c_min, c_max in tqdm(sig["grid"], desc=f"sigmerge({anchor}) grid", unit="setting"):
            merged = cmp.merge(bench, "sigmerge", {"anchor": anchor, "anchor_options": anchor_options,
                                                  "c_min": c_min, "c_max": c_max}, context)
            record = dict(context.record)
            dev = cmp.score_backbone(bench, merged, split="dev")
            candidates.append((sum(dev.values()) / len(dev), c_min, c_max, merged, record))
        dev_avg, c_min, c_max, sig_merged, record = max(candidates, key=lambda c: c[0])
        models = {"anchor": cmp.merge(bench, anchor, anchor_options), "sigmerge": sig_merged}
        rows = {}
        for label, backbone in list(models.items()):
            calibrated, cost = cmp.run_featcal(bench, backbone, batches, featcal_config)
            for name, model in ((label, backbone), (f"{label}+featcal", calibrated)):
                scores = cmp.score_backbone(bench, model)
                rows[name] = {"avg": round(sum(scores.values()) / len(scores), 4),
                              "residual_gap_points": residual_gap(scores, experts), "scores": scores}
            rows[f"{label}+featcal"]["featcal_wall_s"] = round(cost.wall_s, 2)
        out["anchors"][anchor] = {
            "chosen_on_dev": {"c_min": c_min, "c_max": c_max, "dev_avg": round(dev_avg, 4),
                              "grid": [{"c_min": c[1], "c_max": c[2], "dev_avg": round(c[0], 4)} for c in candidates]},
            "sigmerge_wall_s_over_anchor": record["wall_s"], "admitted_total": record["total_admitted"],
            "coords_total": record["total_coords"], **rows,
        }
        plot_admitted(record, f"results/plots/sigmerge/{anchor}.png")
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("what", choices=["compare", "sample-efficiency", "corruption", "sigmerge"])
    what = parser.parse_args().what
    setup_logging()
    params = load_params()
    tasks = enabled_tasks(params)
    settings = get(params, "compare")
    bench = cmp.load_workbench(get(params, "model.base"), {t: f"experts/{t}" for t in tasks}, get(params, "tasks_dir"),
                               {t: max_length(params, t) for t in tasks}, int(get(params, "seed")),
                               int(get(params, "calibration.batch_size")))
    featcal_config = FeatCalConfig.from_mapping(get(params, "featcal"))
    experts = cmp.score_experts(bench)
    experts_avg = sum(experts.values()) / len(experts)
    n = int(settings["examples_per_task"])

    def summarise(rows, merged_avg):
        return {m: {**r, "scores": cmp.summarise(r["scores"], experts_avg, merged_avg)} for m, r in rows.items()}

    if what == "sigmerge":
        write_json("results/sigmerge.json", sigmerge_table(bench, settings, featcal_config, experts, n))
        return

    if what == "compare":
        batches = cmp.to_batches(bench, cmp.calibration_texts(bench, n))
        out = {"experts": cmp.summarise(experts, experts_avg, experts_avg), "examples_per_task": n, "anchors": {}}
        for anchor, options in tqdm(settings["anchors"].items(), desc="anchors", unit="merge"):
            merged, row = merge_anchor(bench, anchor, options)
            merged_scores = cmp.score_backbone(bench, merged)
            merged_avg = sum(merged_scores.values()) / len(merged_scores)
            out["anchors"][anchor] = {**row, "merged": cmp.summarise(merged_scores, experts_avg, merged_avg),
                                      **summarise(methods(bench, merged, batches, settings, featcal_config), merged_avg)}
        write_json("results/compare.json", out)
        return

    anchor, options = "task_arithmetic", settings["anchors"]["task_arithmetic"]
    merged = cmp.merge(bench, anchor, options)
    merged_scores = cmp.score_backbone(bench, merged)
    merged_avg = sum(merged_scores.values()) / len(merged_scores)
    base = {"anchor": anchor, "experts_avg": round(experts_avg, 4), "merged_avg": round(merged_avg, 4)}
    if what == "sample-efficiency":
        out, curve = {**base, "sizes": {}}, []
        for size in tqdm(settings["sample_sizes"], desc="sizes", unit="size"):
            texts = cmp.calibration_texts(bench, int(size))
            short = {t: len(x) for t, x in texts.items() if len(x) < int(size)}
            rows = summarise(methods(bench, merged, cmp.to_batches(bench, texts), settings, featcal_config), merged_avg)
            out["sizes"][str(size)] = {"fewer_examples": short, **rows}
            curve.append({"examples_per_task": int(size), **{m: r["scores"]["avg"] for m, r in rows.items()}})
        write_json("results/sample_efficiency.json", curve)
        write_json("results/sample_efficiency_detail.json", out)
        plot_lines(curve, "examples_per_task", ["featcal", "surgery", "probsurgery"],
                   "results/plots/sample_efficiency.png", "average test accuracy", log_x=True,
                   hlines={"experts": experts_avg, f"merge ({anchor})": merged_avg})
        return

    rate = float(settings["corruption_rate"])
    out = {**base, "rate": rate, "examples_per_task": n, "clean": {}, "corrupted": {}}
    out["clean"] = summarise(methods(bench, merged, cmp.to_batches(bench, cmp.calibration_texts(bench, n)),
                                     settings, featcal_config), merged_avg)
    for kind in tqdm(settings["corruptions"], desc="corruptions", unit="kind"):
        batches = cmp.to_batches(bench, cmp.calibration_texts(bench, n, (kind, rate)))
        out["corrupted"][kind] = summarise(methods(bench, merged, batches, settings, featcal_config), merged_avg)
    write_json("results/corruption.json", out)


if __name__ == "__main__":
    main()
