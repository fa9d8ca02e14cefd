"""Scoring causal language models: mean token negative log-likelihood and perplexity on held-out
text, and multiple-choice accuracy from the choices' log-likelihoods.

Multiple choice is scored as lm-evaluation-harness scores it: each choice is a continuation of the
context; its score is the sum of its tokens' log-probabilities given everything before them
(`acc`), or that sum divided by the choice's length in characters (`acc_norm`). The continuation's
tokens are those of `context + choice` past the context's own tokens, so a tokenizer that merges
across the boundary is handled as the harness handles it.

Text is right-padded here: a left-padded batch would shift the models' position ids. The gap a
calibration closes in NLL terms, (merged − calibrated) ÷ (merged − expert) on each expert's own task,
is `featcal.evaluation.scoring.gap_closed` of the three NLLs.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Iterable, Mapping, Sequence

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from featcal.data.encoders import InputEncoder, check_examples
from featcal.data.splits import TaskSplit, encode_batches

LM_BATCH_SIZE = 16   # texts per forward: the logits are [batch, length, vocabulary] (151,936 for Qwen2)


@dataclass(frozen=True)
class TextScores:
    """Mean negative log-likelihood per predicted token (nats), its perplexity, and the count."""

    nll: float
    perplexity: float
    tokens: int


@dataclass(frozen=True)
class ChoiceItem:
    """One multiple-choice question: a context, its candidate continuations, the right one's index."""

    context: str
    choices: tuple[str, ...]
    answer: int


@dataclass(frozen=True)
class ChoiceScores:
    acc: float
    acc_norm: float
    items: int


def token_log_probs(model: nn.Module, input_ids: Tensor, attention_mask: Tensor) -> tuple[Tensor, Tensor]:
    """log p(token t | tokens < t) for t ≥ 1 ([B, T-1], float64), and which of them count: a real
    token after a real token. The softmax runs in the logits' dtype, one batch at a time."""
    return logits_log_probs(model(input_ids=input_ids, attention_mask=attention_mask).logits, input_ids, attention_mask)


def logits_log_probs(logits: Tensor, input_ids: Tensor, attention_mask: Tensor) -> tuple[Tensor, Tensor]:
    """`token_log_probs` from a causal LM's logits ([B, T, V]) for these texts: the one place the
    next-token log-probabilities are taken, whether the logits come from a whole model's forward or
    from its LM head run a few texts at a time (`featcal.evaluation.streamed`)."""
    targets = input_ids[:, 1:]
    logp = -F.cross_entropy(logits[:, :-1].float().transpose(1, 2), targets, reduction="none")
    valid = attention_mask[:, 1:].bool() & attention_mask[:, :-1].bool()
    return logp.double() * valid, valid


def mean_token_nll(log_probs: Iterable[tuple[Tensor, Tensor]]) -> TextScores:
    """Mean NLL and perplexity from each batch's (`token_log_probs`) pair: float64 sums per batch,
    added in batch order."""
    total, count = 0.0, 0
    for logp, valid in log_probs:
        total -= float(logp.sum())
        count += int(valid.sum())
    if count == 0:
        raise ValueError("no tokens to score: every text is shorter than two tokens")
    nll = total / count
    return TextScores(nll, math.exp(nll), count)


@torch.no_grad()
def text_nll(model: nn.Module, batches: Iterable[Mapping[str, Tensor]]) -> TextScores:
    """Mean token NLL and perplexity of `model` over `batches` (input_ids, attention_mask; right padding)."""
    model.eval()
    return mean_token_nll(token_log_probs(model, b["input_ids"], b["attention_mask"]) for b in batches)


def split_batches(encoder: InputEncoder, split: TaskSplit, max_length: int,
                  batch_size: int = LM_BATCH_SIZE) -> list[dict[str, Tensor]]:
    """A task split's texts encoded in batches (each text truncated to `max_length` tokens), as a
    causal LM is scored on them; a tokenizer that pads on the left is an error naming the task."""
    check_examples(encoder, split.examples, split.task)
    batches = encode_batches(encoder, list(split.examples), max_length, batch_size)
    if any(bool((b["attention_mask"][:, 0] == 0).any()) for b in batches):
        raise ValueError(f"task {split.task!r}: the tokenizer pads on the left; language-model scores need right "
                         "padding (tokenizer.padding_side = 'right')")
    return batches


def split_nll(model: nn.Module, encoder: InputEncoder, split: TaskSplit, max_length: int,
              batch_size: int = LM_BATCH_SIZE) -> float:
    """A causal LM's mean token NLL on a task split's texts (`split_batches`): the score of a
    language-model task, as accuracy is a classifier's (lower is better)."""
    return text_nll(model, split_batches(encoder, split, max_length, batch_size)).nll


def _continuation_ids(tokenizer, context: str, choice: str) -> tuple[list[int], list[int]]:
    whole = tokenizer(context + choice, add_special_tokens=False)["input_ids"]
    n_context = len(tokenizer(context, add_special_tokens=False)["input_ids"])
    return whole[:n_context], whole[n_context:]


@torch.no_grad()
def choice_log_likelihoods(model: nn.Module, tokenizer, item: ChoiceItem) -> list[float]:
    """Each choice's summed log-likelihood as a continuation of the item's context (one batch)."""
    rows, spans = [], []
    for choice in item.choices:
        context, continuation = _continuation_ids(tokenizer, item.context, choice)
        if not continuation:
            raise ValueError(f"choice {choice!r} of {item.context[:40]!r}...: no tokens of its own")
        if not context:   # the first token needs something before it: the BOS (or EOS) token
            start = next((t for t in (tokenizer.bos_token_id, tokenizer.eos_token_id) if t is not None), None)
            if start is None:
                raise ValueError(f"choice {choice!r}: the context is empty and the tokenizer has no BOS or EOS "
                                 "token to condition the first token on")
            context = [start]
        rows.append(context + continuation)
        spans.append((len(context), len(context) + len(continuation)))
    width = max(len(r) for r in rows)
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0
    ids = torch.full((len(rows), width), pad, dtype=torch.long)
    mask = torch.zeros((len(rows), width), dtype=torch.long)
    for i, row in enumerate(rows):
        ids[i, :len(row)] = torch.tensor(row)
        mask[i, :len(row)] = 1
    logp, _ = token_log_probs(model, ids, mask)
    # logp[:, t - 1] scores token t: a continuation [a, b) is logp[:, a-1 : b-1]
    return [float(logp[i, a - 1:b - 1].sum()) for i, (a, b) in enumerate(spans)]


def choice_accuracy(model: nn.Module, tokenizer, items: Sequence[ChoiceItem]) -> ChoiceScores:
    """`acc` and `acc_norm` (per-character) over `items`."""
    if not items:
        raise ValueError("no multiple-choice items to score")
    model.eval()
    right = right_norm = 0
    for item in items:
        scores = choice_log_likelihoods(model, tokenizer, item)
        normed = [s / max(len(c), 1) for s, c in zip(scores, item.choices)]
        right += max(range(len(scores)), key=scores.__getitem__) == item.answer
        right_norm += max(range(len(normed)), key=normed.__getitem__) == item.answer
    return ChoiceScores(right / len(items), right_norm / len(items), len(items))


__all__ = ["ChoiceItem", "ChoiceScores", "TextScores", "choice_accuracy", "choice_log_likelihoods",
           "logits_log_probs", "mean_token_nll", "split_batches", "split_nll", "text_nll", "token_log_probs"]
