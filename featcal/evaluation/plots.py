"""PNG plots of results (matplotlib, headless)."""

from __future__ import annotations

import os
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
from matplotlib.ticker import MaxNLocator  # noqa: E402


def plot_drift(rows: list[dict], path: str | os.PathLike) -> None:
    """Per-layer L2 distance and cosine similarity to the experts, merged vs calibrated."""
    layers = [r["layer"] for r in rows]
    fig, axes = plt.subplots(1, 2, figsize=(9, 3.5))
    for ax, metric, title in ((axes[0], "l2", "mean L2 distance to experts"), (axes[1], "cosine", "cosine similarity to experts")):
        ax.plot(layers, [r[f"merged_{metric}"] for r in rows], "o-", label="merged")
        ax.plot(layers, [r[f"featcal_{metric}"] for r in rows], "s-", label="FeatCal")
        ax.set_xlabel("layer")
        ax.set_title(title)
        ax.grid(alpha=0.3)
    axes[0].legend()
    fig.tight_layout()
    _save(fig, path)


def plot_lines(rows: list[dict], x: str, ys: list[str], path: str | os.PathLike, ylabel: str,
               log_x: bool = False, hlines: dict[str, float] | None = None) -> None:
    """One line per key in `ys` over `x`, with optional horizontal reference lines."""
    fig, ax = plt.subplots(figsize=(5.5, 3.8))
    for y in ys:
        ax.plot([r[x] for r in rows], [r[y] for r in rows], "o-", label=y)
    for i, (label, value) in enumerate((hlines or {}).items()):
        ax.axhline(value, linestyle="--", color=f"C{len(ys) + i}", label=label)
    if log_x:
        ax.set_xscale("log", base=2)
    ax.set_xlabel(x.replace("_", " "))
    ax.set_ylabel(ylabel)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    _save(fig, path)


def plot_training_curves(curves: dict[str, dict[str, list[tuple[int, float]]]], path: str | os.PathLike) -> None:
    """One panel per metric (e.g. train loss, dev accuracy), one line per run (e.g. per task's
    fine-tuning), each a list of (step, value)."""
    metrics = list(dict.fromkeys(m for run in curves.values() for m in run))
    fig, axes = plt.subplots(1, max(1, len(metrics)), figsize=(4.5 * max(1, len(metrics)), 3.6), squeeze=False)
    for ax, metric in zip(axes[0], metrics):
        for name, run in curves.items():
            if metric in run:
                steps, values = zip(*run[metric])
                ax.plot(steps, values, "o-", label=name)
        ax.set_xlabel("epoch")
        ax.xaxis.set_major_locator(MaxNLocator(integer=True))
        ax.set_title(metric.replace("_", " "))
        ax.grid(alpha=0.3)
    axes[0][-1].legend(fontsize=8, loc="best")
    fig.tight_layout()
    _save(fig, path)


# The comparison's methods in the order they are drawn: (key in results/compare_defaults.json, legend label).
COMPARE_METHODS = (("merged", "alone"), ("surgery", "+ Surgery"), ("probsurgery", "+ ProbSurgery"),
                   ("featcal", "+ FeatCal"))
CALIBRATIONS = (("surgery", "Surgery"), ("probsurgery", "ProbSurgery"), ("featcal", "FeatCal"))


def plot_grouped_bars(groups: dict[str, dict[str, float]], path: str | os.PathLike, ylabel: str, title: str = "",
                      hlines: dict[str, float] | None = None) -> None:
    """One group of bars per key of `groups` (its inner keys, in first-seen order, are the bars and
    the legend), with optional dashed horizontal reference lines. A missing bar is left out."""
    series = list(dict.fromkeys(k for bars in groups.values() for k in bars))
    width = 0.8 / max(len(series), 1)
    fig, ax = plt.subplots(figsize=(max(6.5, 0.3 * len(groups) * max(len(series), 1) + 3.5), 4.2))
    for i, name in enumerate(series):
        xs = [g + (i - (len(series) - 1) / 2) * width for g, bars in enumerate(groups.values()) if name in bars]
        ax.bar(xs, [bars[name] for bars in groups.values() if name in bars], width, label=name, color=f"C{i}")
    for j, (label, value) in enumerate((hlines or {}).items()):
        ax.axhline(value, linestyle="--", linewidth=1, color=("k", "0.5", "0.3")[j % 3], label=label)
    values = [v for bars in groups.values() for v in bars.values()] + list((hlines or {}).values())
    if values:
        low, high = min(values), max(values)
        ax.set_ylim(max(0.0, low - 0.15 * (high - low) - 1), high + 0.1 * (high - low) + 1)
    ax.set_xticks(range(len(groups)), list(groups), rotation=30 if len(groups) > 4 else 0,
                  ha="right" if len(groups) > 4 else "center")
    ax.set_ylabel(ylabel)
    if title:
        ax.set_title(title)
    ax.grid(axis="y", alpha=0.3)
    ax.legend(fontsize=8, loc="upper left", bbox_to_anchor=(1.01, 1.0), frameon=False)   # beside the bars
    fig.tight_layout()
    _save(fig, path)


def plot_compare(compare: dict, path: str | os.PathLike) -> None:
    """results/compare_defaults.json as grouped bars: per anchor merge, its average test accuracy (%) alone,
    + Surgery, + ProbSurgery and + FeatCal; the experts' average as a dashed line."""
    groups = {}
    for anchor, row in compare["anchors"].items():
        bars = {}
        for key, label in COMPARE_METHODS:
            if key in row:
                scores = row[key] if key == "merged" else row[key]["scores"]
                bars[label] = 100 * scores["avg"]
        groups[anchor] = bars
    hlines = {"experts": 100 * compare["experts"]["avg"]} if "experts" in compare else None
    plot_grouped_bars(groups, path, "average test accuracy (%)", hlines=hlines)


def plot_corruption(corruption: dict, path: str | os.PathLike) -> None:
    """results/corruption.json as grouped bars: per calibration set (clean, then each corruption),
    the average test accuracy (%) of each calibration; the experts and the merge as dashed lines."""
    conditions = {"clean": corruption["clean"], **corruption.get("corrupted", {})}
    groups = {kind.replace("_", " "): {label: 100 * rows[key]["scores"]["avg"]
                                       for key, label in CALIBRATIONS if key in rows}
              for kind, rows in conditions.items()}
    hlines = {"experts": 100 * corruption["experts_avg"], f"merge ({corruption.get('anchor', 'anchor')})":
              100 * corruption["merged_avg"]}
    rate = corruption.get("rate")
    plot_grouped_bars(groups, path, "average test accuracy (%)", hlines=hlines,
                      title=f"calibration texts corrupted at rate {rate}" if rate is not None else "")


def plot_tuning_history(trials: list[tuple[int, float]], path: str | os.PathLike, ylabel: str = "dev accuracy (avg)",
                        reference: dict[str, float] | None = None) -> None:
    """Each complete trial's value by trial number and the best so far (higher is better); with no
    trial, an empty frame that says so."""
    fig, ax = plt.subplots(figsize=(5.5, 3.8))
    if trials:
        numbers, values = zip(*sorted(trials))
        best = [max(values[: i + 1]) for i in range(len(values))]
        ax.plot(numbers, values, "o", label="trial")
        ax.step(numbers, best, where="post", color="C1", label="best so far")
    else:
        ax.text(0.5, 0.5, "no complete trial yet", ha="center", va="center", transform=ax.transAxes)
    for i, (label, value) in enumerate((reference or {}).items()):
        ax.axhline(value, linestyle="--", linewidth=1, color=f"C{2 + i}", label=label)
    ax.set_xlabel("trial")
    ax.set_ylabel(ylabel)
    ax.set_title(f"tuning history ({len(trials)} complete trial{'s' if len(trials) != 1 else ''})")
    ax.grid(alpha=0.3)
    if trials or reference:
        ax.legend(fontsize=8)
    fig.tight_layout()
    _save(fig, path)


def plot_param_importances(importances: dict[str, float], path: str | os.PathLike, note: str = "") -> None:
    """Horizontal bars of each parameter's importance (largest on top); with none, `note` instead."""
    fig, ax = plt.subplots(figsize=(5.5, 0.5 * max(len(importances), 3) + 1.3))
    if importances:
        names = list(importances)[::-1]
        ax.barh(names, [importances[n] for n in names], color="C0")
        ax.set_xlabel("importance (share)")
        ax.grid(axis="x", alpha=0.3)
    else:
        ax.set_xticks([])
        ax.set_yticks([])
    if note:
        ax.text(0.5, 0.5, note, ha="center", va="center", transform=ax.transAxes, wrap=True)
    ax.set_title("parameter importances")
    fig.tight_layout()
    _save(fig, path)


def plot_study(study, history_path: str | os.PathLike, importance_path: str | os.PathLike) -> None:
    """An Optuna study's tuning history (complete trials' values) and parameter importances
    (optuna.importance.get_param_importances, which needs at least 2 complete trials)."""
    import optuna   # only the tune stage needs it
    from optuna.trial import TrialState

    complete = study.get_trials(deepcopy=False, states=(TrialState.COMPLETE,))
    plot_tuning_history([(t.number, t.value) for t in complete], history_path)
    if len(complete) < 2:
        plot_param_importances({}, importance_path, note=f"needs 2 complete trials, has {len(complete)}")
        return
    plot_param_importances(optuna.importance.get_param_importances(study), importance_path)


def _save(fig, path: str | os.PathLike) -> None:
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(path).with_name(f".{Path(path).name}.tmp.png")
    fig.savefig(tmp, dpi=120)
    plt.close(fig)
    os.replace(tmp, path)
