"""FeatCal against the post-merge baselines, on the same calibration examples, scored on test.

A `Workbench` holds what every comparison shares (base, experts with their heads, input encoder, task
splits). Each method reads exactly the calibration batches it is given (train split, labels
unused); the scores read the test split once per model. `merge_context` supplies a data merge
method (RegMean, AdaMerging, SigMerge, ...) with what it declares it needs: train batches, dev
scoring, shared examples — never test data.
"""

from __future__ import annotations

import copy
import gc
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Mapping, Sequence

import torch
from torch import nn
from tqdm.auto import tqdm

from featcal.merging.in_memory import merge_models
from featcal.baselines.surgery import (
    ProbSurgeryConfig, SurgeryClassifier, SurgeryConfig, representations, train_probsurgery, train_surgery,
)
from featcal.calibration.config import FeatCalConfig
from featcal.calibration.walk import calibrate
from featcal.data.corrupt import corrupt_examples
from featcal.data.encoders import InputEncoder, load_encoder
from featcal.data.splits import Batches, TaskSplit, calibration_subset, encode_batches, read_split
from featcal.merging import MergeContext, data_options, needs_of, split_options
from featcal.merging.sigmerge import plot_admitted
from featcal.io.models import load_backbone, load_classifier, with_backbone
from featcal.profiling import Measurement, measure
from featcal.evaluation.scoring import score_backbone as score_with_heads
from featcal.evaluation.predictions import accuracy

CALIBRATION_SPLIT = "train"


@dataclass
class Workbench:
    base: nn.Module
    experts: dict[str, nn.Module]
    encoder: InputEncoder
    tasks_dir: str
    lengths: dict[str, int]
    seed: int = 0
    batch_size: int = 16
    _splits: dict[tuple[str, str], TaskSplit] = field(default_factory=dict)

    @property
    def tasks(self) -> list[str]:
        return list(self.experts)

    def split(self, task: str, split: str = "test") -> TaskSplit:
        if (task, split) not in self._splits:
            self._splits[task, split] = read_split(self.tasks_dir, task, split)
        return self._splits[task, split]


@dataclass
class TaskData:
    """What a calibration sample needs and no model: the tasks, their splits, the input encoder, lengths,
    seed and batch size (a `Workbench` has the same fields, and the models besides)."""

    tasks: list[str]
    encoder: InputEncoder
    tasks_dir: str
    lengths: dict[str, int]
    seed: int = 0
    batch_size: int = 16


def load_workbench(base_ref: str, expert_dirs: Mapping[str, str], tasks_dir: str, lengths: Mapping[str, int],
                   seed: int = 0, batch_size: int = 16) -> Workbench:
    experts = {t: load_classifier(d) for t, d in expert_dirs.items()}
    return Workbench(load_backbone(base_ref, like=next(iter(experts.values()), None)), experts, load_encoder(base_ref), tasks_dir, dict(lengths), seed, batch_size)


def calibration_examples(bench: Workbench | TaskData, n: int, corruption: tuple[str, float] | None = None) -> dict[str, list[str]]:
    """n train examples per task (seeded), optionally corrupted; labels are dropped here."""
    out = {}
    for task in bench.tasks:
        texts = calibration_subset(read_split(bench.tasks_dir, task, CALIBRATION_SPLIT), n, bench.seed).examples
        if corruption is not None:
            texts = corrupt_examples(texts, corruption[0], corruption[1], bench.seed)
        out[task] = texts
    return out


def to_batches(bench: Workbench | TaskData, texts: Mapping[str, list[str]]) -> Batches:
    return {
        t: encode_batches(bench.encoder, x, bench.lengths[t], bench.batch_size,
                          pad_to=bench.encoder.width(x, bench.lengths[t]))
        for t, x in texts.items()
    }


def merge(bench: Workbench, method: str, options: Mapping | None = None, context: MergeContext | None = None) -> nn.Module:
    return merge_models(bench.base, bench.experts, method, options, context)


def merge_context(bench: Workbench | TaskData, method: str, data: Mapping[str, int] | None = None,
                  options: Mapping[str, Any] | None = None) -> MergeContext:
    """The data `method` with `options` needs (`featcal.merging.needs_of`), from the workbench
    (`data`: how much of it, e.g. {"examples_per_task": 256}; defaults from `featcal.merging.NEEDS`).
    Train batches are a seeded sample of the train split, labels dropped; dev scores read the dev
    split; nothing reads test. Train batches and shared examples need no model (`TaskData` is
    enough); dev scores do."""
    needs = needs_of(method, options)
    data = {**data_options(method, options), **dict(data or {})}
    context = MergeContext()
    if "activations" in needs:
        context.batches = to_batches(bench, calibration_examples(bench, int(data["examples_per_task"])))
    if "dev_scores" in needs:
        context.score_dev = lambda backbone: score_backbone(bench, backbone, split="dev")
        context.expert_dev = score_experts(bench, split="dev")
    if "shared_examples" in needs:
        texts = calibration_examples(bench, int(data["shared_examples_per_task"]))
        shared = [text for task in bench.tasks for text in texts[task]]
        context.shared_batches = encode_batches(bench.encoder, shared, max(bench.lengths.values()), bench.batch_size)
    return context


@torch.no_grad()
def score_backbone(bench: Workbench, backbone: nn.Module, split: str = "test") -> dict[str, float]:
    """Accuracy per task on `split`: the backbone under each task's own head."""
    heads = {t: _fresh_copy(expert) for t, expert in bench.experts.items()}
    return score_with_heads(backbone, heads, bench.encoder, {t: bench.split(t, split) for t in heads}, bench.lengths)


@torch.no_grad()
def score_surgery(bench: Workbench, backbone: nn.Module, modules: Mapping[str, nn.Module]) -> dict[str, float]:
    """Test accuracy of the deployed form: merged backbone + per-task module + head."""
    out = {}
    for task, expert in bench.experts.items():
        model = SurgeryClassifier(with_backbone(_fresh_copy(expert), backbone.state_dict()), modules[task]).eval()
        out[task] = accuracy(model, bench.encoder, bench.split(task), bench.lengths[task])
    return out


def score_experts(bench: Workbench, split: str = "test") -> dict[str, float]:
    return {t: accuracy(m, bench.encoder, bench.split(t, split), bench.lengths[t]) for t, m in bench.experts.items()}


def run_featcal(bench: Workbench, merged: nn.Module, batches: Batches, config: FeatCalConfig) -> tuple[nn.Module, Measurement]:
    with measure() as cost:
        result = calibrate(merged, bench.base, bench.experts, batches, config, progress=False)
    return result.backbone, cost


def run_surgery(bench: Workbench, merged: nn.Module, batches: Batches, kind: str,
                config: SurgeryConfig | ProbSurgeryConfig | None = None) -> tuple[dict[str, nn.Module], Measurement, Measurement]:
    """Train Surgery or ProbSurgery; returns the modules, the whole cost (features + training)
    and the training-only cost (features cached)."""
    trainer = {"surgery": train_surgery, "probsurgery": train_probsurgery}[kind]
    with measure() as total:
        # f_M as the deployed form reads it: the merged backbone under task t's head (CLIP: its projection)
        merged_feats = {t: representations(with_backbone(_fresh_copy(bench.experts[t]), merged.state_dict()), b)
                        for t, b in batches.items()}
        expert_feats = {t: representations(bench.experts[t], b) for t, b in batches.items()}
        with measure() as training:
            modules = trainer(merged_feats, expert_feats, config, split=CALIBRATION_SPLIT)
    return modules, total, training


def summarise(scores: Mapping[str, float], experts_avg: float, merged_avg: float) -> dict:
    avg = sum(scores.values()) / len(scores)
    gap = experts_avg - merged_avg
    return {"avg": round(avg, 4), "gap_closed": round((avg - merged_avg) / gap, 4) if abs(gap) > 1e-12 else None,
            **{t: round(v, 4) for t, v in scores.items()}}


def calibrations(bench: Workbench, merged: nn.Module, batches: Batches, featcal_config: FeatCalConfig,
                 surgery: SurgeryConfig, probsurgery: ProbSurgeryConfig) -> dict[str, dict]:
    """Scores and costs of FeatCal, Surgery and ProbSurgery on one merged backbone, same batches."""
    rows = {}
    calibrated, cost = run_featcal(bench, merged, batches, featcal_config)
    rows["featcal"] = {"scores": score_backbone(bench, calibrated), "cost": cost.as_dict()}
    del calibrated
    for kind, config in (("surgery", surgery), ("probsurgery", probsurgery)):
        modules, total, training = run_surgery(bench, merged, batches, kind, config)
        rows[kind] = {"scores": score_surgery(bench, merged, modules), "cost": total.as_dict(),
                      "training_only_cost": training.as_dict()}
    gc.collect()
    return rows


def merge_anchor(bench: Workbench, anchor: str, options: Mapping[str, Any]) -> tuple[nn.Module, dict]:
    """The anchor merge and its row: options, data options, the merge's cost (a data method's
    train sample and context included) and the method's summary."""
    method_options, data = split_options(anchor, options)
    with measure() as cost:
        context = merge_context(bench, anchor, data, method_options)
        merged = merge(bench, anchor, method_options, context)
    row = {"options": method_options, "merge_cost": cost.as_dict()}
    if data:
        row["data"] = data
    if "summary" in context.record:
        row["merge_summary"] = context.record["summary"]
    return merged, row


def residual_gap(scores: Mapping[str, float], experts: Mapping[str, float]) -> float:
    """Mean over tasks of expert accuracy − model accuracy (points)."""
    return round(100 * sum(experts[t] - scores[t] for t in experts) / len(experts), 2)


@dataclass
class DevChoice:
    """The candidate with the highest mean dev accuracy, its merge and record, and every candidate's score."""

    options: dict
    dev_avg: float
    merged: nn.Module
    record: dict
    grid: list[dict]


def choose_on_dev(bench: Workbench, method: str, candidates: Sequence[Mapping[str, Any]],
                  context: MergeContext | None = None) -> DevChoice:
    """Merge with each candidate's options and keep the best on the dev split (never test); ties go
    to the earlier candidate."""
    best, grid = None, []
    for options in tqdm(candidates, desc=f"{method} on dev", unit="setting"):
        merged = merge(bench, method, dict(options), context)
        dev = score_backbone(bench, merged, split="dev")
        dev_avg = sum(dev.values()) / len(dev)
        grid.append({**options, "dev_avg": round(dev_avg, 4)})
        if best is None or dev_avg > best.dev_avg:
            best = DevChoice(dict(options), dev_avg, merged, dict(context.record) if context else {}, grid)
    if best is None:
        raise ValueError(f"merge method {method!r}: no candidate options to choose from")
    return best


def sigmerge_table(bench: Workbench, anchors: Mapping[str, Mapping[str, Any]], grid: Sequence[Sequence[float]],
                   shared_examples_per_task: int, featcal_config: FeatCalConfig, experts: Mapping[str, float],
                   batches: Batches, plot_dir: str | os.PathLike) -> dict:
    """Per anchor: the anchor, SigMerge(anchor) with (c_min, c_max) chosen on dev from `grid`, and
    each + FeatCal; a plot of SigMerge's admitted coordinates per anchor in `plot_dir`."""
    out = {"experts_avg": round(sum(experts.values()) / len(experts), 4), "anchors": {}}
    context = merge_context(bench, "sigmerge", {"shared_examples_per_task": int(shared_examples_per_task)})
    for anchor, anchor_options in anchors.items():
        choice = choose_on_dev(bench, "sigmerge", [
            {"anchor": anchor, "anchor_options": anchor_options, "c_min": c_min, "c_max": c_max} for c_min, c_max in grid
        ], context)
        models = {"anchor": merge(bench, anchor, anchor_options), "sigmerge": choice.merged}
        rows = {}
        for label, backbone in list(models.items()):
            calibrated, cost = run_featcal(bench, backbone, batches, featcal_config)
            for name, model in ((label, backbone), (f"{label}+featcal", calibrated)):
                scores = score_backbone(bench, model)
                rows[name] = {"avg": round(sum(scores.values()) / len(scores), 4),
                              "residual_gap_points": residual_gap(scores, experts), "scores": scores}
            rows[f"{label}+featcal"]["featcal_wall_s"] = round(cost.wall_s, 2)
        out["anchors"][anchor] = {
            "chosen_on_dev": {"c_min": choice.options["c_min"], "c_max": choice.options["c_max"],
                              "dev_avg": round(choice.dev_avg, 4),
                              "grid": [{"c_min": g["c_min"], "c_max": g["c_max"], "dev_avg": g["dev_avg"]}
                                       for g in choice.grid]},
            "sigmerge_wall_s_over_anchor": choice.record["wall_s"], "admitted_total": choice.record["total_admitted"],
            "coords_total": choice.record["total_coords"], **rows,
        }
        plot_admitted(choice.record, Path(plot_dir) / f"{anchor}.png")
    return out


def _fresh_copy(model: nn.Module) -> nn.Module:
    return copy.deepcopy(model).eval()
