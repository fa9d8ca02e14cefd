"""Scoring causal LMs: token NLL and multiple choice, against sums computed here from the model's own
logits on each unpadded sequence (no featcal code)."""

import math

import pytest
import torch
from transformers import BertTokenizer

from featcal.evaluation.language import ChoiceItem, choice_accuracy, choice_log_likelihoods, nll_gap_closed, text_nll
from conftest import tiny_causal_lm
from tiny_project import WORDS, make_vocab

VOCAB = make_vocab(WORDS)


@pytest.fixture(scope="module")
def lm():
    return tiny_causal_lm("qwen2", vocab=len(VOCAB), hidden=16)


@pytest.fixture(scope="module")
def tokenizer():
    return BertTokenizer(vocab={w: i for i, w in enumerate(VOCAB)})


def log_likelihood(model, ids: list[int]) -> list[float]:
    """log p(ids[t] | ids[:t]) for t ≥ 1, from one forward of the unpadded sequence."""
    with torch.no_grad():
        logp = torch.log_softmax(model(input_ids=torch.tensor([ids])).logits[0].double(), -1)
    return [float(logp[t - 1, ids[t]]) for t in range(1, len(ids))]


def test_text_nll_is_the_token_mean_over_real_tokens_of_right_padded_batches(lm, tokenizer):
    texts = ["the good movie and the film", "bad news", "a great team and a party vote"]
    rows = [tokenizer(t, add_special_tokens=False)["input_ids"] for t in texts]
    per_token = [lp for r in rows for lp in log_likelihood(lm, r)]
    enc = tokenizer(texts, add_special_tokens=False, padding=True, return_tensors="pt")
    batches = [{k: v[:2] for k, v in enc.items()}, {k: v[2:] for k, v in enc.items()}]
    scores = text_nll(lm, batches)
    assert scores.tokens == len(per_token) == sum(len(r) - 1 for r in rows)
    assert scores.nll == pytest.approx(-sum(per_token) / len(per_token), rel=1e-6)
    assert scores.perplexity == pytest.approx(math.exp(scores.nll))
    # HF's own loss on one unpadded text agrees
    ids = torch.tensor([rows[0]])
    with torch.no_grad():
        assert text_nll(lm, [{"input_ids": ids, "attention_mask": torch.ones_like(ids)}]).nll == pytest.approx(
            float(lm(input_ids=ids, labels=ids).loss), rel=1e-5)


def test_choices_are_scored_by_their_continuation_tokens_only(lm, tokenizer):
    item = ChoiceItem("the movie was", (" good", " bad and awful", " great"), answer=1)
    scores = choice_log_likelihoods(lm, tokenizer, item)
    context = tokenizer(item.context, add_special_tokens=False)["input_ids"]
    for choice, score in zip(item.choices, scores):
        ids = tokenizer(item.context + choice, add_special_tokens=False)["input_ids"]
        expected = sum(log_likelihood(lm, ids)[len(context) - 1:])
        assert score == pytest.approx(expected, rel=1e-6), choice
    # the answer the model prefers is right, another one wrong; acc_norm divides by characters
    best = max(range(3), key=scores.__getitem__)
    normed = max(range(3), key=lambda i: scores[i] / len(item.choices[i]))
    right = ChoiceItem(item.context, item.choices, best)
    wrong = ChoiceItem(item.context, item.choices, (best + 1) % 3)
    result = choice_accuracy(lm, tokenizer, [right, wrong, right])
    assert (result.acc, result.items) == (pytest.approx(2 / 3), 3)
    assert result.acc_norm == pytest.approx(((normed == best) * 2 + (normed == (best + 1) % 3)) / 3)


def test_an_empty_context_needs_a_start_token(lm, tokenizer):
    with pytest.raises(ValueError, match="no BOS or EOS"):
        choice_log_likelihoods(lm, tokenizer, ChoiceItem("", ("good",), 0))


def test_nll_gap_closed_is_the_share_of_the_merges_nll_increase_removed():
    assert nll_gap_closed(expert=2.0, merged=3.0, calibrated=2.25) == 0.75
    assert nll_gap_closed(expert=2.0, merged=3.0, calibrated=3.5) == -0.5
    assert nll_gap_closed(expert=2.0, merged=2.0, calibrated=2.1) is None
