"""FeatCal as per-layer steps that exchange hidden states through caches, reading weights lazily.

`collect_expert_layers` runs every expert through its blocks in lockstep and yields one layer of
states at a time; `calibrate_cached_layer` walks one block from the cached states entering it.
Both read from each checkpoint only the tensors of the block they work on (plus the embeddings
a stream needs to enter), through `featcal.calibration.lazy.LazyWeights`, and both run the one walk
(`featcal.calibration.walk`). Chained over every block they compute exactly what `featcal.calibration.walk.calibrate`
computes in one process.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Callable, Iterator, Mapping

import torch
from torch import Tensor

from featcal.calibration.config import FeatCalConfig, resolve_device
from featcal.calibration.calibrate import enter_streams, LayerDrift, ModuleReport, MomentReducer, SumReducer
from featcal.families import family_for
from featcal.families.base import block_prefixes, leaves_stage, outer_prefixes, to_device
from featcal.io.checkpoints import CheckpointReader, empty_backbone, LazyBackbone, module_prefix
from featcal.calibration.lazy import LazyWeights
from featcal.calibration.moments import Moments
from featcal.calibration.walk import Batches, CachedExpertStates, expert_layer_states, split_like, stack_states, walk

PathLike = str | os.PathLike


def collect_expert_layers(expert_dirs: Mapping[str, PathLike], batches: Batches) -> Iterator[dict[str, Tensor]]:
    """For layer 0..L, each expert's states entering that block (layer L: the last block's output),
    every expert on its own task's batches; one block of one expert's weights is read at a time."""
    like = empty_backbone(next(iter(expert_dirs.values())))
    family = family_for(like)
    weights = LazyWeights(family, like, None, {t: expert_dirs[t] for t in batches})
    yield from expert_layer_states(family, weights, batches, len(family.blocks(like)))


@dataclass
class LayerOutput:
    """What one calibrated block hands on: its parameters (named as in the backbone's state dict,
    the pooler's too on the last block), its moment sums, and the student states entering the next."""

    parameters: dict[str, Tensor]
    moments: dict[str, dict[str, Moments]]
    student_next: dict[str, Tensor]
    drift: LayerDrift
    reports: list[ModuleReport]


class LazyStudent:
    """The merged backbone with only block `index`, the tensors every block needs
    (`Family.shared_block_prefixes`) and the parameters outside the blocks (embeddings, final
    norm, pooler: what entering a stream and the pooler step need) in memory, on `device`."""

    def __init__(self, merged_dir: PathLike, index: int, device: torch.device = torch.device("cpu")):
        like = empty_backbone(merged_dir)
        self.family = family_for(like)
        self.lazy = LazyBackbone(like, CheckpointReader(merged_dir))
        self.lazy.move_to(device)   # before anything is read: the block is read onto the device
        self.module = self.lazy.module
        self.index = index
        self.n_blocks = len(self.family.blocks(self.module))
        if not 0 <= index < self.n_blocks:
            raise ValueError(f"{merged_dir}: no block {index}; the model has blocks 0..{self.n_blocks - 1}")
        self.block_prefix = block_prefixes(self.family, self.module)[index]
        self.lazy.load(self.lazy.names_under([self.block_prefix, *self.family.shared_block_prefixes(self.module),
                                              *outer_prefixes(self.family, self.module)]))

    def release_input_embeddings(self) -> None:
        """Drop the token (or patch) embeddings once the streams have entered, where no later block
        of this walk enters a stage again (T5's decoder re-reads them after the encoder's last block):
        a vocabulary × hidden table (0.9 GB on a 1.5B decoder) no block reads."""
        if any(leaves_stage(self.family, self.module, k) for k in range(self.index, self.n_blocks)):
            return
        embeddings = module_prefix(self.module, self.module.get_input_embeddings())
        self.lazy.release(self.lazy.names_under([embeddings]))

    def parameters(self, with_pooler: bool) -> dict[str, Tensor]:
        prefixes = [self.block_prefix]
        if with_pooler and self.family.pooler(self.module) is not None:
            prefixes.append(module_prefix(self.module, self.family.pooler(self.module)))
        return {n: p.detach().cpu().contiguous() for n, p in self.module.state_dict().items()
                if n.startswith(tuple(prefixes))}


def calibrate_cached_layer(
    index: int,
    merged_dir: PathLike,
    base: PathLike,
    expert_dirs: Mapping[str, PathLike],
    batches: Batches,
    student_states: Mapping[str, Tensor] | None,
    expert_states: Callable[[int], Mapping[str, Tensor]],
    config: FeatCalConfig,
    reduce_moments: MomentReducer | None = None,
    reduce_sums: SumReducer | None = None,
    keep_moments: bool = True,
) -> LayerOutput:
    """Walk block `index` alone: the student states entering it (None for block 0: the merged
    embeddings), the experts' cached states (`expert_states(layer)`), weights read lazily from
    `merged_dir`, `base` and `expert_dirs`. On the last block, with `config.calibrate_pooler`, the
    pooler follows (its expert input is the cache of layer L). It computes on `config.device` (`auto`:
    CUDA where torch sees it; `cuda` without it is an error): the block's weights are read onto it
    and the cached states moved there as they enter; what it returns (parameters, the states
    entering the next block) is on the host, the moment sums (if kept) on the device.
    `keep_moments=False`: the output holds no moments, and the solves use up their sums (a lower peak)."""
    device = resolve_device(config.device)
    student = LazyStudent(merged_dir, index, device)
    family = student.family
    weights = LazyWeights(family, student.module, base, {t: expert_dirs[t] for t in batches})
    moments: dict[str, dict[str, Moments]] = {}
    with weights.on(device):
        # the cached states follow the streams' device as they are split (split_like)
        entry = enter_streams(family, student.module, to_device(batches, device))
        student_in = entry if student_states is None else split_like(
            family, index, student_states, entry, {t: student.module for t in entry})
        del entry   # past block 0 only its masks were needed: its embeddings would be held all along
        student.release_input_embeddings()
        result = walk(family, student.module, weights, student_in, CachedExpertStates(family, expert_states), config,
                      start=index, stop=index + 1, reduce_moments=reduce_moments, reduce_sums=reduce_sums,
                      on_block=lambda _k, block: moments.update(block.moments), progress=False,
                      release_memory=True,   # a stage's peak RSS is one block's: keep freed pages out of it
                      keep_moments=keep_moments)
    last = index == student.n_blocks - 1
    return LayerOutput(student.parameters(with_pooler=last and config.calibrate_pooler), moments,
                       stack_states(family, result.student), result.drift[0], result.reports)


__all__ = ["LayerOutput", "LazyStudent", "calibrate_cached_layer", "collect_expert_layers"]

