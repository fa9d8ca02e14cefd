"""featcal.evaluation.bootstrap: paired bootstrap intervals, significance, the selection rule and the
minimum detectable difference, on synthetic correctness with known answers (no model)."""

from __future__ import annotations

import math

import numpy as np
import pytest

from featcal.evaluation.bootstrap import (
    accuracy_intervals, difference_interval, minimum_detectable_difference, resample_indices, selection,
    sign_test_p, significant_vs_best, task_sizes,
)

Z = 1.959963984540054   # z_{0.975}


def pair(n: int = 400, right: int = 300, flipped: int = 20, seed: int = 0) -> tuple[np.ndarray, np.ndarray]:
    """A correct on `right` of `n` examples (shuffled); B equals A but is wrong on `flipped` of A's right ones."""
    a = np.zeros(n, dtype=bool)
    a[:right] = True
    np.random.default_rng(seed).shuffle(a)
    b = a.copy()
    b[np.flatnonzero(a)[:flipped]] = False
    return a, b


def with_accuracy(n: int, right: int, seed: int = 1) -> np.ndarray:
    correct = np.zeros(n, dtype=bool)
    correct[np.random.default_rng(seed).permutation(n)[:right]] = True
    return correct


def test_intervals_match_the_normal_approximation():
    a, b = pair()
    n, p = a.size, a.mean()
    indices = resample_indices({"t": n}, n_resamples=4000, seed=0)
    acc = accuracy_intervals({"t": a}, indices)
    half = Z * math.sqrt(p * (1 - p) / n)
    assert acc.mean.estimate == acc.tasks["t"].estimate == 0.75
    assert acc.tasks["t"].low == pytest.approx(p - half, abs=0.005)
    assert acc.tasks["t"].high == pytest.approx(p + half, abs=0.005)

    diff = difference_interval({"t": a}, {"t": b}, indices)
    d, delta = 20 / 400, 0.05
    half = Z * math.sqrt((d - delta ** 2) / n)
    assert diff.mean.estimate == pytest.approx(delta)
    assert diff.tasks["t"].low == pytest.approx(delta - half, abs=0.005)
    assert diff.tasks["t"].high == pytest.approx(delta + half, abs=0.005)
    assert diff.mean.significant and diff.tasks["t"].significant
    # the other way round: the same interval mirrored
    back = difference_interval({"t": b}, {"t": a}, indices)
    assert (back.mean.low, back.mean.high) == pytest.approx((-diff.mean.high, -diff.mean.low))


def test_same_seed_same_intervals_other_seed_other_ones():
    a, b = pair()
    sizes = {"x": 400, "y": 150}
    models = {"a": {"x": a, "y": with_accuracy(150, 100)}, "b": {"x": b, "y": with_accuracy(150, 90, seed=2)}}

    def run(seed: int):
        indices = resample_indices(sizes, n_resamples=500, seed=seed)
        return indices, accuracy_intervals(models["a"], indices), difference_interval(models["a"], models["b"], indices)

    i1, acc1, diff1 = run(7)
    i2, acc2, diff2 = run(7)
    assert all(np.array_equal(i1[t], i2[t]) for t in sizes)
    assert acc1 == acc2 and diff1 == diff2                              # floats compared exactly
    # the task order of `sizes` does not change the resamples
    assert all(np.array_equal(i1[t], resample_indices({"y": 150, "x": 400}, 500, 7)[t]) for t in sizes)
    _, acc3, diff3 = run(8)
    assert acc3 != acc1 and diff3 != diff1
    assert acc3.mean.estimate == acc1.mean.estimate                     # the point estimate does not resample


def test_pairing_makes_the_difference_interval_narrow():
    a, b = pair(flipped=6)
    indices = resample_indices({"t": a.size}, n_resamples=2000, seed=3)
    half_a = (lambda i: (i.high - i.low) / 2)(accuracy_intervals({"t": a}, indices).mean)
    half_b = (lambda i: (i.high - i.low) / 2)(accuracy_intervals({"t": b}, indices).mean)
    diffs = difference_interval({"t": a}, {"t": b}, indices)
    for diff in (diffs.mean, diffs.tasks["t"]):
        half_diff = (diff.high - diff.low) / 2
        assert half_diff < 0.5 * (half_a + half_b)
        # narrower even than two independent samples would give, sqrt(half_a² + half_b²)
        assert half_diff < 0.5 * math.hypot(half_a, half_b)
        assert diff.significant    # 6 of 400 one way, none the other: a real, if small, difference


def test_with_few_disagreements_the_exact_sign_test_decides():
    """4 of 400 examples, all one way: every resample keeps a ≥ b, so the percentile interval
    excludes 0, but 4 such examples happen by chance with p = 2 · 0.5⁴ = 0.125: not significant.
    5 one way against 1 the other: p = 2 · (1 + 6) / 64. 6 of 400 one way: p = 0.031, significant."""
    assert sign_test_p(4, 0) == 0.125 and sign_test_p(0, 4) == 0.125
    assert sign_test_p(5, 1) == 2 * 7 / 64 and sign_test_p(0, 0) == 1.0 and sign_test_p(3, 3) == 1.0
    for flipped, significant in ((4, False), (6, True)):
        a, b = pair(flipped=flipped)
        indices = resample_indices({"t": a.size}, n_resamples=2000, seed=3)
        diff = difference_interval({"t": a}, {"t": b}, indices)
        for d in (diff.tasks["t"], diff.mean):
            assert d.low > 0 and d.estimate == pytest.approx(flipped / 400)   # the interval excludes 0
            assert d.significant is significant
    # the mean pools the tasks' disagreements: 3 + 3 one way over two tasks is 6, p = 0.031
    (a1, b1), (a2, b2) = pair(flipped=3, seed=1), pair(flipped=3, seed=2)
    indices = resample_indices({"t1": 400, "t2": 400}, n_resamples=2000, seed=3)
    diff = difference_interval({"t1": a1, "t2": a2}, {"t1": b1, "t2": b2}, indices)
    assert not diff.tasks["t1"].significant and not diff.tasks["t2"].significant and diff.mean.significant


def test_identical_models_do_not_differ():
    rng = np.random.default_rng(4)
    models = {name: {"x": rng.random(300) < 0.7, "y": rng.random(120) < 0.6} for name in ("m1", "m2", "m3")}
    indices = resample_indices(task_sizes(models), n_resamples=300, seed=0)
    for correct in models.values():
        same = difference_interval(correct, correct, indices)
        for d in [same.mean, *same.tasks.values()]:
            assert (d.estimate, d.low, d.high, d.significant) == (0.0, 0.0, 0.0, False)
    copies = {**models, "m1 again": {t: v.copy() for t, v in models["m1"].items()}}
    marks = significant_vs_best(copies, "m1", indices)
    assert set(marks) == {"m2", "m3", "m1 again"}                       # every row but the best
    assert marks["m1 again"] is False


def test_significant_vs_best_marks_only_real_gaps():
    a, b = pair(flipped=40)                 # 10 points worse, on the same examples
    close = a.copy()
    close[np.flatnonzero(a)[:1]] = False    # one example worse
    indices = resample_indices({"t": a.size}, n_resamples=1000, seed=5)
    assert significant_vs_best({"a": {"t": a}, "b": {"t": b}, "close": {"t": close}}, "a", indices) == \
        {"b": True, "close": False}


def test_the_average_is_the_unweighted_mean_of_the_tasks():
    small, large = with_accuracy(100, 90), with_accuracy(300, 150)     # 0.9 and 0.5
    indices = resample_indices({"small": 100, "large": 300}, n_resamples=400, seed=1)
    acc = accuracy_intervals({"small": small, "large": large}, indices)
    assert acc.mean.estimate == pytest.approx(0.7)                      # pooled over examples: 0.6
    assert acc.tasks["small"].estimate == pytest.approx(0.9) and acc.tasks["large"].estimate == pytest.approx(0.5)
    assert acc.mean.low < 0.7 < acc.mean.high
    # the resampled means are the means of the resampled task accuracies, resample by resample
    per_resample = np.mean([small[indices["small"]].mean(axis=1), large[indices["large"]].mean(axis=1)], axis=0)
    assert (acc.mean.low, acc.mean.high) == pytest.approx(tuple(np.quantile(per_resample, [0.025, 0.975])))


def test_mismatched_lengths_name_the_task_and_the_model():
    models = {"ties": {"bbc": np.ones(379, bool), "debate_party": np.ones(187, bool)},
              "featcal": {"bbc": np.ones(379, bool), "debate_party": np.ones(186, bool)}}
    with pytest.raises(ValueError, match=r"task 'debate_party': model 'featcal' has 186 examples"):
        task_sizes(models)
    indices = resample_indices({"bbc": 379, "debate_party": 187}, 10, 0)
    with pytest.raises(ValueError, match=r"task 'debate_party': model 'featcal' has 186"):
        significant_vs_best(models, "ties", indices)
    with pytest.raises(ValueError, match=r"task 'debate_party': model 'featcal' has 186"):
        difference_interval(models["ties"], models["featcal"], indices, names=("ties", "featcal"))
    with pytest.raises(ValueError, match=r"task 'debate_party': model 'b' has 186"):   # unnamed: a and b
        difference_interval(models["ties"], models["featcal"], indices)
    with pytest.raises(ValueError, match=r"task 'debate_party': model 'featcal' has 186 examples but the resamples"):
        accuracy_intervals(models["featcal"], indices, model="featcal")
    with pytest.raises(ValueError, match=r"task 'bbc': model 'featcal' has it but model 'ties' does not"):
        task_sizes({"ties": {"debate_party": np.ones(3, bool)},
                    "featcal": {"bbc": np.ones(3, bool), "debate_party": np.ones(3, bool)}})
    with pytest.raises(ValueError, match=r"task 'bbc', model 'm': per-example correctness must be bool or 0/1"):
        task_sizes({"m": {"bbc": np.array([0, 1, 2])}})


def test_selection_prefers_fewer_parameters_among_tied_rows():
    a, b = pair(flipped=2)                                     # "big" is 2 examples of 400 better on dev
    indices = resample_indices({"t": a.size}, n_resamples=1000, seed=0)
    chosen = selection({"big": {"t": a}, "small": {"t": b}}, added_parameters={"big": 10_000, "small": 10},
                       search_seconds={"big": 1.0, "small": 100.0}, indices=indices)
    assert (chosen.chosen, chosen.best, chosen.tied) == ("small", "big", ("big", "small"))
    assert "'small' is tied with the dev-best 'big'" in chosen.reason and "fewest parameters" in chosen.reason


def test_selection_keeps_a_significantly_better_row():
    a, b = pair(flipped=40)                                    # "big" is 10 points better on dev
    indices = resample_indices({"t": a.size}, n_resamples=1000, seed=0)
    chosen = selection({"big": {"t": a}, "small": {"t": b}}, added_parameters={"big": 10_000, "small": 0},
                       search_seconds={"big": 500.0, "small": 0.0}, indices=indices)
    assert (chosen.chosen, chosen.tied) == ("big", ("big",))
    assert "significantly worse" in chosen.reason


def test_selection_breaks_a_parameter_tie_by_search_seconds():
    a, b = pair(flipped=1)
    worse = pair(flipped=60)[1]                                # fewest parameters, fastest, but significantly worse
    indices = resample_indices({"t": a.size}, n_resamples=1000, seed=0)
    chosen = selection({"slow": {"t": a}, "fast": {"t": b}, "worse": {"t": worse}},
                       added_parameters={"slow": 100, "fast": 100, "worse": 0},
                       search_seconds={"slow": 3600.0, "fast": 60.0, "worse": 1.0}, indices=indices)
    assert (chosen.chosen, chosen.best, chosen.tied) == ("fast", "slow", ("slow", "fast"))
    assert "searched the shortest (60.0 s)" in chosen.reason
    # at equal search cost the dev-best row stays
    chosen = selection({"slow": {"t": a}, "fast": {"t": b}}, added_parameters={"slow": 100, "fast": 100},
                       search_seconds={"slow": 60.0, "fast": 60.0}, indices=indices)
    assert chosen.chosen == "slow"
    with pytest.raises(ValueError, match="row 'fast': no search_seconds"):
        selection({"slow": {"t": a}, "fast": {"t": b}}, {"slow": 1, "fast": 1}, {"slow": 1.0}, indices)


def test_minimum_detectable_difference_follows_the_formula():
    mdd = minimum_detectable_difference({"t": 300}, base_accuracy=0.8, discordant=0.1)
    z = 1.96 + 0.8416
    assert mdd.tasks["t"].paired == pytest.approx(z * math.sqrt(0.1 / 300), rel=1e-4)
    assert mdd.tasks["t"].paired == pytest.approx(0.05115, abs=1e-5)
    assert mdd.tasks["t"].unpaired == pytest.approx(z * math.sqrt(2 * 0.8 * 0.2 / 300), rel=1e-4)
    assert mdd.tasks["t"].resolution == 1 / 300
    # the six test splits: SE of the mean = sqrt(Σ d/n_t) / T
    sizes = {"bbc": 379, "tweet_sentiment": 500, "movie_polarity": 500, "drug_review": 379, "debate_party": 187,
             "name_gender": 500}
    six = minimum_detectable_difference(sizes, base_accuracy=0.8)   # d = 0.1 by default
    assert six.mean.paired == pytest.approx(z * math.sqrt(sum(0.1 / n for n in sizes.values())) / 6, rel=1e-4)
    assert six.mean.resolution == 1 / (6 * 500)
    assert six.tasks["debate_party"].paired > six.tasks["bbc"].paired > six.tasks["name_gender"].paired
    # per-task rates, and a rate no two models of that accuracy can have
    per_task = minimum_detectable_difference({"a": 100, "b": 400}, {"a": 0.9, "b": 0.6},
                                             discordant={"a": 0.04, "b": 0.2})
    assert per_task.tasks["a"].paired == pytest.approx(z * 0.02, rel=1e-4)
    with pytest.raises(ValueError, match=r"task 't': discordant rate 0.1 is impossible"):
        minimum_detectable_difference({"t": 300}, base_accuracy=0.97)
