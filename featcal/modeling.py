"""Loading and saving models: local folders, hub ids, or a model shipped inside a Python package.

A multi-task model on disk is one backbone folder (`save_pretrained`, loadable with
`AutoModel.from_pretrained`) plus `heads/<task>/`, each a full task model config and its head
parameters, so `load_task_model(dir, task)` rebuilds `AutoModelForSequenceClassification`.
"""

from __future__ import annotations

import importlib.util
import json
import os
import shutil
import tempfile
from pathlib import Path
from typing import Mapping

import torch
from safetensors.torch import load_file, save_file
from torch import nn
from .families.base import backbone_of
from transformers import AutoConfig, AutoModel, AutoModelForSequenceClassification, AutoTokenizer

PACKAGE_PREFIX = "package:"


def resolve_model_ref(ref: str | os.PathLike) -> str:
    """A local path, a hub id, or `package:<module>[/subdir]` (default subdir `model`)."""
    ref = str(ref)
    if not ref.startswith(PACKAGE_PREFIX):
        return ref
    module, _, sub = ref[len(PACKAGE_PREFIX):].partition("/")
    spec = importlib.util.find_spec(module)
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError(f"model reference {ref!r}: Python package {module!r} is not installed")
    path = Path(list(spec.submodule_search_locations)[0]) / (sub or "model")
    if not (path / "config.json").exists():
        raise FileNotFoundError(f"model reference {ref!r}: no config.json under {path}")
    return str(path)


def load_tokenizer(ref: str):
    return AutoTokenizer.from_pretrained(resolve_model_ref(ref))


def load_backbone(ref: str) -> nn.Module:
    """The bare backbone (`AutoModel`), e.g. the pretrained base."""
    return AutoModel.from_pretrained(resolve_model_ref(ref)).eval()


def load_classifier(ref: str, num_labels: int | None = None) -> nn.Module:
    """A sequence-classification model; a new head is initialised when `num_labels` is given."""
    kwargs = {} if num_labels is None else {"num_labels": num_labels}
    return AutoModelForSequenceClassification.from_pretrained(resolve_model_ref(ref), **kwargs).eval()


def head_state(model: nn.Module) -> dict[str, torch.Tensor]:
    """Parameters outside the backbone: the task head."""
    prefix = model.base_model_prefix + "."
    return {k: v for k, v in model.state_dict().items() if not k.startswith(prefix)}


def with_backbone(task_model: nn.Module, backbone_state: Mapping[str, torch.Tensor]) -> nn.Module:
    """The task model with its backbone replaced (in place); the head is kept."""
    backbone_of(task_model).load_state_dict(dict(backbone_state))
    return task_model


class atomic_dir:
    """Write a folder under a temporary name and rename it into place only on success."""

    def __init__(self, target: str | os.PathLike):
        self.target = Path(target)

    def __enter__(self) -> Path:
        self.target.parent.mkdir(parents=True, exist_ok=True)
        self.tmp = Path(tempfile.mkdtemp(prefix=f".{self.target.name}.", dir=self.target.parent))
        return self.tmp

    def __exit__(self, exc_type, exc, tb) -> None:
        if exc_type is not None:
            shutil.rmtree(self.tmp, ignore_errors=True)
            return
        if self.target.exists():
            shutil.rmtree(self.target) if self.target.is_dir() else self.target.unlink()
        os.replace(self.tmp, self.target)


class atomic_file:
    """A temporary path next to `target`, renamed onto it only when the block succeeds."""

    def __init__(self, target: str | os.PathLike):
        self.target = Path(target)

    def __enter__(self) -> Path:
        self.target.parent.mkdir(parents=True, exist_ok=True)
        self.tmp = self.target.with_name(f".{self.target.name}.tmp")
        return self.tmp

    def __exit__(self, exc_type, exc, tb) -> None:
        if exc_type is not None:
            self.tmp.unlink(missing_ok=True)
            return
        os.replace(self.tmp, self.target)


def write_json(path: str | os.PathLike, data) -> None:
    with atomic_file(path) as tmp:
        tmp.write_text(json.dumps(data, indent=2, sort_keys=False) + "\n")


def save_multitask(
    out_dir: str | os.PathLike,
    backbone: nn.Module,
    task_models: Mapping[str, nn.Module],
    tokenizer=None,
) -> None:
    """Backbone via `save_pretrained` (safetensors) + one head folder per task, written atomically."""
    with atomic_dir(out_dir) as tmp:
        backbone.save_pretrained(tmp)
        if tokenizer is not None:
            tokenizer.save_pretrained(tmp)
        for task, model in task_models.items():
            head_dir = tmp / "heads" / task
            head_dir.mkdir(parents=True)
            model.config.save_pretrained(head_dir)
            save_file({k: v.contiguous() for k, v in head_state(model).items()}, head_dir / "head.safetensors")


def load_task_model(model_dir: str | os.PathLike, task: str) -> nn.Module:
    """Rebuild a task's sequence-classification model from a multi-task folder."""
    model_dir = Path(model_dir)
    head_dir = model_dir / "heads" / task
    if not head_dir.exists():
        known = sorted(p.name for p in (model_dir / "heads").iterdir()) if (model_dir / "heads").exists() else []
        raise FileNotFoundError(f"{model_dir}: no head for task {task!r} (heads: {known})")
    config = AutoConfig.from_pretrained(head_dir)
    model = AutoModelForSequenceClassification.from_config(config)
    backbone_of(model).load_state_dict(AutoModel.from_pretrained(model_dir).state_dict())
    missing, unexpected = model.load_state_dict(load_file(head_dir / "head.safetensors"), strict=False)
    head_missing = [k for k in missing if not k.startswith(model.base_model_prefix + ".")]
    if head_missing or unexpected:
        raise ValueError(f"{head_dir}: head parameters do not match the model (missing {head_missing}, unexpected {unexpected})")
    return model.eval()
