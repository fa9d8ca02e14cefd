"""`make report`: one static HTML page of the results (featcal.evaluation.report), to open offline.

Reads the headline metrics (--metrics), the comparison (--compare, left out when the file does not
exist) and every result plot under --plots; writes the page to --out. Not a DVC stage: it only
re-reads what the stages wrote.
"""

from __future__ import annotations

import argparse

from featcal.evaluation.report import write_report


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--metrics", required=True, help="the headline metrics JSON (results/metrics.json)")
    parser.add_argument("--compare", help="the comparison JSON (results/compare.json), if it exists")
    parser.add_argument("--plots", required=True, help="the folder of result plots (results/plots)")
    parser.add_argument("--out", required=True, help="where the page is written (results/report.html)")
    args = parser.parse_args(argv)
    try:
        out = write_report(args.out, args.metrics, args.plots, args.compare)
    except FileNotFoundError as err:
        raise SystemExit(f"report: error: {err}") from None
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
