"""Images as task examples: one canonical encoding (PNG bytes) whatever the source gave.

Task splits store images as PNG bytes in the parquet column ``image``, so an image task is
deduplicated, split, cached and hashed like a text task; `decode` turns them back into PIL
images for the model's image processor. Sources give images as encoded bytes, Hugging Face
``datasets`` image cells (``{"bytes": ..., "path": ...}``), file paths, PIL images or arrays.
"""

from __future__ import annotations

import io
import os
from pathlib import Path
from typing import TYPE_CHECKING, Any, Iterable, Sequence

import numpy as np

if TYPE_CHECKING:
    import pandas as pd

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


def read_image_folder(folder: Path, task: str) -> pd.DataFrame:
    """``<folder>/<class>/<image>`` (or ``<folder>/<split>/<class>/<image>`` with split
    train/dev/validation/test): columns ``image`` (PNG bytes), ``label`` (the class folder's name)
    and, for the second layout, ``split``."""
    from featcal.data.spec import _SPLIT_ALIASES

    subdirs = sorted(p for p in folder.iterdir() if p.is_dir())
    if not subdirs:
        raise ValueError(f"task {task!r}: image folder {folder} has no class folders")
    by_split = all(p.name.lower() in _SPLIT_ALIASES for p in subdirs)
    rows = []
    for split_dir in subdirs if by_split else [folder]:
        for class_dir in sorted(p for p in split_dir.iterdir() if p.is_dir()):
            for file in sorted(class_dir.iterdir()):
                if file.suffix.lower() in IMAGE_SUFFIXES:
                    row = {"image": to_png(file, f"task {task!r} ({file})"), "label": class_dir.name}
                    if by_split:
                        row["split"] = split_dir.name
                    rows.append(row)
    if not rows:
        raise ValueError(f"task {task!r}: no images ({', '.join(IMAGE_SUFFIXES)}) under {folder}")
    import pandas as pd

    frame = pd.DataFrame(rows)
    frame.attrs["source_file"] = str(folder)
    frame.attrs["image_field"] = "image"
    return frame
