"""Llama-like decoders: the `llama`, `qwen2` and `mistral` model types, as sequence classifiers
(`LlamaForSequenceClassification`, ...) or causal language models (`Qwen2ForCausalLM`, ...).

One family with options, not one copy per type: what differs between them (Qwen2's q/k/v biases,
tied embeddings, grouped-query attention, Mistral's sliding window) lives in the model's own
modules and in the masks its forward builds, which the blocks' inputs are captured from.

Backbone: the decoder model (`model.model`): token embeddings, the decoder layers, the final `norm`
and the rotary embedding. A classifier's head (`score`) reads `norm(h_L)` at one token per example;
a causal LM's head (`lm_head`, often tied to the embeddings) reads it at every token, so its
variant (`LlamaCausalLMFamily`) matches every real token's features, uniformly weighted. The
embeddings, the final norm and the LM head stay as merged.

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

from featcal.io.models import is_causal_lm

from .base import Family, Stream, pool

CACHE_KWARGS = ("cache", "past_key_values", "past_key_value")


def rightmost_index(marks: Tensor) -> Tensor:
    """[B] index of the rightmost True of each row (0 for a row with none)."""
    positions = torch.arange(marks.shape[-1], device=marks.device)
    return (positions * marks.long()).argmax(-1)


class LlamaFamily(Family):
    name = "llama"
    model_types = ("llama", "qwen2", "mistral")
    pooling = "last"

    def for_model(self, model: nn.Module) -> Family:
        return LLAMA_CAUSAL_LM if is_causal_lm(model) else self

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

    def last_hidden_state(self, backbone: nn.Module, stream: Stream) -> Tensor:
        """norm(h_L) at every token, as the decoder's forward ends."""
        return backbone.norm(stream.hidden)

    def head_features(self, backbone: nn.Module, stream: Stream) -> Tensor:
        """norm(h_L) at the pooled token: what `score` reads."""
        last = stream.hidden[torch.arange(stream.hidden.shape[0], device=stream.hidden.device), stream.pooled_index]
        return backbone.norm(last)


class LlamaCausalLMFamily(LlamaFamily):
    """The causal-LM task model: every real token is read by the LM head, none is pooled."""

    name = "llama"
    pooling = "mean"

    def for_model(self, model: nn.Module) -> Family:
        return self

    @torch.no_grad()
    def enter(self, backbone: nn.Module, inputs: Mapping[str, Tensor]) -> Stream:
        return replace(super().enter(backbone, inputs), pooled_index=None)

    def head_features(self, backbone: nn.Module, stream: Stream) -> Tensor:
        """norm(h_L), the LM head's input, averaged over each example's real tokens."""
        return pool(self.last_hidden_state(backbone, stream), stream.mask, None)


LLAMA_CAUSAL_LM = LlamaCausalLMFamily()
