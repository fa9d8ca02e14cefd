"""The dev-tuned comparison: every (anchor, post-merge method) study's choice, read once on test.

Each study (`stages/tune.py --method ... --score-test`) chose its hyperparameters on dev and scored
the choice on test once; this puts them side by side with each anchor alone, the gap each closes (to
its own anchor's and to Task Arithmetic's), what the search cost and what the deployed model carries
beyond the merged backbone. Pure: summaries in, rows out.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Mapping

import numpy as np

METHODS = ("alone", "featcal", "surgery", "probsurgery")   # the anchor alone, and the post-merge methods
SIGMERGE_FEATCAL = "sigmerge_featcal"   # SigMerge repairing the anchor, then FeatCal (its own study)
COMPARED = METHODS + (SIGMERGE_FEATCAL,)
FEATCAL_PIPELINES = ("featcal", SIGMERGE_FEATCAL)   # the models FeatCal makes: the default pipeline's candidates
REFERENCE_ANCHOR = "task_arithmetic"


@dataclass
class ComparisonRow:
    anchor: str
    method: str
    test: dict[str, float]                 # {"avg", <task>: accuracy}
    test_avg: float
    dev_avg: float | None                  # the deployed model's dev (`deployed_dev`; None: the anchor alone)
    gap_closed: float | None               # of this anchor's gap to the experts
    gap_closed_vs_ta: float | None         # of Task Arithmetic's gap
    hyperparameters: dict = field(default_factory=dict)
    trials: int = 0
    search_s: float = 0.0                  # wall seconds: mean trial × trials, plus a rung's exact rebuilds (`search_seconds`)
    extra_parameters: int = 0              # carried by the deployed model beyond the merged backbone
    ci95: dict | None = None               # {"avg", <task>: [low, high]}: paired bootstrap, test
    vs_best: dict | None = None            # test difference to its anchor's best row: {"best", "difference",
                                           # "ci95", "significant"} (`with_uncertainty`)
    rescored: bool = False                 # the scores are the rebuilt model's, not the study's (code changed since)
    source: dict | None = None             # the summary's file, the commit that wrote it, its search (`search_of`)


def gap(value: float, anchor: float, experts: float) -> float | None:
    """(value − anchor) / (experts − anchor); None when the anchor has no gap to close. Unrounded: the
    table rounds it once, where shown."""
    return None if abs(experts - anchor) < 1e-12 else (value - anchor) / (experts - anchor)


def extra_parameters(method: str, hyperparameters: Mapping, width: int, n_tasks: int) -> int:
    """Parameters the deployed model adds: FeatCal none (it rewrites the backbone's own weights);
    Surgery a rank-r down/up pair per task (2·d·r); ProbSurgery a d→h layer and two h→d heads with
    biases per task (3·d·h + 2·d)."""
    if method == "surgery":
        return n_tasks * 2 * width * int(hyperparameters["rank"])
    if method == "probsurgery":
        h = int(hyperparameters["hidden"])
        return n_tasks * (3 * width * h + 2 * width)
    return 0


def comparison_rows(
    experts_avg: float,
    alone: Mapping[str, Mapping[str, float]],
    studies: Mapping[tuple[str, str], Mapping],
    width: int,
    n_tasks: int,
) -> list[ComparisonRow]:
    """`alone[anchor]`: the anchor's test scores ({"avg", <task>}); `studies[(anchor, method)]`: a
    `stages/tune.py --score-test` summary. Anchors in `studies` without test scores alone are refused,
    as are studies that never read test."""
    missing = sorted({a for a, _ in studies} - set(alone))
    if missing:
        raise ValueError(f"no test scores of the anchor alone for {missing}")
    ta = alone.get(REFERENCE_ANCHOR, {}).get("avg")
    rows = []
    for anchor in dict.fromkeys(a for a, _ in studies):   # in the order the studies are given
        base = alone[anchor]["avg"]
        rows.append(ComparisonRow(anchor, "alone", dict(alone[anchor]), base, None, 0.0,
                                  None if ta is None else gap(base, ta, experts_avg)))
        for method in COMPARED[1:]:
            summary = studies.get((anchor, method))
            if summary is None:
                continue
            if not summary.get("test"):
                raise ValueError(f"study {anchor}/{method} ({summary.get('study')}) has no test scores: "
                                 "re-run it with --score-test")
            test = {k: float(v) for k, v in summary["test"].items()}   # rounded once, where shown
            params = dict(summary["best"]["params"])
            n = int(summary.get("trials", {}).get("complete", 0))
            rows.append(ComparisonRow(
                anchor, method, test, test["avg"], deployed_dev(summary),
                gap(test["avg"], base, experts_avg), None if ta is None else gap(test["avg"], ta, experts_avg),
                params, n, search_seconds(summary),
                extra_parameters(method, params, width, n_tasks), rescored=bool(summary.get("rescored")),
            ))
    return rows


def deployed_dev(summary: Mapping) -> float:
    """The dev score of the model the study deployed: after a reduced search (fewer examples, float32, a
    rung) the rebuilt model's (`rescored_dev`), which is not the trial's searched score; else the best trial's."""
    rescored = summary.get("rescored_dev") or {}
    return float(rescored["dev"] if "dev" in rescored else summary["best"]["dev_avg"])


def search_of(summary: Mapping) -> dict:
    """How a study searched: its trials' examples a task (None: every example), their product dtype and
    its rung (0: none): rows searched differently are marked so, not silently put side by side."""
    return {"trial_examples_per_task": summary.get("trial_examples_per_task"),
            "trial_product_dtype": summary.get("trial_product_dtype") or "float64",
            "rerank_top_k": int((summary.get("rerank") or {}).get("top_k", 0))}


def search_seconds(summary: Mapping) -> float:
    """What the search cost: its complete trials (mean wall × count) and a rung's exact rebuilds and scorings."""
    n = int(summary.get("trials", {}).get("complete", 0))
    trials = float(summary.get("trial_wall_s", {}).get("mean", 0.0)) * n
    return round(trials + float((summary.get("rerank") or {}).get("wall_s", 0.0)), 1)


def dev_best(rows: list[ComparisonRow], methods: tuple[str, ...] = COMPARED[1:]) -> ComparisonRow:
    """The row with the highest dev score among `methods`, on a tie the one that adds fewer
    parameters: the pick made without reading test."""
    searched = [r for r in rows if r.method in methods and r.dev_avg is not None]
    if not searched:
        raise ValueError(f"no study of {list(methods)} among the rows")
    return max(searched, key=lambda r: (r.dev_avg, -r.extra_parameters))


def per_task_groups(rows: list[ComparisonRow], experts: Mapping[str, float], tasks: list[str]) -> dict[str, dict[str, float]]:
    """{task: {"experts", "<anchor> alone", "<anchor> + <method> (dev-best)"[, "<anchor> + <featcal
    pipeline> (dev-best FeatCal)"]}} in %: the dev-best row, its anchor alone, and FeatCal's own
    dev-best row when another method won."""
    best = dev_best(rows)
    alone = next(r for r in rows if r.anchor == best.anchor and r.method == "alone")
    shown = {f"{best.anchor} alone": alone, f"{best.anchor} + {best.method} (dev-best)": best}
    if best.method not in FEATCAL_PIPELINES and any(r.method in FEATCAL_PIPELINES for r in rows):
        featcal = dev_best(rows, FEATCAL_PIPELINES)
        shown[f"{featcal.anchor} + {featcal.method} (dev-best FeatCal)"] = featcal
    return {t: {"experts": 100 * experts[t], **{label: 100 * r.test[t] for label, r in shown.items()}} for t in tasks}


def as_mapping(rows: list[ComparisonRow]) -> dict[str, dict[str, dict]]:
    """{anchor: {method: row fields}}: the shape of results/compare.json."""
    out: dict[str, dict[str, dict]] = {}
    for row in rows:
        fields = asdict(row)
        out.setdefault(fields.pop("anchor"), {})[fields.pop("method")] = fields
    return out


def rows_from_mapping(anchors: Mapping[str, Mapping[str, Mapping]]) -> list[ComparisonRow]:
    """`as_mapping`'s inverse: results/compare.json's "anchors" back as rows, in its order."""
    return [ComparisonRow(anchor, method, **fields) for anchor, methods in anchors.items()
            for method, fields in methods.items()]


def _pct(x: float | None) -> str:
    return "–" if x is None else f"{100 * x:.1f}"


def _interval(pair) -> str:
    return "–" if pair is None else f"[{100 * pair[0]:.1f}, {100 * pair[1]:.1f}]"


def _vs_best(row: ComparisonRow) -> str:
    """"best", or the difference to the anchor's best row with its interval, "n.s." where not significant."""
    v = row.vs_best
    if v is None:
        return "–"
    if v["best"] == row.method:
        return "best"
    cell = f"{100 * v['difference']:+.1f} {_interval(v['ci95'])}"
    return cell if v["significant"] else f"{cell} n.s."


def table_cells(rows: list[ComparisonRow], tasks: list[str]) -> tuple[list[str], list[list[str]]]:
    """Header and text cells, one line per (anchor, method): test per task, average and its 95 %
    interval, the difference to the anchor's best row (n.s.: not significant), gaps closed, dev, search
    cost, extra parameters (accuracies in %, rounded once, here). The interval columns appear when the
    rows carry them (`with_uncertainty`)."""
    intervals = any(r.ci95 is not None for r in rows)
    head = ["anchor", "method", *tasks, "test avg", *(["95 % CI", "vs anchor's best (95 % CI)"] if intervals else []),
            "gap closed", "vs TA", "dev avg", "search s", "extra params"]
    return head, [[r.anchor, r.method, *(_pct(r.test.get(t)) for t in tasks), _pct(r.test_avg),
                   *([_interval((r.ci95 or {}).get("avg")), _vs_best(r)] if intervals else []),
                   _pct(r.gap_closed), _pct(r.gap_closed_vs_ta), _pct(r.dev_avg),
                   f"{r.search_s:.0f}" if r.trials else "–", f"{r.extra_parameters:,}"] for r in rows]


def markdown_table(rows: list[ComparisonRow], tasks: list[str]) -> str:
    """`table_cells` as a Markdown table."""
    head, cells = table_cells(rows, tasks)
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    lines += ["| " + " | ".join(line) + " |" for line in cells]
    return "\n".join(lines) + "\n"


# --- uncertainty (docs/uncertainty.md) -------------------------------------------------------------------

Correct = Mapping[str, Mapping[str, "np.ndarray"]]   # model -> task -> per-example correctness


@dataclass(frozen=True)
class Uncertainty:
    """The rows with their test intervals (`ci95`, `vs_best`), the experts' interval, per anchor
    which rows differ significantly from its best test row, and the honest dev selection."""
    rows: list[ComparisonRow]
    experts_ci95: dict
    significant_vs_best: dict[str, dict]   # anchor -> {"best": method, "rows": {method: significant}}
    selection: dict                        # "overall", "featcal", "per_anchor": the rule's picks on dev
    n_resamples: int
    seed: int


def _pairs(intervals) -> dict:
    return {"avg": [intervals.mean.low, intervals.mean.high],
            **{t: [i.low, i.high] for t, i in intervals.tasks.items()}}


def _agrees(what: str, correct: Mapping[str, "np.ndarray"], scores: Mapping[str, float], tolerance: float) -> None:
    """The predictions give the table's scores (to its rounding): they are that model's."""
    for task, value in scores.items():
        if task in ("avg", "gap_closed"):
            continue
        if task not in correct:
            raise ValueError(f"{what}: no predictions for task {task!r}")
        got = float(np.mean(correct[task]))
        if abs(got - float(value)) > tolerance:
            raise ValueError(f"{what}: its predictions give {got:.6f} on {task!r} where the table has {value}: "
                             "they are not that model's (re-run stages/tune_anchor.py --rescore)")


def with_uncertainty(rows: list[ComparisonRow], models: Mapping[tuple[str, str], str], experts_test: Mapping[str, float],
                     test: Correct, dev: Correct, n_resamples: int = 4000, seed: int = 0,
                     level: float = 0.95) -> Uncertainty:
    """Paired bootstrap over the rows: `models[(anchor, method)]` names a row's predictions in `test`
    and `dev` (model -> task -> correctness; the experts' are "experts"). Every row gets its test
    interval and its difference to the best test row of its anchor; the selection rule
    (`featcal.evaluation.bootstrap.selection`) picks on dev, overall, among FeatCal's pipelines and
    per anchor. Predictions that do not give a row's reported scores are refused, naming the row."""
    from featcal.evaluation.bootstrap import accuracy_intervals, difference_interval, resample_indices, selection, task_sizes

    for row in rows:
        if (row.anchor, row.method) not in models or models[(row.anchor, row.method)] not in test:
            raise ValueError(f"row {row.anchor}/{row.method}: no test predictions")
        _agrees(f"row {row.anchor}/{row.method}", test[models[(row.anchor, row.method)]], row.test,
                5e-5 if row.method == "alone" else 1e-6)   # rounded to 4 digits (alone) or 6 (studies)
    if "experts" not in test:
        raise ValueError("no test predictions of the experts")
    _agrees("the experts", test["experts"], experts_test, 5e-5)
    used = {name: test[name] for name in {*models.values(), "experts"}}
    indices = resample_indices(task_sizes(used), n_resamples, seed)
    out, marks = [], {}
    for anchor in dict.fromkeys(r.anchor for r in rows):
        group = [r for r in rows if r.anchor == anchor]
        best = max(group, key=lambda r: (r.test_avg, -r.extra_parameters))
        best_correct = test[models[(anchor, best.method)]]
        marks[anchor] = {"best": best.method, "rows": {}}
        for row in group:
            correct = test[models[(anchor, row.method)]]
            ci = _pairs(accuracy_intervals(correct, indices, level, model=models[(anchor, row.method)]))
            vs_best = {"best": best.method, "difference": 0.0, "ci95": [0.0, 0.0], "significant": False}
            if row is not best:
                d = difference_interval(correct, best_correct, indices, level,
                                        names=(models[(anchor, row.method)], models[(anchor, best.method)])).mean
                vs_best.update(difference=d.estimate, ci95=[d.low, d.high], significant=d.significant)
                marks[anchor]["rows"][row.method] = d.significant
            out.append(ComparisonRow(**{**asdict(row), "ci95": ci, "vs_best": vs_best}))
    searched = [r for r in rows if r.dev_avg is not None]
    for row in searched:
        name = models[(row.anchor, row.method)]
        if name not in dev:
            raise ValueError(f"row {row.anchor}/{row.method}: no dev predictions")
        if abs(float(np.mean([np.mean(c) for c in dev[name].values()])) - row.dev_avg) > 5e-6:
            raise ValueError(f"row {row.anchor}/{row.method}: its dev predictions do not give its dev score "
                             f"{row.dev_avg} (re-run stages/tune_anchor.py --rescore)")
    dev_sizes = task_sizes({models[(r.anchor, r.method)]: dev[models[(r.anchor, r.method)]] for r in searched})
    dev_indices = resample_indices(dev_sizes, n_resamples, seed)

    def pick(candidates: list[ComparisonRow]) -> dict:
        key = {f"{r.anchor}/{r.method}": r for r in candidates}
        chosen = selection({k: dev[models[(r.anchor, r.method)]] for k, r in key.items()},
                           {k: r.extra_parameters for k, r in key.items()}, {k: r.search_s for k, r in key.items()},
                           dev_indices, level)
        return {"chosen": chosen.chosen, "best": chosen.best, "tied": list(chosen.tied), "reason": chosen.reason}

    picks = {"overall": pick(searched), "featcal": pick([r for r in searched if r.method in FEATCAL_PIPELINES]),
             "per_anchor": {a: pick([r for r in searched if r.anchor == a])
                            for a in dict.fromkeys(r.anchor for r in searched)}}
    experts = _pairs(accuracy_intervals(test["experts"], indices, level, model="experts"))
    return Uncertainty(out, experts, marks, picks, n_resamples, seed)


def detectable(rows: list[ComparisonRow], models: Mapping[tuple[str, str], str], correct: Correct,
               alpha: float = 0.05, power: float = 0.8) -> dict:
    """What a split can resolve between two of the tuned rows: per task, the measured rate at which
    two rows of one anchor disagree in correctness (averaged over every such pair), and the minimum
    detectable difference it gives (`featcal.evaluation.bootstrap.minimum_detectable_difference`)."""
    from featcal.evaluation.bootstrap import minimum_detectable_difference

    searched = [r for r in rows if r.dev_avg is not None]
    rates: dict[str, list[float]] = {}
    accuracy: dict[str, list[float]] = {}
    for anchor in dict.fromkeys(r.anchor for r in searched):
        group = [correct[models[(r.anchor, r.method)]] for r in searched if r.anchor == anchor]
        for i, a in enumerate(group):
            for task, values in a.items():
                accuracy.setdefault(task, []).append(float(np.mean(values)))
            for b in group[i + 1:]:
                for task in a:
                    rates.setdefault(task, []).append(float(np.mean(a[task] != b[task])))
    if not rates:
        raise ValueError("no two tuned rows of one anchor to measure how often rows disagree")
    sizes = {task: len(next(iter(correct.values()))[task]) for task in rates}
    d = {task: float(np.mean(v)) for task, v in rates.items()}
    found = minimum_detectable_difference(sizes, {t: float(np.mean(v)) for t, v in accuracy.items()}, alpha, power, d)
    return {"examples": sizes, "discordant": d,
            "mdd": {"avg": found.mean.paired, **{t: x.paired for t, x in found.tasks.items()}},
            "mdd_unpaired": {"avg": found.mean.unpaired, **{t: x.unpaired for t, x in found.tasks.items()}},
            "alpha": alpha, "power": power}


def significance_markdown(measured: Uncertainty, detectable_by_split: Mapping[str, Mapping], tasks: list[str]) -> str:
    """Per anchor: the row the selection rule picks on dev, the rows tied with the dev-best, the best
    test row and whether the pick's test difference to it is significant; then what each split can
    resolve (minimum detectable differences, measured discordant rates). Markdown, accuracies in points."""
    rows = {(r.anchor, r.method): r for r in measured.rows}
    lines = ["| anchor | dev-best | chosen on dev (rule) | tied with the dev-best | best on test | chosen vs best on test "
             "(95 % CI) |", "|---|---|---|---|---|---|"]
    for anchor, pick in measured.selection["per_anchor"].items():
        chosen, best = (name.split("/")[1] for name in (pick["chosen"], pick["best"]))
        tied = ", ".join(name.split("/")[1] for name in pick["tied"])
        top = measured.significant_vs_best[anchor]["best"]
        v = rows[(anchor, chosen)].vs_best
        cell = "it is the best" if v["best"] == chosen else (
            f"{100 * v['difference']:+.1f} [{100 * v['ci95'][0]:+.1f}, {100 * v['ci95'][1]:+.1f}], "
            + ("significant" if v["significant"] else "not significant"))
        lines.append(f"| {anchor} | {best} ({100 * rows[(anchor, best)].dev_avg:.2f}) | {chosen} | {tied} | "
                     f"{top} ({100 * rows[(anchor, top)].test_avg:.1f}) | {cell} |")
    lines += ["", "| split | " + " | ".join(tasks) + " | average |", "|---|" + "---|" * (len(tasks) + 1)]
    for split, found in detectable_by_split.items():
        lines.append(f"| {split}: examples | " + " | ".join(str(found["examples"][t]) for t in tasks) + " | – |")
        lines.append(f"| {split}: rows disagree on | " + " | ".join(f"{100 * found['discordant'][t]:.1f} %" for t in tasks)
                     + " | – |")
        lines.append(f"| {split}: MDD, paired (points) | " + " | ".join(f"{100 * found['mdd'][t]:.1f}" for t in tasks)
                     + f" | {100 * found['mdd']['avg']:.2f} |")
    return "\n".join(lines) + "\n"
