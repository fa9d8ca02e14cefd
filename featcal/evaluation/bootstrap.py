"""Paired bootstrap uncertainty for the accuracies the project reports (docs/uncertainty.md).

Every score is a mean of per-example correctness on small splits (187-500 test examples a task), so
a table of point estimates cannot say which differences are real. Here the test examples are
resampled *within each task*, and *the same resamples score every model*: the noise of which
examples happened to be drawn is shared by the rows and cancels in their differences (pairing).
The headline number is the unweighted mean of the task accuracies, and so is every resampled one.

Input, for one model: task -> 1-D array of per-example correctness (bool or 0/1), the examples of a
task in one fixed order, the same for every model. numpy only: no model is needed.

    indices = resample_indices(task_sizes(models), n_resamples=4000, seed=0)
    accuracy_intervals(models["featcal"], indices).mean         # Interval(estimate, low, high)
    difference_interval(models["featcal"], models["ties"], indices).mean.significant
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from statistics import NormalDist
from typing import Mapping, Sequence, Union

import numpy as np

ArrayLike = Union[np.ndarray, Sequence[bool], Sequence[int]]
Correctness = Mapping[str, ArrayLike]   # task -> per-example correctness of one model
Indices = Mapping[str, np.ndarray]      # task -> [n_resamples, n_task] example indices


@dataclass(frozen=True)
class Interval:
    """A point estimate on all examples and its percentile interval over the resamples."""
    estimate: float
    low: float
    high: float


@dataclass(frozen=True)
class Difference(Interval):
    """A difference a − b; significant when 0 lies outside [low, high]."""
    significant: bool


@dataclass(frozen=True)
class AccuracyIntervals:
    """One model: an interval per task and for the unweighted mean over tasks."""
    tasks: dict[str, Interval]
    mean: Interval
    level: float
    n_resamples: int


@dataclass(frozen=True)
class DifferenceIntervals:
    """Two models, a − b: a difference per task and of the unweighted means."""
    tasks: dict[str, Difference]
    mean: Difference
    level: float
    n_resamples: int


@dataclass(frozen=True)
class Detectable:
    """Smallest detectable accuracy differences (see `minimum_detectable_difference`)."""
    paired: float       # two models scored on the same examples, discordant-pair rate d
    unpaired: float     # for comparison: two independent samples of the same sizes
    resolution: float   # the smallest step the accuracy can take at all (one example)


@dataclass(frozen=True)
class DetectableDifferences:
    """Per task and for the unweighted mean over tasks."""
    tasks: dict[str, Detectable]
    mean: Detectable
    alpha: float
    power: float


@dataclass(frozen=True)
class Selection:
    """The row the selection rule picks, the rows tied with the dev-best one, and why."""
    chosen: str
    best: str                 # the row with the highest dev mean accuracy
    tied: tuple[str, ...]     # `best` and the rows not significantly worse on dev, best dev first
    reason: str


# --- checking the input -----------------------------------------------------------------------------


def _as_correct(values: ArrayLike, task: str, model: str) -> np.ndarray:
    """A 1-D bool array; anything but 0/1 values is refused (a label or a probability passed by
    mistake would otherwise give a plausible-looking accuracy)."""
    array = np.asarray(values)
    if array.ndim != 1:
        raise ValueError(f"task {task!r}, model {model!r}: per-example correctness must be 1-D, "
                         f"got shape {array.shape}")
    if array.size == 0:
        raise ValueError(f"task {task!r}, model {model!r}: no examples")
    if array.dtype != bool and not np.isin(array, (0, 1)).all():
        raise ValueError(f"task {task!r}, model {model!r}: per-example correctness must be bool or 0/1")
    return array.astype(bool, copy=False)


def task_sizes(models: Mapping[str, Correctness]) -> dict[str, int]:
    """The number of examples per task, after checking that every model has the same tasks and the
    same number of examples in each (the pairing is by position, so a mismatch is an error that
    names the task and the model)."""
    if not models:
        raise ValueError("no models given")
    first = next(iter(models))
    sizes = {task: _as_correct(values, task, first).size for task, values in models[first].items()}
    if not sizes:
        raise ValueError(f"model {first!r} has no tasks")
    for model, correct in models.items():
        for task in sorted(set(sizes) ^ set(correct)):
            has, lacks = (model, first) if task in correct else (first, model)
            raise ValueError(f"task {task!r}: model {has!r} has it but model {lacks!r} does not")
        for task, values in correct.items():
            n = _as_correct(values, task, model).size
            if n != sizes[task]:
                raise ValueError(f"task {task!r}: model {model!r} has {n} examples but model {first!r} has "
                                 f"{sizes[task]}; every model must be scored on the same examples in the same order")
    return sizes


def _checked(correct: Correctness, indices: Indices, model: str) -> dict[str, np.ndarray]:
    """`correct` as bool arrays, after checking it against the tasks and sizes the resamples were drawn for."""
    for task in sorted(set(indices) ^ set(correct)):
        where = "the resamples have it but the model does not" if task in indices else "the resamples do not cover it"
        raise ValueError(f"task {task!r}, model {model!r}: {where}")
    out = {}
    for task in indices:
        values = _as_correct(correct[task], task, model)
        n = indices[task].shape[1]
        if values.size != n:
            raise ValueError(f"task {task!r}: model {model!r} has {values.size} examples but the resamples "
                             f"were drawn for {n}")
        out[task] = values
    return out


def _check_level(level: float) -> None:
    if not 0 < level < 1:
        raise ValueError(f"level must lie in (0, 1), got {level}")


# --- resampling -----------------------------------------------------------------------------------------


def resample_indices(sizes: Mapping[str, int], n_resamples: int, seed: int) -> dict[str, np.ndarray]:
    """`n_resamples` bootstrap resamples of each task's examples: [n_resamples, n_task] indices,
    drawn with replacement within the task. Drawn task by task in sorted task order from one
    `np.random.default_rng(seed)`, so one seed gives the same resamples whatever order the tasks
    come in, and every model scored with them is scored on the same resamples (the pairing)."""
    if n_resamples < 1:
        raise ValueError(f"n_resamples must be at least 1, got {n_resamples}")
    rng = np.random.default_rng(seed)
    out = {}
    for task in sorted(sizes):
        n = int(sizes[task])
        if n < 1:
            raise ValueError(f"task {task!r}: no examples to resample")
        out[task] = rng.integers(0, n, size=(n_resamples, n), dtype=np.int32)   # int32: half the memory
    return out


@dataclass(frozen=True)
class _Scores:
    """One model's accuracy per task on all examples and on every resample."""
    point: dict[str, float]
    resampled: dict[str, np.ndarray]   # task -> [n_resamples]
    correct: dict[str, np.ndarray]     # task -> [n] per-example correctness

    @property
    def mean_point(self) -> float:
        return float(np.mean(list(self.point.values())))

    @property
    def mean_resampled(self) -> np.ndarray:
        return np.mean(np.stack(list(self.resampled.values())), axis=0)


def _scores(correct: Correctness, indices: Indices, model: str) -> _Scores:
    checked = _checked(correct, indices, model)
    return _Scores(
        point={task: float(values.mean()) for task, values in checked.items()},
        resampled={task: np.count_nonzero(values[indices[task]], axis=1) / values.size
                   for task, values in checked.items()},
        correct=checked)


def _percentiles(samples: np.ndarray, level: float) -> tuple[float, float]:
    """The percentile interval: the (1 − level)/2 and (1 + level)/2 quantiles of the resampled statistic."""
    low, high = np.quantile(samples, [(1 - level) / 2, (1 + level) / 2])
    return float(low), float(high)


def _interval(estimate: float, samples: np.ndarray, level: float) -> Interval:
    return Interval(estimate, *_percentiles(samples, level))


EXACT_BELOW = 25   # discordant examples: under this many, the percentile interval alone is too liberal


def sign_test_p(wins: int, losses: int) -> float:
    """Exact two-sided McNemar (sign) test: the probability, under no difference, of a split of the
    `wins + losses` discordant examples at least as uneven as this one."""
    n, k = wins + losses, min(wins, losses)
    if n == 0:
        return 1.0
    return min(1.0, 2 * sum(math.comb(n, i) for i in range(k + 1)) / 2 ** n)


def _difference(estimate: float, samples: np.ndarray, level: float, wins: int, losses: int) -> Difference:
    """Significant when 0 lies outside the percentile interval and, with fewer than `EXACT_BELOW`
    discordant examples (a wins, b wins), the exact sign test agrees at the same level."""
    low, high = _percentiles(samples, level)
    significant = bool(low > 0 or high < 0)
    if significant and wins + losses < EXACT_BELOW:
        significant = sign_test_p(wins, losses) < 1 - level
    return Difference(estimate, low, high, significant=significant)


def _n_resamples(indices: Indices) -> int:
    return next(iter(indices.values())).shape[0]


# --- intervals ------------------------------------------------------------------------------------------


def accuracy_intervals(correct: Correctness, indices: Indices, level: float = 0.95, *,
                       model: str = "model") -> AccuracyIntervals:
    """Percentile intervals of one model's accuracy per task and of the unweighted mean over tasks
    (the tables' average: each task counts once, whatever its size). `model` only names the model in errors."""
    _check_level(level)
    scores = _scores(correct, indices, model)
    return AccuracyIntervals(
        tasks={task: _interval(scores.point[task], scores.resampled[task], level) for task in scores.point},
        mean=_interval(scores.mean_point, scores.mean_resampled, level),
        level=level, n_resamples=_n_resamples(indices))


def _differences(a: _Scores, b: _Scores, level: float, n_resamples: int) -> DifferenceIntervals:
    """a − b per task and of the means; the mean's exact check pools the tasks' discordant examples."""
    split = {task: (int(np.count_nonzero(a.correct[task] & ~b.correct[task])),
                    int(np.count_nonzero(~a.correct[task] & b.correct[task]))) for task in a.point}
    return DifferenceIntervals(
        tasks={task: _difference(a.point[task] - b.point[task], a.resampled[task] - b.resampled[task], level,
                                 *split[task]) for task in a.point},
        mean=_difference(a.mean_point - b.mean_point, a.mean_resampled - b.mean_resampled, level,
                         sum(w for w, _ in split.values()), sum(l for _, l in split.values())),
        level=level, n_resamples=n_resamples)


def difference_interval(correct_a: Correctness, correct_b: Correctness, indices: Indices, level: float = 0.95, *,
                        names: tuple[str, str] = ("a", "b")) -> DifferenceIntervals:
    """The paired difference a − b per task and of the unweighted means, with percentile intervals:
    both models are scored on the same resamples, so the interval reflects only the examples on
    which they differ, not the luck of the draw they share. Significant: 0 outside the interval and,
    with fewer than `EXACT_BELOW` disagreeing examples (where the percentile interval alone is too
    liberal: 4 of 400, all one way, exclude 0), the exact sign test below the level too (there p = 0.125)."""
    _check_level(level)
    task_sizes(dict(zip(names, (correct_a, correct_b))))
    return _differences(_scores(correct_a, indices, names[0]), _scores(correct_b, indices, names[1]),
                        level, _n_resamples(indices))


def significant_vs_best(models: Mapping[str, Correctness], best: str, indices: Indices,
                        level: float = 0.95) -> dict[str, bool]:
    """For every row other than `best`: whether its mean accuracy differs significantly from
    `best`'s (paired, `level` percentile interval of the difference excludes 0). No correction for
    the number of rows: with many rows, some "significant" marks are expected by chance."""
    _check_level(level)
    if best not in models:
        raise ValueError(f"best row {best!r} is not among the models: {sorted(models)}")
    task_sizes(models)
    scores = {name: _scores(correct, indices, name) for name, correct in models.items()}
    n = _n_resamples(indices)
    return {name: _differences(scores[name], scores[best], level, n).mean.significant
            for name in models if name != best}


# --- the selection rule -----------------------------------------------------------------------------


def selection(dev: Mapping[str, Correctness], added_parameters: Mapping[str, int],
              search_seconds: Mapping[str, float], indices: Indices, level: float = 0.95) -> Selection:
    """The honest selection rule, on dev data only: the row with the best dev mean accuracy and
    every row whose paired dev difference to it is not significant are tied (dev cannot tell them
    apart); of the tied rows, the one that adds the fewest parameters wins, then the one with the
    lowest search cost (then the higher dev accuracy, then the name, so the choice is unique).
    `indices` are resamples of the dev splits."""
    _check_level(level)
    task_sizes(dev)
    for name in dev:
        for what, table in (("added_parameters", added_parameters), ("search_seconds", search_seconds)):
            if name not in table:
                raise ValueError(f"row {name!r}: no {what}")
            if not (math.isfinite(table[name]) and table[name] >= 0):
                raise ValueError(f"row {name!r}: {what} must be a finite number >= 0, got {table[name]}")
    scores = {name: _scores(correct, indices, name) for name, correct in dev.items()}
    accuracy = {name: s.mean_point for name, s in scores.items()}

    def cost(name: str) -> tuple:
        return added_parameters[name], search_seconds[name], -accuracy[name], name

    top = max(accuracy.values())
    best = min((name for name in dev if accuracy[name] == top), key=cost)
    n = _n_resamples(indices)
    diff = {name: _differences(scores[best], scores[name], level, n).mean for name in dev}
    tied = tuple(sorted((name for name in dev if name == best or not diff[name].significant),
                        key=lambda name: (-accuracy[name], name)))
    chosen = min(tied, key=cost)
    pct = f"{level:.0%}"
    if len(tied) == 1:
        reason = (f"{best!r} has the best dev accuracy ({accuracy[best]:.4f}) and every other row is "
                  f"significantly worse ({pct} paired interval)")
    elif chosen == best:
        reason = (f"{best!r} has the best dev accuracy ({accuracy[best]:.4f}); tied with "
                  f"{', '.join(repr(t) for t in tied if t != best)} (difference not significant, {pct}), "
                  f"none of which adds fewer parameters or, at as many, searched for less time")
    else:
        d = diff[chosen]
        head = (f"{chosen!r} is tied with the dev-best {best!r} (dev difference {d.estimate:+.4f}, {pct} "
                f"interval [{d.low:+.4f}, {d.high:+.4f}])")
        fewest = min(added_parameters[t] for t in tied)
        if added_parameters[chosen] < added_parameters[best] and \
                sum(added_parameters[t] == fewest for t in tied) == 1:
            reason = (f"{head} and adds the fewest parameters of the {len(tied)} tied rows "
                      f"({added_parameters[chosen]} vs {added_parameters[best]})")
        else:
            reason = (f"{head}; of the tied rows adding the fewest parameters ({fewest}) it searched the "
                      f"shortest ({search_seconds[chosen]:.1f} s)")
    return Selection(chosen=chosen, best=best, tied=tied, reason=reason)


# --- what the split sizes can resolve -----------------------------------------------------------------


def _per_task(value: Mapping[str, float] | float, sizes: Mapping[str, int], what: str) -> dict[str, float]:
    if isinstance(value, Mapping):
        missing = sorted(set(sizes) - set(value))
        if missing:
            raise ValueError(f"{what}: no value for task(s) {missing}")
        return {task: float(value[task]) for task in sizes}
    return {task: float(value) for task in sizes}


def minimum_detectable_difference(sizes: Mapping[str, int], base_accuracy: Mapping[str, float] | float,
                                  alpha: float = 0.05, power: float = 0.8,
                                  discordant: Mapping[str, float] | float = 0.1) -> DetectableDifferences:
    """The smallest accuracy difference a paired comparison on splits of these sizes detects with
    probability `power` at two-sided level `alpha` (normal approximation, McNemar-style):

        per task t:      SE_t = sqrt(d_t / n_t),              MDD_t = (z_{1-α/2} + z_power) · SE_t
        mean of T tasks: SE   = sqrt(Σ_t d_t / n_t) / T,      MDD   = (z_{1-α/2} + z_power) · SE

    d_t, `discordant`: the fraction of task t's examples on which the two models disagree in
    correctness. The exact paired SE is sqrt((d_t − δ_t²) / n_t); dropping δ² (small differences)
    makes the MDD slightly conservative. The default d = 0.1 is an assumed typical rate between two
    calibrated merges of the same experts, not a measurement: pass the measured rates where known.
    An MDD above d itself means no difference is detectable at that power (a difference cannot
    exceed the discordant rate).

    `base_accuracy` p_t gives, for comparison, the unpaired MDD of two independent samples,
    (z_{1-α/2} + z_power) · sqrt(2 p_t (1 − p_t) / n_t) (mean: sqrt(Σ_t 2 p_t (1 − p_t) / n_t) / T), and
    bounds d: two models of accuracy about p disagree on at most 2·min(p, 1 − p) of the examples, so a
    larger d is refused. `resolution`: one example, 1/n_t; for the mean the finest step,
    1/(T · max_t n_t) (one example of task t moves the mean by 1/(T · n_t))."""
    if not 0 < alpha < 1 or not 0 < power < 1:
        raise ValueError(f"alpha and power must lie in (0, 1), got {alpha}, {power}")
    if not sizes:
        raise ValueError("no tasks given")
    for task, n in sizes.items():
        if n < 1:
            raise ValueError(f"task {task!r}: no examples")
    p = _per_task(base_accuracy, sizes, "base_accuracy")
    d = _per_task(discordant, sizes, "discordant")
    for task in sizes:
        if not 0 <= p[task] <= 1:
            raise ValueError(f"task {task!r}: base accuracy {p[task]} outside [0, 1]")
        bound = 2 * min(p[task], 1 - p[task])
        if not 0 < d[task] <= 1 or d[task] > bound + 1e-12:
            raise ValueError(f"task {task!r}: discordant rate {d[task]} is impossible for two models of accuracy "
                             f"about {p[task]} (they disagree on at most {bound:.4g} of the examples)")
    z = NormalDist().inv_cdf(1 - alpha / 2) + NormalDist().inv_cdf(power)
    T = len(sizes)
    tasks = {task: Detectable(paired=z * math.sqrt(d[task] / n),
                              unpaired=z * math.sqrt(2 * p[task] * (1 - p[task]) / n),
                              resolution=1 / n)
             for task, n in sizes.items()}
    mean = Detectable(paired=z * math.sqrt(sum(d[t] / n for t, n in sizes.items())) / T,
                      unpaired=z * math.sqrt(sum(2 * p[t] * (1 - p[t]) / n for t, n in sizes.items())) / T,
                      resolution=1 / (T * max(sizes.values())))
    return DetectableDifferences(tasks=tasks, mean=mean, alpha=alpha, power=power)
