"""TSV-M, Task Singular Vectors Merge (Gargiulo et al., "Task Singular Vectors: Reducing Task
Interference in Model Merging", CVPR 2025, arXiv:2412.00081).

Per 2-D tensor, with τ_i ∈ ℝ^{m×n}, r = min(m, n) and k = ⌊r/T⌋:
  1. τ_i = U_i diag(s_i) V_iᵀ (thin SVD); keep the top k of each task;
  2. Ū = [U_1[:, :k], …, U_T[:, :k], 0] ∈ ℝ^{m×r}, s̄ = [s_1[:k], …, s_T[:k], 0] ∈ ℝ^r,
     V̄ᵀ = [V_1ᵀ[:k]; …; V_Tᵀ[:k]; 0] ∈ ℝ^{r×n} (slots ≥ T·k stay zero);
  3. decorrelate across tasks: Ū⊥ = polar(Ū), V̄ᵀ⊥ = polar(V̄ᵀ) (SVD polar / Procrustes, as the
     official code; the paper's whitening Ū(ŪᵀŪ)^{-1/2} is the same at full column rank);
  4. Δ = Ū⊥ diag(s̄) V̄ᵀ⊥.
Every other tensor: Δ = mean_i τ_i. Result θ = θ₀ + α·Δ.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import dataclass
from typing import ClassVar

from torch import Tensor

from featcal.merging.registry import StateDict, register
from featcal.merging.spectral import (
    SVD_DTYPES,
    Factors,
    SpectralOptions,
    concat_factors,
    merge_per_matrix,
    polar,
    top_svd,
)

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class TsvOptions(SpectralOptions):
    """TSV-M options (see ``SpectralOptions`` for exclude and svd_dtype).

    alpha: α = 1.0, FusionBench's data-free default (the official code sweeps α ∈ {0.1, …, 3.0}
        on a labelled validation split; here that choice belongs to the dev split).
    """

    method: ClassVar[str] = "tsv_m"

    alpha: float = 1.0


def tsv_rank(r: int, tasks: int) -> int:
    """k = ⌊r/T⌋, the singular directions kept per task."""
    return r // tasks


def tsv_factors(taus: Sequence[Tensor]) -> Factors:
    """(Ū⊥, s̄, V̄ᵀ⊥) of steps 1–3 for one tensor's task matrices."""
    m, n = taus[0].shape
    r = min(m, n)
    k = tsv_rank(r, len(taus))
    u_bar, s_bar, vh_bar = concat_factors([top_svd(tau, k) for tau in taus], r)
    return polar(u_bar), s_bar, polar(vh_bar)


def tsv_delta(name: str, taus: list[Tensor]) -> Tensor:
    """Δ = Ū⊥ diag(s̄) V̄ᵀ⊥; Δ = 0 when r < T (k = 0), as the reference code."""
    r = min(taus[0].shape)
    if tsv_rank(r, len(taus)) == 0:
        log.warning("tensor %r: r = %d < T = %d, so TSV-M keeps k = 0 directions and leaves it at θ₀", name, r, len(taus))
        return taus[0].new_zeros(taus[0].shape)
    u, s, vh = tsv_factors(taus)
    return (u * s) @ vh


@register("tsv_m", TsvOptions)
def tsv_m(base: StateDict, experts: Sequence[StateDict], opts: TsvOptions) -> StateDict:
    """θ = θ₀ + α·Δ, Δ = Ū⊥ diag(s̄) V̄ᵀ⊥ per matrix (module docstring), mean τ elsewhere."""
    return merge_per_matrix(base, experts, tsv_delta, exclude=opts.exclude, alpha=opts.alpha,
                            work_dtype=SVD_DTYPES[opts.svd_dtype])
