"""Data-parallel calibration: torchrun with 2 processes (gloo, CPU) gives the single-process weights.

Tolerance. Each rank sums the float64 moments of its own examples and the all-reduce adds the two
partial sums, so the sums are the single-process ones in a different order: relative differences of
a few ulps (~1e-16) in the moments. The solve (Cholesky of Σω_i G_i + λI) can amplify them by the
condition number of that system (≈ 60 here; it compounds mildly layer after layer because the
next block sees the slightly different calibrated output). The models run in float64, so nothing
rounds these differences up to float32 ulps (~1e-7); we assert rtol = atol = 1e-9, about 1e6 times
the float64 epsilon and far below any difference calibration makes (weights move by ~1e-2).
Measured: max |Δ| = 4e-15. In float32 the runs would agree to a few float32 ulps (~1e-7) instead.
"""

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from transformers import AutoModel

from featcal import merge_models
from featcal.calibration.config import FeatCalConfig
from featcal.calibration.walk import calibrate
from featcal.calibration.distributed import (
    all_reduce_moments,
    calibrate_distributed,
    shard_batches,
    world_size,
    zero_moments,
)
from featcal.calibration.moments import LinearMoments, NormMoments
from conftest import perturbed, save_models, tiny_bert

RTOL = ATOL = 1e-9
ROOT = Path(__file__).resolve().parents[1]


def make_batches(counts, seed=0, bs=4, length=8):
    g = torch.Generator().manual_seed(seed)
    out = {}
    for task, n in counts.items():
        out[task] = []
        for i in range(n):
            mask = torch.ones(bs, length, dtype=torch.long)
            mask[i % bs, 3 + i % 4:] = 0
            out[task].append(dict(input_ids=torch.randint(1, 60, (bs, length), generator=g), attention_mask=mask))
    return out


def assert_close_states(a, b):
    assert list(a) == list(b)
    for name in a:
        torch.testing.assert_close(a[name], b[name], rtol=RTOL, atol=ATOL, msg=name)


def test_shard_batches_puts_every_batch_on_exactly_one_rank():
    batches = {"a": list(range(5)), "b": [10]}
    shards = [shard_batches(batches, r, 2) for r in range(2)]
    assert shards[0] == {"a": [0, 2, 4], "b": [10]} and shards[1] == {"a": [1, 3], "b": []}
    with pytest.raises(ValueError):
        shard_batches(batches, 2, 2)


def test_one_process_reduction_only_fills_missing_tasks_with_zeros():
    assert world_size() == 1
    lin, norm = torch.nn.Linear(3, 2), torch.nn.LayerNorm(3)
    m = LinearMoments()
    m.add(torch.randn(5, 3, dtype=torch.float64), torch.randn(5, 3, dtype=torch.float64))
    out = all_reduce_moments({"q": {"a": m}, "ln": {}}, {"q": lin, "ln": norm}, tasks=["a", "b"])
    assert out["q"]["a"] is m and list(out["q"]) == ["a", "b"]
    assert torch.equal(out["q"]["b"].student_gram, torch.zeros(3, 3, dtype=torch.float64))
    assert isinstance(out["ln"]["a"], NormMoments) and float(out["ln"]["b"].count) == 0.0
    assert zero_moments(norm).first.shape == (3,)


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    root = tmp_path_factory.mktemp("dist")
    base = tiny_bert(layers=3, dtype=torch.float64)
    experts = {t: perturbed(base, i + 1) for i, t in enumerate(["a", "b", "c"])}
    merged = merge_models(base, experts, "task_arithmetic", {"scale": 0.3})
    save_models(root, {"base": base, "merged": merged, **experts})
    # 3 batches of a (rank 0 gets 2, rank 1 gets 1), 2 of b, 1 of c (rank 1 has no example of c)
    batches = make_batches({"a": 3, "b": 2, "c": 1})
    torch.save(batches, root / "batches.pt")
    config = FeatCalConfig(calibrate_pooler=True)
    single = calibrate(merged, base, experts, batches, config, progress=False)
    return dict(root=root, base=base, experts=experts, merged=merged, batches=batches, config=config, single=single)


def test_one_process_data_parallel_path_is_exactly_calibrate(saved):
    s = saved
    result = calibrate_distributed(s["merged"], s["batches"], s["config"], base=s["base"], experts=s["experts"],
                                   progress=False)
    for name, value in s["single"].backbone.state_dict().items():
        assert torch.equal(value, result.backbone.state_dict()[name]), name
    assert result.drift == s["single"].drift


@pytest.mark.slow(10)
def test_torchrun_two_processes_match_one_process(saved, tmp_path):
    s = saved
    root = s["root"]
    out = tmp_path / "calibrated"
    cmd = [
        sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2",
        "-m", "featcal.calibration.distributed", "--lazy", "--dtype", "float64",
        "--merged", str(root / "merged"), "--base", str(root / "base"),
        *[f"--expert={t}={root / t}" for t in ["a", "b", "c"]],
        "--batches", str(root / "batches.pt"), "--out", str(out),
        "--config", json.dumps({"calibrate_pooler": True}), "--backend", "gloo",
    ]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)}
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=300, cwd=ROOT)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    # each rank prints the sha256 of its calibrated weights: every rank must hold the same model
    digests = dict(re.findall(r"featcal\.calibration\.distributed rank (\d+/\d+) digest ([0-9a-f]{64})", proc.stdout))
    assert set(digests) == {"0/2", "1/2"}, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert digests["0/2"] == digests["1/2"], "the two ranks hold different calibrated weights"
    run = json.loads((out / "featcal_run.json").read_text())
    assert run["world_size"] == 2 and run["digest"] == digests["0/2"]

    calibrated = AutoModel.from_pretrained(out, dtype=torch.float64).state_dict()
    single = s["single"].backbone.state_dict()
    assert_close_states(single, calibrated)
    # calibration did move the weights, by far more than the tolerance
    merged = s["merged"].state_dict()
    moved = max((single[k] - merged[k]).abs().max().item() for k in single if single[k].is_floating_point())
    assert moved > 1e-3
    for a, b in zip(s["single"].drift, run["drift"]):
        assert a.layer == b["layer"]
        assert b["l2"] == pytest.approx(a.l2, rel=1e-9) and b["cosine"] == pytest.approx(a.cosine, rel=1e-9)
