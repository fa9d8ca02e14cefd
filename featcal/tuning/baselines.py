"""Surgery and ProbSurgery tuned on dev by the protocol FeatCal's α, ρ, λ are: same problem, same budget.

`BaselineProblem` takes a `TuneProblem` (the merged model, the experts, the calibration batches and
the dev splits with calibration look-alikes removed) and caches, per task, the representation f_M
the head reads in the merged model and in the expert, on the calibration examples FeatCal reads
(or, in a reduced-fidelity study, on each task's first N of them, as FeatCal's trials are). A
trial trains every task's module from those with the trial's knobs and scores the deployed form
(merged backbone + module + the expert's head) on dev. `tune_baseline` runs one Optuna study per
method with `featcal.tuning.study.run_trials`: seeded TPE, resumable, the papers' defaults first.
"""

from __future__ import annotations

import copy
import hashlib
from dataclasses import dataclass, replace
from typing import Mapping

import torch
from optuna.trial import Trial
from torch import nn

from featcal.baselines.surgery import (
    ProbSurgeryConfig, SurgeryClassifier, SurgeryConfig, representations, train_probsurgery, train_surgery,
)
from featcal.data.splits import TaskSplit
from featcal.evaluation.predictions import accuracy
from featcal.io.checkpoints import with_backbone_assigned
from featcal.tuning.objective import AnchorSearch, TuneProblem
from featcal.tuning.study import (
    chosen_trial, count_trials, make_storage, open_study, redacted, rerank, run_trials, summarize, TuneOutcome,
)


KINDS = ("surgery", "probsurgery")


@dataclass(frozen=True)
class Knob:
    """A searched training knob: a float or an integer range, optionally on a log scale."""

    low: float
    high: float
    log: bool = True
    integer: bool = False

    def suggest(self, trial: Trial, name: str) -> float | int:
        if self.integer:
            return trial.suggest_int(name, int(self.low), int(self.high), log=self.log)
        return trial.suggest_float(name, self.low, self.high, log=self.log)


# Around each paper's defaults (Surgery: Adam 1e-3, rank 16, 500 iterations; ProbSurgery: 1e-3,
# width 128, 5 × 800 steps), a decade of learning rate and a factor of four to eight either way.
SPACES: dict[str, dict[str, Knob]] = {
    "surgery": {"lr": Knob(1e-4, 1e-2), "rank": Knob(4, 64, integer=True), "iterations": Knob(125, 2000, integer=True)},
    "probsurgery": {"lr": Knob(1e-4, 1e-2), "hidden": Knob(32, 512, integer=True),
                    "iterations": Knob(500, 8000, integer=True)},
}


def default_config(kind: str) -> SurgeryConfig | ProbSurgeryConfig:
    if kind not in KINDS:
        raise ValueError(f"baseline {kind!r}: expected one of {KINDS}")
    return SurgeryConfig(progress=False) if kind == "surgery" else ProbSurgeryConfig(progress=False)


class BaselineProblem:
    """The cached representations and the deployed form's scorers, built once from a `TuneProblem`."""

    def __init__(self, problem: TuneProblem, examples_per_task: int | None = None):
        self.problem = problem
        self.examples_per_task = examples_per_task
        # every calibration example, or each task's first N (a reduced-fidelity study's trials)
        self.batches = problem.calibration_batches(examples_per_task)
        self.dev = problem.dev
        self.encoder = problem.encoder
        self.expert_feats = {t: representations(problem.experts[t], self.batches[t]) for t in problem.dev}
        self._merged: nn.Module | None = None
        self.use_merged(problem.merged)

    def use_merged(self, merged: nn.Module) -> None:
        """Train and score on `merged` (a trial's anchor merge); its representations are computed
        once per merged backbone."""
        if merged is self._merged:
            return
        problem = self.problem
        # each task's model with the merged backbone (the expert's head)
        self.merged_models = {t: with_backbone_assigned(copy.deepcopy(problem.experts[t]).eval(), merged)
                              for t in problem.dev}
        self.merged_feats = {t: representations(self.merged_models[t], self.batches[t]) for t in problem.dev}
        self._merged = merged

    def on_every_example(self) -> BaselineProblem:
        """This problem on every calibration example: what leaves a reduced-fidelity study (the best
        configuration, trained for test) is trained there, as FeatCal's best is calibrated on all."""
        return self if self.examples_per_task is None else BaselineProblem(self.problem)

    def train(self, config: SurgeryConfig | ProbSurgeryConfig) -> dict[str, nn.Module]:
        trainer = train_surgery if isinstance(config, SurgeryConfig) else train_probsurgery
        return trainer(self.merged_feats, self.expert_feats, config, split="train")

    @torch.no_grad()
    def score(self, modules: Mapping[str, nn.Module], splits: Mapping[str, TaskSplit] | None = None) -> dict[str, float]:
        """Accuracy per task of the deployed form on `splits` (default: the dev splits)."""
        out = {}
        for task, dev in self.dev.items():
            split = dev.split if splits is None else splits[task]
            model = SurgeryClassifier(self.merged_models[task], modules[task]).eval()
            out[task] = accuracy(model, self.encoder, split, dev.max_length)
        return out


def tune_baseline(problem: BaselineProblem, kind: str, storage: str, study_name: str, n_trials: int,
                  seed: int = 0, startup_trials: int = 8, anchor: AnchorSearch | None = None,
                  rerank_top_k: int = 0) -> TuneOutcome:
    """Bring the study `study_name` up to `n_trials` trials of `kind` (surgery | probsurgery), the
    paper's defaults tried first; each trial's dev accuracy per task is kept (`dev`). With `anchor`,
    each trial also merges with its own anchor values (`featcal.tuning.objective.AnchorSearch`).
    A study holds trials of one fidelity (`problem.examples_per_task`, in its fingerprint). A
    reduced-fidelity study with `rerank_top_k` K trains its K best configurations again on every
    example and keeps the best of those on dev (`featcal.tuning.study.rerank`), as FeatCal's does."""
    base = default_config(kind)
    space = SPACES[kind]
    examples = "all" if problem.examples_per_task is None else problem.examples_per_task

    def objective(trial: Trial) -> float:
        config = replace(base, **{name: knob.suggest(trial, name) for name, knob in space.items()})
        if anchor is not None:
            problem.use_merged(problem.problem.merged_with(anchor, anchor.suggest_options(trial)))
        dev = problem.score(problem.train(config))
        trial.set_user_attr("dev", {t: round(v, 6) for t, v in dev.items()})
        return sum(dev.values()) / len(dev)

    fingerprint = hashlib.sha256(f"{kind} trial_examples_per_task={examples}".encode()).hexdigest()
    study = open_study(make_storage(storage), study_name, fingerprint=fingerprint)
    existing = count_trials(study)
    enqueue = {name: getattr(base, name) for name in space}
    ran = run_trials(study, objective, n_trials, seed=seed, startup_trials=startup_trials,
                     enqueue={**enqueue, **anchor.defaults()} if anchor is not None else enqueue)
    deployed = None
    if rerank_top_k and problem.examples_per_task is not None:
        final = problem.on_every_example()

        def exactly(trial) -> dict[str, nn.Module]:   # (scored right after, on this trial's merge)
            if anchor is not None:
                final.use_merged(problem.problem.merged_with(anchor, anchor.options_of(trial.params)))
            return final.train(config_of(trial.params, kind))

        _, deployed = rerank(study, rerank_top_k, exactly, final.score)
    summary = summarize(study)
    summary.update({"method": kind, "storage": redacted(storage), "target": n_trials, "ran_now": len(ran)})
    if problem.examples_per_task is not None:
        summary["trial_examples_per_task"] = problem.examples_per_task
    return TuneOutcome(study, ran, existing, summary, deployed)


def config_of(params: Mapping, kind: str) -> SurgeryConfig | ProbSurgeryConfig:
    """A trial's configuration from its parameters (its `anchor.*` values are the anchor's)."""
    return replace(default_config(kind), **{k: v for k, v in params.items() if k in SPACES[kind]})


def best_config(outcome: TuneOutcome, kind: str) -> SurgeryConfig | ProbSurgeryConfig:
    """The configuration of the study's best trial (`chosen_trial`: a rerank's choice where one ran)."""
    return config_of(chosen_trial(outcome.study).params, kind)


__all__ = ["BaselineProblem", "KINDS", "Knob", "SPACES", "best_config", "default_config", "tune_baseline"]
