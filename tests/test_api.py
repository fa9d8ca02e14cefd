"""The README's Python API: merge, calibrate, save, and load a task model back."""

import torch
from transformers import AutoModel

from featcal import FeatCalConfig, calibrate, load_task_model, merge_models, save_multitask
from conftest import batches_for, perturbed, tiny_bert


def test_merge_calibrate_save_and_load_round_trip(tmp_path):
    base = tiny_bert()
    experts = {t: perturbed(base, i + 1, scale=0.1, encoder_only=True) for i, t in enumerate(["a", "b"])}
    merged = merge_models(base, experts, "task_arithmetic", {"scale": 0.3})
    result = calibrate(merged, base, experts, batches_for(experts), FeatCalConfig(), progress=False)
    save_multitask(tmp_path / "model", result.backbone, experts)

    reloaded_backbone = AutoModel.from_pretrained(tmp_path / "model")
    batch = batches_for(["a"])["a"][0]
    with torch.no_grad():
        assert torch.equal(reloaded_backbone(**batch).last_hidden_state, result.backbone(**batch).last_hidden_state)
        task_model = load_task_model(tmp_path / "model", "b")
        expected = experts["b"].classifier(result.backbone(**batch).pooler_output)
        assert torch.equal(task_model(**batch).logits, expected)
