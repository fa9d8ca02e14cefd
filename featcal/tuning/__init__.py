"""Tuning FeatCal's α, ρ, λ on the dev split: the objective (`objective`) apart from the study
plumbing that stores, shares and resumes trials (`study`).

Names load from their module on first use, so a process that only shares a study (a worker that
claims trials) imports optuna, not torch."""

from featcal import _lazy_exports

_FROM = {
    **dict.fromkeys(("AnchorSearch", "DEFAULT_EXPERT_CACHE_MIB", "DevSplit", "Range", "SearchSpace", "TuneProblem", "drop_calibration_overlap", "load_problem",
                     "make_objective"), "featcal.tuning.objective"),
    **dict.fromkeys(("DEFAULT_STUDY", "ClaimLock", "StudyMismatchError", "StudySettings", "StudyStorageError",
                     "TuneOutcome", "best_values", "chosen_trial", "copy_to_sqlite", "count_trials", "make_storage",
                     "open_study", "rerank", "reranked_dev", "run_trials", "snapshot_to_sqlite", "summarize", "tune",
                     "write_best"), "featcal.tuning.study"),
}

__all__ = sorted(_FROM)
__getattr__, __dir__ = _lazy_exports(__name__, _FROM)
