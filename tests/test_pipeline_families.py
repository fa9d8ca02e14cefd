"""The pipeline beyond BERT: real `dvc repro` on tiny projects whose base and experts are Llama or
T5 text classifiers or ViT image classifiers (digit images), and a CLIP vision tower base, which
has no task model to fine-tune, refused before anything runs."""

import json
import sys

import pytest
import torch
import yaml
from transformers import (CLIPVisionConfig, CLIPVisionModelWithProjection, LlamaForSequenceClassification,
                          T5ForSequenceClassification, ViTForImageClassification)

from conftest import DOWNSTREAM, DVC, UPSTREAM, stages_run
from featcal.data.encoders import load_encoder
from featcal.io.models import load_task_model
from featcal.data.splits import encode_batches, read_split
from tiny_project import (ROOT, image_tasks, make_llama_base, make_project, make_t5_base, make_tasks, make_vit_base, run,
                          tiny_params)

sys.path.insert(0, str(ROOT / "stages"))
import common  # noqa: E402

pytestmark = pytest.mark.slow

def check_family_project(root, tasks: dict, task_class: type) -> None:
    """`dvc repro` of a tiny project on the base saved at `root/base`: the whole chain runs, the
    calibrated model's drift to the experts falls at every block, `models/featcal` loads per task as
    `task_class` and scores what evaluate reported, and an alpha change re-runs only calibration
    and evaluation."""
    project = make_project(root, tiny_params(root / "base", tasks))
    first = run([*DVC, "repro"], project)
    assert stages_run(first) == upstream_of(tasks) | DOWNSTREAM, first   # the whole chain

    drift = json.loads((project / "results/drift.json").read_text())
    assert [row["layer"] for row in drift] == [0, 1]
    assert all(row["featcal_l2"] < row["merged_l2"] for row in drift), drift

    metrics = json.loads((project / "results/metrics.json").read_text())
    params = yaml.safe_load((project / "params.yaml").read_text())
    encoder = load_encoder(str(project / "models/featcal"))
    for task in tasks:
        model = load_task_model(project / "models/featcal", task)
        assert isinstance(model, task_class)
        test = read_split(project / "data/tasks", task, "test")
        with torch.no_grad():
            preds = torch.cat([model(**b).logits.argmax(-1) for b in
                               encode_batches(encoder, test.examples, params["tokens"]["max_length"], 64)])
        assert round(float((preds == test.labels).float().mean()), 4) == metrics["featcal"][task]

    params["featcal"]["alpha"] = 0.5
    (project / "params.yaml").write_text(yaml.safe_dump(params, sort_keys=False))
    second = run([*DVC, "repro"], project)
    assert stages_run(second) == {"calibrate-layer@L00", "calibrate-layer@L01", "evaluate"}, second


def upstream_of(tasks: dict) -> set[str]:
    """The upstream stages of a project with these tasks (conftest's UPSTREAM names the text tasks')."""
    return {s for s in UPSTREAM if not s.startswith("finetune@")} | {f"finetune@{t}" for t in tasks}


def test_a_llama_project_runs_end_to_end_and_an_alpha_change_reruns_only_the_calibration(tmp_path):
    make_llama_base(tmp_path / "base")
    check_family_project(tmp_path, make_tasks(tmp_path / "raw"), LlamaForSequenceClassification)


def test_a_vit_project_on_image_tasks_runs_end_to_end_and_an_alpha_change_reruns_only_the_calibration(tmp_path):
    make_vit_base(tmp_path / "base")
    check_family_project(tmp_path, image_tasks(), ViTForImageClassification)


def test_a_t5_project_runs_end_to_end_and_an_alpha_change_reruns_only_the_calibration(tmp_path):
    """An encoder block and a decoder block: the stored decoder states carry the encoder output."""
    make_t5_base(tmp_path / "base")
    check_family_project(tmp_path, make_tasks(tmp_path / "raw"), T5ForSequenceClassification)


def test_a_clip_vision_tower_base_is_refused_naming_the_key_and_where_zero_shot_heads_are_built(tmp_path):
    config = CLIPVisionConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                              image_size=8, patch_size=2, projection_dim=16)
    CLIPVisionModelWithProjection(config).save_pretrained(tmp_path / "clip")
    (tmp_path / "params.yaml").write_text(yaml.safe_dump(tiny_params(tmp_path / "clip", image_tasks()), sort_keys=False))
    with pytest.raises(SystemExit) as err:
        common.load_params(tmp_path / "params.yaml", check_chain=False)
    message = str(err.value.code)
    assert "model.base" in message and "'clip_vision_model'" in message and "clip_zero_shot" in message, message
