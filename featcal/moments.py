"""Streaming moment sums in float64: exact, and summable across batches, processes and machines.

A moment object holds running *sums* (never means), so two objects built from disjoint rows add
to the object built from all rows. Means are taken only when a solve needs them.
"""

from __future__ import annotations

from dataclasses import dataclass, field, fields

import torch
from torch import Tensor


def _rows(x: Tensor) -> Tensor:
    return x.reshape(-1, x.shape[-1]).to(torch.float64)


def _row_weights(weights: Tensor | None, n: int) -> Tensor:
    if weights is None:
        return torch.ones(n, dtype=torch.float64)
    return weights.reshape(-1).to(torch.float64)


@dataclass
class LinearMoments:
    """Σw, Σw x_s x_sᵀ, Σw x_e x_sᵀ, Σw x_s, Σw x_e for one linear module and one task."""

    count: Tensor = field(default_factory=lambda: torch.zeros((), dtype=torch.float64))
    student_gram: Tensor | None = None
    cross: Tensor | None = None
    student_sum: Tensor | None = None
    expert_sum: Tensor | None = None

    def add(self, student: Tensor, expert: Tensor, weights: Tensor | None = None) -> None:
        """Add rows x_s, x_e (same shape (..., d)); `weights` optionally weights each row."""
        xs, xe = _rows(student), _rows(expert)
        if xs.shape != xe.shape:
            raise ValueError(f"student rows {tuple(xs.shape)} and expert rows {tuple(xe.shape)} differ")
        w = _row_weights(weights, xs.shape[0])
        xs_w = xs * w[:, None]
        upd = LinearMoments(w.sum(), xs_w.T @ xs, (xe * w[:, None]).T @ xs, xs_w.sum(0), (xe * w[:, None]).sum(0))
        self.merge(upd)

    def merge(self, other: "LinearMoments") -> "LinearMoments":
        _merge_into(self, other)
        return self

    @property
    def gram(self) -> Tensor:
        """G = E[x_s x_sᵀ]."""
        return self.student_gram / self.count

    @property
    def cross_mean(self) -> Tensor:
        """K = E[x_e x_sᵀ]."""
        return self.cross / self.count

    @property
    def student_mean(self) -> Tensor:
        return self.student_sum / self.count

    def target_mean(self, alpha: float) -> Tensor:
        """μ_t = α E[x_e] + (1−α) E[x_s]."""
        return (alpha * self.expert_sum + (1.0 - alpha) * self.student_sum) / self.count


@dataclass
class NormMoments:
    """Σw, Σw z, Σw z² per channel of a norm module's normalised student input z."""

    count: Tensor = field(default_factory=lambda: torch.zeros((), dtype=torch.float64))
    first: Tensor | None = None
    second: Tensor | None = None

    def add(self, normalised: Tensor, weights: Tensor | None = None) -> None:
        z = _rows(normalised)
        w = _row_weights(weights, z.shape[0])[:, None]
        self.merge(NormMoments(w.sum(), (z * w).sum(0), (z * z * w).sum(0)))

    def merge(self, other: "NormMoments") -> "NormMoments":
        _merge_into(self, other)
        return self

    @property
    def mean(self) -> Tensor:
        return self.first / self.count

    @property
    def mean_square(self) -> Tensor:
        return self.second / self.count


Moments = LinearMoments | NormMoments


def _merge_into(target, other) -> None:
    """Add `other`'s sums to `target`'s in place (the first time, a copy): no second d×d buffer
    per field while a block's moments grow."""
    for f in fields(target):
        mine, theirs = getattr(target, f.name), getattr(other, f.name)
        if theirs is None:
            continue
        if mine is None:
            setattr(target, f.name, theirs.clone())
        else:
            mine.add_(theirs)


def moments_to_arrays(m: Moments) -> dict[str, Tensor]:
    """Flatten to named float64 tensors (for zarr stores and all-reduce)."""
    return {f.name: getattr(m, f.name) for f in fields(m) if getattr(m, f.name) is not None}


def moments_from_arrays(kind: str, arrays: dict[str, Tensor]) -> Moments:
    cls = {"linear": LinearMoments, "norm": NormMoments}[kind]
    return cls(**{k: torch.as_tensor(v, dtype=torch.float64) for k, v in arrays.items()})


def pack_moments(moments: dict[str, dict[str, Moments]]) -> tuple[dict[str, Tensor], dict]:
    """One [tasks, total] float64 array per moment field (all modules' sums flattened side by
    side) plus the layout to undo it: a layer's moments become a handful of arrays, not hundreds."""
    tasks = sorted({t for per_task in moments.values() for t in per_task})
    columns: dict[str, list[Tensor]] = {}
    layout: dict[str, list] = {}
    for module, per_task in moments.items():
        kind = "linear" if isinstance(next(iter(per_task.values())), LinearMoments) else "norm"
        arrays = {t: moments_to_arrays(per_task[t]) for t in tasks}
        for name, value in arrays[tasks[0]].items():
            offset = sum(c.shape[1] for c in columns.get(name, []))
            columns.setdefault(name, []).append(torch.stack([arrays[t][name].reshape(-1) for t in tasks]))
            layout.setdefault(name, []).append([module, kind, offset, list(value.shape)])
    packed = {name: torch.cat(cols, dim=1) for name, cols in columns.items()}
    return packed, {"tasks": tasks, "layout": layout}


def unpack_moments(packed: dict[str, Tensor], meta: dict) -> dict[str, dict[str, Moments]]:
    """The inverse of `pack_moments`."""
    fields_of: dict[str, dict[str, dict[str, Tensor]]] = {}
    kinds: dict[str, str] = {}
    for name, entries in meta["layout"].items():
        for module, kind, offset, shape in entries:
            size = int(torch.Size(shape).numel())
            kinds[module] = kind
            for i, task in enumerate(meta["tasks"]):
                value = packed[name][i, offset:offset + size].reshape(shape)
                fields_of.setdefault(module, {}).setdefault(task, {})[name] = value
    return {m: {t: moments_from_arrays(kinds[m], arrays) for t, arrays in per_task.items()}
            for m, per_task in fields_of.items()}
