"""Images as task examples: one canonical encoding (PNG bytes) whatever the source gave.

Task splits store images as PNG bytes in the parquet column ``image``, so an image task is
deduplicated, split, cached and hashed like a text task; `decode` turns them back into PIL
images for the model's image processor. Sources give images as encoded bytes, Hugging Face
``datasets`` image cells (``{"bytes": ..., "path": ...}``), file paths, PIL images or arrays.
"""

from __future__ import annotations

import io
import os
from typing import Any, Iterable, Sequence

import numpy as np

IMAGE_SUFFIXES = (".png", ".jpg", ".jpeg", ".bmp", ".gif", ".webp", ".tif", ".tiff")


def to_png(value: Any, where: str) -> bytes:
    """PNG bytes of one image cell; `where` names the task and row in errors."""
    from PIL import Image, UnidentifiedImageError

    if isinstance(value, dict):   # a `datasets` Image cell read without decoding
        value = value.get("bytes") or value.get("path")
    try:
        if isinstance(value, Image.Image):
            image = value
        elif isinstance(value, (bytes, bytearray, memoryview)):
            image = Image.open(io.BytesIO(bytes(value)))
        elif isinstance(value, (str, os.PathLike)):
            image = Image.open(value)
        elif isinstance(value, np.ndarray):
            image = Image.fromarray(value)
        else:
            raise ValueError(f"{where}: an image cell holds {type(value).__name__}, not image bytes, a path or an array")
        image.load()
    except (OSError, UnidentifiedImageError) as err:
        raise ValueError(f"{where}: not a readable image: {err}") from None
    out = io.BytesIO()
    image.save(out, format="PNG")
    return out.getvalue()


def holds_images(examples: Sequence) -> bool:
    """Whether a task's examples are images (PNG bytes) rather than texts."""
    return bool(examples) and isinstance(examples[0], (bytes, bytearray))


def example_column(columns: Iterable[str]) -> str:
    """The column of a task's frame or split file that holds its examples: ``image`` or ``text``."""
    return "image" if "image" in columns else "text"


def pixels(png: bytes) -> np.ndarray:
    """The stored pixels as an array (H x W, or H x W x channels), in the image's own mode."""
    from PIL import Image

    return np.asarray(Image.open(io.BytesIO(png)))


def decode(png: bytes, mode: str = "RGB"):
    """The PIL image of stored bytes, in `mode` (the image processors expect RGB)."""
    from PIL import Image

    return Image.open(io.BytesIO(png)).convert(mode)
