"""The forward-order walk: the one loop over blocks that every FeatCal entry point runs.

For each block k in [start, stop): capture the calibrated modules' inputs on the student's
uncalibrated block and on each expert's own block, accumulate moments, solve in closed form,
write the update, advance the student on the calibrated block (`calibrate.calibrate_block`).
After the last block of the model, optionally the pooler pseudo-layer.

Three things differ between callers, and each is passed in:

- where weights come from (`BlockWeights`): modules in memory (`ModuleWeights`), or tensors read
  per block from safetensors folders (`featcal.calibration.lazy.LazyWeights`);
- where the experts' states come from (`ExpertStates`): carried forward by the walk itself
  (`CarriedExpertStates`), or read per layer from a cache (`CachedExpertStates`);
- how sums are reduced across processes (`reduce_moments`, `reduce_sums`; `featcal.calibration.distributed`).

The in-process API (`calibrate`, at the end of this module) walks 0..L in memory; `calibrate_lazy`
walks 0..L with lazy weights; a tune trial walks 0..L with cached expert states; a
`calibrate-layer@Lk` stage walks block k alone with lazy weights, cached expert states and the
student states its predecessor wrote.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass, field
from typing import Callable, ContextManager, Iterator, Mapping, Protocol, Sequence

import torch
from torch import Tensor, nn
from tqdm.auto import tqdm

from featcal.calibration.calibrate import (
    BlockResult, calibrate_block, calibrate_pooler, CalibrationResult, check_tasks, enter_streams, ExpertInputCache,
    LayerDrift, ModuleReport,
    MomentReducer, student_backbone, SumReducer,
)
from featcal.calibration.config import FeatCalConfig, resolve_device
from featcal.families import Family, Stream, family_for
from featcal.families.base import to_device
from featcal.profiling import phase

Streams = dict[str, list[Stream]]
Batches = Mapping[str, Sequence[Mapping[str, Tensor]]]


# --- where weights come from ------------------------------------------------------------------------


class BlockWeights(Protocol):
    """The base's and the experts' backbones, holding (at least) the parameters a step needs."""

    def block(self, index: int) -> ContextManager[tuple[nn.Module, dict[str, nn.Module]]]:
        """(base backbone, {task: expert backbone}) with block `index` present."""

    def pooler(self) -> ContextManager[tuple[nn.Module, dict[str, nn.Module]]]:
        """The same with the pooler present."""

    def enter_experts(self, family: Family, batches: Batches) -> Streams:
        """Each expert's own stream entering block 0 on its task's batches."""

    def expert_head_features(self, family: Family, streams: Streams) -> dict[str, list[Tensor]]:
        """Each expert's head features (`family.head_features`) of its task's streams after the last block."""

    def on(self, device: torch.device) -> ContextManager[None]:
        """Inside the block, the weights a step gets are on `device`."""

    def release_expert(self, task: str, names: Sequence[str]) -> None:
        """Expert `task`'s named parameters are not read again in this step (a provider that reads
        them per block may free them now)."""

    def release_base(self, names: Sequence[str]) -> None:
        """The same for the base's named parameters."""


@dataclass
class ModuleWeights:
    """Backbones held whole in memory."""

    base: nn.Module
    experts: dict[str, nn.Module]

    def block(self, index: int) -> ContextManager[tuple[nn.Module, dict[str, nn.Module]]]:
        return contextlib.nullcontext((self.base, self.experts))

    def release_expert(self, task: str, names: Sequence[str]) -> None:
        """Held whole for the walk: nothing is freed."""

    def release_base(self, names: Sequence[str]) -> None:
        """Held whole for the walk: nothing is freed."""

    def pooler(self) -> ContextManager[tuple[nn.Module, dict[str, nn.Module]]]:
        return contextlib.nullcontext((self.base, self.experts))

    def enter_experts(self, family: Family, batches: Batches) -> Streams:
        return {t: [family.enter(self.experts[t], b) for b in bs] for t, bs in batches.items()}

    @torch.no_grad()
    def expert_head_features(self, family: Family, streams: Streams) -> dict[str, list[Tensor]]:
        return {t: [family.head_features(self.experts[t], s) for s in ss] for t, ss in streams.items()}

    @contextlib.contextmanager
    def on(self, device: torch.device) -> Iterator[None]:
        with contextlib.ExitStack() as stack:
            for backbone in [self.base, *self.experts.values()]:
                stack.enter_context(moved(backbone, device))
            yield


@contextlib.contextmanager
def moved(module: nn.Module, device: torch.device) -> Iterator[nn.Module]:
    """`module` on `device` inside the block, back where it was after it (a no-op on its own device)."""
    home = next(module.parameters()).device
    if home == device:
        yield module
        return
    module.to(device)
    try:
        yield module
    finally:
        module.to(home)


# --- where the experts' states come from ------------------------------------------------------------


class ExpertStates(Protocol):
    def at(self, index: int, like: Streams, backbones: Mapping[str, nn.Module]) -> Streams:
        """The experts' streams entering block `index` (`like`: the student's streams there, whose
        masks a cached state is put into; `backbones`: the experts', holding block `index`)."""

    def advance(self, expert_next: Streams) -> None:
        """Block outputs the walk computed for the experts (the streams entering the next block)."""


class CarriedExpertStates:
    """Each expert's block-k output, computed by the walk, is its stream entering block k+1."""

    def __init__(self, streams: Streams):
        self.streams = streams

    def at(self, index: int, like: Streams, backbones: Mapping[str, nn.Module]) -> Streams:
        return self.streams

    def advance(self, expert_next: Streams) -> None:
        self.streams = expert_next


CARRIED = "."   # stored carried tensors are named ".<name>/<task>" (a task name never starts with ".")


def stack_states(family: Family, streams: Mapping[str, Sequence[Stream]]) -> dict[str, Tensor]:
    """What a cache stores of streams: per task, the batches' hidden states concatenated along
    examples ([N, T, d], under the task's name) and the family's carried tensors (".<name>/<task>")."""
    out: dict[str, Tensor] = {}
    for task, ss in streams.items():
        if not ss:
            continue
        out[task] = torch.cat([s.hidden for s in ss]).cpu()
        for name in family.carried(ss[0]):
            out[f"{CARRIED}{name}/{task}"] = torch.cat([family.carried(s)[name] for s in ss]).cpu()
    return out


def states_of(states: Mapping[str, Tensor], tasks: Sequence[str]) -> dict[str, Tensor]:
    """The stored states (hidden and carried) of `tasks` only."""
    return {k: v for k, v in states.items() if k.rsplit("/", 1)[-1] in tasks}


def split_like(family: Family, index: int, states: Mapping[str, Tensor], like: Streams,
               backbones: Mapping[str, nn.Module]) -> Streams:
    """Per task, cut stored states (`stack_states`) into `like`'s batches and resume each as the
    stream of `backbones[task]` entering block `index` (`Family.resume`; `like`: streams on the same
    batches entering block 0 or block `index`)."""
    carried_names = {k[len(CARRIED):].rsplit("/", 1)[0] for k in states if k.startswith(CARRIED)}
    out: Streams = {}
    for task, streams in like.items():
        if task not in states:
            raise KeyError(f"no cached hidden states for task {task!r} (cached: {sorted(k for k in states if not k.startswith(CARRIED))})")
        hidden, start, out[task] = states[task], 0, []
        carried = {n: states[f"{CARRIED}{n}/{task}"] for n in carried_names}
        for stream in streams:
            n = stream.hidden.shape[0]
            part = hidden[start:start + n]
            # a state carrying more (T5's decoder) may resume from a `like` of another length
            expected = stream.hidden.shape if not carried else (n, *part.shape[1:-1], stream.hidden.shape[-1])
            if part.shape != expected:
                raise ValueError(
                    f"task {task!r}: cached states {tuple(hidden.shape)} do not match the calibration batches "
                    f"(batch at example {start} has shape {tuple(stream.hidden.shape)})"
                )
            cast = dict(device=stream.hidden.device, dtype=stream.hidden.dtype)
            parts = {name: value[start:start + n].to(**cast) for name, value in carried.items()}
            out[task].append(family.resume(backbones[task], index, stream, part.to(**cast), parts))
            start += n
        if start != hidden.shape[0]:
            raise ValueError(f"task {task!r}: {hidden.shape[0]} cached examples, the batches hold {start}")
    return out


class CachedExpertStates:
    """The experts' states entering each block, read from a cache (`load(layer)`: `stack_states`' dict)."""

    def __init__(self, family: Family, load: Callable[[int], Mapping[str, Tensor]]):
        self.family, self.load = family, load

    def at(self, index: int, like: Streams, backbones: Mapping[str, nn.Module]) -> Streams:
        with phase("cache I/O"):
            return split_like(self.family, index, self.load(index), like, backbones)

    def advance(self, expert_next: Streams) -> None:
        pass


# --- the walk ---------------------------------------------------------------------------------------


@dataclass
class WalkResult:
    drift: list[LayerDrift] = field(default_factory=list)
    reports: list[ModuleReport] = field(default_factory=list)
    student: Streams = field(default_factory=dict)   # the student's streams entering block `stop`


def walk(
    family: Family,
    student: nn.Module,
    weights: BlockWeights,
    student_in: Streams,
    experts: ExpertStates,
    config: FeatCalConfig,
    *,
    start: int = 0,
    stop: int | None = None,
    reduce_moments: MomentReducer | None = None,
    reduce_sums: SumReducer | None = None,
    on_block: Callable[[int, BlockResult], None] | None = None,
    progress: bool = True,
    desc: str = "featcal",
    release_memory: bool = False,
    measure_drift: bool = True,
    expert_inputs: ExpertInputCache | None = None,
    keep_moments: bool = True,
) -> WalkResult:
    """Calibrate blocks `start`..`stop`−1 of the `student` backbone in place, in forward order.

    `student_in` are the student's streams entering block `start`. When the walk reaches the end of
    the model and `config.calibrate_pooler` is set, the pooler follows as a last pseudo-layer.
    `on_block(k, result)` sees each block's result (moments, updates) before it is dropped.
    `release_memory`: see `calibrate_block` (the calibrate-layer stage sets it). `expert_inputs`: the
    experts' module inputs kept across walks (a tuning study's; with cached expert states only): a block
    it holds reads no expert state and runs no expert forward. `keep_moments=False`: `on_block` sees no
    moments (the solves use up their sums: see `calibrate_block`).
    """
    if expert_inputs is not None and not isinstance(experts, CachedExpertStates):
        raise ValueError("an expert input cache needs the experts' states from a cache (CachedExpertStates)")
    n_blocks = len(family.blocks(student))
    stop = n_blocks if stop is None else stop
    if not 0 <= start < stop <= n_blocks:
        raise ValueError(f"blocks {start}..{stop - 1}: the model has blocks 0..{n_blocks - 1}")
    pooled = config.calibrate_pooler and family.pooler(student) is not None
    config.check_layers(n_blocks + pooled)   # an override of a layer the model lacks is an error
    out = WalkResult(student=student_in)
    for index in tqdm(range(start, stop), desc=desc, unit="layer", disable=not progress):
        with weights.block(index) as (base_bb, expert_bbs):
            held = expert_inputs is not None and expert_inputs.holds(index, config.products)
            expert_in = {} if held else experts.at(index, out.student, expert_bbs)
            result = calibrate_block(
                family, index, student, base_bb, expert_bbs, out.student, expert_in, config,
                last=index == n_blocks - 1, reduce_moments=reduce_moments, reduce_sums=reduce_sums,
                release_memory=release_memory, measure_drift=measure_drift, expert_inputs=expert_inputs,
                keep_moments=keep_moments, release_expert=weights.release_expert, release_base=weights.release_base,
            )
        if on_block is not None:
            on_block(index, result)
        experts.advance(result.expert_next)
        out.student = result.student_next
        if result.drift is not None:
            out.drift.append(result.drift)
        out.reports.extend(result.reports)
        del result  # this block's moments are not kept while the next block gathers its own
    if stop == n_blocks and config.calibrate_pooler and family.pooler(student) is not None:
        with weights.pooler() as (base_bb, expert_bbs):
            expert_final = experts.at(n_blocks, out.student, expert_bbs)
            out.reports.extend(calibrate_pooler(
                family, student, base_bb, expert_bbs, out.student, expert_final, config, reduce_moments,
            ))
    return out


def walk_all(
    family: Family,
    student: nn.Module,
    weights: BlockWeights,
    batches: Batches,
    config: FeatCalConfig,
    expert_states: ExpertStates | None = None,
    **kwargs,
) -> WalkResult:
    """The whole model: enter the student (and, unless `expert_states` are given, the experts)
    on the calibration batches, then walk blocks 0..L, on `config.device`. The student's weights
    end where they were; the returned streams stay on the device."""
    device = resolve_device(config.device)
    with weights.on(device), moved(student, device):
        batches = to_device(batches, device)
        with phase("enter forwards"):
            student_in = enter_streams(family, student, batches)
            if expert_states is None:
                expert_states = CarriedExpertStates(weights.enter_experts(family, batches))
        return walk(family, student, weights, student_in, expert_states, config, **kwargs)


@torch.no_grad()
def expert_layer_states(family: Family, weights: BlockWeights, batches: Batches, n_blocks: int) -> Iterator[dict[str, Tensor]]:
    """Yield, for layer 0..L, each expert's states entering that block (layer L: the last output).

    Each expert runs its own forward on its own task's examples; one layer of states is held at a
    time, and only the weights `weights.block(k)` holds.
    """
    streams = weights.enter_experts(family, batches)
    yield stack_states(family, streams)
    for index in range(n_blocks):
        with weights.block(index) as (_, experts):
            streams = {t: [family.run_block(experts[t], index, s) for s in ss] for t, ss in streams.items()}
        yield stack_states(family, streams)


# --- the same forward order with a caller's own per-block step (RegMean, RegMean++) -----------------

BlockStep = Callable[[int, nn.Module, dict[str, nn.Module], Streams], Streams]


def walk_blocks(
    weights: BlockWeights,
    streams: Streams,
    step: BlockStep,
    *,
    n_blocks: int,
    progress: bool = True,
    desc: str = "blocks",
) -> Streams:
    """Blocks 0..n_blocks−1 in forward order, with `step` in place of FeatCal's calibration step.

    `step(k, base, experts, streams)` gets block k of the base and of each expert (as
    `weights.block(k)` holds them) and the streams entering block k, and returns the streams
    entering block k+1 (whose they are is the step's choice: each expert's own, or a merged
    prefix's). Returns the streams after the last block. `walk` is the FeatCal loop; this one
    lets the anchor merges that need block inputs (RegMean, RegMean++) share its order and weights.
    """
    for index in tqdm(range(n_blocks), desc=desc, unit="layer", disable=not progress):
        with weights.block(index) as (base_bb, expert_bbs):
            streams = step(index, base_bb, expert_bbs, streams)
    return streams


def calibrate(
    merged: nn.Module,
    base: nn.Module,
    experts: Mapping[str, nn.Module],
    batches: Mapping[str, Sequence[Mapping[str, Tensor]]],
    config: FeatCalConfig | None = None,
    family: Family | None = None,
    inplace: bool = False,
    progress: bool = True,
    reduce_moments: MomentReducer | None = None,
    reduce_sums: SumReducer | None = None,
) -> CalibrationResult:
    """FeatCal in forward order on a merged model, everything in memory (the walk above).

    `merged`, `base` and each `experts[task]` are models of one family (full task models or bare
    backbones); `batches[task]` are tokenised calibration batches of that task (labels unused).
    Returns the calibrated backbone (a copy unless `inplace`). `reduce_moments` / `reduce_sums`
    make it one process of a data-parallel run (`featcal.calibration.distributed`); by default none.
    For experts read one layer at a time from safetensors files, see `featcal.calibration.lazy.calibrate_lazy`.
    """
    family = family or family_for(merged)
    check_tasks(batches, experts, family.backbone(merged))
    student = student_backbone(family, merged, inplace)
    weights = ModuleWeights(family.backbone(base).eval(), {t: family.backbone(m).eval() for t, m in experts.items()})
    result = walk_all(family, student, weights, batches, config or FeatCalConfig(), progress=progress,
                      reduce_moments=reduce_moments, reduce_sums=reduce_sums)
    return CalibrationResult(student, result.drift, result.reports)
