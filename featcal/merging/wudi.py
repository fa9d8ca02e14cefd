"""WUDI merging (Cheng et al., "Whoever Started the Interference Should End It: Guiding Data-Free
Model Merging via Task Vectors", ICML 2025, arXiv:2503.08099).

Each task vector stands in for its task's inputs (its rows lie near the span of the inputs the layer
saw in fine-tuning), so per 2-D tensor (layout (out, in), τ_i ∈ ℝ^{m×n}) the merged update
minimises the interference measured through the task vectors themselves:

  L(τ_m) = Σ_i ‖(τ_m − τ_i) τ_iᵀ‖²_F / ‖τ_i‖²_F,

by Adam (lr 1e-5, no weight decay, default betas) for a fixed number of full-batch steps from
τ_m⁽⁰⁾ = Σ_i τ_i. The early-stopped iterate is the method (not the closed-form optimum). θ = θ₀ + τ_m,
no α. Tasks with τ_i = 0 in a tensor are left out of L (they would divide by zero).

The gradient is evaluated exactly in Gram form, ∇L = 2(τ_m A − B) with A = Σ_i w_i τ_iᵀτ_i and
B = Σ_i w_i τ_i τ_iᵀ τ_i, w_i = 1/‖τ_i‖²_F (A and B computed once, in float64): one m×n×n product
per step instead of the reference's T m×m products, the same function and gradient. With at most one
non-zero task the gradient is exactly 0 and τ_m = Σ_i τ_i is returned, as the reference does.
"""

from __future__ import annotations

import numbers
from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import Tensor

from featcal.merging.dense import _check_real
from featcal.merging.registry import StateDict, register
from featcal.merging.spectral import OTHER_RULES, check_choice, check_exclude, merge_per_matrix

# The families' embedding tables: BERT/CLIP/ViT `embeddings.*`, Llama `embed_tokens`, T5 `shared`
# and its relative attention bias. Their layout is not (out, in), and vocab-sized tables are costly.
EMBEDDING_PATTERNS = ("embed", "shared", "relative_attention_bias")


@dataclass(frozen=True)
class WudiOptions:
    """WUDI options.

    iterations: Adam steps per tensor (default 300, the official ViT code's `--iter`; FusionBench's
        config uses 400). 0 gives Task Arithmetic with λ = 1.
    lr: Adam learning rate (default 1e-5, official ViT code; its RoBERTa code uses 2e-5). Absolute,
        not relative to ‖τ‖: every entry moves by at most about 3·iterations·lr.
    others: rule for tensors not optimised: "base" (default; official ViT code: they stay θ₀) or
        "average" (FusionBench: mean of τ, i.e. weight averaging).
    exclude: regular expressions (``re.search`` on the tensor name) of 2-D tensors not optimised
        (they follow ``others``). Default: the embedding tables (``EMBEDDING_PATTERNS``), which the
        official code leaves at θ₀ and this project excludes by default (docs/algorithms.md#wudi); [] optimises every 2-D tensor
        (FusionBench).
    The method has no randomness: the result is a deterministic function of the inputs.
    """

    iterations: int = 300
    lr: float = 1e-5
    others: str = "base"
    exclude: tuple[str, ...] = EMBEDDING_PATTERNS

    def __post_init__(self) -> None:
        if isinstance(self.iterations, bool) or not isinstance(self.iterations, numbers.Integral) or self.iterations < 0:
            raise ValueError(f"merge method 'wudi': option 'iterations' must be an integer >= 0, got {self.iterations!r}")
        if _check_real("wudi", "lr", self.lr) <= 0:
            raise ValueError(f"merge method 'wudi': option 'lr' must be > 0, got {self.lr!r}")
        check_choice("wudi", "others", self.others, OTHER_RULES)
        object.__setattr__(self, "exclude", check_exclude("wudi", self.exclude))


def wudi_delta(taus: Sequence[Tensor], iterations: int, lr: float) -> Tensor:
    """τ_m after ``iterations`` Adam steps on L from Σ_i τ_i (module docstring)."""
    tau_sum = torch.stack(list(taus)).sum(dim=0)
    active = [t for t in taus if bool(t.any())]
    if iterations == 0 or len(active) <= 1:
        return tau_sum
    n = tau_sum.shape[1]
    a = torch.zeros(n, n, dtype=torch.float64, device=tau_sum.device)
    b = torch.zeros(tau_sum.shape, dtype=torch.float64, device=tau_sum.device)
    for tau in active:
        t64 = tau.to(torch.float64)
        gram = t64.T @ t64
        weight = 1.0 / t64.square().sum()
        a += weight * gram
        b += weight * (t64 @ gram)
    a, b = a.to(tau_sum.dtype), b.to(tau_sum.dtype)
    tau_m = torch.nn.Parameter(tau_sum.clone())
    optimizer = torch.optim.Adam([tau_m], lr=lr, weight_decay=0.0)
    for _ in range(iterations):
        tau_m.grad = 2.0 * (tau_m.detach() @ a - b)
        optimizer.step()
    return tau_m.detach()


@register("wudi", WudiOptions)
def wudi(base: StateDict, experts: Sequence[StateDict], opts: WudiOptions) -> StateDict:
    """θ = θ₀ + τ_m per optimised matrix (module docstring); θ₀ or θ₀ + mean τ elsewhere."""
    return merge_per_matrix(
        base, experts, lambda name, taus: wudi_delta(taus, opts.iterations, opts.lr),
        exclude=opts.exclude, others=opts.others,
    )
