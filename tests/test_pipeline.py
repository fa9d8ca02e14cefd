"""Real `dvc repro` on a tiny configuration, and which stages DVC re-runs when α changes."""

import json
import re
import shutil
import sys

import pytest
import torch
import yaml
from safetensors.torch import load_file

from featcal.calibrate import FeatCalConfig, calibrate
from featcal.data import batches_from_arrays
from featcal.modeling import load_backbone, load_classifier
from featcal.store import read_group

from conftest import UPSTREAM, copy_project, stages_run, stages_skipped
from tiny_project import run

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def project(tiny_project, tmp_path_factory):
    """A copy of the session's tiny project after its `dvc repro` (and the output of the two runs
    that reproduced it: `dvc repro merge collect-expert-features`, then `dvc repro`)."""
    project = copy_project(tiny_project.full, tmp_path_factory.mktemp("pipeline") / "project")
    return project, (tiny_project.upstream_output, tiny_project.full_output)


def test_dvc_repro_then_alpha_change_reruns_only_calibration_and_evaluate(project):
    project, (upstream, first) = project
    expected = {"prepare", "finetune@sentiment", "finetune@topic", "merge", "collect-expert-features",
                "collect-test-features", "evaluate-merged", "calibrate-layer@L00", "calibrate-layer@L01", "evaluate"}
    # every stage ran once: the upstream part first, the plain `dvc repro` ran the rest and skipped it
    assert stages_run(upstream) == UPSTREAM, upstream
    assert stages_run(first) == expected - UPSTREAM and UPSTREAM <= stages_skipped(first), first
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
    assert {"prepare", "finetune@sentiment", "finetune@topic", "merge", "collect-expert-features",
            "collect-test-features", "evaluate-merged"} <= stages_skipped(second)
    assert (project / "calib/layers/L01.safetensors").read_bytes() != before

    status = run([sys.executable, "-m", "dvc", "status", "dvc.yaml"], project)
    assert "up to date" in status.lower(), status


def test_the_dvc_chain_equals_one_in_process_calibration_bit_for_bit(project):
    project, _ = project
    params = yaml.safe_load((project / "params.yaml").read_text())
    tasks = list(params["tasks"])
    batches = batches_from_arrays(read_group(project / "features/experts/inputs.zarr"), params["calibration"]["batch_size"])
    merged = load_backbone(str(project / "models/merged"))
    in_process = calibrate(merged, load_backbone(params["model"]["base"]),
                           {t: load_classifier(str(project / "experts" / t)) for t in tasks}, batches,
                           FeatCalConfig.from_mapping(params["featcal"]), progress=False).backbone.state_dict()
    chain = {}
    for path in sorted((project / "calib/layers").glob("L*.safetensors")):
        chain.update(load_file(path))
    assert len(chain) == sum(1 for n in in_process if n.startswith("encoder.layer."))
    for name, value in chain.items():
        assert torch.equal(value, in_process[name]), name


def test_a_stage_is_out_of_date_when_library_code_it_runs_changes(project):
    project, _ = project
    family = project / "featcal/families/bert.py"
    original = family.read_text()
    try:
        family.write_text(original + "\n# an edit\n")
        status = run([sys.executable, "-m", "dvc", "status", "dvc.yaml"], project)
    finally:
        family.write_text(original)
    changed = set(re.findall(r"^(\S+):\s*$", status, flags=re.M))
    assert {"calibrate-layer@L00", "calibrate-layer@L01", "collect-expert-features", "evaluate"} <= changed, status


def test_compare_stages_write_their_results_outside_the_default_run(project):
    project, first = project
    assert not (project / "results/compare.json").exists()
    out = run([sys.executable, "-m", "dvc", "repro", "compare/dvc.yaml"], project)
    assert stages_run(out) == {f"compare/dvc.yaml:{s}" for s in ("compare", "sample-efficiency", "corruption", "sigmerge")}, out
    compare = json.loads((project / "results/compare.json").read_text())
    assert set(compare["anchors"]) == {"average", "task_arithmetic", "ties"}
    for anchor in compare["anchors"].values():
        assert set(anchor) >= {"merged", "featcal", "surgery", "probsurgery"}
        assert anchor["featcal"]["cost"]["wall_s"] > 0 and anchor["surgery"]["cost"]["peak_rss_mib"] > 0
        assert set(anchor["featcal"]["scores"]) >= {"avg", "gap_closed", "sentiment", "topic"}
    curve = json.loads((project / "results/sample_efficiency.json").read_text())
    assert [row["examples_per_task"] for row in curve] == [4, 16]
    corruption = json.loads((project / "results/corruption.json").read_text())
    assert set(corruption["corrupted"]) == {"typos", "word_dropout", "word_shuffle"}
    assert (project / "results/plots/sample_efficiency.png").stat().st_size > 0
    table = json.loads((project / "results/sigmerge.json").read_text())
    for anchor in ("task_arithmetic", "ties"):
        rows = table["anchors"][anchor]
        assert {"anchor", "sigmerge", "anchor+featcal", "sigmerge+featcal"} <= set(rows)
        assert rows["chosen_on_dev"]["c_max"] in (0.05, 0.3)
        assert (project / f"results/plots/sigmerge/{anchor}.png").exists()


def test_sigmerge_as_the_pipeline_merge_feeds_the_calibration_chain(project):
    project, _ = project
    params = yaml.safe_load((project / "params.yaml").read_text())
    params["merge"] = {"method": "sigmerge", "options": {"anchor": "task_arithmetic", "anchor_options": {"scale": 0.3},
                                                         "c_min": 0.02, "c_max": 0.2, "shared_examples_per_task": 4}}
    (project / "params.yaml").write_text(yaml.safe_dump(params, sort_keys=False))
    out = run([sys.executable, "-m", "dvc", "repro"], project)
    ran = stages_run(out)
    assert "merge" in ran and "collect-expert-features" not in ran, out
    record = json.loads((project / "results/merge/record.json").read_text())
    assert set(record["domains"]) == {"sentiment", "topic"} and len(record["blocks"]) == 2
    assert (project / "results/merge/admitted.png").stat().st_size > 0
    chain = {"calibrate-layer@L00", "calibrate-layer@L01", "evaluate"}
    if record["total_admitted"] > 0:
        assert chain <= ran, out  # a new merged model: the whole chain re-runs on it
    else:
        # nothing admitted: SigMerge returned the anchor bit for bit, so DVC sees the same merged
        # model (the TA merge it replaced) and keeps the calibration
        assert not chain & ran, out


def test_stages_under_torchrun_give_the_one_process_weights_in_float64(project, tmp_path):
    """collect-expert-features and calibrate-layer with parallel.nproc_per_node 2 (each stage
    re-launches itself under torchrun, gloo) equal the 1-process run to 1e-9 (see test_distributed
    for why float64 and this tolerance)."""
    project, _ = project
    work = tmp_path / "p64"
    shutil.copytree(project, work, symlinks=True, ignore=shutil.ignore_patterns(".dvc", ".git"))
    params = yaml.safe_load((work / "params.yaml").read_text())
    tasks = list(params["tasks"])
    load_backbone(params["model"]["base"]).double().save_pretrained(work / "base64")
    load_backbone(str(project / "models/merged")).double().save_pretrained(work / "models/merged")
    for t in tasks:
        load_classifier(str(project / "experts" / t)).double().save_pretrained(work / "experts" / t)
    params["model"]["base"] = str(work / "base64")
    params["cache"]["dtype"] = "float64"

    def run_stages(nproc: int) -> dict:
        params["parallel"]["nproc_per_node"] = nproc
        (work / "params.yaml").write_text(yaml.safe_dump(params, sort_keys=False))
        run([sys.executable, "stages/collect_expert_features.py", "--split", "train", "--experts", "experts",
             "--out", "features/experts"], work)
        state = {}
        for k in range(2):
            out = run([sys.executable, "stages/calibrate_layer.py", "--layer", str(k), "--merged", "models/merged",
                       "--experts", "experts", "--features", "features/experts",
                       "--student-in", "models/merged" if k == 0 else f"calib/student/layer_{k:02d}.zarr",
                       "--layer-out", f"calib/layers/L{k:02d}.safetensors", "--moments-out", f"calib/moments/L{k:02d}.zarr",
                       "--student-out", f"calib/student/layer_{k + 1:02d}.zarr"], work)
            state.update(load_file(work / f"calib/layers/L{k:02d}.safetensors"))
        return state, out

    one, _ = run_stages(1)
    two, log = run_stages(2)
    assert "(2 processes)" in log, log
    assert set(one) == set(two) and all(v.dtype == torch.float64 for v in one.values())
    for name in one:
        assert torch.allclose(two[name], one[name], rtol=1e-9, atol=1e-9), name
