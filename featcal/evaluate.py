"""Measuring a merged or calibrated backbone: per-task accuracy and per-layer drift to the experts."""

from __future__ import annotations

from dataclasses import asdict
from typing import Mapping

import torch
from torch import Tensor, nn

from .calibrate import LayerDrift, block_drift, enter_streams
from .families import Family

Batches = Mapping[str, list[Mapping[str, Tensor]]]


@torch.no_grad()
def layer_drift(family: Family, experts: Mapping[str, nn.Module], candidate: nn.Module, batches: Batches) -> list[LayerDrift]:
    """Mean L2 distance and cosine similarity of the candidate's block outputs to each task's expert
    (every real token of every example), layer by layer; both run their own full forward."""
    cand_bb = family.backbone(candidate).eval()
    exp_bbs = {t: family.backbone(experts[t]).eval() for t in batches}
    cand = enter_streams(family, cand_bb, batches)
    exp = {t: [family.enter(exp_bbs[t], b) for b in bs] for t, bs in batches.items()}
    out = []
    for index in range(len(family.blocks(cand_bb))):
        cand = {t: [family.run_block(cand_bb, index, s) for s in ss] for t, ss in cand.items()}
        exp = {t: [family.run_block(exp_bbs[t], index, s) for s in ss] for t, ss in exp.items()}
        out.append(block_drift(family, index, cand_bb, exp_bbs, cand, exp))
    return out


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


__all__ = ["LayerDrift", "asdict", "drift_rows", "gap_closed", "layer_drift", "summary"]
