"""DVC stage `evaluate`: assemble the calibrated model, score it on test, measure its drift.

Only the calibrated model is scored here; the merged model's scores and drift come from
`evaluate-merged` and the experts' from `finetune@<task>`, so an α experiment re-runs only this.
"""

from __future__ import annotations

import glob
import json

import torch
from common import TIMING_DIR, enabled_tasks, load_params, read_json, setup_logging, timed
from evaluate_merged import evaluate_backbone
from safetensors.torch import load_file

from featcal.calibrate import LayerDrift
from featcal.evaluate import drift_rows, gap_closed, summary
from featcal.lazy import load_head
from featcal.modeling import load_backbone, load_tokenizer, save_multitask, write_json
from featcal.plots import plot_drift


def assemble(merged: torch.nn.Module, layer_files: list[str]) -> torch.nn.Module:
    """The merged backbone with every calibrated layer's parameters put in place."""
    state = merged.state_dict()
    for path in layer_files:
        for name, value in load_file(path).items():
            if name not in state:
                raise SystemExit(f"{path}: parameter {name!r} is not in the merged model")
            state[name] = value
    merged.load_state_dict(state)
    return merged


def main() -> None:
    setup_logging()
    params = load_params()
    tasks = enabled_tasks(params)
    with timed("evaluate"):
        calibrated = assemble(load_backbone("models/merged"), sorted(glob.glob("calib/layers/L*.safetensors")))
        heads = {t: load_head(f"experts/{t}") for t in tasks}
        save_multitask("models/featcal", calibrated, heads, load_tokenizer("models/merged"))
        scores, drift = evaluate_backbone(calibrated, heads, params, "features/test")
        merged = read_json("results/merged.json")
        metrics = {
            # the expert's test accuracy was measured by finetune@<task> on this same split
            "experts": summary({t: read_json(f"results/experts/{t}.json")["test"] for t in tasks}),
            "merged": merged["test"],
            "featcal": summary(scores),
        }
        metrics["gap_closed"] = gap_closed(metrics["experts"]["avg"], metrics["merged"]["avg"], metrics["featcal"]["avg"])
        write_json("results/metrics.json", metrics)
        rows = drift_rows([LayerDrift(**d) for d in merged["drift"]], drift)
        write_json("results/drift.json", rows)
        plot_drift(rows, "results/plots/drift.png")
    timing = {f.split("/")[-1][:-5]: read_json(f) for f in sorted(glob.glob(f"{TIMING_DIR}/*.json"))}
    write_json("results/timing.json", timing)
    print(json.dumps(metrics, indent=2))


if __name__ == "__main__":
    main()
