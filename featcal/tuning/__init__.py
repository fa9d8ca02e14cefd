"""Tuning FeatCal's α, ρ, λ on the dev split: the objective (`objective`) apart from the study
plumbing that stores, shares and resumes trials (`study`)."""

from featcal.tuning.objective import (
    DevSplit, Range, SearchSpace, TuneProblem, drop_calibration_overlap, load_problem, make_objective,
)
from featcal.tuning.study import (
    DEFAULT_STUDY, ClaimLock, StudyMismatchError, StudySettings, StudyStorageError, TuneOutcome, best_values,
    copy_to_sqlite, count_trials, make_storage, open_study, run_trials, snapshot_to_sqlite, summarize, tune,
    write_best,
)

__all__ = [
    "DEFAULT_STUDY", "ClaimLock", "DevSplit", "Range", "SearchSpace", "StudyMismatchError", "StudySettings",
    "StudyStorageError", "TuneOutcome", "TuneProblem", "best_values", "copy_to_sqlite", "count_trials",
    "drop_calibration_overlap", "load_problem", "make_objective", "make_storage", "open_study", "run_trials",
    "snapshot_to_sqlite", "summarize", "tune", "write_best",
]
