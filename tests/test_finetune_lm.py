"""Causal-LM experts as LoRA fine-tunes merged into full weights (featcal.finetune_lm), on a tiny
random Qwen2 and a word-level tokenizer."""

import copy

import pytest
import torch
from transformers import BertTokenizer

from featcal.data.encoders import TextEncoder
from featcal.finetune_lm import LoraSettings, finetune_lora, lm_batch
from conftest import tiny_causal_lm
from tiny_project import WORDS, make_vocab

VOCAB = make_vocab(WORDS)
TEXTS = ["the good movie and the great film", "a bad film and an awful movie", "the team and the sport news",
         "a vote and a party and the news"]


@pytest.fixture(scope="module")
def encoder():
    return TextEncoder(BertTokenizer(vocab={w: i for i, w in enumerate(VOCAB)}))


def lora_run(encoder, **changes):
    base = tiny_causal_lm("qwen2", layers=3, vocab=len(VOCAB), hidden=16)
    settings = LoraSettings(rank=2, steps=12, batch_size=2, learning_rate=3e-2, **changes)
    expert, losses = finetune_lora(copy.deepcopy(base), encoder, TEXTS, settings, progress=False)
    return base, expert, losses


def test_lora_lowers_the_loss_and_changes_only_the_adapted_linears_by_a_low_rank_delta(encoder):
    base, expert, losses = lora_run(encoder, layers=(1, 2))
    assert type(expert) is type(base) and not any("lora" in n for n, _ in expert.named_parameters())
    assert sum(losses[-3:]) < sum(losses[:3])
    before, after = base.state_dict(), expert.state_dict()
    assert list(before) == list(after)
    changed = {n for n in before if not torch.equal(before[n], after[n])}
    assert changed == {f"model.layers.{k}.self_attn.{m}_proj.weight" for k in (1, 2) for m in "qv"}
    for name in changed:
        assert torch.linalg.matrix_rank((after[name] - before[name]).double(), atol=1e-6) <= 2, name
    # the merged expert's loss on its texts is below the base's
    batch = lm_batch(encoder, TEXTS, 16)
    with torch.no_grad():
        assert float(expert(**batch).loss) < float(base(**batch).loss)


def test_lora_is_deterministic_for_a_seed_and_moves_with_it(encoder):
    a, b, c = (lora_run(encoder, seed=s)[1].state_dict() for s in (0, 0, 1))
    assert all(torch.equal(a[n], b[n]) for n in a)
    assert any(not torch.equal(a[n], c[n]) for n in a)


def test_no_texts_is_an_error_naming_the_run(encoder):
    with pytest.raises(ValueError, match="news: no texts"):
        finetune_lora(tiny_causal_lm("qwen2"), encoder, [], LoraSettings(), progress=False, desc="news")
