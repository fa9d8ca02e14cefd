"""`make report`: one static HTML page of the results (featcal.evaluation.report), to open offline.

Reads the headline metrics (--metrics), the dev-tuned comparison (--tuned, results/compare.json of
stages/compare_tuned.py) and the papers'-defaults one (--compare), each left out when its file does not
exist, every result plot under --plots and, with --live, the DVCLive logs under that folder (one
sub-folder per run, e.g. results/live/finetune/<task>), drawn as one figure of curves; writes the
page to --out. Not a DVC stage: it only re-reads what the stages wrote.
"""

from __future__ import annotations

import argparse
import json
import tempfile
from pathlib import Path

from warm_start import start_stage

start_stage()   # the stage environment; returns unless a warm interpreter ran this stage (stages/warm_start.py)

from featcal.evaluation.report import Table, check_scores, write_report  # noqa: E402
from featcal.tuning.comparison import rows_from_mapping, table_cells  # noqa: E402

LIVE_CAPTION = "Fine-tuning, per task: train loss and dev accuracy per epoch (DVCLive, stage finetune)"


def read_live(folder: Path) -> dict[str, dict[str, list[tuple[int, float]]]]:
    """run -> metric -> [(step, value)] from DVCLive's `<run>/plots/metrics/<metric>.tsv` files."""
    curves: dict[str, dict[str, list[tuple[int, float]]]] = {}
    for tsv in sorted(folder.glob("*/plots/metrics/*.tsv")):
        rows = [line.split("\t") for line in tsv.read_text().splitlines()[1:] if line.strip()]
        curves.setdefault(tsv.parts[-4], {})[tsv.stem] = [(int(step), float(value)) for step, value in rows]
    return curves


def tuned_table(path: Path) -> Table | None:
    """results/compare.json as the page's table, the rows dev picks in bold; None when it does not exist."""
    if not path.is_file():
        return None
    try:
        compared = json.loads(path.read_text())
        rows = rows_from_mapping(compared["anchors"])
        for r in rows:   # test per task and average; dev where the row was searched
            check_scores({**r.test, **({"dev_avg": r.dev_avg} if r.dev_avg is not None else {})},
                         f"anchors.{r.anchor}.{r.method}")
        # the selection rule's picks on dev (docs/uncertainty.md), where the comparison has them
        chosen = list((compared.get("selected") or {}).values()) or [compared.get("dev_best"), compared.get("dev_best_featcal")]
        picks = {(p["anchor"], p["method"]) for p in chosen if p}
        header, cells = table_cells(rows, compared["tasks"])
    except (ValueError, KeyError, TypeError, AttributeError) as err:
        raise SystemExit(f"report: error: {path} is not stages/compare_tuned.py's comparison "
                         f"({type(err).__name__}: {err}); re-run python stages/compare_tuned.py") from None
    return Table(header, cells, text_cols=2,
                 bold=frozenset(i for i, r in enumerate(rows) if (r.anchor, r.method) in picks))


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--metrics", required=True, help="the headline metrics JSON (results/metrics.json)")
    parser.add_argument("--compare", help="the comparison JSON (results/compare_defaults.json), if it exists")
    parser.add_argument("--tuned", help="the dev-tuned comparison JSON (results/compare.json), if it exists")
    parser.add_argument("--plots", required=True, help="the folder of result plots (results/plots)")
    parser.add_argument("--live", help="a folder of DVCLive logs to draw (results/live/finetune), if it exists")
    parser.add_argument("--out", required=True, help="where the page is written (results/report.html)")
    args = parser.parse_args(argv)
    with tempfile.TemporaryDirectory() as tmp:
        extra = []
        curves = read_live(Path(args.live)) if args.live else {}
        if curves:
            from featcal.evaluation.plots import plot_training_curves   # matplotlib: only when there is a log

            plot_training_curves(curves, Path(tmp) / "finetune_curves.png")
            extra.append((Path(tmp) / "finetune_curves.png", LIVE_CAPTION))
        try:
            out = write_report(args.out, args.metrics, args.plots, args.compare, extra,
                               tuned=tuned_table(Path(args.tuned)) if args.tuned else None)
        except (FileNotFoundError, ValueError) as err:   # a missing, malformed or out-of-range results file
            raise SystemExit(f"report: error: {err}") from None
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
