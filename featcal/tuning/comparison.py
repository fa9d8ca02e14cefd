"""The dev-tuned comparison: every (anchor, post-merge method) study's choice, read once on test.

Each study (`stages/tune.py --method ... --score-test`) chose its hyperparameters on dev and scored
the choice on test once; this puts them side by side with each anchor alone, the gap each closes (to
its own anchor's and to Task Arithmetic's), what the search cost and what the deployed model carries
beyond the merged backbone. Pure: summaries in, rows out.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Mapping

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
    dev_avg: float | None                  # the study's best (None: the anchor alone, not searched)
    gap_closed: float | None               # of this anchor's gap to the experts
    gap_closed_vs_ta: float | None         # of Task Arithmetic's gap
    hyperparameters: dict = field(default_factory=dict)
    trials: int = 0
    search_s: float = 0.0                  # the study's trials, wall seconds (mean trial × trials)
    extra_parameters: int = 0              # carried by the deployed model beyond the merged backbone


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
                anchor, method, test, test["avg"], float(summary["best"]["dev_avg"]),
                gap(test["avg"], base, experts_avg), None if ta is None else gap(test["avg"], ta, experts_avg),
                params, n, round(float(summary.get("trial_wall_s", {}).get("mean", 0.0)) * n, 1),
                extra_parameters(method, params, width, n_tasks),
            ))
    return rows


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


def table_cells(rows: list[ComparisonRow], tasks: list[str]) -> tuple[list[str], list[list[str]]]:
    """Header and text cells, one line per (anchor, method): test per task, average, gaps closed, dev,
    search cost, extra parameters (accuracies in %, rounded once, here)."""
    head = ["anchor", "method", *tasks, "test avg", "gap closed", "vs TA", "dev avg", "search s", "extra params"]

    def pct(x: float | None) -> str:
        return "–" if x is None else f"{100 * x:.1f}"

    return head, [[r.anchor, r.method, *(pct(r.test.get(t)) for t in tasks), pct(r.test_avg), pct(r.gap_closed),
                   pct(r.gap_closed_vs_ta), pct(r.dev_avg), f"{r.search_s:.0f}" if r.trials else "–",
                   f"{r.extra_parameters:,}"] for r in rows]


def markdown_table(rows: list[ComparisonRow], tasks: list[str]) -> str:
    """`table_cells` as a Markdown table."""
    head, cells = table_cells(rows, tasks)
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    lines += ["| " + " | ".join(line) + " |" for line in cells]
    return "\n".join(lines) + "\n"
