"""The in-memory merge driver: models loaded whole, the method's context filled with them."""

from __future__ import annotations

import copy
from typing import Mapping

from torch import nn

from featcal.families import family_for
from featcal.io.models import check_experts_fit_base, is_causal_lm
from featcal.merging.registry import MergeContext, fill_models, merge_state_dicts


def merge_models(
    base: nn.Module,
    experts: Mapping[str, nn.Module],
    method: str = "task_arithmetic",
    options: Mapping | None = None,
    context: MergeContext | None = None,
) -> nn.Module:
    """A copy of the base backbone holding the merge of the experts' backbones (heads untouched).

    Experts of another model type than the base, or with other tensors, or with NaN/Inf weights
    are refused; an expert that looks like no fine-tune of the base gets a warning. A data method
    (RegMean, AdaMerging, SigMerge, ...) reads `context`: this driver fills its models (the base
    backbone, the experts in order, their family); the caller gives the data (train batches, dev
    scoring). Whatever the method reports lands in `context.record`.
    """
    family = family_for(base)
    check_experts_fit_base(base, experts)
    merged = copy.deepcopy(family.backbone(base))
    context = fill_models(context, list(experts), lambda: family.backbone(base).eval(), lambda: experts, family)
    state = merge_state_dicts(
        method, merged.state_dict(), [family.backbone(m).state_dict() for m in experts.values()], options, context
    )
    merged.load_state_dict(state)
    if is_causal_lm(base) and not is_causal_lm(merged):   # a base built in memory names no architecture:
        merged.config.architectures = [type(base).__name__]   # the bare decoder is still a causal LM's
    return merged.eval()
