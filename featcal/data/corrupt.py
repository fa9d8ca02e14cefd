"""Seeded text corruptions for calibration data: character typos, word dropout, word shuffling.

Each takes a rate in [0, 1] and a `random.Random`, so a corrupted calibration set is reproducible.
Only calibration texts are corrupted; evaluation always reads clean test data.
"""

from __future__ import annotations

import random
import string
from typing import Callable

LETTERS = string.ascii_lowercase


def typos(text: str, rate: float, rng: random.Random) -> str:
    """Each word of two or more characters gets, with probability `rate`, one random edit:
    swap two adjacent characters, delete one, insert one, or substitute one."""
    words = text.split(" ")
    for i, word in enumerate(words):
        if len(word) < 2 or rng.random() >= rate:
            continue
        pos = rng.randrange(len(word) - 1)
        edit = rng.randrange(4)
        if edit == 0:
            word = word[:pos] + word[pos + 1] + word[pos] + word[pos + 2:]
        elif edit == 1:
            word = word[:pos] + word[pos + 1:]
        elif edit == 2:
            word = word[:pos] + rng.choice(LETTERS) + word[pos:]
        else:
            word = word[:pos] + rng.choice(LETTERS) + word[pos + 1:]
        words[i] = word
    return " ".join(words)


def word_dropout(text: str, rate: float, rng: random.Random) -> str:
    """Drop each word with probability `rate` (at least one word is kept)."""
    words = text.split()
    kept = [w for w in words if rng.random() >= rate]
    return " ".join(kept or words[:1])


def word_shuffle(text: str, rate: float, rng: random.Random) -> str:
    """Pick a `rate` fraction of word positions and permute the words among them."""
    words = text.split()
    k = int(round(rate * len(words)))
    if k < 2:
        return " ".join(words)
    positions = sorted(rng.sample(range(len(words)), k))
    moved = [words[p] for p in positions]
    rng.shuffle(moved)
    for p, w in zip(positions, moved):
        words[p] = w
    return " ".join(words)


CORRUPTIONS: dict[str, Callable[[str, float, random.Random], str]] = {
    "typos": typos,
    "word_dropout": word_dropout,
    "word_shuffle": word_shuffle,
}


def corrupt_texts(texts: list[str], kind: str, rate: float, seed: int) -> list[str]:
    """A corrupted copy of `texts`; the same (kind, rate, seed) always gives the same copy."""
    if kind not in CORRUPTIONS:
        raise ValueError(f"unknown corruption {kind!r}; expected one of {sorted(CORRUPTIONS)}")
    if not 0.0 <= rate <= 1.0:
        raise ValueError(f"corruption rate must be in [0, 1], got {rate}")
    rng = random.Random(f"{kind}:{rate}:{seed}")
    return [CORRUPTIONS[kind](t, rate, rng) for t in texts]
