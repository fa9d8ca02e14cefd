"""`make timings`: the last run's wall time and peak RSS per stage (results/timing.json), as a table.

Timings are DVC outputs, not metrics, so `dvc exp show` and `make metrics` show the params and the
accuracies a user compares; this is where the costs are read. Not a stage.

    python stages/timings.py results/timing.json
"""

from __future__ import annotations

import json
import sys
from pathlib import Path


def table(timing: dict) -> str:
    rows = [(stage, float(t["wall_s"]), float(t["peak_rss_mib"])) for stage, t in timing.items()]
    lines = ["| stage | wall s | peak RSS MiB |", "|---|---|---|"]
    lines += [f"| {stage} | {wall:.1f} | {rss:.0f} |" for stage, wall, rss in rows]
    lines.append(f"| all stages | {sum(r[1] for r in rows):.1f} | {max((r[2] for r in rows), default=0):.0f} (largest) |")
    return "\n".join(lines)


def main() -> None:
    path = Path(sys.argv[1] if len(sys.argv) > 1 else "results/timing.json")
    try:
        timing = json.loads(path.read_text())
        print(table(timing))
    except FileNotFoundError:
        raise SystemExit(f"timings: {path} does not exist: run `make repro` first") from None
    except (ValueError, KeyError, TypeError, AttributeError) as err:
        raise SystemExit(f"timings: {path} is not a timing file ({type(err).__name__}: {err})") from None


if __name__ == "__main__":
    main()
