"""The benchmark scripts of `make bench`, end to end on the tiny project.

Their figures mean something on the demo only (a benchmark measures alone, on an idle machine); here
they are only checked to be there and sane, so a script that stopped running is found by `make test`,
not by the next benchmark run (bench/calibration_cost.py once stopped at its merge when the demo's
anchor became a data method, cf41bc4).
"""

from __future__ import annotations

import json
import math
import subprocess
import sys
from pathlib import Path

from conftest import copy_project
from tiny_project import project_env

REPO = Path(__file__).resolve().parents[1]


def test_calibration_cost_runs_on_a_project_and_writes_the_median_of_its_repeats(tiny_project, tmp_path):
    project = copy_project(tiny_project.full, tmp_path / "project")
    out = tmp_path / "bench.json"
    done = subprocess.run([sys.executable, str(REPO / "bench" / "calibration_cost.py"), "--repeats", "3",
                           "--examples-per-task", "4", "--out", str(out)],
                          cwd=project, env=project_env(), capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, (done.stdout + done.stderr)[-4000:]
    figures = json.loads(out.read_text())
    cost = figures["calibration_cost"]
    assert cost["repeats"] == 3 and len(cost["ratios"]) == 3 and cost["examples_per_task"] == 4
    assert figures["featcal_over_forwards"] == round(sorted(cost["ratios"])[1], 3)   # the median repeat
    assert math.isfinite(figures["max_rel_diff_vs_float64"]) and 0 <= figures["max_rel_diff_vs_float64"] < 1e-3
    assert {"moments", "solve", "capture forwards", "advance forwards"} <= set(cost["phases_s"])
    assert "featcal_over_forwards" in done.stdout and "median of 3" in done.stdout
