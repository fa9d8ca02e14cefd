"""The dev-tuned comparison table from the studies' summaries (not a stage; run after the studies).

Every `<anchor>_<method>.json` in --studies (`stages/tune.py --method <method> --score-test
--summary ...`, anchor a registry name of `compare.anchors`, method featcal | surgery | probsurgery)
becomes a row next to its anchor alone (test scores from the `compare` stage's JSON, same options);
writes the rows as JSON ({anchor: {method: ...}}, and which row dev picks) and as a Markdown table,
a per-task plot of the experts, the dev-best model's anchor and that model, and the dev-best FeatCal
study's history and parameter importances.

    python stages/compare_tuned.py
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import subprocess
from pathlib import Path

import optuna
from common import enabled_tasks, get, load_params

from featcal.evaluation.plots import plot_grouped_bars, plot_study
from featcal.io.models import write_json
from featcal.evaluation.predictions import read_correctness
from featcal.tuning.comparison import (
    COMPARED, FEATCAL_PIPELINES, as_mapping, comparison_rows, detectable, dev_best, markdown_table, per_task_groups,
    search_of, significance_markdown, with_uncertainty,
)


def written_by(path: Path) -> dict:
    """The commit that last wrote a summary into the repository (its search ran on the code just before it),
    or "uncommitted" while the file differs from HEAD: rows of other code versions say which."""
    def git(*args: str) -> subprocess.CompletedProcess:
        return subprocess.run(["git", *args], capture_output=True, text=True, cwd=path.parent)
    if git("diff", "--quiet", "HEAD", "--", path.name).returncode != 0 or git("ls-files", "--error-unmatch", path.name).returncode:
        return {"commit": "uncommitted"}
    commit, _, date = git("log", "-1", "--format=%h %cs", "--", path.name).stdout.strip().partition(" ")
    return {"commit": commit or "unknown", "date": date or None}


def with_rescored_scores(studies: dict, predictions: Path) -> dict:
    """A study whose dev-best model, rebuilt by `tune_anchor.py --rescore`, does not reproduce its
    record (its method's code changed since the study ran) is reported with the rebuilt model's dev
    and test scores, the ones its predictions give, and marked `rescored`."""
    record = predictions / "rescored.json"
    checks = json.loads(record.read_text()) if record.exists() else {}
    out = dict(studies)
    for (anchor, method), summary in studies.items():
        check = checks.get(f"{anchor}/{method}")
        if check is None or (check["dev_matches"] and check["test_matches"] and check["same_trial"]):
            continue
        again = json.loads((predictions / "rescored" / f"{anchor}_{method}.json").read_text())
        out[(anchor, method)] = {**summary, "test": again["test"], "rescored": True, "rescored_dev": again["rescored_dev"],
                                 "best": {**summary["best"], "dev_avg": again["rescored_dev"]["dev"]}}
        print(f"compare_tuned: {anchor}/{method}: the rebuilt model does not reproduce study {summary['study']} "
              f"(test {summary['test']['avg']} -> {again['test']['avg']}); its rebuilt scores are reported")
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--studies", default="results/dev_tuning", help="folder of the studies' summaries")
    parser.add_argument("--alone", default="results/compare_defaults.json",
                        help="the compare stage's JSON: each anchor's test scores alone, and the experts'")
    parser.add_argument("--experts", default="experts", help="folder of the experts (their width)")
    parser.add_argument("--out", default="results/compare.json", help="where the rows (JSON) are written")
    parser.add_argument("--table", default="results/compare.md", help="where the Markdown table is written")
    parser.add_argument("--predictions", default="results/predictions",
                        help="the rows' per-example dev and test predictions (stages/tune_anchor.py --rescore): "
                             "every row gets a paired-bootstrap 95 %% interval and its difference to its anchor's "
                             "best row, and dev's pick follows the selection rule (docs/uncertainty.md)")
    parser.add_argument("--resamples", type=int, default=4000, help="bootstrap resamples (seed: params' seed)")
    parser.add_argument("--significance", default="results/compare_significance.md",
                        help="where the per-anchor picks, their significance and the splits' detectable differences go")
    parser.add_argument("--plots", default="results/plots",
                        help="folder of the plots: compare_tuned_per_task.png (experts, anchor, dev-best model per "
                             "task) and the dev-best FeatCal study's compare_tuned_featcal_{history,importance}.png")
    args = parser.parse_args()
    params = load_params()
    tasks = enabled_tasks(params)
    anchors = list(get(params, "compare.anchors"))
    studies, sources = {}, {}
    for anchor in anchors:
        for method in COMPARED[1:]:
            path = Path(args.studies) / f"{anchor}_{method}.json"
            if path.exists():
                studies[(anchor, method)] = json.loads(path.read_text())
                sources[(anchor, method)] = {"summary": str(path), **written_by(path),
                                             "search": search_of(studies[(anchor, method)])}
    if not studies:
        raise SystemExit(f"compare_tuned: no <anchor>_<method>.json summaries in {args.studies} "
                         f"(anchors {anchors}, methods {list(COMPARED[1:])})")
    studies = with_rescored_scores(studies, Path(args.predictions))
    compared = json.loads(Path(args.alone).read_text())
    alone = {a: compared["anchors"][a]["merged"] for a in anchors if a in compared.get("anchors", {})}
    width = json.loads((Path(args.experts) / tasks[0] / "config.json").read_text())["hidden_size"]
    try:
        rows = comparison_rows(compared["experts"]["avg"], alone, studies, width, len(tasks))
    except ValueError as err:
        raise SystemExit(f"compare_tuned: {err}") from None
    best, best_featcal = dev_best(rows), dev_best(rows, FEATCAL_PIPELINES)
    files = sorted(Path(args.predictions).glob("*.parquet"))
    if not files:
        raise SystemExit(f"compare_tuned: no predictions in {args.predictions}: run python stages/tune_anchor.py "
                         "<anchor> --rescore (and --sigmerge --rescore) for every anchor of the comparison")
    models = {(r.anchor, r.method): r.anchor if r.method == "alone" else studies[(r.anchor, r.method)]["study"]
              for r in rows}
    correct = {split: read_correctness(files, split) for split in ("dev", "test")}
    try:
        measured = with_uncertainty(rows, models, compared["experts"], correct["test"], correct["dev"],
                                    n_resamples=args.resamples, seed=int(get(params, "seed")))
    except ValueError as err:
        raise SystemExit(f"compare_tuned: {args.predictions}: {err}") from None
    rows = [dataclasses.replace(r, source=sources.get((r.anchor, r.method))) for r in measured.rows]
    resolved = {split: detectable(rows, models, correct[split]) for split in ("dev", "test")}
    Path(args.significance).write_text(significance_markdown(measured, resolved, tasks))
    chosen = {k: dict(zip(("anchor", "method"), measured.selection[k]["chosen"].split("/"))) for k in ("overall", "featcal")}
    write_json(args.out, {"experts": {**compared["experts"], "ci95": measured.experts_ci95}, "tasks": tasks,
                          "anchors": as_mapping(rows),
                          "dev_best": {"anchor": best.anchor, "method": best.method},
                          "dev_best_featcal": {"anchor": best_featcal.anchor, "method": best_featcal.method},
                          "selected": chosen, "selection": measured.selection,
                          "significant_vs_best": measured.significant_vs_best,
                          "detectable": resolved,
                          "bootstrap": {"resamples": measured.n_resamples, "seed": measured.seed, "level": 0.95,
                                        "paired": "test examples resampled within each task, the same for every row"}})
    Path(args.table).write_text(markdown_table(rows, tasks))
    plots = Path(args.plots)
    plot_grouped_bars(per_task_groups(rows, compared["experts"], tasks), plots / "compare_tuned_per_task.png",
                      "test accuracy (%)", title=f"chosen on dev: {best.anchor} + {best.method}")
    summary = studies[(best_featcal.anchor, best_featcal.method)]
    plot_study(optuna.load_study(study_name=summary["study"], storage=summary["storage"]),
               plots / "compare_tuned_featcal_history.png", plots / "compare_tuned_featcal_importance.png")
    print(markdown_table(rows, tasks))
    print(f"dev-best: {best.anchor} + {best.method} (test {best.test_avg}); "
          f"dev-best FeatCal: {best_featcal.anchor} + {best_featcal.method} (study {summary['study']})")
    for key in ("overall", "featcal"):
        print(f"selection rule, {key}: {measured.selection[key]['chosen']}: {measured.selection[key]['reason']}")


if __name__ == "__main__":
    main()
