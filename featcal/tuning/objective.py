"""The tuning objective: FeatCal's α, ρ, λ scored on the dev split of the calibrated model.

A trial runs the whole forward-order calibration in this process from cached states: the experts'
states entering every block (computed once, never re-run here) and the calibration token inputs.
It then scores each task's dev split with that task's head on the calibrated backbone. Dev
examples whose tokens also appear in the calibration sample are dropped from scoring; the test
split is never read. Where the study lives and how trials are shared is `featcal.tuning.study`.
"""

from __future__ import annotations

import copy
import dataclasses
import hashlib
import logging
import os
import statistics
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Mapping, Sequence

import numpy as np
import optuna
import torch
from optuna.trial import Trial
from torch import Tensor, nn

from featcal.calibration.calibrate import ExpertInputCache
from featcal.calibration.spill import BlockSpill
from featcal.calibration.config import FeatCalConfig, HYPER_KEYS
from featcal.data.splits import TaskSplit, arrays_by_task, batches_from_arrays, read_split
from featcal.evaluation.scoring import score_backbone
from featcal.families import Family, family_for
from featcal.data.encoders import InputEncoder, load_encoder
from featcal.io.models import load_backbone, load_classifier
from featcal.io.feature_store import read_group
from featcal.calibration.walk import CachedExpertStates, ModuleWeights, states_of, walk_all
from featcal.merging.registry import MergeContext, data_options, needs_of

log = logging.getLogger(__name__)

@dataclass(frozen=True)
class Range:
    low: float
    high: float
    log: bool = False

    def __post_init__(self) -> None:
        if not self.low < self.high:
            raise ValueError(f"range low {self.low} must be below high {self.high}")
        if self.log and self.low <= 0:
            raise ValueError(f"a log range needs low > 0, got {self.low}")

    def __contains__(self, value: float) -> bool:
        return self.low <= value <= self.high

    @classmethod
    def parse(cls, name: str, spec) -> "Range":
        if isinstance(spec, Mapping):
            bad = set(spec) - {"low", "high", "log"}
            if bad:
                raise ValueError(f"tune.search.{name}: unknown keys {sorted(bad)} (use low, high, log)")
            return cls(float(spec["low"]), float(spec["high"]), bool(spec.get("log", False)))
        if isinstance(spec, Sequence) and not isinstance(spec, str) and len(spec) == 2:
            return cls(float(spec[0]), float(spec[1]))
        raise ValueError(f"tune.search.{name}: expected [low, high] or {{low, high, log}}, got {spec!r}")


def split_key(key: str) -> tuple[str, int | None]:
    """A searched key as (hyperparameter, block): "alpha" -> ("alpha", None), "alpha@3" -> ("alpha", 3);
    ValueError for anything else."""
    hyper, at, block = key.partition("@")
    if hyper not in HYPER_KEYS or (at and not block.isdigit()):
        raise ValueError(f"tune.search: unknown hyperparameter {key!r}; searchable: {', '.join(HYPER_KEYS)}, "
                         "each also per block as KEY@BLOCK (e.g. alpha@0)")
    return hyper, int(block) if at else None


def config_with(base: FeatCalConfig, values: Mapping[str, float]) -> FeatCalConfig:
    """`base` with searched values: plain keys replace its α, ρ, λ; KEY@BLOCK ones go into its
    layer_overrides (over what it already overrides there)."""
    plain, overrides = {}, {k: dict(v) for k, v in base.layer_overrides.items()}
    for key, value in values.items():
        hyper, block = split_key(key)
        if block is None:
            plain[hyper] = value
        else:
            overrides.setdefault(block, {})[hyper] = value
    return dataclasses.replace(base, **plain, layer_overrides=overrides)


@dataclass(frozen=True)
class SearchSpace:
    """The hyperparameters searched and their ranges; the others keep their FeatCalConfig value.
    A key is α, ρ or λ for every block, or KEY@BLOCK for one block (per-layer α: alpha@0, alpha@1, ...;
    the plain key then holds for the blocks not named and the pooler)."""

    ranges: Mapping[str, Range] = field(default_factory=lambda: {
        "alpha": Range(0.0, 1.0), "rho": Range(0.5, 3.0), "ridge": Range(1e-5, 1.0, log=True)})

    def __post_init__(self) -> None:
        for key in self.ranges:
            split_key(key)
        if not self.ranges:
            raise ValueError("tune.search: nothing to search")

    @classmethod
    def from_mapping(cls, values: Mapping) -> "SearchSpace":
        return cls({k: Range.parse(k, v) for k, v in values.items()})

    def blocks(self) -> set[int]:
        """The blocks searched on their own (KEY@BLOCK keys)."""
        return {b for b in (split_key(k)[1] for k in self.ranges) if b is not None}

    def suggest(self, trial: Trial) -> dict[str, float]:
        return {k: trial.suggest_float(k, r.low, r.high, log=r.log) for k, r in self.ranges.items()}

    def defaults(self, base: FeatCalConfig) -> dict[str, float]:
        """The searched keys' values in `base` (a block's own value where it overrides one)."""
        out = {}
        for key in self.ranges:
            hyper, block = split_key(key)
            out[key] = getattr(base, hyper) if block is None else getattr(base.for_layer(block), hyper)
        return out

    def contains(self, values: Mapping[str, float]) -> bool:
        return all(values[k] in r for k, r in self.ranges.items())


# what the experts' captured block inputs may hold in a study by default (the demo's take ~4.5 GiB)
DEFAULT_EXPERT_CACHE_MIB = 8192

# the needs of a data merge a TuneProblem supplies from what it holds (`TuneProblem.merge_context`)
SUPPLIED_NEEDS = frozenset({"activations", "dev_scores", "shared_examples"})


@dataclass(frozen=True)
class AnchorSearch:
    """The anchor merge's own knobs (TA's scale, TIES' density, SigMerge's c_min, c_max, ...)
    searched next to a method's: each trial merges the base and the experts in memory with its
    values. Data-free methods, and data methods whose needs the problem holds (`SUPPLIED_NEEDS`:
    train batches, dev scores, shared examples). Trial parameters are named `anchor.<option>`;
    `options` holds the fixed ones (the params' merge.options without the data options), `data` the
    data options (e.g. shared_examples_per_task)."""

    method: str
    options: Mapping[str, object]
    ranges: Mapping[str, Range]
    data: Mapping[str, int] = field(default_factory=dict)

    PREFIX = "anchor."

    def __post_init__(self) -> None:
        from featcal.merging.registry import build_options

        unsupplied = needs_of(self.method, self.options) - SUPPLIED_NEEDS
        if unsupplied:
            raise ValueError(f"tune.anchor_search: merge method {self.method!r} needs data "
                             f"({', '.join(sorted(unsupplied))}) a trial cannot supply; searchable: data-free "
                             f"anchors and methods needing only {', '.join(sorted(SUPPLIED_NEEDS))}")
        if not self.ranges:
            raise ValueError("tune.anchor_search: nothing to search")
        for key, rng in self.ranges.items():   # unknown options and out-of-bounds ranges fail here
            for value in (rng.low, rng.high):
                build_options(self.method, {**self.options, key: value})

    def suggest_options(self, trial: Trial) -> dict[str, object]:
        """The merge options of this trial: its `anchor.*` suggestions over the fixed ones."""
        searched = {k: trial.suggest_float(self.PREFIX + k, r.low, r.high, log=r.log) for k, r in self.ranges.items()}
        return {**self.options, **searched}

    def defaults(self) -> dict[str, float]:
        """The fixed options' values of the searched knobs (method defaults where not given), as
        trial parameters, for the first trial; {} if one lies outside its range."""
        from featcal.merging.registry import build_options

        built = build_options(self.method, dict(self.options))
        values = {k: float(getattr(built, k)) for k in self.ranges}
        inside = all(v in self.ranges[k] for k, v in values.items())
        return {self.PREFIX + k: v for k, v in values.items()} if inside else {}

    def options_of(self, params: Mapping[str, float]) -> dict[str, object]:
        """The merge options of a trial's parameters (its `anchor.*` values over the fixed ones)."""
        searched = {k[len(self.PREFIX):]: v for k, v in params.items() if k.startswith(self.PREFIX)}
        return {**self.options, **searched}


# --- the problem a trial solves ----------------------------------------------------------------------


@dataclass
class DevSplit:
    """A task's dev examples used for scoring (calibration look-alikes removed) and their length."""

    split: TaskSplit
    max_length: int
    dropped: int = 0


def drop_calibration_overlap(split: TaskSplit, encoder: InputEncoder, max_length: int,
                             inputs: Mapping[str, Tensor]) -> tuple[TaskSplit, int]:
    """Remove examples the model sees exactly as one of the calibration rows (token ids of the real
    tokens; pixels), so a dev score never rewards fitting an example that calibration saw."""
    seen = set(encoder.input_identities(inputs))
    encoded = encoder.identities(split.examples, max_length)
    keep = [i for i, ids in enumerate(encoded) if ids not in seen]
    kept = split.subset(keep)
    return kept, len(split.examples) - len(keep)


class TuneProblem:
    """Everything a trial needs, loaded once: the merged backbone (never modified), the base, the
    experts, the calibration batches, the experts' cached states per block, their module inputs per
    block once a trial has captured them (`expert_cache_bytes` bounds that memory, 8 GiB by default;
    None unbounded, 0 off; the blocks past it go to `expert_spill`, a `BlockSpill` on disk, where given)
    and the dev splits;
    `train_batches(n)` gives a data anchor (RegMean inside SigMerge) the merge stage's train sample."""

    def __init__(
        self,
        merged: nn.Module,
        base: nn.Module,
        experts: Mapping[str, nn.Module],
        batches: Mapping[str, list[dict[str, Tensor]]],
        expert_states: Callable[[int], Mapping[str, Tensor]],
        dev: Mapping[str, DevSplit],
        encoder: InputEncoder,
        family: Family | None = None,
        train_batches: Callable[[int], Mapping[str, Sequence[Mapping[str, Tensor]]]] | None = None,
        expert_cache_bytes: int | None = DEFAULT_EXPERT_CACHE_MIB * 2**20,
        expert_spill: BlockSpill | None = None,
    ):
        self.family = family or family_for(merged)
        self.merged = self.family.backbone(merged).eval()
        self.base, self.experts, self.batches = base, dict(experts), dict(batches)
        self.dev, self.encoder = dict(dev), encoder
        missing = set(self.dev) - set(self.experts)
        if missing:
            raise KeyError(f"dev splits for tasks without an expert: {sorted(missing)}")
        self._expert_states = expert_states
        self._states: dict[int, Mapping[str, Tensor]] = {}
        self.n_blocks = len(self.family.blocks(self.merged))
        self.weights = ModuleWeights(self.family.backbone(base).eval(),
                                     {t: self.family.backbone(m).eval() for t, m in self.experts.items()})
        # scoring swaps backbones into copies of the task models; the experts stay untouched
        self._scorers = {t: copy.deepcopy(self.experts[t]).eval() for t in self.dev}
        self._last_merge: tuple[tuple, nn.Module] | None = None
        self._dev_of: dict[str, dict[str, float]] = {}   # backbone digest -> dev scores (data anchors)
        self._merge_caches: dict[tuple, dict] = {}        # (method, data options) -> MergeContext.cache
        self._train_batches = train_batches               # n -> each task's first n train examples, batched
        self._train_of: dict[int, Mapping[str, Sequence[Mapping[str, Tensor]]]] = {}
        # the experts' module inputs of every block, captured in the first trial (None: every trial runs them)
        self.expert_inputs = ExpertInputCache(expert_cache_bytes, expert_spill) if expert_cache_bytes != 0 else None
        self._leading: dict[int, dict[str, list[dict[str, Tensor]]]] = {}   # n -> each task's first n examples

    def states(self, layer: int) -> Mapping[str, Tensor]:
        if layer not in self._states:
            self._states[layer] = self._expert_states(layer)
        return self._states[layer]

    def merged_with(self, anchor: AnchorSearch | None, options: Mapping[str, object] | None = None) -> nn.Module:
        """The merged backbone for `options` of `anchor`'s method (the loaded one without an anchor
        search); the last merge is kept, so trials with the same options merge once."""
        if anchor is None:
            return self.merged
        options = dict(options or {})
        key = (anchor.method, repr(sorted(options.items())))
        if self._last_merge is None or self._last_merge[0] != key:
            from featcal.merging.in_memory import merge_models

            self._last_merge = None   # the previous merge freed before the next is built
            merged = merge_models(self.base, self.experts, anchor.method, options, self.merge_context(anchor))
            self._last_merge = (key, self.family.backbone(merged).eval())
        return self._last_merge[1]

    def merge_context(self, anchor: AnchorSearch) -> MergeContext | None:
        """What a data anchor reads (`SUPPLIED_NEEDS`), from what the problem holds: dev scores on the
        tuning dev split, each distinct backbone scored once (SigMerge's inner anchor is the same in
        every trial that keeps its options), the train batches from `train_batches` (the merge
        stage's sample, built once per size), and as the shared examples each task's first
        calibration examples (the merge stage's are the same prefix of the same sample). What the
        method keeps between merges (`MergeContext.cache`) lives as long as the problem. None for
        data-free methods."""
        needs = needs_of(anchor.method, anchor.options)
        if not needs:
            return None
        data = {**data_options(anchor.method, anchor.options), **dict(anchor.data)}
        context = MergeContext(cache=self._merge_caches.setdefault((anchor.method, repr(sorted(data.items()))), {}))
        if "activations" in needs:
            n = int(data["examples_per_task"])
            if self._train_batches is None:
                raise ValueError(f"merge method {anchor.method!r} with {dict(anchor.options)} reads train batches; "
                                 "this problem was built without them (TuneProblem(train_batches=...), or load_problem)")
            if n not in self._train_of:
                self._train_of[n] = self._train_batches(n)
            context.batches = self._train_of[n]
        if "dev_scores" in needs:
            context.score_dev = self.score_once
            context.expert_dev = {t: self.score_once(self.family.backbone(self.experts[t]))[t] for t in self.dev}
        if "shared_examples" in needs:
            n = int(data["shared_examples_per_task"])
            context.shared_batches = [b for t in self.experts for b in leading_examples(self.batches[t], n)]
        return context

    def score_once(self, backbone: nn.Module) -> dict[str, float]:
        """`score`, remembered per backbone weights: a data anchor re-scores the same inner merge every trial."""
        h = hashlib.blake2b(digest_size=20)
        hash_module(h, backbone)
        key = h.hexdigest()
        if key not in self._dev_of:
            self._dev_of[key] = self.score(backbone)
        return self._dev_of[key]

    def calibration_batches(self, examples_per_task: int | None = None) -> Mapping[str, list[dict[str, Tensor]]]:
        """Each task's calibration batches, or only its first `examples_per_task` examples (a trial of a
        reduced-fidelity search); more than a task has is refused, naming `tune.trial_examples_per_task`."""
        if examples_per_task is None:
            return self.batches
        if examples_per_task not in self._leading:
            have = {t: sum(map(examples_in, batches)) for t, batches in self.batches.items()}
            short = {t: n for t, n in have.items() if n < examples_per_task}
            if examples_per_task < 1 or short:
                raise ValueError(f"tune.trial_examples_per_task: {examples_per_task} calibration examples per task "
                                 f"asked; the calibration sample holds {have} (calibration.examples_per_task)")
            self._leading[examples_per_task] = {t: leading_examples(b, examples_per_task)
                                                for t, b in self.batches.items()}
        return self._leading[examples_per_task]

    def calibrate(self, config: FeatCalConfig, after_block: Callable[[int, nn.Module], None] | None = None,
                  merged: nn.Module | None = None, examples_per_task: int | None = None) -> nn.Module:
        """A calibrated copy of the merged backbone (or of `merged`, e.g. `merged_with`'s): the walk,
        with the experts' states from the cache; on each task's first `examples_per_task` calibration
        examples only, where given (the experts' cached states are cut the same way).

        `config`'s λ is the whole sample's: on fewer examples the walk uses λ·N/n (`ridge_scaled`). The
        solve weighs λ against *means* over the rows, so on n of N examples an unscaled λ would weigh
        N/n times as much against the data as it does on all of them, and a reduced-fidelity search
        would rank its values for a sample it will not be calibrated on (on the demo, 32 of 128
        examples: rank correlation with the full sample's dev scores −0.12 unscaled, 0.89 scaled)."""
        batches = self.calibration_batches(examples_per_task)
        if examples_per_task is not None:
            whole = sum(examples_in(b) for bs in self.batches.values() for b in bs)
            config = ridge_scaled(config, whole / sum(examples_in(b) for bs in batches.values() for b in bs))
        backbone = copy.deepcopy(self.merged if merged is None else merged)

        def on_block(k: int, _result) -> None:
            if after_block is not None and k < self.n_blocks - 1:
                after_block(k, backbone)

        inputs = None if self.expert_inputs is None else self.expert_inputs.for_examples(examples_per_task)
        states = self.states if examples_per_task is None else \
            (lambda layer: {k: v[:examples_per_task] for k, v in self.states(layer).items()})
        walk_all(self.family, backbone, self.weights, batches, config,   # a trial reads its dev score, no drift
                 expert_states=CachedExpertStates(self.family, states), on_block=on_block, progress=False,
                 measure_drift=False, expert_inputs=inputs)
        return backbone

    @torch.no_grad()
    def score(self, backbone: nn.Module, splits: Mapping[str, TaskSplit] | None = None) -> dict[str, float]:
        """Dev accuracy per task (or on `splits`), each task's head on `backbone`
        (`featcal.evaluation.scoring.score_backbone`)."""
        splits = {t: d.split for t, d in self.dev.items()} if splits is None else splits
        return score_backbone(backbone, self._scorers, self.encoder, {t: splits[t] for t in self.dev},
                              {t: d.max_length for t, d in self.dev.items()})

    def fingerprint(self, config: FeatCalConfig, space: SearchSpace, anchor: AnchorSearch | None = None,
                    examples_per_task: int | None = None) -> str:
        """A digest of what a trial's score depends on apart from the searched values: models,
        cached states, calibration inputs, dev data, the fixed FeatCal settings, with an anchor
        search its method and fixed options, and the trials' calibration examples per task if cut."""
        h = hashlib.blake2b(digest_size=20)
        hash_module(h, self.merged)
        hash_module(h, self.family.backbone(self.base))
        for task in sorted(self.experts):
            h.update(task.encode())
            hash_module(h, self.experts[task])
            for batch in self.batches[task]:
                for key in sorted(batch):
                    hash_tensor(h, batch[key])
        for layer in range(self.n_blocks + (1 if config.calibrate_pooler else 0)):
            for task, value in sorted(self.states(layer).items()):
                h.update(f"{layer}/{task}".encode())
                hash_tensor(h, value)
        for task, d in sorted(self.dev.items()):
            h.update(f"{task}/{d.max_length}/{len(d.split.examples)}".encode())
            # texts hash exactly as before images existed: an existing study keeps its fingerprint
            h.update(b"\0".join(x if isinstance(x, bytes) else x.encode() for x in d.split.examples))
            hash_tensor(h, d.split.labels)
        fixed = {k: v for k, v in dataclasses.asdict(config).items() if k not in space.ranges}
        h.update(repr(sorted(fixed.items())).encode())
        if anchor is not None:   # (a study without one keeps the fingerprint it always had)
            fixed_options = {k: v for k, v in anchor.options.items() if k not in anchor.ranges}
            h.update(repr((anchor.method, sorted(fixed_options.items()), sorted(anchor.ranges))).encode())
            if anchor.data:
                h.update(repr(sorted(anchor.data.items())).encode())
        if examples_per_task is not None:   # (a study on every example keeps the fingerprint it always had)
            h.update(f"trial_examples_per_task={examples_per_task}; ridge scaled by N/n".encode())
        return h.hexdigest()


def hash_tensor(h, t: Tensor) -> None:
    """Feed a tensor's dtype, shape and bytes to the hash `h`."""
    h.update(str((t.dtype, tuple(t.shape))).encode())
    h.update(np.ascontiguousarray(t.detach().cpu().numpy()).data)


def hash_module(h, m: nn.Module) -> None:
    """Feed a module's state (names and tensors, sorted by name) to the hash `h`."""
    for name, value in sorted(m.state_dict().items()):
        h.update(name.encode())
        hash_tensor(h, value)


def ridge_scaled(config: FeatCalConfig, factor: float) -> FeatCalConfig:
    """`config` with λ, and every layer's λ override, times `factor`."""
    overrides = {layer: {**values, "ridge": values["ridge"] * factor} if "ridge" in values else dict(values)
                 for layer, values in config.layer_overrides.items()}
    return dataclasses.replace(config, ridge=config.ridge * factor, layer_overrides=overrides)


def examples_in(batch: Mapping[str, Tensor]) -> int:
    """How many examples a batch holds (every tensor's first dimension)."""
    return len(next(iter(batch.values())))


def leading_examples(batches: Sequence[Mapping[str, Tensor]], n: int) -> list[dict[str, Tensor]]:
    """The first `n` examples of a batch list, as batches (the last one cut short)."""
    out, left = [], n
    for batch in batches:
        if left <= 0:
            break
        size = examples_in(batch)
        out.append({k: v[:left] for k, v in batch.items()} if size > left else dict(batch))
        left -= size
    return out


def load_problem(
    *, base: str, tasks: Sequence[str], max_length: Mapping[str, int], batch_size: int,
    merged: str | os.PathLike, experts_dir: str | os.PathLike, features: str | os.PathLike,
    tasks_dir: str | os.PathLike, seed: int = 0, expert_cache_mib: int | None = DEFAULT_EXPERT_CACHE_MIB,
    expert_spill: BlockSpill | None = None,
) -> TuneProblem:
    """Load a problem from files: `merged` (multi-task folder), `experts_dir/<task>`, the
    expert-feature caches `features/{inputs,layer_XX}.zarr` and `tasks_dir/<task>/dev.parquet`;
    a data anchor's train batches are the merge stage's (`tasks_dir`'s train split, `seed`).
    `expert_cache_mib`: the memory the experts' captured block inputs may take, `expert_spill` where
    the blocks past it go (TuneProblem)."""
    features = Path(features)
    encoder = load_encoder(str(merged))
    inputs = read_group(features / "inputs.zarr")
    batches = batches_from_arrays(inputs, batch_size)
    missing = set(tasks) - set(batches)
    if missing:
        raise KeyError(f"{features / 'inputs.zarr'} has no calibration inputs for {sorted(missing)}")
    batches = {t: batches[t] for t in tasks}
    dev = {}
    for task in tasks:
        split, dropped = drop_calibration_overlap(read_split(tasks_dir, task, "dev"), encoder, max_length[task],
                                                  arrays_by_task(inputs)[task])
        if not split.examples:
            raise ValueError(f"task {task!r}: every dev example is also in the calibration sample")
        if dropped:
            log.warning("task %s: %d dev examples also in the calibration sample are not scored", task, dropped)
        dev[task] = DevSplit(split, max_length[task], dropped)

    def expert_states(layer: int) -> dict[str, Tensor]:
        return states_of(read_group(features / f"layer_{layer:02d}.zarr"), tasks)

    def train_batches(n: int) -> dict[str, list[dict[str, Tensor]]]:
        from featcal.evaluation.compare import TaskData, calibration_examples, to_batches

        data = TaskData(list(tasks), encoder, str(tasks_dir), dict(max_length), seed)
        return to_batches(data, calibration_examples(data, n))

    experts = {t: load_classifier(str(Path(experts_dir) / t)) for t in tasks}
    return TuneProblem(load_backbone(str(merged)), load_backbone(base, like=experts[tasks[0]]), experts,
                       batches, expert_states, dev, encoder, train_batches=train_batches,
                       expert_cache_bytes=None if expert_cache_mib is None else int(expert_cache_mib) * 2**20,
                       expert_spill=expert_spill)


# --- the objective -------------------------------------------------------------------------------------


def make_objective(problem: TuneProblem, space: SearchSpace, base: FeatCalConfig,
                   prune_after: Sequence[int] = (), anchor: AnchorSearch | None = None,
                   examples_per_task: int | None = None) -> Callable[[Trial], float]:
    """Objective: mean dev accuracy over tasks of the model calibrated with the trial's values
    (with `anchor`, from the merge with the trial's anchor values; with `examples_per_task`, on each
    task's first that many calibration examples).

    With `prune_after` (block indices), the partly calibrated model (blocks 0..k calibrated, the
    rest merged) is scored after each listed block and reported, so a pruner may stop the trial.
    """
    def objective(trial: Trial) -> float:
        config = config_with(base, space.suggest(trial))
        merged = None
        if anchor is not None:
            start = time.perf_counter()
            merged = problem.merged_with(anchor, anchor.suggest_options(trial))
            trial.set_user_attr("merge_s", round(time.perf_counter() - start, 3))

        def after_block(k: int, backbone: nn.Module) -> None:
            if k in prune_after:
                partial = statistics.fmean(problem.score(backbone).values())
                trial.report(partial, k)
                if trial.should_prune():
                    raise optuna.TrialPruned(f"dev {partial:.4f} after block {k}")

        start = time.perf_counter()
        backbone = problem.calibrate(config, after_block if prune_after else None, merged, examples_per_task)
        trial.set_user_attr("calibrate_s", round(time.perf_counter() - start, 3))
        if problem.expert_inputs is not None:   # the memory the experts' side takes, once captured
            trial.set_user_attr("expert_inputs_mib", round(problem.expert_inputs.nbytes / 2**20, 1))
            if problem.expert_inputs.disk_nbytes:
                trial.set_user_attr("expert_inputs_disk_mib", round(problem.expert_inputs.disk_nbytes / 2**20, 1))
        start = time.perf_counter()
        scores = problem.score(backbone)
        trial.set_user_attr("score_s", round(time.perf_counter() - start, 3))
        trial.set_user_attr("dev", {t: round(v, 6) for t, v in scores.items()})
        return statistics.fmean(scores.values())

    return objective


