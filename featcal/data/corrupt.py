"""Seeded corruptions of calibration data: for texts character typos, word dropout and word
shuffling; for images (PNG bytes, `featcal.data.images`) Gaussian noise, pixel dropout and an
occluding square.

Each takes a rate in [0, 1] and a seeded generator, so a corrupted calibration set is
reproducible. Only calibration examples are corrupted; evaluation always reads clean test data.
"""

from __future__ import annotations

import random
import string
from typing import Callable

import numpy as np

from featcal.data.images import holds_images, pixels, to_png

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


def gaussian_noise(image: np.ndarray, rate: float, rng: np.random.Generator) -> np.ndarray:
    """Add N(0, (rate * 255)^2) to every pixel value, clipped to 0..255."""
    noisy = image.astype(np.float64) + rng.normal(0.0, rate * 255.0, image.shape)
    return np.clip(np.rint(noisy), 0, 255).astype(np.uint8)


def pixel_dropout(image: np.ndarray, rate: float, rng: np.random.Generator) -> np.ndarray:
    """Set each pixel (all its channels) to black with probability `rate`."""
    keep = rng.random(image.shape[:2]) >= rate
    return image * (keep[..., None] if image.ndim == 3 else keep).astype(np.uint8)


def occlusion(image: np.ndarray, rate: float, rng: np.random.Generator) -> np.ndarray:
    """A mid-grey square covering a `rate` fraction of the image, at a random place."""
    h, w = image.shape[:2]
    side = int(round((rate * h * w) ** 0.5))
    out = image.copy()
    if side:
        top, left = rng.integers(0, h - min(side, h) + 1), rng.integers(0, w - min(side, w) + 1)
        out[top:top + side, left:left + side] = 128
    return out


TEXT_CORRUPTIONS: dict[str, Callable[[str, float, random.Random], str]] = {
    "typos": typos,
    "word_dropout": word_dropout,
    "word_shuffle": word_shuffle,
}
IMAGE_CORRUPTIONS: dict[str, Callable[[np.ndarray, float, np.random.Generator], np.ndarray]] = {
    "gaussian_noise": gaussian_noise,
    "pixel_dropout": pixel_dropout,
    "occlusion": occlusion,
}
CORRUPTIONS = {**TEXT_CORRUPTIONS, **IMAGE_CORRUPTIONS}


def corrupt_examples(examples: list, kind: str, rate: float, seed: int) -> list:
    """A corrupted copy of a task's examples (texts, or images as PNG bytes); the same (kind,
    rate, seed) always gives the same copy. A text corruption of images (or the reverse) is an
    error naming the kinds that apply."""
    if kind not in CORRUPTIONS:
        raise ValueError(f"unknown corruption {kind!r}; expected one of {sorted(CORRUPTIONS)}")
    if not 0.0 <= rate <= 1.0:
        raise ValueError(f"corruption rate must be in [0, 1], got {rate}")
    images = holds_images(examples)
    kinds = IMAGE_CORRUPTIONS if images else TEXT_CORRUPTIONS
    if kind not in kinds:
        raise ValueError(f"corruption {kind!r} does not apply to {'image' if images else 'text'} examples; "
                         f"use one of {sorted(kinds)}")
    rng = random.Random(f"{kind}:{rate}:{seed}")
    if not images:
        return [TEXT_CORRUPTIONS[kind](t, rate, rng) for t in examples]
    generator = np.random.default_rng(rng.getrandbits(64))
    return [to_png(IMAGE_CORRUPTIONS[kind](pixels(png), rate, generator), f"example {i}")
            for i, png in enumerate(examples)]
