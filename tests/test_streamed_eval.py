"""A causal LM scored one block at a time from its folder: the NLLs and the drift of the whole model
in memory (`score_backbone`, `drift_to_states` after `with_parameters_from`), never more than one
block's parameters materialized, and the calibrated multi-task folder copied shard by shard."""

import random

import pytest
import torch
from safetensors.torch import load_file, save_file
from transformers import BertTokenizer

from featcal import merge_models
from featcal.calibration.layerwise import collect_expert_layers
from featcal.data.encoders import TextEncoder
from featcal.data.splits import TaskSplit
from featcal.evaluation.scoring import drift_to_states, score_backbone
from featcal.evaluation.streamed import DriftInputs, score_streamed
from featcal.families import family_for
from featcal.io import checkpoints
from featcal.io.checkpoints import CheckpointReader, LazyBackbone, load_head, save_multitask_from
from featcal.io.models import (load_backbone, load_task_model, NonFiniteWeightsError, save_multitask,
                               with_parameters_from)
from conftest import batches_for, perturbed, tiny_causal_lm
from tiny_project import WORDS, make_vocab

VOCAB = make_vocab(WORDS)
TASKS = ("a", "b")
N_TEXTS = 21   # a batch of 16 and one of 5: the LM head's chunks of 2 end on a single text


def untied(model):
    """`model` with an LM head of its own (a copy of the embeddings, perturbed below with the backbone's)."""
    model.config.tie_word_embeddings = False
    model.lm_head.weight = torch.nn.Parameter(model.lm_head.weight.detach().clone())
    return model


def texts(seed: int) -> list[str]:
    rng = random.Random(seed)
    return [" ".join(rng.choice(WORDS) for _ in range(rng.randint(1, 12))) for _ in range(N_TEXTS)]


def saved_lm(root, model_type: str, tied: bool) -> dict:
    """A TA merge of two perturbed experts saved as the merge stage saves it (the bare backbone), a
    calibrated-layer file for block 1 (its tensors moved), the experts' cached states per layer."""
    base = tiny_causal_lm(model_type, layers=3, vocab=len(VOCAB))
    base = base if tied else untied(base)
    experts = {}
    for i, task in enumerate(TASKS):
        expert = perturbed(base, i + 2, scale=0.005)
        if not tied:
            with torch.no_grad():
                expert.lm_head.weight.add_(0.005 * torch.randn_like(expert.lm_head.weight))
        expert.save_pretrained(root / task)
        experts[task] = expert
    merged = merge_models(base, experts, "task_arithmetic", {"scale": 0.3})
    merged.save_pretrained(root / "merged")
    g = torch.Generator().manual_seed(7)
    layer = {n: v + 0.05 * torch.randn(v.shape, generator=g) for n, v in merged.state_dict().items()
             if n.startswith("layers.1.")}
    save_file(layer, root / "L01.safetensors")
    drift_batches = batches_for(TASKS, vocab=len(VOCAB))
    states = list(collect_expert_layers({t: root / t for t in TASKS}, drift_batches))
    return dict(root=root, merged_dir=root / "merged", layer_files=[root / "L01.safetensors"],
                heads={t: load_head(root / t) for t in TASKS}, encoder=TextEncoder(BertTokenizer(
                    vocab={w: i for i, w in enumerate(VOCAB)})),
                splits={t: TaskSplit(t, "test", texts(i), torch.zeros(N_TEXTS, dtype=torch.long))
                        for i, t in enumerate(TASKS)},
                lengths={"a": 16, "b": 9}, drift=DriftInputs(drift_batches, lambda k: states[k]), tied=tied)


@pytest.fixture(scope="module", params=[("qwen2", True), ("mistral", False)], ids=["qwen2-tied", "mistral-untied"])
def saved(request, tmp_path_factory):
    model_type, tied = request.param
    return saved_lm(tmp_path_factory.mktemp(f"streamed_{model_type}"), model_type, tied)


def in_memory(saved, layer_files):
    """What evaluate computes today: the whole backbone, the layers put in, scored and compared."""
    backbone = with_parameters_from(load_backbone(str(saved["merged_dir"])), layer_files)
    scores = score_backbone(backbone, saved["heads"], saved["encoder"], saved["splits"], saved["lengths"])
    drift = drift_to_states(family_for(backbone), backbone, saved["drift"].batches, saved["drift"].states)
    return scores, drift


@pytest.mark.parametrize("calibrated", [False, True], ids=["merged", "calibrated"])
def test_streamed_scores_and_drift_are_those_of_the_whole_model(saved, calibrated):
    layer_files = saved["layer_files"] if calibrated else []
    scores, drift = in_memory(saved, layer_files)
    result = score_streamed(saved["merged_dir"], saved["heads"], saved["encoder"], saved["splits"], saved["lengths"],
                            layer_files, saved["drift"], progress=False)
    # the heads are handed back without the loaded embeddings (nothing real in their backbones)
    assert all(p.is_meta for h in saved["heads"].values() for p in h.model.parameters())
    assert result.scores == scores   # bit for bit: the same batches, block inputs and float64 sums
    assert result.drift == drift
    assert len(drift) == 3 and all(d.l2 > 0 for d in drift)
    assert all(1.0 < s < 10.0 for s in scores.values()), scores
    if calibrated:   # the layer file was read: the scores moved
        merged, _ = in_memory(saved, [])
        assert all(merged[t] != scores[t] for t in TASKS)


def test_the_streamed_scorer_never_holds_more_than_one_block(saved, monkeypatch):
    """Every decoder block that runs is a block of a `LazyBackbone` in which it is the only block
    loaded, with nothing outside the blocks loaded (the streams enter with the embeddings alone,
    the forward stopped at block 0); the LM head runs with no block loaded, and an untied one
    without the embeddings. Loading the model whole (a block run outside a lazy backbone, or beside
    its neighbours) fails this."""
    lazies = []
    init = LazyBackbone.__init__

    def recording(self, *args, **kwargs):
        init(self, *args, **kwargs)
        lazies.append(self)

    monkeypatch.setattr(LazyBackbone, "__init__", recording)
    heads = {t: saved["root"] / t for t in TASKS}   # as the stages give them: each loaded while its task is scored
    seen = {"entries": 0, "blocks": 0, "lm_head": 0}

    def loaded(lazy) -> tuple[set[str], list[str]]:
        real = [n for n, p in lazy.module.named_parameters() if not p.is_meta]
        return {n.split(".")[1] for n in real if n.startswith("layers.")}, [n for n in real if not n.startswith("layers.")]

    def check(module, _args):
        if type(module).__name__.endswith("DecoderLayer"):
            owners = [lazy for lazy in lazies if any(module is block for block in lazy.module.layers)]
            assert owners, "a decoder block ran outside the lazy backbone"
            blocks, outer = loaded(owners[0])
            if not blocks and module is owners[0].module.layers[0]:   # a stream entering: the forward
                seen["entries"] += 1                                   # stops before block 0 runs
                return
            assert len(blocks) == 1 and not outer, (blocks, outer)
            seen["blocks"] += 1
        if isinstance(module, torch.nn.Linear) and module.out_features == len(VOCAB):   # an LM head
            blocks, outer = loaded(lazies[-1])
            assert not blocks, blocks
            # the embeddings only for a head tied to them: an untied head needs the final norm alone
            assert outer == (["embed_tokens.weight", "norm.weight"] if saved["tied"] else ["norm.weight"]), outer
            seen["lm_head"] += 1

    handle = torch.nn.modules.module.register_module_forward_pre_hook(check)
    try:
        score_streamed(saved["merged_dir"], heads, saved["encoder"], saved["splits"], saved["lengths"],
                       saved["layer_files"], saved["drift"], progress=False)
    finally:
        handle.remove()
    # 8 batches (2 tasks x 2 of texts, 2 x 2 for the drift) enter and run through 3 blocks; the
    # head runs on 2 tasks x 11 chunks (16 texts, then 5, 2 at a time)
    assert seen == {"entries": 8, "blocks": 3 * 8, "lm_head": 2 * (8 + 3)}, seen


def test_the_calibrated_folder_is_copied_shard_by_shard_and_loads_as_the_model_scored(saved, tmp_path, monkeypatch):
    """The merged folder's tensors with the calibrated layers in place, in shards no larger than
    `COPY_SHARD_BYTES`: each task's model loads from it and equals the one save_multitask writes."""
    monkeypatch.setattr(checkpoints, "COPY_SHARD_BYTES", 10_000)   # the tiny model: ~65 kB, no tensor over 10 kB
    reader = CheckpointReader(saved["merged_dir"]).with_tensors_from(saved["layer_files"])
    files = save_multitask_from(tmp_path / "streamed", reader, {t: saved["root"] / t for t in TASKS}, saved["encoder"])
    copied = CheckpointReader(tmp_path / "streamed")
    sizes = {f: sum(copied.nbytes(n) for n, g in copied.weight_map.items() if g == f) for f in copied.files}
    assert sorted(sizes) == sorted(f for f in files if f.suffix == ".safetensors")
    assert len(sizes) > 3 and max(sizes.values()) <= 10_000, sizes
    backbone = with_parameters_from(load_backbone(str(saved["merged_dir"])), saved["layer_files"])
    save_multitask(tmp_path / "in_memory", backbone, saved["heads"], saved["encoder"])
    ids = torch.tensor([[5, 6, 7, 8, 9]])
    for task in TASKS:
        copied, written = load_task_model(tmp_path / "streamed", task), load_task_model(tmp_path / "in_memory", task)
        assert copied.state_dict().keys() == written.state_dict().keys()
        for name, value in written.state_dict().items():
            assert torch.equal(copied.state_dict()[name], value), name
        with torch.no_grad():
            assert torch.equal(copied(input_ids=ids).logits, written(input_ids=ids).logits)


def test_a_layer_file_the_model_lacks_and_a_non_finite_tensor_are_refused_naming_them(saved, tmp_path):
    bad = tmp_path / "L09.safetensors"
    save_file({"layers.9.mlp.up_proj.weight": torch.zeros(2, 2)}, bad)
    with pytest.raises(ValueError, match=r"L09.safetensors: parameter 'layers.9.mlp.up_proj.weight' is not in the model"):
        score_streamed(saved["merged_dir"], saved["heads"], saved["encoder"], saved["splits"], saved["lengths"], [bad])
    save_file({"layers.1.mlp.up_proj.weight": torch.zeros(2, 2)}, bad)
    with pytest.raises(ValueError, match=r"L09.safetensors: parameter 'layers.1.mlp.up_proj.weight' has shape \(2, 2\), "
                                         r"the model's is \(48, 24\)"):
        CheckpointReader(saved["merged_dir"]).with_tensors_from([bad])
    layer = load_file(saved["layer_files"][0])
    name = sorted(layer)[0]
    layer[name].view(-1)[0] = float("nan")
    save_file(layer, tmp_path / "L01.safetensors")
    reader = CheckpointReader(saved["merged_dir"]).with_tensors_from([tmp_path / "L01.safetensors"])
    with pytest.raises(NonFiniteWeightsError, match=rf"the backbone: tensor '{name}' holds 1 NaN"):
        save_multitask_from(tmp_path / "out", reader, saved["heads"], saved["encoder"])
    assert not (tmp_path / "out").exists()



def test_a_non_finite_head_is_refused_before_the_backbone_is_copied(tmp_path, monkeypatch):
    saved = saved_lm(tmp_path, "mistral", tied=False)   # (a tied head is the embeddings: no tensor of its own)
    head = load_head(saved["root"] / "a")
    with torch.no_grad():
        head.lm_head.weight[0, 0] = float("inf")
    copied = []
    monkeypatch.setattr(CheckpointReader, "read", lambda self, names: copied.append(names))
    with pytest.raises(NonFiniteWeightsError, match=r"refusing to write .*/out: the head of task 'a': tensor "
                                                    r"'lm_head.weight' holds 0 NaN and 1 infinite"):
        save_multitask_from(tmp_path / "out", CheckpointReader(saved["merged_dir"]), {"a": head}, saved["encoder"])
    assert not copied and not (tmp_path / "out").exists()
