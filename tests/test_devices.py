"""Every merge method and FeatCal compute on the device the models are on.

No CUDA here, so the check runs on a pair of devices: the models live on the CPU while the default
device is `meta`. A tensor made without naming a device then lands on `meta` and meets the models'
CPU tensors: an error (or a meta result) wherever code would, on a CUDA machine, have made a tensor
on the CPU next to models on the GPU. Host-side tensors that must stay on the CPU (seeded generators'
draws, row counts, histograms) name `device="cpu"` explicitly. Before this test, RegMean's Gram
solve, AdaMerging's λ, DARE's mask and FeatCal's solve all failed it.
"""

import pytest
import torch

from conftest import batches_for, perturbed, tiny_bert
from featcal import FeatCalConfig, calibrate, merge_models
from featcal.merging import MergeContext

METHODS = {"average": {}, "task_arithmetic": {}, "ties": {}, "dare": {}, "tsv_m": {}, "iso_c": {}, "iso_cts": {},
           "wudi": {"iterations": 3}, "regmean": {}, "regmean_plus_plus": {}, "adamerging": {"steps": 2}}


@pytest.fixture(scope="module")
def models():
    base = tiny_bert(layers=2)
    experts = {t: perturbed(base, i + 1, scale=0.01) for i, t in enumerate("ab")}
    return base, experts, batches_for(experts)


def on_cpu(module) -> bool:
    return all(t.device.type == "cpu" for t in module.state_dict().values())


@pytest.mark.parametrize("method", sorted(METHODS))
def test_a_merge_makes_no_tensor_off_the_models_device(models, method):
    base, experts, batches = models
    reference = merge_models(base, experts, method, METHODS[method], MergeContext(batches=batches)).state_dict()
    with torch.device("meta"):
        merged = merge_models(base, experts, method, METHODS[method], MergeContext(batches=batches))
    assert on_cpu(merged)
    assert all(torch.equal(merged.state_dict()[n], reference[n]) for n in reference)


def test_featcal_makes_no_tensor_off_the_models_device(models):
    base, experts, batches = models
    merged = merge_models(base, experts, "task_arithmetic", {"scale": 0.3})
    reference = calibrate(merged, base, experts, batches, FeatCalConfig(), progress=False).backbone.state_dict()
    with torch.device("meta"):
        result = calibrate(merged, base, experts, batches, FeatCalConfig(), progress=False)
    assert on_cpu(result.backbone)
    assert all(torch.equal(result.backbone.state_dict()[n], reference[n]) for n in reference)


class _Entered(Exception):
    """Stops the per-layer step once its streams are about to enter."""


def test_the_per_layer_step_computes_on_featcal_device(models, tmp_path, monkeypatch):
    """calibrate_cached_layer (a calibrate-layer stage) reads its block and the base's and experts' onto
    the device `featcal.device` resolves to, and moves the calibration batches there before they enter
    (it computed on the CPU whatever the setting). `meta` stands in for CUDA: the step is stopped where the
    streams enter, and what it holds by then is looked at."""
    from conftest import save_models
    from featcal.calibration import layerwise
    base, experts, batches = models
    save_models(tmp_path, {"base": base, "merged": merge_models(base, experts, "task_arithmetic", {"scale": 0.3}),
                           **experts})
    device = torch.device("meta")
    seen = {}

    def enter_streams(family, student, entering):
        seen["batches"] = {t.device for per_task in entering.values() for b in per_task for t in b.values()
                           if isinstance(t, torch.Tensor)}
        seen["student"] = {p.device for n, p in student.state_dict().items() if n.startswith("encoder.layer.1.")}
        seen["lazy"] = {b.device for b in [seen["weights"].base, *seen["weights"].experts.values()]}
        raise _Entered

    real_weights = layerwise.LazyWeights

    def weights(*args, **kwargs):
        seen["weights"] = real_weights(*args, **kwargs)
        return seen["weights"]

    monkeypatch.setattr(layerwise, "resolve_device", lambda name: device)
    monkeypatch.setattr(layerwise, "enter_streams", enter_streams)
    monkeypatch.setattr(layerwise, "LazyWeights", weights)
    # (leaving the block, the weights' buffers go back to the host: from meta they cannot, which is the
    # stand-in's error, not the step's)
    with pytest.raises((_Entered, NotImplementedError)):
        layerwise.calibrate_cached_layer(1, tmp_path / "merged", tmp_path / "base",
                                         {t: tmp_path / t for t in experts}, batches, None, lambda layer: {},
                                         FeatCalConfig(device="auto"))
    assert seen["batches"] == {device} and seen["student"] == {device} and seen["lazy"] == {device}
