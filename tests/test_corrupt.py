"""Calibration-data corruptions: seeded, rate-controlled, and they really change the text."""

import pytest

from featcal.data.corrupt import CORRUPTIONS, corrupt_texts

TEXTS = ["the quick brown fox jumps over the lazy dog again and again today"] * 20


@pytest.mark.parametrize("kind", sorted(CORRUPTIONS))
def test_corruption_is_reproducible_for_a_seed_and_changes_text(kind):
    a = corrupt_texts(TEXTS, kind, 0.3, seed=1)
    assert a == corrupt_texts(TEXTS, kind, 0.3, seed=1)
    assert a != corrupt_texts(TEXTS, kind, 0.3, seed=2)
    assert sum(x != y for x, y in zip(a, TEXTS)) >= 10


@pytest.mark.parametrize("kind", sorted(CORRUPTIONS))
def test_rate_zero_leaves_text_unchanged(kind):
    assert corrupt_texts(TEXTS, kind, 0.0, seed=0) == TEXTS


def test_word_dropout_rate_matches_dropped_fraction():
    out = corrupt_texts(TEXTS, "word_dropout", 0.25, seed=0)
    kept = sum(len(t.split()) for t in out) / sum(len(t.split()) for t in TEXTS)
    assert 0.65 < kept < 0.85


def test_word_shuffle_keeps_the_multiset_of_words():
    for before, after in zip(TEXTS, corrupt_texts(TEXTS, "word_shuffle", 0.5, seed=3)):
        assert sorted(before.split()) == sorted(after.split())


def test_unknown_corruption_and_bad_rate_are_refused():
    with pytest.raises(ValueError, match="blur"):
        corrupt_texts(TEXTS, "blur", 0.1, seed=0)
    with pytest.raises(ValueError, match="rate"):
        corrupt_texts(TEXTS, "typos", 1.5, seed=0)
