"""Tuning FeatCal's α, ρ, λ on the dev split: the objective (`objective`) apart from the study
plumbing that stores, shares and resumes trials (`study`).

Names load from their module on first use, so a process that only shares a study (a worker that
claims trials) imports optuna, not torch."""

import importlib

_FROM = {
    **dict.fromkeys(("DevSplit", "Range", "SearchSpace", "TuneProblem", "drop_calibration_overlap", "load_problem",
                     "make_objective"), "objective"),
    **dict.fromkeys(("DEFAULT_STUDY", "ClaimLock", "StudyMismatchError", "StudySettings", "StudyStorageError",
                     "TuneOutcome", "best_values", "copy_to_sqlite", "count_trials", "make_storage", "open_study",
                     "run_trials", "snapshot_to_sqlite", "summarize", "tune", "write_best"), "study"),
}

__all__ = sorted(_FROM)


def __getattr__(name: str):
    if name not in _FROM:
        raise AttributeError(f"module 'featcal.tuning' has no attribute {name!r}")
    return getattr(importlib.import_module(f"featcal.tuning.{_FROM[name]}"), name)
