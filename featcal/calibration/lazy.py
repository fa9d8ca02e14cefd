"""FeatCal with the base and the experts read one block at a time from their checkpoints.

`LazyWeights` gives the walk (`featcal.calibration.walk`) one block of the base and of every expert
at a time (plus, for the expert streams' entry, each expert's embeddings while its stream is
built); `calibrate_lazy` is the whole-model walk with it. Peak memory then grows with one layer ×
number of experts instead of the whole model × number of experts.
"""

from __future__ import annotations

import contextlib
import os
from typing import Mapping, Sequence

import torch
from torch import Tensor, nn

from featcal.calibration.calibrate import CalibrationResult, check_tasks, MomentReducer, student_backbone, SumReducer
from featcal.calibration.config import FeatCalConfig
from featcal.calibration.walk import walk_all
from featcal.families import Family, family_for
from featcal.families.base import block_prefixes, leaves_stage, outer_prefixes
from featcal.io.checkpoints import CheckpointReader, LazyBackbone, module_prefix


class LazyWeights:
    """`featcal.calibration.walk.BlockWeights` read from safetensors folders: a step holds one block (or the
    pooler) of the base and of each expert; each expert's embeddings only while its stream enters.

    `like` is the backbone whose shape the checkpoints have (the student, or `empty_backbone`).
    """

    def __init__(self, family: Family, like: nn.Module, base: str | os.PathLike | None,
                 experts: Mapping[str, str | os.PathLike]):
        self.family, self.like = family, like
        self.base = None if base is None else LazyBackbone(like, CheckpointReader(base))  # None: experts only
        self.experts = {t: LazyBackbone(like, CheckpointReader(path)) for t, path in experts.items()}
        self.outer = outer_prefixes(family, like)
        self.blocks = block_prefixes(family, like)
        self.shared = family.shared_block_prefixes(like)

    @contextlib.contextmanager
    def _loaded(self, base_prefixes: list[str], expert_prefixes: list[str]):
        with contextlib.ExitStack() as stack:
            base = None if self.base is None else stack.enter_context(self.base.loaded(base_prefixes))
            experts = {t: stack.enter_context(e.loaded(expert_prefixes)) for t, e in self.experts.items()}
            yield base, experts

    @contextlib.contextmanager
    def on(self, device: torch.device):
        """Read every tensor onto `device` inside the block (the host again after it)."""
        lazy = ([] if self.base is None else [self.base]) + list(self.experts.values())
        for backbone in lazy:
            backbone.move_to(device)
        try:
            yield
        finally:
            for backbone in lazy:
                backbone.move_to(torch.device("cpu"))

    def block(self, index: int):
        """Block `index` of the base; of each expert also the tensors every block needs and, when the
        block leaves its stage (T5's last encoder block), the parameters outside the blocks."""
        leaves = leaves_stage(self.family, self.like, index)
        expert = [self.blocks[index], *self.shared] + (self.outer if leaves else [])
        return self._loaded([self.blocks[index]], expert)

    def release_expert(self, task: str, names: Sequence[str]) -> None:
        """Back to the meta device before the block's context ends (which releases them again: a no-op)."""
        self.experts[task].release(names)

    def release_base(self, names: Sequence[str]) -> None:
        """The same for the base's."""
        if self.base is not None:
            self.base.release(names)

    def pooler(self):
        where = [module_prefix(self.like, self.family.pooler(self.like))]
        return self._loaded(where, where)

    def enter_experts(self, family: Family, batches) -> dict:
        streams = {}
        for task, task_batches in batches.items():
            if not task_batches:  # possible on one process of a data-parallel run
                streams[task] = []
                continue
            with self.experts[task].loaded(self.outer) as expert:
                streams[task] = [family.enter(expert, b) for b in task_batches]
        return streams

    @torch.no_grad()
    def expert_head_features(self, family: Family, streams) -> dict[str, list[Tensor]]:
        """Each expert's non-block tensors only while its own features are taken (one expert at a time)."""
        out = {}
        for task, task_streams in streams.items():
            if not task_streams:
                out[task] = []
                continue
            with self.experts[task].loaded(self.outer) as expert:
                out[task] = [family.head_features(expert, s) for s in task_streams]
        return out


def calibrate_lazy(
    merged: nn.Module,
    base_dir: str | os.PathLike,
    expert_dirs: Mapping[str, str | os.PathLike],
    batches: Mapping[str, Sequence[Mapping[str, Tensor]]],
    config: FeatCalConfig | None = None,
    family: Family | None = None,
    inplace: bool = False,
    progress: bool = True,
    reduce_moments: MomentReducer | None = None,
    reduce_sums: SumReducer | None = None,
) -> CalibrationResult:
    """`featcal.calibration.walk.calibrate` with the base and the experts read from safetensors folders
    one block at a time (`LazyWeights`), instead of loaded whole.

    `merged` is in memory (it becomes the calibrated model). `base_dir` and `expert_dirs[task]` are
    Hugging Face model folders (task models or bare backbones, single-file or sharded). Parameters
    are cast to the merged model's dtypes. Gives the same result as `calibrate` with the same
    experts loaded whole.
    """
    family = family or family_for(merged)
    check_tasks(batches, expert_dirs, family.backbone(merged))
    student = student_backbone(family, merged, inplace)
    weights = LazyWeights(family, student, base_dir, {t: expert_dirs[t] for t in batches})
    result = walk_all(family, student, weights, batches, config or FeatCalConfig(), progress=progress,
                      desc="featcal (lazy)", reduce_moments=reduce_moments, reduce_sums=reduce_sums)
    return CalibrationResult(student, result.drift, result.reports)
