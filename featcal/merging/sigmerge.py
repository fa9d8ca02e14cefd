"""SigMerge: signature-guided capacity occupancy (spec "SigMerge", seed 002_e3dd4182d19aad29).

SigMerge repairs a dense *anchor* merge θ_A (Task Arithmetic, TIES, ...) by admitting a bounded
number of task-vector coordinates per block and per domain, without search or training:

1. **Where (conflict → capacity).** Per block i three conflict signals, each min-max normalised
   across blocks (a constant signal → 0): geometry = 1 − mean pairwise linear CKA of the experts'
   pooled block-i outputs; direction = (1 − mean pairwise cos(τ_e, τ_f))/2; demand = mean pairwise
   rate of opposite signs over the coordinates both experts demand. S_i = their mean and
   C_i = c_max − (c_max − c_min)·S_i.
2. **Who (deficit → allocation).** g_d = max(0, best_dev_d − anchor_dev_d), ρ_d = g_d / Σ g,
   quota n_{i,d} = floor(C_i ρ_d N_i), N_i = number of floating entries of block i's tensors.
3. **How (sequential claiming).** Domains in descending deficit (ties by name) each claim, among
   block i's still-unclaimed coordinates with τ_{s(d)} ≠ 0, their quota of largest |τ_{s(d)}|
   (ties by lower index); θ̂ = θ_A + Σ_d M_d ⊙ γ(θ_{s(d)} − θ_A).

Conventions (readings this module adopts where the method's description leaves room; docs/algorithms.md#sigmerge):
- τ_e = θ_e − θ₀ (expert minus *base*), both for the signals and for the claiming ranking; the
  increment that is admitted is the one towards the source expert from the *anchor*.
- A block's coordinates are the concatenation, in the base dict's order, of the flattened floating
  tensors whose ``block_of(name)`` is that block; "lower index" means position in that
  concatenation. Non-floating tensors and tensors with ``block_of(name) is None`` keep θ_A.
- Pairwise means run over all unordered pairs of experts in the pool (all of ``experts``), not only
  domains with a deficit. With fewer than two experts every signal is 0 (no conflict).
- cos(τ_e, τ_f) with a zero vector is taken as 0 (direction contribution 1/2).
- An expert's "demanded" coordinates are its round(fraction·N_i) entries of largest |τ| in the
  block (halves up, ties by lower index, as TIES's trim), minus those where τ = 0: an expert does
  not demand a coordinate it never moved. The opposite-sign rate of a pair is
  #{both demand, sign(τ_e) = −sign(τ_f)} / #{both demand}, 0 when nobody demands in common.
- linear CKA with a constant (zero-variance after centring) representation is taken as 0.
- Quotas: floor(C_i ρ_d N_i) evaluated in float64 after rounding the product to 9 decimals, so
  that e.g. 0.1·0.5·200 = 9.999999999999998 gives 10, not 9.
- γ = 1 writes the source expert's value exactly (not θ_A + (θ_s − θ_A), which can round).
- All computation runs in float32 or wider (``registry.compute_dtype``) and results are cast to the
  anchor's dtype per tensor; coordinates that are not admitted are the anchor's, bit for bit.
"""

from __future__ import annotations

import dataclasses
import itertools
import json
import math
import numbers
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch import Tensor

from featcal.merging import dense as _dense  # noqa: F401  (registers the dense anchors)
from featcal.merging.dense import keep_count
from featcal.merging.registry import (
    MergeContext, StateDict, build_options, compute_dtype, data_options, get_method, merge_state_dicts,
)

SIGNALS = ("geometry", "direction", "demand")

# --------------------------------------------------------------------------- options


def _real(key: str, value: object) -> float:
    if isinstance(value, bool) or not isinstance(value, numbers.Real) or not math.isfinite(value):
        raise ValueError(f"sigmerge: option {key!r} must be a finite number, got {value!r}")
    return float(value)


@dataclass(frozen=True)
class SigMergeOptions:
    """Options of SigMerge.

    anchor: registered merge that gives θ_A (default "task_arithmetic"); a data anchor (RegMean,
        AdaMerging) reads the context SigMerge is given, its data options (``examples_per_task``)
        next to ``anchor``; used by ``anchor_merge`` and recorded — ``sigmerge`` itself receives
        θ_A already computed.
    anchor_options: options of the anchor merge (a plain mapping; None/empty → its defaults).
    c_min, c_max: capacity range, 0 ≤ c_min ≤ c_max ≤ 1 (defaults 0.02 and 0.2, "to tune").
    demand_fraction: fraction of a block's coordinates each expert demands (default 0.2), in (0, 1].
    gamma: scale of the admitted increment θ_{s(d)} − θ_A, in [0, 1] (default 1: copy the expert).
    """

    anchor: str = "task_arithmetic"
    anchor_options: Mapping[str, Any] = field(default_factory=dict)
    c_min: float = 0.02
    c_max: float = 0.2
    demand_fraction: float = 0.2
    gamma: float = 1.0

    def __post_init__(self) -> None:
        get_method(self.anchor)  # ValueError naming the registered methods
        if self.anchor == "sigmerge":
            raise ValueError("sigmerge: the anchor must be another merge method, not sigmerge itself")
        if self.anchor_options is None:
            object.__setattr__(self, "anchor_options", {})
        if not isinstance(self.anchor_options, Mapping):
            raise ValueError(f"sigmerge: option 'anchor_options' must be a mapping, got {self.anchor_options!r}")
        data = sorted(set(self.anchor_options) & set(data_options(self.anchor)))
        if data:   # how much data the anchor reads is said where every data option is: next to `anchor`
            raise ValueError(f"sigmerge: {', '.join(data)} in 'anchor_options' says how much data the anchor "
                             f"{self.anchor!r} reads; give it as sigmerge's own option, next to 'anchor'")
        try:
            build_options(self.anchor, dict(self.anchor_options))
        except (TypeError, ValueError) as err:
            raise ValueError(f"sigmerge: option 'anchor_options': {err}") from None
        c_min, c_max = _real("c_min", self.c_min), _real("c_max", self.c_max)
        if not 0.0 <= c_min <= c_max <= 1.0:
            raise ValueError(f"sigmerge: need 0 <= c_min <= c_max <= 1, got c_min={c_min}, c_max={c_max}")
        if not 0.0 < _real("demand_fraction", self.demand_fraction) <= 1.0:
            raise ValueError(f"sigmerge: option 'demand_fraction' must be in (0, 1], got {self.demand_fraction!r}")
        if not 0.0 <= _real("gamma", self.gamma) <= 1.0:
            raise ValueError(f"sigmerge: option 'gamma' must be in [0, 1], got {self.gamma!r}")

    def as_dict(self) -> dict[str, Any]:
        """JSON-friendly view of the options."""
        out = dataclasses.asdict(self)
        out["anchor_options"] = dict(self.anchor_options)
        return out


def anchor_merge(base: StateDict, experts: Mapping[str, StateDict], options: SigMergeOptions,
                 context: MergeContext | None = None) -> StateDict:
    """θ_A: the registered ``options.anchor`` merge of ``experts`` (in the mapping's order); a data
    anchor reads ``context`` (its record goes to a copy, not to SigMerge's)."""
    if get_method(options.anchor).needs:
        context = dataclasses.replace(context, record={}, cache=None) if context is not None else None
    return merge_state_dicts(options.anchor, base, list(experts.values()), dict(options.anchor_options), context)


# --------------------------------------------------------------------------- 1. where: conflict → capacity


def linear_cka(x: Tensor, y: Tensor) -> float:
    """Linear CKA of representations x [n, d1] and y [n, d2] (rows = the same n examples).

    Both are centred over rows; CKA = ‖yᵀx‖²_F / (‖xᵀx‖_F ‖yᵀy‖_F), computed in float64 (in the
    n×n Gram form when n is smaller than both widths). In [0, 1]; 0 when either is constant.
    """
    if x.dim() != 2 or y.dim() != 2 or x.shape[0] != y.shape[0]:
        raise ValueError(f"linear_cka needs [n, d1] and [n, d2] matrices, got {tuple(x.shape)} and {tuple(y.shape)}")
    x = x.detach().to("cpu", torch.float64)
    y = y.detach().to("cpu", torch.float64)
    x = x - x.mean(dim=0, keepdim=True)
    y = y - y.mean(dim=0, keepdim=True)
    n = x.shape[0]
    if n < min(x.shape[1], y.shape[1]):
        kx, ky = x @ x.T, y @ y.T
        cross = (kx * ky).sum()
        nx, ny = torch.linalg.norm(kx), torch.linalg.norm(ky)
    else:
        cross = torch.linalg.norm(y.T @ x) ** 2
        nx, ny = torch.linalg.norm(x.T @ x), torch.linalg.norm(y.T @ y)
    denom = float(nx * ny)
    if denom == 0.0 or not math.isfinite(denom):
        return 0.0
    return min(1.0, max(0.0, float(cross) / denom))


def _pairs(items: Sequence[Any]) -> list[tuple[Any, Any]]:
    return list(itertools.combinations(items, 2))


def geometry_signal(pooled: Sequence[Tensor]) -> float:
    """1 − mean pairwise linear CKA of the experts' pooled block outputs ([n, d] each); 0 for < 2."""
    pairs = _pairs(list(pooled))
    if not pairs:
        return 0.0
    return 1.0 - sum(linear_cka(a, b) for a, b in pairs) / len(pairs)


def _cosine(a: Tensor, b: Tensor) -> float:
    a, b = a.to(torch.float64), b.to(torch.float64)
    na, nb = torch.linalg.norm(a), torch.linalg.norm(b)
    if float(na) == 0.0 or float(nb) == 0.0:
        return 0.0
    return max(-1.0, min(1.0, float(torch.dot(a, b) / (na * nb))))


def direction_signal(task_vectors: Sequence[Tensor]) -> float:
    """(1 − mean pairwise cos(τ_e, τ_f))/2 over one block's flat task vectors; 0 for < 2."""
    flats = [t.flatten() for t in task_vectors]
    pairs = _pairs(flats)
    if not pairs:
        return 0.0
    return (1.0 - sum(_cosine(a, b) for a, b in pairs) / len(pairs)) / 2.0


def demand_mask(tau: Tensor, demand_fraction: float = 0.2) -> Tensor:
    """Coordinates an expert demands: its round(f·N) largest |τ| (ties by lower index), τ ≠ 0 only."""
    flat = tau.flatten()
    k = keep_count(demand_fraction, flat.numel())
    mask = torch.zeros(flat.numel(), dtype=torch.bool, device=flat.device)
    if k > 0:
        order = torch.sort(flat.abs(), descending=True, stable=True).indices
        mask[order[:k]] = True
    return mask & (flat != 0)


def demand_signal(task_vectors: Sequence[Tensor], demand_fraction: float = 0.2) -> float:
    """Mean pairwise rate of opposite signs over the coordinates both experts demand; 0 for < 2."""
    flats = [t.flatten() for t in task_vectors]
    pairs = _pairs(list(range(len(flats))))
    if not pairs:
        return 0.0
    demands = [demand_mask(t, demand_fraction) for t in flats]
    signs = [torch.sign(t) for t in flats]
    total = 0.0
    for e, f in pairs:
        both = demands[e] & demands[f]
        n_both = int(both.sum())
        if n_both:
            total += int((both & (signs[e] * signs[f] < 0)).sum()) / n_both
    return total / len(pairs)


def normalise_across_blocks(values: Sequence[float]) -> list[float]:
    """Min-max to [0, 1] across blocks; a constant signal (or a single block) maps to all 0."""
    vals = [float(v) for v in values]
    if not vals:
        return []
    lo, hi = min(vals), max(vals)
    if hi == lo:
        return [0.0] * len(vals)
    return [min(1.0, max(0.0, (v - lo) / (hi - lo))) for v in vals]


def conflict_scores(
    geometry: Sequence[float], direction: Sequence[float], demand: Sequence[float]
) -> list[float]:
    """S_i = mean of the three signals, each normalised across blocks (lists indexed by block)."""
    if not len(geometry) == len(direction) == len(demand):
        raise ValueError("conflict_scores: the three signals must cover the same blocks")
    normed = [normalise_across_blocks(s) for s in (geometry, direction, demand)]
    return [sum(col) / 3.0 for col in zip(*normed)]


def capacities(scores: Sequence[float], c_min: float = 0.02, c_max: float = 0.2) -> list[float]:
    """C_i = c_max − (c_max − c_min)·S_i: high conflict → less capacity."""
    return [c_max - (c_max - c_min) * float(s) for s in scores]


# --------------------------------------------------------------------------- 2. who: deficit → allocation


def deficits(best_expert_dev: Mapping[str, float], anchor_dev: Mapping[str, float]) -> dict[str, float]:
    """g_d = max(0, best expert's dev score on d − anchor's dev score on d), per domain."""
    if set(best_expert_dev) != set(anchor_dev):
        raise ValueError(
            f"deficits: best_expert_dev domains {sorted(best_expert_dev)} differ from anchor_dev {sorted(anchor_dev)}"
        )
    out: dict[str, float] = {}
    for d in best_expert_dev:
        best, anchor = float(best_expert_dev[d]), float(anchor_dev[d])
        if not (math.isfinite(best) and math.isfinite(anchor)):
            raise ValueError(f"deficits: non-finite dev score for domain {d!r} (best {best}, anchor {anchor})")
        out[d] = max(0.0, best - anchor)
    return out


def shares(deficit: Mapping[str, float]) -> dict[str, float]:
    """ρ_d = g_d / Σ g; all zero when Σ g = 0."""
    total = sum(float(g) for g in deficit.values())
    if total <= 0.0:
        return {d: 0.0 for d in deficit}
    return {d: float(g) / total for d, g in deficit.items()}


def quota(capacity: float, share: float, n_coords: int) -> int:
    """n_{i,d} = floor(C_i ρ_d N_i) (product rounded to 9 decimals first; never negative)."""
    return max(0, math.floor(round(float(capacity) * float(share) * int(n_coords), 9)))


def quotas(capacity: float, share: Mapping[str, float], n_coords: int) -> dict[str, int]:
    """Block quotas n_{i,d} for every domain of ``share``."""
    return {d: quota(capacity, rho, n_coords) for d, rho in share.items()}


def claiming_order(deficit: Mapping[str, float]) -> list[str]:
    """Domains by descending deficit, ties by name."""
    return sorted(deficit, key=lambda d: (-float(deficit[d]), d))


# --------------------------------------------------------------------------- 3. how: sequential claiming


def claim(
    task_vectors_per_domain: Mapping[str, Tensor], quotas: Mapping[str, int], order: Sequence[str]
) -> dict[str, Tensor]:
    """Disjoint claim masks over one block's flat coordinates.

    Domains in ``order`` each take, among the still-unclaimed coordinates where their own
    τ_{s(d)} ≠ 0, the min(quota, available) of largest |τ_{s(d)}| (ties by lower index). Domains
    of ``task_vectors_per_domain`` absent from ``order`` (or with no quota) claim nothing.
    Returns one boolean mask (shape of the flattened τ) per domain of ``task_vectors_per_domain``.
    """
    flats = {d: t.flatten() for d, t in task_vectors_per_domain.items()}
    if not flats:
        return {}
    sizes = {t.numel() for t in flats.values()}
    if len(sizes) != 1:
        raise ValueError(f"claim: task vectors of one block must have the same size, got {sorted(sizes)}")
    if len(set(order)) != len(order):
        raise ValueError(f"claim: order has repeated domains: {list(order)}")
    n = sizes.pop()
    device = next(iter(flats.values())).device
    claimed = torch.zeros(n, dtype=torch.bool, device=device)
    masks = {d: torch.zeros(n, dtype=torch.bool, device=device) for d in flats}
    for d in order:
        if d not in flats:
            raise ValueError(f"claim: domain {d!r} in order has no task vector")
        q = int(quotas.get(d, 0))
        if q <= 0:
            continue
        tau = flats[d]
        available = (~claimed) & (tau != 0)
        take = min(q, int(available.sum()))
        if take == 0:
            continue
        # Unavailable coordinates score −1 (below every |τ| ≥ 0); a stable descending sort keeps
        # equal magnitudes in index order, so ties go to the lower index.
        score = torch.where(available, tau.abs().to(torch.float64), torch.full_like(tau, -1.0, dtype=torch.float64))
        idx = torch.sort(score, descending=True, stable=True).indices[:take]
        masks[d][idx] = True
        claimed[idx] = True
    return masks


def apply_claims(
    anchor_block: Tensor,
    expert_blocks_by_domain: Mapping[str, Tensor],
    masks: Mapping[str, Tensor],
    gamma: float = 1.0,
) -> Tensor:
    """θ̂ = θ_A + Σ_d M_d ⊙ γ(θ_{s(d)} − θ_A) on one block's flat (or same-shape) tensors.

    ``expert_blocks_by_domain[d]`` is the source expert s(d)'s block. Masks must be disjoint.
    With γ = 1 admitted coordinates are the source's values exactly; elsewhere θ_A is untouched.
    Computed in float32 or wider, returned in the anchor's dtype.
    """
    dt = compute_dtype(anchor_block.dtype, *(t.dtype for t in expert_blocks_by_domain.values()))
    anchor = anchor_block.to(dt)
    out = anchor.clone()
    seen = torch.zeros(anchor.shape, dtype=torch.bool, device=anchor.device)
    for d, mask in masks.items():
        mask = mask.view(anchor.shape)
        if not bool(mask.any()):
            continue
        if bool((seen & mask).any()):
            raise ValueError(f"apply_claims: mask of domain {d!r} overlaps an earlier domain's")
        seen |= mask
        src = expert_blocks_by_domain[d].to(device=anchor.device, dtype=dt).view(anchor.shape)
        value = src if gamma == 1.0 else anchor + gamma * (src - anchor)
        out = torch.where(mask, value, out)
    return out.to(anchor_block.dtype)


# --------------------------------------------------------------------------- 4. the whole method


def _flat_block(state: Mapping[str, Tensor], names: Sequence[str], dtype: torch.dtype) -> Tensor:
    return torch.cat([state[n].detach().to(dtype).flatten() for n in names]) if names else torch.zeros(0, dtype=dtype)


def _check_same_layout(base: Mapping[str, Tensor], other: Mapping[str, Tensor], what: str) -> None:
    for name, ref in base.items():
        if name not in other:
            raise ValueError(f"sigmerge: {what} has no tensor {name!r}")
        if other[name].shape != ref.shape:
            raise ValueError(
                f"sigmerge: tensor {name!r} of {what} has shape {tuple(other[name].shape)}, expected {tuple(ref.shape)}"
            )
    extra = sorted(set(other) - set(base))
    if extra:
        raise ValueError(f"sigmerge: {what} has tensors the base does not have: {extra[:5]}")


@dataclass(frozen=True)
class BlockSignals:
    """Pass 1 of SigMerge: per block its tensors (floating, in base order), coordinate count and raw
    conflict signals, for the expert pool and demand fraction they were computed with."""

    pool: list[str]
    demand_fraction: float
    block_names: dict[int, list[str]]
    raw: dict[str, list[float]]
    n_coords: list[int]


def block_signals(
    base: Mapping[str, Tensor],
    experts: Mapping[str, Mapping[str, Tensor]],
    block_of: Callable[[str], int | None],
    block_outputs: Mapping[int, Mapping[str, Tensor]],
    demand_fraction: float = 0.2,
) -> BlockSignals:
    """The conflict signals of every block (one block's task vectors in memory at a time)."""
    block_names: dict[int, list[str]] = {}
    for name, ref in base.items():
        if not ref.is_floating_point():
            continue
        b = block_of(name)
        if b is not None:
            block_names.setdefault(int(b), []).append(name)
    pool = list(experts)
    raw: dict[str, list[float]] = {s: [] for s in SIGNALS}
    n_coords: list[int] = []
    for b in sorted(block_names):
        names = block_names[b]
        dt = compute_dtype(*(base[n].dtype for n in names), *(experts[e][n].dtype for e in pool for n in names))
        theta0 = _flat_block(base, names, dt)
        taus = [_flat_block(experts[e], names, dt) - theta0 for e in pool]
        n_coords.append(int(theta0.numel()))
        if b not in block_outputs:
            raise ValueError(f"sigmerge: block_outputs has no entry for block {b}")
        missing = [e for e in pool if e not in block_outputs[b]]
        if missing:
            raise ValueError(f"sigmerge: block_outputs[{b}] lacks experts {missing}")
        raw["geometry"].append(geometry_signal([block_outputs[b][e] for e in pool]))
        raw["direction"].append(direction_signal(taus))
        raw["demand"].append(demand_signal(taus, demand_fraction))
        del taus, theta0
    return BlockSignals(pool, float(demand_fraction), block_names, raw, n_coords)


def sigmerge(
    base: Mapping[str, Tensor],
    experts: Mapping[str, Mapping[str, Tensor]],
    anchor: Mapping[str, Tensor],
    block_of: Callable[[str], int | None],
    block_outputs: Mapping[int, Mapping[str, Tensor]],
    best_dev: Mapping[str, float],
    anchor_dev: Mapping[str, float],
    options: SigMergeOptions | Mapping[str, Any] | None = None,
    sources: Mapping[str, str] | None = None,
    signals: "BlockSignals | None" = None,
) -> tuple[StateDict, dict[str, Any]]:
    """SigMerge θ̂ of ``anchor`` = θ_A and the record of every decision.

    base: θ₀; experts: domain → θ_e (the pool; every expert enters the conflict signals);
    anchor: θ_A (see ``anchor_merge``); block_of: tensor name → block index, or None for tensors
    that keep θ_A (embeddings, final norms, pooler, heads); block_outputs: block → domain → pooled
    block outputs [n, d] of that expert on one shared calibration set (every block, every expert);
    best_dev / anchor_dev: domain → dev score of the best expert for d and of θ_A;
    sources: domain → the expert key s(d) whose task vector d claims with (default: d itself);
    signals: ``block_signals(base, experts, block_of, block_outputs, demand_fraction)`` computed
    beforehand (they do not depend on the anchor, the deficits or the capacity range; a search over
    c_min, c_max computes them once).

    Returns (merged state dict in the anchor's dtypes and order, record). With zero deficit
    everywhere the anchor is returned unchanged (clones, equal bit for bit).
    """
    if options is None:
        opts = SigMergeOptions()
    elif isinstance(options, SigMergeOptions):
        opts = options
    else:
        valid = [f.name for f in dataclasses.fields(SigMergeOptions)]
        unknown = [k for k in options if k not in valid]
        if unknown:
            raise ValueError(f"sigmerge: unknown option(s) {unknown}; valid options: {', '.join(valid)}")
        opts = SigMergeOptions(**dict(options))
    if not experts:
        raise ValueError("sigmerge needs at least one expert")
    for e, sd in experts.items():
        _check_same_layout(base, sd, f"expert {e!r}")
    _check_same_layout(base, anchor, "the anchor")

    g = deficits(best_dev, anchor_dev)
    rho = shares(g)
    order = claiming_order(g)
    src = {d: (sources or {}).get(d, d) for d in g}
    for d, s in src.items():
        if s not in experts:
            raise ValueError(f"sigmerge: source expert {s!r} of domain {d!r} is not in the pool {sorted(experts)}")

    if signals is None:
        signals = block_signals(base, experts, block_of, block_outputs, opts.demand_fraction)
    elif signals.pool != list(experts) or signals.demand_fraction != opts.demand_fraction:
        raise ValueError(f"sigmerge: the signals given were computed for experts {signals.pool} and demand "
                         f"fraction {signals.demand_fraction}, not {list(experts)} and {opts.demand_fraction}")
    block_names, raw, n_coords, pool = signals.block_names, signals.raw, signals.n_coords, signals.pool
    blocks = sorted(block_names)
    normed = {s: normalise_across_blocks(raw[s]) for s in SIGNALS}
    scores = conflict_scores(raw["geometry"], raw["direction"], raw["demand"])
    caps = capacities(scores, opts.c_min, opts.c_max)

    merged: StateDict = {name: t.clone() for name, t in anchor.items() if name in base}
    merged = {name: merged[name] for name in base}  # base order
    block_records: list[dict[str, Any]] = []
    any_deficit = any(r > 0.0 for r in rho.values())
    for j, b in enumerate(blocks):
        names = block_names[b]
        q = quotas(caps[j], rho, n_coords[j])
        admitted = {d: 0 for d in g}
        if any_deficit and any(v > 0 for v in q.values()):
            dt = compute_dtype(
                *(base[n].dtype for n in names),
                *(anchor[n].dtype for n in names),
                *(experts[s][n].dtype for s in set(src.values()) for n in names),
            )
            theta0 = _flat_block(base, names, dt)
            source_blocks = {s: _flat_block(experts[s], names, dt) for s in set(src.values())}
            taus = {d: source_blocks[src[d]] - theta0 for d in g}
            masks = claim(taus, q, order)
            admitted = {d: int(masks[d].sum()) for d in g}
            anchor_flat = _flat_block(anchor, names, dt)
            new_flat = apply_claims(anchor_flat, {d: source_blocks[src[d]] for d in g}, masks, opts.gamma)
            offset = 0
            for name in names:
                ref = anchor[name]
                k = ref.numel()
                merged[name] = new_flat[offset : offset + k].view(ref.shape).to(ref.dtype)
                offset += k
            del theta0, source_blocks, taus, masks, anchor_flat, new_flat
        block_records.append(
            {
                "block": b,
                "n_coords": n_coords[j],
                "tensors": list(names),
                "signals": {s: raw[s][j] for s in SIGNALS},
                "normalised": {s: normed[s][j] for s in SIGNALS},
                "S": scores[j],
                "C": caps[j],
                "quotas": q,
                "admitted": admitted,
            }
        )

    record: dict[str, Any] = {
        "method": "sigmerge",
        "options": opts.as_dict(),
        "pool": pool,
        "blocks": block_records,
        "domains": {d: {"deficit": g[d], "share": rho[d], "source": src[d]} for d in g},
        "order": order,
        "admitted": {str(br["block"]): dict(br["admitted"]) for br in block_records},
        "total_admitted": sum(sum(br["admitted"].values()) for br in block_records),
        "total_coords": sum(n_coords),
    }
    return merged, record


def save_record(record: Mapping[str, Any], path: str | Path) -> None:
    """Write the record as indented JSON."""
    Path(path).write_text(json.dumps(record, indent=2, sort_keys=False) + "\n")


def plot_admitted(record: Mapping[str, Any], path: str | Path) -> None:
    """Heat map of admitted coordinates (fraction of the block) per block × domain, counts annotated."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    blocks = record["blocks"]
    domains = list(record["order"])
    frac = [[br["admitted"].get(d, 0) / max(1, br["n_coords"]) for d in domains] for br in blocks]
    fig, ax = plt.subplots(figsize=(1.2 + 1.1 * max(1, len(domains)), 1.0 + 0.35 * max(1, len(blocks))))
    try:
        im = ax.imshow(frac if blocks and domains else [[0.0]], aspect="auto", cmap="viridis", vmin=0.0)
        ax.set_xticks(range(len(domains)), domains, rotation=30, ha="right")
        ax.set_yticks(range(len(blocks)), [f"{br['block']} (C={br['C']:.3f})" for br in blocks])
        ax.set_xlabel("domain (claiming order)")
        ax.set_ylabel("block")
        ax.set_title("SigMerge admitted coordinates (fraction of block)")
        for r, br in enumerate(blocks):
            for c, d in enumerate(domains):
                ax.text(c, r, str(br["admitted"].get(d, 0)), ha="center", va="center", fontsize=7, color="w")
        fig.colorbar(im, ax=ax)
        fig.tight_layout()
        Path(path).parent.mkdir(parents=True, exist_ok=True)
        fig.savefig(path, dpi=120)
    finally:
        plt.close(fig)
