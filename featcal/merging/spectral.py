"""Shared pieces of the per-matrix merges (TSV-M, Iso-C, Iso-CTS, WUDI).

Each of these methods treats every 2-D floating tensor that no ``exclude`` pattern matches as a
matrix τ_i ∈ ℝ^{m×n} (τ_i = θ_i − θ₀) and computes the merged update Δ from the T task matrices
of *that tensor alone*; every other tensor gets a simple rule (the mean of τ, or no update). So
they act tensor by tensor, and the lazy/sharded merge can run them one block at a time.

Notation: thin SVD A = U diag(s) Vᵀ with s descending; polar(A) := U Vᵀ, the orthogonal-Procrustes
factor (nearest matrix with orthonormal columns or rows; not QR, which depends on column order).
"""

from __future__ import annotations

import logging
import re
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import ClassVar

import torch
from torch import Tensor

from featcal.merging.dense import _check_real
from featcal.merging.registry import StateDict

log = logging.getLogger(__name__)

SVD_DTYPES = {"float32": torch.float32, "float64": torch.float64}
OTHER_RULES = ("average", "base")

Factors = tuple[Tensor, Tensor, Tensor]  # (U: m×k, s: k, Vᵀ: k×n)
MatrixRule = Callable[[str, list[Tensor]], Tensor]  # (tensor name, [τ_1..τ_T]) -> Δ


# --------------------------------------------------------------------------- option checks


def check_exclude(method: str, value: object) -> tuple[str, ...]:
    """``exclude`` as a tuple of valid regular expressions (a YAML list is accepted)."""
    if isinstance(value, str) or not isinstance(value, (list, tuple)):
        raise ValueError(f"merge method {method!r}: option 'exclude' must be a list of regular expressions, got {value!r}")
    for pattern in value:
        if not isinstance(pattern, str):
            raise ValueError(f"merge method {method!r}: option 'exclude' holds {pattern!r}, expected a string")
        try:
            re.compile(pattern)
        except re.error as exc:
            raise ValueError(f"merge method {method!r}: option 'exclude' pattern {pattern!r} is invalid ({exc})") from None
    return tuple(value)


def check_choice(method: str, key: str, value: object, choices: Sequence[str]) -> None:
    if value not in choices:
        raise ValueError(f"merge method {method!r}: option {key!r} must be one of {tuple(choices)}, got {value!r}")


@dataclass(frozen=True)
class SpectralOptions:
    """Options shared by TSV-M, Iso-C and Iso-CTS: θ = θ₀ + α·Δ.

    alpha: α, scales Δ of the matrices and the mean τ of every other tensor.
    exclude: regular expressions (``re.search`` on the backbone tensor name); a matching 2-D tensor
        is treated like a non-matrix tensor (mean of τ, scaled by α). Default none, as FusionBench.
    svd_dtype: "float64" (default) or "float32", the dtype every SVD and polar factor runs in.
        The reference code uses float32; float64 costs about 2× on CPU and makes the polar step
        on nearly dependent bases less sensitive to rounding. The result is cast back.
    """

    method: ClassVar[str] = "spectral"

    alpha: float = 1.0
    exclude: tuple[str, ...] = ()
    svd_dtype: str = "float64"

    def __post_init__(self) -> None:
        _check_real(self.method, "alpha", self.alpha)
        object.__setattr__(self, "exclude", check_exclude(self.method, self.exclude))
        check_choice(self.method, "svd_dtype", self.svd_dtype, tuple(SVD_DTYPES))


# --------------------------------------------------------------------------- linear algebra


def polar(a: Tensor) -> Tensor:
    """polar(A) = P Qᵀ for the thin SVD A = P diag(σ) Qᵀ; equals A(AᵀA)^{-1/2} at full column rank."""
    p, _, qh = torch.linalg.svd(a, full_matrices=False)
    return p @ qh


def top_svd(a: Tensor, k: int) -> Factors:
    """The top-k thin-SVD factors (U[:, :k], s[:k], Vᵀ[:k]) of ``a``."""
    u, s, vh = torch.linalg.svd(a, full_matrices=False)
    return u[:, :k], s[:k], vh[:k]


def concat_factors(parts: Sequence[Factors], r: int) -> Factors:
    """Ū = [U_1, U_2, …], s̄ = [s_1, s_2, …], V̄ᵀ = [V_1ᵀ; V_2ᵀ; …], zero-padded to r slots."""
    us, ss, vhs = zip(*parts)
    m, n = us[0].shape[0], vhs[0].shape[1]
    used = sum(s.numel() for s in ss)
    if used > r:
        raise ValueError(f"the blocks fill {used} singular slots, more than r = {r}")
    pad = r - used
    like = us[0]
    u_bar = torch.cat([*us, like.new_zeros(m, pad)], dim=1)
    s_bar = torch.cat([*ss, like.new_zeros(pad)])
    vh_bar = torch.cat([*vhs, like.new_zeros(pad, n)], dim=0)
    return u_bar, s_bar, vh_bar


def warn_if_rank_deficient(name: str, s: Tensor, what: str) -> None:
    """Log when s_min/s_max < 1e-6: the directions of the zero singular values are arbitrary."""
    if s.numel() and float(s.max()) > 0 and float(s.min()) < 1e-6 * float(s.max()):
        log.warning(
            "tensor %r: %s is rank deficient (s_min/s_max = %.1e); the flattened spectrum adds "
            "directions the SVD back-end chooses", name, what, float(s.min() / s.max()),
        )


# --------------------------------------------------------------------------- per-tensor driver


def is_matrix(name: str, tensor: Tensor, exclude: Sequence[str]) -> bool:
    """True for a 2-D tensor whose name no ``exclude`` pattern matches."""
    return tensor.ndim == 2 and not any(re.search(p, name) for p in exclude)


def merge_per_matrix(
    base: StateDict,
    experts: Sequence[StateDict],
    rule: MatrixRule,
    *,
    exclude: Sequence[str],
    alpha: float = 1.0,
    others: str = "average",
    work_dtype: torch.dtype | None = None,
) -> StateDict:
    """θ = θ₀ + α·Δ per tensor.

    Matrices (``is_matrix``): Δ = rule(name, [τ_1..τ_T]) with the τ_i cast to ``work_dtype``
    (None: the compute dtype handed over by the registry). Every other tensor: Δ = mean_i τ_i when
    ``others`` is "average", Δ = 0 (the tensor stays θ₀) when it is "base".
    """
    check_choice("merge_per_matrix", "others", others, OTHER_RULES)
    out: StateDict = {}
    for name, ref in base.items():
        taus = [expert[name] - ref for expert in experts]
        if is_matrix(name, ref, exclude):
            delta = rule(name, [t.to(work_dtype or t.dtype) for t in taus])
            if delta.shape != ref.shape:
                raise RuntimeError(
                    f"tensor {name!r}: the matrix rule returned shape {tuple(delta.shape)}, expected {tuple(ref.shape)}"
                )
            delta = delta.to(ref.dtype)
        elif others == "average":
            delta = torch.stack(taus).mean(dim=0)
        else:
            delta = torch.zeros_like(ref)
        out[name] = ref + alpha * delta
    return out
