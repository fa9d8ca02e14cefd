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
