"""Task splits on disk (`<tasks_dir>/<task>/{train,dev,test}.parquet`) and encoded batches."""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Mapping

import pyarrow.parquet as pq
import torch
from torch import Tensor

from featcal.data.encoders import InputEncoder, check_examples
from featcal.data.images import example_column

SPLITS = ("train", "dev", "test")


@dataclass
class TaskSplit:
    """A split's examples (texts, or images as PNG bytes) and labels. `ids`: each example's row in
    its split file, kept through subsets so per-example predictions can be paired across models."""

    task: str
    split: str
    examples: list
    labels: Tensor
    ids: Tensor | None = None   # None: 0, 1, 2, ... (the split as read)

    def example_ids(self) -> Tensor:
        return torch.arange(len(self.examples)) if self.ids is None else self.ids

    def subset(self, index: Tensor | list[int]) -> "TaskSplit":
        """The examples at `index`, in that order, with their labels and ids."""
        index = torch.as_tensor(index, dtype=torch.long)
        return TaskSplit(self.task, self.split, [self.examples[i] for i in index.tolist()], self.labels[index],
                         self.example_ids()[index])


def read_split(tasks_dir: str | os.PathLike, task: str, split: str) -> TaskSplit:
    """One split of one task; errors name the file and the missing column."""
    if split not in SPLITS:
        raise ValueError(f"unknown split {split!r}; expected one of {SPLITS}")
    path = Path(tasks_dir) / task / f"{split}.parquet"
    if not path.exists():
        raise FileNotFoundError(f"task {task!r}: {path} does not exist (run the prepare stage)")
    table = pq.read_table(path)
    content = example_column(table.column_names)
    for column in (content, "label"):
        if column not in table.column_names:
            raise ValueError(f"{path}: missing column {column!r} (columns: {table.column_names})")
    return TaskSplit(task, split, table.column(content).to_pylist(), torch.tensor(table.column("label").to_pylist()))


def class_names(tasks_dir: str | os.PathLike, task: str) -> list[str]:
    """Label i's name (`labels.json`), or the label numbers as text for a task folder without one."""
    path = Path(tasks_dir) / task / "labels.json"
    if path.exists():
        record = json.loads(path.read_text())
        return [str(c) for c in (record["classes"] if isinstance(record, dict) else record)]   # a list before the raw-label record
    return [str(i) for i in range(int(read_split(tasks_dir, task, "train").labels.max()) + 1)]


def num_labels(tasks_dir: str | os.PathLike, task: str) -> int:
    return len(class_names(tasks_dir, task))


def calibration_subset(split: TaskSplit, n: int, seed: int) -> TaskSplit:
    """A seeded sample of n examples (all of them when the split is smaller); labels are kept
    only so callers can check they never use them."""
    g = torch.Generator().manual_seed(seed)
    order = torch.randperm(len(split.examples), generator=g)[: min(n, len(split.examples))].sort().values
    return split.subset(order)


def encode_batches(
    encoder: InputEncoder, examples: list, max_length: int, batch_size: int, pad_to: int | None = None
) -> list[dict[str, Tensor]]:
    """Encoded batches in order. With `pad_to`, every text batch has that many positions (a fixed
    width lets per-layer caches store one array per task)."""
    return [encoder.encode(examples[start:start + batch_size], max_length, pad_to)
            for start in range(0, len(examples), batch_size)]


@dataclass
class CalibrationSpec:
    """Which unlabelled examples calibration reads: a seeded sample of each task's split."""

    tasks_dir: str
    tasks: list[str]
    examples_per_task: int = 128
    batch_size: int = 16
    max_length: dict[str, int] | int = 64
    seed: int = 0
    split: str = "train"

    def length(self, task: str) -> int:
        return self.max_length if isinstance(self.max_length, int) else int(self.max_length[task])


Batches = dict[str, list[dict[str, Tensor]]]


def calibration_batches(spec: CalibrationSpec, encoder: InputEncoder) -> Batches:
    """Per task, fixed-width batches of the calibration sample (labels dropped)."""
    out: Batches = {}
    for task in spec.tasks:
        sample = calibration_subset(read_split(spec.tasks_dir, task, spec.split), spec.examples_per_task, spec.seed)
        check_examples(encoder, sample.examples, task)
        width = encoder.width(sample.examples, spec.length(task))
        out[task] = encode_batches(encoder, sample.examples, spec.length(task), spec.batch_size, pad_to=width)
    return out


def batches_to_arrays(batches: Batches) -> dict[str, Tensor]:
    """Flatten to `<input name>/<task>` arrays (what the inputs cache stores)."""
    out = {}
    for task, task_batches in batches.items():
        for key in task_batches[0]:
            out[f"{key}/{task}"] = torch.cat([b[key] for b in task_batches])
    return out


def arrays_by_task(arrays: Mapping[str, Tensor]) -> dict[str, dict[str, Tensor]]:
    """`<input name>/<task>` arrays grouped as {task: {input name: array}}."""
    per_task: dict[str, dict[str, Tensor]] = {}
    for name, value in arrays.items():
        key, _, task = name.partition("/")
        per_task.setdefault(task, {})[key] = value
    return per_task


def batches_from_arrays(arrays: dict[str, Tensor], batch_size: int) -> Batches:
    """The inverse of `batches_to_arrays`, cut into batches of `batch_size` examples."""
    out: Batches = {}
    for task, inputs in arrays_by_task(arrays).items():
        inputs = {k: v if v.is_floating_point() else v.long() for k, v in inputs.items()}
        n = next(iter(inputs.values())).shape[0]
        out[task] = [{k: v[i:i + batch_size] for k, v in inputs.items()} for i in range(0, n, batch_size)]
    return out
