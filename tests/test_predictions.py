"""Per-example predictions: recorded by the one scorer, stored as Parquet, read back paired by example."""

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch

from featcal.evaluation.predictions import TaskPredictions, read_correctness, read_table, recording, write_predictions
from featcal.finetune import accuracy
from test_finetune import model_and_tokenizer, split


def predictions(task, split_name, ids, labels, preds, classes=2):
    n = len(ids)
    return TaskPredictions(task, split_name, np.asarray(ids), np.asarray(labels), np.asarray(preds),
                           np.log(np.full((n, classes), 1 / classes, dtype=np.float32)))


def test_the_scorer_records_each_tasks_predictions_and_they_give_its_accuracy(tmp_path):
    model, encoder = model_and_tokenizer(tmp_path / "base")
    dev = split("dev", 14, 1).subset([13, 2, 5, 7, 0, 9])   # a subset keeps each example's row in the file
    outside = accuracy(model, encoder, dev, 16)
    with recording() as records:
        inside = accuracy(model, encoder, dev, 16)
    assert inside == outside
    (record,) = records
    assert (record.task, record.split) == ("toy", "dev")
    assert record.ids.tolist() == [13, 2, 5, 7, 0, 9]
    assert record.labels.tolist() == dev.labels.tolist()
    assert record.accuracy == pytest.approx(inside, abs=1e-7)   # (the scorer averages in float32)
    assert record.log_probs.shape == (6, 2)
    np.testing.assert_allclose(np.exp(record.log_probs).sum(1), 1, rtol=1e-5)
    assert (record.log_probs.argmax(1) == record.predictions).all()
    accuracy(model, encoder, dev, 16)
    assert len(records) == 1   # nothing recorded once the block is left


def test_predictions_round_trip_through_parquet_paired_by_example_id(tmp_path):
    a = [predictions("t1", "test", [2, 0, 1], [1, 0, 1], [1, 1, 1]), predictions("t2", "test", [0, 1], [0, 1], [0, 1], 3),
         predictions("t1", "dev", [0], [1], [0])]
    b = [predictions("t2", "test", [1, 0], [1, 0], [0, 0], 3), predictions("t1", "test", [0, 1, 2], [0, 1, 1], [0, 1, 0])]
    write_predictions(tmp_path / "a.parquet", {"a": a})
    write_predictions(tmp_path / "b.parquet", {"b": b})
    correct = read_correctness([tmp_path / "a.parquet", tmp_path / "b.parquet"], "test")
    assert correct["a"]["t1"].tolist() == [False, True, True]   # ids 0, 1, 2
    assert correct["b"]["t1"].tolist() == [True, True, False]
    assert correct["a"]["t2"].tolist() == [True, True]
    assert correct["b"]["t2"].tolist() == [True, False]
    assert read_correctness([tmp_path / "a.parquet"], "dev") == {"a": {"t1": np.array([False])}}
    table = read_table([tmp_path / "a.parquet"])
    assert len(table) == 6 and len(table.column("log_probs")[3].as_py()) == 3
    assert not list(tmp_path.glob(".*.tmp"))


def test_models_scored_on_other_examples_or_twice_are_refused_by_name(tmp_path):
    write_predictions(tmp_path / "a.parquet", {"a": [predictions("t1", "test", [0, 1], [0, 1], [0, 1])]})
    write_predictions(tmp_path / "b.parquet", {"b": [predictions("t1", "test", [0, 2], [0, 1], [0, 1])]})
    with pytest.raises(ValueError, match="task 't1' \\(test\\): model 'b' was scored on other examples than model 'a'"):
        read_correctness([tmp_path / "a.parquet", tmp_path / "b.parquet"], "test")
    with pytest.raises(ValueError, match="model 'a', task 't1' \\(test\\): an example is listed twice"):
        read_correctness([tmp_path / "a.parquet", tmp_path / "a.parquet"], "test")
    pq.write_table(pa.table({"x": [1]}), tmp_path / "other.parquet")
    with pytest.raises(ValueError, match="other.parquet: not a predictions file"):
        read_correctness([tmp_path / "other.parquet"], "test")
    (tmp_path / "broken.parquet").write_bytes(b"PAR1 not really")
    with pytest.raises(ValueError, match="broken.parquet: not a readable predictions file"):
        read_correctness([tmp_path / "broken.parquet"], "test")


def test_an_empty_split_is_an_error_not_a_nan_accuracy(tmp_path):
    model, encoder = model_and_tokenizer(tmp_path / "base")
    empty = split("dev", 4, 0).subset(torch.zeros(0, dtype=torch.long))
    with pytest.raises(ValueError, match="task 'toy': its dev split has no examples"):
        accuracy(model, encoder, empty, 16)
