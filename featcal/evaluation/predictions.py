"""Per-example predictions of scored models, stored as Parquet (docs/uncertainty.md).

A table of accuracies cannot be re-read with an interval; the predictions behind it can. Every
scoring path of the project ends in `accuracy` (below), which hands each task's
predictions to `recording()` when one is active, so a caller collects them without a second scorer:

    with recording() as records:
        problem.score(backbone, test_splits)
    write_predictions("results/predictions/ties_featcal.parquet", {"ties/featcal": records})
    correct = read_correctness(["results/predictions/ties_featcal.parquet"], "test")   # model -> task -> bool[]

One row per (model, split, task, example): the example's row in its split file (`example_id`), the
label, the prediction and the log-probabilities of the classes (float32).
"""

from __future__ import annotations

import contextlib
import os
from contextvars import ContextVar
from dataclasses import dataclass
from pathlib import Path
from typing import Iterable, Iterator, Mapping, Sequence

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import torch
from torch import nn

from featcal.data.encoders import InputEncoder, check_examples
from featcal.data.splits import TaskSplit, encode_batches

COLUMNS = ("model", "split", "task", "example_id", "label", "prediction", "log_probs")


@dataclass(frozen=True)
class TaskPredictions:
    """One model's predictions on one task's split, examples in scoring order."""
    task: str
    split: str
    ids: np.ndarray         # [n] row of each example in its split file
    labels: np.ndarray      # [n]
    predictions: np.ndarray  # [n] argmax of the logits
    log_probs: np.ndarray   # [n, classes] float32

    @property
    def correct(self) -> np.ndarray:
        return self.predictions == self.labels

    @property
    def accuracy(self) -> float:
        return float(self.correct.mean())


_ACTIVE: ContextVar[list[TaskPredictions] | None] = ContextVar("featcal_predictions", default=None)


@contextlib.contextmanager
def recording() -> Iterator[list[TaskPredictions]]:
    """Collect the predictions of every task scored inside the block, in scoring order."""
    records: list[TaskPredictions] = []
    token = _ACTIVE.set(records)
    try:
        yield records
    finally:
        _ACTIVE.reset(token)


def record(predictions: TaskPredictions) -> None:
    """Called by the scorer; a no-op outside `recording()`."""
    records = _ACTIVE.get()
    if records is not None:
        records.append(predictions)


def is_recording() -> bool:
    return _ACTIVE.get() is not None


def _checked_length(model: str, p: TaskPredictions) -> int:
    n = len(p.ids)
    if not (len(p.labels) == len(p.predictions) == len(p.log_probs) == n):
        raise ValueError(f"model {model!r}, task {p.task!r} ({p.split}): ids, labels, predictions and "
                         f"log-probabilities differ in length")
    return n


def to_table(models: Mapping[str, Iterable[TaskPredictions]]) -> pa.Table:
    """model name -> its task predictions, as one table (the columns of `COLUMNS`)."""
    names, parts = [], []
    for model, records in models.items():
        for p in records:
            names.append((model, p.split, p.task, _checked_length(model, p)))
            parts.append(p)
    repeat = [np.repeat(np.asarray([n[i] for n in names], dtype=object), [n[3] for n in names]) for i in range(3)]
    log_probs = [np.asarray(p.log_probs, dtype=np.float32) for p in parts]
    flat = np.concatenate([lp.ravel() for lp in log_probs]) if log_probs else np.zeros(0, np.float32)
    row_offsets = np.concatenate([[0], np.cumsum([lp.shape[1] for lp in log_probs for _ in range(lp.shape[0])],
                                                 dtype=np.int64)]).astype(np.int32)

    def ints(field: str, dtype) -> np.ndarray:
        values = [np.asarray(getattr(p, field), dtype=dtype) for p in parts]
        return np.concatenate(values) if values else np.zeros(0, dtype)

    return pa.table({
        "model": pa.array(repeat[0].tolist(), pa.string()).dictionary_encode(),
        "split": pa.array(repeat[1].tolist(), pa.string()).dictionary_encode(),
        "task": pa.array(repeat[2].tolist(), pa.string()).dictionary_encode(),
        "example_id": pa.array(ints("ids", np.int32)),
        "label": pa.array(ints("labels", np.int16)),
        "prediction": pa.array(ints("predictions", np.int16)),
        "log_probs": pa.ListArray.from_arrays(pa.array(row_offsets), pa.array(flat)),
    })


def write_predictions(path: str | os.PathLike, models: Mapping[str, Iterable[TaskPredictions]]) -> Path:
    """Write the table at `path` (zstd), whole or not at all (a temporary file renamed into place)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp")
    pq.write_table(to_table(models), tmp, compression="zstd")
    os.replace(tmp, path)
    return path


def read_table(paths: Sequence[str | os.PathLike]) -> pa.Table:
    """The predictions in `paths` as one table; a file without the columns is refused by name."""
    if not paths:
        raise ValueError("no prediction files given")
    tables = []
    for path in paths:
        try:
            table = pq.read_table(path)
        except (OSError, pa.ArrowInvalid) as err:
            raise ValueError(f"{path}: not a readable predictions file ({err})") from None
        missing = [c for c in COLUMNS if c not in table.column_names]
        if missing:
            raise ValueError(f"{path}: not a predictions file (missing columns {missing})")
        tables.append(table.select(list(COLUMNS)).cast(tables[0].schema) if tables else table.select(list(COLUMNS)))
    return pa.concat_tables(tables)


def read_correctness(paths: Sequence[str | os.PathLike], split: str) -> dict[str, dict[str, np.ndarray]]:
    """model -> task -> per-example correctness on `split`, each task's examples sorted by
    `example_id`, so rows are paired by example whatever order they were scored in. A model listed
    twice for a task, or scored on other examples than the first model, is an error naming both."""
    table = read_table(paths)
    columns = {name: table.column(name).to_numpy() if name in ("example_id", "label", "prediction")
               else np.asarray(table.column(name).to_pylist(), dtype=object)
               for name in ("model", "split", "task", "example_id", "label", "prediction")}
    keep = columns["split"] == split
    out: dict[str, dict[str, np.ndarray]] = {}
    ids_of: dict[str, tuple[str, np.ndarray]] = {}
    models, tasks = columns["model"][keep], columns["task"][keep]
    ids, correct = columns["example_id"][keep], columns["prediction"][keep] == columns["label"][keep]
    for model in dict.fromkeys(models):
        in_model = models == model
        for task in dict.fromkeys(tasks[in_model]):
            rows = in_model & (tasks == task)
            order = np.argsort(ids[rows], kind="stable")
            task_ids = ids[rows][order]
            if len(np.unique(task_ids)) != len(task_ids):
                raise ValueError(f"model {model!r}, task {task!r} ({split}): an example is listed twice")
            if task in ids_of:
                first, expected = ids_of[task]
                if not np.array_equal(expected, task_ids):
                    raise ValueError(f"task {task!r} ({split}): model {model!r} was scored on other examples "
                                     f"than model {first!r}")
            else:
                ids_of[task] = (model, task_ids)
            out.setdefault(model, {})[task] = correct[rows][order]
    return out


# --- the one accuracy: every scoring path of the project ends here ------------------------------


@torch.no_grad()
def predict_logits(model: nn.Module, encoder: InputEncoder, examples: list, max_length: int,
                   batch_size: int = 64) -> torch.Tensor:
    model.eval()
    logits = [model(**b).logits.float() for b in encode_batches(encoder, examples, max_length, batch_size)]
    return torch.cat(logits) if logits else torch.zeros(0, 0)


def accuracy(model: nn.Module, encoder: InputEncoder, split: TaskSplit, max_length: int) -> float:
    """The one accuracy of the project; inside `recording()` the
    per-example predictions are kept as well."""
    check_examples(encoder, split.examples, split.task)
    if not split.examples:
        raise ValueError(f"task {split.task!r}: its {split.split} split has no examples to score")
    logits = predict_logits(model, encoder, split.examples, max_length)
    preds = logits.argmax(-1)
    if is_recording():
        record(TaskPredictions(split.task, split.split, split.example_ids().numpy(), split.labels.numpy(),
                               preds.numpy(), torch.log_softmax(logits, -1).numpy()))
    return float((preds == split.labels).float().mean())


__all__ = ["COLUMNS", "TaskPredictions", "accuracy", "is_recording", "predict_logits", "read_correctness", "read_table", "record", "recording",
           "to_table", "write_predictions"]
