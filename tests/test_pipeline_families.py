"""The pipeline beyond BERT: real `dvc repro` on tiny projects whose base and experts are Llama or
T5 text classifiers, ViT image classifiers or CLIP vision towers with zero-shot heads (digit
images)."""

import json
import sys
from typing import Callable

import pytest
import torch
import yaml
from transformers import (CLIPVisionModelWithProjection, LlamaForSequenceClassification, MPNetForSequenceClassification,
                          T5ForSequenceClassification, ViTForImageClassification)

from conftest import DOWNSTREAM, DVC, UPSTREAM, stages_run
from featcal.data.encoders import load_encoder
from featcal.families.clip_zero_shot import CLIPVisionClassifier, load_text_tower, zero_shot_weight
from featcal.io.models import load_classifier, load_task_model
from featcal.data.splits import encode_batches, read_split
from tiny_project import (RULES, ROOT, image_tasks, make_causal_lm_base, make_clip_base, make_llama_base, make_mpnet_base,
                          make_project, make_t5_base,
                          make_tasks, make_vit_base, run, tiny_params)

sys.path.insert(0, str(ROOT / "stages"))
import common  # noqa: E402

pytestmark = pytest.mark.slow(15)

def check_family_project(root, tasks: dict, task_class: type, configure: Callable[[dict], None] | None = None,
                         folder: str | None = None, alpha_rerun: bool = False) -> None:
    """`dvc repro` of a tiny project on the base saved at `root/base`: the whole chain runs, the
    calibrated model's drift to the experts falls at every block, and `models/featcal` loads per task
    as `task_class` and scores what evaluate reported. `alpha_rerun`: then an alpha change re-runs
    only calibration and evaluation (which stages a params change re-runs is DVC's reading of
    dvc.yaml, the same for every family: test_pipeline checks it for BERT, and the MPNet test for
    a second pipeline in a subfolder).
    `configure(params)` edits the tiny project's params first; `folder`: the project is a second
    pipeline in that subfolder (stages/gen_pipeline.py), run from there."""
    params = tiny_params(root / "base", tasks)
    if configure is not None:
        configure(params)
    project = make_project(root, params, folder)
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

    if not alpha_rerun:
        return
    params["featcal"]["alpha"] = 0.5
    (project / "params.yaml").write_text(yaml.safe_dump(params, sort_keys=False))
    second = run([*DVC, "repro"], project)
    assert stages_run(second) == {"calibrate-layer@L00", "calibrate-layer@L01", "evaluate"}, second


def upstream_of(tasks: dict) -> set[str]:
    """The upstream stages of a project with these tasks (conftest's UPSTREAM names the text tasks')."""
    return {s for s in UPSTREAM if not s.startswith("finetune@")} | {f"finetune@{t}" for t in tasks}


def test_a_llama_project_runs_end_to_end(tmp_path):
    make_llama_base(tmp_path / "base")
    check_family_project(tmp_path, make_tasks(tmp_path / "raw"), LlamaForSequenceClassification)


def test_an_mpnet_project_in_a_subfolder_runs_end_to_end_and_an_alpha_change_reruns_only_the_calibration(tmp_path):
    """MPNet's shared position bias through the stored states of the chain, in a second pipeline
    whose dvc.yaml is generated from the root's (the layout of mpnet/)."""
    make_mpnet_base(tmp_path / "base")
    check_family_project(tmp_path, make_tasks(tmp_path / "raw"), MPNetForSequenceClassification, folder="sub",
                         alpha_rerun=True)


def test_a_vit_project_on_image_tasks_runs_end_to_end(tmp_path):
    make_vit_base(tmp_path / "base")
    check_family_project(tmp_path, image_tasks(), ViTForImageClassification)


def test_a_t5_project_runs_end_to_end(tmp_path):
    """An encoder block and a decoder block: the stored decoder states carry the encoder output."""
    make_t5_base(tmp_path / "base")
    check_family_project(tmp_path, make_tasks(tmp_path / "raw"), T5ForSequenceClassification)


def test_a_clip_project_with_zero_shot_heads_runs_end_to_end(tmp_path):
    """CLIP vision towers whose heads are CLIP's zero-shot heads, made from the class names by the
    CLIP text tower (`model.zero_shot.text_model`): frozen while the experts fine-tune, and given to
    an expert that comes as a bare tower without a head, as the merging papers' experts do."""
    make_clip_base(tmp_path / "base", tmp_path / "clip")
    tasks = image_tasks()
    text_model = str(tmp_path / "clip")
    check_family_project(tmp_path, tasks, CLIPVisionClassifier,
                         lambda params: params["model"]["zero_shot"].update(text_model=text_model))
    clip, tokenizer = load_text_tower(text_model)
    project = tmp_path / "project"

    def zero_shot(task: str) -> torch.Tensor:
        return zero_shot_weight(clip, tokenizer, json.loads((project / f"data/tasks/{task}/labels.json").read_text())["classes"])

    for task in tasks:   # each task's head: the zero-shot head of its class names, in the experts and the result
        for model in (load_classifier(str(project / "experts" / task)), load_task_model(project / "models/featcal", task)):
            assert torch.equal(model.classifier.weight, zero_shot(task)), task

    tower = CLIPVisionModelWithProjection.from_pretrained(project / "experts/magnitude")   # no classifier
    with torch.no_grad():
        tower.visual_projection.weight.mul_(2.0)   # told apart from the expert the pipeline made
    tower.save_pretrained(tmp_path / "tower")
    params = yaml.safe_load((project / "params.yaml").read_text())
    params["experts"]["paths"] = {"magnitude": str(tmp_path / "tower")}
    (project / "params.yaml").write_text(yaml.safe_dump(params, sort_keys=False))
    assert stages_run(run([*DVC, "repro", "--single-item", "finetune@magnitude"], project)) == {"finetune@magnitude"}
    given = load_classifier(str(project / "experts/magnitude"))
    assert torch.equal(given.classifier.weight, zero_shot("magnitude"))
    assert torch.equal(given.visual_projection.weight, tower.visual_projection.weight)


def test_zero_shot_heads_for_a_base_that_is_no_clip_vision_tower_are_refused_naming_the_key(tmp_path):
    make_clip_base(tmp_path / "clip_base", tmp_path / "clip")
    make_vit_base(tmp_path / "base")
    params = tiny_params(tmp_path / "base", image_tasks())
    params["model"]["zero_shot"]["text_model"] = str(tmp_path / "clip")
    (tmp_path / "params.yaml").write_text(yaml.safe_dump(params, sort_keys=False))
    with pytest.raises(SystemExit) as err:
        common.load_params(tmp_path / "params.yaml", check_chain=False)
    message = str(err.value.code)
    assert "model.zero_shot.text_model" in message and "'vit'" in message, message


def test_a_causal_lm_project_fine_tunes_lora_experts_and_reports_nll(tmp_path):
    """Language-model tasks on a tiny Qwen2 causal LM: LoRA experts, TA, FeatCal on every token; the
    scores are mean token NLLs, with the gap closed per task; the drift to the experts falls at every
    block, and models/featcal loads per task as a causal LM that scores what evaluate reported. (30
    LoRA steps on a 2-layer model teach it the texts' shape more than each domain: whether the gap
    closes is the real model's question, `make bench-llm`.)"""
    from featcal.evaluation.language import split_nll
    from transformers import Qwen2ForCausalLM

    make_causal_lm_base(tmp_path / "base")
    # two domains: each task's texts are made of its own words (an expert of one is no expert of the other)
    tasks = {**make_tasks(tmp_path / "raw_a", rules={"sentiment": RULES["sentiment"]}, filler=["the", "a"]),
             **make_tasks(tmp_path / "raw_b", rules={"topic": RULES["topic"]}, filler=["and", "news"])}
    for spec in tasks.values():
        spec["objective"] = "language_model"
    params = tiny_params(tmp_path / "base", tasks)
    params["finetune"]["lm"] = {"rank": 4, "steps": 30, "batch_size": 8, "learning_rate": 0.02,
                                "target_modules": ["q_proj", "v_proj", "down_proj"]}
    params["featcal"].update(alpha=0.25, rho=2.2, ridge=0.05)   # the spec's defaults (params.yaml's are the demo's)
    project = make_project(tmp_path, params)
    first = run([*DVC, "repro"], project)
    assert stages_run(first) == upstream_of(tasks) | DOWNSTREAM, first

    metrics = json.loads((project / "results/metrics.json").read_text())
    assert metrics["score"] == "nll"
    for task in tasks:   # nats per token, below a uniform guess over the 19 words and specials (ln 19 = 2.94)
        assert all(0 < metrics[model][task] < 2.9 for model in ("experts", "merged", "featcal")), metrics
    assert set(metrics["gap_closed_per_task"]) == set(tasks)
    drift = json.loads((project / "results/drift.json").read_text())
    assert all(row["featcal_l2"] < row["merged_l2"] for row in drift), drift
    encoder = load_encoder(str(project / "models/featcal"))
    for task in tasks:
        model = load_task_model(project / "models/featcal", task)
        assert isinstance(model, Qwen2ForCausalLM)
        test = read_split(project / "data/tasks", task, "test")
        assert round(split_nll(model, encoder, test, params["tokens"]["max_length"]), 4) == metrics["featcal"][task]
