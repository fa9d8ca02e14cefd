"""MPNet encoders (`MPNetForSequenceClassification`, `MPNetModel`; all-mpnet-base-v2).

A BERT-like stack whose attention adds a relative position bias. The bias table is the encoder's
(`encoder.relative_attention_bias`), outside every block: `MPNetEncoder.forward` computes the
bias once from it and hands the same tensor to every block, as T5's stack does with block 0's.
A stream stored between stages keeps only hidden states, so `resume` rebuilds the bias from the
model it resumes for (each expert's own table, the student's merged one), and that table is read
with every block (`shared_block_prefixes`).

The task head (`classifier`: dense, tanh, out_proj on the first token) is the task model's and is
never calibrated; the sequence classifier has no pooler (a bare `MPNetModel` has one, as BERT's).
"""

from __future__ import annotations

from dataclasses import replace
from typing import Mapping

from torch import Tensor, nn

from .base import Stream
from .bert import BertFamily

BIAS_TABLE = "encoder.relative_attention_bias."
POSITION_BIAS = 1   # in Stream.args: MPNetEncoder calls layer(hidden, attention_mask, position_bias)


class MPNetFamily(BertFamily):
    name = "mpnet"
    model_types = ("mpnet",)

    def model_inputs(self, inputs: Mapping[str, Tensor]) -> dict[str, Tensor]:
        """MPNet has no token types (its tokenizer gives none; a batch that has them drops them)."""
        return {k: v for k, v in inputs.items() if k in ("input_ids", "attention_mask")}

    def shared_block_prefixes(self, backbone: nn.Module) -> list[str]:
        return [BIAS_TABLE]

    def resume(self, backbone: nn.Module, index: int, like: Stream, hidden: Tensor,
               carried: Mapping[str, Tensor]) -> Stream:
        """`like`'s mask, and the position bias of `backbone`'s own table (not `like`'s model's)."""
        args = list(like.args)
        args[POSITION_BIAS] = backbone.encoder.compute_position_bias(hidden)
        return replace(like, hidden=hidden, args=tuple(args))
