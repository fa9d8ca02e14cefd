"""A task as `params.yaml` declares it (`TaskSpec`), checked without loading any data, so the
pipeline's params check stays cheap; `featcal.data.tasks` loads, splits and writes tasks."""

from __future__ import annotations

import difflib
import inspect
import math
import re
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any, Mapping

import numpy as np

from featcal.data.corpora import BUILTIN_LOADERS

SPLITS = ("train", "dev", "test")
_SPLIT_ALIASES = {
    "train": "train",
    "training": "train",
    "dev": "dev",
    "val": "dev",
    "valid": "dev",
    "validation": "dev",
    "test": "test",
    "testing": "test",
}
SOURCE_KINDS = ("package", "file", "hf")
FILE_SUFFIXES = (".parquet", ".csv", ".tsv", ".jsonl")
# what an expert of the task is trained for: a classifier of its labels, or a causal language
# model of its texts (labels unused: a source without them is read as one class)
OBJECTIVES = ("classification", "language_model")
_FILE_OPTIONS = {"sep", "encoding"}


# ----------------------------------------------------------------------------------------------
# Spec
# ----------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class TaskSpec:
    """One task as configured in ``params.yaml`` ``tasks.<name>``.

    ``label_map`` maps raw label values (compared as strings) to class names; a value of ``null``
    drops that raw label; class order (label 0..K-1) is the order of first appearance among the
    values. Without it, builtin and ``hf`` sources keep their own class order and ``file`` sources
    use the sorted unique labels. ``split_field`` names the column holding a source's own split
    (train/dev/validation/test); it is used when present, ``null`` ignores it. ``balance``
    downsamples every class to the smallest class (per source split) before splitting.
    ``image_field`` makes it an image task: that column holds the images (encoded bytes, a
    ``datasets`` image cell, a path or an array); builtin image loaders and image folders
    (``file:<folder>``, one sub-folder per class) name it themselves.
    ``objective`` is ``classification`` (the experts classify ``label``) or ``language_model``
    (causal-LM experts of the texts; labels, where the source has them, only stratify the splits).
    ``options`` are source-specific: keyword arguments of the builtin loader, ``sep`` /
    ``encoding`` for csv/tsv files, extra ``load_dataset`` arguments for ``hf``.
    """

    name: str
    source: str
    text_field: str = "text"
    label_field: str = "label"
    image_field: str | None = None
    label_map: Mapping[str, str | None] | None = None
    max_train: int = 2000
    n_dev: int = 300
    n_test: int = 500
    enabled: bool = True
    balance: bool = False
    min_chars: int = 1
    split_field: str | None = "split"
    objective: str = "classification"
    options: Mapping[str, Any] = field(default_factory=dict)

    @property
    def language_model(self) -> bool:
        return self.objective == "language_model"

    @property
    def source_kind(self) -> str:
        return self.source.split(":", 1)[0]

    @property
    def source_target(self) -> str:
        return self.source.split(":", 1)[1]

    @classmethod
    def from_mapping(cls, name: str, mapping: Mapping[str, Any] | None) -> "TaskSpec":
        """Build and validate a spec from one ``tasks:`` entry; errors name the task and key."""
        where = f"tasks.{name}"
        if not isinstance(name, str) or not name or "/" in name or name.startswith("."):
            raise ValueError(f"task name {name!r} is not a usable directory name")
        if not isinstance(mapping, Mapping):
            raise ValueError(f"{where}: expected a mapping of options, found {type(mapping).__name__}")
        allowed = {f.name for f in fields(cls)} - {"name"}
        unknown = sorted(set(map(str, mapping)) - allowed)
        if unknown:
            close = difflib.get_close_matches(unknown[0], sorted(allowed), n=1, cutoff=0.6)
            hint = f" (did you mean {close[0]!r}?)" if close else ""
            raise ValueError(
                f"{where}: unknown key {unknown[0]!r}{hint} (allowed keys: {', '.join(sorted(allowed))})"
            )
        if "source" not in mapping:
            raise ValueError(f"{where}: missing required key 'source'")
        kw: dict[str, Any] = dict(mapping)

        source = kw["source"]
        if not isinstance(source, str) or ":" not in source:
            raise ValueError(
                f"{where}.source: expected 'package:<loader>', 'file:<path>' or 'hf:<id>[:config]', "
                f"found {source!r}"
            )
        kind, target = source.split(":", 1)
        if kind not in SOURCE_KINDS or not target:
            raise ValueError(
                f"{where}.source: expected 'package:<loader>', 'file:<path>' or 'hf:<id>[:config]', "
                f"found {source!r}"
            )
        if kind == "package" and target not in BUILTIN_LOADERS:
            raise ValueError(
                f"{where}.source: unknown builtin loader {target!r} "
                f"(available: {', '.join(sorted(BUILTIN_LOADERS))})"
            )
        if kind == "file" and Path(target).suffix.lower() not in FILE_SUFFIXES and not Path(target).is_dir():
            raise ValueError(
                f"{where}.source: file {target!r} must be an image folder or end in one of {', '.join(FILE_SUFFIXES)}"
            )

        for key in ("text_field", "label_field"):
            if key in kw and (not isinstance(kw[key], str) or not kw[key]):
                raise ValueError(f"{where}.{key}: expected a column name, found {kw[key]!r}")
        for key in ("split_field", "image_field"):
            if key in kw and kw[key] is not None and (not isinstance(kw[key], str) or not kw[key]):
                raise ValueError(f"{where}.{key}: expected a column name or null, found {kw[key]!r}")
        for key, minimum in (("max_train", 1), ("n_dev", 1), ("n_test", 1), ("min_chars", 0)):
            if key in kw:
                value = kw[key]
                if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
                    raise ValueError(f"{where}.{key}: expected an integer >= {minimum}, found {value!r}")
        if "objective" in kw and kw["objective"] not in OBJECTIVES:
            raise ValueError(f"{where}.objective: expected one of {', '.join(OBJECTIVES)}, found {kw['objective']!r}")
        for key in ("enabled", "balance"):
            if key in kw and not isinstance(kw[key], bool):
                raise ValueError(f"{where}.{key}: expected true or false, found {kw[key]!r}")

        label_map = kw.get("label_map")
        if label_map is not None:
            if not isinstance(label_map, Mapping) or not label_map:
                raise ValueError(f"{where}.label_map: expected a non-empty mapping raw label -> class name")
            for raw, cls_name in label_map.items():
                if cls_name is not None and not isinstance(cls_name, (str, int)):
                    raise ValueError(
                        f"{where}.label_map.{raw}: expected a class name or null, found {cls_name!r}"
                    )
            kw["label_map"] = {}
            for raw, cls_name in label_map.items():
                key = _label_key(raw)
                if key in kw["label_map"]:
                    raise ValueError(
                        f"{where}.label_map: raw labels {raw!r} and another key both normalise to {key!r}"
                    )
                kw["label_map"][key] = None if cls_name is None else str(cls_name)
            if all(v is None for v in kw["label_map"].values()):
                raise ValueError(f"{where}.label_map: every raw label is mapped to null")

        options = kw.get("options") or {}
        if not isinstance(options, Mapping):
            raise ValueError(f"{where}.options: expected a mapping, found {type(options).__name__}")
        options = {str(k): v for k, v in options.items()}
        if kind == "package":
            params = inspect.signature(BUILTIN_LOADERS[target]).parameters
            for key in options:
                if key not in params:
                    raise ValueError(
                        f"{where}.options: unknown key {key!r} for loader {target!r} "
                        f"(allowed: {', '.join(params) or 'none'})"
                    )
        elif kind == "file":
            for key in options:
                if key not in _FILE_OPTIONS:
                    raise ValueError(
                        f"{where}.options: unknown key {key!r} for a file source "
                        f"(allowed: {', '.join(sorted(_FILE_OPTIONS))})"
                    )
        kw["options"] = options
        return cls(name=name, **kw)


_NUMBER = re.compile(r"[+-]?(\d+\.?\d*|\.\d+)([eE][+-]?\d+)?")


def _label_key(value: Any) -> str:
    """One spelling per label value, so that 1, 1.0, "1" and " 1.0 " are one class ("1"), and
    0.5 and "0.50" another ("0.5"); other text is only stripped."""
    if isinstance(value, (bool, np.bool_)):
        return str(bool(value))
    if isinstance(value, (int, np.integer)):
        return str(int(value))
    if isinstance(value, (float, np.floating)):
        return _number_key(float(value))
    text = str(value).strip()
    if _NUMBER.fullmatch(text):
        return _number_key(float(text))
    return text


def _number_key(number: float) -> str:
    if math.isfinite(number) and number.is_integer():
        return str(int(number))
    return repr(number)
