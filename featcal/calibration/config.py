"""FeatCal's settings: the hyperparameters (α, ρ, λ, per layer if wished), what is calibrated, and
where and in what precision the products run. Light to import: a program that only checks
settings (the pipeline's params schema) runs no model code.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Mapping

import torch

from featcal.calibration.moments import PRODUCT_DTYPES


HYPER_KEYS = ("alpha", "rho", "ridge")


PIPELINE_KEYS = ("use_tuned",)   # keys of the `featcal` params section that are not FeatCal knobs


@dataclass(frozen=True)
class LayerHyper:
    """α (target interpolation), ρ (anchor blend) and λ (ridge) used for one block."""

    alpha: float
    rho: float
    ridge: float


def check_hyper(hyper: LayerHyper, where: str) -> None:
    """α in [0, 1], ρ > 0, λ >= 0, all finite real numbers: the ranges FeatCal's formulas are meant for."""
    for key in HYPER_KEYS:
        value = getattr(hyper, key)
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise TypeError(f"{where}.{key} must be a number, got {value!r} ({type(value).__name__})")
    if not 0.0 <= hyper.alpha <= 1.0:
        raise ValueError(f"{where}.alpha must be in [0, 1], got {hyper.alpha}")
    if not (hyper.rho > 0 and math.isfinite(hyper.rho)):
        raise ValueError(f"{where}.rho must be a finite number > 0, got {hyper.rho}")
    if not (hyper.ridge >= 0 and math.isfinite(hyper.ridge)):
        raise ValueError(f"{where}.ridge must be a finite number >= 0, got {hyper.ridge}")


def check_device_name(name: str) -> None:
    if name not in ("auto", "cpu", "cuda") and not (name.startswith("cuda:") and name[5:].isdigit()):
        raise ValueError(f"featcal.device must be 'auto', 'cpu', 'cuda' or 'cuda:N', got {name!r}")


def resolve_device(name: str) -> torch.device:
    """The device a `device` setting means on this machine; asking for CUDA without one is an error."""
    check_device_name(name)
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if name.startswith("cuda") and not torch.cuda.is_available():
        raise ValueError(f"featcal.device is {name!r} but torch sees no CUDA device; use 'auto' or 'cpu'")
    return torch.device(name)


@dataclass
class FeatCalConfig:
    """FeatCal's knobs; their defaults and meaning: docs/algorithms.md#featcal."""

    alpha: float = 0.25
    rho: float = 2.2
    ridge: float = 0.05
    pooled_token_weight: float = 0.01
    calibrate_bias: bool = True
    calibrate_norms: bool = True
    calibrate_pooler: bool = False
    layer_overrides: dict[int, dict[str, float]] = field(default_factory=dict)
    # how, not what: each batch's student Gram in float64 (the exact path, every default) or, as an explicit
    # opt-in, in float32 (of batch-centred rows; every other product and every sum stays float64; ~1.15x
    # faster, the demo's calibrated weights move by 7.3e-6 relative: docs/results.md, "what calibration costs")
    product_dtype: str = "float64"
    # where the block forwards, moment products and solves run: "auto" (CUDA when present), "cpu",
    # "cuda" or "cuda:N"; sums and solves stay float64 there (docs/results.md)
    device: str = "auto"

    def __post_init__(self) -> None:
        check_hyper(LayerHyper(self.alpha, self.rho, self.ridge), "featcal")
        for key in ("calibrate_bias", "calibrate_norms", "calibrate_pooler"):
            if not isinstance(getattr(self, key), bool):
                raise TypeError(f"featcal.{key} must be true or false, got {getattr(self, key)!r}")
        if isinstance(self.pooled_token_weight, bool) or not isinstance(self.pooled_token_weight, (int, float)):
            raise TypeError(f"featcal.pooled_token_weight must be a number, got {self.pooled_token_weight!r}")
        check_device_name(self.device)
        if self.product_dtype not in PRODUCT_DTYPES:
            raise ValueError(f"featcal.product_dtype must be one of {sorted(PRODUCT_DTYPES)}, got {self.product_dtype!r}")
        if not 0.0 <= self.pooled_token_weight <= 1.0:
            raise ValueError(f"featcal.pooled_token_weight must be in [0, 1], got {self.pooled_token_weight}")
        overrides = {}
        for layer, values in (self.layer_overrides or {}).items():
            bad = set(values) - set(HYPER_KEYS)
            if bad:
                raise ValueError(f"featcal.layer_overrides[{layer}]: unknown keys {sorted(bad)}; allowed {HYPER_KEYS}")
            for key, value in values.items():
                if isinstance(value, bool) or not isinstance(value, (int, float)):
                    raise TypeError(f"featcal.layer_overrides[{layer}].{key} must be a number, got {value!r}")
            overrides[int(layer)] = dict(values)
        self.layer_overrides = overrides
        for layer in overrides:
            check_hyper(self.for_layer(layer), f"featcal.layer_overrides[{layer}]")

    @classmethod
    def from_mapping(cls, values: Mapping) -> "FeatCalConfig":
        # `use_tuned` is the pipeline's switch to tuned values (stages/gen_chain.py), not a knob
        values = {k: v for k, v in values.items() if k not in PIPELINE_KEYS}
        known = set(cls.__dataclass_fields__)
        bad = set(values) - known
        if bad:
            raise ValueError(f"featcal params: unknown keys {sorted(bad)}; known keys {sorted(known)}")
        return cls(**dict(values))

    @property
    def products(self) -> torch.dtype:
        return PRODUCT_DTYPES[self.product_dtype]

    def check_layers(self, n_layers: int) -> None:
        """`layer_overrides` name layers the model has (its blocks 0 .. n − 1 and, where calibrated, the
        pooler as layer n): an override of a missing layer would otherwise be ignored silently."""
        missing = sorted(k for k in self.layer_overrides if not 0 <= k < n_layers)
        if missing:
            raise ValueError(f"featcal.layer_overrides: no layer {missing[0]} in this model; its calibrated layers "
                             f"are 0..{n_layers - 1} (the blocks, then the pooler where calibrate_pooler is set)")

    def for_layer(self, index: int) -> LayerHyper:
        values = {"alpha": self.alpha, "rho": self.rho, "ridge": self.ridge}
        values.update(self.layer_overrides.get(index, {}))
        return LayerHyper(**{k: float(v) for k, v in values.items()})
