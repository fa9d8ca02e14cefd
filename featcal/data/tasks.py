"""Classification tasks (texts or images): load a source, split it (seeded, stratified), write parquet.

A task is described by a :class:`TaskSpec` (`featcal.data.spec`; one entry of ``params.yaml``
``tasks:``). Its ``source`` is one of

- ``package:<loader>`` — a builtin loader that reads a data file shipped inside an installed
  PyPI package (the package's ``__init__`` is never imported; see `featcal.data.corpora.BUILTIN_LOADERS`);
- ``file:<path>`` — a local ``.parquet`` / ``.csv`` / ``.tsv`` / ``.jsonl`` file whose columns
  ``text_field`` (or ``image_field``) and ``label_field`` hold the example and the class, or an
  image folder (one sub-folder per class);
- ``hf:<dataset id>[:config]`` — ``datasets.load_dataset`` (offline only if already cached).

:func:`load_task_frame` gives one DataFrame with columns ``text`` (str) or ``image`` (PNG bytes), ``label`` (int64,
0..K-1) and, where the source has its own splits, ``split`` (train/dev/test); the class names in
label order are in ``frame.attrs["classes"]``. :func:`split_task` dedupes and makes the
train/dev/test splits; :func:`write_task` writes them atomically as
``<out_dir>/{train,dev,test}.parquet`` plus ``labels.json``.
"""

from __future__ import annotations

import json
import logging
import math
import os
import shutil
import tempfile
import zlib
from pathlib import Path
from typing import Mapping

import numpy as np
import pandas as pd

from featcal.data.corpora import BUILTIN_LOADERS
from featcal.data.images import IMAGE_SUFFIXES, example_column, to_png
from featcal.data.spec import SPLITS, TaskSpec, _SPLIT_ALIASES, _label_key
from featcal.io.atomic import remove_stale_temps, temp_prefix

log = logging.getLogger(__name__)

# ----------------------------------------------------------------------------------------------
# Other sources
# ----------------------------------------------------------------------------------------------


def read_image_folder(folder: Path, task: str) -> pd.DataFrame:
    """``<folder>/<class>/<image>`` (or ``<folder>/<split>/<class>/<image>`` with split
    train/dev/validation/test): columns ``image`` (PNG bytes), ``label`` (the class folder's name)
    and, for the second layout, ``split``."""
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
    frame = pd.DataFrame(rows)
    frame.attrs["source_file"] = str(folder)
    frame.attrs["image_field"] = "image"
    return frame


def _read_file(spec: TaskSpec) -> pd.DataFrame:
    path = Path(spec.source_target)
    if path.is_dir():
        return read_image_folder(path, spec.name)
    if not path.is_file():
        raise FileNotFoundError(f"task {spec.name!r}: source file {path} does not exist")
    suffix = path.suffix.lower()
    try:
        if suffix == ".parquet":
            frame = pd.read_parquet(path)
        elif suffix in (".csv", ".tsv"):
            sep = spec.options.get("sep", "\t" if suffix == ".tsv" else ",")
            # only an empty field is missing: texts such as "NA", "None" or "null" are kept as text
            frame = pd.read_csv(path, sep=sep, encoding=spec.options.get("encoding", "utf-8"),
                                keep_default_na=False, na_values=[""], dtype={spec.text_field: str})
        else:
            frame = pd.read_json(path, lines=True, encoding=spec.options.get("encoding", "utf-8"))
    except (ValueError, OSError, UnicodeDecodeError) as err:
        raise ValueError(f"task {spec.name!r}: cannot read {path}: {err}") from err
    frame.attrs["source_file"] = str(path)
    return frame


def _load_hf(spec: TaskSpec) -> pd.DataFrame:
    import datasets  # slow import; only when a task needs it

    dataset_id, _, config = spec.source_target.partition(":")
    loaded = datasets.load_dataset(dataset_id, config or None, **dict(spec.options))
    if isinstance(loaded, datasets.Dataset):
        loaded = datasets.DatasetDict({"train": loaded})
    parts = []
    classes = None
    for split_name, dataset in loaded.items():
        split = _SPLIT_ALIASES.get(str(split_name).lower())
        if split is None:
            log.info("task %s: ignoring split %r of %s", spec.name, split_name, spec.source)
            continue
        feature = dataset.features.get(spec.label_field)
        if isinstance(feature, datasets.ClassLabel):
            classes = list(feature.names)
        part = dataset.to_pandas()
        if classes is not None and spec.label_field in part:
            codes = part[spec.label_field]
            part = part[codes >= 0]  # unlabelled rows (e.g. GLUE test sets) carry -1
            part[spec.label_field] = [classes[int(c)] for c in part[spec.label_field]]
        part["split"] = split
        parts.append(part)
    if not parts:
        raise ValueError(f"task {spec.name!r}: {spec.source} has no train/validation/test split")
    frame = pd.concat(parts, ignore_index=True)
    if classes is not None:
        frame.attrs["classes"] = classes
    frame.attrs["source_file"] = spec.source
    return frame


# ----------------------------------------------------------------------------------------------
# Loading, splitting, writing
# ----------------------------------------------------------------------------------------------


def _raw_frame(spec: TaskSpec) -> pd.DataFrame:
    kind = spec.source_kind
    if kind == "package":
        return BUILTIN_LOADERS[spec.source_target](**dict(spec.options))
    if kind == "file":
        return _read_file(spec)
    return _load_hf(spec)


def load_task_frame(spec: TaskSpec) -> pd.DataFrame:
    """Load a task's rows as ``text`` (str, stripped, non-empty), ``label`` (int64 0..K-1) and,
    if the source has its own splits, ``split`` (train/dev/test). ``attrs["classes"]`` holds the
    class names in label order, ``attrs["source_file"]`` where the rows came from.
    """
    raw = _raw_frame(spec)
    where = f"task {spec.name!r} ({raw.attrs.get('source_file', spec.source)})"
    image_field = spec.image_field or raw.attrs.get("image_field")
    content = ("image_field", image_field) if image_field else ("text_field", spec.text_field)
    if spec.language_model and spec.label_field not in raw.columns:   # unlabelled text: one class
        raw = raw.assign(**{spec.label_field: "text"})
    for key, column in (content, ("label_field", spec.label_field)):
        if column not in raw.columns:
            raise ValueError(
                f"{where}: {key} column {column!r} not found (columns: {', '.join(map(str, raw.columns))})"
            )
    split_col = spec.split_field if spec.split_field in raw.columns else None
    if spec.split_field not in (None, "split") and split_col is None:
        raise ValueError(
            f"{where}: split_field column {spec.split_field!r} not found "
            f"(columns: {', '.join(map(str, raw.columns))})"
        )

    text = raw[content[1]]
    missing_text = text.isna().to_numpy()
    missing_label = raw[spec.label_field].isna().to_numpy() & ~missing_text
    keep = ~missing_text & ~missing_label
    if image_field:
        from featcal.data.images import to_png

        texts = pd.Series([to_png(v, f"{where} row {i}") for i, v in text[keep].items()], dtype=object)
    elif not pd.api.types.is_string_dtype(text) and not pd.api.types.is_object_dtype(text):
        raise ValueError(f"{where}: text_field column {spec.text_field!r} holds {text.dtype}, not text")
    else:
        texts = text[keep].astype(str).str.strip()
    raw_labels = raw[spec.label_field][keep]
    label_keys = [_label_key(v) for v in raw_labels]

    if spec.label_map is not None:
        missing = sorted(set(label_keys) - set(spec.label_map))
        if missing:
            raise ValueError(
                f"{where}: label_field column {spec.label_field!r} has values not in label_map: "
                f"{missing[:10]}"
            )
        classes = list(dict.fromkeys(v for v in spec.label_map.values() if v is not None))
        names = [spec.label_map[k] for k in label_keys]
    else:
        present = list(dict.fromkeys(label_keys))
        default = raw.attrs.get("classes")
        if default is not None:
            classes = [str(c) for c in default]
            extra = sorted(set(present) - set(classes))
            if extra:
                raise ValueError(
                    f"{where}: label_field column {spec.label_field!r} has values {extra[:10]} "
                    f"outside the source's classes {classes}; give a label_map"
                )
        elif pd.api.types.is_integer_dtype(raw_labels) or all(k.lstrip("-").isdigit() for k in present):
            classes = [str(v) for v in sorted({int(k) for k in present})]
        else:
            classes = sorted(present)
        names = label_keys
    index = {c: i for i, c in enumerate(classes)}
    codes = np.array([index.get(n, -1) if n is not None else -1 for n in names], dtype=np.int64)

    column = "image" if image_field else "text"
    out = pd.DataFrame({column: texts.to_numpy(dtype=object), "label": codes})
    if split_col is not None:
        splits = raw[split_col][keep].astype(str).str.strip().str.lower()
        bad = sorted(set(splits) - set(_SPLIT_ALIASES))
        if bad:
            raise ValueError(
                f"{where}: split_field column {split_col!r} has values {bad[:10]} "
                f"(expected train/dev/validation/test)"
            )
        out["split"] = splits.map(_SPLIT_ALIASES).to_numpy(dtype=object)
    mapped_null = (out["label"] < 0).to_numpy()
    lengths = out[column].map(len) if image_field else out[column].str.len()
    short = ~mapped_null & (lengths < max(spec.min_chars, 1)).to_numpy()
    dropped = {"missing text": int(missing_text.sum()), "missing label": int(missing_label.sum()),
               "label mapped to null": int(mapped_null.sum()),
               ("empty text" if spec.min_chars <= 1 else f"text under {spec.min_chars} characters"): int(short.sum())}
    dropped = {reason: n for reason, n in dropped.items() if n}
    out = out[~mapped_null & ~short].reset_index(drop=True)
    if dropped:
        log.info("task %s: dropped %d of %d rows: %s", spec.name, sum(dropped.values()), len(raw),
                 ", ".join(f"{reason} {n}" for reason, n in dropped.items()))
    if out.empty:
        raise ValueError(f"{where}: no usable rows (non-empty text with a mapped label)")
    present = sorted(set(out["label"]))
    if len(present) < 2 and not spec.language_model:
        raise ValueError(
            f"{where}: all {len(out)} usable rows have the same class {classes[present[0]]!r} "
            f"(label_field {spec.label_field!r}); a classifier needs at least two classes"
        )
    out.attrs["classes"] = classes
    out.attrs["source_file"] = raw.attrs.get("source_file", spec.source)
    out.attrs["dropped"] = dropped
    # every raw spelling found -> its class (null: dropped), so the normalisation can be checked
    spellings = dict.fromkeys(str(v).strip() for v in raw_labels)
    out.attrs["raw_labels"] = {
        raw_value: (spec.label_map.get(_label_key(raw_value)) if spec.label_map is not None else _label_key(raw_value))
        for raw_value in spellings
    }
    return out


def _dedupe(frame: pd.DataFrame, task: str) -> pd.DataFrame:
    """Keep one row per exact text (image); drop texts seen with conflicting labels. Where a text
    occurs in several source splits, the copy in test (then dev) wins so the source's test set is kept."""
    column = example_column(frame.columns)
    n_labels = frame.groupby(column)["label"].nunique()
    conflicting = set(n_labels.index[n_labels > 1])
    in_conflict = frame[column].isin(conflicting)
    frame = frame[~in_conflict]
    if "split" in frame.columns:
        priority = frame["split"].map({"test": 0, "dev": 1, "train": 2})
        frame = frame.assign(_p=priority).sort_values(["_p"], kind="stable").drop(columns="_p")
    n_before = len(frame)
    frame = frame.drop_duplicates(column, keep="first")
    dropped = {"duplicate text": n_before - len(frame), "text with conflicting labels": int(in_conflict.sum())}
    if any(dropped.values()):
        log.info("task %s: dropped %s", task, ", ".join(f"{reason} {n} rows" for reason, n in dropped.items() if n))
    return frame


def _balance(frame: pd.DataFrame, rng: np.random.Generator) -> pd.DataFrame:
    counts = frame["label"].value_counts()
    smallest = int(counts.min())
    keep = []
    for label in sorted(counts.index):
        idx = frame.index[frame["label"] == label].to_numpy()
        keep.append(rng.permutation(idx)[:smallest])
    return frame.loc[np.sort(np.concatenate(keep))]


def _allocate(size: int, weights: np.ndarray, capacity: np.ndarray, min_each: int = 0) -> np.ndarray:
    """Integer per-class counts summing to ``size``: proportional to ``weights`` (largest
    remainder), never above ``capacity``, and at least ``min_each`` per class where possible."""
    size = int(min(size, capacity.sum()))
    exact = size * weights / max(weights.sum(), 1)
    quota = np.minimum(np.floor(exact).astype(np.int64), capacity)
    if min_each and size >= min_each * np.count_nonzero(capacity):
        quota = np.maximum(quota, np.minimum(min_each, capacity))
    while quota.sum() > size:  # the minimums overshot: take back from the most over-served class
        over = np.where(quota > np.minimum(min_each, capacity), quota - exact, -np.inf)
        quota[int(np.argmax(over))] -= 1
    while quota.sum() < size:
        room = np.where(quota < capacity, exact - quota, -np.inf)
        quota[int(np.argmax(room))] += 1
    return quota


def _planned_sizes(n_pool: int, requests: dict[str, int], task: str) -> dict[str, int]:
    """Sizes for the splits carved from one pool: as requested when the pool allows, else every
    request scaled by the same factor (dev/test at least 1, train gets the rest)."""
    total = sum(requests.values())
    if n_pool >= total:
        return dict(requests)
    if n_pool < len(requests):
        raise ValueError(f"task {task!r}: only {n_pool} usable rows, too few for splits {list(requests)}")
    scale = n_pool / total
    sizes = {s: max(1, math.floor(n * scale)) for s, n in requests.items() if s != "train"}
    if "train" in requests:
        sizes["train"] = min(requests["train"], n_pool - sum(sizes.values()))
    return sizes


def _task_rng(seed: int, name: str) -> np.random.Generator:
    """Per-task generator: adding or removing another task never changes this task's split."""
    return np.random.default_rng([int(seed) & 0xFFFFFFFF, zlib.crc32(name.encode("utf-8"))])


def split_task(frame: pd.DataFrame, spec: TaskSpec, seed: int = 0) -> dict[str, pd.DataFrame]:
    """Seeded, stratified train/dev/test splits of a :func:`load_task_frame` frame.

    Exact duplicate texts are collapsed first (texts with conflicting labels are dropped), so no
    text is in two splits; empty texts are dropped. Without a ``split`` column, test (``n_test``),
    dev (``n_dev``) and train (up to ``max_train``) are drawn from all rows; with one, each split
    is drawn from the source's own split, and a split the source lacks is carved from its train
    rows. When a pool is smaller than requested, all requests on it shrink by one factor (dev and
    test stay non-empty) and a warning says so. Class proportions in every split follow the pool
    (largest remainder); the result depends only on the rows, ``spec`` and ``seed``, not on row
    order. Each split has columns ``text`` (str) and ``label`` (int64).
    """
    rng = _task_rng(seed, spec.name)
    column = example_column(frame.columns)
    if column == "text":
        frame = frame[frame["text"].astype(str).str.strip().str.len() > 0]
    frame = _dedupe(frame, spec.name)
    # Canonical order, so the outcome does not depend on how the source ordered its rows.
    frame = frame.sort_values(["label", column], kind="stable").reset_index(drop=True)
    n_classes = int(frame["label"].max()) + 1 if len(frame) else 0
    requests = {"test": spec.n_test, "dev": spec.n_dev, "train": spec.max_train}

    if "split" in frame.columns:
        pools = {s: frame[frame["split"] == s] for s in SPLITS}
    else:
        pools = {"train": frame, "dev": frame.iloc[:0], "test": frame.iloc[:0]}
    own = [s for s in ("test", "dev") if len(pools[s])]
    carved = [s for s in ("test", "dev") if s not in own] + ["train"]

    out: dict[str, pd.DataFrame] = {}
    notes = []
    for split in own:
        pool = _balance(pools[split], rng) if spec.balance else pools[split]
        size = min(requests[split], len(pool))
        if size < requests[split]:
            notes.append(f"{split} uses all {size} rows of the source's {split} split (< {requests[split]})")
        out[split] = _draw(pool, {split: size}, n_classes, rng)[split]
    pool = _balance(pools["train"], rng) if spec.balance else pools["train"]
    sizes = _planned_sizes(len(pool), {s: requests[s] for s in carved}, spec.name)
    shrunk = {s: n for s, n in sizes.items() if n < requests[s]}
    if shrunk:
        notes.append(
            f"only {len(pool)} usable rows for {'/'.join(carved)} (requested "
            f"{sum(requests[s] for s in carved)}): shrunk proportionally to "
            + ", ".join(f"{s}={sizes[s]}" for s in carved)
        )
    out.update(_draw(pool, sizes, n_classes, rng))
    for note in notes:
        log.warning("task %s: %s", spec.name, note)
    return {s: out[s] for s in SPLITS}


def _draw(
    pool: pd.DataFrame, sizes: dict[str, int], n_classes: int, rng: np.random.Generator
) -> dict[str, pd.DataFrame]:
    """Stratified draw of disjoint splits from one pool, eval splits first (in ``sizes`` order)."""
    by_class = [rng.permutation(pool.index[pool["label"] == c].to_numpy()) for c in range(n_classes)]
    weights = np.array([len(ix) for ix in by_class], dtype=np.float64)
    used = np.zeros(n_classes, dtype=np.int64)
    out = {}
    for split, size in sizes.items():
        capacity = weights.astype(np.int64) - used
        quota = _allocate(size, weights, capacity, min_each=0 if split == "train" else 1)
        chosen = np.concatenate(
            [by_class[c][used[c] : used[c] + quota[c]] for c in range(n_classes)] + [np.array([], dtype=np.int64)]
        )
        used += quota
        column = example_column(pool.columns)
        part = pool.loc[rng.permutation(chosen), [column, "label"]]
        examples = part[column] if column == "image" else part[column].astype(str)
        out[split] = pd.DataFrame({column: examples.to_numpy(dtype=object), "label": part["label"].to_numpy(np.int64)})
    return out


def write_task(
    splits: Mapping[str, pd.DataFrame],
    out_dir: str | Path,
    labels: list[str],
    raw_labels: Mapping[str, str | None] | None = None,
    dropped: Mapping[str, int] | None = None,
) -> Path:
    """Write ``<out_dir>/{train,dev,test}.parquet`` (``text`` string or ``image`` PNG bytes,
    ``label`` int64) and
    ``labels.json`` atomically: everything goes to a temporary folder next to ``out_dir``, which
    then replaces ``out_dir``; on failure nothing of it is left behind (and what a killed run
    left is removed by the next). ``labels.json`` holds ``classes`` (label i is ``classes[i]``),
    ``raw_labels`` (each raw label spelling found -> its class, null: dropped) and ``dropped``
    (rows left out at loading, per reason); see :func:`load_task_frame`."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    out_dir = Path(out_dir)
    labels = [str(label) for label in labels]
    for split in SPLITS:
        if split not in splits:
            raise ValueError(f"{out_dir}: split {split!r} missing (got {sorted(splits)})")
        frame = splits[split]
        for column in (example_column(frame.columns), "label"):
            if column not in frame.columns:
                raise ValueError(f"{out_dir}: split {split!r} has no column {column!r}")
        bad = frame["label"][(frame["label"] < 0) | (frame["label"] >= len(labels))]
        if len(bad):
            raise ValueError(
                f"{out_dir}: split {split!r} column 'label' has {bad.iloc[0]!r} outside 0..{len(labels) - 1}"
            )
    out_dir.parent.mkdir(parents=True, exist_ok=True)
    remove_stale_temps(out_dir)
    tmp = Path(tempfile.mkdtemp(prefix=temp_prefix(out_dir), dir=out_dir.parent))
    try:
        tmp.chmod(0o777 & ~_umask())  # mkdtemp makes it 0700; give it a normal folder's mode
        for split in SPLITS:
            frame = splits[split]
            if example_column(frame.columns) == "image":
                examples = pa.array(frame["image"].tolist(), type=pa.binary())
            else:
                examples = pa.array(frame["text"].astype(str).tolist(), type=pa.string())
            table = pa.table({example_column(frame.columns): examples,
                              "label": pa.array(frame["label"].to_numpy(np.int64), type=pa.int64())})
            pq.write_table(table, tmp / f"{split}.parquet")
        record = {"classes": labels, "raw_labels": dict(raw_labels or {}), "dropped": dict(dropped or {})}
        (tmp / "labels.json").write_text(json.dumps(record, indent=1) + "\n", encoding="utf-8")
        old = None
        if out_dir.exists():
            old = Path(tempfile.mkdtemp(prefix=temp_prefix(out_dir) + "old-", dir=out_dir.parent))
            old.rmdir()
            out_dir.rename(old)
        tmp.rename(out_dir)
        if old is not None:
            shutil.rmtree(old, ignore_errors=True)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return out_dir


def _umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask


def summarize(name: str, splits: Mapping[str, pd.DataFrame], labels: list[str]) -> str:
    """One line: counts per split, and the classes with their share of all written rows."""
    counts = np.zeros(len(labels), dtype=np.int64)
    for frame in splits.values():
        counts += np.bincount(frame["label"].to_numpy(np.int64), minlength=len(labels))
    total = max(int(counts.sum()), 1)
    sizes = " ".join(f"{s}={len(splits[s])}" for s in SPLITS)
    shares = ", ".join(f"{label} {100 * c / total:.0f}%" for label, c in zip(labels, counts))
    return f"{name}: {sizes} | {len(labels)} classes: {shares}"
