"""The typed schema of params.yaml: every section, key, type and range, checked before any model loads.

`validate(raw, root)` turns the parsed YAML (including what `dvc exp run -S` set) into `Params`
or raises `ParamsError` naming the key, the value found and what is allowed. Unknown keys are
refused in every section with the closest known key suggested, because a typo must never fall
back to a default silently. Cross-section checks follow: task and layer keys name existing
tasks and blocks of the base model, the base and every given expert are of a supported model
type (the same one), no URL carries a password (params end up in dvc.lock), and, for a DVC
stage, `stages/chain.yaml` was generated from these params (else: run `python stages/gen_chain.py`).
"""

from __future__ import annotations

import difflib
import math
import re
from dataclasses import MISSING, dataclass, field, fields
from pathlib import Path
from typing import Any, Callable, Mapping

import yaml

from featcal.calibration.config import check_device_name
from featcal.calibration.moments import PRODUCT_DTYPES
from featcal.io.feature_store import COMPRESSORS, STORAGE_DTYPES

CHAIN_FILE = "stages/chain.yaml"
HYPER_KEYS = ("alpha", "rho", "ridge")
COMPARE_FEATCAL_KEYS = (*HYPER_KEYS, "calibrate_pooler")   # compare.featcal: FeatCal's method values, over the spec's
CACHE_DTYPES = tuple(STORAGE_DTYPES)   # float32 | bfloat16 | float16 | float64 (models run in float64)
CACHE_COMPRESSORS = COMPRESSORS
# scheme://user:password@host — a password written into params would be recorded in dvc.lock
URL_WITH_PASSWORD = re.compile(r"^[A-Za-z][A-Za-z0-9+.-]*://[^/@:\s]*:[^/@\s]+@")


class ParamsError(ValueError):
    """A params value that is missing, unknown, of the wrong type or out of range."""


Parser = Callable[[Any, str], Any]


# --- value parsers: each takes (value, dotted key) and returns the checked value --------------------


def _closest(key: str, known) -> str:
    match = difflib.get_close_matches(str(key), [str(k) for k in known], n=1, cutoff=0.6)
    return f" (did you mean {match[0]!r}?)" if match else ""


def unknown_key(where: str, key, known, what: str = "key") -> ParamsError:
    """The error for a key no one reads: names it, suggests the closest known one, lists them all."""
    listed = ", ".join(sorted(map(str, known))) or "none"
    place = f"{where}.{key}" if where else str(key)
    return ParamsError(f"{place}: unknown {what} {str(key)!r}{_closest(key, known)}; known {what}s: {listed}")


def integer(low: int | None = None, high: int | None = None) -> Parser:
    def parse(value, where: str) -> int:
        if isinstance(value, bool) or not isinstance(value, int):
            raise ParamsError(f"{where} = {value!r}: expected an integer{_range_text(low, high)}")
        if (low is not None and value < low) or (high is not None and value > high):
            raise ParamsError(f"{where} = {value!r}: expected an integer{_range_text(low, high)}")
        return value
    return parse


def real(low: float | None = None, high: float | None = None, *, low_open: bool = False) -> Parser:
    def parse(value, where: str) -> float:
        allowed = f"a finite number{_range_text(low, high, low_open)}"
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
            raise ParamsError(f"{where} = {value!r}: expected {allowed}")
        below = value <= low if (low is not None and low_open) else (low is not None and value < low)
        if below or (high is not None and value > high):
            raise ParamsError(f"{where} = {value!r}: expected {allowed}")
        return float(value)
    return parse


def _range_text(low, high, low_open: bool = False) -> str:
    if low is not None and high is not None:
        return f" in {'(' if low_open else '['}{low}, {high}]"
    if low is not None:
        return f" {'>' if low_open else '>='} {low}"
    if high is not None:
        return f" <= {high}"
    return ""


def boolean(value, where: str) -> bool:
    if not isinstance(value, bool):
        raise ParamsError(f"{where} = {value!r}: expected true or false")
    return value


def text(value, where: str) -> str:
    if not isinstance(value, str) or not value.strip():
        raise ParamsError(f"{where} = {value!r}: expected a non-empty string")
    return value


def optional(parse: Parser) -> Parser:
    return lambda value, where: None if value is None else parse(value, where)


def one_of(*choices: str) -> Parser:
    def parse(value, where: str) -> str:
        if value not in choices:
            raise ParamsError(f"{where} = {value!r}: expected one of {', '.join(choices)}{_closest(value, choices)}")
        return value
    return parse


def device_name(value, where: str) -> str:
    """auto | cpu | cuda | cuda:N (whether CUDA is present is checked where calibration runs)."""
    try:
        check_device_name(text(value, where))
    except ValueError as exc:
        raise ParamsError(f"{where} = {value!r}: expected auto, cpu, cuda or cuda:N") from exc
    return value


def list_of(item: Parser, min_len: int = 0) -> Parser:
    def parse(value, where: str) -> list:
        if value is None:
            value = []
        if not isinstance(value, (list, tuple)) or len(value) < min_len:
            raise ParamsError(f"{where} = {value!r}: expected a list" + (f" of at least {min_len} items" if min_len else ""))
        return [item(v, f"{where}[{i}]") for i, v in enumerate(value)]
    return parse


def mapping(value, where: str) -> dict:
    if value is None:
        return {}
    if not isinstance(value, Mapping):
        raise ParamsError(f"{where} = {value!r}: expected a mapping of keys")
    return dict(value)


def mapping_of(item: Parser) -> Parser:
    def parse(value, where: str) -> dict:
        return {key: item(v, f"{where}.{key}") for key, v in mapping(value, where).items()}
    return parse


def section(cls: type) -> Parser:
    """Parse a mapping into the dataclass `cls`; each field's metadata holds its parser."""
    def parse(value, where: str):
        raw = mapping(value, where)
        known = {f.name: f for f in fields(cls)}
        for key in raw:
            if key not in known:
                raise unknown_key(where, key, known)
        values = {}
        for name, f in known.items():
            place = f"{where}.{name}" if where else name
            if name in raw:
                values[name] = f.metadata["parse"](raw[name], place)
            elif f.default is MISSING and f.default_factory is MISSING:
                raise ParamsError(f"{place}: missing; it is required")
        return cls(**values)
    return parse


def subset_of(cls: type, exclude: tuple[str, ...] = ()) -> Parser:
    """A mapping of some of `cls`'s keys (per-task or per-layer overrides), each parsed as in `cls`."""
    known = {f.name: f for f in fields(cls) if f.name not in exclude}

    def parse(value, where: str) -> dict:
        raw = mapping(value, where)
        for key in raw:
            if key not in known:
                raise unknown_key(where, key, known)
        return {k: known[k].metadata["parse"](v, f"{where}.{k}") for k, v in raw.items()}
    return parse


def knob(parse: Parser, default: Any = MISSING, factory: Callable | None = None):
    """A dataclass field that carries its parser."""
    if factory is not None:
        return field(default_factory=factory, metadata={"parse": parse})
    return field(default=default, metadata={"parse": parse})


def nested(cls: type):
    return knob(section(cls), factory=cls)


# --- the sections ----------------------------------------------------------------------------------


def prompt_template(value, where: str) -> str:
    if "{}" not in text(value, where):
        raise ParamsError(f'{where} = {value!r}: a prompt template needs "{{}}" where the class name goes')
    return value


@dataclass(frozen=True)
class ZeroShot:
    text_model: str | None = knob(optional(text), None)
    templates: list = knob(list_of(prompt_template, 1), factory=lambda: ["a photo of a {}."])


@dataclass(frozen=True)
class Model:
    base: str = knob(text)
    zero_shot: ZeroShot = nested(ZeroShot)


@dataclass(frozen=True)
class Tokens:
    max_length: int = knob(integer(1), 64)
    per_task: dict = knob(mapping_of(integer(1)), factory=dict)


@dataclass(frozen=True)
class Finetune:
    learning_rate: float = knob(real(0, low_open=True), 5e-5)
    epochs: float = knob(real(0, low_open=True), 2.0)
    batch_size: int = knob(integer(1), 32)
    weight_decay: float = knob(real(0), 0.01)
    warmup_ratio: float = knob(real(0, 1), 0.1)
    overrides: dict = knob(lambda v, w: mapping_of(subset_of(Finetune, ("overrides",)))(v, w), factory=dict)


@dataclass(frozen=True)
class Experts:
    paths: dict = knob(mapping_of(text), factory=dict)


@dataclass(frozen=True)
class Merge:
    method: str = knob(text, "task_arithmetic")
    options: dict = knob(mapping, factory=dict)


@dataclass(frozen=True)
class Calibration:
    examples_per_task: int = knob(integer(1), 128)
    batch_size: int = knob(integer(1), 16)


@dataclass(frozen=True)
class FeatCal:
    alpha: float = knob(real(0, 1), 0.25)
    rho: float = knob(real(0, low_open=True), 2.2)
    ridge: float = knob(real(0), 0.05)
    pooled_token_weight: float = knob(real(0, 1), 0.01)
    calibrate_bias: bool = knob(boolean, True)
    calibrate_norms: bool = knob(boolean, True)
    calibrate_pooler: bool = knob(boolean, False)
    product_dtype: str = knob(one_of(*PRODUCT_DTYPES), "float32")
    device: str = knob(device_name, "auto")
    layer_overrides: dict = knob(lambda v, w: mapping_of(subset_of(FeatCal, tuple(
        f.name for f in fields(FeatCal) if f.name not in HYPER_KEYS)))(v, w), factory=dict)
    use_tuned: bool = knob(boolean, False)


@dataclass(frozen=True)
class SearchRange:
    low: float = knob(real())
    high: float = knob(real())
    log: bool = knob(boolean, False)


def search_range(value, where: str) -> SearchRange:
    """[low, high] or {low, high, log}: low < high, and low > 0 on a log scale."""
    if isinstance(value, (list, tuple)):
        if len(value) != 2:
            raise ParamsError(f"{where} = {value!r}: expected [low, high] or {{low: .., high: .., log: true}}")
        value = {"low": value[0], "high": value[1]}
    elif not isinstance(value, Mapping):
        raise ParamsError(f"{where} = {value!r}: expected [low, high] or {{low: .., high: .., log: true}}")
    found = section(SearchRange)(value, where)
    if not found.low < found.high:
        raise ParamsError(f"{where} = {value!r}: low must be below high")
    if found.log and found.low <= 0:
        raise ParamsError(f"{where} = {value!r}: a log range needs low > 0")
    return found


@dataclass(frozen=True)
class Tune:
    n_trials: int = knob(integer(1), 24)
    seed: int = knob(integer(0), 0)
    study_name: str = knob(text, "featcal-dev")
    storage: str | None = knob(optional(text), None)
    startup_trials: int = knob(integer(0), 8)
    enqueue_defaults: bool = knob(boolean, True)
    search: dict = knob(mapping_of(search_range), factory=dict)
    anchor_search: dict = knob(mapping_of(search_range), factory=dict)
    prune_after_layers: list = knob(list_of(integer(0)), factory=list)
    prune_startup_trials: int = knob(integer(0), 5)


@dataclass(frozen=True)
class Evaluate:
    drift_examples_per_task: int = knob(integer(1), 128)


def c_range(value, where: str) -> list[float]:
    """A SigMerge capacity pair [c_min, c_max] with 0 <= c_min <= c_max <= 1."""
    pair = list_of(real(0, 1), 2)(value, where)
    if len(pair) != 2 or pair[0] > pair[1]:
        raise ParamsError(f"{where} = {value!r}: expected [c_min, c_max] with 0 <= c_min <= c_max <= 1")
    return pair


@dataclass(frozen=True)
class CompareSigmerge:
    anchors: list = knob(list_of(text, 1), factory=lambda: ["task_arithmetic", "ties"])
    grid: list = knob(list_of(c_range, 1), factory=lambda: [[0.02, 0.2]])
    shared_examples_per_task: int = knob(integer(1), 16)


@dataclass(frozen=True)
class Compare:
    anchors: dict = knob(mapping_of(mapping), factory=dict)
    examples_per_task: int = knob(integer(1), 128)
    sample_sizes: list = knob(list_of(integer(1), 1), factory=lambda: [128])
    corruptions: list = knob(list_of(text), factory=list)
    corruption_rate: float = knob(real(0, 1), 0.2)
    featcal: dict = knob(subset_of(FeatCal, tuple(f.name for f in fields(FeatCal) if f.name not in COMPARE_FEATCAL_KEYS)),
                         factory=dict)
    surgery: dict = knob(mapping, factory=dict)
    probsurgery: dict = knob(mapping, factory=dict)
    sigmerge: CompareSigmerge = nested(CompareSigmerge)


@dataclass(frozen=True)
class Parallel:
    nproc_per_node: int = knob(integer(1), 1)


@dataclass(frozen=True)
class Cache:
    dtype: str = knob(one_of(*CACHE_DTYPES), "float32")
    compressor: str = knob(one_of(*CACHE_COMPRESSORS), "zstd")
    moments: bool = knob(boolean, False)


def task_specs(value, where: str) -> dict:
    """`tasks`: name -> featcal.data.tasks.TaskSpec (its own checks), at least one enabled."""
    from featcal.data.spec import TaskSpec

    raw = mapping(value, where)
    specs = {}
    for name, spec in raw.items():
        try:
            specs[str(name)] = TaskSpec.from_mapping(str(name), spec)
        except ValueError as err:
            raise ParamsError(str(err)) from None
    if not any(s.enabled for s in specs.values()):
        raise ParamsError(f"{where}: no enabled task (found {sorted(specs) or 'none'}); at least one is needed")
    return specs


@dataclass(frozen=True)
class Params:
    """The whole params.yaml."""

    model: Model = knob(section(Model))
    tasks: dict = knob(task_specs)
    seed: int = knob(integer(0), 0)
    tasks_dir: str = knob(text, "data/tasks")
    tokens: Tokens = nested(Tokens)
    finetune: Finetune = nested(Finetune)
    experts: Experts = nested(Experts)
    merge: Merge = nested(Merge)
    calibration: Calibration = nested(Calibration)
    featcal: FeatCal = nested(FeatCal)
    tune: Tune = nested(Tune)
    evaluate: Evaluate = nested(Evaluate)
    compare: Compare = nested(Compare)
    parallel: Parallel = nested(Parallel)
    cache: Cache = nested(Cache)

    @property
    def enabled_tasks(self) -> list[str]:
        return [name for name, spec in self.tasks.items() if spec.enabled]


# --- checks across sections --------------------------------------------------------------------------


def check_no_passwords(raw, where: str = "") -> None:
    """No string anywhere in params is a URL with a password: params are recorded in dvc.lock."""
    if isinstance(raw, Mapping):
        for key, value in raw.items():
            check_no_passwords(value, f"{where}.{key}" if where else str(key))
    elif isinstance(raw, (list, tuple)):
        for i, value in enumerate(raw):
            check_no_passwords(value, f"{where}[{i}]")
    elif isinstance(raw, str) and URL_WITH_PASSWORD.match(raw.strip()):
        raise ParamsError(
            f"{where}: the URL holds a password, and params are recorded in dvc.lock (and git). Leave the "
            "password out of the URL: PostgreSQL reads it from ~/.pgpass or $PGPASSWORD, MySQL from ~/.my.cnf; "
            "or give the whole URL in an environment variable (FEATCAL_TUNE_STORAGE for tune.storage)")


def check_task_keys(params: Params) -> None:
    """Per-task settings must name a task of `tasks:` (a typo would silently keep the default)."""
    for where, keys in (("tokens.per_task", params.tokens.per_task), ("experts.paths", params.experts.paths),
                        ("finetune.overrides", params.finetune.overrides)):
        for key in keys:
            if str(key) not in params.tasks:
                raise unknown_key(where, key, params.tasks, "task")


def layer_index(key, where: str, depth: int) -> int:
    """A block index of the base model (an integer key, or its digits when set by `dvc exp run -S`)."""
    index = int(key) if isinstance(key, str) and key.isdigit() else key
    if isinstance(index, bool) or not isinstance(index, int) or not 0 <= index < depth:
        raise ParamsError(f"{where}.{key}: no such layer; the base model has {depth} blocks, 0..{depth - 1}")
    return index


def check_layers(params: Params, depth: int) -> None:
    for key in params.featcal.layer_overrides:
        layer_index(key, "featcal.layer_overrides", depth)
    for key in params.tune.search:   # per-block keys, KEY@BLOCK
        block = search_key(key)[1]
        if block is not None and not block < depth:
            raise ParamsError(f"tune.search.{key}: no such block; the base model has {depth} blocks, 0..{depth - 1}")
    for i, layer in enumerate(params.tune.prune_after_layers):
        if layer >= depth - 1:
            raise ParamsError(f"tune.prune_after_layers[{i}] = {layer}: prune after one of blocks 0..{depth - 2} "
                              f"(the base model has {depth} blocks)")


def search_key(key: str) -> tuple[str, int | None]:
    """A tune.search key as (hyperparameter, block): alpha, or alpha@3 for block 3 alone."""
    hyper, at, block = key.partition("@")
    if hyper not in HYPER_KEYS or (at and not block.isdigit()):
        raise ParamsError(f"tune.search.{key}: unknown hyperparameter{_closest(hyper, HYPER_KEYS)}; searchable: "
                          f"{', '.join(HYPER_KEYS)}, each also for one block as KEY@BLOCK (e.g. alpha@0)")
    return hyper, int(block) if at else None


def check_search(params: Params) -> None:
    """Search ranges must lie where the hyperparameter is valid."""
    allowed = {f.name: f.metadata["parse"] for f in fields(FeatCal) if f.name in HYPER_KEYS}
    for key, found in params.tune.search.items():
        hyper = search_key(key)[0]
        allowed[hyper](found.low, f"tune.search.{key}.low")
        allowed[hyper](found.high, f"tune.search.{key}.high")
    if params.tune.anchor_search:   # merge.method's own options, searched per trial
        from featcal.merging import split_options
        from featcal.tuning.objective import AnchorSearch, Range

        try:
            AnchorSearch(params.merge.method, split_options(params.merge.method, params.merge.options)[0],
                         {k: Range(r.low, r.high, r.log) for k, r in params.tune.anchor_search.items()})
        except ValueError as err:
            text = str(err)
            raise ParamsError(text if text.startswith("tune.anchor_search") else f"tune.anchor_search: {text}") from None


def check_merge(params: Params) -> None:
    """merge.method and every compare anchor are registered, with options their method knows."""
    check_merge_options(params.merge.method, params.merge.options, "merge")
    for anchor, options in params.compare.anchors.items():
        check_merge_options(anchor, options, f"compare.anchors.{anchor}", key_is_method=True)
    for i, anchor in enumerate(params.compare.sigmerge.anchors):
        if anchor not in params.compare.anchors:
            raise ParamsError(f"compare.sigmerge.anchors[{i}] = {anchor!r}: not one of compare.anchors "
                              f"({', '.join(params.compare.anchors) or 'none'}){_closest(anchor, params.compare.anchors)}")


def check_merge_options(method: str, options: Mapping, where: str, key_is_method: bool = False) -> None:
    """A registered method, with options its dataclass accepts and, for a data method, data options
    (`examples_per_task`, ...) of the context it declares (`featcal.merging.split_options`)."""
    from featcal.merging import MERGE_METHODS, build_options, split_options

    known = sorted(MERGE_METHODS)
    place = where if key_is_method else f"{where}.method"
    if method not in known:
        raise ParamsError(f"{place} = {method!r}: not a merge method{_closest(method, known)}; known: {', '.join(known)}")
    options_where = where if key_is_method else f"{where}.options"
    try:
        method_options, _ = split_options(method, options)
        build_options(method, method_options)
    except (TypeError, ValueError) as err:
        raise ParamsError(f"{options_where}: {err}") from None


def check_compare(params: Params) -> None:
    """Corruption kinds exist; Surgery/ProbSurgery overrides name their configs' knobs and pass their checks."""
    from featcal.baselines.surgery import ProbSurgeryConfig, SurgeryConfig
    from featcal.data.corrupt import CORRUPTIONS

    for i, kind in enumerate(params.compare.corruptions):
        one_of(*CORRUPTIONS)(kind, f"compare.corruptions[{i}]")
    for key, cls in (("surgery", SurgeryConfig), ("probsurgery", ProbSurgeryConfig)):
        overrides = getattr(params.compare, key)
        known = [f.name for f in fields(cls) if f.name != "progress"]
        for name in overrides:
            if name not in known:
                raise unknown_key(f"compare.{key}", name, known)
        try:
            cls(**overrides)
        except (TypeError, ValueError) as err:
            raise ParamsError(f"compare.{key}: {err}") from None


# --- the base model and the experts' configs -----------------------------------------------------------


@dataclass(frozen=True)
class BaseModelInfo:
    """What the checks need from the base model's config (no weights are read)."""

    model_type: str
    depth: int
    max_positions: int | None


def model_config(ref: str, where: str):
    """The config of a model reference (a path, hub id, package: or parts:), or an error naming the key."""
    from transformers import AutoConfig

    from featcal.io.models import resolve_model_ref

    try:
        return AutoConfig.from_pretrained(resolve_model_ref(ref))
    except (OSError, ValueError) as err:
        raise ParamsError(f"{where} = {ref!r}: cannot read the model's config: {err}") from None


def base_model_info(params: Params) -> BaseModelInfo:
    from featcal.families import FAMILIES

    config = model_config(params.model.base, "model.base")
    if config.model_type not in FAMILIES:
        raise ParamsError(f"model.base = {params.model.base!r}: model type {config.model_type!r} is not supported; "
                          f"supported model types: {', '.join(sorted(FAMILIES))}")
    from featcal.io.models import task_model_class

    task_class = task_model_class(config)
    if type(config) not in task_class._model_mapping:
        raise ParamsError(f"model.base = {params.model.base!r}: model type {config.model_type!r} has no "
                          f"{task_class.__name__} class, and the pipeline fine-tunes and scores one task model per task")
    check_zero_shot(params, config)
    positions = getattr(config, "max_position_embeddings", None)
    return BaseModelInfo(config.model_type, FAMILIES[config.model_type].depth(config), positions)


def check_zero_shot(params: Params, base_config) -> None:
    """Zero-shot heads: for a CLIP vision tower, from a CLIP text tower of the same projection width."""
    ref = params.model.zero_shot.text_model
    if ref is None:
        return
    where = "model.zero_shot.text_model"
    if base_config.model_type != "clip_vision_model":
        raise ParamsError(f"{where} = {ref!r}: zero-shot heads are for CLIP vision towers, but model.base is a "
                          f"{base_config.model_type!r} model; set it to null")
    config = model_config(ref, where)
    text_config = getattr(config, "text_config", config)
    if config.model_type not in ("clip", "clip_text_model"):
        raise ParamsError(f"{where} = {ref!r}: a {config.model_type!r} model; expected a CLIP model or CLIP text tower")
    width = getattr(config, "projection_dim", getattr(text_config, "projection_dim", None))
    if width != base_config.projection_dim:
        raise ParamsError(f"{where} = {ref!r}: its text embeddings have {width} dimensions, the base's image "
                          f"embeddings {base_config.projection_dim} (model.base = {params.model.base!r})")


def check_lengths(params: Params, base: BaseModelInfo) -> None:
    """Token lengths must fit the base model's position embeddings."""
    if base.max_positions is None:
        return
    lengths = {"tokens.max_length": params.tokens.max_length,
               **{f"tokens.per_task.{t}": n for t, n in params.tokens.per_task.items()}}
    for where, length in lengths.items():
        if length > base.max_positions:
            raise ParamsError(f"{where} = {length}: the base model has only {base.max_positions} positions "
                              f"(max_position_embeddings); use at most that")


def check_experts(params: Params, base: BaseModelInfo) -> None:
    """Every given expert exists and is of the base's model type."""
    for task, ref in params.experts.paths.items():
        where = f"experts.paths.{task}"
        model_type = model_config(ref, where).model_type
        if model_type != base.model_type:
            raise ParamsError(f"{where} = {ref!r}: a {model_type!r} model, but model.base is a {base.model_type!r} "
                              f"model; experts must be fine-tuned from the base")


# --- the generated chain --------------------------------------------------------------------------------


def expected_chain(params: Params, depth: int) -> dict:
    """What stages/gen_chain.py writes for these params, as far as DVC's expansion depends on it."""
    return {
        "enabled_tasks": params.enabled_tasks,
        "layers": [f"L{k:02d}" for k in range(depth)],
        "featcal_params": "tune/best.yaml" if params.featcal.use_tuned else "params.yaml",
    }


def check_chain(params: Params, depth: int, chain_path: Path) -> None:
    """stages/chain.yaml must match the params and the base's depth: a stale one leaves blocks
    uncalibrated, or a task without its finetune stage."""
    fix = "run `python stages/gen_chain.py`"
    if not chain_path.is_file():
        raise ParamsError(f"{chain_path} is missing; {fix}")
    chain = yaml.safe_load(chain_path.read_text(encoding="utf-8")) or {}
    found = {"enabled_tasks": chain.get("enabled_tasks"), "layers": list(chain.get("layers") or {}),
             "featcal_params": chain.get("featcal_params")}
    expected = expected_chain(params, depth)
    for key, want in expected.items():
        if found[key] != want:
            raise ParamsError(f"{chain_path} is stale: its {key} are {found[key]} but params.yaml "
                              f"(model.base with {depth} blocks, tasks, featcal.use_tuned) gives {want}; {fix}")


# --- entry points ------------------------------------------------------------------------------------


def validate(raw: Any, root: str | Path = ".", *, chain: bool = False, models: bool = True) -> Params:
    """Check everything in params.yaml; `models`: also read the base's and experts' configs (no
    weights); `chain`: also compare stages/chain.yaml under `root` with the params."""
    if not isinstance(raw, Mapping):
        raise ParamsError(f"expected a mapping of sections at the top, found {type(raw).__name__}")
    check_no_passwords(raw)
    params = section(Params)(raw, "")
    check_task_keys(params)
    check_search(params)
    check_merge(params)
    check_compare(params)
    if models:
        base = base_model_info(params)
        check_lengths(params, base)
        check_layers(params, base.depth)
        check_experts(params, base)
        if chain:
            check_chain(params, base.depth, Path(root) / CHAIN_FILE)
    return params


def validate_tuned(raw: Any) -> dict:
    """tune/best.yaml's `featcal: {alpha, rho, ridge}`, each in its allowed range, and the optional
    per-block `layer_overrides` a KEY@BLOCK search writes."""
    values = mapping(mapping(raw, "").get("featcal"), "featcal")
    parsers = {f.name: f.metadata["parse"] for f in fields(FeatCal) if f.name in (*HYPER_KEYS, "layer_overrides")}
    for key in HYPER_KEYS:
        if key not in values:
            raise ParamsError(f"featcal.{key}: missing; it is required")
    for key in values:
        if key not in parsers:
            raise unknown_key("featcal", key, parsers)
    return {k: parsers[k](values[k], f"featcal.{k}") for k in values}
