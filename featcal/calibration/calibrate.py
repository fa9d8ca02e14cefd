"""FeatCal's per-block step: gather moments of module inputs, solve in closed form, advance.

The step only gathers statistics and calls the pure solvers in `featcal.calibration.solve`. It holds one
block's activations for the calibration set at a time (the student and expert streams entering
the block). The loop over blocks is `featcal.calibration.walk.walk`, the only one; `featcal.calibration.walk.calibrate`
is its in-memory entry point.
"""

from __future__ import annotations

import copy
import logging
from dataclasses import dataclass
from typing import TYPE_CHECKING, Callable, Iterable, Mapping, MutableMapping, Sequence

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from featcal.calibration import solve
from featcal.families import Family, Stream, module_kind
from featcal.calibration.config import FeatCalConfig, LayerHyper
from featcal.calibration.moments import LinearMoments, Moments, NormMoments, host_count, projected_key
from featcal.profiling import phase, trim_heap
from featcal.io.checkpoints import module_prefix

if TYPE_CHECKING:
    from featcal.calibration.spill import BlockSpill

log = logging.getLogger(__name__)


# Optional hooks for data-parallel runs (see featcal.calibration.distributed); both default to "no reduction".
# reduce_moments(moments[module][task], modules) -> moments summed over all processes, with every
#   task present for every module (a process may have held no example of a task);
# reduce_sums(tensor) -> the tensor summed over all processes.
MomentReducer = Callable[[dict, Mapping[str, nn.Module]], dict]
SumReducer = Callable[[Tensor], Tensor]












# --- capturing module inputs ---------------------------------------------------------------------


@torch.no_grad()
def run_capturing(
    family: Family,
    backbone: nn.Module,
    index: int,
    block: nn.Module,
    names: Iterable[str],
    stream: Stream,
    projected: Iterable[str] = (),
    product_dtype: torch.dtype = torch.float64,
) -> tuple[dict[str, Tensor], Stream]:
    """Run one block on a stream, recording the input of each named module (forward pre-hooks).

    For each module in `projected` its W x is recorded too, under `projected_key(name)`: in float32
    the block's own output less the bias (no extra product), in float64 recomputed exactly.
    """
    captured: dict[str, Tensor] = {}
    modules = dict(block.named_modules())
    handles = []
    for name in names:
        def hook(_module, args, _name=name):
            captured.setdefault(_name, args[0])

        handles.append(modules[name].register_forward_pre_hook(hook))
    for name in projected:
        def out_hook(module, args, output, _name=projected_key(name)):
            if product_dtype == torch.float64:
                captured.setdefault(_name, F.linear(args[0].double(), module.weight.double()))
            else:
                captured.setdefault(_name, output if module.bias is None else output - module.bias)

        handles.append(modules[name].register_forward_hook(out_hook))
    try:
        out = family.run_block(backbone, index, stream, block=block)
    finally:
        for h in handles:
            h.remove()
    return captured, out


class ExpertInputCache:
    """The experts' captured module inputs (`run_capturing`'s dicts) per block, kept across walks.

    A tuning study's trials walk the same experts over the same calibration batches, so the experts'
    side of every block is the same in every trial: captured in the first walk, read in the others
    (`calibrate_block`). Keyed by block and product dtype (a float64 walk keeps its W x rows in
    float64). `max_bytes` bounds what is held in memory; a block that would pass it goes to `spill`
    (a `BlockSpill`: on disk, read back in each walk) or, without one or past the spill's own bound,
    is not kept, and its experts run in every walk. `nbytes`: the memory held (distinct storages);
    `disk_nbytes`: the spill's. `for_examples(n)`: a view of the same store (same bounds) for walks
    over each task's first `n` calibration examples.
    """

    def __init__(self, max_bytes: int | None = None, spill: BlockSpill | None = None):
        self._max_bytes, self._nbytes, self._spill = max_bytes, 0, spill
        self._skipped: set[int] = set()
        self._blocks: dict[tuple, dict[str, list[dict[str, Tensor]]]] = {}
        self._root, self._part = self, None

    @property
    def max_bytes(self) -> int | None:
        return self._root._max_bytes

    @property
    def nbytes(self) -> int:
        return self._root._nbytes

    @property
    def spill(self) -> BlockSpill | None:
        return self._root._spill

    @property
    def disk_nbytes(self) -> int:
        return 0 if self.spill is None else self.spill.nbytes

    @property
    def skipped(self) -> set[int]:
        return self._root._skipped

    def for_examples(self, n: int | None) -> "ExpertInputCache":
        """The cache of walks over each task's first `n` calibration examples (None: all of them)."""
        if n is None:
            return self._root
        view = object.__new__(ExpertInputCache)
        view._root, view._part = self._root, n
        return view

    def holds(self, index: int, dtype: torch.dtype) -> bool:
        key = (index, dtype, self._part)
        return key in self._root._blocks or (self.spill is not None and self.spill.holds(key))

    def get(self, index: int, dtype: torch.dtype) -> dict[str, list[dict[str, Tensor]]] | None:
        key = (index, dtype, self._part)
        if key in self._root._blocks:
            return self._root._blocks[key]
        return self.spill.read(key) if self.spill is not None and self.spill.holds(key) else None

    def put(self, index: int, dtype: torch.dtype, captured: dict[str, list[dict[str, Tensor]]]) -> None:
        storages = {t.untyped_storage().data_ptr(): t.untyped_storage().nbytes()
                    for batches in captured.values() for batch in batches for t in batch.values()}
        size = sum(storages.values())
        key = (index, dtype, self._part)
        if self.max_bytes is not None and self.nbytes + size > self.max_bytes:
            if self.spill is None or not self.spill.write(key, captured):
                self.skipped.add(index)
            return
        self._root._blocks[key] = captured
        self._root._nbytes += size

    def __len__(self) -> int:
        return len(self._root._blocks)


def projects_cross(module: nn.Module) -> bool:
    """A narrowing linear (out < in) keeps its cross sum projected through the expert weight."""
    return module_kind(module) == "linear" and module.out_features < module.in_features


def row_weights(stream: Stream, rows: Tensor, pooled_token_weight: float) -> Tensor:
    """Weight 1 for the token the head reads, `pooled_token_weight` for the others."""
    w = torch.full(rows.shape, pooled_token_weight, dtype=torch.float64, device=rows.device)
    w[torch.arange(rows.shape[0], device=rows.device), stream.pooled_index] = 1.0
    return w


def normalised(module: nn.Module, x: Tensor) -> Tensor:
    """The norm's input with the affine part removed: what γ and β multiply and shift."""
    x = x.to(torch.float64)
    if module_kind(module) == "layernorm":
        return F.layer_norm(x, module.normalized_shape, eps=module.eps)
    eps = getattr(module, "variance_epsilon", getattr(module, "eps", 1e-6))
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps)


def accumulate_block_moments(
    family: Family,
    modules: Mapping[str, nn.Module],
    student_inputs: Mapping[str, Tensor],
    expert_inputs: Mapping[str, Tensor],
    student_stream: Stream,
    moments: dict[str, Moments],
    weighted: bool,
    pooled_token_weight: float,
    product_dtype: torch.dtype = torch.float64,
    expert_weights: Mapping[str, Tensor] | None = None,
) -> None:
    """Add one batch's rows to each module's moments (one task).

    `expert_inputs` holds, for each module that `projects_cross`, the expert's W x rows too.
    `expert_weights`: the expert's W_e of the modules whose W_e G is formed from rows (`row_space`).
    """
    shared: dict[tuple, LinearMoments] = {}
    for name, module in modules.items():
        rows = family.row_mask(name, student_stream)
        use_weights = weighted and student_stream.pooled_index is not None and not family.is_key_value(name)
        w = row_weights(student_stream, rows, pooled_token_weight)[rows] if use_weights else None
        xs = real_rows(student_inputs[name], rows)
        if module_kind(module) == "linear":
            m = moments.setdefault(name, LinearMoments())
            projected = expert_inputs[projected_key(name)] if projects_cross(module) else None
            key = (student_inputs[name].data_ptr(), expert_inputs[name].data_ptr(), xs.shape, use_weights)
            if projected is None and key in shared:  # q/k/v read the same input: reuse the batch sums
                m.merge(shared[key])
                continue
            xe = real_rows(expert_inputs[name], rows)
            if projected is not None:   # a wide module's sums grow in place (no batch copies)
                m.add_projected(xs, xe, real_rows(projected, rows), w, product_dtype, (expert_weights or {}).get(name))
                continue
            batch = shared[key] = LinearMoments.of_rows(xs, xe, w, None, product_dtype)
            m.merge(batch)
        else:
            moments.setdefault(name, NormMoments()).add(normalised(module, xs), w)


def row_space(family: Family, modules: Mapping[str, nn.Module], projected: Sequence[str],
              streams: Mapping[str, Sequence[Stream]]) -> set[str]:
    """The narrowing modules (`projected`: those that `projects_cross`) whose W_e G comes from rows
    (`LinearMoments.projected_gram`): where every task has fewer rows than half the module's input
    width, 2·n·out·in products beat out·in² (a 1.5B decoder's down projection on ~2,000 tokens a
    task: 5.5e10 against 1.2e11 a task)."""
    # the largest task decides for every task: one set of moment fields per module
    rows = {name: max((sum(int(family.row_mask(name, s).sum()) for s in ss) for ss in streams.values()), default=0)
            for name in projected}
    return {name for name, n in rows.items() if 0 < 2 * n < modules[name].in_features}


def real_rows(x: Tensor, rows: Tensor) -> Tensor:
    """The rows of real tokens ([n, d]); a view, not a copy, when every token is real. (An index_select:
    the same rows as x[rows], ~5x faster on CPU than the boolean mask's gather.)"""
    flat = x.reshape(-1, x.shape[-1])
    return flat if bool(rows.all()) else flat.index_select(0, rows.reshape(-1).nonzero().squeeze(1))


def accumulate_pooled_moments(
    student: Stream, expert: Stream, moments: LinearMoments, family: Family, backbone: nn.Module
) -> None:
    """Rows for a pooler pseudo-layer: the pooled token of the last block's outputs."""
    moments.add(family.head_features(backbone, student), family.head_features(backbone, expert))


# --- solving ---------------------------------------------------------------------------------------


@dataclass
class ModuleReport:
    module: str
    kind: str
    condition: float | None = None
    solver: str | None = None


def solve_modules(
    student: Mapping[str, nn.Module],
    base: Mapping[str, nn.Module],
    experts: Mapping[str, Mapping[str, nn.Module]],
    moments: Mapping[str, Mapping[str, Moments]],
    hyper: LayerHyper,
    config: FeatCalConfig,
    prefix: str = "",
    consume: bool = False,
    systems: MutableMapping[str, solve.NormalEquations] | None = None,
    expert_outputs: Mapping[str, Mapping[str, Tensor]] | None = None,
) -> tuple[dict[str, Tensor], list[ModuleReport]]:
    """Closed-form updates for a set of modules, from their per-task moments.

    `student` holds the *pre-calibration* merged modules (they define the anchor);
    `moments[module][task]`. Returns {"<module>.<param>": float64 tensor} and a report per module.
    `consume`: the linear modules' d × d sums are used up by the solve (`gram_and_target`), for a
    caller that keeps no moments: a block's peak is then its sums and one system, not twice that.
    `systems`: linear modules' normal equations with every task folded in already (`fold_task`); the
    moments of those modules then need only their means (for the bias). `expert_outputs[module][task]`:
    b_i + W_i μ_t,i where `fold_task` formed it (that expert's weight may be gone); else formed here.
    """
    updates: dict[str, Tensor] = {}
    reports: list[ModuleReport] = []
    for name, module in student.items():
        kind = module_kind(module)
        per_task = moments[name]
        tasks = list(per_task)
        if not tasks:
            raise ValueError(f"module {prefix}{name}: no calibration rows for any task")
        mods = [experts[t][name] for t in tasks]
        stats = [per_task[t] for t in tasks]
        if kind == "linear":
            system = systems.pop(name, None) if systems is not None else None
            if system is None:
                system = start_system(module, base[name], hyper)
                for m, e in zip(stats, mods):   # one task's G_i at a time: a wide module's largest transients
                    system.add(*gram_and_target(m, e.weight, hyper.alpha, consume))
            weight, rep, omegas = system.solve(prefix + name)
            del system
            updates[f"{name}.weight"] = weight
            reports.append(ModuleReport(prefix + name, kind, rep.condition, rep.method))
            if module.bias is not None and config.calibrate_bias:
                formed = (expert_outputs or {}).get(name, {})
                outputs = [formed[t] if t in formed else solve.expert_output(e.weight, e.bias, m.target_mean(hyper.alpha))
                           for t, m, e in zip(tasks, stats, mods)]
                updates[f"{name}.bias"] = solve.solve_bias(
                    weight, [m.student_mean for m in stats], outputs,
                    solve.anchor(module.bias, base[name].bias, hyper.rho), hyper.ridge, omegas,
                )
        elif not config.calibrate_norms:
            continue
        elif kind == "layernorm":
            gamma, beta = solve.solve_layernorm(
                [m.mean for m in stats], [m.mean_square for m in stats],
                [e.weight for e in mods], [e.bias for e in mods],
                solve.anchor(module.weight, base[name].weight, hyper.rho),
                solve.anchor(module.bias, base[name].bias, hyper.rho), hyper.ridge,
            )
            updates[f"{name}.weight"], updates[f"{name}.bias"] = gamma, beta
            reports.append(ModuleReport(prefix + name, kind))
        elif kind == "rmsnorm":
            updates[f"{name}.weight"] = solve.solve_rmsnorm(
                [m.mean_square for m in stats], [e.weight for e in mods],
                solve.anchor(module.weight, base[name].weight, hyper.rho), hyper.ridge,
            )
            reports.append(ModuleReport(prefix + name, kind))
    return updates, reports


def start_system(module: nn.Module, base_module: nn.Module, hyper: LayerHyper) -> solve.NormalEquations:
    """A linear module's normal equations before any task: λ I and λ W_anc."""
    return solve.NormalEquations.start(solve.anchor(module.weight, base_module.weight, hyper.rho), hyper.ridge)


def fold_task(
    modules: Mapping[str, nn.Module],
    base: Mapping[str, nn.Module],
    expert: Mapping[str, nn.Module],
    per_task: Mapping[str, Moments],
    hyper: LayerHyper,
    systems: MutableMapping[str, solve.NormalEquations],
) -> dict[str, Tensor]:
    """Add one task's linear-module sums into their systems and let go of its d × d sums: a block
    then holds one task's Grams and the systems, not every task's Grams (ω_i needs the whole G_i, so a
    task is folded once all its rows are in). The same numbers as `solve_modules` with `consume`.
    Returns b_i + W_i μ_t,i of each module with a bias: after this the expert's linear weights are
    not read again in the block."""
    outputs = {}
    for name, module in modules.items():
        if module_kind(module) != "linear" or name not in per_task:
            continue
        if name not in systems:
            systems[name] = start_system(module, base[name], hyper)
        systems[name].add(*gram_and_target(per_task[name], expert[name].weight, hyper.alpha, consume=True))
        if module.bias is not None:
            outputs[name] = solve.expert_output(expert[name].weight, expert[name].bias,
                                                per_task[name].target_mean(hyper.alpha))
    return outputs


def linear_weights(backbone: nn.Module, modules: Mapping[str, nn.Module]) -> list[str]:
    """The backbone's parameter names of the linear modules' weights among `modules`."""
    return [module_prefix(backbone, m) + "weight" for m in modules.values() if module_kind(m) == "linear"]


def gram_and_target(moments: LinearMoments, expert_weight: Tensor, alpha: float,
                    consume: bool = False) -> tuple[Tensor, Tensor]:
    """(G_i, W_i C_i) of one task, G_i formed once. `consume`: G_i is formed in the Gram sum's own
    buffer and the moments let go of their d × d sums, so the solve holds no second copy of them."""
    if not consume:
        gram = moments.gram
        return gram, moments.target_product(expert_weight, alpha, gram)
    gram = moments.student_gram.div_(moments.count)
    target = moments.target_product(expert_weight, alpha, gram, consume=True)
    moments.student_gram = moments.cross = moments.projected_cross = moments.projected_gram = None
    return gram, target


@torch.no_grad()
def apply_updates(module: nn.Module, updates: Mapping[str, Tensor]) -> None:
    """Write float64 solutions into a module's parameters (cast to each parameter's dtype)."""
    params = dict(module.named_parameters())
    for name, value in updates.items():
        params[name].copy_(value.to(params[name].dtype))


# --- one block, and the whole forward-order walk ------------------------------------------------------


@dataclass
class LayerDrift:
    """Distance of the calibrated student's block output to the experts' (mean over tasks' tokens)."""

    layer: int
    l2: float
    cosine: float


def block_drift(
    family: Family,
    index: int,
    student_backbone: nn.Module,
    expert_backbones: Mapping[str, nn.Module],
    student: Mapping[str, Sequence[Stream]],
    expert: Mapping[str, Sequence[Stream]],
    reduce_sums: SumReducer | None = None,
) -> LayerDrift:
    """Mean L2 distance and cosine similarity between block `index`'s outputs in the student and
    expert streams (the streams `run_block` returned), over every real token of every task.
    `reduce_sums` (data-parallel runs) sums the (l2, cosine, count) totals over processes."""
    l2 = cos = count = host_count(0)   # host scalars: the sums below may live on any device
    for task, streams in student.items():
        for s, e in zip(streams, expert[task], strict=True):
            hs, mask = family.block_output(student_backbone, index, s)
            he, _ = family.block_output(expert_backbones[task], index, e)
            hs, he = real_rows(hs, mask), real_rows(he, mask)   # per-token terms in the model's dtype,
            l2 = l2 + (hs - he).norm(dim=-1).sum(dtype=torch.float64).cpu()      # their sums in float64
            cos = cos + F.cosine_similarity(hs, he, dim=-1).sum(dtype=torch.float64).cpu()
            count = count + hs.shape[0]
    if reduce_sums is not None:
        l2, cos, count = reduce_sums(torch.stack([l2, cos, count]))
    return LayerDrift(index, float(l2 / count), float(cos / count))


@dataclass
class BlockResult:
    updates: dict[str, Tensor]
    reports: list[ModuleReport]
    moments: dict[str, dict[str, Moments]]
    student_next: dict[str, list[Stream]]
    expert_next: dict[str, list[Stream]]
    drift: LayerDrift | None   # None where the caller did not ask for it (a tuning trial)


def calibrate_block(
    family: Family,
    index: int,
    student_backbone: nn.Module,
    base_backbone: nn.Module,
    expert_backbones: Mapping[str, nn.Module],
    student_streams: Mapping[str, Sequence[Stream]],
    expert_streams: MutableMapping[str, Sequence[Stream]],
    config: FeatCalConfig,
    last: bool,
    reduce_moments: MomentReducer | None = None,
    reduce_sums: SumReducer | None = None,
    release_memory: bool = False,
    measure_drift: bool = True,
    expert_inputs: ExpertInputCache | None = None,
    keep_moments: bool = True,
    release_expert: Callable[[str, list[str]], None] | None = None,
    release_base: Callable[[list[str]], None] | None = None,
) -> BlockResult:
    """Calibrate block `index` of the student backbone in place, and advance both streams.

    `expert_streams` is consumed: each task's entry is taken out once its moments are gathered, so
    the experts' block inputs are not held through the solve. With `reduce_moments` (data-parallel
    runs), the per-block moment sums are reduced over processes before the solve, and a task may
    have no local batch on this process. `release_memory` hands the heap's freed pages back to the
    OS before and after the solve (`featcal.profiling.trim_heap`): a lower peak RSS for a process
    that walks one block, at ~0.1 s a trim in pages faulted back in. `measure_drift=False` skips the
    drift to the experts (a tuning trial reads its dev score only: ~6 % of a trial's calibration).
    `expert_inputs` (a tuning study's, `ExpertInputCache`): the experts' module inputs on this block do
    not depend on the trial, so they are captured once and read back in later walks; where it holds
    this block, `expert_streams` may be empty and no expert forward runs (nor advances: the walk's
    experts must come from a cache, and the drift is not measured). `keep_moments=False`: the solve
    uses up the linear modules' d × d sums (`solve_modules`' `consume`) and the result holds no moments;
    in one process (no `reduce_moments`) each task is folded into the systems once its rows are in,
    and `release_expert(task, names)` is then told that expert's linear weights in this block are done
    with (a lazy provider frees them: one expert's block held at a time, not every expert's), and
    `release_base(names)` the base's once every system holds its anchor (after the first task).
    """
    cached = None if expert_inputs is None else expert_inputs.get(index, config.products)
    if expert_inputs is not None and measure_drift:
        raise ValueError("an expert input cache skips the experts' block outputs: use it with measure_drift=False")
    block = family.blocks(student_backbone)[index]
    base_block = family.blocks(base_backbone)[index]
    modules = family.calibrated_modules(block)
    expert_blocks = {t: family.blocks(b)[index] for t, b in expert_backbones.items()}
    moments: dict[str, dict[str, Moments]] = {name: {} for name in modules}
    base_modules = family.calibrated_modules(base_block)
    expert_modules = {t: family.calibrated_modules(b) for t, b in expert_blocks.items()}
    fold = not keep_moments and reduce_moments is None
    systems: dict[str, solve.NormalEquations] = {}
    expert_outputs: dict[str, dict[str, Tensor]] = {}
    projected = [name for name, module in modules.items() if projects_cross(module)]
    # data-parallel processes see their own rows only: each would choose its own moment fields
    from_rows = row_space(family, modules, projected, student_streams) if reduce_moments is None else set()
    expert_next: dict[str, list[Stream]] = {}
    captured: dict[str, list[dict[str, Tensor]]] = {}
    for task, streams in student_streams.items():
        if task not in expert_blocks:
            raise KeyError(f"calibration data for task {task!r} but no expert for it")
        if not streams and reduce_moments is None:
            raise ValueError(f"block {index}: task {task!r} has no calibration batches")
        per_task: dict[str, Moments] = {}
        expert_next[task] = []
        if cached is not None and task not in cached:
            raise KeyError(f"block {index}: the expert input cache holds tasks {sorted(cached)}, not {task!r}")
        expert_batches = cached[task] if cached is not None else expert_streams.pop(task)
        row_space_weights = {n: expert_modules[task][n].weight for n in from_rows}   # their W_e
        if len(expert_batches) != len(streams):
            source = "the expert input cache holds" if cached is not None else "the experts' streams hold"
            raise ValueError(f"block {index}: task {task!r} has {len(streams)} calibration batches; "
                             f"{source} {len(expert_batches)}")
        for s, e in zip(streams, expert_batches):
            with phase("capture forwards"):
                xs, _ = run_capturing(family, student_backbone, index, block, modules, s)
                if cached is not None:
                    xe = e   # this block's module inputs, captured in an earlier walk
                else:
                    xe, e_out = run_capturing(family, expert_backbones[task], index, expert_blocks[task], modules, e,
                                              projected, config.products)
                    expert_next[task].append(e_out)
                    if expert_inputs is not None:
                        captured.setdefault(task, []).append(xe)
            with phase("moments"):
                accumulate_block_moments(family, modules, xs, xe, s, per_task, last, config.pooled_token_weight,
                                         config.products, row_space_weights)
        for name in modules:
            if name in per_task:
                moments[name][task] = per_task[name]
        if fold:
            with phase("solve"):
                formed = fold_task(modules, base_modules, expert_modules[task], per_task, config.for_layer(index), systems)
            for name, output in formed.items():
                expert_outputs.setdefault(name, {})[task] = output
            if release_expert is not None:
                release_expert(task, linear_weights(expert_backbones[task], expert_modules[task]))
            if release_base is not None and all(n in systems for n, m in modules.items() if module_kind(m) == "linear"):
                release_base(linear_weights(base_backbone, base_modules))   # each system holds λ W_anc: the
                release_base = None                                          # bias and norm anchors stay
            if release_memory:   # the task's used-up sums out of the RSS the next task's sums add to
                trim_heap()
    if expert_inputs is not None and cached is None:
        expert_inputs.put(index, config.products, captured)
    if reduce_moments is not None:
        with phase("reduce across processes"):
            moments = reduce_moments(moments, modules)
    if release_memory:
        trim_heap()
    with phase("solve"):
        updates, reports = solve_modules(
            modules, base_modules, expert_modules, moments,
            config.for_layer(index), config, prefix=f"block {index}: ", consume=not keep_moments, systems=systems,
            expert_outputs=expert_outputs,
        )
        apply_updates(block, updates)
    if release_memory:
        trim_heap()
    with phase("advance forwards"):
        student_next = {
            t: [family.run_block(student_backbone, index, s) for s in streams] for t, streams in student_streams.items()
        }
    drift = None
    if measure_drift:
        with phase("drift"):
            drift = block_drift(family, index, student_backbone, expert_backbones, student_next, expert_next, reduce_sums)
    return BlockResult(updates, reports, moments if keep_moments else {}, student_next, expert_next, drift)


def calibrate_pooler(
    family: Family,
    student_backbone: nn.Module,
    base_backbone: nn.Module,
    expert_backbones: Mapping[str, nn.Module],
    student_streams: Mapping[str, Sequence[Stream]],
    expert_streams: Mapping[str, Sequence[Stream]],
    config: FeatCalConfig,
    reduce_moments: MomentReducer | None = None,
) -> list[ModuleReport]:
    """The pooler dense as a last pseudo-layer: its input is the pooled token of the last block."""
    pooler = family.pooler(student_backbone)
    if pooler is None:
        return []
    moments: dict[str, Moments] = {}
    for task, streams in student_streams.items():
        moments[task] = LinearMoments()
        for s, e in zip(streams, expert_streams[task], strict=True):
            accumulate_pooled_moments(s, e, moments[task], family, student_backbone)
    name = "dense"
    all_moments = {name: moments}
    if reduce_moments is not None:
        all_moments = reduce_moments(all_moments, {name: pooler})
    updates, reports = solve_modules(
        {name: pooler}, {name: family.pooler(base_backbone)},
        {t: {name: family.pooler(b)} for t, b in expert_backbones.items()}, all_moments,
        config.for_layer(len(family.blocks(student_backbone))), config, prefix="pooler: ",
    )
    apply_updates(pooler, {k.removeprefix(f"{name}."): v for k, v in updates.items()})
    return reports


@dataclass
class CalibrationResult:
    backbone: nn.Module
    drift: list[LayerDrift]
    reports: list[ModuleReport]


def enter_streams(
    family: Family, backbone: nn.Module, batches: Mapping[str, Sequence[Mapping[str, Tensor]]]
) -> dict[str, list[Stream]]:
    return {t: [family.enter(backbone, b) for b in bs] for t, bs in batches.items()}


def student_backbone(family: Family, merged: nn.Module, inplace: bool) -> nn.Module:
    """The merged model's backbone, the one calibration writes into (a copy unless `inplace`)."""
    student = family.backbone(merged)
    return (student if inplace else copy.deepcopy(student)).eval()


def check_tasks(batches: Mapping, experts: Mapping, model: nn.Module | None = None) -> None:
    """Every task has an expert and its batches are tokenised (mappings of tensors). Padded batches
    without an attention mask (padding: `model`'s pad token id) get a warning: their pad positions
    would be calibrated on as if they were tokens."""
    pad_token_id = getattr(getattr(model, "config", None), "pad_token_id", None)
    missing = set(batches) - set(experts)
    if missing:
        raise KeyError(f"calibration data for tasks without an expert: {sorted(missing)}")
    for task, task_batches in batches.items():
        for i, batch in enumerate(task_batches):
            if not isinstance(batch, Mapping) or not all(isinstance(v, Tensor) for v in batch.values()):
                raise TypeError(f"calibration batches[{task!r}][{i}] is a {type(batch).__name__}, not a tokenised "
                                "batch (a mapping of tensors: input_ids, attention_mask, ...): tokenise the texts "
                                "first, e.g. featcal.data.splits.encode_batches or the model's tokenizer")
            ids = batch.get("input_ids")
            if pad_token_id is not None and ids is not None and "attention_mask" not in batch \
                    and bool((ids == pad_token_id).any()):
                log.warning("calibration batches[%r][%d] holds padding (token id %d) but no attention_mask: its pad "
                            "positions are calibrated on as if they were tokens; pass the tokenizer's attention_mask",
                            task, i, pad_token_id)
