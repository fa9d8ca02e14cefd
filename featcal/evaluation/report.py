"""One static HTML page of the results, to read offline: the headline metrics, the dev-tuned
comparison, every result plot and the papers'-defaults comparison.

The page holds everything it shows: each plot is a base64 `data:` image, the style sheet is inline,
there is no script and no external address, so it opens from disk with no network.
"""

from __future__ import annotations

import base64
import html
import json
import math
import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

# The result plots in page order: (path under the plots folder, a glob for a folder of them; caption).
PLOTS = (
    ("drift.png", "Per-layer drift to the experts on test examples, merged vs calibrated (stage evaluate)"),
    ("compare.png", "Average test accuracy per anchor merge: alone, + Surgery, + ProbSurgery, + FeatCal "
                    "(compare/dvc.yaml:compare)"),
    ("sample_efficiency.png", "Average test accuracy against calibration examples per task, Task Arithmetic "
                              "anchor (compare/dvc.yaml:sample-efficiency)"),
    ("corruption.png", "Calibration on corrupted texts, scored on clean test data (compare/dvc.yaml:corruption)"),
    ("sigmerge/*.png", "SigMerge's admitted coordinates, anchor {stem} (compare/dvc.yaml:sigmerge)"),
    ("compare_tuned_per_task.png", "Per task, test accuracy: the experts, the dev-best model's anchor alone, that "
                                   "model and the dev-best FeatCal pipeline (stages/compare_tuned.py)"),
    ("compare_tuned_featcal_history.png", "The dev-best FeatCal study of the comparison: each trial's average dev "
                                          "accuracy and the best so far (stages/compare_tuned.py)"),
    ("compare_tuned_featcal_importance.png", "Parameter importances of that study (stages/compare_tuned.py)"),
    ("tune_history.png", "Tuning history: each trial's average dev accuracy and the best so far (stage tune)"),
    ("tune_importance.png", "Parameter importances of the tuning study (stage tune)"),
)
METRIC_ROWS = (("experts", "experts (each on its own task)"), ("merged", "merged"), ("featcal", "+ FeatCal"))
COMPARE_METHODS = (("merged", "merge alone"), ("surgery", "+ Surgery"), ("probsurgery", "+ ProbSurgery"),
                   ("featcal", "+ FeatCal"))

STYLE = """
body { font-family: sans-serif; margin: 2em auto; max-width: 1100px; padding: 0 1em; color: #222; }
h1 { font-size: 1.6em; } h2 { font-size: 1.25em; margin-top: 2em; border-bottom: 1px solid #ccc; }
table { border-collapse: collapse; font-size: 0.9em; margin: 0.5em 0; }
th, td { border: 1px solid #ccc; padding: 0.25em 0.6em; text-align: right; }
th:first-child, td:first-child, th.name, td.name { text-align: left; }
div.wide { overflow-x: auto; }
thead th { background: #f2f2f2; } tr.head td { font-weight: bold; }
figure { margin: 1.5em 0; } figure img { max-width: 100%; border: 1px solid #ddd; }
figcaption { font-size: 0.9em; color: #555; margin-top: 0.3em; }
"""


def find_plots(plots_dir: str | os.PathLike) -> list[tuple[Path, str]]:
    """The result plots that exist under `plots_dir`, in page order, each with its caption."""
    root = Path(plots_dir)
    found = []
    for pattern, caption in PLOTS:
        for path in sorted(root.glob(pattern)):
            if path.is_file():
                found.append((path, caption.format(stem=path.stem)))
    return found


@dataclass(frozen=True)
class Table:
    """Text cells made elsewhere (the dev-tuned comparison's come from featcal.tuning.comparison)."""
    header: list[str]
    rows: list[list[str]]
    text_cols: int = 1                  # leading name columns, left-aligned
    bold: frozenset[int] = frozenset()  # rows that stand out


def _pct(value) -> str:
    return "" if value is None else f"{100 * float(value):.1f}"


def _table(header: list[str], rows: list[list[str]], text_cols: int = 1, bold: frozenset[int] = frozenset()) -> str:
    """An HTML table; the first `text_cols` columns are names (left-aligned), rows in `bold` stand out."""
    head = "".join(f'<th class="name">{html.escape(h)}</th>' if j < text_cols else f"<th>{html.escape(h)}</th>"
                   for j, h in enumerate(header))
    body = []
    for i, row in enumerate(rows):
        cells = "".join((f'<td class="name">{html.escape(c)}</td>' if j < text_cols else f"<td>{html.escape(c)}</td>")
                        for j, c in enumerate(row))
        body.append(f'<tr class="head">{cells}</tr>' if i in bold else f"<tr>{cells}</tr>")
    return f"<div class=\"wide\"><table><thead><tr>{head}</tr></thead><tbody>{''.join(body)}</tbody></table></div>"


def metrics_table(metrics: dict) -> str:
    """results/metrics.json: test accuracy (%) per task and on average, and the gap closed."""
    tasks = [t for t in metrics["experts"] if t not in ("avg", "gap_closed")]
    rows = [[label, *(_pct(metrics[key].get(t)) for t in tasks), _pct(metrics[key].get("avg"))]
            for key, label in METRIC_ROWS if key in metrics]
    gap = metrics.get("gap_closed")
    note = (f"<p>Gap closed: <b>{float(gap):.2f}</b> = (FeatCal − merged) / (experts − merged).</p>"
            if gap is not None else "")
    return _table(["model", *tasks, "avg"], rows, bold=frozenset({len(rows) - 1})) + note


def compare_table(compare: dict) -> str:
    """results/compare_defaults.json: per anchor the merge alone and each calibration, test accuracy (%), the
    gap closed and the wall time of the step."""
    experts = compare["experts"]
    tasks = [t for t in experts if t not in ("avg", "gap_closed")]
    rows = [["–", "experts", *(_pct(experts.get(t)) for t in tasks), _pct(experts["avg"]), "", ""]]
    for anchor, row in compare["anchors"].items():
        for key, label in COMPARE_METHODS:
            if key not in row:
                continue
            scores = row[key] if key == "merged" else row[key]["scores"]
            cost = row.get("merge_cost", {}) if key == "merged" else row[key].get("cost", {})
            gap = scores.get("gap_closed")
            rows.append([anchor, label, *(_pct(scores.get(t)) for t in tasks), _pct(scores["avg"]),
                         "" if gap is None else f"{float(gap):.2f}",
                         "" if cost.get("wall_s") is None else f"{float(cost['wall_s']):.1f}"])
    return _table(["anchor", "method", *tasks, "avg", "gap closed", "wall s"], rows, text_cols=2)


def figure(path: str | os.PathLike, caption: str) -> str:
    """One plot as an embedded image with its caption."""
    data = base64.b64encode(Path(path).read_bytes()).decode("ascii")
    alt = html.escape(caption, quote=True)
    return (f'<figure><img src="data:image/png;base64,{data}" alt="{alt}">'
            f"<figcaption>{html.escape(caption)} <code>{html.escape(Path(path).name)}</code></figcaption></figure>")


def render(metrics: dict, plots: list[tuple[str | os.PathLike, str]], compare: dict | None = None,
           title: str = "featcal results", tuned: Table | None = None) -> str:
    """The page: the headline metrics, the dev-tuned comparison when `tuned` is given, each plot in
    `plots` (path, caption) embedded, and the papers'-defaults comparison when `compare` is given."""
    parts = [f"<h1>{html.escape(title)}</h1>",
             "<h2>Headline: test accuracy (%), <code>results/metrics.json</code></h2>", metrics_table(metrics)]
    if tuned is not None:
        parts += ["<h2>Every method tuned on dev with the same budget, test read once: test accuracy (%), "
                  "<code>results/compare.json</code></h2>",
                  "<p>Each (anchor, method) at its study's dev-best configuration; gap closed = (method − anchor) / "
                  "(experts − anchor), vs TA the same of Task Arithmetic's gap; search s: the study's trials; "
                  "extra params: what the deployed model carries beyond the merged backbone. 95 % CI: paired "
                  "bootstrap interval of the test average (test examples resampled within each task, the same "
                  "resamples for every row); vs anchor's best: the difference to the anchor's best test row and "
                  "its interval, <b>n.s.</b> where the test split cannot tell the two apart. Bold: the rows dev "
                  "picks by the selection rule (rows whose dev difference to the dev-best is not significant are "
                  "tied; fewer added parameters, then less search time wins), overall and among the FeatCal "
                  "pipelines.</p>",
                  _table(tuned.header, tuned.rows, tuned.text_cols, tuned.bold)]
    if plots:
        parts += ["<h2>Plots</h2>", *(figure(p, c) for p, c in plots)]
    if compare is not None:
        parts += ["<h2>FeatCal vs Surgery vs ProbSurgery on each anchor at the papers' defaults: test accuracy (%), "
                  "<code>results/compare_defaults.json</code></h2>",
                  f"<p>Every method reads the same {html.escape(str(compare.get('examples_per_task', '')))} "
                  "unlabelled calibration examples per task; gap closed = (method − merge) / (experts − merge); "
                  "wall s: the merge's for the merge alone, else the method's.</p>",
                  compare_table(compare)]
    return ("<!DOCTYPE html>\n<html lang=\"en\"><head><meta charset=\"utf-8\">"
            '<meta name="viewport" content="width=device-width, initial-scale=1">'
            '<link rel="icon" href="data:,">'
            f"<title>{html.escape(title)}</title><style>{STYLE}</style></head>\n<body>\n"
            + "\n".join(parts) + "\n</body></html>\n")


def check_scores(scores, where: str) -> None:
    """A score map ({"avg", <task>: accuracy, ["gap_closed"]}): every accuracy a finite number in [0, 1]
    (a percentage or a NaN written by mistake would be shown as 9472.3 % or nan)."""
    if not isinstance(scores, Mapping) or not scores:
        raise ValueError(f"{where}: expected a mapping of accuracies, got {scores!r:.80}")
    for key, value in scores.items():
        if key == "gap_closed":
            if value is not None and not (isinstance(value, (int, float)) and not isinstance(value, bool)
                                          and math.isfinite(value)):
                raise ValueError(f"{where}.gap_closed = {value!r}: expected a finite number or null")
            continue
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0.0 <= value <= 1.0:
            raise ValueError(f"{where}.{key} = {value!r}: an accuracy must be a number in [0, 1]")


def read_results(path: str | os.PathLike, kind: str) -> dict:
    """A results file read and its scores checked: `kind` "metrics" (results/metrics.json) or
    "compare" (results/compare_defaults.json). Errors name the file and the key."""
    path = Path(path)
    try:
        data = json.loads(path.read_text())
    except (UnicodeDecodeError, json.JSONDecodeError) as err:
        raise ValueError(f"{path}: not valid JSON ({err})") from None
    if not isinstance(data, dict):
        raise ValueError(f"{path}: expected a JSON object, got {type(data).__name__}")
    try:
        if kind == "metrics":
            for key, _label in METRIC_ROWS:
                if key in data:
                    check_scores(data[key], key)
            if "experts" not in data:
                raise ValueError("no 'experts' scores")
            check_scores({"gap_closed": data.get("gap_closed")}, "")
        else:
            check_scores(data.get("experts"), "experts")
            for anchor, row in (data.get("anchors") or {}).items():
                check_scores(row.get("merged"), f"anchors.{anchor}.merged")
                for key, _label in COMPARE_METHODS:
                    if key in row and key != "merged":
                        check_scores(row[key].get("scores"), f"anchors.{anchor}.{key}.scores")
    except (ValueError, AttributeError, TypeError) as err:
        raise ValueError(f"{path}: {err}") from None
    return data


def write_report(out: str | os.PathLike, metrics: str | os.PathLike, plots_dir: str | os.PathLike,
                 compare: str | os.PathLike | None = None,
                 extra_plots: Sequence[tuple[str | os.PathLike, str]] = (), tuned: Table | None = None) -> Path:
    """Read the results at these paths and write the page to `out` (atomically); a `compare` path
    that does not exist leaves the comparison out; `extra_plots` (path, caption) follow the result
    plots; `tuned` is the dev-tuned comparison's table. Returns `out`."""
    metrics_path = Path(metrics)
    if not metrics_path.is_file():
        raise FileNotFoundError(f"no metrics at {metrics_path}: run the pipeline first (make repro)")
    compare_data = None
    if compare is not None and Path(compare).is_file():
        compare_data = read_results(compare, "compare")
    page = render(read_results(metrics_path, "metrics"), [*find_plots(plots_dir), *extra_plots], compare_data,
                  tuned=tuned)
    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_name(f".{out.name}.tmp")
    tmp.write_text(page, encoding="utf-8")
    os.replace(tmp, out)
    return out
