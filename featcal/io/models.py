"""Loading and saving models: local folders, hub ids, a model shipped inside a Python package, or a
checkpoint shipped in split parts across several packages (`featcal.io.split_packages`).

A multi-task model on disk is one backbone folder (`save_pretrained`, loadable with
`AutoModel.from_pretrained`) plus `heads/<task>/`, each a full task model config and its head
parameters, so `load_task_model(dir, task)` rebuilds `AutoModelForSequenceClassification` (for vision
models `AutoModelForImageClassification`).
"""

from __future__ import annotations

import contextlib
import importlib.util
import json
import logging
import math
import os
import warnings
from pathlib import Path
from typing import Iterable, Mapping, Sequence

import torch
from safetensors.torch import load_file, save_file
from torch import nn
from transformers import (AutoConfig, AutoModel, AutoModelForCausalLM, AutoModelForImageClassification,
                          AutoModelForSequenceClassification)

from featcal.io.atomic import (  # noqa: F401  (re-exported: the stages and merges import them from here)
    atomic_dir, atomic_file, remove_stale_temps, temp_prefix, write_json,
)

PACKAGE_PREFIX = "package:"
PARTS_PREFIX = "parts:"
# ‖θ_expert − θ_base‖ / ‖θ_base‖ over the backbone's weight matrices: fine-tunes stay far below
# this (the demo's experts: ~0.01); a random init or another checkpoint of that shape lands near 1.4
IMPLAUSIBLE_TASK_VECTOR_RATIO = 0.5
WEIGHT_FILES = ("model.safetensors", "pytorch_model.bin")
IMAGE_MODEL_TYPES = ("vit", "clip_vision_model", "clip")
INDEX_FILES = ("model.safetensors.index.json", "pytorch_model.bin.index.json")


def backbone_of(model: nn.Module) -> nn.Module:
    """A Hugging Face task model's base model (`model.<base_model_prefix>`), or the model itself."""
    prefix = getattr(model, "base_model_prefix", "")
    return getattr(model, prefix) if prefix and hasattr(model, prefix) else model


class NonFiniteWeightsError(ValueError):
    """A checkpoint or a model about to be written holds NaN or infinite values."""


class ImplausibleExpertWarning(UserWarning):
    """An expert looks like no fine-tune of the base (its task vector is as large as the base)."""


def _hub_offline() -> bool:
    return os.environ.get("HF_HUB_OFFLINE", "").strip().lower() in ("1", "on", "yes", "true")


def _is_hub_id(ref: str) -> bool:
    from huggingface_hub.utils import HFValidationError, validate_repo_id

    try:
        validate_repo_id(ref)
    except HFValidationError:
        return False
    return True


def _hub_cached(ref: str) -> bool:
    from huggingface_hub import try_to_load_from_cache

    return isinstance(try_to_load_from_cache(ref, "config.json"), str)


def resolve_model_ref(ref: str | os.PathLike) -> str:
    """A local path, a hub id, `package:<module>[/subdir]` (default subdir `model`), or
    `parts:<name>`: a split checkpoint of `featcal.io.split_packages.SPLIT_CHECKPOINTS`, assembled
    from its installed parts on first use.

    A missing local path is an error naming it (not a hub "Repo id must be..." error), and so is
    a hub id that is neither a local folder nor cached while hub downloads are off.
    """
    ref = str(ref)
    if ref.startswith(PARTS_PREFIX):
        from featcal.io.split_packages import resolve_split_checkpoint

        return resolve_split_checkpoint(ref[len(PARTS_PREFIX):])
    if not ref.startswith(PACKAGE_PREFIX):
        if Path(ref).exists():
            return ref
        if not _is_hub_id(ref):
            raise FileNotFoundError(f"model reference {ref!r}: no such file or folder")
        if _hub_offline() and not _hub_cached(ref):
            raise FileNotFoundError(f"model reference {ref!r}: no such local folder, and no cached hub model of "
                                    "that name (hub downloads are off: HF_HUB_OFFLINE=1)")
        return ref
    module, _, sub = ref[len(PACKAGE_PREFIX):].partition("/")
    spec = importlib.util.find_spec(module)
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError(f"model reference {ref!r}: Python package {module!r} is not installed")
    path = Path(list(spec.submodule_search_locations)[0]) / (sub or "model")
    if not (path / "config.json").exists():
        raise FileNotFoundError(f"model reference {ref!r}: no config.json under {path}")
    return str(path)


def load_backbone(ref: str, like: nn.Module | None = None) -> nn.Module:
    """The bare backbone (`AutoModel`), e.g. the pretrained base; non-finite weights are an error.
    `like`: an expert (task model or backbone) whose structure the base must have to be merged with
    it: no pooler where the expert's backbone has none (MPNet's and RoBERTa's classifiers drop the
    pooler their pretrained checkpoint holds)."""
    path = resolve_model_ref(ref)
    names = stored_tensors(Path(path)) if Path(path).is_dir() else None
    pooler = None if like is None else getattr(backbone_of(like), "pooler", None) is not None
    kwargs = backbone_kwargs(names, AutoConfig.from_pretrained(path), pooler)
    return checked_load(AutoModel.from_pretrained(path, **kwargs), path)


def backbone_kwargs(tensor_names: Iterable[str] | None, config, pooler: bool | None = None) -> dict:
    """`add_pooling_layer=False` for a checkpoint (holding `tensor_names`; None: unknown) without
    pooler tensors whose backbone would otherwise get one (a ViT image classifier's `vit` has
    none; `ViTModel` adds one by default), or when `pooler` is False."""
    import inspect

    model_class = AutoModel._model_mapping.get(type(config), None)
    if model_class is None or "add_pooling_layer" not in inspect.signature(model_class.__init__).parameters:
        return {}
    if pooler is False:
        return {"add_pooling_layer": False}
    if tensor_names is None:
        return {}
    has_pooler = any(n.startswith("pooler.") or ".pooler." in n for n in tensor_names)
    return {} if has_pooler else {"add_pooling_layer": False}


def is_image_model(model_type: str | None) -> bool:
    """Whether a config's `model_type` is a vision model (its inputs are images, its task model an image classifier)."""
    return model_type in IMAGE_MODEL_TYPES


CAUSAL_LM_SUFFIX = "ForCausalLM"


def is_causal_lm_config(config) -> bool:
    """Whether a config was saved from a causal language model (`architectures`)."""
    return any(a.endswith(CAUSAL_LM_SUFFIX) for a in getattr(config, "architectures", None) or ())


def saved_as_causal_lm(ref: str | os.PathLike) -> bool:
    """Whether a model folder (or reference) holds a causal LM, from its config alone (nothing is loaded)."""
    return is_causal_lm_config(AutoConfig.from_pretrained(resolve_model_ref(ref)))


def is_causal_lm(model: nn.Module) -> bool:
    """A causal-LM task model, or a bare decoder whose checkpoint was saved from one (its config's
    `architectures`); a task model with another head (a classifier) is not one."""
    if type(model).__name__.endswith(CAUSAL_LM_SUFFIX):
        return True
    return backbone_of(model) is model and is_causal_lm_config(getattr(model, "config", None))


def task_model_class(config, causal_lm: bool | None = None) -> type:
    """The task-model class of a config: image classification for vision models, a causal LM for a
    config saved from one (or with `causal_lm`), else sequence classification (or with
    `causal_lm=False`: a classifier on a causal-LM checkpoint)."""
    if config.model_type == "clip_vision_model":   # registers its classifier (an import of CLIP's modelling code)
        from featcal.io import clip_vision  # noqa: F401

    if is_image_model(config.model_type):
        return AutoModelForImageClassification
    causal_lm = is_causal_lm_config(config) if causal_lm is None else causal_lm
    return AutoModelForCausalLM if causal_lm else AutoModelForSequenceClassification


log = logging.getLogger(__name__)


@contextlib.contextmanager
def quiet_loading():
    """transformers' load report (a table of missing and unexpected tensors per load) held back:
    the caller says in words what was expected and refuses what was not. (With the report's logger
    at ERROR, transformers checks the model's tensor-parallel plan and warns, on its own logger, of
    every layer "not sharded" by it, though nothing is sharded here: that one is held back too.)"""
    loggers = [logging.getLogger(name) for name in ("transformers.modeling_utils",
                                                    "transformers.distributed.tensor_parallel")]
    levels = [logger.level for logger in loggers]
    for logger in loggers:
        logger.setLevel(logging.ERROR)
    try:
        yield
    finally:
        for logger, level in zip(loggers, levels):
            logger.setLevel(level)


def load_classifier(ref: str, num_labels: int | None = None) -> nn.Module:
    """A sequence- or image-classification model, or the causal LM that a checkpoint saved from one
    holds; a new classification head is initialised when `num_labels` is given (said in one line;
    a causal-LM checkpoint then gives a classifier). Without `num_labels` the checkpoint must hold the whole task model: a
    tensor it lacks (a masked-LM or bare checkpoint has no classification head) is an error naming
    the checkpoint, never a random head. Non-finite weights are an error naming the file and the tensor."""
    kwargs = {} if num_labels is None else {"num_labels": num_labels}
    path = resolve_model_ref(ref)
    config = AutoConfig.from_pretrained(path)
    task_class = task_model_class(config, causal_lm=False if num_labels is not None else None)   # a new head: a classifier
    with quiet_loading():
        model, info = task_class.from_pretrained(path, output_loading_info=True, **kwargs)
    missing = sorted(info.get("missing_keys") or ())
    if missing and num_labels is None:
        shown = ", ".join(missing[:4]) + (", ..." if len(missing) > 4 else "")
        raise ValueError(f"{ref}: not a fine-tuned {type(model).__name__}: {len(missing)} of its tensors are not in "
                         f"the checkpoint ({shown}; the checkpoint is a {', '.join(config.architectures or ['?'])}); "
                         "an expert must hold its own trained head")
    if missing:
        log.info("%s: a new %d-label head (%s not in the checkpoint, as expected of a base model)",
                 ref, num_labels, ", ".join(missing))
    return checked_load(model, path)


# --- weights checked where they enter and leave ----------------------------------------------------------


def first_nonfinite(tensors: Mapping[str, torch.Tensor]) -> tuple[str, str] | None:
    """The name of the first floating tensor holding NaN or ±Inf, and how many of each."""
    for name, value in tensors.items():
        if value.is_floating_point() and not bool(torch.isfinite(value).all()):
            nan, inf = int(torch.isnan(value).sum()), int(torch.isinf(value).sum())
            return name, f"{nan} NaN and {inf} infinite values (of {value.numel()})"
    return None


def check_finite(tensors: Mapping[str, torch.Tensor], where: str) -> None:
    """Refuse tensors holding NaN or ±Inf, naming `where` (a file or a model) and the tensor."""
    found = first_nonfinite(tensors)
    if found is not None:
        raise NonFiniteWeightsError(f"{where}: tensor {found[0]!r} holds {found[1]}")


def stored_tensors(folder: Path) -> dict[str, Path] | None:
    """Tensor name -> weight file of a checkpoint folder (its index, or its one safetensors file);
    None where the folder does not say (a `.bin` file, no weights)."""
    for index in INDEX_FILES:
        if (folder / index).is_file():
            return {k: folder / v for k, v in json.loads((folder / index).read_text())["weight_map"].items()}
    if (folder / WEIGHT_FILES[0]).is_file():
        from safetensors import safe_open

        with safe_open(folder / WEIGHT_FILES[0], "pt") as handle:
            return dict.fromkeys(handle.keys(), folder / WEIGHT_FILES[0])
    return None


def _checkpoint_file(folder: Path, name: str, prefix: str) -> tuple[str, str]:
    """The weight file of a folder holding tensor `name`, and the tensor's name in that file."""
    candidates = [name, f"{prefix}.{name}", name.removeprefix(f"{prefix}.")]
    stored = stored_tensors(folder)
    if stored is not None:
        key = next((k for k in candidates if k in stored), name)
        return str(stored.get(key, folder)), key
    for file in WEIGHT_FILES:
        if (folder / file).is_file():
            return str(folder / file), name
    return str(folder), name


def checked_load(model: nn.Module, path: str) -> nn.Module:
    """`model` (just loaded from `path`) in eval mode, or an error naming the file and tensor
    that hold NaN or ±Inf: such weights would silently turn every result into NaN."""
    found = first_nonfinite(model.state_dict())
    if found is not None:
        file, key = _checkpoint_file(Path(path), found[0], getattr(model, "base_model_prefix", ""))
        raise NonFiniteWeightsError(f"{file}: tensor {key!r} holds {found[1]}; the checkpoint is damaged "
                                    "or its training diverged: re-create it")
    return model.eval()


def task_vector_sums(base: Mapping[str, torch.Tensor], expert: Mapping[str, torch.Tensor]) -> tuple[float, float]:
    """(‖θ_expert − θ_base‖², ‖θ_base‖²) over the weight matrices both hold (float64): sums that
    add over tensor groups, for merges that stream. Norm scales and biases are left out: they
    start equal (ones, zeros) in any two random inits."""
    diff = norm = 0.0
    for name, value in base.items():
        if value.is_floating_point() and value.ndim >= 2 and name in expert:
            value = value.double()
            diff += float((expert[name].double() - value).pow(2).sum())
            norm += float(value.pow(2).sum())
    return diff, norm


def task_vector_ratio(base: Mapping[str, torch.Tensor], expert: Mapping[str, torch.Tensor]) -> float:
    """‖θ_expert − θ_base‖ / ‖θ_base‖ (`task_vector_sums`)."""
    return ratio_of(*task_vector_sums(base, expert))


def ratio_of(diff: float, norm: float) -> float:
    return math.sqrt(diff) / max(math.sqrt(norm), 1e-12)


# config keys that fix a model's shape: an expert fine-tuned from the base has the base's values
SHAPE_KEYS = ("num_hidden_layers", "num_layers", "num_decoder_layers", "hidden_size", "d_model", "intermediate_size",
              "d_ff", "num_attention_heads", "num_key_value_heads", "vocab_size")


def shape_mismatch(base_config, expert_config) -> str | None:
    """The first shape-fixing config value in which an expert differs from its base, said; None if none.
    (An expert with more layers than the base has every base tensor, so a tensor-by-tensor check of
    the base's names would pass it.)"""
    for key in SHAPE_KEYS:
        mine, theirs = getattr(base_config, key, None), getattr(expert_config, key, None)
        if mine is not None and theirs is not None and mine != theirs:
            return f"its {key} is {theirs}, the base's is {mine}"
    return None


def check_experts_fit_base(base: nn.Module, experts: Mapping[str, nn.Module]) -> None:
    """Experts must be of the base's model type, with its tensors, and finite; an expert whose
    task vector is implausibly large for a fine-tune of the base gets a warning naming the ratio."""
    base_type = getattr(getattr(base, "config", None), "model_type", None)
    base_state = backbone_of(base).state_dict()
    for task, expert in experts.items():
        expert_type = getattr(getattr(expert, "config", None), "model_type", None)
        if expert_type != base_type:
            raise ValueError(f"expert {task!r} is a {expert_type!r} model ({type(expert).__name__}) but the base is a "
                             f"{base_type!r} model ({type(base).__name__}); experts must be fine-tuned from the base")
        state = backbone_of(expert).state_dict()
        for name, value in base_state.items():
            found = state.get(name)
            if found is None or found.shape != value.shape:
                shape = None if found is None else tuple(found.shape)
                raise ValueError(f"expert {task!r}: tensor {name!r} has shape {shape}, the base's is {tuple(value.shape)}; "
                                 "experts must be fine-tuned from the base")
        mismatch = shape_mismatch(getattr(base, "config", None), getattr(expert, "config", None))
        if mismatch:   # e.g. more layers than the base: every base tensor is there, and more
            raise ValueError(f"expert {task!r}: {mismatch}; experts must be fine-tuned from the base")
        check_finite(state, f"expert {task!r}")
        warn_if_implausible(task, task_vector_ratio(base_state, state))


def warn_if_implausible(expert: str, ratio: float) -> None:
    """Warn when an expert's task-vector ratio (`task_vector_ratio`) is too large for a fine-tune;
    for merges that stream tensors and sum the ratio's two norms themselves."""
    if ratio > IMPLAUSIBLE_TASK_VECTOR_RATIO:
        warnings.warn(f"expert {expert!r}: its task vector is {ratio:.2f} times the base's norm "
                      f"(‖θ_expert − θ_base‖ / ‖θ_base‖ over weight matrices; above {IMPLAUSIBLE_TASK_VECTOR_RATIO} "
                      "is implausible for a fine-tune): was it fine-tuned from this base, not from a random init or "
                      "another checkpoint?", ImplausibleExpertWarning, stacklevel=3)


def check_model_types(base: str | os.PathLike, experts: Mapping[str, str | os.PathLike]) -> None:
    """`check_experts_fit_base`'s model-type check from the configs alone (nothing is loaded), for
    merges that read the experts tensor by tensor (they check names, shapes and finiteness there)."""
    base_config = AutoConfig.from_pretrained(resolve_model_ref(base))
    for task, ref in experts.items():
        config = AutoConfig.from_pretrained(resolve_model_ref(ref))
        if config.model_type != base_config.model_type:
            raise ValueError(f"expert {task!r} ({ref}) is a {config.model_type!r} model but the base ({base}) is a "
                             f"{base_config.model_type!r} model; experts must be fine-tuned from the base")
        mismatch = shape_mismatch(base_config, config)
        if mismatch:
            raise ValueError(f"expert {task!r} ({ref}): {mismatch}; experts must be fine-tuned from the base")


def head_state(model: nn.Module) -> dict[str, torch.Tensor]:
    """Parameters outside the backbone: the task head. A head tied to a backbone tensor (a causal
    LM's `lm_head` tied to the embeddings) is the backbone's, not the head's."""
    prefix = model.base_model_prefix + "."
    state = model.state_dict()
    inside = {v.data_ptr() for k, v in state.items() if k.startswith(prefix)}
    return {k: v for k, v in state.items() if not k.startswith(prefix) and v.data_ptr() not in inside}


def with_backbone(task_model: nn.Module, backbone_state: Mapping[str, torch.Tensor]) -> nn.Module:
    """The task model with its backbone replaced (in place); the head is kept."""
    backbone_of(task_model).load_state_dict(dict(backbone_state))
    return task_model


def with_parameters_from(model: nn.Module, files: Sequence[str | os.PathLike]) -> nn.Module:
    """`model` with the tensors of each safetensors file put in place (e.g. calibrated layers over
    the merged backbone); a name the model lacks is an error naming the file."""
    state = model.state_dict()
    for path in files:
        for name, value in load_file(path).items():
            if name not in state:
                raise ValueError(f"{path}: parameter {name!r} is not in the model")
            state[name] = value
    model.load_state_dict(state)
    return model


def save_multitask(
    out_dir: str | os.PathLike,
    backbone: nn.Module,
    task_models: Mapping[str, nn.Module],
    encoder=None,
) -> None:
    """Backbone via `save_pretrained` (safetensors) + one head folder per task, written atomically.
    Nothing is written when any tensor is NaN or infinite."""
    check_finite(backbone.state_dict(), f"refusing to write {out_dir}: the backbone")
    for task, model in task_models.items():
        check_finite(head_state(model), f"refusing to write {out_dir}: the head of task {task!r}")
    with atomic_dir(out_dir) as tmp:
        save_model(backbone, tmp)
        save_heads(tmp, task_models, encoder)


def save_model(model: nn.Module, folder: str | os.PathLike) -> None:
    """`save_pretrained`, except that a causal LM's bare decoder keeps its task model's name in the
    config: transformers records the class saved (`Qwen2Model`), and a decoder so named is walked as a
    classifier's (`is_causal_lm`: its last block would weigh all but the last token by 0.01)."""
    kept = list(getattr(model.config, "architectures", None) or ())
    model.save_pretrained(folder)
    if backbone_of(model) is model and any(a.endswith(CAUSAL_LM_SUFFIX) for a in kept):
        model.config.architectures = kept   # the object's config too: save_pretrained overwrote it
        model.config.save_pretrained(folder)


def save_heads(folder: str | os.PathLike, task_models: Mapping[str, nn.Module], encoder=None,
               target: str | os.PathLike | None = None) -> None:
    """The multi-task layout's other half: `heads/<task>/` (config + head tensors) and the input
    encoder (tokenizer or image processor), written into a folder that holds (or will hold) the backbone.
    `target`: the folder errors name (where `folder` is the temporary one an atomic write fills)."""
    folder = Path(folder)
    if encoder is not None:
        encoder.save_pretrained(folder)
    for task, model in task_models.items():
        head = head_state(model)
        check_finite(head, f"refusing to write {target or folder}: the head of task {task!r}")
        head_dir = folder / "heads" / task
        head_dir.mkdir(parents=True)
        model.config.architectures = [type(model).__name__]   # as save_pretrained records it: the class to rebuild
        model.config.save_pretrained(head_dir)
        save_file({k: v.contiguous() for k, v in head.items()}, head_dir / "head.safetensors")


def load_task_model(model_dir: str | os.PathLike, task: str) -> nn.Module:
    """Rebuild a task's model (a classifier, or a causal LM) from a multi-task folder."""
    model_dir = Path(model_dir)
    head_dir = model_dir / "heads" / task
    if not head_dir.exists():
        known = sorted(p.name for p in (model_dir / "heads").iterdir()) if (model_dir / "heads").exists() else []
        raise FileNotFoundError(f"{model_dir}: no head for task {task!r} (heads: {known})")
    config = AutoConfig.from_pretrained(head_dir)
    model = task_model_class(config).from_config(config)
    backbone_of(model).load_state_dict(load_backbone(str(model_dir)).state_dict())
    missing, unexpected = model.load_state_dict(load_file(head_dir / "head.safetensors"), strict=False)
    head = head_state(model)   # (a tied head is the backbone's: not missing)
    head_missing = [k for k in missing if k in head]
    if head_missing or unexpected:
        raise ValueError(f"{head_dir}: head parameters do not match the model (missing {head_missing}, unexpected {unexpected})")
    return model.eval()
