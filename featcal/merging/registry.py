"""Registry of merge methods and the one entry point that validates inputs and runs them.

A merge method is a pure function ``fn(base, experts, opts) -> merged`` over *backbone* state
dicts (name -> tensor). It declares its options as a frozen dataclass. Adding a method is one
``@register("name", OptionsCls)`` line on that function; no method reads or writes files.

``merge_state_dicts`` is the only place that:
- checks that every expert has exactly the base's tensor names and shapes,
- builds the options dataclass from a plain mapping (unknown keys are an error),
- upcasts floating tensors to float32 (float64 stays float64) before the method sees them and
  casts the result back to the base dtype, and
- copies non-floating tensors (integer buffers such as ``position_ids``) from the base unchanged.

So a method receives only floating tensors, all in a compute dtype of at least float32.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

StateDict = dict[str, Tensor]
MergeFn = Callable[[StateDict, Sequence[StateDict], Any], StateDict]


@dataclass(frozen=True)
class MergeMethod:
    """One registered merge method: its name, the function, and its options dataclass."""

    name: str
    fn: MergeFn
    options_cls: type


MERGE_METHODS: dict[str, MergeMethod] = {}


def register(name: str, options_cls: type) -> Callable[[MergeFn], MergeFn]:
    """Decorator: register ``fn(base, experts, opts) -> merged`` under ``name``.

    ``options_cls`` must be a frozen dataclass whose fields all have defaults.
    """
    if not (dataclasses.is_dataclass(options_cls) and isinstance(options_cls, type)):
        raise TypeError(f"merge method {name!r}: options_cls must be a dataclass, got {options_cls!r}")
    if not options_cls.__dataclass_params__.frozen:  # type: ignore[attr-defined]
        raise TypeError(f"merge method {name!r}: options dataclass {options_cls.__name__} must be frozen")

    def decorator(fn: MergeFn) -> MergeFn:
        if name in MERGE_METHODS:
            raise ValueError(f"merge method {name!r} is already registered")
        MERGE_METHODS[name] = MergeMethod(name=name, fn=fn, options_cls=options_cls)
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
) -> StateDict:
    """Merge ``experts`` (fine-tuned from ``base``) with the registered ``method``.

    Floating tensors are upcast to ``compute_dtype`` (>= float32), merged, and cast back to the
    base dtype; non-floating tensors are copied from ``base``. The result keeps the base's order.
    """
    spec = get_method(method)
    opts = build_options(method, options)
    experts = list(experts)
    _check_compatible(base, experts)

    float_names = [n for n, t in base.items() if t.is_floating_point()]
    float_base: StateDict = {}
    float_experts: list[StateDict] = [{} for _ in experts]
    for name in float_names:
        dt = compute_dtype(base[name].dtype, *(e[name].dtype for e in experts))
        float_base[name] = base[name].to(dt)
        for i, expert in enumerate(experts):
            float_experts[i][name] = expert[name].to(device=base[name].device, dtype=dt)

    merged = spec.fn(float_base, float_experts, opts) if float_names else {}
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
