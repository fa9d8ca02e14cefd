"""The typed schema of params.yaml (pydantic models), checked before any model loads, and its JSON Schema.

`validate(raw, root)` turns the parsed YAML (including what `dvc exp run -S` set) into `Params`
or raises `ParamsError` naming the key, the value found and what is allowed. Each section is a
pydantic model that refuses unknown keys, with the closest known key suggested, because a typo
must never fall back to a default silently; its fields are strict (the string '0.3' is no number,
true no integer) and carry their ranges. Cross-section checks follow, as plain functions on the
validated `Params`: task and layer keys name existing tasks and blocks of the base model, the base
and every given expert are of a supported model type (the same one), no URL carries a password
(params end up in dvc.lock), and, for a DVC stage, `stages/chain.yaml` was generated from these
params (else: run `python stages/gen_chain.py`).

`python stages/params_schema.py --json-schema` prints the JSON Schema of params.yaml, committed as
`stages/params.schema.json` for editors (docs/reliability.md).
"""

import argparse
import difflib
import json
import re
from dataclasses import dataclass, fields
from pathlib import Path
from typing import Annotated, Any, Literal, Mapping, Optional

import yaml
from pydantic import (AfterValidator, BaseModel, BeforeValidator, ConfigDict, Field, PlainValidator, TypeAdapter,
                      ValidationError, WithJsonSchema, WrapValidator, create_model, model_validator)
from pydantic_core import PydanticCustomError

from featcal.calibration.config import check_device_name
from featcal.calibration.moments import PRODUCT_DTYPES
from featcal.data.spec import TaskSpec
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


# --- the wording of every error ------------------------------------------------------------------------


def _closest(key, known) -> str:
    match = difflib.get_close_matches(str(key), [str(k) for k in known], n=1, cutoff=0.6)
    return f" (did you mean {match[0]!r}?)" if match else ""


def unknown_key(where: str, key, known, what: str = "key") -> ParamsError:
    """The error for a key no one reads: names it, suggests the closest known one, lists them all."""
    listed = ", ".join(sorted(map(str, known))) or "none"
    place = f"{where}.{key}" if where else str(key)
    return ParamsError(f"{place}: unknown {what} {str(key)!r}{_closest(key, known)}; known {what}s: {listed}")


def _range_text(low, high, low_open: bool = False) -> str:
    if low is not None and high is not None:
        return f" in {'(' if low_open else '['}{low}, {high}]"
    return f" {'>' if low_open else '>='} {low}" if low is not None else f" <= {high}" if high is not None else ""


def _bad(text: str, kind: str = "params", **ctx) -> PydanticCustomError:
    """A bad value, said as `KEY = VALUE: text` (ctx `value`: the value to show, if not the one given),
    or, of kind "said", an error said in full by the check that found it."""
    return PydanticCustomError(kind, "{text}", {"text": text, **ctx})


def _dotted(raw, loc: tuple, where: str = "") -> str:
    """The dotted key of a pydantic error location: `a.b.c`, list items as `a[0]` (told apart in `raw`)."""
    node = raw
    for part in loc:
        if isinstance(part, int) and isinstance(node, (list, tuple)):
            where += f"[{part}]"
        else:
            where = f"{where}.{part}" if where else str(part)
        try:
            node = node[part]
        except (KeyError, IndexError, TypeError):
            node = None
    return where


def _params_error(err: ValidationError, raw, where: str = "") -> ParamsError:
    """pydantic's first error in today's words: the dotted key, the value found, what is allowed."""
    first = err.errors(include_url=False)[0]
    kind, ctx, place = first["type"], first.get("ctx") or {}, _dotted(raw, first["loc"], where)
    if kind == "unknown_key":
        return unknown_key(place, ctx["key"], ctx["known"])
    if kind == "missing":
        return ParamsError(f"{place}: missing; it is required")
    if kind == "said":
        return ParamsError(ctx["text"])
    text = ctx["text"] if kind == "params" else first["msg"]
    return ParamsError(f"{place} = {ctx.get('value', first['input'])!r}: {text}")


def _validated(kind, value, where: str = ""):
    """`value` checked as `kind` (a model or an annotated type), or the ParamsError naming `where`."""
    try:
        return TypeAdapter(kind).validate_python(value)
    except ValidationError as err:
        raise _params_error(err, value, where) from None


# --- the value types: pydantic's constraints, today's messages ------------------------------------------


def _says(allowed):
    """Any pydantic error of the wrapped type becomes `expected ...` (`allowed`: the text or value -> text)."""
    def wrap(value, handler):
        try:
            return handler(value)
        except ValidationError:
            raise _bad(allowed(value) if callable(allowed) else allowed) from None
    return WrapValidator(wrap)


def integer(low: int | None = None, high: int | None = None):
    return Annotated[int, Field(strict=True, ge=low, le=high), _says(f"expected an integer{_range_text(low, high)}")]


def real(low: float | None = None, high: float | None = None, *, low_open: bool = False):
    bounds = {"gt": low} if low_open else {"ge": low}
    return Annotated[float, Field(strict=True, allow_inf_nan=False, le=high, **bounds),
                     _says(f"expected a finite number{_range_text(low, high, low_open)}")]


def one_of(*choices: str):
    return Annotated[Literal[choices], _says(lambda v: f"expected one of {', '.join(choices)}{_closest(v, choices)}")]


def _mapping(value) -> dict:
    if value is None:
        return {}
    if not isinstance(value, Mapping):
        raise _bad("expected a mapping of keys")
    return dict(value)


def mapping_of(item=Any):
    """A mapping (null: empty) of `item`s; its keys are checked where they must name tasks or blocks."""
    return Annotated[dict[Any, item], BeforeValidator(_mapping)]


def list_of(item, min_len: int = 0):
    def check(value) -> list:
        shown = [] if value is None else value
        if not isinstance(shown, (list, tuple)) or len(shown) < min_len:
            raise _bad("expected a list" + (f" of at least {min_len} items" if min_len else ""), value=shown)
        return list(shown)
    return Annotated[list[item], Field(min_length=min_len or None), BeforeValidator(check)]


def _holds(test, text: str) -> AfterValidator:
    """A check after the type's: `test(value)`, else the error `KEY = VALUE: text`."""
    def check(value):
        if not test(value):
            raise _bad(text)
        return value
    return AfterValidator(check)


Boolean = Annotated[bool, Field(strict=True), _says("expected true or false")]
Text = Annotated[str, Field(strict=True, pattern=r"\S"), _says("expected a non-empty string")]
OptionalText = Annotated[Optional[Annotated[str, Field(strict=True, pattern=r"\S")]], _says("expected a non-empty string")]
PromptTemplate = Annotated[Text, _holds(lambda v: "{}" in v, 'a prompt template needs "{}" where the class name goes')]
CRange = Annotated[list_of(real(0, 1), 2), Field(json_schema_extra={"maxItems": 2}),   # a SigMerge capacity pair
                   _holds(lambda p: len(p) == 2 and p[0] <= p[1], "expected [c_min, c_max] with 0 <= c_min <= c_max <= 1")]
Device = Annotated[str, Field(strict=True, json_schema_extra={"pattern": r"^(auto|cpu|cuda(:[0-9]+)?)$"}),
                   AfterValidator(lambda v: check_device_name(v) or v),   # whether CUDA is present: where it runs
                   _says("expected auto, cpu, cuda or cuda:N")]


# --- the sections --------------------------------------------------------------------------------------


class Section(BaseModel):
    """A params section: a mapping (null: all defaults) of known keys only."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    @model_validator(mode="before")
    @classmethod
    def _known_keys(cls, value):
        value = _mapping(value)
        for key in value:   # refused before any value is read, with the closest known key
            if key not in cls.model_fields:
                raise PydanticCustomError("unknown_key", "unknown key", {"key": key, "known": list(cls.model_fields)})
        return value


def _no_default(schema: dict) -> None:
    schema.pop("default", None)


def given_keys(model: type[Section], names: tuple[str, ...] | None = None):
    """Some of `model`'s keys (per-task, per-layer overrides), each checked as there; validates to the
    dict of the keys given."""
    names = names or tuple(model.model_fields)
    sub = create_model(f"{model.__name__}Overrides", __base__=Section, __doc__=f"Some of {model.__name__}'s keys.",
                       **{name: (model.model_fields[name].rebuild_annotation(),
                                 Field(None, json_schema_extra=_no_default)) for name in names})
    return Annotated[sub, AfterValidator(lambda found: found.model_dump(exclude_unset=True))]


class ZeroShot(Section):
    """Zero-shot heads (CLIP vision-tower bases only)."""

    text_model: OptionalText = None
    templates: list_of(PromptTemplate, 1) = ["a photo of a {}."]


class Model(Section):
    base: Text
    zero_shot: ZeroShot = Field(default_factory=ZeroShot)


class Tokens(Section):
    max_length: integer(1) = 64
    per_task: mapping_of(integer(1)) = {}


class FinetuneKnobs(Section):
    learning_rate: real(0, low_open=True) = 5e-5
    epochs: real(0, low_open=True) = 2.0
    batch_size: integer(1) = 32
    weight_decay: real(0) = 0.01
    warmup_ratio: real(0, 1) = 0.1


class FinetuneLM(Section):
    """finetune.lm: causal-LM experts of language-model tasks (featcal.finetune_lm.LoraSettings): LoRA adapters
    on the named linears of the listed decoder layers (null: all), merged into the expert's weights."""

    rank: integer(1) = 8
    alpha: real(0, low_open=True) = 16.0
    target_modules: list_of(Text, 1) = ["q_proj", "v_proj"]
    layers: Optional[list_of(integer(0), 1)] = None
    learning_rate: real(0, low_open=True) = 2e-4
    steps: integer(1) = 100
    batch_size: integer(1) = 4


class Finetune(FinetuneKnobs):
    overrides: mapping_of(given_keys(FinetuneKnobs)) = {}
    lm: FinetuneLM = Field(default_factory=FinetuneLM)


class Experts(Section):
    paths: mapping_of(Text) = {}


class Merge(Section):
    method: Text = "task_arithmetic"
    options: mapping_of() = {}


class Calibration(Section):
    examples_per_task: integer(1) = 128
    batch_size: integer(1) = 16


class Hyper(Section):
    """FeatCal's α, ρ, λ (HYPER_KEYS): tuned, searched, and set per block in layer_overrides."""

    alpha: real(0, 1) = 0.25
    rho: real(0, low_open=True) = 2.2
    ridge: real(0) = 0.05


class FeatCal(Hyper):
    pooled_token_weight: real(0, 1) = 0.01
    calibrate_bias: Boolean = True
    calibrate_norms: Boolean = True
    calibrate_pooler: Boolean = False
    product_dtype: one_of(*PRODUCT_DTYPES) = "float64"   # the exact path (FeatCalConfig's default too)
    device: Device = "auto"
    layer_overrides: mapping_of(given_keys(Hyper)) = {}
    use_tuned: Boolean = False


class SearchRange(Section):
    low: real()
    high: real()
    log: Boolean = False


def _search_range(value, handler) -> SearchRange:
    """[low, high] or {low, high, log}: low < high, and low > 0 on a log scale."""
    if isinstance(value, (list, tuple)) and len(value) == 2:
        value = {"low": value[0], "high": value[1]}
    elif not isinstance(value, Mapping):
        raise _bad("expected [low, high] or {low: .., high: .., log: true}")
    found = handler(value)
    if not found.low < found.high:
        raise _bad("low must be below high", value=value)
    if found.log and found.low <= 0:
        raise _bad("a log range needs low > 0", value=value)
    return found


class _OrPair:
    """JSON Schema: a search range may also be written [low, high]."""

    def __get_pydantic_json_schema__(self, core_schema, handler) -> dict:
        pair = {"type": "array", "items": {"type": "number"}, "minItems": 2, "maxItems": 2}
        return {"anyOf": [pair, handler(core_schema)]}


Range = Annotated[SearchRange, WrapValidator(_search_range), _OrPair()]


class Tune(Section):
    n_trials: integer(1) = 24
    seed: integer(0) = 0
    study_name: Text = "featcal-dev"
    storage: OptionalText = None
    startup_trials: integer(0) = 8
    enqueue_defaults: Boolean = True
    search: mapping_of(Range) = {}   # keys: HYPER_KEYS, or KEY@BLOCK (search_key)
    anchor_search: mapping_of(Range) = {}
    prune_after_layers: list_of(integer(0)) = []
    prune_startup_trials: integer(0) = 5
    trial_product_dtype: Optional[one_of(*PRODUCT_DTYPES)] = None   # trials' moment products; the best: featcal's
    trial_examples_per_task: Optional[integer(1)] = None   # trials' calibration examples per task; the best: all
    rerank_top_k: integer(0) = 0   # a reduced search's K best trials recalibrated exactly; the best of those leaves
    expert_cache_mib: Optional[integer(0)] = 8192   # the experts' captured block inputs kept for later trials; 0 off
    expert_cache_disk_mib: Optional[integer(0)] = 32768   # the blocks past expert_cache_mib, on disk; 0 off
    expert_cache_dir: OptionalText = None   # where that spill's temporary folder goes (None: the system's)


class Evaluate(Section):
    drift_examples_per_task: integer(1) = 128


class CompareSigmerge(Section):
    anchors: list_of(Text, 1) = ["task_arithmetic", "ties"]
    grid: list_of(CRange, 1) = [[0.02, 0.2]]   # SigMerge capacity pairs [c_min, c_max]
    shared_examples_per_task: integer(1) = 16


class Compare(Section):
    # params.yaml's three anchors at their papers' defaults: a project without `compare:` passes the
    # sigmerge check below with the defaults (compare.sigmerge.anchors are among them)
    anchors: mapping_of(mapping_of()) = {"task_arithmetic": {"scale": 0.3}, "ties": {"density": 0.2, "scale": 1.0},
                                         "regmean_plus_plus": {"off_diagonal": 0.95, "examples_per_task": 256}}
    examples_per_task: integer(1) = 128
    sample_sizes: list_of(integer(1), 1) = [128]
    corruptions: list_of(Text) = []
    corruption_rate: real(0, 1) = 0.2
    featcal: given_keys(FeatCal, COMPARE_FEATCAL_KEYS) = {}
    surgery: mapping_of() = {}
    probsurgery: mapping_of() = {}
    sigmerge: CompareSigmerge = Field(default_factory=CompareSigmerge)


class Parallel(Section):
    nproc_per_node: integer(1) = 1


class Cache(Section):
    dtype: one_of(*CACHE_DTYPES) = "float32"
    compressor: one_of(*CACHE_COMPRESSORS) = "zstd"
    moments: Boolean = False


def task_specs(value) -> dict:
    """`tasks`: name -> featcal.data.spec.TaskSpec (its own checks), at least one enabled."""
    specs = {}
    for name, spec in _mapping(value).items():
        try:
            specs[str(name)] = TaskSpec.from_mapping(str(name), spec)
        except ValueError as err:
            raise _bad(kind="said", text=str(err)) from None
    if not any(s.enabled for s in specs.values()):
        raise _bad(kind="said", text=f"tasks: no enabled task (found {sorted(specs) or 'none'}); at least one is needed")
    objectives = {s.objective: name for name, s in specs.items() if s.enabled}
    if len(objectives) > 1:   # an average of accuracies and NLLs means nothing
        named = " and ".join(f"{name} ({objective})" for objective, name in objectives.items())
        raise _bad(kind="said", text=f"tasks: the enabled tasks mix objectives, e.g. {named}; one project scores one "
                                     "kind (run classification and language-model tasks as two projects)")
    return specs


def _task_schema() -> dict:
    schema = TypeAdapter(TaskSpec).json_schema()   # the name is the key in `tasks:`
    del schema["properties"]["name"]
    schema["required"].remove("name")
    schema.update(additionalProperties=False, description="One task: its source and options (featcal.data.spec.TaskSpec).")
    return {"type": "object", "additionalProperties": schema}


Tasks = Annotated[dict, PlainValidator(task_specs), WithJsonSchema(_task_schema())]


class Params(Section):
    """The whole params.yaml."""

    model: Model
    tasks: Tasks
    seed: integer(0) = 0
    tasks_dir: Text = "data/tasks"
    tokens: Tokens = Field(default_factory=Tokens)
    finetune: Finetune = Field(default_factory=Finetune)
    experts: Experts = Field(default_factory=Experts)
    merge: Merge = Field(default_factory=Merge)
    calibration: Calibration = Field(default_factory=Calibration)
    featcal: FeatCal = Field(default_factory=FeatCal)
    tune: Tune = Field(default_factory=Tune)
    evaluate: Evaluate = Field(default_factory=Evaluate)
    compare: Compare = Field(default_factory=Compare)
    parallel: Parallel = Field(default_factory=Parallel)
    cache: Cache = Field(default_factory=Cache)

    @property
    def enabled_tasks(self) -> list[str]:
        return [name for name, spec in self.tasks.items() if spec.enabled]


class Tuned(Section):
    """tune/best.yaml's featcal: α, ρ, λ, and the per-block values a KEY@BLOCK search writes."""

    alpha: Hyper.model_fields["alpha"].rebuild_annotation()
    rho: Hyper.model_fields["rho"].rebuild_annotation()
    ridge: Hyper.model_fields["ridge"].rebuild_annotation()
    layer_overrides: FeatCal.model_fields["layer_overrides"].rebuild_annotation() = {}

    @model_validator(mode="before")   # runs before Section's: a missing α, ρ or λ is named first
    @classmethod
    def _required_first(cls, value):
        for key in HYPER_KEYS:
            if key not in _mapping(value):
                raise _bad(kind="said", text=f"featcal.{key}: missing; it is required")
        return value


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
    for key, found in params.tune.search.items():
        allowed = Hyper.model_fields[search_key(key)[0]].rebuild_annotation()
        _validated(allowed, found.low, f"tune.search.{key}.low")
        _validated(allowed, found.high, f"tune.search.{key}.high")
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
        _validated(one_of(*CORRUPTIONS), kind, f"compare.corruptions[{i}]")
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

    task_class = task_model_class(config, causal_lm=any(s.language_model for s in params.tasks.values() if s.enabled))
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
    params = _validated(Params, raw)
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
    tuned = _validated(Tuned, _validated(mapping_of(), raw).get("featcal"), "featcal")   # `study`: the stage's record
    return {key: getattr(tuned, key) for key in Tuned.model_fields if key in tuned.model_fields_set}


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--json-schema", action="store_true", help="print the JSON Schema of params.yaml")
    args = parser.parse_args(argv)
    if not args.json_schema:
        parser.error("nothing to do: give --json-schema")
    print(json.dumps(Params.model_json_schema(), indent=2, ensure_ascii=False))


if __name__ == "__main__":
    main()
