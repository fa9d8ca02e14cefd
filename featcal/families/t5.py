"""T5 encoder-decoders (`T5ForSequenceClassification`, `T5Model`, `T5ForConditionalGeneration`).

Backbone: the `T5Model` (`model.transformer` of the sequence classifier) or, for the conditional
generation model, the model itself (its `lm_head` is the head and is never calibrated). Blocks in
forward order: the encoder's blocks, then the decoder's. Encoder-only models (`T5EncoderModel`)
get just the encoder blocks.

T5's blocks do not all receive the same inputs, so this family runs them itself, passing exactly
what `T5Stack.forward` passes:
- block 0 of each stack computes the relative position bias and returns it; the stack hands it to
  every later block (and, in the decoder, the cross-attention bias likewise);
- running the last encoder block also leaves the encoder: `final_layer_norm` (+ dropout, identity
  in eval) gives the encoder output, then the decoder's own forward is run up to decoder block 0
  (embedding, causal mask, encoder mask), with the encoder output of *this* stream as
  `encoder_hidden_states`. The student's decoder therefore cross-attends to the calibrated
  student encoder, and each expert's to its own encoder.

Decoder inputs, as the models build them: `decoder_input_ids` if the batch has them; else, for a
model with an `lm_head` and token `labels`, `shift_right(labels)`; else `shift_right(input_ids)`
(what `T5ForSequenceClassification` does). Real decoder rows: `decoder_attention_mask` if given,
else `labels != -100` (seq2seq), else the encoder's attention mask (shifted inputs have the
encoder's length), else every token.

Pooling: `T5ForSequenceClassification` reads the decoder output at the last EOS of `input_ids`;
the family uses that index (or, when the decoder length differs or a row has no EOS, the
rightmost real decoder token). With an `lm_head` every decoder token is read, so it mean-pools
(no pooled-token weighting). Cross-attention key/value projections read encoder tokens: their
rows are the encoder's token mask (`row_mask`).

The relative attention bias is an Embedding and stays uncalibrated, as do the final norms.

Stored streams (the pipeline's per-layer caches): a decoder stream carries its encoder output
(`carried`); `resume` rebuilds a stream entering block k of a given model from the stored states:
the decoder's inputs from the carried encoder output, and the self-attention position bias from
that model's own block-0 position table (`shared_block_prefixes`, read with every block). The
cross-attention bias is left to the block, which makes the same zeros block 0 would hand on.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Mapping

import torch
from torch import Tensor, nn

from .base import Family, Stream, capture_block_call, pool
from .llama import CACHE_KWARGS, rightmost_index

ENCODER, DECODER = "encoder", "decoder"
CROSS_KEY_VALUE = ("EncDecAttention.k", "EncDecAttention.v")

# positions in Stream.args (the arguments after hidden_states that T5Stack passes to T5Block)
MASK, POSITION_BIAS, ENCODER_HIDDEN, ENCODER_MASK, CROSS_POSITION_BIAS = range(5)


def _no_cache(kwargs: Mapping) -> dict:
    return {k: v for k, v in kwargs.items() if k not in CACHE_KWARGS}


class T5Family(Family):
    name = "t5"
    model_types = ("t5",)
    pooling = "eos"

    # --- structure -------------------------------------------------------------------------
    def backbone(self, model: nn.Module) -> nn.Module:
        transformer = getattr(model, "transformer", None)
        return transformer if isinstance(transformer, nn.Module) else model

    @staticmethod
    def decoder(backbone: nn.Module) -> nn.Module | None:
        return getattr(backbone, "decoder", None)

    def blocks(self, backbone: nn.Module) -> list[nn.Module]:
        blocks = list(backbone.encoder.block)
        decoder = self.decoder(backbone)
        return blocks + (list(decoder.block) if decoder is not None else [])

    def depth(self, config) -> int:
        """The encoder's blocks and the decoder's: the pipeline's backbone (`AutoModel`) is a `T5Model`."""
        return int(config.num_layers) + int(config.num_decoder_layers)

    def n_encoder_blocks(self, backbone: nn.Module) -> int:
        return len(backbone.encoder.block)

    def stacks(self, backbone: nn.Module) -> list[tuple[int, nn.Module]]:
        """(index of its first block, stack) for the encoder and, when there is one, the decoder."""
        decoder = self.decoder(backbone)
        return [(0, backbone.encoder)] + ([] if decoder is None else [(self.n_encoder_blocks(backbone), decoder)])

    def shared_block_prefixes(self, backbone: nn.Module) -> list[str]:
        return [self.block_prefix(backbone, first) + "layer.0.SelfAttention.relative_attention_bias."
                for first, _ in self.stacks(backbone)]

    # --- inputs -------------------------------------------------------------------------------
    def model_inputs(self, inputs: Mapping[str, Tensor]) -> dict[str, Tensor]:
        keys = ("input_ids", "attention_mask", "decoder_input_ids", "decoder_attention_mask")
        return {k: v for k, v in inputs.items() if k in keys}

    def token_mask(self, inputs: Mapping[str, Tensor], hidden: Tensor) -> Tensor:
        return super().token_mask(inputs, hidden).to(hidden.device)

    def decoder_inputs(self, backbone: nn.Module, inputs: Mapping[str, Tensor]) -> tuple[Tensor, Tensor | None, Tensor]:
        """(decoder_input_ids, decoder_attention_mask as the model gets it, real decoder rows)."""
        attn = inputs.get("decoder_attention_mask")
        labels = inputs.get("labels")
        if inputs.get("decoder_input_ids") is not None:
            ids = inputs["decoder_input_ids"]
            rows = attn if attn is not None else torch.ones_like(ids)
        elif hasattr(backbone, "lm_head") and labels is not None and labels.dim() == 2:
            ids = backbone._shift_right(labels)
            rows = (labels != -100) if attn is None else attn
        else:
            input_ids = inputs["input_ids"]
            ids = backbone._shift_right(input_ids)
            rows = attn if attn is not None else inputs.get("attention_mask", torch.ones_like(input_ids))
        return ids, attn, rows.to(torch.bool)

    def decoder_pooled_index(self, backbone: nn.Module, inputs: Mapping[str, Tensor], rows: Tensor) -> Tensor | None:
        """The decoder token the head reads: last EOS of input_ids (sequence classification)."""
        if hasattr(backbone, "lm_head"):
            return None
        input_ids = inputs.get("input_ids")
        eos = getattr(backbone.config, "eos_token_id", None)
        if eos is not None and input_ids is not None and input_ids.shape == rows.shape:
            is_eos = input_ids == eos
            if bool(is_eos.any(1).all()):
                return rightmost_index(is_eos)
        return rightmost_index(rows)

    # --- running --------------------------------------------------------------------------------
    @torch.no_grad()
    def enter(self, backbone: nn.Module, inputs: Mapping[str, Tensor]) -> Stream:
        """The stream entering encoder block 0; the decoder's inputs wait in `extras`."""
        input_ids, attention_mask = inputs["input_ids"], inputs.get("attention_mask")
        encoder = backbone.encoder
        args, kwargs = capture_block_call(
            encoder.block[0], lambda: encoder(input_ids=input_ids, attention_mask=attention_mask)
        )
        hidden = args[0]
        mask = self.token_mask(inputs, hidden)
        extras: dict = {"stage": ENCODER, "encoder_mask": mask, "encoder_attention_mask": attention_mask}
        if self.decoder(backbone) is not None:
            ids, attn, rows = self.decoder_inputs(backbone, inputs)
            extras.update(
                decoder_input_ids=ids, decoder_attention_mask=attn, decoder_mask=rows.to(hidden.device),
                decoder_pooled_index=self.decoder_pooled_index(backbone, inputs, rows),
            )
        # the encoder stage of an encoder-decoder is never pooled; an encoder-only model mean-pools
        return Stream(hidden, mask, tuple(args[1:]), _no_cache(kwargs), None, extras)

    @torch.no_grad()
    def enter_decoder(self, backbone: nn.Module, stream: Stream) -> Stream:
        """From the last encoder block's output to the stream entering decoder block 0."""
        encoder = backbone.encoder
        return self.decoder_entry(backbone, stream.extras, encoder.dropout(encoder.final_layer_norm(stream.hidden)))

    @torch.no_grad()
    def decoder_entry(self, backbone: nn.Module, extras: Mapping, encoder_output: Tensor) -> Stream:
        """The stream entering decoder block 0 when the encoder gave `encoder_output` (`extras`:
        the decoder inputs that `enter` prepared)."""
        decoder, x = backbone.decoder, extras
        args, kwargs = capture_block_call(
            decoder.block[0],
            lambda: decoder(
                input_ids=x["decoder_input_ids"], attention_mask=x["decoder_attention_mask"],
                encoder_hidden_states=encoder_output, encoder_attention_mask=x["encoder_attention_mask"],
                use_cache=False,
            ),
        )
        extras = {**x, "stage": DECODER, "encoder_output": encoder_output}
        return Stream(args[0], x["decoder_mask"], tuple(args[1:]), _no_cache(kwargs), x["decoder_pooled_index"], extras)

    @torch.no_grad()
    def run_block(self, backbone: nn.Module, index: int, stream: Stream, block: nn.Module | None = None) -> Stream:
        block = self.blocks(backbone)[index] if block is None else block
        hidden, self_bias, cross_bias = block(stream.hidden, *stream.args, **stream.kwargs)[:3]
        # as T5Stack.forward: block 0's position biases are handed to every later block
        args = list(stream.args)
        args[POSITION_BIAS] = self_bias
        if stream.extras["stage"] == DECODER and args[ENCODER_HIDDEN] is not None:
            args[CROSS_POSITION_BIAS] = cross_bias
        out = Stream(hidden, stream.mask, tuple(args), stream.kwargs, stream.pooled_index, stream.extras)
        if index == self.n_encoder_blocks(backbone) - 1 and self.decoder(backbone) is not None:
            return self.enter_decoder(backbone, out)
        return out

    def carried(self, stream: Stream) -> dict[str, Tensor]:
        return {"encoder_output": stream.extras["encoder_output"]} if stream.extras.get("stage") == DECODER else {}

    @torch.no_grad()
    def resume(self, backbone: nn.Module, index: int, like: Stream, hidden: Tensor,
               carried: Mapping[str, Tensor]) -> Stream:
        first, stack = [(f, s) for f, s in self.stacks(backbone) if f <= index][-1]
        if stack is not backbone.encoder:
            output = carried["encoder_output"]
            if like.extras["stage"] == ENCODER:
                like = self.decoder_entry(backbone, like.extras, output)
            else:
                args = list(like.args)
                args[ENCODER_HIDDEN] = output
                like = replace(like, args=tuple(args), extras={**like.extras, "encoder_output": output})
        args = list(like.args)
        args[CROSS_POSITION_BIAS] = None
        args[POSITION_BIAS] = None
        if first < index < len(self.blocks(backbone)):
            # what block 0 of the stack computes and T5Stack hands to every later block
            attention = stack.block[0].layer[0].SelfAttention
            args[POSITION_BIAS] = attention.compute_bias(hidden.shape[1], hidden.shape[1], device=hidden.device)
        return replace(like, hidden=hidden, args=tuple(args))

    def row_mask(self, module_name: str, stream: Stream) -> Tensor:
        """Cross-attention keys/values read the encoder's tokens; everything else the stream's."""
        if stream.extras.get("stage") == DECODER and module_name.endswith(CROSS_KEY_VALUE):
            return stream.extras["encoder_mask"]
        return stream.mask

    def block_output(self, backbone: nn.Module, index: int, stream: Stream) -> tuple[Tensor, Tensor]:
        """After the last encoder block the stream is the decoder's input; its output is the encoder's."""
        if index == self.n_encoder_blocks(backbone) - 1 and stream.extras.get("stage") == DECODER:
            return stream.extras["encoder_output"], stream.extras["encoder_mask"]
        return stream.hidden, stream.mask

    def head_features(self, backbone: nn.Module, stream: Stream) -> Tensor:
        """final_layer_norm of the stack the stream is in, pooled as the head reads it."""
        stack = backbone.decoder if stream.extras.get("stage") == DECODER else backbone.encoder
        return pool(stack.final_layer_norm(stream.hidden), stream.mask, stream.pooled_index)
