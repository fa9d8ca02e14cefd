"""Lazy per-layer loading: calibration and merging read one block at a time from safetensors
folders (single file or sharded with an index) and give exactly the in-memory results."""

import copy
import json

import pytest
import torch
from transformers import AutoModel

import featcal.walk as walk_module
from featcal import merge_models
from featcal.calibrate import FeatCalConfig, calibrate
from featcal.lazy import CheckpointReader, LazyBackbone, block_group, calibrate_lazy, lazy_merge, parse_size
from conftest import assert_same_state, batches_for, perturbed, tiny_bert


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    root = tmp_path_factory.mktemp("lazy")
    base = tiny_bert(layers=3)
    experts = {t: perturbed(base, i + 1, num_labels=2 + i) for i, t in enumerate("abc")}
    base.save_pretrained(root / "base")
    dirs, sharded = {}, {}
    for t, m in experts.items():
        m.save_pretrained(root / t)
        m.save_pretrained(root / f"{t}_sharded", max_shard_size="20KB")
        dirs[t], sharded[t] = root / t, root / f"{t}_sharded"
    merged = merge_models(base, experts, "task_arithmetic", {"scale": 0.3})
    return dict(root=root, base=base, experts=experts, dirs=dirs, sharded=sharded, merged=merged)


def test_sharded_checkpoint_has_several_files_and_is_read_by_name(setup):
    folder = setup["sharded"]["a"]
    assert (folder / "model.safetensors.index.json").exists()
    reader = CheckpointReader(folder)
    assert len(reader.files) > 3
    state = setup["experts"]["a"].state_dict()
    name = "bert.encoder.layer.2.output.dense.weight"
    assert torch.equal(reader.read([name])[name], state[name])
    assert reader.shape(name) == tuple(state[name].shape) and reader.dtype(name) == torch.float32
    assert reader.find_prefix("encoder.layer.0.attention.self.query.weight") == "bert."
    with pytest.raises(KeyError, match="no tensor 'nope'"):
        reader.read(["nope"])
    with pytest.raises(FileNotFoundError, match="model.safetensors"):
        CheckpointReader(setup["root"] / "a" / "..")


def test_calibrate_lazy_equals_calibrate_with_experts_loaded_whole(setup):
    config = FeatCalConfig(calibrate_pooler=True)
    batches = batches_for("abc")
    whole = calibrate(setup["merged"], setup["base"], setup["experts"], batches, config, progress=False)
    lazy_result = calibrate_lazy(setup["merged"], setup["root"] / "base", setup["dirs"], batches, config, progress=False)
    assert_same_state(whole.backbone, lazy_result.backbone)
    assert whole.drift == lazy_result.drift
    assert [r.module for r in whole.reports] == [r.module for r in lazy_result.reports]
    # the merged model given is left alone (a copy is calibrated)
    assert_same_state(setup["merged"], merge_models(setup["base"], setup["experts"], "task_arithmetic", {"scale": 0.3}))


def test_sharded_experts_give_the_same_calibration_as_unsharded(setup):
    batches = batches_for("abc", seed=3)
    one = calibrate_lazy(setup["merged"], setup["root"] / "base", setup["dirs"], batches, progress=False)
    many = calibrate_lazy(setup["merged"], setup["root"] / "base", setup["sharded"], batches, progress=False)
    assert_same_state(one.backbone, many.backbone)


def test_lazy_calibration_holds_one_block_of_each_expert_at_a_time(setup, monkeypatch):
    seen = []
    original = walk_module.calibrate_block

    def spy(family, index, student, base_bb, expert_bbs, *args, **kwargs):
        prefix = family.block_prefix(student, index)
        for bb in [base_bb, *expert_bbs.values()]:
            real = [n for n, p in bb.named_parameters() if p.device.type != "meta"]
            assert real and all(n.startswith(prefix) for n in real), (index, real[:3])
        seen.append(index)
        return original(family, index, student, base_bb, expert_bbs, *args, **kwargs)

    monkeypatch.setattr(walk_module, "calibrate_block", spy)
    result = calibrate_lazy(setup["merged"], setup["root"] / "base", setup["dirs"], batches_for("ab"), progress=False)
    assert seen == [0, 1, 2]
    assert all(p.device.type == "cpu" for p in result.backbone.parameters())


def test_lazy_backbone_keeps_tied_parameters_tied(setup):
    merged = setup["merged"]
    backbone = LazyBackbone(merged, CheckpointReader(setup["dirs"]["a"]))
    assert backbone.prefix == "bert."
    assert all(p.device.type == "meta" for p in backbone.module.parameters())
    with backbone.loaded(["encoder.layer.1."]) as m:
        w = m.encoder.layer[1].intermediate.dense.weight
        assert torch.equal(w, setup["experts"]["a"].bert.encoder.layer[1].intermediate.dense.weight)
        assert m.encoder.layer[0].intermediate.dense.weight.device.type == "meta"
    assert m.encoder.layer[1].intermediate.dense.weight.device.type == "meta"


@pytest.mark.parametrize("method, options", [
    ("average", {}),
    ("task_arithmetic", {"scale": 0.4}),
    ("ties", {"density": 0.3, "scale": 1.0}),
    ("dare", {"drop_rate": 0.3, "seed": 7, "then": "ties", "density": 0.5}),
])
def test_lazy_merge_equals_merge_models_and_loads_with_auto_model(setup, tmp_path, method, options):
    out = lazy_merge(setup["root"] / "base", setup["sharded"], method, options, tmp_path / "merged",
                     max_shard_size="30KB", progress=False)
    index = json.loads((out / "model.safetensors.index.json").read_text())
    files = sorted(p.name for p in out.glob("model-*.safetensors"))
    n = len(files)
    assert n > 1 and files[0] == f"model-00001-of-{n:05d}.safetensors"
    assert set(index["weight_map"].values()) == set(files)
    loaded = AutoModel.from_pretrained(out).eval()
    expected = merge_models(setup["base"], setup["experts"], method, options)
    assert_same_state(loaded, expected)


def test_lazy_merge_writes_one_file_when_it_fits_and_refuses_model_scope_ties(setup, tmp_path):
    out = lazy_merge(setup["root"] / "base", setup["dirs"], "average", None, tmp_path / "one", progress=False)
    assert (out / "model.safetensors").exists() and not (out / "model.safetensors.index.json").exists()
    assert json.loads((out / "config.json").read_text())["architectures"] == ["BertModel"]
    with pytest.raises(ValueError, match="scope='model'"):
        lazy_merge(setup["root"] / "base", setup["dirs"], "ties", {"scope": "model"}, tmp_path / "x", progress=False)
    assert not (tmp_path / "x").exists()


def test_lazy_merge_names_the_expert_and_tensor_that_do_not_fit(setup, tmp_path):
    other = tiny_bert(layers=2)
    other.save_pretrained(tmp_path / "shallow")
    with pytest.raises(ValueError, match=r"shallow.*encoder\.layer\.2"):
        lazy_merge(setup["root"] / "base", [setup["dirs"]["a"], tmp_path / "shallow"], "average", None,
                   tmp_path / "out", progress=False)


def test_helpers():
    assert block_group("encoder.layer.11.attention.self.query.weight") == "encoder.layer.11"
    assert block_group("encoder.block.0.layer.1.DenseReluDense.wi.weight") == "encoder.block.0"
    assert block_group("embeddings.word_embeddings.weight") == "embeddings.word_embeddings.weight"
    assert parse_size("2GB") == 2 * 10**9 and parse_size("20KiB") == 20 * 1024 and parse_size(512) == 512


def test_t5_encoder_decoder_lazy_equals_whole(tmp_path):
    # the last encoder block hands over to the decoder through parameters outside the blocks
    from transformers import T5Config, T5ForSequenceClassification

    torch.manual_seed(0)
    cfg = T5Config(vocab_size=40, d_model=16, d_kv=4, d_ff=32, num_layers=2, num_decoder_layers=2, num_heads=4,
                   relative_attention_num_buckets=8, relative_attention_max_distance=16, num_labels=2,
                   decoder_start_token_id=0, pad_token_id=0, eos_token_id=1)
    base = T5ForSequenceClassification(cfg).eval()
    experts = {}
    for i, t in enumerate("ab"):
        experts[t] = copy.deepcopy(base)
        g = torch.Generator().manual_seed(i + 1)
        with torch.no_grad():
            for p in experts[t].transformer.parameters():
                p.add_(0.1 * torch.randn(p.shape, generator=g))
        experts[t].save_pretrained(tmp_path / t)
    base.save_pretrained(tmp_path / "base")
    merged = merge_models(base, experts, "task_arithmetic")
    g = torch.Generator().manual_seed(5)
    batches = {}
    for t in experts:
        ids = torch.randint(2, 40, (3, 7), generator=g)
        ids[:, -1] = 1
        batches[t] = [dict(input_ids=ids, attention_mask=torch.ones_like(ids))]
    whole = calibrate(merged, base, experts, batches, progress=False)
    lazy_result = calibrate_lazy(merged, tmp_path / "base", {t: tmp_path / t for t in experts}, batches, progress=False)
    assert_same_state(whole.backbone, lazy_result.backbone)


def test_lazy_merge_warns_about_an_expert_that_is_no_fine_tune_of_the_base(setup, tmp_path):
    from featcal.modeling import ImplausibleExpertWarning

    tiny_bert(seed=9, layers=3).save_pretrained(tmp_path / "random")
    perturbed(setup["base"], 5, scale=0.001).save_pretrained(tmp_path / "fine_tune")   # a small task vector
    experts = {"fine_tune": tmp_path / "fine_tune", "random": tmp_path / "random"}
    with pytest.warns(ImplausibleExpertWarning, match=r"random': its task vector is \d\.\d\d times") as caught:
        lazy_merge(setup["root"] / "base", experts, "task_arithmetic", {}, tmp_path / "merged", progress=False)
    assert not any("fine_tune" in str(w.message) for w in caught)
