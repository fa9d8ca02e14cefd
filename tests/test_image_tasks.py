"""Image tasks in the data package: every source kind stores PNG bytes that decode to the same
pixels, duplicates collapse, splits never share an image, and the encoder makes pixel batches."""

from __future__ import annotations

import io

import numpy as np
import pandas as pd
import pytest
import torch
from PIL import Image

from featcal.data.corpora import load_digits
from featcal.data.encoders import ImageEncoder
from featcal.data.images import decode
from featcal.data.splits import batches_from_arrays, batches_to_arrays, encode_batches, read_split
from featcal.data import tasks
from featcal.data.tasks import TaskSpec, load_task_frame, split_task, write_task


def pixels(png: bytes) -> np.ndarray:
    return np.asarray(Image.open(io.BytesIO(png)))


def square(value: int, size: int = 4) -> np.ndarray:
    return np.full((size, size), value, dtype=np.uint8)


def test_digits_are_the_packaged_pixels_with_three_conflicting_label_columns():
    frame = load_digits()
    assert len(frame) == 1797 and frame.attrs["image_field"] == "image"
    # row 0 of sklearn's digits.csv.gz is a zero: its 8x8 values (0..16) scaled to 0..255
    first = pixels(frame["image"][0])
    assert first.shape == (8, 8) and first.dtype == np.uint8
    assert first[0].tolist() == [v * 255 // 16 for v in (0, 0, 5, 13, 9, 1, 0, 0)]
    assert frame["digit"][0] == 0 and frame["parity"][0] == "even" and frame["magnitude"][0] == "low"
    assert set(frame["parity"]) == {"even", "odd"} and set(frame["magnitude"]) == {"low", "high"}
    assert ((frame["digit"] % 2 == 1) == (frame["parity"] == "odd")).all()
    assert ((frame["digit"] >= 5) == (frame["magnitude"] == "high")).all()


def test_an_image_folder_reads_one_class_per_folder(tmp_path):
    for label, values in {"dark": (10, 20, 30), "light": (200, 210, 220)}.items():
        (tmp_path / "images" / label).mkdir(parents=True)
        for v in values:
            Image.fromarray(square(v)).save(tmp_path / "images" / label / f"{v}.png")
    (tmp_path / "images" / "dark" / "notes.txt").write_text("not an image")
    spec = TaskSpec.from_mapping("shade", {"source": f"file:{tmp_path / 'images'}"})
    frame = load_task_frame(spec)
    assert list(frame.columns) == ["image", "label"] and frame.attrs["classes"] == ["dark", "light"]
    assert sorted(int(pixels(b)[0, 0]) for b in frame["image"][frame["label"] == 1]) == [200, 210, 220]


def from_frame(monkeypatch, frame: pd.DataFrame) -> None:
    """The task source yields `frame` (image cells a parquet file cannot hold: PIL images, paths)."""
    monkeypatch.setattr(tasks, "_raw_frame", lambda _spec: frame)


def test_datasets_cells_paths_and_encoded_bytes_give_the_same_pixels(tmp_path, monkeypatch):
    Image.fromarray(square(77)).save(tmp_path / "a.png")
    encoded = io.BytesIO()
    Image.fromarray(square(99)).save(encoded, format="JPEG", quality=100)
    cells = [{"bytes": (tmp_path / "a.png").read_bytes(), "path": None}, str(tmp_path / "a.png"),
             {"bytes": None, "path": str(tmp_path / "a.png")}, encoded.getvalue()]
    from_frame(monkeypatch, pd.DataFrame({"img": cells, "y": [0, 1, 0, 1]}))
    spec = TaskSpec.from_mapping("cells", {"source": "file:unused.parquet", "image_field": "img", "label_field": "y"})
    out = load_task_frame(spec)
    assert [int(pixels(b)[0, 0]) for b in out["image"][:3]] == [77, 77, 77]
    assert abs(int(pixels(out["image"][3])[0, 0]) - 99) <= 1


def test_an_unreadable_image_names_the_task_and_row(tmp_path):
    path = tmp_path / "bad.parquet"
    pd.DataFrame({"image": [b"\x89PNG not really", b"x"], "label": [0, 1]}).to_parquet(path)
    spec = TaskSpec.from_mapping("broken", {"source": f"file:{path}", "image_field": "image"})
    with pytest.raises(ValueError, match=r"task 'broken' .*row 0: not a readable image"):
        load_task_frame(spec)


def test_duplicate_images_collapse_and_no_image_is_in_two_splits(tmp_path, monkeypatch):
    values = list(range(0, 240, 4))
    from_frame(monkeypatch, pd.DataFrame({"image": [Image.fromarray(square(v)) for v in values + values[:10]],
                                          "label": [v % 3 for v in values + values[:10]]}))
    spec = TaskSpec.from_mapping("squares", {"source": "file:unused.parquet", "image_field": "image",
                                             "max_train": 40, "n_dev": 8, "n_test": 8})
    loaded = load_task_frame(spec)
    splits = split_task(loaded, spec, seed=0)
    seen = [b for s in ("train", "dev", "test") for b in splits[s]["image"]]
    assert len(seen) == len(set(seen)) == 56      # 70 rows, 10 duplicates: 60 images, 40 + 8 + 8 drawn
    write_task(splits, tmp_path / "tasks" / "squares", loaded.attrs["classes"])
    dev = read_split(tmp_path / "tasks", "squares", "dev")
    assert dev.examples == list(splits["dev"]["image"]) and dev.labels.tolist() == splits["dev"]["label"].tolist()


def test_the_image_encoder_gives_the_processors_pixels_and_the_cache_keeps_them_float():
    class Processor:
        def __call__(self, images, return_tensors):
            arrays = [np.asarray(im, dtype=np.float32) / 255.0 for im in images]
            return {"pixel_values": torch.tensor(np.stack(arrays)).permute(0, 3, 1, 2)}

    frame = load_digits()
    examples = list(frame["image"][:5])
    batches = encode_batches(ImageEncoder(Processor()), examples, max_length=0, batch_size=2)
    assert [b["pixel_values"].shape for b in batches] == [(2, 3, 8, 8), (2, 3, 8, 8), (1, 3, 8, 8)]
    rgb = np.asarray(decode(examples[0]), dtype=np.float32) / 255.0
    assert torch.equal(batches[0]["pixel_values"][0], torch.tensor(rgb).permute(2, 0, 1))
    back = batches_from_arrays(batches_to_arrays({"digits": batches}), batch_size=2)["digits"]
    assert back[0]["pixel_values"].dtype == torch.float32
    assert all(torch.equal(a["pixel_values"], b["pixel_values"]) for a, b in zip(batches, back))


def test_a_task_of_the_other_kind_than_the_model_is_refused_naming_the_task(tmp_path):
    from transformers import BertTokenizer

    from featcal.data.encoders import TextEncoder
    from featcal.data.splits import TaskSplit
    from featcal.finetune import accuracy

    text = TextEncoder(BertTokenizer(vocab={w: i for i, w in enumerate(["[PAD]", "[UNK]", "[CLS]", "[SEP]", "a"])}))
    digits = TaskSplit("parity", "test", list(load_digits()["image"][:4]), torch.zeros(4, dtype=torch.long))
    with pytest.raises(ValueError, match=r"task 'parity' holds images, but the model reads texts"):
        accuracy(torch.nn.Identity(), text, digits, 8)
    words = TaskSplit("topic", "test", ["a", "a"], torch.zeros(2, dtype=torch.long))
    with pytest.raises(ValueError, match=r"task 'topic' holds texts, but the model reads images"):
        accuracy(torch.nn.Identity(), ImageEncoder(None), words, 8)
