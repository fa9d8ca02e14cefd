"""Measuring a merged or calibrated backbone: per-task accuracy and per-layer drift to the experts."""

from __future__ import annotations

from dataclasses import asdict
from typing import Callable, Mapping

import torch
from torch import Tensor, nn

from featcal.calibration.calibrate import block_drift, enter_streams, LayerDrift
from featcal.data.encoders import InputEncoder
from featcal.data.splits import TaskSplit
from featcal.families import Family
from featcal.families.base import run_streams
from featcal.io.checkpoints import with_backbone_assigned
from featcal.evaluation.language import split_nll
from featcal.evaluation.predictions import accuracy
from featcal.io.models import is_causal_lm
from featcal.calibration.walk import ModuleWeights, Streams, split_like

Batches = Mapping[str, list[Mapping[str, Tensor]]]
DRIFT_BATCH_SIZE = 32   # examples per batch when drift is measured on test examples


def _drift_by_layer(family: Family, candidate: nn.Module, batches: Batches,
                    drift_at: Callable[[int, Streams], LayerDrift]) -> list[LayerDrift]:
    """The candidate runs its own forward; after each block k its outputs are compared with the
    experts' (`drift_at(k, candidate streams)`)."""
    cand_bb = family.backbone(candidate).eval()
    cand = enter_streams(family, cand_bb, batches)
    out = []
    for index in range(len(family.blocks(cand_bb))):
        cand = run_streams(family, cand_bb, index, cand)
        out.append(drift_at(index, cand))
    return out


def drift_to_cache(family: Family, index: int, backbone: nn.Module, candidate: Streams,
                   expert_states: Callable[[int], Mapping[str, Tensor]]) -> LayerDrift:
    """Block `index`'s drift: the candidate's streams just out of it against the experts' cached
    states leaving it (`expert_states(index + 1)`). The expert states are compared, never run:
    resumed on the candidate's backbone, they keep the experts' hidden states and carried tensors
    (what `Family.block_output` reads)."""
    same = {t: backbone for t in candidate}
    experts = split_like(family, index + 1, expert_states(index + 1), candidate, same)
    return block_drift(family, index, backbone, same, candidate, experts)


@torch.no_grad()
def drift_to_states(
    family: Family, candidate: nn.Module, batches: Batches, expert_states: Callable[[int], Mapping[str, Tensor]]
) -> list[LayerDrift]:
    """Mean L2 distance and cosine similarity of the candidate's block outputs to the experts'
    (`expert_states(k)`: each task's expert states entering block k, e.g. a cache), layer by layer,
    over every real token of every example."""
    cand_bb = family.backbone(candidate).eval()
    return _drift_by_layer(family, candidate, batches,
                           lambda k, cand: drift_to_cache(family, k, cand_bb, cand, expert_states))


@torch.no_grad()
def layer_drift(family: Family, experts: Mapping[str, nn.Module], candidate: nn.Module, batches: Batches) -> list[LayerDrift]:
    """The same against the experts run in memory, each on its own task's batches (any family)."""
    cand_bb = family.backbone(candidate).eval()
    exp_bbs = {t: family.backbone(experts[t]).eval() for t in batches}
    exp = ModuleWeights(None, exp_bbs).enter_experts(family, batches)

    def drift_at(index: int, cand: Streams) -> LayerDrift:
        nonlocal exp
        exp = run_streams(family, exp_bbs, index, exp)
        return block_drift(family, index, cand_bb, exp_bbs, cand, exp)

    return _drift_by_layer(family, candidate, batches, drift_at)


@torch.no_grad()
def score_backbone(backbone: nn.Module, heads: Mapping[str, nn.Module], encoder: InputEncoder, splits: Mapping[str, TaskSplit],
                   max_length: Mapping[str, int]) -> dict[str, float]:
    """Accuracy per task of `backbone` under each task's head: the one scorer of the project; a causal
    LM's task is scored by its mean token NLL instead (`featcal.evaluation.language.split_nll`).

    `heads[task]` is a task model (an expert, or a `featcal.io.checkpoints.load_head` model) whose backbone is
    replaced by `backbone`'s parameters (shared, not copied); only tasks in `heads` are scored."""
    return {t: task_score(with_backbone_assigned(heads[t], backbone), encoder, splits[t], max_length[t]) for t in heads}


def task_score(task_model: nn.Module, encoder: InputEncoder, split: TaskSplit, max_length: int) -> float:
    """A classifier's accuracy, or a causal LM's mean token NLL (lower is better), on one split."""
    if is_causal_lm(task_model):
        return split_nll(task_model, encoder, split, max_length)
    return accuracy(task_model, encoder, split, max_length)


def summary(scores: Mapping[str, float]) -> dict[str, float]:
    """{"avg": mean, <task>: score, ...} rounded for metrics files."""
    out = {"avg": round(sum(scores.values()) / len(scores), 4)}
    out.update({t: round(v, 4) for t, v in scores.items()})
    return out


def gap_closed(experts: float, merged: float, calibrated: float) -> float | None:
    """(calibrated − merged) / (experts − merged); None when the merge has no gap to close."""
    gap = experts - merged
    return None if abs(gap) < 1e-12 else round((calibrated - merged) / gap, 4)


def drift_rows(merged: list[LayerDrift], calibrated: list[LayerDrift]) -> list[dict]:
    return [
        {"layer": m.layer, "merged_l2": round(m.l2, 5), "featcal_l2": round(c.l2, 5),
         "merged_cosine": round(m.cosine, 5), "featcal_cosine": round(c.cosine, 5)}
        for m, c in zip(merged, calibrated)
    ]


__all__ = ["LayerDrift", "asdict", "drift_rows", "drift_to_cache", "gap_closed", "layer_drift", "summary"]
