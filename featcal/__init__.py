"""featcal: merge fine-tuned experts, then calibrate the merged model toward them (FeatCal).

    from featcal import merge_models, calibrate, FeatCalConfig, save_multitask, load_task_model

The names are imported on first use, so a program that needs one part of the library (a stage that
fine-tunes an expert, say) runs none of the others.
"""

from __future__ import annotations

import importlib

_EXPORTS = {
    "merge_models": "featcal.merging.in_memory",
    "MERGE_METHODS": "featcal.merging",
    "MergeContext": "featcal.merging",
    "calibrate": "featcal.calibration.calibrate",
    "CalibrationResult": "featcal.calibration.calibrate",
    "FeatCalConfig": "featcal.calibration.config",
    "calibrate_lazy": "featcal.calibration.lazy",
    "lazy_merge": "featcal.merging.lazy",
    "load_task_model": "featcal.io.models",
    "save_multitask": "featcal.io.models",
}

__all__ = sorted(_EXPORTS)


def __getattr__(name: str):
    if name not in _EXPORTS:
        raise AttributeError(f"module 'featcal' has no attribute {name!r}")
    value = getattr(importlib.import_module(_EXPORTS[name]), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_EXPORTS))
