"""Iso-C and Iso-CTS, isotropic merging (Marczak et al., "No Task Left Behind: Isotropic Model
Merging with Common and Task-Specific Subspaces", ICML 2025, arXiv:2502.04959).

Iso-C, per 2-D tensor with r = min(m, n):
  Σ_i τ_i = U diag(s) Vᵀ,  σ̄ = (1/r) Σ_{j≤r} s_j,  Δ = σ̄ · U Vᵀ = σ̄ · polar(Σ_i τ_i).
Iso-CTS, per 2-D tensor, with the common fraction f:
  k_c0 = ⌊r·f⌋, S = round((r − k_c0)/T)·T (Python's half-to-even round), k_c = r − S, k_t = S/T;
  common: the top k_c factors (U_c, s_c, V_cᵀ) of Σ_i τ_i;
  task-specific: the top k_t factors of R_i = τ_i − U_c U_cᵀ τ_i (common *left* subspace removed);
  Ū = [U_1', …, U_T', U_c], s̄ = [s_1', …, s_T', s_c], V̄ᵀ = [V_1'ᵀ; …; V_T'ᵀ; V_cᵀ] (r slots);
  Δ = mean(s̄) · polar(Ū) · polar(V̄ᵀ).
Every other tensor: Δ = mean_i τ_i. Result θ = θ₀ + α·Δ. Iso-CTS assumes the (out, in) layout
(it is not transpose-equivariant); Iso-C does not care.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import ClassVar

import torch
from torch import Tensor

from featcal.merging.dense import _check_real
from featcal.merging.registry import StateDict, register
from featcal.merging.spectral import (
    SVD_DTYPES,
    Factors,
    MatrixRule,
    SpectralOptions,
    concat_factors,
    merge_per_matrix,
    polar,
    top_svd,
    warn_if_rank_deficient,
)


@dataclass(frozen=True)
class IsoCOptions(SpectralOptions):
    """Iso-C options (see ``SpectralOptions`` for exclude and svd_dtype).

    alpha: α = 1.30, the CLIP ViT-B/32 value of the RegMean++ authors' reproduction script (1.40 for
        B/16, 1.50 for L/14); FusionBench's config uses 1.0 and its docs 1.5; the official code
        sweeps α on a labelled validation split (here: the dev split).
    """

    method: ClassVar[str] = "iso_c"

    alpha: float = 1.30


@dataclass(frozen=True)
class IsoCTSOptions(SpectralOptions):
    """Iso-CTS options (see ``SpectralOptions`` for exclude and svd_dtype).

    alpha: α = 1.50, the CLIP ViT-B/32 value of the RegMean++ authors' script (1.60 for B/16, 1.90
        for L/14); FusionBench's docs use 1.5.
    common_space_fraction: f = 0.8 (official config and README), in (0, 1]; f = 1 gives Iso-C.
    """

    method: ClassVar[str] = "iso_cts"

    alpha: float = 1.50
    common_space_fraction: float = 0.8

    def __post_init__(self) -> None:
        super().__post_init__()
        if not 0.0 < _check_real(self.method, "common_space_fraction", self.common_space_fraction) <= 1.0:
            raise ValueError(
                f"merge method {self.method!r}: option 'common_space_fraction' must be in (0, 1], "
                f"got {self.common_space_fraction!r}"
            )


def iso_c_delta(name: str, taus: list[Tensor]) -> Tensor:
    """Δ = σ̄ · U Vᵀ for Σ_i τ_i = U diag(s) Vᵀ, σ̄ = mean of all r singular values."""
    u, s, vh = torch.linalg.svd(torch.stack(taus).sum(dim=0), full_matrices=False)
    warn_if_rank_deficient(name, s, "the sum of the task matrices")
    return s.mean() * (u @ vh)


def iso_cts_sizes(r: int, tasks: int, fraction: float) -> tuple[int, int]:
    """(k_c, k_t) with k_c + T·k_t = r, computed exactly as the official code (half-to-even round)."""
    common0 = math.floor(r * fraction)
    specific_total = round((r - common0) / tasks) * tasks
    return r - specific_total, specific_total // tasks


def iso_cts_factors(taus: Sequence[Tensor], fraction: float, name: str = "?") -> Factors:
    """(Ū, s̄, V̄ᵀ) before orthogonalisation: T task-specific blocks of k_t, then the common k_c."""
    m, n = taus[0].shape
    r = min(m, n)
    k_c, k_t = iso_cts_sizes(r, len(taus), fraction)
    if k_c < 0:
        raise ValueError(
            f"tensor {name!r}: Iso-CTS with r = {r}, T = {len(taus)}, common_space_fraction = {fraction} "
            f"gives {r - k_c} task-specific slots, more than r; raise common_space_fraction"
        )
    u_c, s_c, vh_c = top_svd(torch.stack(list(taus)).sum(dim=0), k_c)
    parts = [top_svd(tau - u_c @ (u_c.T @ tau), k_t) for tau in taus] if k_t else []
    return concat_factors([*parts, (u_c, s_c, vh_c)], r)


def iso_cts_delta(fraction: float) -> MatrixRule:
    """The Iso-CTS matrix rule for common fraction f: Δ = mean(s̄) · polar(Ū) · polar(V̄ᵀ)."""

    def rule(name: str, taus: list[Tensor]) -> Tensor:
        u_bar, s_bar, vh_bar = iso_cts_factors(taus, fraction, name)
        warn_if_rank_deficient(name, s_bar, "the common + task-specific spectrum")
        return s_bar.mean() * (polar(u_bar) @ polar(vh_bar))

    return rule


@register("iso_c", IsoCOptions)
def iso_c(base: StateDict, experts: Sequence[StateDict], opts: IsoCOptions) -> StateDict:
    """θ = θ₀ + α·σ̄·polar(Σ_i τ_i) per matrix (module docstring), mean τ elsewhere."""
    return merge_per_matrix(base, experts, iso_c_delta, exclude=opts.exclude, alpha=opts.alpha,
                            work_dtype=SVD_DTYPES[opts.svd_dtype])


@register("iso_cts", IsoCTSOptions)
def iso_cts(base: StateDict, experts: Sequence[StateDict], opts: IsoCTSOptions) -> StateDict:
    """θ = θ₀ + α·mean(s̄)·polar(Ū)·polar(V̄ᵀ) per matrix (module docstring), mean τ elsewhere."""
    return merge_per_matrix(base, experts, iso_cts_delta(opts.common_space_fraction), exclude=opts.exclude,
                            alpha=opts.alpha, work_dtype=SVD_DTYPES[opts.svd_dtype])
