"""Layer-wise AdaMerging (Yang et al., "AdaMerging: Adaptive Model Merging for Multi-Task Learning",
ICLR 2024, arXiv:2310.02575); ../shared/spec/anchors.md §8.

One coefficient per parameter tensor and task, λ ∈ ℝ^{P×T} (a "layer" is a tensor, as in the
reference code), every floating backbone tensor included:

  θ_p(λ) = θ₀_p + Σ_t clamp(λ_{p,t}, 0, 1) · τ_{t,p},   λ⁽⁰⁾ = 0.3 (Task Arithmetic with 0.3).

λ minimises Σ_t mean_{x∈B_t} H(softmax(f_{θ(λ)}(x; head_t))), the entropy of each task's
predictions under its own frozen head, by Adam (lr 1e-3, β = (0.9, 0.999), no weight decay), one
step per draw of ``batches_per_step`` batches per task. The clamp acts on the raw λ in the forward
(so the gradient is 0 outside [0, 1]; λ can stick there, as in the reference). Eval mode (no
dropout); only λ gets gradients.

Data protocol: the batches are **unlabelled train-split** examples (``MergeContext.batches``), never
test — the public code adapts on the test split; this is the deviation the spec asks for. The batch
order is a seeded shuffle per task, cycled; the record says how often each batch was drawn.
"""

from __future__ import annotations

import numbers
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.func import functional_call

from featcal.families import Family
from featcal.families.base import first_output
from featcal.merging.dense import _check_real
from featcal.merging.registry import MergeContext, StateDict, register
from featcal.merging.regmean import check_batches


@dataclass(frozen=True)
class AdaMergingOptions:
    """Layer-wise AdaMerging options (defaults: the official code, spec §8).

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
            self.queues[task] = torch.randperm(self.sizes[task], generator=self.generator).tolist()
        index = self.queues[task].pop(0)
        self.counts[task][index] += 1
        return index


def merged_tensors(base: StateDict, taus: Mapping[str, Tensor], lam: Tensor, names: Sequence[str], clamp: bool) -> StateDict:
    """θ_p = θ₀_p + Σ_t λ_{p,t} τ_{t,p} (λ clamped to [0, 1] when ``clamp``); differentiable in λ."""
    coef = lam.clamp(0.0, 1.0) if clamp else lam
    return {name: base[name] + torch.einsum("t,t...->...", coef[p], taus[name]) for p, name in enumerate(names)}


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


@register("adamerging", AdaMergingOptions, needs=("activations",))
def adamerging(base: StateDict, experts: Sequence[StateDict], opts: AdaMergingOptions, context: MergeContext) -> StateDict:
    """θ(λ*) with λ* after ``steps`` Adam steps of entropy minimisation (module docstring)."""
    family, tasks = context.family, list(context.experts)
    batches = check_batches("adamerging", context)
    aliases = tied_aliases(context.base, base)
    names = [name for name in base if name not in aliases]   # one λ row per tensor, tied names share it
    taus = {name: torch.stack([e[name] - base[name] for e in experts]) for name in names}
    lam = torch.full((len(names), len(tasks)), float(opts.init), dtype=torch.float32, requires_grad=True)
    optimizer = torch.optim.Adam([lam], lr=opts.lr, betas=(0.9, 0.999), weight_decay=0.0)
    models = {t: m.eval() for t, m in context.experts.items()}
    prefixes = {t: _backbone_prefix(family, m) for t, m in models.items()}
    draws = BatchDraws({t: len(b) for t, b in batches.items()}, opts.seed)
    curve: list[float] = []
    for _ in range(opts.steps):
        params = merged_tensors(base, taus, lam, names, opts.clamp)
        loss = torch.zeros((), dtype=torch.float32)
        for task in tasks:
            for _ in range(opts.batches_per_step):
                batch = batches[task][draws.next(task)]
                loss = loss + entropy(task_logits(family, models[task], prefixes[task], params, batch).float())
        (grad,) = torch.autograd.grad(loss, [lam])
        lam.grad = grad
        optimizer.step()
        curve.append(float(loss.detach()))
    with torch.no_grad():
        out = merged_tensors(base, taus, lam, names, opts.clamp)
        out.update({alias: out[name] for alias, name in aliases.items()})
        final = lam.clamp(0.0, 1.0) if opts.clamp else lam.detach()
    per_tensor = {name: [round(float(v), 6) for v in final[p]] for p, name in enumerate(names)}
    context.record.update({
        "tasks": tasks, "lambda": per_tensor, "entropy_per_step": curve, "batch_draws": draws.counts,
        "summary": {"steps": opts.steps, "entropy_first": curve[0] if curve else None,
                    "entropy_last": curve[-1] if curve else None,
                    "lambda_mean": round(float(final.mean()), 4), "lambda_min": round(float(final.min()), 4),
                    "lambda_max": round(float(final.max()), 4)},
    })
    return out


def _backbone_prefix(family: Family, model: nn.Module) -> str:
    """The name prefix of the backbone's tensors inside the task model ("bert." for BERT; "" if bare)."""
    from featcal.lazy import module_prefix   # featcal.lazy imports the merging package

    backbone = family.backbone(model)
    return "" if backbone is model else module_prefix(model, backbone)


__all__ = ["AdaMergingOptions", "adamerging", "entropy", "merged_tensors"]
