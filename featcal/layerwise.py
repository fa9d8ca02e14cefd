"""FeatCal split into per-layer steps that exchange hidden states through caches.

`collect_expert_states` walks every expert through its blocks in lockstep and yields one layer of
states at a time; `calibrate_cached_block` calibrates one block from the cached states entering it.
Together they compute exactly what `featcal.calibrate.calibrate` computes in one process.
"""

from __future__ import annotations

from typing import Iterator, Mapping, Sequence

import torch
from torch import Tensor, nn

from .calibrate import BlockResult, FeatCalConfig, calibrate_block, calibrate_pooler, enter_streams
from .families import Family, Stream

Batches = Mapping[str, Sequence[Mapping[str, Tensor]]]


def require_uniform(family: Family) -> None:
    if not family.uniform_block_inputs:
        raise ValueError(
            f"the per-layer pipeline needs blocks that share their extra inputs; family {family.name!r} "
            "does not (use featcal.calibrate.calibrate in one process instead)"
        )


def stack_hidden(streams: Mapping[str, Sequence[Stream]]) -> dict[str, Tensor]:
    """Per task, the batches' hidden states concatenated along examples ([N, T, d], float32)."""
    return {t: torch.cat([s.hidden for s in ss]).float() for t, ss in streams.items()}


def streams_from_cache(family: Family, backbone: nn.Module, batches: Batches, hidden: Mapping[str, Tensor]) -> dict[str, list[Stream]]:
    """Rebuild streams entering a block: the model's block inputs from the token batches, with the
    cached hidden states in place of the embeddings."""
    require_uniform(family)
    out: dict[str, list[Stream]] = {}
    for task, task_batches in batches.items():
        if task not in hidden:
            raise KeyError(f"no cached hidden states for task {task!r} (cached: {sorted(hidden)})")
        streams, start = [], 0
        for batch in task_batches:
            stream = family.enter(backbone, batch)
            n = stream.hidden.shape[0]
            cached = hidden[task][start:start + n]
            if cached.shape != stream.hidden.shape:
                raise ValueError(
                    f"task {task!r}: cached states {tuple(hidden[task].shape)} do not match the batches "
                    f"(batch at example {start} has shape {tuple(stream.hidden.shape)})"
                )
            streams.append(stream.with_hidden(cached.to(stream.hidden.dtype)))
            start += n
        out[task] = streams
    return out


@torch.no_grad()
def collect_expert_states(family: Family, experts: Mapping[str, nn.Module], batches: Batches) -> Iterator[dict[str, Tensor]]:
    """Yield, for layer 0..L, each expert's states entering that block (layer L: the last output).

    Each expert runs its own forward on its own task's examples; one layer is held at a time.
    """
    require_uniform(family)
    backbones = {t: family.backbone(experts[t]).eval() for t in batches}
    streams = {t: [family.enter(backbones[t], b) for b in batches[t]] for t in batches}
    n_blocks = len(family.blocks(next(iter(backbones.values()))))
    yield stack_hidden(streams)
    for index in range(n_blocks):
        streams = {t: [family.run_block(backbones[t], index, s) for s in ss] for t, ss in streams.items()}
        yield stack_hidden(streams)


@torch.no_grad()
def merged_entry_states(family: Family, merged: nn.Module, batches: Batches) -> dict[str, Tensor]:
    """The student's states entering block 0: the merged model's embeddings on each task."""
    return stack_hidden(enter_streams(family, family.backbone(merged), batches))


def calibrate_cached_block(
    family: Family,
    index: int,
    merged: nn.Module,
    base: nn.Module,
    experts: Mapping[str, nn.Module],
    batches: Batches,
    student_hidden: Mapping[str, Tensor],
    expert_hidden: Mapping[str, Tensor],
    config: FeatCalConfig,
    expert_out_hidden: Mapping[str, Tensor] | None = None,
) -> BlockResult:
    """Calibrate block `index` of `merged` in place from cached states entering it.

    On the last block, with `config.calibrate_pooler`, the pooler is calibrated too; it needs the
    experts' final states (`expert_out_hidden`, the cache of layer L).
    """
    student_bb = family.backbone(merged).eval()
    base_bb = family.backbone(base).eval()
    expert_bbs = {t: family.backbone(m).eval() for t, m in experts.items()}
    student = streams_from_cache(family, student_bb, batches, student_hidden)
    expert = streams_from_cache(family, student_bb, batches, expert_hidden)
    last = index == len(family.blocks(student_bb)) - 1
    result = calibrate_block(family, index, student_bb, base_bb, expert_bbs, student, expert, config, last=last)
    if last and config.calibrate_pooler:
        if expert_out_hidden is None:
            raise ValueError("calibrating the pooler needs the experts' final states (layer L cache)")
        expert_final = streams_from_cache(family, student_bb, batches, expert_out_hidden)
        result.reports.extend(
            calibrate_pooler(family, student_bb, base_bb, expert_bbs, result.student_next, expert_final, config)
        )
    return result
