"""Tests for featcal.data.tasks and stages/prepare.py: synthetic file sources plus the builtin loaders."""

from __future__ import annotations

import json
import logging
import subprocess
import sys
from pathlib import Path

import numpy as np
import pandas as pd
import pyarrow.parquet as pq
import pytest
import yaml

from featcal.data import corpora
from featcal.data.corpora import BUILTIN_LOADERS
from featcal.data.tasks import TaskSpec, load_task_frame, split_task, write_task

REPO = Path(__file__).resolve().parents[1]


def synthetic(n_per_class=(600, 300, 100), seed=0) -> pd.DataFrame:
    """Imbalanced 3-class frame with unique texts (labels as strings a/b/c)."""
    rng = np.random.default_rng(seed)
    rows = []
    for label, n in zip("abc", n_per_class):
        rows += [(f"{label} example {i} {rng.integers(1 << 30)}", label) for i in range(n)]
    return pd.DataFrame(rows, columns=["sentence", "category"])


def file_task(tmp_path, frame, suffix=".csv", **spec) -> TaskSpec:
    path = tmp_path / f"source{suffix}"
    if suffix == ".parquet":
        frame.to_parquet(path)
    elif suffix == ".jsonl":
        frame.to_json(path, orient="records", lines=True)
    else:
        frame.to_csv(path, index=False, sep="\t" if suffix == ".tsv" else ",")
    mapping = {"source": f"file:{path}", "text_field": "sentence", "label_field": "category", **spec}
    return TaskSpec.from_mapping("toy", mapping)


def shares(frame: pd.DataFrame, k: int) -> np.ndarray:
    return np.bincount(frame["label"], minlength=k) / len(frame)


# --- splitting ---------------------------------------------------------------------------------


def test_splits_are_disjoint_and_respect_requested_sizes(tmp_path):
    spec = file_task(tmp_path, synthetic(), max_train=400, n_dev=100, n_test=200)
    splits = split_task(load_task_frame(spec), spec, seed=0)
    assert {s: len(f) for s, f in splits.items()} == {"train": 400, "dev": 100, "test": 200}
    texts = [set(splits[s]["text"]) for s in ("train", "dev", "test")]
    assert not (texts[0] & texts[1]) and not (texts[0] & texts[2]) and not (texts[1] & texts[2])
    for frame in splits.values():
        assert list(frame.columns) == ["text", "label"] and frame["label"].dtype == np.int64


def test_splits_are_stratified(tmp_path):
    spec = file_task(tmp_path, synthetic(), max_train=500, n_dev=100, n_test=200)
    frame = load_task_frame(spec)
    splits = split_task(frame, spec, seed=3)
    expected = shares(frame, 3)  # 0.6 / 0.3 / 0.1
    for name, part in splits.items():
        np.testing.assert_allclose(shares(part, 3), expected, atol=0.011, err_msg=name)


def test_split_is_deterministic_for_a_seed_and_independent_of_row_order(tmp_path):
    data = synthetic()
    spec = file_task(tmp_path, data, max_train=300, n_dev=50, n_test=80)
    first = split_task(load_task_frame(spec), spec, seed=7)
    again = split_task(load_task_frame(spec), spec, seed=7)
    (tmp_path / "shuffled").mkdir()
    shuffled_spec = file_task(
        tmp_path / "shuffled", data.sample(frac=1, random_state=1), max_train=300, n_dev=50, n_test=80
    )
    shuffled = split_task(load_task_frame(shuffled_spec), shuffled_spec, seed=7)
    other_seed = split_task(load_task_frame(spec), spec, seed=8)
    for s in ("train", "dev", "test"):
        pd.testing.assert_frame_equal(first[s], again[s])
        pd.testing.assert_frame_equal(first[s], shuffled[s])
    assert set(first["test"]["text"]) != set(other_seed["test"]["text"])


def test_duplicate_texts_are_removed_and_conflicting_labels_dropped(tmp_path):
    data = synthetic((60, 40, 20))
    dupes = data.iloc[:10]  # exact duplicates, same label
    conflict = pd.DataFrame({"sentence": ["same text", "same text"], "category": ["a", "b"]})
    blank = pd.DataFrame({"sentence": ["   ", ""], "category": ["a", "b"]})
    spec = file_task(tmp_path, pd.concat([data, dupes, dupes, conflict, blank]), max_train=1000)
    splits = split_task(load_task_frame(spec), spec, seed=0)
    texts = pd.concat([splits[s]["text"] for s in ("train", "dev", "test")])
    assert texts.is_unique
    assert len(texts) == len(data)
    assert "same text" not in set(texts) and "" not in set(texts)


def test_small_task_shrinks_proportionally_keeps_eval_splits_and_logs(tmp_path, caplog):
    spec = file_task(tmp_path, synthetic((30, 20, 6)))  # 56 rows against 2000/300/500
    with caplog.at_level(logging.WARNING, logger="featcal.data.tasks"):
        splits = split_task(load_task_frame(spec), spec, seed=0)
    sizes = {s: len(f) for s, f in splits.items()}
    assert sum(sizes.values()) == 56
    assert sizes["dev"] >= 3 and sizes["test"] >= 3 and sizes["train"] > sizes["test"] > sizes["dev"]
    assert sizes["test"] == pytest.approx(56 * 500 / 2800, abs=1)
    for name in ("dev", "test"):  # every class present in each eval split
        assert set(splits[name]["label"]) == {0, 1, 2}
    assert any("toy" in r.message and "shrunk" in r.message for r in caplog.records)


def test_source_split_column_keeps_its_test_and_carves_dev_from_train(tmp_path):
    data = synthetic((200, 100, 50))
    data["part"] = np.where(np.arange(len(data)) % 5 == 0, "test", "train")
    spec = file_task(tmp_path, data, split_field="part", max_train=150, n_dev=60, n_test=500)
    splits = split_task(load_task_frame(spec), spec, seed=0)
    source_test = set(data.loc[data["part"] == "test", "sentence"])
    assert set(splits["test"]["text"]) == source_test  # all 70 source-test rows, nothing else
    assert not (set(splits["dev"]["text"]) | set(splits["train"]["text"])) & source_test
    assert (len(splits["train"]), len(splits["dev"])) == (150, 60)


def test_balance_downsamples_to_smallest_class(tmp_path):
    spec = file_task(tmp_path, synthetic((300, 100, 50)), balance=True, max_train=90, n_dev=15, n_test=30)
    splits = split_task(load_task_frame(spec), spec, seed=0)
    for part in splits.values():
        counts = np.bincount(part["label"], minlength=3)
        assert counts.max() - counts.min() <= 1


# --- loading and validation --------------------------------------------------------------------


@pytest.mark.parametrize("suffix", [".csv", ".tsv", ".parquet", ".jsonl"])
def test_file_sources_load_text_and_sorted_label_codes(tmp_path, suffix):
    frame = load_task_frame(file_task(tmp_path, synthetic((5, 4, 3)), suffix=suffix))
    assert frame.attrs["classes"] == ["a", "b", "c"]
    assert np.bincount(frame["label"]).tolist() == [5, 4, 3]
    assert frame["label"].dtype == np.int64


def test_label_map_sets_class_order_and_null_drops(tmp_path):
    spec = file_task(tmp_path, synthetic((5, 4, 3)), label_map={"c": "low", "a": "high", "b": None})
    frame = load_task_frame(spec)
    assert frame.attrs["classes"] == ["low", "high"]
    assert np.bincount(frame["label"]).tolist() == [3, 5]


def test_label_missing_from_label_map_is_an_error(tmp_path):
    spec = file_task(tmp_path, synthetic((5, 4, 3)), label_map={"a": "x", "b": "y"})
    with pytest.raises(ValueError, match=r"'toy'.*'category'.*\['c'\]"):
        load_task_frame(spec)


@pytest.mark.parametrize("key", ["text_field", "label_field"])
def test_missing_column_error_names_task_file_and_column(tmp_path, key):
    spec = file_task(tmp_path, synthetic((5, 4, 3)), **{key: "nope"})
    with pytest.raises(ValueError) as err:
        load_task_frame(spec)
    message = str(err.value)
    assert "'toy'" in message and "source.csv" in message and "'nope'" in message and key in message


def test_unknown_key_error_names_task_and_key():
    with pytest.raises(ValueError, match=r"tasks\.bbc.*'max_trian'"):
        TaskSpec.from_mapping("bbc", {"source": "package:bbc", "max_trian": 10})


@pytest.mark.parametrize(
    "mapping, match",
    [
        ({"source": "package:nope"}, r"tasks\.t\.source.*'nope'"),
        ({"source": "ftp:x"}, r"tasks\.t\.source"),
        ({"source": "file:x.xlsx"}, r"tasks\.t\.source.*x\.xlsx"),
        ({"source": "package:bbc", "n_dev": 0}, r"tasks\.t\.n_dev"),
        ({"source": "package:bbc", "max_train": True}, r"tasks\.t\.max_train"),
        ({"source": "package:bbc", "options": {"color": 1}}, r"tasks\.t\.options.*'color'"),
        ({"source": "package:bbc", "enabled": "no"}, r"tasks\.t\.enabled"),
        ({"source": "package:bbc", "objective": "lm"}, r"tasks\.t\.objective: expected one of classification, "
                                                       r"language_model, found 'lm'"),
        ({"text_field": "x"}, r"tasks\.t.*'source'"),
    ],
)
def test_invalid_spec_errors_name_task_and_key(mapping, match):
    with pytest.raises(ValueError, match=match):
        TaskSpec.from_mapping("t", mapping)


def test_missing_source_file_error_names_task_and_file(tmp_path):
    spec = TaskSpec.from_mapping("toy", {"source": f"file:{tmp_path}/absent.csv"})
    with pytest.raises(FileNotFoundError, match=r"'toy'.*absent\.csv"):
        load_task_frame(spec)


# --- writing -----------------------------------------------------------------------------------


def test_write_task_writes_parquet_and_labels_and_replaces_atomically(tmp_path, monkeypatch):
    spec = file_task(tmp_path, synthetic((40, 30, 20)), max_train=50, n_dev=10, n_test=20)
    frame = load_task_frame(spec)
    splits = split_task(frame, spec, seed=0)
    out = tmp_path / "tasks" / "toy"
    write_task(splits, out, frame.attrs["classes"])
    table = pq.read_table(out / "train.parquet")
    assert table.schema.names == ["text", "label"]
    assert str(table.schema.field("label").type) == "int64" and str(table.schema.field("text").type) == "string"
    assert json.loads((out / "labels.json").read_text())["classes"] == ["a", "b", "c"]
    assert {p.name for p in out.iterdir()} == {"train.parquet", "dev.parquet", "test.parquet", "labels.json"}

    # A failing rewrite leaves the previous output untouched and no temporary folder behind.
    calls = []

    def failing_write(table, path, **kw):
        calls.append(path)
        if len(calls) == 2:
            raise OSError("disk full")
        return real_write(table, path, **kw)

    real_write = pq.write_table
    monkeypatch.setattr(pq, "write_table", failing_write)
    with pytest.raises(OSError, match="disk full"):
        write_task(split_task(frame, spec, seed=1), out, frame.attrs["classes"])
    monkeypatch.undo()
    pd.testing.assert_frame_equal(pd.read_parquet(out / "test.parquet"), splits["test"])
    assert [p.name for p in out.parent.iterdir()] == ["toy"]

    with pytest.raises(ValueError, match=r"'label'.*outside 0\.\.1"):
        write_task(splits, tmp_path / "other", ["a", "b"])
    assert not (tmp_path / "other").exists()


def test_prepare_stage_end_to_end_with_tasks_only_params(tmp_path):
    source = tmp_path / "toy.csv"
    synthetic((80, 60, 40)).to_csv(source, index=False)
    params = {
        "tasks": {
            "toy": {"source": f"file:{source}", "text_field": "sentence", "label_field": "category",
                    "max_train": 100, "n_dev": 20, "n_test": 40},
            "off": {"source": "package:bbc", "enabled": False},
        }
    }
    (tmp_path / "params.yaml").write_text(yaml.safe_dump(params))
    out = tmp_path / "out"
    result = subprocess.run(
        [sys.executable, str(REPO / "stages" / "prepare.py"), "--params", str(tmp_path / "params.yaml"), "--out", str(out)],
        capture_output=True, text=True, cwd=tmp_path, timeout=60,
    )
    assert result.returncode == 0, result.stderr
    assert "toy: train=100 dev=20 test=40 | 3 classes" in result.stdout
    assert "off: skipped" in result.stdout
    assert sorted(p.name for p in out.iterdir()) == ["toy"]
    assert len(pd.read_parquet(out / "toy" / "dev.parquet")) == 20


# --- builtin package loaders (real data files) ---------------------------------------------------


@pytest.mark.parametrize(
    "loader, classes, rows",
    [
        ("bbc", ["business", "entertainment", "politics", "sports", "tech"], (2200, 2300)),
        ("tweet_sentiment", ["negative", "neutral", "positive"], (37000, 39000)),
        ("movie_polarity", ["rotten", "fresh"], (12500, 13000)),
        ("drug_review", ["negative", "neutral", "positive"], (970, 990)),
        ("debate_party", ["democrat", "republican", "moderator"], (1100, 1150)),
        ("name_gender", ["female", "male"], (30000, 40000)),
        ("subjectivity", ["objective", "subjective"], (15000, 20000)),
    ],
)
def test_builtin_loader_reads_package_data(loader, classes, rows):
    frame = BUILTIN_LOADERS[loader]()
    assert frame.attrs["classes"] == classes
    assert rows[0] <= len(frame) <= rows[1]
    assert set(frame["label"]) == set(classes)
    assert frame["text"].map(lambda t: isinstance(t, str)).all()
    assert (frame["text"].str.len() > 0).mean() > 0.99
    counts = frame["label"].value_counts()
    assert counts.min() / len(frame) > 0.05  # no degenerate class


def test_drug_review_keeps_source_test_split_as_test():
    spec = TaskSpec.from_mapping("drug_review", {"source": "package:drug_review"})
    frame = load_task_frame(spec)
    assert frame["split"].value_counts().to_dict() == {"train": 600, "test": 379}
    splits = split_task(frame, spec, seed=0)
    assert len(splits["test"]) == 379 and len(splits["dev"]) > 0
    assert len(splits["train"]) + len(splits["dev"]) == 599  # one train review repeats a test review
    assert [corpora.drug_rating_class(r) for r in (1, 4, 5, 6, 7, 10)] == [
        "negative", "negative", "neutral", "neutral", "positive", "positive"]


def test_debate_party_mapping_covers_every_speaker():
    frame = BUILTIN_LOADERS["debate_party"]()
    by_speaker = frame.groupby("speaker")["label"].agg(set).to_dict()
    assert by_speaker == {s: {p} for s, p in corpora.DEBATE_SPEAKER_PARTY.items()}


def test_name_gender_skips_unisex_names():
    frame = BUILTIN_LOADERS["name_gender"]()
    assert frame["text"].is_unique
    names = dict(zip(frame["text"], frame["label"]))
    assert names.get("Michael") == "male" and names.get("Mary") == "female"
    assert "Andrea" not in names  # listed as male and female


def test_hf_source_keeps_class_label_names_splits_and_drops_unlabelled(tmp_path):
    import datasets

    pd.DataFrame({"sentence": [f"train {i}" for i in range(30)], "category": [0, 1, 2] * 10}).to_json(
        tmp_path / "train.jsonl", orient="records", lines=True)
    pd.DataFrame({"sentence": ["t0", "t1", "t2", "t3"], "category": [2, 1, 0, -1]}).to_json(
        tmp_path / "test.jsonl", orient="records", lines=True)
    features = datasets.Features(
        {"sentence": datasets.Value("string"), "category": datasets.ClassLabel(names=["neg", "neu", "pos"])})
    spec = TaskSpec.from_mapping("hub", {
        "source": "hf:json", "text_field": "sentence", "label_field": "category",
        "options": {"data_files": {"train": str(tmp_path / "train.jsonl"), "test": str(tmp_path / "test.jsonl")},
                    "features": features, "cache_dir": str(tmp_path / "cache")},
    })
    frame = load_task_frame(spec)
    assert frame.attrs["classes"] == ["neg", "neu", "pos"]
    assert frame["split"].value_counts().to_dict() == {"train": 30, "test": 3}
    splits = split_task(frame, spec, seed=0)
    assert sorted(splits["test"]["text"]) == ["t0", "t1", "t2"]
    assert dict(zip(splits["test"]["text"], splits["test"]["label"])) == {"t0": 2, "t1": 1, "t2": 0}


# --- language-model tasks ---------------------------------------------------------------------------


def test_a_language_model_task_reads_unlabelled_text_as_one_class(tmp_path):
    frame = pd.DataFrame({"sentence": [f"line {i} of some text" for i in range(50)]})
    spec = file_task(tmp_path, frame, objective="language_model")
    assert spec.language_model
    loaded = load_task_frame(spec)
    assert loaded.attrs["classes"] == ["text"] and set(loaded["label"]) == {0} and len(loaded) == 50
    splits = split_task(loaded, TaskSpec.from_mapping("toy", {"source": spec.source, "text_field": "sentence",
                                                              "objective": "language_model", "n_dev": 5, "n_test": 5,
                                                              "max_train": 40}))
    assert [len(splits[s]) for s in ("train", "dev", "test")] == [40, 5, 5]
    # a classifier of the same rows is refused: it has one class (or no label column at all)
    with pytest.raises(ValueError, match="label_field column 'category' not found"):
        load_task_frame(file_task(tmp_path, frame))


def test_python_source_cuts_a_packages_modules_into_pieces_of_code():
    frame = BUILTIN_LOADERS["python_source"](lines=30, min_lines=10)
    assert len(frame) > 1000 and {"linear_model", "ensemble"} <= set(frame["label"])
    lengths = frame["text"].str.count("\n") + 1
    assert lengths.between(10, 30).all() and frame["text"].str.contains("def |import |class ").mean() > 0.5
    assert frame["text"].tolist() == BUILTIN_LOADERS["python_source"](lines=30, min_lines=10)["text"].tolist()
    with pytest.raises(ValueError, match="min_lines <= lines"):
        BUILTIN_LOADERS["python_source"](lines=5, min_lines=10)
