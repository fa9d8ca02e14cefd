"""Llama-style decoders (`LlamaForSequenceClassification`, `LlamaModel`): RMSNorm, gated MLP, no biases.

Backbone: the `LlamaModel` (`model.model`): token embeddings, the decoder layers, the final `norm`
and the rotary embedding. The head (`score`) reads `norm(h_L)` at one token per example.

Pooling "last", as `LlamaForSequenceClassification` does it: the *rightmost* token that is not the
pad token (`(arange(T) * (input_ids != pad_token_id)).argmax(-1)`), which is right for both right
and left padding; without a pad token id, the rightmost token of the attention mask.

The blocks' extra inputs (4-D causal mask, rotary `position_embeddings`, `position_ids`) are
captured from the model's own forward; the forward runs with `use_cache=False` and no cache object
is kept in the stream (a cache would be mutated by every block call).
"""

from __future__ import annotations

from dataclasses import replace
from typing import Mapping

import torch
from torch import Tensor, nn

from .base import Family, Stream

CACHE_KWARGS = ("cache", "past_key_values", "past_key_value")


def rightmost_index(marks: Tensor) -> Tensor:
    """[B] index of the rightmost True of each row (0 for a row with none)."""
    positions = torch.arange(marks.shape[-1], device=marks.device)
    return (positions * marks.long()).argmax(-1)


class LlamaFamily(Family):
    name = "llama"
    model_types = ("llama",)
    pooling = "last"

    def blocks(self, backbone: nn.Module) -> list[nn.Module]:
        return list(backbone.layers[: backbone.config.num_hidden_layers])

    def model_inputs(self, inputs: Mapping[str, Tensor]) -> dict:
        kept = {k: v for k, v in inputs.items() if k in ("input_ids", "attention_mask", "position_ids")}
        kept["use_cache"] = False
        return kept

    def token_mask(self, inputs: Mapping[str, Tensor], hidden: Tensor) -> Tensor:
        return super().token_mask(inputs, hidden).to(hidden.device)

    def last_token(self, backbone: nn.Module, inputs: Mapping[str, Tensor], mask: Tensor) -> Tensor:
        """The token `LlamaForSequenceClassification` reads, per example."""
        pad = getattr(backbone.config, "pad_token_id", None)
        input_ids = inputs.get("input_ids")
        if pad is not None and input_ids is not None:
            return rightmost_index(input_ids != pad)
        return rightmost_index(mask)

    @torch.no_grad()
    def enter(self, backbone: nn.Module, inputs: Mapping[str, Tensor]) -> Stream:
        stream = super().enter(backbone, inputs)
        kwargs = {k: v for k, v in stream.kwargs.items() if k not in CACHE_KWARGS}
        return replace(stream, kwargs=kwargs, pooled_index=self.last_token(backbone, inputs, stream.mask))

    def head_features(self, backbone: nn.Module, stream: Stream) -> Tensor:
        """norm(h_L) at the pooled token: what `score` reads."""
        last = stream.hidden[torch.arange(stream.hidden.shape[0], device=stream.hidden.device), stream.pooled_index]
        return backbone.norm(last)
