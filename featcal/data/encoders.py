"""What turns a task's examples into model inputs: the base model's tokenizer for text tasks, its
image processor for image tasks. One interface, so splitting, fine-tuning, caching, scoring and
tuning never ask which kind of task they hold."""

from __future__ import annotations

import importlib.util
import os
from typing import Mapping, Sequence

from torch import Tensor

from featcal.data.images import decode, holds_images

class TextEncoder:
    """Tokenised, truncated to `max_length`; padded to the longest in the call, or to `pad_to`."""

    kind = "text"

    def __init__(self, tokenizer):
        self.tokenizer = tokenizer

    def encode(self, examples: Sequence[str], max_length: int, pad_to: int | None = None) -> dict[str, Tensor]:
        if pad_to is None:
            return dict(self.tokenizer(list(examples), truncation=True, max_length=max_length, padding=True,
                                       return_tensors="pt"))
        enc = self.tokenizer(list(examples), truncation=True, max_length=max_length, padding="max_length",
                             return_tensors="pt")
        return {k: v[:, :pad_to] for k, v in enc.items()}

    def width(self, examples: Sequence[str], max_length: int) -> int:
        """The longest tokenised length among `examples`, capped at max_length."""
        lengths = [len(ids) for ids in self.tokenizer(list(examples), truncation=True, max_length=max_length)["input_ids"]]
        return max(lengths) if lengths else 1

    def identities(self, examples: Sequence[str], max_length: int) -> list[tuple]:
        """What the model sees of each example (its token ids), to find examples it cannot tell apart."""
        return [tuple(ids) for ids in self.tokenizer(list(examples), truncation=True, max_length=max_length)["input_ids"]]

    def input_identities(self, inputs: Mapping[str, Tensor]) -> list[tuple]:
        """`identities` of encoded rows (padded batches: the real tokens' ids)."""
        return [tuple(ids[m.bool()].tolist()) for ids, m in zip(inputs["input_ids"], inputs["attention_mask"])]

    def save_pretrained(self, folder: str | os.PathLike) -> None:
        self.tokenizer.save_pretrained(folder)


class ImageEncoder:
    """Images (PNG bytes, `featcal.data.images`) through the model's image processor into
    `pixel_values`; every image has the processor's size, so lengths play no part."""

    kind = "image"

    def __init__(self, processor):
        self.processor = processor

    def encode(self, examples: Sequence[bytes], max_length: int | None = None, pad_to: int | None = None) -> dict[str, Tensor]:
        return {"pixel_values": self.processor([decode(x) for x in examples], return_tensors="pt")["pixel_values"]}

    def width(self, examples: Sequence[bytes], max_length: int | None = None) -> int:
        return 0

    def identities(self, examples: Sequence[bytes], max_length: int | None = None) -> list[tuple]:
        return self.input_identities(self.encode(examples))

    def input_identities(self, inputs: Mapping[str, Tensor]) -> list[tuple]:
        """What the model sees of each encoded image: its pixel values."""
        return [tuple(row.flatten().tolist()) for row in inputs["pixel_values"]]

    def save_pretrained(self, folder: str | os.PathLike) -> None:
        self.processor.save_pretrained(folder)


InputEncoder = TextEncoder | ImageEncoder


def check_examples(encoder: InputEncoder, examples: Sequence, task: str) -> None:
    """A task's examples are of the kind the model reads (images for a vision model, texts for a
    text model); else an error naming the task, before any of them is encoded."""
    images = holds_images(examples)
    if examples and images != (encoder.kind == "image"):
        have, reads = ("images", "texts") if images else ("texts", "images")
        raise ValueError(f"task {task!r} holds {have}, but the model reads {reads}: an image task needs a vision "
                         "base model (ViT) and a text task a text one (model.base), in one project")


def load_encoder(ref: str | os.PathLike) -> InputEncoder:
    """The input encoder saved with a model (a folder, hub id, `package:` or `parts:` reference):
    its image processor for vision models, else its tokenizer."""
    from transformers import AutoConfig, AutoImageProcessor, AutoTokenizer

    from featcal.io.models import is_image_model, resolve_model_ref

    path = resolve_model_ref(ref)
    if is_image_model(AutoConfig.from_pretrained(path).model_type):
        # without torchvision, transformers falls back to the PIL processor with a warning: ask for it
        backend = {} if importlib.util.find_spec("torchvision") else {"backend": "pil"}
        try:
            return ImageEncoder(AutoImageProcessor.from_pretrained(path, **backend))
        except OSError as err:
            raise FileNotFoundError(f"{ref}: an image model needs its image processor "
                                    f"(preprocessor_config.json): {err}") from None
    return TextEncoder(AutoTokenizer.from_pretrained(path))

