"""featcal: merge fine-tuned experts, then calibrate the merged model toward them (FeatCal).

    from featcal import merge_models, calibrate, FeatCalConfig, save_multitask, load_task_model

The names are imported on first use, so a program that needs one part of the library (a stage that
fine-tunes an expert, say) runs none of the others.
"""

from __future__ import annotations

import importlib
import sys
from typing import Callable, Mapping


def _lazy_exports(package: str, exports: Mapping[str, str]) -> tuple[Callable[[str], object], Callable[[], list[str]]]:
    """`__getattr__` and `__dir__` (PEP 562) for `package`, whose name `n` lives in the module
    `exports[n]`: imported on first use, then kept in the package's namespace."""
    namespace = sys.modules[package].__dict__

    def __getattr__(name: str):
        if name not in exports:
            raise AttributeError(f"module {package!r} has no attribute {name!r}")
        value = getattr(importlib.import_module(exports[name]), name)
        namespace[name] = value
        return value

    def __dir__() -> list[str]:
        return sorted(set(namespace) | set(exports))

    return __getattr__, __dir__


_EXPORTS = {
    "merge_models": "featcal.merging.in_memory",
    "MERGE_METHODS": "featcal.merging",
    "MergeContext": "featcal.merging",
    "calibrate": "featcal.calibration.walk",
    "CalibrationResult": "featcal.calibration.calibrate",
    "FeatCalConfig": "featcal.calibration.config",
    "calibrate_lazy": "featcal.calibration.lazy",
    "lazy_merge": "featcal.merging.lazy",
    "load_task_model": "featcal.io.models",
    "save_multitask": "featcal.io.models",
}

__all__ = sorted(_EXPORTS)
__getattr__, __dir__ = _lazy_exports(__name__, _EXPORTS)
