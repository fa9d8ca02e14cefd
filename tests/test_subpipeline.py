"""The second pipelines in subfolders (mpnet/: all-mpnet-base-v2; llm/: Qwen2.5-Coder-1.5B): their
pipeline files are the root's, generated (never edited by hand), and their params pass the same checks
as the demo's. (Tiny projects in a subfolder run end to end in tests/test_pipeline_families.py; the real
checkpoints are never needed here.)"""

import sys

import pytest
import yaml

from tiny_project import ROOT

sys.path.insert(0, str(ROOT / "stages"))
import gen_pipeline  # noqa: E402
from params_schema import expected_chain, validate  # noqa: E402

# folder: (its model reference, the checkpoint's depth)
FOLDERS = {"mpnet": ("parts:all-mpnet-base-v2", 12), "llm": ("parts:qwen2.5-coder-1.5b", 28)}


@pytest.mark.parametrize("folder", FOLDERS)
def test_the_committed_pipeline_files_are_generated_from_the_roots(folder):
    sources = gen_pipeline.pipelines_of(ROOT / folder)
    for source in sources:
        committed = (ROOT / folder / source).read_text(encoding="utf-8")
        assert committed == gen_pipeline.render(ROOT, source, ROOT.joinpath(folder).relative_to(ROOT)), (
            f"{folder}/{source} is stale: run `python stages/gen_pipeline.py {folder}`")
    for source in set(gen_pipeline.PIPELINES) - set(sources):   # no comparison without `compare:` params
        assert not (ROOT / folder / source).exists(), f"{folder}/{source}: {folder}/params.yaml has no compare:"


def test_llm_gets_no_comparison_pipeline():
    assert gen_pipeline.pipelines_of(ROOT / "llm") == ("dvc.yaml",)
    assert gen_pipeline.pipelines_of(ROOT / "mpnet") == gen_pipeline.PIPELINES


@pytest.mark.parametrize("folder", FOLDERS)
def test_generated_stages_run_the_roots_scripts_and_keep_their_data_paths_in_the_folder(folder):
    stages = yaml.safe_load((ROOT / folder / "dvc.yaml").read_text())["stages"]
    root = yaml.safe_load((ROOT / "dvc.yaml").read_text())["stages"]
    assert list(stages) == list(root)
    merge = stages["merge"]
    assert merge["cmd"].startswith("python ../stages/merge.py")
    assert "../featcal/merging" in merge["deps"] and "experts" in merge["deps"] and "data/tasks" in merge["deps"]
    assert all(not d.startswith(("stages/", "featcal/")) for s in stages.values() for d in s.get("do", s).get("deps", []))


@pytest.mark.parametrize("folder", FOLDERS)
def test_the_params_pass_the_checks_and_match_the_committed_chain(folder):
    base, depth = FOLDERS[folder]
    raw = yaml.safe_load((ROOT / folder / "params.yaml").read_text())
    params = validate(raw, ROOT / folder, models=False)
    assert raw["model"]["base"] == base
    chain = yaml.safe_load((ROOT / folder / "stages/chain.yaml").read_text())
    expected = expected_chain(params, depth)
    assert chain["enabled_tasks"] == expected["enabled_tasks"]
    assert list(chain["layers"]) == expected["layers"] and chain["featcal_params"] == expected["featcal_params"]


def test_the_llm_project_is_language_modelling_with_lora_experts():
    raw = yaml.safe_load((ROOT / "llm/params.yaml").read_text())
    assert {spec["objective"] for spec in raw["tasks"].values()} == {"language_model"}
    assert len(raw["tasks"]) >= 3 and raw["finetune"]["lm"]["steps"] > 0
