"""Streaming moment sums in float64: exact, and summable across batches, processes and machines.

A moment object holds running *sums* (never means), so two objects built from disjoint rows add
to the object built from all rows. Means are taken only when a solve needs them.
"""

from __future__ import annotations

from dataclasses import dataclass, field, fields

import torch
from torch import Tensor


PRODUCT_DTYPES = {"float32": torch.float32, "float64": torch.float64}
PROJECTED_SUFFIX = ":W x"


def projected_key(name: str) -> str:
    """Where a narrowing module's W x rows (its projected cross's factor) travel beside its input: in a
    capture's dict, the expert input cache and its spill, which stores them unnarrowed."""
    return f"{name}{PROJECTED_SUFFIX}"


def host_count(n: float) -> Tensor:
    """A row count as a 0-dim float64 CPU tensor: a host scalar, which combines with sums on any
    device (and is what the data-parallel reductions add up)."""
    return torch.tensor(float(n), dtype=torch.float64, device="cpu")


def _rows(x: Tensor, dtype: torch.dtype = torch.float64) -> Tensor:
    return x.reshape(-1, x.shape[-1]).to(dtype)


def _row_weights(weights: Tensor | None, n: int, device: torch.device | None = None) -> Tensor:
    if weights is None:
        return torch.ones(n, dtype=torch.float64, device=device)
    return weights.reshape(-1).to(device=device, dtype=torch.float64)


def _weigher(weights: Tensor | None, n: int, dtype: torch.dtype, device: torch.device):
    """The count of n rows (Σw: a host scalar) and the row weighing in `dtype`."""
    if weights is None:
        return host_count(n), (lambda x: x)
    w = _row_weights(weights, n, device)
    count, w = w.sum().cpu(), w.to(dtype)[:, None]   # counts stay on the host
    return count, (lambda x: x * w)


def _weighed_rows(student: Tensor, expert: Tensor, weights: Tensor | None):
    """A batch's student and expert rows in float64 (every product but a reduced Gram's), their count (Σw: a
    host scalar) and the row weighing."""
    xs, xe = _rows(student), _rows(expert)
    if xs.shape != xe.shape:
        raise ValueError(f"student rows {tuple(xs.shape)} and expert rows {tuple(xe.shape)} differ")
    return (xs, xe, *_weigher(weights, xs.shape[0], torch.float64, xs.device))


@dataclass
class _Centred:
    """A batch's rows less their (weighted) batch mean, for a Gram in a reduced precision.

    A float32 product of rows x sums terms of the size of |x|, and its rounding is relative to that;
    of rows x − m it is relative to |x − m|, while the mean's share (Σw(x − m) mᵀ and the like) is added
    exactly in float64 (`reduced_gram`). On the demo at the dev-tuned λ this takes float32 products
    from 7.8e-5 to 1.6e-5 of the float64 weights, at the cost of a subtraction per row.
    """

    rows: Tensor       # x − m, in the product dtype (m: the batch mean rounded to that dtype)
    weighed: Tensor    # w (x − m)
    mean: Tensor       # m, float64
    deviation: Tensor  # Σ w (x − m), float64: what the mean's terms need of the rows actually multiplied
    count: float       # Σ w

    @classmethod
    def of(cls, x: Tensor, weigh, count: Tensor) -> "_Centred":
        # .double().sum: the same float64 sum, ~4x faster than .sum(dtype=float64) of float32 rows on CPU
        total = weigh(x).double().sum(0)
        n = count.to(device=x.device)
        mean = torch.where(n > 0, total / n.clamp_min(1e-300), torch.zeros_like(total)).to(x.dtype)
        rows = x - mean
        weighed = weigh(rows)
        return cls(rows, weighed, mean.to(torch.float64), weighed.double().sum(0), float(count))


def reduced_gram(student: Tensor, weights: Tensor | None, dtype: torch.dtype, into: Tensor | None = None) -> Tensor:
    """Σw x xᵀ of a batch's student rows in float64, multiplied in `dtype`: (w(x − m))ᵀ(x − m) of batch-centred
    rows (`_Centred`) plus Σw(x − m) mᵀ + m Σw(x − m)ᵀ + Σw m mᵀ in float64. `into`: a running float64 sum the
    product is added to in place (no d × d buffer beside it); returned.

    The one product a reduced precision forms: the crosses are float64 in every precision. Their rounding is
    not damped where the solve divides by G + λI's small eigenvalues (C ≈ W_e G there, its float32 error is
    not), and it was most of float32's distance to the float64 weights on the demo (1.38e-5 → 7.3e-6, issue 36).
    """
    x = _rows(student, dtype)
    count, weigh = _weigher(weights, x.shape[0], dtype, x.device)
    c = _Centred.of(x, weigh, count)
    out = gram_sum(c.rows, None if weights is None else c.weighed, into)
    if into is None:
        out = out.to(torch.float64)
    return out.addr_(c.deviation, c.mean).addr_(c.mean, c.deviation).addr_(c.mean, c.mean, alpha=c.count)


def gram_of(x: Tensor, block: int = 512, into: Tensor | None = None) -> Tensor:
    """xᵀx for rows x ([n, d]): for wide d, only the k(k+1)/2 column blocks on and above the diagonal
    are multiplied (the product is symmetric): (k+1)/(2k) of the work, 2/3 at d = 3·block.
    `into`: a running sum the product is added to in place, block by block (the same numbers as adding
    the whole product, without a d × d buffer for it: 0.64 GB in float64 at d = 8,960); returned."""
    d = x.shape[1]
    if d < 2 * block:
        return x.T @ x if into is None else into.add_(x.T @ x)
    edges = [(i, min(i + block, d)) for i in range(0, d, block)]
    out = torch.empty(d, d, dtype=x.dtype, device=x.device) if into is None else into
    put = (lambda where, part: where.copy_(part)) if into is None else (lambda where, part: where.add_(part))
    for i, (a, b) in enumerate(edges):
        for c, e in edges[i:]:
            part = x[:, a:b].T @ x[:, c:e]
            put(out[a:b, c:e], part)
            if c != a:
                put(out[c:e, a:b], part.T)
    return out


def gram_sum(rows: Tensor, weighed: Tensor | None, into: Tensor | None = None) -> Tensor:
    """Σw x xᵀ of rows x ([n, d]), given w x (`weighed`; None: unweighted, symmetric, `gram_of`).
    `into`: a running sum the product is added to in place (no d × d buffer beside it); returned."""
    if weighed is None:
        return gram_of(rows, into=into)
    return weighed.T @ rows if into is None else add_product(into, weighed, rows)


PRODUCT_CHUNK = 512   # rows of an out × in sum formed at a time (a 512 × 8,960 float64 slice: 37 MB)


def add_product(into: Tensor, a: Tensor, b: Tensor) -> Tensor:
    """into += aᵀ b (a: [n, out], b: [n, in]), `PRODUCT_CHUNK` of its rows at a time: no out × in
    product beside the running sum."""
    for i in range(0, a.shape[1], PRODUCT_CHUNK):
        into[i:i + PRODUCT_CHUNK].add_(a[:, i:i + PRODUCT_CHUNK].T @ b)
    return into


def weight_times(weight: Tensor, m: Tensor) -> Tensor:
    """weight @ m in float64 (weight: out × in, any float dtype), `PRODUCT_CHUNK` of its rows cast at a
    time: no float64 copy of the weight beside the product."""
    out = torch.empty(weight.shape[0], m.shape[1], dtype=torch.float64, device=m.device)
    for i in range(0, weight.shape[0], PRODUCT_CHUNK):
        rows = weight[i:i + PRODUCT_CHUNK].detach().to(device=m.device, dtype=torch.float64)
        torch.matmul(rows, m, out=out[i:i + PRODUCT_CHUNK])
    return out


@dataclass
class LinearMoments:
    """Σw, Σw x_s x_sᵀ, Σw x_e x_sᵀ, Σw x_s, Σw x_e for one linear module and one task.

    For a module that narrows (out < in, e.g. an FFN's down projection) the cross sum may be kept
    projected through the expert's weight instead: Σw (W_e x_e) x_sᵀ, (out × in) rather than
    (in × in). The solve needs only W_e K, so this is exact, and its products cost out/in as much.
    Likewise the solve's W_e G may come from rows, Σw (W_e x_s) x_sᵀ (`projected_gram`): 2·n·out·in
    products for n rows instead of out·in² once, cheaper where a task has fewer than in/2 rows (a
    1.5B decoder's 8,960-wide down projection on ~2,000 calibration tokens).
    """

    count: Tensor = field(default_factory=lambda: host_count(0))   # a host scalar: mixes with any device
    student_gram: Tensor | None = None
    cross: Tensor | None = None
    student_sum: Tensor | None = None
    expert_sum: Tensor | None = None
    projected_cross: Tensor | None = None
    projected_gram: Tensor | None = None

    def add(
        self,
        student: Tensor,
        expert: Tensor,
        weights: Tensor | None = None,
        expert_projected: Tensor | None = None,
        product_dtype: torch.dtype = torch.float64,
    ) -> None:
        """Add rows x_s, x_e (same shape (..., d)); `weights` optionally weights each row.

        With `expert_projected` (rows W_e x_e), the projected cross sum is kept instead of the cross.
        """
        self.merge(LinearMoments.of_rows(student, expert, weights, expert_projected, product_dtype))

    @staticmethod
    def of_rows(
        student: Tensor,
        expert: Tensor,
        weights: Tensor | None = None,
        expert_projected: Tensor | None = None,
        product_dtype: torch.dtype = torch.float64,
    ) -> "LinearMoments":
        """One batch's sums in float64 (merge them into running sums). `product_dtype` float32: the student
        Gram is multiplied in float32 (`reduced_gram`: ~1e-7 relative a batch; the running sums lose nothing
        more), every other product in float64."""
        xs, xe, count, weigh = _weighed_rows(student, expert, weights)
        xs_w, xe_w = weigh(xs), weigh(xe)
        if expert_projected is None:
            cross, projected = xe_w.T @ xs, None
        else:
            cross, projected = None, weigh(_rows(expert_projected)).T @ xs
        if product_dtype != torch.float64:
            gram = reduced_gram(student, weights, product_dtype)
        else:
            gram = gram_sum(xs, None if weights is None else xs_w)
        return LinearMoments(count, gram, cross, xs_w.sum(0), xe_w.sum(0), projected)

    def add_projected(
        self,
        student: Tensor,
        expert: Tensor,
        expert_projected: Tensor,
        weights: Tensor | None = None,
        product_dtype: torch.dtype = torch.float64,
        expert_weight: Tensor | None = None,
    ) -> None:
        """`add` for a narrowing module (its cross kept projected, rows W_e x_e in `expert_projected`),
        every sum grown in place: no batch-sized copy of the in × in Gram or the out × in sums beside
        the running ones (0.1 GB each for a 1.5B decoder's down projection), nor a float64 copy of
        W_e. `expert_weight` (W_e, out × in): Σw (W_e x_s) x_sᵀ (`projected_gram`) is kept too.
        `product_dtype`: the student Gram's, as in `of_rows`."""
        xs, xe, count, weigh = _weighed_rows(student, expert, weights)
        pe = _rows(expert_projected)
        d, out = xs.shape[1], pe.shape[1]
        shapes = {"student_gram": (d, d), "projected_cross": (out, d), "student_sum": (d,), "expert_sum": (d,)}
        if expert_weight is not None:
            shapes["projected_gram"] = (out, d)
        for name, shape in shapes.items():
            if getattr(self, name) is None:
                setattr(self, name, torch.zeros(shape, dtype=torch.float64, device=xs.device))
        self.count = self.count + count
        if product_dtype != torch.float64:
            reduced_gram(student, weights, product_dtype, into=self.student_gram)
        else:
            gram_sum(xs, None if weights is None else weigh(xs), into=self.student_gram)
        add_product(self.projected_cross, weigh(pe), xs)
        if expert_weight is not None:
            for i in range(0, out, PRODUCT_CHUNK):   # W_e x_s a slice of W_e's rows at a time
                slice_ = expert_weight[i:i + PRODUCT_CHUNK].detach().to(device=xs.device, dtype=torch.float64)
                self.projected_gram[i:i + PRODUCT_CHUNK].add_(weigh(xs @ slice_.T).T @ xs)
        self.student_sum.add_(weigh(xs).sum(0))
        self.expert_sum.add_(weigh(xe).sum(0))

    def merge(self, other: "LinearMoments") -> "LinearMoments":
        _merge_into(self, other)
        return self

    @property
    def gram(self) -> Tensor:
        """G = E[x_s x_sᵀ]."""
        return self.student_gram / self.count

    @property
    def cross_mean(self) -> Tensor:
        """K = E[x_e x_sᵀ] (not kept when the cross was projected)."""
        if self.cross is None:
            raise ValueError("these moments keep the projected cross W_e K only; use target_product")
        return self.cross / self.count

    def target_product(self, expert_weight: Tensor, alpha: float, gram: Tensor | None = None,
                       consume: bool = False) -> Tensor:
        """W_e C = W_e (α K + (1−α) G): what the solve needs of the cross (out × in), with one product
        by W_e (none where both of its terms were kept projected). `gram`: `self.gram` when the caller
        holds it already (it is not formed twice). `consume`: the sums are scaled in their own buffers
        (the same numbers), for a caller that lets them go."""
        mean = (lambda x: x.div_(self.count)) if consume else (lambda x: x / self.count)
        if self.projected_gram is None and gram is None:   # G itself is needed (not where W_e G came from rows)
            gram = self.gram
        if self.projected_cross is None:
            return weight_times(expert_weight, mean(self.cross).mul_(alpha).add_(gram, alpha=1.0 - alpha))
        wk = mean(self.projected_cross).mul_(alpha)
        wg = mean(self.projected_gram) if self.projected_gram is not None else weight_times(expert_weight, gram)
        return wk.add_(wg, alpha=1.0 - alpha)

    @property
    def student_mean(self) -> Tensor:
        return self.student_sum / self.count

    def target_mean(self, alpha: float) -> Tensor:
        """μ_t = α E[x_e] + (1−α) E[x_s]."""
        return (alpha * self.expert_sum + (1.0 - alpha) * self.student_sum) / self.count


@dataclass
class NormMoments:
    """Σw, Σw z, Σw z² per channel of a norm module's normalised student input z."""

    count: Tensor = field(default_factory=lambda: host_count(0))
    first: Tensor | None = None
    second: Tensor | None = None

    def add(self, normalised: Tensor, weights: Tensor | None = None) -> None:
        z = _rows(normalised)
        w = _row_weights(weights, z.shape[0], z.device)[:, None]
        self.merge(NormMoments(w.sum().cpu(), (z * w).sum(0), (z * z * w).sum(0)))

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
            setattr(target, f.name, theirs.to(torch.float64, copy=True))
        else:
            mine.add_(theirs)   # float32 batch products are added into the float64 sums


def moments_to_arrays(m: Moments) -> dict[str, Tensor]:
    """Flatten to named float64 tensors (for zarr stores and all-reduce)."""
    return {f.name: getattr(m, f.name) for f in fields(m) if getattr(m, f.name) is not None}


def moments_from_arrays(kind: str, arrays: dict[str, Tensor]) -> Moments:
    cls = {"linear": LinearMoments, "norm": NormMoments}[kind]
    return cls(**{k: torch.as_tensor(v, dtype=torch.float64) for k, v in arrays.items()})


def moments_layout(moments: dict[str, dict[str, Moments]]) -> dict:
    """Where each (field, module) sits in a task's packed row: {"tasks", "layout": [[field, module,
    kind, offset, shape], ...], "total"}. Every module holds the same fields for every task."""
    tasks = sorted({t for per_task in moments.values() for t in per_task})
    layout, offset = [], 0
    for module, per_task in moments.items():
        kind = "linear" if isinstance(next(iter(per_task.values())), LinearMoments) else "norm"
        for name, value in moments_to_arrays(per_task[tasks[0]]).items():
            layout.append([name, module, kind, offset, list(value.shape)])
            offset += value.numel()
    return {"tasks": tasks, "layout": layout, "total": offset}


def packed_row(moments: dict[str, dict[str, Moments]], meta: dict, task: str, release: bool = False) -> Tensor:
    """One task's sums of every module and field side by side (float64, `meta["total"]` long);
    `release` drops that task's moments from `moments` once copied."""
    row = torch.empty(meta["total"], dtype=torch.float64)
    for name, module, _kind, offset, shape in meta["layout"]:
        value = getattr(moments[module][task], name)
        row[offset:offset + value.numel()] = value.reshape(-1)
    if release:
        for per_task in moments.values():
            per_task.pop(task, None)
    return row


def pack_moments(moments: dict[str, dict[str, Moments]]) -> tuple[Tensor, dict]:
    """A layer's moments as one [tasks, total] float64 array plus the layout to undo it
    (`moments_layout`): a handful of files when stored, however many modules and fields.
    The calibrate stage writes the same rows one at a time (`packed_row`), never the whole array."""
    meta = moments_layout(moments)
    return torch.stack([packed_row(moments, meta, t) for t in meta["tasks"]]), meta


def unpack_moments(packed: Tensor, meta: dict) -> dict[str, dict[str, Moments]]:
    """The inverse of `pack_moments` (`packed`: its array, or the stored one)."""
    fields_of: dict[str, dict[str, dict[str, Tensor]]] = {}
    kinds: dict[str, str] = {}
    for name, module, kind, offset, shape in meta["layout"]:
        size = int(torch.Size(shape).numel())
        kinds[module] = kind
        for i, task in enumerate(meta["tasks"]):
            fields_of.setdefault(module, {}).setdefault(task, {})[name] = packed[i, offset:offset + size].reshape(shape)
    return {m: {t: moments_from_arrays(kinds[m], arrays) for t, arrays in per_task.items()}
            for m, per_task in fields_of.items()}
