"""What SigMerge needs from models and data, and SigMerge as a registered merge method.

The method itself (`featcal.merging.sigmerge`) sees tensors only; this module gathers its inputs
from a `MergeContext`: per-domain dev accuracy of the experts and of the anchor (the context's
scoring callable), and each expert's mean-pooled block outputs on one shared set of unlabelled
train examples (for the CKA geometry signal). `merge_models(base, experts, "sigmerge", options,
context)` runs it like every other method; the decisions land in `context.record`.
"""

from __future__ import annotations

import copy
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any, Callable, Mapping

import torch
from torch import Tensor, nn

from featcal.families import Family
from featcal.merging.registry import MergeContext, StateDict, get_method, register
from featcal.merging.sigmerge import SigMergeOptions, anchor_merge, block_signals, plot_admitted, sigmerge


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


def write_admitted(record: Mapping[str, Any], folder: str | Path) -> None:
    """SigMerge's report: the admitted-coordinates heat map as `folder`/admitted.png."""
    plot_admitted(record, Path(folder) / "admitted.png")


def anchor_needs(options: Mapping[str, Any]) -> frozenset[str]:
    """What the inner anchor reads (RegMean: activations), which SigMerge's context must then hold too."""
    return get_method(options.get("anchor", SigMergeOptions.anchor)).needs


@register("sigmerge", SigMergeOptions, needs=("dev_scores", "shared_examples"), report=write_admitted,
          more_needs=anchor_needs)
def sigmerge_method(
    base: StateDict, experts: Sequence[StateDict], opts: SigMergeOptions, context: MergeContext
) -> StateDict:
    """SigMerge on the anchor merge: dev deficits, conflict signals, claiming (`sigmerge.sigmerge`).

    The record (signals, capacities, deficits, admitted counts) goes to `context.record`, with the
    wall seconds of the anchor merge and of what SigMerge adds beyond it.
    """
    family = context.family
    expert_states = dict(zip(context.experts, experts))
    cache = context.cache if context.cache is not None else {}
    start = time.perf_counter()
    anchor_key = (opts.anchor, repr(sorted(dict(opts.anchor_options).items())))
    if cache.get("anchor", (None,))[0] != anchor_key:   # the latest inner anchor only
        cache["anchor"] = (anchor_key, anchor_merge(base, expert_states, opts, context))
    anchor_state = cache["anchor"][1]
    anchor_s = time.perf_counter() - start

    start = time.perf_counter()
    anchor = copy.deepcopy(context.base)
    anchor.load_state_dict({**context.base.state_dict(), **anchor_state})
    anchor_dev = context.score_dev(anchor.eval())
    expert_dev = dict(context.expert_dev)
    block_of = block_index_of(family, context.base)
    if "outputs" not in cache:
        cache["outputs"] = pooled_block_outputs(family, context.experts, context.shared_batches)
    outputs = cache["outputs"]
    signals_key = ("signals", opts.demand_fraction)
    if signals_key not in cache:
        cache[signals_key] = block_signals(base, expert_states, block_of, outputs, opts.demand_fraction)
    state, record = sigmerge(
        base, expert_states, anchor_state, block_of, outputs, expert_dev, anchor_dev, opts, signals=cache[signals_key],
    )
    record["wall_s"] = {"anchor": round(anchor_s, 2), "sigmerge_extra": round(time.perf_counter() - start, 2)}
    record["dev"] = {"experts": expert_dev, "anchor": anchor_dev}
    record["summary"] = {"admitted_total": record["total_admitted"], "coords_total": record["total_coords"]}
    context.record.update(record)
    return state
