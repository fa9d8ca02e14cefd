"""Real `dvc repro` on a tiny configuration, and which stages DVC re-runs when α changes."""

import ast
import json
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import yaml
import zarr
from safetensors.torch import load_file

from featcal.calibration.config import FeatCalConfig
from featcal.calibration.walk import calibrate
from featcal.calibration.moments import LinearMoments, unpack_moments
from featcal.data.splits import batches_from_arrays
from featcal.io.models import load_backbone, load_classifier
from featcal.evaluation import compare as cmp
from featcal.io.feature_store import read_group
from featcal.merging import split_options
from featcal.merging.in_memory import merge_models

import featcal
from conftest import DVC, UPSTREAM, copy_project, stages_run, stages_skipped
from tiny_project import ROOT, project_env, run

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def project(tiny_project, tmp_path_factory):
    """A copy of the session's tiny project after its `dvc repro` (and the output of the two runs
    that reproduced it: `dvc repro merge collect-expert-features`, then `dvc repro`)."""
    project = copy_project(tiny_project.full, tmp_path_factory.mktemp("pipeline") / "project")
    return project, (tiny_project.upstream_output, tiny_project.full_output)


@pytest.mark.slow(7)
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
    # a calibrate-layer stage also says where its seconds went
    assert {"capture forwards", "moments", "solve", "advance forwards"} <= set(timing["calibrate-layer@L01"]["phases_s"])
    before = (project / "calib/layers/L01.safetensors").read_bytes()

    params = yaml.safe_load((project / "params.yaml").read_text())
    params["featcal"]["alpha"] = 0.5
    (project / "params.yaml").write_text(yaml.safe_dump(params, sort_keys=False))
    second = run([*DVC, "repro"], project)
    assert stages_run(second) == {"calibrate-layer@L00", "calibrate-layer@L01", "evaluate"}, second
    assert {"prepare", "finetune@sentiment", "finetune@topic", "merge", "collect-expert-features",
            "collect-test-features", "evaluate-merged"} <= stages_skipped(second)
    assert (project / "calib/layers/L01.safetensors").read_bytes() != before

    status = run([*DVC, "status", "dvc.yaml"], project)
    assert "up to date" in status.lower(), status


def calibrated_prefixes(params: dict) -> tuple[str, ...]:
    """The tiny BERT's parameters the chain writes: every block's, and the pooler's when calibrated."""
    return ("encoder.layer.", "pooler.") if params["featcal"]["calibrate_pooler"] else ("encoder.layer.",)


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
    assert len(chain) == sum(1 for n in in_process if n.startswith(calibrated_prefixes(params)))
    for name, value in chain.items():
        assert torch.equal(value, in_process[name]), name


def test_a_block_keeps_its_moment_sums_only_when_asked_and_they_leave_the_weights_unchanged(project, tmp_path):
    """cache.moments false (the default): calib/moments/Lkk.zarr is the block's record alone (its
    solves); true: also every task's float64 sums, one row per task, unpacking to each solved module."""
    project, _ = project
    record = zarr.open_group(str(project / "calib/moments/L00.zarr"), mode="r")
    assert read_group(project / "calib/moments/L00.zarr") == {}
    solves = record.attrs["solves"]
    linear = [s["module"].split(": ")[-1] for s in solves if s["kind"] == "linear"]   # "block 0: <module>"
    assert linear and all(s["condition"] > 0 for s in solves if s["kind"] == "linear")
    assert record.attrs["moments"].startswith("not kept")

    work = tmp_path / "kept"
    shutil.copytree(project, work, symlinks=True, ignore=shutil.ignore_patterns(".dvc", ".git"))
    params = yaml.safe_load((work / "params.yaml").read_text())
    params.setdefault("cache", {})["moments"] = True
    (work / "params.yaml").write_text(yaml.safe_dump(params, sort_keys=False))
    run([sys.executable, "stages/calibrate_layer.py", "--layer", "0", "--merged", "models/merged", "--experts", "experts",
         "--features", "features/experts", "--student-in", "models/merged", "--layer-out", "L00.safetensors",
         "--moments-out", "L00.zarr", "--student-out", "layer_01.zarr"], work)
    assert (work / "L00.safetensors").read_bytes() == (project / "calib/layers/L00.safetensors").read_bytes()
    kept = zarr.open_group(str(work / "L00.zarr"), mode="r")
    packed = read_group(work / "L00.zarr")["moments"]
    assert packed.dtype == torch.float64 and packed.shape == (len(params["tasks"]), kept.attrs["total"])
    sums = unpack_moments(packed, dict(kept.attrs))
    assert sorted(kept.attrs["tasks"]) == sorted(params["tasks"]) and kept.attrs["solves"] == solves
    assert {m for m in sums if isinstance(next(iter(sums[m].values())), LinearMoments)} == set(linear)


def read_tsv(path: Path) -> list[list[str]]:
    return [line.split("\t") for line in path.read_text().splitlines()]


def test_fine_tuning_logs_loss_and_dev_accuracy_per_epoch_through_dvclive(project):
    project, _ = project
    params = yaml.safe_load((project / "params.yaml").read_text())
    epochs = params["finetune"]["epochs"]
    for task in params["tasks"]:
        live = project / "results/live/finetune" / task
        dev = read_tsv(live / "plots/metrics/dev_accuracy.tsv")
        loss = read_tsv(live / "plots/metrics/train_loss.tsv")
        assert dev[0] == ["step", "dev_accuracy"] and loss[0] == ["step", "train_loss"]
        assert [int(row[0]) for row in dev[1:]] == [int(row[0]) for row in loss[1:]] == list(range(1, epochs + 1))
        assert all(float(row[1]) > 0 for row in loss[1:])
        # the last epoch's dev accuracy is the expert's dev score the stage records
        assert float(dev[-1][1]) == json.loads((project / f"results/experts/{task}.json").read_text())["dev"]
    # DVC reads them as the stages' metrics and plots (what `dvc exp show` and `dvc plots` draw from)
    def dvc_json(*args: str) -> dict:   # stdout only: DVC says on stderr that the compare results are absent
        out = subprocess.run([*DVC, *args, "--json"], cwd=project, env=project_env(),
                             capture_output=True, text=True, check=True)
        return json.loads(out.stdout)

    metrics = dvc_json("metrics", "show")[""]["data"]
    assert metrics["results/live/finetune/topic/metrics.json"]["data"]["step"] == epochs
    plots = dvc_json("plots", "show")["data"]
    assert {f"results/live/finetune/{t}/plots/metrics/{m}.tsv" for t in params["tasks"]
            for m in ("dev_accuracy", "train_loss")} <= set(plots)


def test_a_stage_is_out_of_date_when_library_code_it_runs_changes(project):
    project, _ = project
    family = project / "featcal/families/bert.py"
    original = family.read_text()
    try:
        family.write_text(original + "\n# an edit\n")
        status = run([*DVC, "status", "dvc.yaml"], project)
    finally:
        family.write_text(original)
    changed = set(re.findall(r"^(\S+):\s*$", status, flags=re.M))
    assert {"calibrate-layer@L00", "calibrate-layer@L01", "collect-expert-features", "evaluate"} <= changed, status


def test_bytecode_caches_in_the_code_a_stage_runs_leave_it_up_to_date(project):
    """A stage that imports featcal writes featcal/**/__pycache__/ (unless PYTHONDONTWRITEBYTECODE is
    set): .dvcignore keeps them out of the stages' featcal/... deps, or every stage that ran before
    one which imports another module would be out of date."""
    project, _ = project
    before = run([*DVC, "status", "dvc.yaml"], project)
    cache = project / "featcal/families/__pycache__"
    cache.mkdir(exist_ok=True)
    (cache / "planted.cpython-311.pyc").write_bytes(b"\x00" * 16)
    try:
        after = run([*DVC, "status", "dvc.yaml"], project)
    finally:
        (cache / "planted.cpython-311.pyc").unlink()
    assert after == before and "featcal/families" not in after, after


def code_run_by(script: Path) -> set[str]:
    """The project files a stage script may execute: it, the stage modules and the featcal modules it
    imports (anywhere in a module, function-level imports too), followed transitively, with the
    packages whose __init__ an import runs. Names `featcal` exports lazily resolve to their module.
    The params check (stages/params_schema.py) is not followed: it reads the option classes of every
    section to refuse a bad value, and can stop a stage but never change what it writes."""
    seen: set[str] = set()
    todo = [script]
    while todo:
        path = todo.pop()
        rel = str(path.relative_to(ROOT))
        if rel in seen:
            continue
        seen.add(rel)
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                names = [(alias.name, None) for alias in node.names]
            elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
                names = [(node.module, alias.name) for alias in node.names]
            else:
                continue
            for module, name in names:
                if module == "featcal" and name in featcal._EXPORTS:
                    module, name = featcal._EXPORTS[name], None
                parts = module.split(".")
                if parts[0] != "featcal":
                    local = ROOT / "stages" / f"{module}.py"   # a stage module (common, parallel, ...)
                    todo += [local] if len(parts) == 1 and local.exists() and module != "params_schema" else []
                    continue
                for k in range(1, len(parts) + 1):             # each package's __init__ runs, then the module
                    base = ROOT.joinpath(*parts[:k])
                    todo += [f for f in (base / "__init__.py", base.with_suffix(".py")) if f.exists()]
                if name is not None:                           # `from package import submodule`
                    sub = ROOT.joinpath(*parts, name)
                    todo += [f for f in (sub.with_suffix(".py"), sub / "__init__.py") if f.exists()]
    return seen


def pipeline_stages() -> dict[str, dict]:
    """Every stage of dvc.yaml and compare/dvc.yaml (a foreach stage once): its command and deps."""
    out = {}
    for dvc_file in ("dvc.yaml", "compare/dvc.yaml"):
        for name, stage in yaml.safe_load((ROOT / dvc_file).read_text())["stages"].items():
            stage = stage.get("do", stage)
            out[f"{dvc_file}:{name}"] = {"cmd": stage["cmd"], "deps": [str(d) for d in stage.get("deps", [])]}
    return out


def test_every_stage_lists_the_code_it_runs_among_its_deps():
    """DVC sees what a stage runs: each file the stage's script can execute lies under one of its deps."""
    stages = pipeline_stages()
    assert len(stages) >= 12, stages
    for name, stage in stages.items():
        script = ROOT / re.search(r"python (stages/\S+\.py)", stage["cmd"]).group(1)
        runs = code_run_by(script)
        assert any(f.startswith("featcal/") for f in runs), (name, runs)
        missing = sorted(f for f in runs if not any(f == d or f.startswith(d.rstrip("/") + "/") for d in stage["deps"]))
        assert not missing, f"{name}: deps miss {missing}"


@pytest.mark.slow(12)
def test_compare_stages_write_their_results_outside_the_default_run(project):
    project, first = project
    assert not (project / "results/compare_defaults.json").exists()
    out = run([*DVC, "repro", "compare/dvc.yaml"], project)
    assert stages_run(out) == {f"compare/dvc.yaml:{s}" for s in ("compare", "sample-efficiency", "corruption", "sigmerge")}, out
    compare = json.loads((project / "results/compare_defaults.json").read_text())
    assert set(compare["anchors"]) == {"average", "task_arithmetic", "ties"}
    for anchor in compare["anchors"].values():
        assert set(anchor) >= {"merged", "featcal", "surgery", "probsurgery"}
        assert anchor["featcal"]["cost"]["wall_s"] > 0 and anchor["surgery"]["cost"]["peak_rss_mib"] > 0
        assert set(anchor["featcal"]["scores"]) >= {"avg", "gap_closed", "sentiment", "topic"}
    curve = json.loads((project / "results/sample_efficiency.json").read_text())
    assert [row["examples_per_task"] for row in curve] == [4, 16]
    corruption = json.loads((project / "results/corruption.json").read_text())
    assert set(corruption["corrupted"]) == {"typos", "word_dropout", "word_shuffle"}
    for plot in ("compare", "sample_efficiency", "corruption"):       # each stage draws its own result
        assert (project / f"results/plots/{plot}.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n", plot
    table = json.loads((project / "results/sigmerge.json").read_text())
    for anchor in ("task_arithmetic", "ties"):
        rows = table["anchors"][anchor]
        assert {"anchor", "sigmerge", "anchor+featcal", "sigmerge+featcal"} <= set(rows)
        assert rows["chosen_on_dev"]["c_max"] in (0.05, 0.3)
        assert (project / f"results/plots/sigmerge/{anchor}.png").exists()


def test_the_comparison_runs_featcal_at_the_spec_defaults_not_at_the_default_pipelines_tuned_values():
    """compare/dvc.yaml is the papers'-defaults comparison: the dev-tuned `featcal` values of params.yaml
    (and per-block overrides) do not leak into it; its run settings and compare.featcal do."""
    sys.path.insert(0, str(ROOT / "stages"))
    import compare as compare_stage   # stages/compare.py

    spec = FeatCalConfig()
    tuned = {"alpha": 0.035, "rho": 2.64, "ridge": 0.015, "calibrate_pooler": True, "product_dtype": "float64",
             "layer_overrides": {0: {"alpha": 0.5}}, "use_tuned": False}
    config = compare_stage.compare_featcal(tuned, {})
    assert (config.alpha, config.rho, config.ridge, config.calibrate_pooler, config.layer_overrides) == (
        spec.alpha, spec.rho, spec.ridge, spec.calibrate_pooler, {})
    assert config.product_dtype == "float64"
    assert compare_stage.compare_featcal(tuned, {"alpha": 0.5, "calibrate_pooler": True}).for_layer(3).alpha == 0.5
    params = yaml.safe_load((ROOT / "params.yaml").read_text())
    ours = compare_stage.compare_featcal(params["featcal"], params["compare"]["featcal"])
    assert (ours.alpha, ours.rho, ours.ridge, ours.calibrate_pooler) == (0.25, 2.2, 0.05, False)


def test_sigmerge_as_the_pipeline_merge_feeds_the_calibration_chain(project):
    project, _ = project
    params = yaml.safe_load((project / "params.yaml").read_text())
    params["merge"] = {"method": "sigmerge", "options": {"anchor": "task_arithmetic", "anchor_options": {"scale": 0.3},
                                                         "c_min": 0.02, "c_max": 0.2, "shared_examples_per_task": 4}}
    (project / "params.yaml").write_text(yaml.safe_dump(params, sort_keys=False))
    out = run([*DVC, "repro"], project)
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


@pytest.mark.parametrize("method", ["regmean_plus_plus", "adamerging"])
def test_the_merge_stage_streams_a_data_method_and_equals_the_in_memory_merge(project, tmp_path, method):
    """RegMean++ / AdaMerging as the pipeline's merge: the stage reads the checkpoints block by block
    (lazy_merge) with train batches built from the task data alone, and writes the tensors that
    merge_models gives with the experts in memory and the same context."""
    project, _ = project
    work = tmp_path / "merge"
    shutil.copytree(project, work, symlinks=True, ignore=shutil.ignore_patterns(".dvc", ".git"))
    params = yaml.safe_load((work / "params.yaml").read_text())
    options = {"examples_per_task": 6, **({"steps": 2, "batches_per_step": 1} if method == "adamerging" else {})}
    params["merge"] = {"method": method, "options": options}
    (work / "params.yaml").write_text(yaml.safe_dump(params, sort_keys=False))
    out = run([sys.executable, "stages/merge.py", "--experts", "experts", "--out", "merged", "--record", "record"], work)
    assert f"with {method} -> merged" in out, out
    record = json.loads((work / "record/record.json").read_text())
    assert record["method"] == method and record["data"] == {"examples_per_task": 6}

    tasks = list(params["tasks"])
    bench = cmp.load_workbench(params["model"]["base"], {t: str(work / "experts" / t) for t in tasks},
                               str(work / params["tasks_dir"]), {t: 16 for t in tasks}, int(params["seed"]))
    merge_options, data = split_options(method, options)
    context = cmp.merge_context(bench, method, data)
    expected = merge_models(bench.base, bench.experts, method, merge_options, context).state_dict()
    streamed = load_backbone(str(work / "merged")).state_dict()
    assert list(streamed) == list(expected)
    for name in expected:
        torch.testing.assert_close(streamed[name], expected[name], rtol=1e-5, atol=1e-6, msg=name)


@pytest.mark.slow(11)
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

    def run_stages(nproc: int) -> tuple[dict, str]:
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

    two, log = run_stages(2)
    assert "(2 processes)" in log, log
    # the 1-process result: the chain's one-process stages equal the in-process walk bit for bit
    # (test_the_dvc_chain_equals_one_in_process_calibration_bit_for_bit), so the walk stands for them
    batches = batches_from_arrays(read_group(work / "features/experts/inputs.zarr"), params["calibration"]["batch_size"])
    in_process = calibrate(load_backbone(str(work / "models/merged")), load_backbone(params["model"]["base"]),
                           {t: load_classifier(str(work / "experts" / t)) for t in tasks}, batches,
                           FeatCalConfig.from_mapping(params["featcal"]), progress=False).backbone.state_dict()
    one = {name: in_process[name] for name in two}
    assert len(two) == sum(1 for n in in_process if n.startswith(calibrated_prefixes(params)))
    assert all(v.dtype == torch.float64 for v in one.values()) and all(v.dtype == torch.float64 for v in two.values())
    for name in one:
        assert torch.allclose(two[name], one[name], rtol=1e-9, atol=1e-9), name


def test_results_timing_lists_only_this_projects_stages(tmp_path, monkeypatch):
    """A project that brings its own tasks keeps the demo's committed timing files in results/timing/;
    results/timing.json lists only its own stages (and tune only where tuned values are used)."""
    sys.path.insert(0, str(ROOT / "stages"))
    import evaluate as evaluate_stage   # stages/evaluate.py

    timing = tmp_path / "results/timing"
    timing.mkdir(parents=True)
    for stage in ("finetune@bbc", "finetune@reviews", "calibrate-layer@L00", "calibrate-layer@L05", "merge",
                  "evaluate", "tune"):
        (timing / f"{stage}.json").write_text(json.dumps({"stage": stage, "wall_s": 1.0, "peak_rss_mib": 2.0}))
    monkeypatch.chdir(tmp_path)
    own = evaluate_stage.own_timings({"featcal": {"use_tuned": False}}, ["reviews"], ["L00"])
    assert set(own) == {"finetune@reviews", "calibrate-layer@L00", "merge", "evaluate"}
    assert "tune" in evaluate_stage.own_timings({"featcal": {"use_tuned": True}}, ["reviews"], ["L00"])
