"""The base-size pipeline in mpnet/: its pipeline files are the root's, generated (never edited by
hand), and its params pass the same checks as the demo's. (A tiny MPNet project in a subfolder runs
end to end in tests/test_pipeline_families.py; the real checkpoint is never needed here.)"""

import sys

import yaml

from tiny_project import ROOT

sys.path.insert(0, str(ROOT / "stages"))
import gen_pipeline  # noqa: E402
from params_schema import expected_chain, validate  # noqa: E402

FOLDER = "mpnet"


def test_the_committed_pipeline_files_are_generated_from_the_roots():
    for source in gen_pipeline.PIPELINES:
        committed = (ROOT / FOLDER / source).read_text(encoding="utf-8")
        assert committed == gen_pipeline.render(ROOT, source, ROOT.joinpath(FOLDER).relative_to(ROOT)), (
            f"{FOLDER}/{source} is stale: run `python stages/gen_pipeline.py {FOLDER}`")


def test_generated_stages_run_the_roots_scripts_and_keep_their_data_paths_in_the_folder():
    stages = yaml.safe_load((ROOT / FOLDER / "dvc.yaml").read_text())["stages"]
    root = yaml.safe_load((ROOT / "dvc.yaml").read_text())["stages"]
    assert list(stages) == list(root)
    merge = stages["merge"]
    assert merge["cmd"].startswith("python ../stages/merge.py")
    assert "../featcal/merging" in merge["deps"] and "experts" in merge["deps"] and "data/tasks" in merge["deps"]
    assert all(not d.startswith(("stages/", "featcal/")) for s in stages.values() for d in s.get("do", s).get("deps", []))


def test_the_mpnet_params_pass_the_checks_and_match_the_committed_chain():
    raw = yaml.safe_load((ROOT / FOLDER / "params.yaml").read_text())
    params = validate(raw, ROOT / FOLDER, models=False)
    assert raw["model"]["base"] == "parts:all-mpnet-base-v2"
    chain = yaml.safe_load((ROOT / FOLDER / "stages/chain.yaml").read_text())
    expected = expected_chain(params, 12)   # all-mpnet-base-v2: 12 blocks
    assert chain["enabled_tasks"] == expected["enabled_tasks"]
    assert list(chain["layers"]) == expected["layers"] and chain["featcal_params"] == expected["featcal_params"]
