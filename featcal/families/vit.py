"""ViT image classifiers (`ViTForImageClassification`, `ViTModel`): CLS pooling, every token real.

Backbone: the `ViTModel` (`model.vit`): patch embeddings, the blocks, the final `layernorm` and,
when the model was built with `add_pooling_layer=True`, the pooler. The classifier reads
`layernorm(h_L[:, 0])`; the pooler (if any) reads the same vector, so `head_features` applies the
final layernorm to the CLS token of the last block's output.
"""

from __future__ import annotations

from typing import Mapping

import torch
from torch import Tensor, nn

from .base import Family, Stream

IMAGE_INPUT_KEYS = ("pixel_values", "interpolate_pos_encoding")


def image_inputs(inputs: Mapping[str, Tensor]) -> dict[str, Tensor]:
    """The vision backbone's keyword inputs (labels and unknown keys dropped)."""
    return {k: v for k, v in inputs.items() if k in IMAGE_INPUT_KEYS}


def all_tokens(hidden: Tensor) -> Tensor:
    """Images have no padding: every patch token (and CLS) is one moment row."""
    return torch.ones(hidden.shape[:2], dtype=torch.bool, device=hidden.device)


class ImageTowerFamily(Family):
    """Vision transformers: pixel inputs, no padding, the head reads final_norm(CLS)."""

    pooling = "cls"

    def final_norm(self, backbone: nn.Module) -> nn.Module:
        raise NotImplementedError

    def model_inputs(self, inputs: Mapping[str, Tensor]) -> dict[str, Tensor]:
        return image_inputs(inputs)

    def token_mask(self, inputs: Mapping[str, Tensor], hidden: Tensor) -> Tensor:
        return all_tokens(hidden)

    def head_features(self, backbone: nn.Module, stream: Stream) -> Tensor:
        """final_norm(CLS of the last block): what the head reads."""
        cls = stream.hidden[torch.arange(stream.hidden.shape[0], device=stream.hidden.device), stream.pooled_index]
        return self.final_norm(backbone)(cls)


class ViTFamily(ImageTowerFamily):
    name = "vit"
    model_types = ("vit",)
    pooling = "cls"

    def blocks(self, backbone: nn.Module) -> list[nn.Module]:
        # transformers >= 5 keeps the blocks in `vit.layers`; older releases in `vit.encoder.layer`
        layers = getattr(backbone, "layers", None)
        return list(layers if layers is not None else backbone.encoder.layer)

    def pooler(self, backbone: nn.Module) -> nn.Linear | None:
        pooler = getattr(backbone, "pooler", None)
        return None if pooler is None else pooler.dense

    def final_norm(self, backbone: nn.Module) -> nn.Module:
        """The classifier (and the pooler, if any) read layernorm(CLS)."""
        return backbone.layernorm
