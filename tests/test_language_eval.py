"""Scoring causal LMs: token NLL and multiple choice, against sums computed here from the model's own
logits on each unpadded sequence (no featcal code)."""

import math

import pytest
import torch
from transformers import BertTokenizer

from featcal.evaluation.language import ChoiceItem, choice_accuracy, choice_log_likelihoods, text_nll
from featcal.evaluation.scoring import gap_closed
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


def test_the_gap_closed_in_nll_terms_is_the_share_of_the_merges_nll_increase_removed():
    assert gap_closed(2.0, 3.0, 2.25) == 0.75   # expert, merged, calibrated NLLs
    assert gap_closed(2.0, 3.0, 3.5) == -0.5
    assert gap_closed(2.0, 2.0, 2.1) is None


def test_a_causal_lm_expert_round_trips_the_multitask_layout_and_is_scored_by_its_nll(lm, tokenizer, tmp_path):
    """A tied LM head is the embeddings' (no head tensor is written); the one scorer of the project
    gives a causal LM's task its mean token NLL."""
    from featcal.data.encoders import TextEncoder
    from featcal.data.splits import TaskSplit
    from featcal.evaluation.language import split_nll
    from featcal.evaluation.scoring import score_backbone
    from featcal.io.checkpoints import load_head
    from featcal.io.models import head_state, load_backbone, load_task_model, save_multitask

    assert head_state(lm) == {}
    untied = tiny_causal_lm("qwen2", vocab=len(VOCAB), hidden=16)
    untied.config.tie_word_embeddings = False
    untied.lm_head.weight = torch.nn.Parameter(untied.lm_head.weight.detach().clone())
    assert list(head_state(untied)) == ["lm_head.weight"]

    save_multitask(tmp_path / "multi", lm.model, {"news": lm})
    from safetensors.torch import load_file
    assert load_file(tmp_path / "multi/heads/news/head.safetensors") == {}
    rebuilt = load_task_model(tmp_path / "multi", "news")
    ids = torch.tensor([[5, 6, 7, 8]])
    with torch.no_grad():
        assert torch.equal(rebuilt(input_ids=ids).logits, lm(input_ids=ids).logits)

    texts = ["the good movie and the film", "bad news", "a great team"]
    split = TaskSplit("news", "test", texts, torch.zeros(3, dtype=torch.long))
    encoder = TextEncoder(tokenizer)
    lm.save_pretrained(tmp_path / "expert")
    scores = score_backbone(load_backbone(str(tmp_path / "multi")), {"news": load_head(tmp_path / "expert")}, encoder,
                            {"news": split}, {"news": 16})
    assert scores["news"] == pytest.approx(split_nll(lm, encoder, split, 16), rel=1e-6)
    assert 1.0 < scores["news"] < 10.0   # nats per token: an NLL, not an accuracy


def test_a_causal_lm_checkpoint_loads_as_itself_or_with_a_new_head_as_a_classifier(lm, tmp_path):
    from transformers import Qwen2ForCausalLM, Qwen2ForSequenceClassification

    from featcal.io.models import load_classifier

    lm.save_pretrained(tmp_path / "lm")
    assert type(load_classifier(str(tmp_path / "lm"))) is Qwen2ForCausalLM
    classifier = load_classifier(str(tmp_path / "lm"), num_labels=3)
    assert type(classifier) is Qwen2ForSequenceClassification and classifier.config.num_labels == 3
