"""Layer-wise AdaMerging (Yang et al., "AdaMerging: Adaptive Model Merging for Multi-Task Learning",
ICLR 2024, arXiv:2310.02575); docs/algorithms.md#layer-wise-adamerging.

One coefficient per parameter tensor and task, λ ∈ ℝ^{P×T} (a "layer" is a tensor, as in the
reference code), every floating backbone tensor included:

  θ_p(λ) = θ₀_p + Σ_t clamp(λ_{p,t}, 0, 1) · τ_{t,p},   λ⁽⁰⁾ = 0.3 (Task Arithmetic with 0.3).

λ minimises Σ_t mean_{x∈B_t} H(softmax(f_{θ(λ)}(x; head_t))), the entropy of each task's
predictions under its own frozen head, by Adam (lr 1e-3, β = (0.9, 0.999), no weight decay), one
step per draw of ``batches_per_step`` batches per task. The clamp acts on the raw λ in the forward
(so the gradient is 0 outside [0, 1]; λ can stick there, as in the reference). Eval mode (no
dropout); only λ gets gradients.

Data protocol: the batches are **unlabelled train-split** examples (``MergeContext.batches``), never
test — the public code adapts on the test split; a deliberate deviation (docs/algorithms.md#layer-wise-adamerging). The batch
order is a seeded shuffle per task, cycled; the record says how often each batch was drawn.

How a step runs (``fit_lambda``, the one loop for the in-memory merge and ``featcal.merging.lazy.lazy_merge``):
each task model runs its whole forward (``functional_call``) with the non-block tensors θ_outer(λ)
built once per step, and every block k replaced by a checkpointed call
(``torch.utils.checkpoint``) that builds θ_k(λ) from ``vectors.read`` (θ₀_k and the stacked τ_k)
and runs the block on it; backward recomputes it. ``vectors`` says where θ₀ and τ come from:
``HeldTaskVectors`` (in memory, this registry function) or ``featcal.merging.lazy.CheckpointTaskVectors``
(read per call from the checkpoints). Both run the same operations in the same order, so they give
the same λ and the same merge (bit for bit in ``tests/test_lazy.py``).

Memory. In memory: the models, θ₀ and the T task vectors, plus per step the saved
block inputs of every forward and one block's intermediates at a time (the checkpoint drops the
rest). Through ``lazy_merge``: θ₀'s and the T task vectors' non-block tensors (embeddings, norms,
pooler) for the whole run; one block's θ₀_k, T expert tensors, τ_k and θ_k(λ) at a time, read
again at each call; the heads; the saved block inputs (per step: tasks × ``batches_per_step``
batches × blocks hidden states) and one block's intermediates. The price is I/O and compute: each
step reads every block 2 × tasks × ``batches_per_step`` times (forward and recompute) and runs
each block's forward twice.
"""

from __future__ import annotations

import contextlib
import numbers
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Protocol

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.func import functional_call
from torch.utils.checkpoint import checkpoint

from featcal.families import Family
from featcal.io.checkpoints import module_prefix
from featcal.families.base import first_output
from featcal.families.llama import CACHE_KWARGS
from featcal.merging.dense import _check_real
from featcal.merging.registry import MergeContext, StateDict, register
from featcal.merging.regmean import check_batches


@dataclass(frozen=True)
class AdaMergingOptions:
    """Layer-wise AdaMerging options (defaults: the official code; docs/algorithms.md#layer-wise-adamerging).

    steps: Adam steps (default 500, the paper's; 0 returns Task Arithmetic with λ = init).
    lr: Adam learning rate (default 1e-3).
    init: λ⁽⁰⁾ for every tensor and task (default 0.3).
    batches_per_step: batches drawn per task for one step (default 2: the official loop consumes
        2 batches of 16 per task per step; FusionBench draws 1). The batch size is the supplier's.
    clamp: clamp λ to [0, 1] in the forward (default true, official; FusionBench's CLIP config: false).
    seed: seed of the per-task batch shuffles (default 0).
    """

    steps: int = 500
    lr: float = 1e-3
    init: float = 0.3
    batches_per_step: int = 2
    clamp: bool = True
    seed: int = 0

    def __post_init__(self) -> None:
        for key in ("steps", "batches_per_step", "seed"):
            value = getattr(self, key)
            low = 1 if key == "batches_per_step" else 0
            if isinstance(value, bool) or not isinstance(value, numbers.Integral) or value < low:
                raise ValueError(f"merge method 'adamerging': option {key!r} must be an integer >= {low}, got {value!r}")
        if _check_real("adamerging", "lr", self.lr) <= 0:
            raise ValueError(f"merge method 'adamerging': option 'lr' must be > 0, got {self.lr!r}")
        _check_real("adamerging", "init", self.init)
        if not isinstance(self.clamp, bool):
            raise ValueError(f"merge method 'adamerging': option 'clamp' must be true or false, got {self.clamp!r}")


def entropy(logits: Tensor) -> Tensor:
    """Mean over rows of H(softmax(logits)) = −Σ_c p_c log p_c (the official −Σ softmax·log_softmax)."""
    return -(F.softmax(logits, dim=-1) * F.log_softmax(logits, dim=-1)).sum(dim=-1).mean()


class BatchDraws:
    """Per task, batch indices in seeded shuffles, one shuffle after another; counts every draw."""

    def __init__(self, sizes: Mapping[str, int], seed: int):
        self.generator = torch.Generator().manual_seed(seed)
        self.sizes = dict(sizes)
        self.queues: dict[str, list[int]] = {t: [] for t in sizes}
        self.counts: dict[str, list[int]] = {t: [0] * n for t, n in sizes.items()}

    def next(self, task: str) -> int:
        if not self.queues[task]:
            self.queues[task] = torch.randperm(self.sizes[task], generator=self.generator, device="cpu").tolist()
        index = self.queues[task].pop(0)
        self.counts[task][index] += 1
        return index


def merged_tensors(base: StateDict, taus: Mapping[str, Tensor], lam: Tensor, names: Sequence[str], clamp: bool) -> StateDict:
    """θ_p = θ₀_p + Σ_t λ_{p,t} τ_{t,p} (λ clamped to [0, 1] when ``clamp``); differentiable in λ."""
    coef = lam.clamp(0.0, 1.0) if clamp else lam
    return combine(base, taus, coef, {name: p for p, name in enumerate(names)}, names)


def combine(base: StateDict, taus: Mapping[str, Tensor], coef: Tensor, rows: Mapping[str, int],
            names: Sequence[str]) -> StateDict:
    """θ_p = θ₀_p + Σ_t coef_{rows[p],t} τ_{t,p} for each of ``names`` (coef: λ, clamped or not)."""
    return {name: base[name] + torch.einsum("t,t...->...", coef[rows[name]], taus[name]) for name in names}


class TaskVectors(Protocol):
    """Where θ₀ and the stacked task vectors come from, by backbone tensor name."""

    def read(self, names: Sequence[str]) -> tuple[StateDict, StateDict]:
        """({name: θ₀}, {name: [τ_1, ..., τ_T] stacked}) in the compute dtype."""


class HeldTaskVectors:
    """θ₀ and τ_t = θ_t − θ₀ held in memory (the in-memory merge)."""

    def __init__(self, base: StateDict, experts: Sequence[StateDict], names: Sequence[str]):
        self.base = base
        self.taus = {name: torch.stack([e[name] - base[name] for e in experts]) for name in names}

    def read(self, names: Sequence[str]) -> tuple[StateDict, StateDict]:
        return {n: self.base[n] for n in names}, {n: self.taus[n] for n in names}


def task_logits(family: Family, model: nn.Module, prefix: str, params: StateDict, batch: Mapping[str, Tensor]) -> Tensor:
    """The task model's logits with its backbone's tensors replaced by ``params`` (head kept)."""
    dtypes = dict(model.state_dict(keep_vars=True))
    replaced = {prefix + n: v.to(dtypes[prefix + n].dtype) for n, v in params.items()}
    out = functional_call(model, replaced, args=(), kwargs=family.model_inputs(batch), strict=False)
    logits = getattr(out, "logits", None) if not isinstance(out, (tuple, list)) else first_output(out)
    if logits is None:
        raise ValueError(f"adamerging: {type(model).__name__} returns {type(out).__name__} without logits; the entropy "
                         "objective needs each task's classification head (a CLIP tower needs its zero-shot head)")
    return logits


def tied_aliases(backbone: nn.Module, names: Mapping[str, Tensor]) -> dict[str, str]:
    """Every tensor name of ``names`` that is tied to an earlier one (T5's shared embeddings) ->
    that earlier name: merged once, written under both, so the tie holds."""
    first: dict[int, str] = {}
    out: dict[str, str] = {}
    for name, param in backbone.named_parameters(remove_duplicate=False):
        if name not in names:
            continue
        if id(param) in first:
            out[name] = first[id(param)]
        else:
            first[id(param)] = name
    return out


class _Step:
    """The coefficients of the current step, which the patched blocks read."""

    coef: Tensor | None = None


@contextlib.contextmanager
def blocks_on_task_vectors(
    family: Family, like: nn.Module, models: Mapping[str, nn.Module], rows: Mapping[str, int],
    vectors: TaskVectors, step: _Step,
) -> Iterator[None]:
    """Inside, block k of every task model runs on θ_k(step.coef) = θ₀_k + Σ_t coef τ_t,k, built from
    ``vectors.read`` at each call inside a non-reentrant checkpoint (so nothing of it is kept for
    backward: the recompute reads it again). `rows`: backbone tensor name -> λ row (tied aliases
    included); `like` a backbone of the models' shape, for the blocks' name prefixes."""
    prefixes = [family.block_prefix(like, i) for i in range(len(family.blocks(like)))]
    patched = []

    def patch(block: nn.Module, prefix: str) -> None:
        original = block.forward
        dtypes = {n: v.dtype for n, v in block.state_dict(keep_vars=True).items()}
        names = [n for n in rows if n.startswith(prefix) and n[len(prefix):] in dtypes]
        inside = [False]

        def run(coef: Tensor, *args, **kwargs):
            base, taus = vectors.read(names)
            params = {n[len(prefix):]: v.to(dtypes[n[len(prefix):]]) for n, v in combine(base, taus, coef, rows, names).items()}
            inside[0] = True
            try:
                return functional_call(block, params, args, kwargs, strict=False)
            finally:
                inside[0] = False

        def forward(*args, **kwargs):
            if inside[0]:   # the call functional_call makes: the block's own forward
                return original(*args, **kwargs)
            # no cache (T5's decoder gets one): the recompute would find what the first run stored
            kwargs = {k: v for k, v in kwargs.items() if k not in CACHE_KWARGS}
            return checkpoint(run, step.coef, *args, use_reentrant=False, **kwargs)

        block.forward = forward
        patched.append(block)

    try:
        for model in models.values():
            for block, prefix in zip(family.blocks(family.backbone(model)), prefixes, strict=True):
                patch(block, prefix)
        yield
    finally:
        for block in patched:
            del block.forward


def fit_lambda(
    family: Family, like: nn.Module, models: Mapping[str, nn.Module], batches: Mapping[str, Sequence[Mapping[str, Tensor]]],
    names: Sequence[str], aliases: Mapping[str, str], vectors: TaskVectors, opts: AdaMergingOptions,
) -> tuple[Tensor, dict]:
    """λ after ``opts.steps`` Adam steps (rows: ``names``; ``aliases`` share their tensor's row), and
    the record. Non-block tensors are read once and held; blocks are read per call (module docstring)."""
    tasks = list(models)
    rows = {name: p for p, name in enumerate(names)}
    rows.update({alias: rows[name] for alias, name in aliases.items()})
    blocks = tuple(family.block_prefix(like, i) for i in range(len(family.blocks(like))))
    outer = [name for name in names if not name.startswith(blocks)]
    outer_base, outer_taus = vectors.read(outer)
    # λ lives where the task vectors do (`like` may be a meta-device skeleton: the lazy merge)
    device = next(iter(outer_base.values())).device if outer_base else next(like.parameters()).device
    lam = torch.full((len(names), len(tasks)), float(opts.init), dtype=torch.float32, device=device, requires_grad=True)
    optimizer = torch.optim.Adam([lam], lr=opts.lr, betas=(0.9, 0.999), weight_decay=0.0)
    models = {t: m.eval() for t, m in models.items()}
    prefixes = {t: _backbone_prefix(family, m) for t, m in models.items()}
    draws = BatchDraws({t: len(b) for t, b in batches.items()}, opts.seed)
    curve: list[float] = []
    step = _Step()
    with blocks_on_task_vectors(family, like, models, rows, vectors, step):
        for _ in range(opts.steps):
            step.coef = lam.clamp(0.0, 1.0) if opts.clamp else lam
            params = combine(outer_base, outer_taus, step.coef, rows, outer)
            loss = torch.zeros((), dtype=torch.float32, device=device)
            for task in tasks:
                for _ in range(opts.batches_per_step):
                    batch = batches[task][draws.next(task)]
                    loss = loss + entropy(task_logits(family, models[task], prefixes[task], params, batch).float())
            (grad,) = torch.autograd.grad(loss, [lam])
            lam.grad = grad
            optimizer.step()
            curve.append(float(loss.detach()))
            step.coef = None
    final = lam.detach().clamp(0.0, 1.0) if opts.clamp else lam.detach()
    per_tensor = {name: [round(float(v), 6) for v in final[p]] for p, name in enumerate(names)}
    record = {
        "tasks": tasks, "lambda": per_tensor, "entropy_per_step": curve, "batch_draws": draws.counts,
        "summary": {"steps": opts.steps, "entropy_first": curve[0] if curve else None,
                    "entropy_last": curve[-1] if curve else None,
                    "lambda_mean": round(float(final.mean()), 4), "lambda_min": round(float(final.min()), 4),
                    "lambda_max": round(float(final.max()), 4)},
    }
    return lam.detach(), record


@register("adamerging", AdaMergingOptions, needs=("activations",))
def adamerging(base: StateDict, experts: Sequence[StateDict], opts: AdaMergingOptions, context: MergeContext) -> StateDict:
    """θ(λ*) with λ* after ``steps`` Adam steps of entropy minimisation (module docstring)."""
    batches = check_batches("adamerging", context)
    aliases = tied_aliases(context.base, base)
    names = [name for name in base if name not in aliases]   # one λ row per tensor, tied names share it
    vectors = HeldTaskVectors(base, experts, names)
    lam, record = fit_lambda(context.family, context.base, context.experts, batches, names, aliases, vectors, opts)
    with torch.no_grad():
        out = merged_tensors(base, vectors.taus, lam, names, opts.clamp)
        out.update({alias: out[name] for alias, name in aliases.items()})
    context.record.update(record)
    return out


def _backbone_prefix(family: Family, model: nn.Module) -> str:
    """The name prefix of the backbone's tensors inside the task model ("bert." for BERT; "" if bare)."""
    backbone = family.backbone(model)
    return "" if backbone is model else module_prefix(model, backbone)


__all__ = ["AdaMergingOptions", "HeldTaskVectors", "TaskVectors", "adamerging", "combine", "entropy", "fit_lambda",
           "merged_tensors"]
