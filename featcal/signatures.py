"""What SigMerge needs from models and data: dev scores and the experts' pooled block outputs.

The method itself (`featcal.merging.sigmerge`) sees tensors only; this module gathers its inputs:
per-domain dev accuracy of the experts and of the anchor, and each expert's mean-pooled block
outputs on one shared set of unlabelled train examples (for the CKA geometry signal).
"""

from __future__ import annotations

import copy
import time
from typing import Any, Callable, Mapping

import torch
from torch import Tensor, nn

from . import compare as cmp
from .data import tokenize_batches
from .families import Family, family_for
from .merging.sigmerge import SigMergeOptions, anchor_merge, sigmerge


@torch.no_grad()
def pooled_block_outputs(family: Family, experts: Mapping[str, nn.Module], batches) -> dict[int, dict[str, Tensor]]:
    """block index → expert → [n, d] masked-mean block outputs on the same shared examples."""
    out: dict[int, dict[str, Tensor]] = {}
    for name, model in experts.items():
        backbone = family.backbone(model).eval()
        per_block: dict[int, list[Tensor]] = {}
        for batch in batches:
            stream = family.enter(backbone, batch)
            for index in range(len(family.blocks(backbone))):
                stream = family.run_block(backbone, index, stream)
                hidden, mask = family.block_output(backbone, index, stream)
                m = mask.to(hidden.dtype)[..., None]
                per_block.setdefault(index, []).append((hidden * m).sum(1) / m.sum(1).clamp_min(1.0))
        for index, rows in per_block.items():
            out.setdefault(index, {})[name] = torch.cat(rows).double()
    return out


def block_index_of(family: Family, backbone: nn.Module) -> Callable[[str], int | None]:
    """Backbone parameter name → its block's index, or None outside the blocks."""
    prefixes = [(family.block_prefix(backbone, i), i) for i in range(len(family.blocks(backbone)))]

    def block_of(name: str) -> int | None:
        for prefix, index in prefixes:
            if name.startswith(prefix):
                return index
        return None

    return block_of


def run_sigmerge(
    bench: cmp.Workbench, options: SigMergeOptions | Mapping[str, Any], shared_examples_per_task: int = 16
) -> tuple[nn.Module, dict[str, Any]]:
    """SigMerge on a workbench: anchor merge, dev deficits, conflict signals, claiming.

    Returns the merged backbone and the record (signals, capacities, deficits, admitted counts),
    with the wall seconds spent beyond the anchor merge.
    """
    options = options if isinstance(options, SigMergeOptions) else SigMergeOptions(**dict(options))
    family = family_for(bench.base)
    base_state = bench.base.state_dict()
    expert_states = {t: family.backbone(m).state_dict() for t, m in bench.experts.items()}
    start = time.perf_counter()
    anchor_state = anchor_merge(base_state, expert_states, options)
    anchor_s = time.perf_counter() - start

    start = time.perf_counter()
    anchor = cmp.merge(bench, options.anchor, options.anchor_options)
    anchor_dev = cmp.score_backbone(bench, anchor, split="dev")
    expert_dev = cmp.score_experts(bench, split="dev")
    texts = cmp.calibration_texts(bench, shared_examples_per_task)
    shared = [text for task in bench.tasks for text in texts[task]]
    batches = tokenize_batches(bench.tokenizer, shared, max(bench.lengths.values()), bench.batch_size)
    outputs = pooled_block_outputs(family, bench.experts, batches)
    state, record = sigmerge(
        base_state, expert_states, anchor_state, block_index_of(family, bench.base), outputs,
        expert_dev, anchor_dev, options,
    )
    record["wall_s"] = {"anchor": round(anchor_s, 2), "sigmerge_extra": round(time.perf_counter() - start, 2)}
    record["dev"] = {"experts": expert_dev, "anchor": anchor_dev}
    merged = copy.deepcopy(bench.base)
    merged.load_state_dict(state)
    return merged.eval(), record
