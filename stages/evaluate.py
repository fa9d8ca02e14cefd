"""DVC stage `evaluate`: assemble the calibrated model, score it on test, measure its drift.

Only the calibrated model is scored here; the merged model's scores and drift come from
`evaluate-merged` and the experts' from `finetune@<task>`, so an α experiment re-runs only this.
A causal LM is never whole in memory: its calibrated folder is copied tensor group by tensor group
and it is scored one decoder block at a time.
"""

from __future__ import annotations

import argparse
import glob
import json
from pathlib import Path

from common import TIMING_DIR, enabled_tasks, load_params, read_json, setup_logging, timed
from evaluate_merged import evaluate_backbone, evaluate_streamed, expert_folders, is_language_model

from featcal.calibration.calibrate import LayerDrift
from featcal.evaluation.scoring import drift_rows, gap_closed, summary
from featcal.io.checkpoints import CheckpointReader, load_head, save_multitask_from
from featcal.data.encoders import load_encoder
from featcal.io.models import load_backbone, save_multitask, with_parameters_from, write_json
from featcal.evaluation.plots import plot_drift


def own_timings(params: dict, tasks: list[str], layers: list[str]) -> dict:
    """results/timing/*.json of this project's stages only: its tasks' fine-tunes, its calibrated
    layers, tune where tuned values are used, and the single stages (timing files of another
    project's stages, e.g. the demo's committed ones in a project that brings its own tasks, are left out)."""
    wanted = {f"finetune@{t}" for t in tasks} | {f"calibrate-layer@{k}" for k in layers}
    if (params.get("featcal") or {}).get("use_tuned"):
        wanted.add("tune")
    out = {}
    for path in sorted(glob.glob(f"{TIMING_DIR}/*.json")):
        stage = Path(path).stem
        if stage in wanted or ("@" not in stage and stage != "tune"):
            out[stage] = read_json(path)
    return out


def write_and_score(args, heads: dict, params: dict, layer_files: list[str]) -> tuple[dict, list]:
    """The calibrated backbone in memory: the merged one with the layers put in; written, then scored."""
    try:
        calibrated = with_parameters_from(load_backbone(args.merged), layer_files)
    except ValueError as err:
        raise SystemExit(str(err)) from None
    save_multitask(args.out_model, calibrated, heads, load_encoder(args.merged))
    return evaluate_backbone(calibrated, heads, params, args.features, args.merged)


def write_and_score_streamed(args, expert_dirs: dict, params: dict, layer_files: list[str]) -> tuple[dict, list]:
    """A causal LM's: the merged folder's tensors with the layers in place, copied group by group,
    then scored one block at a time; each task's head is read from its expert folder while it is used."""
    try:
        calibrated = CheckpointReader(args.merged).with_tensors_from(layer_files)
    except ValueError as err:
        raise SystemExit(str(err)) from None
    save_multitask_from(args.out_model, calibrated, expert_dirs, load_encoder(args.merged))
    return evaluate_streamed(args.merged, expert_dirs, params, args.features, layer_files)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--merged", required=True, help="the merged multi-task model folder")
    parser.add_argument("--layers", required=True, help="folder of the calibrated layers (L*.safetensors)")
    parser.add_argument("--experts", required=True, help="folder of the experts, one sub-folder per task")
    parser.add_argument("--features", required=True, help="the experts' cached test states")
    parser.add_argument("--merged-scores", required=True, help="evaluate-merged's JSON (scores and drift)")
    parser.add_argument("--expert-scores", required=True, help="folder of finetune's <task>.json scores")
    parser.add_argument("--out-model", required=True, help="where the calibrated multi-task model is written")
    parser.add_argument("--metrics", required=True, help="where the metrics JSON is written")
    parser.add_argument("--drift", required=True, help="where the per-layer drift JSON is written")
    parser.add_argument("--drift-plot", required=True, help="where the drift plot (PNG) is written")
    args = parser.parse_args()
    setup_logging()
    params = load_params()
    tasks = enabled_tasks(params)
    with timed("evaluate"):
        layer_files = sorted(glob.glob(f"{args.layers}/L*.safetensors"))
        expert_dirs = expert_folders(args.experts, tasks)
        language_model = is_language_model(expert_dirs)
        if language_model:   # one decoder block, and one task's head, in memory at a time
            scores, drift = write_and_score_streamed(args, expert_dirs, params, layer_files)
        else:
            heads = {t: load_head(d) for t, d in expert_dirs.items()}
            scores, drift = write_and_score(args, heads, params, layer_files)
        merged = read_json(args.merged_scores)
        metrics = {
            # the expert's test accuracy was measured by finetune@<task> on this same split
            "experts": summary({t: read_json(Path(args.expert_scores) / f"{t}.json")["test"] for t in tasks}),
            "merged": merged["test"],
            "featcal": summary(scores),
        }
        metrics["gap_closed"] = gap_closed(metrics["experts"]["avg"], metrics["merged"]["avg"], metrics["featcal"]["avg"])
        if language_model:
            # language-model tasks: the scores are mean token NLLs; the gap closed on each expert's own task
            metrics["score"] = "nll"
            metrics["gap_closed_per_task"] = {t: gap_closed(metrics["experts"][t], metrics["merged"][t],
                                                            metrics["featcal"][t]) for t in tasks}
        write_json(args.metrics, metrics)
        rows = drift_rows([LayerDrift(**d) for d in merged["drift"]], drift)
        write_json(args.drift, rows)
        plot_drift(rows, args.drift_plot)
    write_json(TIMING_DIR.parent / "timing.json", own_timings(params, tasks, [Path(f).stem for f in layer_files]))
    print(json.dumps(metrics, indent=2))


if __name__ == "__main__":
    main()
