"""Dense merge methods: simple averaging, Task Arithmetic, TIES and DARE.

Notation (spec "Dense merges"): θ₀ = base, θ_t = expert t (t = 1..T), τ_t = θ_t − θ₀.
Each method is a pure function over backbone state dicts of floating tensors that
``merge_state_dicts`` has already validated and upcast to >= float32.
"""

from __future__ import annotations

import hashlib
import math
import numbers
from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import Tensor

from featcal.merging.registry import StateDict, register

TIES_SCOPES = ("tensor", "model")
DARE_THEN = ("task_arithmetic", "ties")


# --------------------------------------------------------------------------- option checks


def _check_real(method: str, key: str, value: object) -> float:
    if isinstance(value, bool) or not isinstance(value, numbers.Real) or not math.isfinite(value):
        raise ValueError(f"merge method {method!r}: option {key!r} must be a finite number, got {value!r}")
    return float(value)


def _check_density(method: str, value: object) -> None:
    density = _check_real(method, "density", value)
    if not 0.0 <= density <= 1.0:
        raise ValueError(f"merge method {method!r}: option 'density' must be in [0, 1], got {value!r}")


def _check_scope(method: str, value: object) -> None:
    if value not in TIES_SCOPES:
        raise ValueError(f"merge method {method!r}: option 'scope' must be one of {TIES_SCOPES}, got {value!r}")


# --------------------------------------------------------------------------- options


@dataclass(frozen=True)
class AverageOptions:
    """Simple averaging takes no options."""


@dataclass(frozen=True)
class TaskArithmeticOptions:
    """Task Arithmetic: θ = θ₀ + s Σ_t τ_t.

    scale: s (default 0.3, docs/algorithms.md#task-arithmetic; the original papers tune s in 0.1..1.0 on dev).
    """

    scale: float = 0.3

    def __post_init__(self) -> None:
        _check_real("task_arithmetic", "scale", self.scale)


@dataclass(frozen=True)
class TiesOptions:
    """TIES: trim, elect sign, disjoint mean; θ = θ₀ + s·τ_m.

    density: k, the fraction of entries of each task vector kept by |τ| (default 0.2 = top-20%).
        Exactly ⌊k·n + 1/2⌋ of the n entries are kept (``keep_count``: round half up, clipped to
        [0, n]; mergekit truncates to ⌊k·n⌋ instead, so where k·n has a fractional part >= 1/2
        this keeps one entry more than mergekit), ties at the threshold broken by lowest index;
        k = 0 keeps nothing, so the result is θ₀.
    scale: s (default 0.3, chosen to match Task Arithmetic since no TIES default is prescribed;
        the TIES paper tunes s on a validation split and often lands near 1.0, because τ_m is a
        mean rather than a sum).
    scope: "tensor" (default; trim each tensor of τ_t separately, as mergekit does, but with the
        keep count above) or "model"
        (trim over the whole flattened task vector across all floating tensors, as the original
        paper; ties broken by position in base-dict order, then flat index).
    """

    density: float = 0.2
    scale: float = 0.3
    scope: str = "tensor"

    def __post_init__(self) -> None:
        _check_density("ties", self.density)
        _check_real("ties", "scale", self.scale)
        _check_scope("ties", self.scope)


@dataclass(frozen=True)
class DareOptions:
    """DARE: τ̃_t = (m_t ⊙ τ_t)/(1 − p), m_t ~ Bernoulli(1 − p); then Task Arithmetic or TIES on τ̃.

    drop_rate: p in [0, 1) (default 0.5). p = 0 leaves τ unchanged.
    seed: base seed (default 0). The mask of expert t for tensor `name` comes from a
        torch.Generator seeded with a hash of (seed, t, name), so it does not depend on dict order
        nor on which other tensors are merged in the same call.
    then: "task_arithmetic" (default) or "ties".
    scale: s of the `then` method (default 0.3).
    density, scope: TIES options, only valid with then="ties" (None -> TIES defaults 0.2 and
        "tensor"). Setting either with then="task_arithmetic" is an error. Note the TIES trim runs
        on the rescaled τ̃; density=1.0 gives DARE's sparsification followed by TIES's sign
        election only (mergekit's "dare_ties").
    """

    drop_rate: float = 0.5
    seed: int = 0
    then: str = "task_arithmetic"
    scale: float = 0.3
    density: float | None = None
    scope: str | None = None

    def __post_init__(self) -> None:
        p = _check_real("dare", "drop_rate", self.drop_rate)
        if not 0.0 <= p < 1.0:
            raise ValueError(f"merge method 'dare': option 'drop_rate' must be in [0, 1), got {self.drop_rate!r}")
        if isinstance(self.seed, bool) or not isinstance(self.seed, numbers.Integral):
            raise ValueError(f"merge method 'dare': option 'seed' must be an integer, got {self.seed!r}")
        if self.then not in DARE_THEN:
            raise ValueError(f"merge method 'dare': option 'then' must be one of {DARE_THEN}, got {self.then!r}")
        _check_real("dare", "scale", self.scale)
        if self.then == "task_arithmetic":
            for key in ("density", "scope"):
                if getattr(self, key) is not None:
                    raise ValueError(
                        f"merge method 'dare': option {key!r} applies only with then='ties', "
                        "but then='task_arithmetic'"
                    )
        if self.density is not None:
            _check_density("dare", self.density)
        if self.scope is not None:
            _check_scope("dare", self.scope)

    def ties_options(self) -> TiesOptions:
        """The TIES options this DARE configuration implies."""
        defaults = TiesOptions()
        return TiesOptions(
            density=defaults.density if self.density is None else self.density,
            scale=self.scale,
            scope=defaults.scope if self.scope is None else self.scope,
        )


# --------------------------------------------------------------------------- pure tensor functions


def task_vectors(base: StateDict, experts: Sequence[StateDict]) -> list[StateDict]:
    """τ_t = θ_t − θ₀ for every expert t."""
    return [{name: expert[name] - ref for name, ref in base.items()} for expert in experts]


def keep_count(density: float, n: int) -> int:
    """⌊k·n + 1/2⌋ (round half up, not Python's half-to-even), clipped to [0, n]; mergekit's
    magnitude trim keeps int(k·n), one fewer when the fractional part of k·n is >= 1/2."""
    return min(n, max(0, math.floor(density * n + 0.5)))


def topk_mask(tau: Tensor, density: float) -> Tensor:
    """Boolean mask of the round(k·n) entries of largest |τ|; ties broken by lowest flat index."""
    n = tau.numel()
    k = keep_count(density, n)
    if k >= n:
        return torch.ones_like(tau, dtype=torch.bool)
    mask = torch.zeros(n, dtype=torch.bool, device=tau.device)
    if k > 0:
        # A stable descending sort keeps equal magnitudes in index order.
        order = torch.sort(tau.abs().flatten(), descending=True, stable=True).indices
        mask[order[:k]] = True
    return mask.view(tau.shape)


_RADIX_BITS = 11


def _magnitude_bits(tau: Tensor, int_dtype: torch.dtype, float_dtype: torch.dtype) -> Tensor:
    """|τ| as the integer bit pattern of ``float_dtype``: monotone in |τ| for non-negative floats."""
    return tau.abs().to(float_dtype).flatten().view(int_dtype)


def model_topk_masks(taus: Sequence[Tensor], density: float) -> list[Tensor]:
    """Masks keeping the round(k·N) entries of largest |τ| over all ``taus`` together.

    N = Σ numel. Ties at the threshold are broken by position (tensor order, then flat index).
    Exact and without concatenation (no kthvalue/quantile, so no 2²⁴ / 2³¹ element limits): the
    K-th largest magnitude v is found by a radix select on the IEEE bit patterns (non-negative
    floats order like their bits), counting digits tensor by tensor; then all |τ| > v are kept
    plus the first K − #{|τ| > v} entries equal to v.
    """
    n_total = sum(t.numel() for t in taus)
    k = keep_count(density, n_total)
    if k >= n_total:
        return [torch.ones_like(t, dtype=torch.bool) for t in taus]
    if k == 0:
        return [torch.zeros_like(t, dtype=torch.bool) for t in taus]

    if any(t.dtype == torch.float64 for t in taus):
        float_dtype, int_dtype = torch.float64, torch.int64
    else:
        float_dtype, int_dtype = torch.float32, torch.int32

    # One magnitude copy of this task vector (as bits) is held during the search.
    mags = [_magnitude_bits(t, int_dtype, float_dtype) for t in taus]

    # Radix select of the k-th largest bit pattern, most significant digit first: one bincount
    # pass per digit over the magnitudes still tied with the threshold's prefix (usually few after
    # the first digit). n_above counts the magnitudes already known to be above the threshold.
    candidates = list(mags)
    n_above = 0
    threshold = 0
    bits_left = 63 if int_dtype == torch.int64 else 31  # the sign bit of |τ| is 0
    while bits_left > 0:
        width = min(_RADIX_BITS, bits_left)
        shift = bits_left - width
        digits = [(c >> shift) & ((1 << width) - 1) for c in candidates]
        counts = torch.zeros(1 << width, dtype=torch.int64, device="cpu")   # a host histogram
        for d in digits:
            if d.numel() > 0:
                counts += torch.bincount(d.long(), minlength=1 << width).cpu()
        at_least = counts.flip(0).cumsum(0).flip(0)  # at_least[d] = #{digit ≥ d}
        digit = int(torch.nonzero(n_above + at_least >= k).max())
        n_above += int(at_least[digit + 1]) if digit + 1 < (1 << width) else 0
        candidates = [c[d == digit] for c, d in zip(candidates, digits)]
        threshold = (threshold << width) | digit
        bits_left = shift

    masks = [(m > threshold).view(t.shape) for m, t in zip(mags, taus)]
    remaining = k - sum(int(m.sum()) for m in masks)
    for mag, mask in zip(mags, masks):
        if remaining <= 0:
            break
        equal = torch.nonzero(mag == threshold).flatten()[:remaining]
        mask.view(-1)[equal] = True
        remaining -= equal.numel()
    return masks


def trim(taus: Sequence[StateDict], density: float, scope: str) -> list[StateDict]:
    """τ̂_t: each task vector with all but its top-k fraction of |τ| set to zero."""
    trimmed: list[StateDict] = []
    for tau in taus:
        if scope == "tensor":
            masks = {name: topk_mask(t, density) for name, t in tau.items()}
        elif scope == "model":
            names = list(tau)
            masks = dict(zip(names, model_topk_masks([tau[n] for n in names], density)))
        else:
            raise ValueError(f"unknown TIES scope {scope!r}; expected one of {TIES_SCOPES}")
        trimmed.append({name: torch.where(masks[name], t, torch.zeros_like(t)) for name, t in tau.items()})
    return trimmed


def elect_sign(trimmed: Tensor) -> Tensor:
    """γ = sgn(Σ_t τ̂_t) over dim 0; where the sum is 0, the majority sign of the nonzero τ̂_t.

    If positive and negative entries are equally many (including none at all), γ = +1.
    """
    gamma = torch.sign(trimmed.sum(dim=0))
    positive = (trimmed > 0).sum(dim=0)
    negative = (trimmed < 0).sum(dim=0)
    majority = torch.where(positive >= negative, 1.0, -1.0).to(trimmed.dtype)
    return torch.where(gamma == 0, majority, gamma)


def disjoint_mean(trimmed: Tensor, gamma: Tensor) -> Tensor:
    """τ_m = mean over t of τ̂_t where τ̂_t ≠ 0 and sgn(τ̂_t) = γ; 0 where no task agrees."""
    agree = (trimmed != 0) & (torch.sign(trimmed) == gamma)
    count = agree.sum(dim=0)
    total = torch.where(agree, trimmed, torch.zeros_like(trimmed)).sum(dim=0)
    return torch.where(count > 0, total / count.clamp(min=1).to(total.dtype), torch.zeros_like(total))


def ties_from_task_vectors(base: StateDict, taus: Sequence[StateDict], opts: TiesOptions) -> StateDict:
    """θ = θ₀ + s·τ_m, τ_m = disjoint mean of the trimmed τ̂_t under the elected sign γ."""
    trimmed = trim(taus, opts.density, opts.scope)
    out: StateDict = {}
    for name, ref in base.items():
        stacked = torch.stack([t[name] for t in trimmed])
        tau_m = disjoint_mean(stacked, elect_sign(stacked))
        out[name] = ref + opts.scale * tau_m
    return out


def task_arithmetic_from_task_vectors(base: StateDict, taus: Sequence[StateDict], scale: float) -> StateDict:
    """θ = θ₀ + s Σ_t τ_t."""
    return {name: ref + scale * torch.stack([t[name] for t in taus]).sum(dim=0) for name, ref in base.items()}


def dare_seed(seed: int, expert_index: int, name: str) -> int:
    """Deterministic 64-bit generator seed for (seed, expert index, tensor name)."""
    digest = hashlib.blake2b(f"{seed}\x00{expert_index}\x00{name}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little")


def dare_rescale(tau: Tensor, drop_rate: float, generator_seed: int) -> Tensor:
    """τ̃ = (m ⊙ τ)/(1 − p) with m ~ Bernoulli(1 − p) from a CPU generator seeded with ``generator_seed``."""
    gen = torch.Generator(device="cpu").manual_seed(generator_seed)
    # drawn on the host whatever the device, so a seed gives one mask everywhere
    keep = torch.rand(tau.shape, generator=gen, dtype=torch.float32, device="cpu") < (1.0 - drop_rate)
    keep = keep.to(tau.device)
    return torch.where(keep, tau / (1.0 - drop_rate), torch.zeros_like(tau))


# --------------------------------------------------------------------------- registered methods


@register("average", AverageOptions, elementwise=True)
def average(base: StateDict, experts: Sequence[StateDict], opts: AverageOptions) -> StateDict:
    """θ = (1/T) Σ_t θ_t."""
    return {name: torch.stack([e[name] for e in experts]).mean(dim=0) for name in base}


@register("task_arithmetic", TaskArithmeticOptions, elementwise=True)
def task_arithmetic(base: StateDict, experts: Sequence[StateDict], opts: TaskArithmeticOptions) -> StateDict:
    """θ = θ₀ + s Σ_t τ_t, τ_t = θ_t − θ₀."""
    return task_arithmetic_from_task_vectors(base, task_vectors(base, experts), opts.scale)


@register("ties", TiesOptions, whole_model=lambda opts: opts.scope == "model")
def ties(base: StateDict, experts: Sequence[StateDict], opts: TiesOptions) -> StateDict:
    """θ = θ₀ + s·τ_m: trim τ_t to its top-k |τ|, elect γ = sgn(Σ_t τ̂_t), disjoint mean τ_m."""
    return ties_from_task_vectors(base, task_vectors(base, experts), opts)


@register("dare", DareOptions,
          whole_model=lambda opts: opts.then == "ties" and opts.ties_options().scope == "model")
def dare(base: StateDict, experts: Sequence[StateDict], opts: DareOptions) -> StateDict:
    """τ̃_t = (m_t ⊙ τ_t)/(1 − p), m_t ~ Bernoulli(1 − p); then Task Arithmetic or TIES on τ̃_t."""
    rescaled = [
        {name: dare_rescale(t, opts.drop_rate, dare_seed(opts.seed, i, name)) for name, t in tau.items()}
        for i, tau in enumerate(task_vectors(base, experts))
    ]
    if opts.then == "ties":
        return ties_from_task_vectors(base, rescaled, opts.ties_options())
    return task_arithmetic_from_task_vectors(base, rescaled, opts.scale)
