"""A causal LM scored, and its drift to the experts measured, one decoder block at a time from its
checkpoint: what `featcal.evaluation.scoring.score_backbone` and `drift_to_states` give for the model
loaded whole, without the whole model in memory.

The model folder is read through a `LazyBackbone`: its embeddings while the test texts enter block
0, then each block in turn (every task's streams through it, and the drift streams, compared with
the experts' cached states leaving it), then for each task in turn its head and the final norm
(the embeddings too for a head tied to them), the logits taken `LM_HEAD_CHUNK` texts at a time.
The blocks run on the very batches `split_nll` scores (the same padding), with the inputs each
block receives captured from the model's own forward (`Family.enter`), so the scores are those of
the whole model's forward.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from typing import Callable, Iterable, Mapping, Sequence

import torch
from torch import Tensor, nn
from tqdm.auto import tqdm

from featcal.calibration.calibrate import enter_streams, LayerDrift
from featcal.data.encoders import InputEncoder
from featcal.data.splits import TaskSplit
from featcal.evaluation.language import logits_log_probs, mean_token_nll, split_batches
from featcal.evaluation.scoring import drift_to_cache
from featcal.families import Family, family_for, Stream
from featcal.families.base import block_prefixes, outer_prefixes, run_streams
from featcal.io.checkpoints import (CheckpointReader, empty_backbone, head_model, HeadSource, LazyBackbone, module_prefix,
                                    with_backbone_assigned)
from featcal.io.models import backbone_of
from featcal.profiling import trim_heap

Batches = Mapping[str, list[Mapping[str, Tensor]]]
# texts whose logits are taken at once: [texts, T, V] floats, ~3 such tensors with the log-softmax
# (Qwen2's V = 151,936: 2 texts of 128 tokens are 156 MB; a batch of 16 would be 1.2 GB)
LM_HEAD_CHUNK = 2


@dataclass(frozen=True)
class DriftInputs:
    """What the drift is measured on: each task's tokenised batches, and the experts' states
    entering each block on them (`states(k)`: `featcal.calibration.walk.stack_states`' dict, e.g.
    a per-layer cache; layer L is the last block's output)."""

    batches: Batches
    states: Callable[[int], Mapping[str, Tensor]]


@dataclass
class StreamedScores:
    scores: dict[str, float]   # each task's mean token NLL
    drift: list[LayerDrift] = field(default_factory=list)   # per block; empty without `DriftInputs`


def lazy_model(model_dir: str | os.PathLike, layer_files: Sequence[str | os.PathLike] = ()) -> LazyBackbone:
    """The folder's backbone with every parameter on the meta device until a step reads it; the
    tensors of `layer_files` (calibrated layers) are read in place of the folder's."""
    reader = CheckpointReader(model_dir).with_tensors_from(layer_files)
    lazy = LazyBackbone(empty_backbone(reader.folder), reader)
    types = set(getattr(lazy.module.config, "layer_types", None) or ())
    if len(types) > 1:   # every block is given block 0's captured mask
        raise ValueError(f"{reader.folder}: its layers mix attention types {sorted(types)} (config layer_types); "
                         "blocks run one at a time all receive block 0's attention mask")
    return lazy


@torch.no_grad()
def score_streamed(
    model_dir: str | os.PathLike,
    heads: Mapping[str, HeadSource],
    encoder: InputEncoder,
    splits: Mapping[str, TaskSplit],
    max_length: Mapping[str, int],
    layer_files: Sequence[str | os.PathLike] = (),
    drift: DriftInputs | None = None,
    progress: bool = True,
) -> StreamedScores:
    """Each task's mean token NLL on its split under its head (`heads[task]`: a causal LM, e.g. a
    `featcal.io.checkpoints.load_head` model, or the expert folder to load it from, then held only
    while its task is scored), of the backbone in `model_dir` with the tensors of `layer_files` put
    in place, and with `drift` its per-block drift to the experts' states: the numbers
    `score_backbone` and `drift_to_states` give for that backbone in memory, in one pass over its
    blocks. In memory at once: one block, or the parameters outside the blocks (the embeddings only
    while the texts enter, or for a head tied to them), one task's head, every task's streams at one
    block boundary and `LM_HEAD_CHUNK` texts' logits. A head given as a model gets its meta backbone
    back before this returns."""
    lazy = lazy_model(model_dir, layer_files)
    family = family_for(lazy.module)
    texts = {t: split_batches(encoder, splits[t], max_length[t]) for t in heads}
    outer = outer_prefixes(family, lazy.module)
    with lazy.loaded(outer) as backbone:
        streams = enter_streams(family, backbone, texts)
        compared = enter_streams(family, backbone, drift.batches) if drift is not None else {}
    out = StreamedScores({})
    shared = family.shared_block_prefixes(lazy.module)
    blocks = block_prefixes(family, lazy.module)
    for index, prefix in enumerate(tqdm(blocks, desc="score (streamed)", unit="block", disable=not progress)):
        with lazy.loaded([prefix, *shared]) as backbone:
            streams = run_streams(family, backbone, index, streams)
            if drift is not None:
                compared = run_streams(family, backbone, index, compared)
                out.drift.append(drift_to_cache(family, index, backbone, compared, drift.states))
        trim_heap()   # the block's freed pages out of the RSS the next block adds to
    for task, head in heads.items():   # one task's head at a time
        model = head_model(head)
        try:
            with lazy.loaded(head_inputs(lazy.module, model, outer)) as backbone:
                out.scores[task] = lm_nll(with_backbone_assigned(model, backbone), family, backbone, streams[task],
                                          texts[task])
        finally:   # the tensors just loaded are freed, not held by the head
            with_backbone_assigned(model, lazy.module)
        del model
        trim_heap()   # the head's pages out of the RSS the next task's head adds to
    return out


def head_inputs(backbone: nn.Module, task_model: nn.Module, outer: Sequence[str]) -> list[str]:
    """What the LM head step reads of the backbone (`outer`: its parameters outside the blocks): the
    final norm, and the input embeddings only where the task's LM head is tied to them (an untied
    head is the task's own, vocabulary x hidden floats that need no second copy beside them)."""
    embeddings = module_prefix(backbone, backbone.get_input_embeddings())
    tied = task_model.get_output_embeddings().weight is backbone_of(task_model).get_input_embeddings().weight
    return [n for n in outer if tied or not n.startswith(embeddings)]


def lm_nll(task_model: nn.Module, family: Family, backbone: nn.Module, streams: Iterable[Stream],
           batches: Iterable[Mapping[str, Tensor]]) -> float:
    """Mean token NLL of the texts whose streams left the last block: the backbone's output, then
    the task model's LM head (`get_output_embeddings`, the embeddings where tied) on
    `LM_HEAD_CHUNK` texts at a time, summed as `featcal.evaluation.language.text_nll` sums."""
    lm_head = task_model.get_output_embeddings()
    return mean_token_nll(
        chunked_log_probs(lm_head, family.last_hidden_state(backbone, s), b["input_ids"], b["attention_mask"])
        for s, b in zip(streams, batches, strict=True)
    ).nll


def chunked_log_probs(lm_head: nn.Module, hidden: Tensor, input_ids: Tensor, attention_mask: Tensor,
                      chunk: int = LM_HEAD_CHUNK) -> tuple[Tensor, Tensor]:
    """`featcal.evaluation.language.logits_log_probs` of one batch, its logits `chunk` texts at a time."""
    parts = [logits_log_probs(lm_head(hidden[i:i + chunk]), input_ids[i:i + chunk], attention_mask[i:i + chunk])
             for i in range(0, hidden.shape[0], chunk)]
    return torch.cat([logp for logp, _ in parts]), torch.cat([valid for _, valid in parts])


__all__ = ["DriftInputs", "LM_HEAD_CHUNK", "StreamedScores", "chunked_log_probs", "head_inputs", "lazy_model", "lm_nll",
           "score_streamed"]
