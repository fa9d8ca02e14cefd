"""Registry of merge methods and the one entry point that validates inputs and runs them.

A merge method is a function ``fn(base, experts, opts) -> merged`` over *backbone* state dicts
(name -> tensor). It declares its options as a frozen dataclass, and what else it needs:

- ``needs``: the context a data method reads besides the state dicts (``NEEDS`` lists them:
  "activations" — the models and each task's unlabelled train batches; "dev_scores" — dev accuracy
  of a backbone under each task's head; "shared_examples" — one batch set every expert runs on).
  A method with needs is called ``fn(base, experts, opts, context)`` with a ``MergeContext``
  holding them; one without needs never sees a context (it stays a pure tensor function).
- ``whole_model``: whether, for given options, it needs every tensor at once (TIES trimming over
  the whole model). A method without needs and not whole-model acts tensor group by tensor group,
  so ``featcal.merging.lazy.lazy_merge`` can stream it without a context (``MergeMethod.streams``); of the
  data methods, lazy_merge streams RegMean, RegMean++ and AdaMerging given a context
  (``featcal.merging.lazy.DATA_MERGES``).
- ``report``: an optional writer of the method's figures from its record (SigMerge's heat map).

Adding a method is one ``@register("name", OptionsCls, ...)`` line on that function; no method
reads or writes files.

``merge_state_dicts`` is the only place that:
- checks that every expert has exactly the base's tensor names and shapes,
- builds the options dataclass from a plain mapping (unknown keys are an error),
- checks that a data method got the context it declares (an error names the method and what is
  missing),
- upcasts floating tensors to float32 (float64 stays float64) before the method sees them and
  casts the result back to the base dtype, and
- copies non-floating tensors (integer buffers such as ``position_ids``) from the base unchanged.

So a method receives only floating tensors, all in a compute dtype of at least float32.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch
from torch import Tensor, nn

if TYPE_CHECKING:
    from featcal.families import Family

StateDict = dict[str, Tensor]
MergeFn = Callable[..., StateDict]
Batches = Mapping[str, Sequence[Mapping[str, Tensor]]]


@dataclass(frozen=True)
class Need:
    """One kind of context: the ``MergeContext`` fields it consists of, what they are, and the
    options that say how much data a supplier gathers for it (with their defaults)."""

    fields: tuple[str, ...]
    description: str
    data_options: Mapping[str, int] = field(default_factory=dict)


# The models (base, experts, family) come from the driver (`featcal.merge_models`); the data from
# whoever calls it (`featcal.evaluation.compare.merge_context` for the stages).
NEEDS: dict[str, Need] = {
    "activations": Need(
        ("base", "experts", "family", "batches"),
        "the base and expert models and, per task, unlabelled train batches (each expert runs on its own task's)",
        {"examples_per_task": 256},
    ),
    "dev_scores": Need(
        ("base", "experts", "family", "score_dev", "expert_dev"),
        "dev accuracy per task of a backbone under each task's head (score_dev) and of each expert (expert_dev)",
    ),
    "shared_examples": Need(
        ("experts", "family", "shared_batches"),
        "one set of unlabelled train batches from every task that every expert runs on",
        {"shared_examples_per_task": 16},
    ),
}


@dataclass
class MergeContext:
    """What data methods read besides the state dicts, and where they report.

    base: the base backbone; experts: task -> expert model (with its head), in the order of the
    expert state dicts; family: their ``featcal.families.Family``. ``featcal.merge_models`` fills
    these three. batches: task -> unlabelled train batches (never test); shared_batches: one batch
    list of every task's examples; score_dev: backbone -> {task: dev accuracy under that task's
    head}; expert_dev: {task: dev accuracy of its expert}. record: filled by the method with what
    it decided (cleared at the start of every merge). cache: optional; a method keeps there what
    does not change between merges of the same models and data with other options (SigMerge: its
    inner anchor, the experts' block outputs, the conflict signals), so a search over its options
    computes them once. Its owner gives it only to contexts of those same models and data.
    """

    base: nn.Module | None = None
    experts: Mapping[str, nn.Module] | None = None
    family: "Family | None" = None
    batches: Batches | None = None
    shared_batches: Sequence[Mapping[str, Tensor]] | None = None
    score_dev: Callable[[nn.Module], dict[str, float]] | None = None
    expert_dev: Mapping[str, float] | None = None
    record: dict[str, Any] = field(default_factory=dict)
    cache: dict[Any, Any] | None = None

    def missing(self, needs: Sequence[str]) -> list[str]:
        """The fields of ``needs`` that are not set, in declaration order."""
        wanted = [f for need in needs for f in NEEDS[need].fields]
        return [f for f in dict.fromkeys(wanted) if getattr(self, f) is None]


@dataclass(frozen=True)
class MergeMethod:
    """One registered merge method: its name, the function, its options dataclass, the context it
    needs, whether (for given options) it needs the whole model at once, and its report writer."""

    name: str
    fn: MergeFn
    options_cls: type
    needs: frozenset[str] = frozenset()
    whole_model: Callable[[Any], bool] | None = None
    report: Callable[[Mapping[str, Any], Any], None] | None = None
    more_needs: Callable[[Mapping[str, Any]], frozenset[str]] | None = None
    elementwise: bool = False   # each merged entry reads only the same entry of the inputs (row-chunkable)

    def streams(self, opts: Any) -> bool:
        """Whether it acts tensor group by tensor group (no context, not whole-model)."""
        return not self.needs and not (self.whole_model is not None and self.whole_model(opts))


MERGE_METHODS: dict[str, MergeMethod] = {}


def register(
    name: str,
    options_cls: type,
    *,
    needs: Sequence[str] = (),
    whole_model: Callable[[Any], bool] | None = None,
    report: Callable[[Mapping[str, Any], Any], None] | None = None,
    more_needs: Callable[[Mapping[str, Any]], frozenset[str]] | None = None,
    elementwise: bool = False,
) -> Callable[[MergeFn], MergeFn]:
    """Decorator: register ``fn(base, experts, opts[, context]) -> merged`` under ``name``.

    ``options_cls`` must be a frozen dataclass whose fields all have defaults; ``needs`` names
    entries of ``NEEDS`` (then ``fn`` takes the context as fourth argument); ``whole_model(opts)``
    says when it cannot run tensor group by tensor group; ``report(record, folder)`` writes figures;
    ``more_needs(options)`` adds needs that depend on the options as written (SigMerge: its inner
    anchor's), on top of ``needs`` (which must then be non-empty, so ``fn`` always takes a context).
    ``elementwise``: each merged entry depends on that entry of the inputs alone (averaging, Task
    Arithmetic), so a streamed merge may read and merge a large tensor a slice of rows at a time.
    """
    if not (dataclasses.is_dataclass(options_cls) and isinstance(options_cls, type)):
        raise TypeError(f"merge method {name!r}: options_cls must be a dataclass, got {options_cls!r}")
    if not options_cls.__dataclass_params__.frozen:  # type: ignore[attr-defined]
        raise TypeError(f"merge method {name!r}: options dataclass {options_cls.__name__} must be frozen")
    unknown = sorted(set(needs) - set(NEEDS))
    if unknown:
        raise ValueError(f"merge method {name!r}: unknown needs {unknown}; known: {', '.join(NEEDS)}")
    if more_needs is not None and not needs:
        raise ValueError(f"merge method {name!r}: more_needs needs a method with needs (it takes a context)")

    def decorator(fn: MergeFn) -> MergeFn:
        if name in MERGE_METHODS:
            raise ValueError(f"merge method {name!r} is already registered")
        MERGE_METHODS[name] = MergeMethod(name, fn, options_cls, frozenset(needs), whole_model, report, more_needs,
                                         elementwise)
        return fn

    return decorator


def get_method(name: str) -> MergeMethod:
    """Return the registered method ``name``; ValueError listing the registered names otherwise."""
    try:
        return MERGE_METHODS[name]
    except KeyError:
        known = ", ".join(sorted(MERGE_METHODS)) or "(none)"
        raise ValueError(f"unknown merge method {name!r}; registered methods: {known}") from None


def build_options(method: str, options: Mapping[str, Any] | Any | None = None) -> Any:
    """Build ``method``'s options dataclass from a mapping (None -> all defaults).

    An instance of the method's options class is returned as is. Unknown keys raise ValueError
    naming the key, the method and the valid keys; value checks live in the dataclass.
    """
    spec = get_method(method)
    cls = spec.options_cls
    if options is None:
        return cls()
    if isinstance(options, cls):
        return options
    if not isinstance(options, Mapping):
        raise TypeError(
            f"options for merge method {method!r} must be a mapping or {cls.__name__}, "
            f"got {type(options).__name__}"
        )
    valid = [f.name for f in dataclasses.fields(cls) if f.init]
    for key in options:
        if key not in valid:
            raise ValueError(
                f"unknown option {key!r} for merge method {method!r}; "
                f"valid options: {', '.join(valid) or '(none)'}"
            )
    return cls(**dict(options))


def needs_of(method: str, options: Mapping[str, Any] | Any | None = None) -> frozenset[str]:
    """What ``method`` needs with these options (a mapping as written, data options allowed, or its
    options dataclass): its declared needs plus those its options add (SigMerge over RegMean needs
    activations too)."""
    spec = get_method(method)
    if spec.more_needs is None:
        return spec.needs
    if dataclasses.is_dataclass(options):
        options = dataclasses.asdict(options)
    return spec.needs | frozenset(spec.more_needs(dict(options or {})))


def data_options(method: str, options: Mapping[str, Any] | None = None) -> dict[str, int]:
    """The options that say how much data a supplier gathers for ``method``'s needs (with
    ``options``, see ``needs_of``), with defaults (e.g. RegMean's ``examples_per_task``); they are
    not the method's own options."""
    return {k: v for need in sorted(needs_of(method, options)) for k, v in NEEDS[need].data_options.items()}


def split_options(method: str, options: Mapping[str, Any] | None) -> tuple[dict[str, Any], dict[str, Any]]:
    """(the method's options, the data options with defaults filled) from one mapping, as written
    in params.yaml: a data method's block may say how much data to gather next to its options."""
    options = dict(options or {})
    data = data_options(method, options)
    for key in data:
        if key in options:
            value = options.pop(key)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"merge method {method!r}: option {key!r} must be an integer >= 1, got {value!r}")
            data[key] = value
    return options, data


def check_context(method: str, context: MergeContext | None, filled: Sequence[str] = (),
                  options: Mapping[str, Any] | Any | None = None) -> MergeContext:
    """The context of a data method (with ``options``, see ``needs_of``), or ValueError naming the
    method, each missing need and its fields.

    ``filled``: fields the caller fills itself afterwards (a driver's models), not required yet.
    """
    wanted = sorted(needs_of(method, options))
    context = context if context is not None else MergeContext()
    missing = [f for f in context.missing(wanted) if f not in filled]
    if missing:
        needs = [f"{n} ({NEEDS[n].description}: {', '.join(f for f in NEEDS[n].fields if f in missing)})"
                 for n in wanted if any(f in missing for f in NEEDS[n].fields)]
        raise ValueError(
            f"merge method {method!r} needs context that was not given: {'; '.join(needs)}. Pass "
            "context=MergeContext(...) to featcal.merge_models or featcal.merging.lazy.lazy_merge (they fill base, "
            "experts and family) or merge_state_dicts"
        )
    return context


def fill_models(context: MergeContext | None, tasks: Sequence[str], base: Callable[[], nn.Module],
                experts: Callable[[], Mapping[str, nn.Module]], family: "Family | None" = None) -> MergeContext:
    """The context (a new one if None) with the models a merge driver supplies where the caller left
    them unset: `base()` (the base backbone), `experts()` (task -> expert, in the order of `tasks`)
    and the family (`family`, else the base's). Experts the caller gave must be `tasks`, in order."""
    context = MergeContext() if context is None else context
    if context.base is None:
        context.base = base()
    if context.family is None:
        from featcal.families import family_for   # the registry itself knows no family

        context.family = family if family is not None else family_for(context.base)
    if context.experts is None:
        context.experts = dict(experts())
    elif list(context.experts) != list(tasks):
        raise ValueError(f"the context's experts {list(context.experts)} are not the experts merged {list(tasks)}")
    return context


def _check_compatible(base: Mapping[str, Tensor], experts: Sequence[Mapping[str, Tensor]]) -> None:
    """Raise ValueError at the first tensor (in base order) whose name or shape differs."""
    if len(experts) == 0:
        raise ValueError("merge needs at least one expert state dict, got 0")
    for name, ref in base.items():
        for i, expert in enumerate(experts):
            if name not in expert:
                raise ValueError(f"expert {i} has no tensor {name!r} (expected shape {tuple(ref.shape)})")
            found = expert[name]
            if found.shape != ref.shape:
                raise ValueError(
                    f"tensor {name!r}: expert {i} has shape {tuple(found.shape)}, "
                    f"expected {tuple(ref.shape)} (base)"
                )
            if found.is_floating_point() != ref.is_floating_point():
                raise ValueError(
                    f"tensor {name!r}: expert {i} has dtype {found.dtype}, base has {ref.dtype} "
                    "(floating and non-floating do not mix)"
                )
    for i, expert in enumerate(experts):
        for name in expert:
            if name not in base:
                raise ValueError(f"expert {i} has tensor {name!r}, which the base does not have")


def compute_dtype(*dtypes: torch.dtype) -> torch.dtype:
    """The dtype a merge is computed in: the widest of ``dtypes`` and float32."""
    out = torch.float32
    for dt in dtypes:
        out = torch.promote_types(out, dt)
    return out


def merge_state_dicts(
    method: str,
    base: Mapping[str, Tensor],
    experts: Sequence[Mapping[str, Tensor]],
    options: Mapping[str, Any] | Any | None = None,
    context: MergeContext | None = None,
) -> StateDict:
    """Merge ``experts`` (fine-tuned from ``base``) with the registered ``method``.

    Floating tensors are upcast to ``compute_dtype`` (>= float32), merged, and cast back to the
    base dtype; non-floating tensors are copied from ``base``. The result keeps the base's order.
    A data method gets ``context`` (checked to hold what it needs; its ``record`` is cleared first);
    a method without needs ignores it.
    """
    spec = get_method(method)
    opts = build_options(method, options)
    experts = list(experts)
    _check_compatible(base, experts)
    if spec.needs:
        context = check_context(method, context, options=opts)
        if len(context.experts) != len(experts):
            raise ValueError(f"merge method {method!r}: the context holds {len(context.experts)} expert models "
                             f"for {len(experts)} expert state dicts")
        context.record.clear()

    float_names = [n for n, t in base.items() if t.is_floating_point()]
    float_base: StateDict = {}
    float_experts: list[StateDict] = [{} for _ in experts]
    for name in float_names:
        dt = compute_dtype(base[name].dtype, *(e[name].dtype for e in experts))
        float_base[name] = base[name].to(dt)
        for i, expert in enumerate(experts):
            float_experts[i][name] = expert[name].to(device=base[name].device, dtype=dt)

    if not float_names:
        merged = {}
    elif spec.needs:
        merged = spec.fn(float_base, float_experts, opts, context)
    else:
        merged = spec.fn(float_base, float_experts, opts)
    if set(merged) != set(float_names):
        missing = sorted(set(float_names) - set(merged))
        extra = sorted(set(merged) - set(float_names))
        raise RuntimeError(
            f"merge method {method!r} returned the wrong tensors (missing {missing}, extra {extra})"
        )

    out: StateDict = {}
    for name, ref in base.items():
        if ref.is_floating_point():
            out[name] = merged[name].to(ref.dtype)
        else:
            out[name] = ref.clone()
    return out
