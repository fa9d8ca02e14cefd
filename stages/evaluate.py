"""DVC stage `evaluate`: assemble the calibrated model, score experts / merged / FeatCal on test."""

from __future__ import annotations

import glob
import json

import torch
from common import TIMING_DIR, enabled_tasks, get, load_params, max_length, read_json, setup_logging, timed
from safetensors.torch import load_file
from tqdm.auto import tqdm

from featcal.data import calibration_subset, read_split, tokenize_batches
from featcal.evaluate import drift_rows, gap_closed, layer_drift, summary
from featcal.families import family_for
from featcal.modeling import load_backbone, load_classifier, load_tokenizer, save_multitask, with_backbone, write_json
from featcal.plots import plot_drift
from featcal.train import accuracy


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
    tasks_dir = get(params, "tasks_dir")
    with timed("evaluate"):
        tokenizer = load_tokenizer("models/merged")
        merged = load_backbone("models/merged")
        layer_files = sorted(glob.glob("calib/layers/L*.safetensors"))
        calibrated = assemble(load_backbone("models/merged"), layer_files)
        experts = {t: load_classifier(f"experts/{t}") for t in tasks}
        save_multitask("models/featcal", calibrated, experts, tokenizer)

        scores = {"experts": {}, "merged": {}, "featcal": {}}
        for task in tqdm(tasks, desc="evaluate", unit="task"):
            test, length = read_split(tasks_dir, task, "test"), max_length(params, task)
            # the expert's test accuracy was measured by finetune@<task> on this same split
            scores["experts"][task] = read_json(f"results/experts/{task}.json")["test"]
            model = load_classifier(f"experts/{task}")
            for label, backbone in (("merged", merged), ("featcal", calibrated)):
                scores[label][task] = accuracy(with_backbone(model, backbone.state_dict()), tokenizer, test, length)
        metrics = {k: summary(v) for k, v in scores.items()}
        metrics["gap_closed"] = gap_closed(metrics["experts"]["avg"], metrics["merged"]["avg"], metrics["featcal"]["avg"])
        write_json("results/metrics.json", metrics)

        n = int(get(params, "evaluate.drift_examples_per_task"))
        seed = int(get(params, "seed"))
        batches = {t: tokenize_batches(tokenizer, calibration_subset(read_split(tasks_dir, t, "test"), n, seed).texts,
                                       max_length(params, t), 32) for t in tasks}
        family = family_for(merged)
        rows = drift_rows(layer_drift(family, experts, merged, batches), layer_drift(family, experts, calibrated, batches))
        write_json("results/drift.json", rows)
        plot_drift(rows, "results/plots/drift.png")
    timing = {f.split("/")[-1][:-5]: read_json(f) for f in sorted(glob.glob(f"{TIMING_DIR}/*.json"))}
    write_json("results/timing.json", timing)
    print(json.dumps(metrics, indent=2))


if __name__ == "__main__":
    main()
