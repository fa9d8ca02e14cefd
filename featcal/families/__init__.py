"""Model families behind one interface; `family_for(model)` picks one by config.model_type."""

from __future__ import annotations

from torch import nn

from .base import Family, Stream, module_kind, pool
from .bert import BertFamily
from .clip import CLIPVisionFamily
from .llama import LlamaFamily
from .mpnet import MPNetFamily
from .t5 import T5Family
from .vit import ViTFamily

FAMILIES: dict[str, Family] = {}


def register_family(family: Family) -> Family:
    for model_type in family.model_types:
        FAMILIES[model_type] = family
    return family


register_family(BertFamily())
register_family(MPNetFamily())
register_family(ViTFamily())
register_family(CLIPVisionFamily())
register_family(LlamaFamily())
register_family(T5Family())


def family_for(model: nn.Module) -> Family:
    """The family of a Hugging Face model, or an error that lists the supported ones."""
    config = getattr(model, "config", None)
    model_type = getattr(config, "model_type", None)
    if model_type in FAMILIES:
        return FAMILIES[model_type].for_model(model)
    supported = ", ".join(sorted(FAMILIES))
    raise ValueError(
        f"unsupported architecture {model_type!r} ({type(model).__name__}); "
        f"featcal supports model types: {supported}"
    )


__all__ = ["FAMILIES", "Family", "Stream", "family_for", "module_kind", "pool", "register_family"]
