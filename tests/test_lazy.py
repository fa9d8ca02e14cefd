"""Lazy per-layer loading: calibration and merging read one block at a time from safetensors
folders (single file or sharded with an index) and give exactly the in-memory results."""

import copy
import json

import pytest
import torch
from transformers import AutoModel

import featcal.calibration.walk as walk_module
from featcal import MergeContext, merge_models
from featcal.calibration.config import FeatCalConfig
from featcal.calibration.walk import calibrate
from featcal.io.checkpoints import block_group, CheckpointReader, LazyBackbone, parse_size
from featcal.merging.lazy import CheckpointTaskVectors, lazy_merge
from featcal.calibration.lazy import calibrate_lazy
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


def file_maps(path) -> int:
    """How many memory maps of `path` this process holds (Linux /proc)."""
    with open("/proc/self/maps") as maps:
        return sum(1 for line in maps if line.rstrip().endswith(str(path)))


def test_each_tensor_read_has_its_own_file_map_so_releasing_some_frees_them(setup):
    """The tensors one safetensors opening gives share one map of the file, kept while any of them
    lives: a backbone that lets go of some parameters of a block (an expert's linear weights after
    its task is folded in, the base's after the first) would free none of them. Each is read alone."""
    reader = CheckpointReader(setup["dirs"]["a"])
    file = reader.files[0].resolve()
    names = ["bert.encoder.layer.0.output.dense.weight", "bert.encoder.layer.0.output.dense.bias"]
    before = file_maps(file)
    tensors = reader.read(names)
    assert file_maps(file) == before + 2
    del tensors[names[0]]
    assert file_maps(file) == before + 1
    assert torch.equal(tensors[names[1]], setup["experts"]["a"].state_dict()[names[1]])


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


@pytest.mark.parametrize("method, options", [("average", {}), ("task_arithmetic", {"scale": 0.4})])
def test_an_elementwise_merge_reads_a_large_tensor_by_rows_and_writes_the_same_tensors(setup, tmp_path, method,
                                                                                          options, monkeypatch):
    """Averaging and Task Arithmetic read a tensor group of one tensor above chunk_bytes (here 4 kB: the
    word embeddings) a slice of rows at a time, bit for bit the whole-tensor merge."""
    import featcal.merging.lazy as lazy

    whole = lazy_merge(setup["root"] / "base", setup["dirs"], method, options, tmp_path / "whole", progress=False)
    sliced = []
    real_read = lazy.CheckpointReader.read
    monkeypatch.setattr(lazy.CheckpointReader, "read", lambda self, names, rows=None: (
        sliced.append(rows) if rows is not None else None) or real_read(self, names, rows))
    chunked = lazy_merge(setup["root"] / "base", setup["dirs"], method, options, tmp_path / "rows", progress=False,
                         chunk_bytes=4096)
    assert len({(r.start, r.stop) for r in sliced}) >= 2   # the base and each expert, slice by slice
    a, b = AutoModel.from_pretrained(whole).state_dict(), AutoModel.from_pretrained(chunked).state_dict()
    assert a.keys() == b.keys() and all(torch.equal(a[n], b[n]) for n in a)


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
    from featcal.io.models import ImplausibleExpertWarning

    tiny_bert(seed=9, layers=3).save_pretrained(tmp_path / "random")
    perturbed(setup["base"], 5, scale=0.001).save_pretrained(tmp_path / "fine_tune")   # a small task vector
    experts = {"fine_tune": tmp_path / "fine_tune", "random": tmp_path / "random"}
    with pytest.warns(ImplausibleExpertWarning, match=r"random': its task vector is \d\.\d\d times") as caught:
        lazy_merge(setup["root"] / "base", experts, "task_arithmetic", {}, tmp_path / "merged", progress=False)
    assert not any("fine_tune" in str(w.message) for w in caught)


# --- data methods (RegMean, RegMean++, AdaMerging) through lazy_merge ---------------------------------


@pytest.fixture(scope="module")
def data_setup(tmp_path_factory):
    """A tiny BERT and fine-tune sized experts with their own heads; the base saved as one file and
    sharded, the experts as sharded task models (keys under "bert.", heads beside them)."""
    root = tmp_path_factory.mktemp("lazy_data")
    base = tiny_bert(layers=2)
    experts = {t: perturbed(base, i + 1, scale=0.008, num_labels=2 + i) for i, t in enumerate("abc")}
    base.save_pretrained(root / "base")
    base.save_pretrained(root / "base_sharded", max_shard_size="20KB")
    for t, m in experts.items():
        m.save_pretrained(root / t, max_shard_size="20KB")
    return dict(root=root, base=base, experts=experts, dirs={t: root / t for t in experts})


DATA_METHODS = [
    ("regmean", {"off_diagonal": 0.9}),
    ("regmean_plus_plus", None),
    ("adamerging", {"steps": 3, "lr": 0.05, "batches_per_step": 1, "seed": 2}),
]


@pytest.mark.parametrize("base_name", ["base", "base_sharded"])
@pytest.mark.parametrize("method, options", DATA_METHODS)
def test_lazy_data_merge_equals_merge_models_with_the_same_context(data_setup, tmp_path, method, options, base_name):
    base, experts, root = data_setup["base"], data_setup["experts"], data_setup["root"]
    batches = batches_for(experts, seed=4)
    memory = MergeContext(batches=batches)
    expected = merge_models(base, experts, method, options, memory).state_dict()
    lazy = MergeContext(batches=batches)
    out = lazy_merge(root / base_name, data_setup["dirs"], method, options, tmp_path / "merged",
                     max_shard_size="30KB", progress=False, context=lazy)
    assert (out / "model.safetensors.index.json").exists() and (out / "config.json").exists()
    loaded = AutoModel.from_pretrained(out).eval().state_dict()
    assert list(loaded) == list(expected)
    for name, value in expected.items():
        torch.testing.assert_close(loaded[name], value, rtol=0, atol=1e-6, msg=name)
    assert lazy.record == memory.record   # the same solves, pre-block / kept lists, λ and entropy curve
    # the models lazy_merge put in the context are skeletons: no backbone tensor was loaded whole
    assert all(p.device.type == "meta" for p in lazy.base.parameters())
    assert all(p.device.type == "meta" for m in lazy.experts.values() for p in m.bert.parameters())
    mean = {n: torch.stack([e.bert.state_dict()[n] for e in experts.values()]).mean(0) for n in expected}
    assert not torch.allclose(expected["encoder.layer.1.attention.self.query.weight"],
                              mean["encoder.layer.1.attention.self.query.weight"])   # not a plain average


def test_lazy_regmean_holds_one_block_of_each_expert_at_a_time(data_setup, tmp_path, monkeypatch):
    """Every load and release of the experts' lazy backbones, replayed: at no moment does an expert
    hold two blocks; its non-block tensors are loaded for one expert at a time (its stream enters,
    its head features are taken) while no block is, except the pooler, which RegMean solves last
    from every expert's at once."""
    live: dict[str, set[str]] = {}   # expert folder -> parameter names loaded now
    peaks = {"blocks": 0, "experts_with_a_block": 0, "experts_outside": 0, "poolers": 0}
    order = []
    expert_dirs = {str(d) for d in data_setup["dirs"].values()}
    real_load, real_release = LazyBackbone.load, LazyBackbone.release

    def check():
        blocks = {k: {block_group(n) for n in names if n.startswith("encoder.layer.")} for k, names in live.items()}
        outer = {k: {n for n in names if not n.startswith("encoder.layer.")} for k, names in live.items()}
        outside = [k for k, names in outer.items() if any(not n.startswith("pooler.") for n in names)]
        poolers = [k for k, names in outer.items() if names and all(n.startswith("pooler.") for n in names)]
        assert all(len(b) <= 1 for b in blocks.values()), blocks
        assert len(outside) <= 1 and not (outside and poolers), (outside, poolers)
        assert not (any(outer.values()) and any(blocks.values())), (outer, blocks)
        peaks["blocks"] = max(peaks["blocks"], max((len(b) for b in blocks.values()), default=0))
        peaks["experts_with_a_block"] = max(peaks["experts_with_a_block"], sum(1 for b in blocks.values() if b))
        peaks["experts_outside"] = max(peaks["experts_outside"], len(outside))
        peaks["poolers"] = max(peaks["poolers"], len(poolers))
        for b in blocks.values():
            if b and (not order or order[-1] != next(iter(b))):
                order.append(next(iter(b)))

    def load(self, names):
        loaded = real_load(self, names)
        if str(self.reader.path) in expert_dirs:
            live.setdefault(str(self.reader.path), set()).update(loaded)
            check()
        return loaded

    def release(self, names):
        real_release(self, names)
        if str(self.reader.path) in expert_dirs:
            live[str(self.reader.path)] -= set(names)

    monkeypatch.setattr(LazyBackbone, "load", load)
    monkeypatch.setattr(LazyBackbone, "release", release)
    for method in ("regmean", "regmean_plus_plus"):
        order.clear()
        lazy_merge(data_setup["root"] / "base", data_setup["dirs"], method, None, tmp_path / method, progress=False,
                   context=MergeContext(batches=batches_for("abc")))
        assert order == ["encoder.layer.0", "encoder.layer.1"]   # forward order, each block once
        assert not any(live.values())   # everything released at the end
    assert peaks == {"blocks": 1, "experts_with_a_block": 3, "experts_outside": 1, "poolers": 3}


def test_lazy_adamerging_reads_one_block_at_a_time(data_setup, tmp_path, monkeypatch):
    """After the non-block tensors (read once, held), every read of θ₀ and the task vectors is one
    block's: at each block call of each forward and again in its recompute, then for the output."""
    reads = []
    real = CheckpointTaskVectors.read
    monkeypatch.setattr(CheckpointTaskVectors, "read", lambda self, names: reads.append(list(names)) or real(self, names))
    steps, tasks = 2, "abc"
    lazy_merge(data_setup["root"] / "base", data_setup["dirs"], "adamerging",
               {"steps": steps, "batches_per_step": 1}, tmp_path / "out", progress=False,
               context=MergeContext(batches=batches_for(tasks)))
    groups = [{block_group(n) for n in names} for names in reads]
    assert not any(n.startswith("encoder.layer.") for n in reads[0])   # the non-block tensors, once
    in_blocks = [g for g in groups[1:] if all(x.startswith("encoder.layer.") for x in g)]
    assert all(len(g) == 1 for g in in_blocks)
    # per step, task and block: the forward and the recompute; then one read per block for the output
    assert len(in_blocks) == steps * len(tasks) * 2 * 2 + 2
