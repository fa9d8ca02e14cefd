"""Real `dvc repro` on a tiny configuration, and which stages DVC re-runs when α changes."""

import json
import re
import sys

import pytest
import yaml

from tiny_project import make_project, run

pytestmark = pytest.mark.slow


def stages_run(output: str) -> set[str]:
    return set(re.findall(r"Running stage '([^']+)'", output))


def stages_skipped(output: str) -> set[str]:
    return set(re.findall(r"Stage '([^']+)' didn't change, skipping", output))


def test_dvc_repro_then_alpha_change_reruns_only_calibration_and_evaluate(tmp_path):
    project = make_project(tmp_path)
    first = run([sys.executable, "-m", "dvc", "repro"], project)
    expected = {"prepare", "finetune@sentiment", "finetune@topic", "merge", "collect-expert-features",
                "calibrate-layer@L00", "calibrate-layer@L01", "evaluate"}
    assert stages_run(first) == expected, first
    metrics = json.loads((project / "results/metrics.json").read_text())
    assert set(metrics) == {"experts", "merged", "featcal", "gap_closed"}
    assert set(metrics["featcal"]) == {"avg", "sentiment", "topic"}
    assert (project / "results/plots/drift.png").stat().st_size > 0
    assert len(json.loads((project / "results/drift.json").read_text())) == 2
    timing = json.loads((project / "results/timing.json").read_text())
    assert "calibrate-layer@L01" in timing and timing["calibrate-layer@L01"]["peak_rss_mib"] > 0
    before = (project / "calib/layers/L01.safetensors").read_bytes()

    params = yaml.safe_load((project / "params.yaml").read_text())
    params["featcal"]["alpha"] = 0.5
    (project / "params.yaml").write_text(yaml.safe_dump(params, sort_keys=False))
    second = run([sys.executable, "-m", "dvc", "repro"], project)
    assert stages_run(second) == {"calibrate-layer@L00", "calibrate-layer@L01", "evaluate"}, second
    assert {"prepare", "finetune@sentiment", "finetune@topic", "merge", "collect-expert-features"} <= stages_skipped(second)
    assert (project / "calib/layers/L01.safetensors").read_bytes() != before

    status = run([sys.executable, "-m", "dvc", "status"], project)
    assert "up to date" in status.lower(), status
