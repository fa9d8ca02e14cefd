"""Model families on tiny random configurations: exact block-by-block replay, and FeatCal on each.

Every model here is built in code from a seeded tiny config (hidden 32, 2 layers): nothing is
downloaded. Experts are a few seeded fine-tuning steps from the base, each on its own task's
inputs; the merge is Task Arithmetic (θ0 + 0.3 Σ τ_t), computed here on state dicts.
"""

from __future__ import annotations

import copy
import os
from dataclasses import dataclass
from typing import Callable

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import pytest
import torch
import transformers as tf
from torch import Tensor, nn

from featcal.calibration.config import FeatCalConfig
from featcal.calibration.walk import calibrate
from featcal.evaluation.scoring import layer_drift as evaluate_layer_drift
from featcal.families import FAMILIES, Family, Stream, family_for
from featcal.families.base import first_output
from conftest import tiny_bert

VOCAB, PAD, EOS = 64, 0, 1
HIDDEN, LAYERS, HEADS, FFN = 32, 2, 4, 64
IMAGE, PATCH = 16, 4
TASKS = ("a", "b", "c")
MERGE_SCALE = 0.3


# --- inputs ----------------------------------------------------------------------------------------


def text_batch(seed: int, lengths: list[int], seq_len: int, task: int = 0, padding: str = "right",
               eos: bool = False, token_type_ids: bool = False) -> dict[str, Tensor]:
    """Random token ids (a task-specific slice of the vocabulary) with padding, optionally EOS-ended."""
    g = torch.Generator().manual_seed(seed)
    low = 2 + 12 * task
    ids = torch.randint(low, low + 26, (len(lengths), seq_len), generator=g)
    mask = torch.zeros(len(lengths), seq_len, dtype=torch.long)
    for row, n in enumerate(lengths):
        if padding == "right":
            mask[row, :n] = 1
            if eos:
                ids[row, n - 1] = EOS
        else:
            mask[row, seq_len - n:] = 1
            if eos:
                ids[row, -1] = EOS
    ids[mask == 0] = PAD
    batch = {"input_ids": ids, "attention_mask": mask}
    if token_type_ids:
        batch["token_type_ids"] = (torch.arange(seq_len) >= seq_len // 2).long().expand(len(lengths), -1).clone()
    return batch


def image_batch(seed: int, n: int, task: int = 0) -> dict[str, Tensor]:
    """Noise images around a fixed per-task template (each task its own input distribution)."""
    template = torch.randn(3, IMAGE, IMAGE, generator=torch.Generator().manual_seed(1234 + task))
    noise = torch.randn(n, 3, IMAGE, IMAGE, generator=torch.Generator().manual_seed(seed))
    return {"pixel_values": noise + template}


# --- the families under test ---------------------------------------------------------------------------


@dataclass
class Case:
    name: str
    build: Callable[[], nn.Module]
    batch: Callable[[int, int], dict[str, Tensor]]  # (seed, task) -> model inputs
    # the head applied to `family.head_features(...)`, and the same quantity from the full model
    head: Callable[[nn.Module, Tensor], Tensor] | None = None
    full_head: Callable[[nn.Module, dict], Tensor] | None = None


def seeded(build: Callable[[], nn.Module]) -> Callable[[], nn.Module]:
    def make() -> nn.Module:
        torch.manual_seed(0)
        return build().eval()

    return make


def bert() -> nn.Module:
    return tiny_bert(0, LAYERS, vocab=VOCAB, hidden=HIDDEN, intermediate=FFN, positions=32, num_labels=3,
                     pad_token_id=PAD)


def mpnet() -> nn.Module:
    return tf.MPNetForSequenceClassification(tf.MPNetConfig(
        vocab_size=VOCAB, hidden_size=HIDDEN, num_hidden_layers=LAYERS, num_attention_heads=HEADS,
        intermediate_size=FFN, max_position_embeddings=40, num_labels=3,   # 32 position buckets: the encoder
        # always asks for 32, whatever the config says
        pad_token_id=PAD,
    ))


def vit() -> nn.Module:
    return tf.ViTForImageClassification(tf.ViTConfig(
        image_size=IMAGE, patch_size=PATCH, hidden_size=HIDDEN, num_hidden_layers=LAYERS,
        num_attention_heads=HEADS, intermediate_size=FFN, num_labels=3,
    ))


def clip() -> nn.Module:
    return tf.CLIPVisionModelWithProjection(tf.CLIPVisionConfig(
        image_size=IMAGE, patch_size=PATCH, hidden_size=HIDDEN, num_hidden_layers=LAYERS,
        num_attention_heads=HEADS, intermediate_size=FFN, projection_dim=16,
    ))


def llama() -> nn.Module:
    return tf.LlamaForSequenceClassification(tf.LlamaConfig(
        vocab_size=VOCAB, hidden_size=HIDDEN, num_hidden_layers=LAYERS, num_attention_heads=HEADS,
        num_key_value_heads=2, intermediate_size=FFN, max_position_embeddings=64, num_labels=3,
        pad_token_id=PAD,
    ))


def llama_like(config_class: type, task_class: type, **extra) -> Callable[[], nn.Module]:
    """A tiny Llama-like decoder of another model type (GQA), as the task model `task_class`."""
    def build() -> nn.Module:
        return task_class(config_class(
            vocab_size=VOCAB, hidden_size=HIDDEN, num_hidden_layers=LAYERS, num_attention_heads=HEADS,
            num_key_value_heads=2, intermediate_size=FFN, max_position_embeddings=64, pad_token_id=PAD, **extra,
        ))
    return build


# Qwen2: q/k/v biases; the causal LMs tie the LM head to the embeddings; Mistral's window (4) is
# shorter than the batches (8 tokens), so its mask is not the plain causal one
qwen2 = llama_like(tf.Qwen2Config, tf.Qwen2ForSequenceClassification, num_labels=3)
qwen2_causal_lm = llama_like(tf.Qwen2Config, tf.Qwen2ForCausalLM, tie_word_embeddings=True)
mistral_causal_lm = llama_like(tf.MistralConfig, tf.MistralForCausalLM, sliding_window=4, tie_word_embeddings=True)


def t5_config() -> tf.T5Config:
    return tf.T5Config(
        vocab_size=VOCAB, d_model=HIDDEN, d_kv=8, num_heads=HEADS, d_ff=FFN, num_layers=LAYERS,
        num_decoder_layers=LAYERS, relative_attention_num_buckets=8, feed_forward_proj="gated-gelu",
        num_labels=3, pad_token_id=PAD, eos_token_id=EOS, decoder_start_token_id=PAD,
    )


def t5() -> nn.Module:
    return tf.T5ForSequenceClassification(t5_config())


def t5_seq2seq() -> nn.Module:
    return tf.T5ForConditionalGeneration(t5_config())


def t5_seq2seq_batch(seed: int, task: int) -> dict[str, Tensor]:
    batch = text_batch(seed, [7, 4, 6], 7, task, eos=True)
    labels = text_batch(seed + 1, [3, 5, 2], 5, task, eos=True)
    labels["input_ids"][labels["attention_mask"] == 0] = -100
    return {**batch, "labels": labels["input_ids"]}


CASES = {
    "bert": Case(
        "bert", seeded(bert),
        lambda seed, task: text_batch(seed, [9, 5, 7, 3], 9, task, token_type_ids=True),
        head=lambda m, f: m.classifier(torch.tanh(m.bert.pooler.dense(f))),
        full_head=lambda m, b: m(**b).logits,
    ),
    "mpnet": Case(
        "mpnet", seeded(mpnet), lambda seed, task: text_batch(seed, [9, 5, 7, 3], 9, task),
        head=lambda m, f: m.classifier(f[:, None, :]), full_head=lambda m, b: m(**b).logits,
    ),
    "vit": Case(
        "vit", seeded(vit), lambda seed, task: image_batch(seed, 4, task),
        head=lambda m, f: m.classifier(f), full_head=lambda m, b: m(**b).logits,
    ),
    "clip": Case(
        "clip", seeded(clip), lambda seed, task: image_batch(seed, 4, task),
        head=lambda m, f: m.visual_projection(f), full_head=lambda m, b: m(**b).image_embeds,
    ),
    "llama": Case(
        "llama", seeded(llama), lambda seed, task: text_batch(seed, [8, 5, 2, 6], 8, task),
        head=lambda m, f: m.score(f), full_head=lambda m, b: m(**b).logits,
    ),
    "qwen2": Case(
        "llama", seeded(qwen2), lambda seed, task: text_batch(seed, [8, 5, 2, 6], 8, task),
        head=lambda m, f: m.score(f), full_head=lambda m, b: m(**b).logits,
    ),
    # causal LMs: every real token is a feature; the LM head reads norm(h) at each (mean-pooled here)
    "qwen2-causal-lm": Case(
        "llama", seeded(qwen2_causal_lm), lambda seed, task: text_batch(seed, [8, 5, 2, 6], 8, task),
        head=lambda m, f: m.lm_head(f), full_head=lambda m, b: mean_over_tokens(m(**b).logits, b),
    ),
    "mistral-causal-lm": Case(
        "llama", seeded(mistral_causal_lm), lambda seed, task: text_batch(seed, [8, 5, 2, 6], 8, task),
        head=lambda m, f: m.lm_head(f), full_head=lambda m, b: mean_over_tokens(m(**b).logits, b),
    ),
    "t5": Case(
        "t5", seeded(t5), lambda seed, task: text_batch(seed, [7, 4, 6, 3], 7, task, eos=True),
        head=lambda m, f: m.classification_head(f), full_head=lambda m, b: m(**b).logits,
    ),
}
EXTRA_REPLAY_CASES = {
    "llama-left-padding": Case(
        "llama", seeded(llama), lambda seed, task: text_batch(seed, [8, 5, 2, 6], 8, task, padding="left"),
        head=lambda m, f: m.score(f), full_head=lambda m, b: m(**b).logits,
    ),
    "t5-seq2seq-labels": Case("t5", seeded(t5_seq2seq), t5_seq2seq_batch),
}


# --- helpers -----------------------------------------------------------------------------------------------


def mean_over_tokens(logits: Tensor, batch: dict[str, Tensor]) -> Tensor:
    """[B, T, V] → [B, V], averaged over each row's real tokens (the LM head is linear, so this is
    the head applied to the mean-pooled features)."""
    m = batch["attention_mask"].to(logits.dtype)[..., None]
    return (logits * m).sum(1) / m.sum(1)


def replay(family: Family, backbone: nn.Module, batch: dict[str, Tensor]) -> Stream:
    """Run the blocks one at a time from `family.enter`."""
    stream = family.enter(backbone, batch)
    for index in range(len(family.blocks(backbone))):
        stream = family.run_block(backbone, index, stream)
    return stream


def last_block_output(family: Family, model: nn.Module, batch: dict[str, Tensor]) -> Tensor:
    """What the full model's last block outputs, read with a forward hook."""
    seen = []
    block = family.blocks(family.backbone(model))[-1]
    handle = block.register_forward_hook(lambda _m, _a, out: seen.append(first_output(out)))
    try:
        with torch.no_grad():
            model(**batch)
    finally:
        handle.remove()
    assert len(seen) == 1
    return seen[0]


def fine_tuned_expert(base: nn.Module, case: Case, task: int, steps: int = 10, lr: float = 3e-3) -> nn.Module:
    """An expert: a few Adam steps from the base on the task's own inputs, towards a random target.

    Each task's inputs come from their own distribution (a slice of the vocabulary, or shifted
    pixels) and its target is a fixed random output, so task vectors depend on the task's inputs
    the way real fine-tuning's do. (Independent random weight noise per expert leaves FeatCal
    little to exploit: the merge is then already close to the least-squares compromise.)
    """
    torch.manual_seed(100 + task)
    expert = copy.deepcopy(base).train()
    optimiser = torch.optim.Adam(expert.parameters(), lr=lr)
    target = None
    for step in range(steps):
        out = head_output(expert, case.batch(10_000 + 100 * task + step, task))
        if target is None:
            target = torch.randn(out.shape, generator=torch.Generator().manual_seed(task))
        loss = (out - target).pow(2).mean()
        optimiser.zero_grad()
        loss.backward()
        optimiser.step()
    return expert.eval()


def task_arithmetic(base: nn.Module, experts: dict[str, nn.Module], scale: float = MERGE_SCALE) -> nn.Module:
    """θ0 + scale · Σ_t (θ_t − θ0), on full state dicts."""
    theta0 = base.state_dict()
    thetas = [e.state_dict() for e in experts.values()]
    merged_sd = {}
    for key, value in theta0.items():
        if value.is_floating_point():
            merged_sd[key] = value + scale * sum(t[key] - value for t in thetas)
        else:
            merged_sd[key] = value
    merged = copy.deepcopy(base)
    merged.load_state_dict(merged_sd)
    return merged.eval()


# Each case's transformer blocks in forward order, by the model's own attribute names (not featcal's).
BLOCKS: dict[str, Callable[[nn.Module], list[nn.Module]]] = {
    "bert": lambda m: list(m.bert.encoder.layer),
    "mpnet": lambda m: list(m.mpnet.encoder.layer),
    "vit": lambda m: list(m.vit.layers if hasattr(m.vit, "layers") else m.vit.encoder.layer),
    "clip": lambda m: list(m.vision_model.encoder.layers),
    "llama": lambda m: list(m.model.layers),
    "t5": lambda m: [*m.get_encoder().block, *m.get_decoder().block],
}


@torch.no_grad()
def block_outputs(case: Case, model: nn.Module, batch: dict[str, Tensor]) -> tuple[list[Tensor], Tensor]:
    """Every block's output in one plain forward of the whole model (forward hooks on its blocks;
    `output_hidden_states` would hand back Llama's and T5's last outputs after the final norm), and the
    real-token mask of their rows: the attention mask (T5's decoder reads the shifted inputs, of the
    same length and mask), every token for images. T5 also gives its encoder output (after
    final_layer_norm) as an extra last entry."""
    seen: list[Tensor] = []
    hooks = [block.register_forward_hook(lambda _m, _a, out: seen.append(out[0] if isinstance(out, tuple) else out))
             for block in BLOCKS[case.name](model)]
    try:
        out = model(**batch)
    finally:
        for hook in hooks:
            hook.remove()
    if case.name == "t5":
        seen.append(out.encoder_last_hidden_state)
    mask = batch.get("attention_mask")
    return seen, (torch.ones(seen[0].shape[:2], dtype=torch.bool) if mask is None else mask.bool())


def layer_drift(case: Case, student: nn.Module, experts: dict[str, nn.Module],
                batches: dict[str, list[dict]]) -> list[tuple[float, float]]:
    """(mean L2 distance, mean cosine similarity) per block output between the student's and each
    task's expert's own forward, over every real token of every batch of every task: computed here
    from `block_outputs`, with no featcal code."""
    sums = None
    count = 0
    for task, task_batches in batches.items():
        for batch in task_batches:
            (student_out, mask), (expert_out, _) = block_outputs(case, student, batch), block_outputs(case, experts[task], batch)
            if sums is None:
                sums = torch.zeros(len(student_out), 2, dtype=torch.float64)
            for k, (hs, he) in enumerate(zip(student_out, expert_out, strict=True)):
                hs, he = hs[mask].double(), he[mask].double()
                sums[k, 0] += (hs - he).pow(2).sum(-1).sqrt().sum()
                sums[k, 1] += ((hs * he).sum(-1) / (hs.pow(2).sum(-1).sqrt() * he.pow(2).sum(-1).sqrt())).sum()
            count += int(mask.sum())
    return [(float(l2), float(cos)) for l2, cos in sums / count]


@torch.no_grad()
def head_drift(family: Family, student: nn.Module, experts: dict[str, nn.Module],
               batches: dict[str, list[dict]]) -> float:
    """Mean L2 distance between the student's and each expert's head features (what heads read)."""
    student_bb = family.backbone(student)
    total, count = 0.0, 0
    for task, task_batches in batches.items():
        expert_bb = family.backbone(experts[task])
        for batch in task_batches:
            s = family.head_features(student_bb, replay(family, student_bb, batch))
            e = family.head_features(expert_bb, replay(family, expert_bb, batch))
            total += float((s - e).norm(dim=-1).sum())
            count += s.shape[0]
    return total / count


def with_backbone(model: nn.Module, family: Family, backbone: nn.Module) -> nn.Module:
    """A full model (heads included) whose backbone is `backbone`."""
    full = copy.deepcopy(model)
    family.backbone(full).load_state_dict(backbone.state_dict())
    return full.eval()


def head_output(model: nn.Module, batch: dict[str, Tensor]) -> Tensor:
    """The model's task output (logits, or CLIP's image embedding)."""
    out = model(**batch)
    return out.image_embeds if hasattr(out, "image_embeds") else out.logits


def outputs(model: nn.Module, batch: dict[str, Tensor]) -> Tensor:
    with torch.no_grad():
        return head_output(model, batch)


# --- 1. block-by-block replay reproduces the full forward ---------------------------------------------


@pytest.mark.parametrize("case", [*CASES.values(), *EXTRA_REPLAY_CASES.values()],
                         ids=[*CASES, *EXTRA_REPLAY_CASES])
def test_blocks_run_one_at_a_time_reproduce_the_full_forward(case: Case) -> None:
    model = case.build()
    family = family_for(model)
    assert family.name == case.name
    backbone = family.backbone(model)
    assert family.depth(model.config) == len(family.blocks(backbone)) == len(BLOCKS[case.name](model))
    batch = case.batch(11, 0)
    stream = replay(family, backbone, batch)
    expected = last_block_output(family, model, batch)
    torch.testing.assert_close(stream.hidden, expected, atol=1e-6, rtol=0)
    if case.head is not None:  # the head features sit where the model's own head reads
        with torch.no_grad():
            torch.testing.assert_close(case.head(model, family.head_features(backbone, stream)),
                                       case.full_head(model, batch), atol=1e-6, rtol=0)


def test_t5_replay_hands_the_encoder_output_to_the_decoder() -> None:
    model = CASES["t5"].build()
    family = family_for(model)
    backbone = family.backbone(model)
    batch = CASES["t5"].batch(3, 1)
    n_encoder = len(backbone.encoder.block)
    stream = family.enter(backbone, batch)
    for index in range(n_encoder):
        stream = family.run_block(backbone, index, stream)
    with torch.no_grad():
        encoder_output = backbone.encoder(**batch).last_hidden_state
    hidden, mask = family.block_output(backbone, n_encoder - 1, stream)
    torch.testing.assert_close(hidden, encoder_output, atol=1e-6, rtol=0)
    assert torch.equal(mask, batch["attention_mask"].bool())
    # decoder block 0 cross-attends to exactly that encoder output; its k/v rows are encoder tokens
    assert stream.args[2] is stream.extras["encoder_output"]  # encoder_hidden_states
    assert stream.hidden.shape[1] == batch["input_ids"].shape[1]
    assert family.row_mask("layer.1.EncDecAttention.k", stream) is stream.extras["encoder_mask"]
    assert family.row_mask("layer.1.EncDecAttention.q", stream) is stream.mask
    # the pooled token is the last EOS of input_ids (what T5ForSequenceClassification reads)
    assert stream.pooled_index.tolist() == [6, 3, 5, 2]


def test_llama_pools_the_rightmost_non_pad_token() -> None:
    model = CASES["llama"].build()
    family = family_for(model)
    right = family.enter(family.backbone(model), CASES["llama"].batch(0, 0))
    left = family.enter(family.backbone(model), EXTRA_REPLAY_CASES["llama-left-padding"].batch(0, 0))
    assert right.pooled_index.tolist() == [7, 4, 1, 5]
    assert left.pooled_index.tolist() == [7, 7, 7, 7]
    assert "cache" not in right.kwargs and {"attention_mask", "position_embeddings"} <= set(right.kwargs)


def test_a_causal_lm_matches_every_real_token_and_a_classifier_its_last(tmp_path) -> None:
    """Llama, Qwen2 and Mistral are one family; its causal-LM variant pools nothing (the last block's
    moments weigh every real token alike), also for a bare decoder saved from a causal LM."""
    batch = CASES["qwen2"].batch(0, 0)
    classifier = family_for(CASES["qwen2"].build())
    assert classifier is FAMILIES["qwen2"] is FAMILIES["mistral"] is FAMILIES["llama"]
    assert classifier.enter(classifier.backbone(CASES["qwen2"].build()), batch).pooled_index.tolist() == [7, 4, 1, 5]
    for key in ("qwen2-causal-lm", "mistral-causal-lm"):
        model = CASES[key].build()
        family = family_for(model)
        assert family is not classifier and family.name == "llama"
        assert family.enter(family.backbone(model), batch).pooled_index is None
        model.save_pretrained(tmp_path / key)
        assert family_for(tf.AutoModel.from_pretrained(tmp_path / key)) is family
    assert family_for(tf.Qwen2Model(CASES["qwen2"].build().config)) is classifier


def test_unknown_architecture_is_refused_with_the_supported_list() -> None:
    model = tf.GPT2Model(tf.GPT2Config(n_embd=HIDDEN, n_layer=1, n_head=HEADS, vocab_size=VOCAB, n_positions=16))
    with pytest.raises(ValueError, match="unsupported architecture 'gpt2'") as info:
        family_for(model)
    for model_type in ("bert", "vit", "clip_vision_model", "llama", "qwen2", "mistral", "t5"):
        assert model_type in str(info.value)
    assert {"bert", "vit", "clip_vision_model", "llama", "qwen2", "mistral", "t5"} <= set(FAMILIES)


# --- 2. FeatCal lowers drift to the experts on every family, and the result round-trips ----------------


@pytest.mark.parametrize("case", CASES.values(), ids=CASES)
def test_featcal_lowers_feature_drift_and_round_trips(case: Case, tmp_path) -> None:
    base = case.build()
    family = family_for(base)
    experts = {t: fine_tuned_expert(base, case, i) for i, t in enumerate(TASKS)}
    merged = task_arithmetic(base, experts)
    batches = {t: [case.batch(1000 * i + j, i) for j in range(2)] for i, t in enumerate(TASKS)}

    before = layer_drift(case, merged, experts, batches)
    result = calibrate(merged, base, experts, batches, FeatCalConfig(), progress=False)
    calibrated = with_backbone(merged, family, result.backbone)
    after = layer_drift(case, calibrated, experts, batches)
    n_blocks = len(family.blocks(result.backbone))
    # T5: the encoder output (after final_layer_norm) follows the blocks
    encoder_output = len(after) - 1 if case.name == "t5" else None
    last_encoder_block = len(family.backbone(merged).encoder.block) - 1 if case.name == "t5" else None

    # every block's output (all real tokens) moves towards the experts' ...
    assert len(after) == len(before) == n_blocks + (case.name == "t5")
    for index, ((b, b_cos), (a, a_cos)) in enumerate(zip(before, after)):
        assert a < b, f"{case.name} block {index}: drift {a:.4g} after calibration, {b:.4g} before"
    # ... and so does what the head reads
    assert head_drift(family, calibrated, experts, batches) < head_drift(family, merged, experts, batches)

    # the driver's own per-layer drift agrees with this independent forward, except T5's last
    # encoder block: the driver compares the streams run_block returns, i.e. the decoder's input
    # embeddings there
    assert [d.layer for d in result.drift] == list(range(n_blocks))
    for d in result.drift:
        if d.layer != last_encoder_block:
            assert (d.l2, d.cosine) == pytest.approx(after[d.layer], rel=1e-5), d
    # featcal.evaluation.scoring.layer_drift (the evaluate stage's) too; at T5's last encoder block it measures
    # the encoder output
    measured = evaluate_layer_drift(family, experts, calibrated, batches)
    assert [d.layer for d in measured] == list(range(n_blocks))
    for d in measured:
        expected = after[encoder_output if d.layer == last_encoder_block else d.layer]
        assert (d.l2, d.cosine) == pytest.approx(expected, rel=1e-5), d

    # the calibrated model round-trips through save_pretrained / from_pretrained (safetensors)
    calibrated.save_pretrained(tmp_path)
    assert (tmp_path / "model.safetensors").exists()
    reloaded = type(calibrated).from_pretrained(tmp_path).eval()
    batch = case.batch(77, 1)
    assert torch.equal(outputs(reloaded, batch), outputs(calibrated, batch))
    reloaded_bb = family.backbone(reloaded).state_dict()
    for key, value in result.backbone.state_dict().items():
        assert torch.equal(reloaded_bb[key], value), key


# --- 3. nothing to correct: identical experts, merge and base leave the model unchanged ---------------


@pytest.mark.parametrize("case", CASES.values(), ids=CASES)
def test_identical_experts_leave_the_merged_model_unchanged(case: Case) -> None:
    base = case.build()
    family = family_for(base)
    experts = {t: copy.deepcopy(base) for t in TASKS[:2]}
    merged = copy.deepcopy(base)
    batches = {t: [case.batch(500 + i, i)] for i, t in enumerate(experts)}
    # float64 products: the identity is exact; float32 ones move a zero bias by ~1e-10
    result = calibrate(merged, base, experts, batches, FeatCalConfig(product_dtype="float64"), progress=False)
    before = dict(family.backbone(merged).named_parameters())
    for name, value in result.backbone.named_parameters():
        scale = float(before[name].detach().abs().max())
        torch.testing.assert_close(value.detach(), before[name].detach(), rtol=0, atol=1e-6 * scale + 1e-12)
