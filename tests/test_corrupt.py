"""Calibration-data corruptions: seeded, rate-controlled, they really change the examples, and
each applies to its own kind of example."""

import numpy as np
import pytest

from featcal.data.corpora import load_digits
from featcal.data.corrupt import CORRUPTIONS, IMAGE_CORRUPTIONS, TEXT_CORRUPTIONS, corrupt_examples
from featcal.data.images import pixels, to_png

TEXTS = ["the quick brown fox jumps over the lazy dog again and again today"] * 20
IMAGES = [to_png(np.full((8, 8), 100, dtype=np.uint8), "grey")] * 20


def examples_for(kind: str) -> list:
    return IMAGES if kind in IMAGE_CORRUPTIONS else TEXTS


@pytest.mark.parametrize("kind", sorted(CORRUPTIONS))
def test_corruption_is_reproducible_for_a_seed_and_changes_the_examples(kind):
    examples = examples_for(kind)
    a = corrupt_examples(examples, kind, 0.3, seed=1)
    assert a == corrupt_examples(examples, kind, 0.3, seed=1)
    assert a != corrupt_examples(examples, kind, 0.3, seed=2)
    assert sum(x != y for x, y in zip(a, examples)) >= 10


@pytest.mark.parametrize("kind", sorted(CORRUPTIONS))
def test_rate_zero_leaves_the_examples_unchanged(kind):
    examples = examples_for(kind)
    out = corrupt_examples(examples, kind, 0.0, seed=0)
    if kind in IMAGE_CORRUPTIONS:
        assert all(np.array_equal(pixels(a), pixels(b)) for a, b in zip(out, examples))
    else:
        assert out == examples


def test_word_dropout_rate_matches_dropped_fraction():
    out = corrupt_examples(TEXTS, "word_dropout", 0.25, seed=0)
    kept = sum(len(t.split()) for t in out) / sum(len(t.split()) for t in TEXTS)
    assert 0.65 < kept < 0.85


def test_word_shuffle_keeps_the_multiset_of_words():
    for before, after in zip(TEXTS, corrupt_examples(TEXTS, "word_shuffle", 0.5, seed=3)):
        assert sorted(before.split()) == sorted(after.split())


def test_image_corruptions_do_what_they_say_on_real_digits():
    digits = list(load_digits()["image"][:50])
    clean = np.stack([pixels(x) for x in digits]).astype(np.int64)
    dropped = np.stack([pixels(x) for x in corrupt_examples(digits, "pixel_dropout", 0.25, seed=0)]).astype(np.int64)
    changed = dropped != clean
    assert (dropped[changed] == 0).all()                                    # a dropped pixel is black
    blacked = ((dropped == 0) & (clean != 0)).sum() / (clean != 0).sum()
    assert 0.18 < blacked < 0.32
    noisy = np.stack([pixels(x) for x in corrupt_examples(digits, "gaussian_noise", 0.1, seed=0)]).astype(np.int64)
    inside = (clean > 60) & (clean < 195)                                   # away from clipping
    assert 0.07 * 255 < (noisy - clean)[inside].std() < 0.13 * 255
    occluded = np.stack([pixels(x) for x in corrupt_examples(digits, "occlusion", 0.25, seed=0)])
    assert ((occluded == 128).reshape(50, -1).sum(1) >= 16).all()           # a 4x4 square on each 8x8 digit


def test_unknown_or_mismatched_corruption_and_bad_rate_are_refused():
    with pytest.raises(ValueError, match="blur"):
        corrupt_examples(TEXTS, "blur", 0.1, seed=0)
    with pytest.raises(ValueError, match="rate"):
        corrupt_examples(TEXTS, "typos", 1.5, seed=0)
    with pytest.raises(ValueError, match=r"'typos' does not apply to image examples.*gaussian_noise"):
        corrupt_examples(IMAGES, "typos", 0.1, seed=0)
    with pytest.raises(ValueError, match=r"'occlusion' does not apply to text examples.*typos"):
        corrupt_examples(TEXTS, "occlusion", 0.1, seed=0)
    assert set(CORRUPTIONS) == set(TEXT_CORRUPTIONS) | set(IMAGE_CORRUPTIONS)
