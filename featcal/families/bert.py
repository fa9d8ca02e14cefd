"""BERT-style encoders (BERT, MiniLM, RoBERTa): CLS pooling through an optional pooler dense."""

from __future__ import annotations

from torch import nn

from .base import Family


class BertFamily(Family):
    name = "bert"
    model_types = ("bert", "roberta", "xlm-roberta", "electra")
    pooling = "cls"

    def blocks(self, backbone: nn.Module) -> list[nn.Module]:
        return list(backbone.encoder.layer)

    def pooler(self, backbone: nn.Module) -> nn.Linear | None:
        pooler = getattr(backbone, "pooler", None)
        return None if pooler is None else pooler.dense
