"""RegMean (Jin et al., "Dataless Knowledge Fusion by Merging Weights of Language Models", ICLR 2023,
arXiv:2212.09849) and RegMean++ (Nguyen et al., 2025, arXiv:2508.03121); docs/algorithms.md#regmean-and-regmean.

Per nn.Linear module (the linears of ``family.calibrated_modules`` in every block; RegMean also the
pooler dense when the family has one) with expert weights W_i ∈ ℝ^{m×n}:

  G_i = (1/N_i) Σ_rows x xᵀ      uncentred mean Gram of the module's inputs over all real tokens
                                (padding masked out) of task i's unlabelled train batches,
  G̃_i = a·G_i + (1−a)·diag(G_i),  off-diagonal entries scaled by a (default 0.95),
  W_M = (Σ_i W_i G̃_i)(Σ_i G̃_i)⁻¹,  solved in float64 (``featcal.calibration.solve.spd_solve``: Cholesky, else
                                an eigendecomposition pseudo-inverse, logged).

The mean (not the sum) gives every task equal weight whatever its token count.

- **RegMean**: x is what expert i's module sees when expert i runs on task i's batches (its own
  forward). Every other tensor (biases, norms, embeddings) is the mean of θ_i.
- **RegMean++**: x is what expert i's block k sees when its input is the output of the *merged*
  blocks 0..k−1 on task i's batches (the merged prefix; inside block k expert i's own modules run).
  Pre-block tensors (those the stream entering block 0 depends on: embeddings, pre-norms) and
  every in-block tensor are averaged; post-block tensors (BERT/ViT pooler, final norms) stay θ₀, as
  the reference code leaves CLIP's post-LayerNorm. For T5 the decoder blocks read the merged encoder's
  output; the encoder's final norm, run between the two stages, is post-block here and stays θ₀.

Activations come from the project's machinery: the family's streams, ``calibrate.run_capturing``
(block forward with input capture), ``moments.LinearMoments`` (float64 sums) and the forward-order
loop ``walk.walk_blocks``. ``walk_regmean`` is that walk for both methods, whatever holds the
weights: ``walk.ModuleWeights`` (the registry functions below, models in memory) or
``lazy.LazyWeights`` (``featcal.merging.lazy.lazy_merge``, checkpoints read block by block). A block's
merged tensors are computed from the expert blocks the weights hold (linears solved, the rest
averaged in the compute dtype) and handed to an ``emit`` callback.

Memory. In memory: the models (RegMean++ also a copy M of the base backbone), plus one block's
Gram sums (float64, per linear and task) and the streams (every task's batches at one block
boundary). Through ``lazy_merge``: one block of every expert at a time (each expert's non-block
tensors only while its own stream enters or its head features are taken; RegMean's pooler dense of
every expert at once, last), one block's Grams, the streams, and for RegMean++ the merged model M's
non-block tensors (its blocks are swapped in one at a time while they run).
"""

from __future__ import annotations

import contextlib
import copy
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass

import torch
from torch import Tensor, nn

from featcal.calibration.calibrate import enter_streams, run_capturing
from featcal.families import Family, module_kind
from featcal.io.checkpoints import module_prefix
from featcal.merging.dense import _check_real
from featcal.merging.registry import MergeContext, StateDict, compute_dtype, register
from featcal.calibration.moments import LinearMoments, gram_of, host_count
from featcal.calibration.solve import spd_solve
from featcal.calibration.walk import BlockWeights, ModuleWeights, Streams, walk_blocks

Grams = dict[str, dict[str, LinearMoments]]  # module -> task -> moment sums


@dataclass(frozen=True)
class RegMeanOptions:
    """RegMean / RegMean++ options.

    off_diagonal: a in G̃ = a·G + (1−a)·diag(G), in [0, 1] (default 0.95, FusionBench's CLIP
        ``reduce_non_diagonal_ratio``, which gave its 82.4 / 84.4; a = 1 is the plain regression,
        a = 0 a per-input-column weighted average).
    How many train examples per task the Grams read is the data supplier's ``examples_per_task``
    (default 256, FusionBench's ``num_regmean_examples``), not an option of the method.
    """

    off_diagonal: float = 0.95

    def __post_init__(self) -> None:
        if not 0.0 <= _check_real("regmean", "off_diagonal", self.off_diagonal) <= 1.0:
            raise ValueError(f"merge method 'regmean': option 'off_diagonal' must be in [0, 1], got {self.off_diagonal!r}")


# --------------------------------------------------------------------------- the closed form


def shrink(gram: Tensor, a: float) -> Tensor:
    """G̃ = a·G + (1−a)·diag(G): off-diagonal entries times a, the diagonal kept."""
    return a * gram + (1.0 - a) * torch.diag(torch.diagonal(gram))


def regmean_weight(grams: Sequence[Tensor], weights: Sequence[Tensor], a: float, name: str = "") -> tuple[Tensor, str]:
    """W_M = (Σ_i W_i G̃_i)(Σ_i G̃_i)⁻¹ in float64; also the solver used ("cholesky" or "eigh-pinv")."""
    lhs = torch.zeros_like(grams[0], dtype=torch.float64)
    rhs = torch.zeros(weights[0].shape, dtype=torch.float64, device=weights[0].device)
    for gram, weight in zip(grams, weights, strict=True):
        g = shrink(gram.to(torch.float64), a)
        lhs += g
        rhs += weight.to(torch.float64) @ g
    solution_t, report = spd_solve(lhs, rhs.T, name)   # Σ G̃ is symmetric: W_Mᵀ = (Σ G̃)⁻¹ (Σ W_i G̃_i)ᵀ
    return solution_t.T.contiguous(), report.method


def gram_sums(rows: Tensor) -> LinearMoments:
    """Σ x xᵀ and the row count of one batch's rows (..., n), in float64."""
    x = rows.reshape(-1, rows.shape[-1]).to(torch.float64)
    return LinearMoments(count=host_count(x.shape[0]), student_gram=gram_of(x))


# --------------------------------------------------------------------------- gathering Grams


def linear_modules(family: Family, block: nn.Module) -> list[str]:
    """The block's calibrated Linear modules (qualified names inside the block)."""
    return [n for n, m in family.calibrated_modules(block).items() if module_kind(m) == "linear"]


@torch.no_grad()
def block_grams(
    family: Family, index: int, experts: Mapping[str, nn.Module], streams: Streams
) -> tuple[Grams, Streams]:
    """Per Linear module of block `index` and per task, the Gram sums of its inputs when expert
    `task`'s block runs on `streams[task]`; also each expert block's output streams."""
    grams: Grams = {}
    out: Streams = {}
    for task, task_streams in streams.items():
        block = family.blocks(experts[task])[index]
        names = linear_modules(family, block)
        out[task] = []
        for stream in task_streams:
            captured, after = run_capturing(family, experts[task], index, block, names, stream)
            shared: dict[tuple, LinearMoments] = {}   # q/k/v read one input: one Gram
            for name in names:
                rows = captured[name][family.row_mask(name, stream)]
                key = (captured[name].data_ptr(), tuple(rows.shape))
                if key not in shared:
                    shared[key] = gram_sums(rows)
                grams.setdefault(name, {}).setdefault(task, LinearMoments()).merge(shared[key])
            out[task].append(after)
    return grams, out


def merge_module(
    scope: str, experts: Mapping[str, nn.Module], tasks: Sequence[str], grams: Grams, a: float, solves: list[dict],
) -> StateDict:
    """The merged tensors of the backbone submodule `scope` (a block, or the pooler dense) from the
    experts' copies of it: every floating tensor the mean of the experts' (in the compute dtype, as
    ``merge_state_dicts`` upcasts), then W_M for each Linear in `grams` (keyed by backbone module
    name). Names are the backbone's (`scope` + "." + name inside)."""
    states = [experts[t].get_submodule(scope).state_dict(prefix=scope + ".") for t in tasks]
    out: StateDict = {}
    for name, ref in states[0].items():
        if ref.is_floating_point():
            dtype = compute_dtype(*(state[name].dtype for state in states))
            out[name] = torch.stack([state[name].to(dtype) for state in states]).mean(dim=0)
    for module, per_task in grams.items():
        name = f"{module}.weight"
        missing = [t for t in tasks if t not in per_task]
        if missing:
            raise ValueError(f"regmean: module {name!r} saw no rows of tasks {missing}")
        weight, solver = regmean_weight([per_task[t].gram for t in tasks], [state[name] for state in states], a, name)
        out[name] = weight.to(out[name].dtype)
        solves.append({"module": name, "solver": solver})
    return out


@contextlib.contextmanager
def holding(module: nn.Module, values: Mapping[str, Tensor]) -> Iterator[nn.Module]:
    """`module` with its named tensors replaced by `values` (cast to their dtypes) inside the block,
    the previous ones (real or on the meta device) back after it."""
    previous = []
    try:
        for name, value in values.items():
            owner, _, leaf = name.rpartition(".")
            sub = module.get_submodule(owner)
            where = sub._parameters if leaf in sub._parameters else sub._buffers
            old = where[leaf]
            previous.append((where, leaf, old))
            value = value.detach().to(old.dtype)
            where[leaf] = nn.Parameter(value, requires_grad=False) if isinstance(old, nn.Parameter) else value
        yield module
    finally:
        for where, leaf, old in reversed(previous):
            where[leaf] = old


Emit = Callable[[StateDict], None]


def walk_regmean(
    family: Family, like: nn.Module, weights: BlockWeights, streams: Streams, tasks: Sequence[str], a: float,
    emit: Emit, merged: nn.Module | None = None,
) -> list[dict]:
    """RegMean's walk (`merged` None) or RegMean++'s (`merged`: the model M, holding θ₀ with the
    averaged pre-block tensors), over blocks in forward order, wherever `weights` read them from.

    `streams`: per task, the streams entering block 0 (each expert's own for RegMean, M's for
    RegMean++). Block k: each expert's block k runs on its task's streams, capturing its linears'
    inputs (``block_grams``); the block's merged tensors (``merge_module``) go to `emit`; the streams
    entering block k+1 are each expert's own output (RegMean) or M's block k, holding the merged
    tensors, run on the streams (RegMean++). RegMean then solves the pooler dense (when the family
    has one) on each expert's head features (``weights.expert_head_features``). `like` is a backbone
    of the experts' shape (block prefixes, the pooler). Returns the solves (module, solver).
    """
    solves: list[dict] = []

    def step(index: int, _base: nn.Module, expert_bbs: dict[str, nn.Module], streams: Streams) -> Streams:
        scope = family.block_prefix(like, index)[:-1]
        grams, after = block_grams(family, index, expert_bbs, streams)
        tensors = merge_module(scope, expert_bbs, tasks, {f"{scope}.{m}": g for m, g in grams.items()}, a, solves)
        emit(tensors)
        if merged is None:
            return after
        with holding(merged, tensors):
            return {t: [family.run_block(merged, index, s) for s in ss] for t, ss in streams.items()}

    final = walk_blocks(weights, streams, step, n_blocks=len(family.blocks(like)), progress=False)
    pooler = family.pooler(like)
    if merged is None and pooler is not None:   # it reads the pooled token of the last block's output
        scope = module_prefix(like, pooler)[:-1]
        grams: Grams = {scope: {t: LinearMoments() for t in tasks}}
        for task, features in weights.expert_head_features(family, final).items():
            for rows in features:
                grams[scope][task].merge(gram_sums(rows))
        with weights.pooler() as (_, expert_bbs):
            emit(merge_module(scope, expert_bbs, tasks, grams, a, solves))
    return solves


def check_batches(method: str, context: MergeContext) -> dict[str, Sequence[Mapping[str, Tensor]]]:
    """The context's batches for exactly its experts, each non-empty."""
    batches = context.batches
    missing = [t for t in context.experts if not batches.get(t)]
    if missing:
        raise ValueError(f"merge method {method!r}: no train batches for tasks {missing} (context.batches has "
                         f"{sorted(batches)})")
    return {t: batches[t] for t in context.experts}


def mean_state(experts: Sequence[StateDict]) -> StateDict:
    """(1/T) Σ_i θ_i per tensor."""
    return {name: torch.stack([e[name] for e in experts]).mean(dim=0) for name in experts[0]}


def _summary(solves: list[dict]) -> dict:
    return {"linear_modules": len(solves), "pseudo_inverse": [s["module"] for s in solves if s["solver"] != "cholesky"]}


# --------------------------------------------------------------------------- RegMean


@register("regmean", RegMeanOptions, needs=("activations",))
def regmean(base: StateDict, experts: Sequence[StateDict], opts: RegMeanOptions, context: MergeContext) -> StateDict:
    """Linear weights by W_M = (Σ W_i G̃_i)(Σ G̃_i)⁻¹ with each expert's own Grams; the rest averaged.

    The blocks and the pooler are merged from the context's expert models (``walk_regmean``); the
    other tensors are the mean of the expert state dicts."""
    tasks = list(context.experts)
    batches = check_batches("regmean", context)
    backbones = {t: context.family.backbone(m).eval() for t, m in context.experts.items()}
    weights = ModuleWeights(context.base, backbones)
    out = mean_state(experts)
    solves = walk_regmean(context.family, context.base, weights, weights.enter_experts(context.family, batches),
                          tasks, opts.off_diagonal, lambda tensors: _update(out, tensors))
    context.record.update(regmean_record(solves))
    return out


def _update(out: StateDict, tensors: StateDict) -> None:
    out.update({name: value.to(out[name].dtype) for name, value in tensors.items()})


def regmean_record(solves: list[dict]) -> dict:
    return {"solves": solves, "summary": _summary(solves)}


# --------------------------------------------------------------------------- RegMean++


def pre_block_names(family: Family, backbone: nn.Module, batch: Mapping[str, Tensor]) -> set[str]:
    """Backbone tensors the stream entering block 0 depends on (embeddings, pre-norms): the direct
    parameters of the modules outside the blocks that run while ``family.enter`` builds it, under
    every name they have (a tied embedding is averaged under all of its names, never half kept)."""
    inside = tuple(family.block_prefix(backbone, i) for i in range(len(family.blocks(backbone))))
    modules = {n: m for n, m in backbone.named_modules() if not (n + ".").startswith(inside)}
    ran: set[str] = set()
    handles = [m.register_forward_hook(lambda _m, _a, _o, _n=n: ran.add(_n)) for n, m in modules.items()]
    try:
        family.enter(backbone, batch)
    finally:
        for handle in handles:
            handle.remove()
    used = {id(p) for n in ran for p in modules[n].parameters(recurse=False)}
    return {name for name, p in backbone.named_parameters(remove_duplicate=False) if id(p) in used}


@torch.no_grad()
def write_into(backbone: nn.Module, values: Mapping[str, Tensor]) -> None:
    """Copy `values` into the backbone's (real) tensors of those names, cast to their dtypes."""
    state = backbone.state_dict(keep_vars=True)
    for name, value in values.items():
        state[name].data.copy_(value.to(state[name].dtype))


def in_blocks(family: Family, backbone: nn.Module) -> tuple[str, ...]:
    """The name prefixes of the backbone's blocks."""
    return tuple(family.block_prefix(backbone, i) for i in range(len(family.blocks(backbone))))


def regmean_plus_plus_record(solves: list[dict], pre: list[str], kept: list[str]) -> dict:
    return {"solves": solves, "averaged_pre_block": pre, "kept_at_base": kept,
            "summary": {**_summary(solves), "kept_at_base": kept}}


@register("regmean_plus_plus", RegMeanOptions, needs=("activations",))
def regmean_plus_plus(
    base: StateDict, experts: Sequence[StateDict], opts: RegMeanOptions, context: MergeContext
) -> StateDict:
    """RegMean with block k's Grams taken on the merged prefix's outputs (module docstring)."""
    family, tasks = context.family, list(context.experts)
    batches = check_batches("regmean_plus_plus", context)
    backbones = {t: family.backbone(m).eval() for t, m in context.experts.items()}
    merged = copy.deepcopy(context.base).eval()   # M: θ₀, then the averaged pre-block; blocks swapped in as merged
    mean = mean_state(experts)
    out = dict(base)
    pre = sorted(pre_block_names(family, merged, next(iter(batches.values()))[0]) & set(base))
    out.update({name: mean[name] for name in pre})
    write_into(merged, {name: out[name] for name in pre})
    solves = walk_regmean(family, context.base, ModuleWeights(context.base, backbones),
                          enter_streams(family, merged, batches), tasks, opts.off_diagonal,
                          lambda tensors: _update(out, tensors), merged=merged)
    blocks = in_blocks(family, merged)
    kept = [n for n in base if n not in pre and not n.startswith(blocks)]
    context.record.update(regmean_plus_plus_record(solves, pre, kept))
    return out


__all__ = ["RegMeanOptions", "block_grams", "merge_module", "pre_block_names", "regmean", "regmean_plus_plus",
           "regmean_weight", "shrink", "walk_regmean"]
