"""FeatCal's closed forms as pure tensor functions (no model, no I/O).

Every function takes float64 statistics and returns float64 parameters; the caller casts back.
Notation follows docs/algorithms.md#featcal: per task i, G_i = E[x_s x_sᵀ], K_i = E[x_e x_sᵀ],
C_i = α K_i + (1−α) G_i, ω_i = 1 / max(‖G_i‖_F, ε).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Iterable, Sequence

import torch
from torch import Tensor

log = logging.getLogger(__name__)

EPS = 1e-8
ILL_CONDITIONED = 1e12


@dataclass
class SolveReport:
    """What happened in one linear solve: the condition estimate and whether a fallback ran."""

    condition: float
    method: str

    @property
    def ill_conditioned(self) -> bool:
        return not (self.condition < ILL_CONDITIONED)


def cholesky_solve(rhs: Tensor, chol: Tensor) -> Tensor:
    """`torch.cholesky_solve(rhs, chol)` (lower factor) as its two triangular solves: the same numbers
    without the column-major copy of the factor it makes (0.6 GB beside a 8,960-wide system)."""
    y = torch.linalg.solve_triangular(chol, rhs, upper=False)
    return torch.linalg.solve_triangular(chol.mT, y, upper=True)


def condition_estimate(a: Tensor, chol: Tensor, iterations: int = 10) -> float:
    """κ(A) = λ_max / λ_min by power iteration on A and on A⁻¹ (through the Cholesky factor).

    O(iterations · d²) instead of an O(d³) eigendecomposition; it converges from below, which is
    enough to flag systems that are ill-conditioned by orders of magnitude.
    """
    g = torch.Generator().manual_seed(0)
    v = torch.randn(a.shape[0], 1, dtype=torch.float64, generator=g, device="cpu").to(a.device)   # one start everywhere
    w = v.clone()
    top = low_inv = 0.0
    for _ in range(iterations):
        v = a @ v
        top = float(v.norm())
        v = v / top
        w = cholesky_solve(w, chol)
        low_inv = float(w.norm())
        w = w / low_inv
    return top * low_inv


def task_weights(grams: Sequence[Tensor], eps: float = EPS) -> Tensor:
    """ω_i = 1 / max(‖G_i‖_F, ε): no task dominates the solve through the scale of its features."""
    norms = torch.stack([torch.linalg.matrix_norm(g, ord="fro") for g in grams])
    return 1.0 / norms.clamp_min(eps)


def target_cross(gram: Tensor, cross: Tensor, alpha: float) -> Tensor:
    """C_i = E[x_t x_sᵀ] with x_t = α x_e + (1−α) x_s, i.e. α K_i + (1−α) G_i."""
    return alpha * cross + (1.0 - alpha) * gram


def symmetrize_(a: Tensor, block: int = 1024) -> Tensor:
    """a ← (a + aᵀ)/2 in place, one pair of off-diagonal blocks at a time: the same numbers as
    `0.5 * (a + a.T)` (each entry is ½(a_ij + a_ji), and that sum commutes) without two more d × d
    buffers (1.3 GB beside a 8,960-wide down projection's system)."""
    d = a.shape[0]
    for i in range(0, d, block):
        for j in range(i, d, block):
            upper = a[i:i + block, j:j + block]
            mean = 0.5 * (upper + a[j:j + block, i:i + block].T)
            upper.copy_(mean)
            a[j:j + block, i:i + block].copy_(mean.T)
    return a


def spd_solve(a: Tensor, rhs: Tensor, name: str = "") -> tuple[Tensor, SolveReport]:
    """Solve A X = rhs for symmetric positive (semi)definite A in float64; a float64 `a` is
    symmetrized in place (the caller's system, which it does not read again).

    Cholesky first; if A is not numerically positive definite, fall back to an
    eigendecomposition pseudo-inverse and say so. Ill-conditioned systems are logged.
    """
    a = symmetrize_(a.to(torch.float64))
    rhs = rhs.to(torch.float64)
    chol, info = torch.linalg.cholesky_ex(a)
    if int(info) == 0:
        out = cholesky_solve(rhs, chol)
        report = SolveReport(condition_estimate(a, chol), "cholesky")
    else:
        vals, vecs = torch.linalg.eigh(a)
        cutoff = vals.abs().max() * a.shape[0] * torch.finfo(torch.float64).eps
        inv = torch.where(vals.abs() > cutoff, 1.0 / vals, torch.zeros_like(vals))
        out = vecs @ (inv[:, None] * (vecs.T @ rhs))
        low = float(vals[0])
        report = SolveReport(float(vals[-1].abs()) / low if low > 0 else float("inf"), "eigh-pinv")
        log.warning("%s: system not positive definite; used an eigendecomposition pseudo-inverse", name)
    if report.ill_conditioned:
        log.warning("%s: ill-conditioned system (condition %.3g); consider a larger ridge λ", name, report.condition)
    return out, report


def solve_linear_weight(
    grams: Sequence[Tensor],
    crosses: Sequence[Tensor],
    expert_weights: Sequence[Tensor],
    anchor: Tensor,
    alpha: float,
    ridge: float,
    omegas: Tensor | None = None,
    name: str = "",
) -> tuple[Tensor, SolveReport]:
    """W* = (Σ_i ω_i W_i C_i + λ W_anc)(Σ_i ω_i G_i + λ I)⁻¹.

    Minimises Σ_i ω_i E‖W x_s − W_i x_t‖² + λ‖W − W_anc‖²_F. W has shape (m, d), G_i, K_i (d, d).
    """
    targets = [w_i.to(torch.float64) @ target_cross(g, k, alpha) for g, k, w_i in zip(grams, crosses, expert_weights)]
    return solve_linear_targets(grams, targets, anchor, ridge, omegas, name)


def solve_linear_targets(
    grams: Sequence[Tensor],
    targets: Sequence[Tensor],
    anchor: Tensor,
    ridge: float,
    omegas: Tensor | None = None,
    name: str = "",
) -> tuple[Tensor, SolveReport]:
    """`solve_linear_weight` given each task's W_i C_i (m, d) instead of its cross moment."""
    lhs, rhs, _ = normal_equations(zip(grams, targets), anchor, ridge, omegas)
    return solve_normal_equations(lhs, rhs, name)


@dataclass
class NormalEquations:
    """Σ_i ω_i G_i + λ I and Σ_i ω_i W_i C_i + λ W_anc, grown one task at a time: a task's d × d Gram
    can be let go of as soon as it is added, before the next task's rows are read."""

    lhs: Tensor
    rhs: Tensor
    omegas: list[Tensor]

    @classmethod
    def start(cls, anchor: Tensor, ridge: float) -> "NormalEquations":
        d = anchor.shape[1]
        lhs = torch.zeros(d, d, dtype=torch.float64, device=anchor.device)
        lhs.diagonal().fill_(ridge)   # λ I without an identity and a scaled copy of it (two more d × d buffers)
        return cls(lhs, ridge * anchor.to(torch.float64), [])

    def add(self, gram: Tensor, target: Tensor, omega: Tensor | None = None) -> None:
        """One task's (G_i, W_i C_i), weighted by `omega` (`task_weights`' unless given)."""
        w = omega if omega is not None else task_weights([gram])[0]
        self.lhs.add_(gram, alpha=float(w))   # no ω_i G_i buffer beside the sum
        self.rhs.add_(target, alpha=float(w))
        self.omegas.append(w)

    def solve(self, name: str = "") -> tuple[Tensor, SolveReport, Tensor]:
        """W* (W* lhs = rhs), its report and the ω_i; the system is used up."""
        weight, report = solve_normal_equations(self.lhs, self.rhs, name)
        self.lhs = self.rhs = None
        return weight, report, torch.stack(self.omegas)


def normal_equations(
    tasks: Iterable[tuple[Tensor, Tensor]], anchor: Tensor, ridge: float, omegas: Tensor | None = None,
) -> tuple[Tensor, Tensor, Tensor]:
    """`NormalEquations`' (lhs, rhs, ω) from (G_i, W_i C_i) pairs. Pairs are consumed one at a time,
    so a lazy iterable holds one task's d × d Gram at a time, not every task's."""
    system = NormalEquations.start(anchor, ridge)
    for i, (g, t) in enumerate(tasks):
        system.add(g, t, None if omegas is None else omegas[i])
    return system.lhs, system.rhs, torch.stack(system.omegas)


def solve_normal_equations(lhs: Tensor, rhs: Tensor, name: str = "") -> tuple[Tensor, SolveReport]:
    """W* from `normal_equations`' (lhs, rhs): W* lhs = rhs."""
    solution_t, report = spd_solve(lhs, rhs.T, name)
    return solution_t.T.contiguous(), report


def expert_output(expert_weight: Tensor, expert_bias: Tensor, target_mean: Tensor) -> Tensor:
    """b_i + W_i μ_t,i: the expert's mean output on the target rows, what `solve_bias` reads of an
    expert (formed as a task is folded in, its weight need not be held to the end of the block)."""
    return expert_bias.to(torch.float64) + expert_weight.to(torch.float64) @ target_mean


def solve_bias(
    weight: Tensor,
    student_means: Sequence[Tensor],
    expert_outputs: Sequence[Tensor],
    anchor_bias: Tensor,
    ridge: float,
    omegas: Tensor,
) -> Tensor:
    """b* = [Σ_i ω_i (b_i + W_i μ_t,i − W* μ_s,i) + λ b_anc] / (Σ_i ω_i + λ), after the weight;
    `expert_outputs` holds each task's b_i + W_i μ_t,i (`expert_output`)."""
    weight = weight.to(torch.float64)
    num = ridge * anchor_bias.to(torch.float64)
    for w, mu_s, out_i in zip(omegas, student_means, expert_outputs):
        num = num + w * (out_i - weight @ mu_s)
    return num / (omegas.sum() + ridge)


def solve_layernorm(
    first: Sequence[Tensor],
    second: Sequence[Tensor],
    expert_gammas: Sequence[Tensor],
    expert_betas: Sequence[Tensor],
    anchor_gamma: Tensor,
    anchor_beta: Tensor,
    ridge: float,
) -> tuple[Tensor, Tensor]:
    """Per-channel 2×2 normal equations for LayerNorm's affine (γ, β).

    With z the student's normalised input, m_i = E[z], e_i = E[z²]:
    [Σe_i + λ, Σm_i; Σm_i, T + λ] [γ; β] = [Σ(e_i γ_i + m_i β_i) + λγ_anc; Σ(m_i γ_i + β_i) + λβ_anc].
    """
    n_tasks = len(first)
    m = torch.stack([t.to(torch.float64) for t in first])
    e = torch.stack([t.to(torch.float64) for t in second])
    g = torch.stack([t.to(torch.float64) for t in expert_gammas])
    b = torch.stack([t.to(torch.float64) for t in expert_betas])
    a11 = e.sum(0) + ridge
    a12 = m.sum(0)
    a22 = n_tasks + ridge
    r1 = (e * g + m * b).sum(0) + ridge * anchor_gamma.to(torch.float64)
    r2 = (m * g + b).sum(0) + ridge * anchor_beta.to(torch.float64)
    det = a11 * a22 - a12 * a12
    det = torch.where(det.abs() < 1e-8, torch.full_like(det, 1e-8), det)
    gamma = (a22 * r1 - a12 * r2) / det
    beta = (a11 * r2 - a12 * r1) / det
    return gamma, beta


def solve_rmsnorm(
    second: Sequence[Tensor],
    expert_gammas: Sequence[Tensor],
    anchor_gamma: Tensor,
    ridge: float,
) -> Tensor:
    """RMSNorm γ* = (Σ_i e_i γ_i + λ γ_anc) / (Σ_i e_i + λ), e_i = E[z²], z = x / rms(x)."""
    e = torch.stack([t.to(torch.float64) for t in second])
    g = torch.stack([t.to(torch.float64) for t in expert_gammas])
    return ((e * g).sum(0) + ridge * anchor_gamma.to(torch.float64)) / (e.sum(0) + ridge)


def anchor(merged: Tensor, base: Tensor, rho: float) -> Tensor:
    """W_anc = ρ W_mer + (1−ρ) W_base, from the pre-calibration merged weights."""
    return rho * merged.to(torch.float64) + (1.0 - rho) * base.to(torch.float64)
