"""Search FeatCal's α, ρ, λ with Optuna, scoring each trial's calibrated model on the dev split.

A trial runs the whole forward-order calibration in this process from cached states: the experts'
states entering every block (computed once, never re-run here) and the calibration token inputs.
It then scores each task's dev split with that task's head on the calibrated backbone. Dev
examples whose tokens also appear in the calibration sample are dropped from scoring; the test
split is never read.

Studies live in any Optuna RDB storage (a SQLAlchemy URL: sqlite for one machine, PostgreSQL or
MySQL for several). `run_trials` brings a study up to a *total* number of trials, so running it
again with a larger total runs only the new trials, and several workers on one study stop at the
total exactly: each claims its next trial under a lock held in the database (PostgreSQL/MySQL
advisory lock) or on the machine (sqlite file lock). Trials of a worker that died are found by
their stopped heartbeat, failed and replaced.

The library knows nothing of DVC: `tune_from_params` reads a params mapping (`tasks`, `tokens`,
`calibration`, `featcal`, `tune`) and a project's file layout, nothing more.
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import dataclasses
import fcntl
import hashlib
import logging
import math
import os
import re
import socket
import statistics
import threading
import time
import warnings
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Iterator, Mapping, Sequence

import numpy as np
import optuna
import sqlalchemy
import torch
import yaml
from optuna.trial import FrozenTrial, Trial, TrialState
from torch import Tensor, nn

from .calibrate import HYPER_KEYS, FeatCalConfig
from .data import TaskSplit, batches_from_arrays, read_split
from .families import Family, family_for
from .modeling import atomic_file, load_backbone, load_classifier, load_tokenizer, write_json
from .store import read_group
from .evaluate import score_backbone
from .walk import CachedExpertStates, ModuleWeights, walk_all

log = logging.getLogger(__name__)

DEFAULT_STORAGE = "sqlite:///tune/study.db"
DEFAULT_STUDY = "featcal-dev"
HEARTBEAT_S = 20            # a live worker touches its running trial this often
GRACE_S = 60                # a running trial untouched this long belongs to a dead worker


# --- search space ------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Range:
    low: float
    high: float
    log: bool = False

    def __post_init__(self) -> None:
        if not self.low < self.high:
            raise ValueError(f"range low {self.low} must be below high {self.high}")
        if self.log and self.low <= 0:
            raise ValueError(f"a log range needs low > 0, got {self.low}")

    def __contains__(self, value: float) -> bool:
        return self.low <= value <= self.high

    @classmethod
    def parse(cls, name: str, spec) -> "Range":
        if isinstance(spec, Mapping):
            bad = set(spec) - {"low", "high", "log"}
            if bad:
                raise ValueError(f"tune.search.{name}: unknown keys {sorted(bad)} (use low, high, log)")
            return cls(float(spec["low"]), float(spec["high"]), bool(spec.get("log", False)))
        if isinstance(spec, Sequence) and not isinstance(spec, str) and len(spec) == 2:
            return cls(float(spec[0]), float(spec[1]))
        raise ValueError(f"tune.search.{name}: expected [low, high] or {{low, high, log}}, got {spec!r}")


@dataclass(frozen=True)
class SearchSpace:
    """The hyperparameters searched and their ranges; the others keep their FeatCalConfig value."""

    ranges: Mapping[str, Range] = field(default_factory=lambda: {
        "alpha": Range(0.0, 1.0), "rho": Range(0.5, 3.0), "ridge": Range(1e-3, 1.0, log=True)})

    def __post_init__(self) -> None:
        bad = set(self.ranges) - set(HYPER_KEYS)
        if bad:
            raise ValueError(f"tune.search: unknown hyperparameters {sorted(bad)}; searchable: {list(HYPER_KEYS)}")
        if not self.ranges:
            raise ValueError("tune.search: nothing to search")

    @classmethod
    def from_mapping(cls, values: Mapping) -> "SearchSpace":
        return cls({k: Range.parse(k, v) for k, v in values.items()})

    def suggest(self, trial: Trial) -> dict[str, float]:
        return {k: trial.suggest_float(k, r.low, r.high, log=r.log) for k, r in self.ranges.items()}

    def contains(self, values: Mapping[str, float]) -> bool:
        return all(values[k] in r for k, r in self.ranges.items())


# --- the problem a trial solves ----------------------------------------------------------------------


@dataclass
class DevSplit:
    """A task's dev examples used for scoring (calibration look-alikes removed) and their length."""

    split: TaskSplit
    max_length: int
    dropped: int = 0


def drop_calibration_overlap(split: TaskSplit, tokenizer, max_length: int, input_ids: Tensor,
                             attention_mask: Tensor) -> tuple[TaskSplit, int]:
    """Remove examples whose token sequence is one of the calibration rows (real tokens only), so a
    dev score never rewards fitting an example that calibration saw."""
    seen = {tuple(ids[m.bool()].tolist()) for ids, m in zip(input_ids, attention_mask)}
    encoded = tokenizer(split.texts, truncation=True, max_length=max_length)["input_ids"]
    keep = [i for i, ids in enumerate(encoded) if tuple(ids) not in seen]
    kept = TaskSplit(split.task, split.split, [split.texts[i] for i in keep], split.labels[keep])
    return kept, len(split.texts) - len(keep)


class TuneProblem:
    """Everything a trial needs, loaded once: the merged backbone (never modified), the base, the
    experts, the calibration batches, the experts' cached states per block and the dev splits."""

    def __init__(
        self,
        merged: nn.Module,
        base: nn.Module,
        experts: Mapping[str, nn.Module],
        batches: Mapping[str, list[dict[str, Tensor]]],
        expert_states: Callable[[int], Mapping[str, Tensor]],
        dev: Mapping[str, DevSplit],
        tokenizer,
        family: Family | None = None,
    ):
        self.family = family or family_for(merged)
        self.merged = self.family.backbone(merged).eval()
        self.base, self.experts, self.batches = base, dict(experts), dict(batches)
        self.dev, self.tokenizer = dict(dev), tokenizer
        missing = set(self.dev) - set(self.experts)
        if missing:
            raise KeyError(f"dev splits for tasks without an expert: {sorted(missing)}")
        self._expert_states = expert_states
        self._states: dict[int, Mapping[str, Tensor]] = {}
        self.n_blocks = len(self.family.blocks(self.merged))
        self.weights = ModuleWeights(self.family.backbone(base).eval(),
                                     {t: self.family.backbone(m).eval() for t, m in self.experts.items()})
        # scoring swaps backbones into copies of the task models; the experts stay untouched
        self._scorers = {t: copy.deepcopy(self.experts[t]).eval() for t in self.dev}

    def states(self, layer: int) -> Mapping[str, Tensor]:
        if layer not in self._states:
            self._states[layer] = self._expert_states(layer)
        return self._states[layer]

    def calibrate(self, config: FeatCalConfig, after_block: Callable[[int, nn.Module], None] | None = None) -> nn.Module:
        """A calibrated copy of the merged backbone: the walk, with the experts' states from the cache."""
        backbone = copy.deepcopy(self.merged)

        def on_block(k: int, _result) -> None:
            if after_block is not None and k < self.n_blocks - 1:
                after_block(k, backbone)

        walk_all(self.family, backbone, self.weights, self.batches, config,
                 expert_states=CachedExpertStates(self.states), on_block=on_block, progress=False)
        return backbone

    @torch.no_grad()
    def score(self, backbone: nn.Module) -> dict[str, float]:
        """Dev accuracy per task, each task's head on `backbone` (`featcal.evaluate.score_backbone`)."""
        return score_backbone(backbone, self._scorers, self.tokenizer, {t: d.split for t, d in self.dev.items()},
                              {t: d.max_length for t, d in self.dev.items()})

    def fingerprint(self, config: FeatCalConfig, space: SearchSpace) -> str:
        """A digest of what a trial's score depends on apart from the searched values: models,
        cached states, calibration inputs, dev data and the fixed FeatCal settings."""
        h = hashlib.blake2b(digest_size=20)

        def tensor(t: Tensor) -> None:
            h.update(str((t.dtype, tuple(t.shape))).encode())
            h.update(np.ascontiguousarray(t.detach().cpu().numpy()).data)

        def module(m: nn.Module) -> None:
            for name, value in sorted(m.state_dict().items()):
                h.update(name.encode())
                tensor(value)

        module(self.merged)
        module(self.family.backbone(self.base))
        for task in sorted(self.experts):
            h.update(task.encode())
            module(self.experts[task])
            for batch in self.batches[task]:
                for key in sorted(batch):
                    tensor(batch[key])
        for layer in range(self.n_blocks + (1 if config.calibrate_pooler else 0)):
            for task, value in sorted(self.states(layer).items()):
                h.update(f"{layer}/{task}".encode())
                tensor(value)
        for task, d in sorted(self.dev.items()):
            h.update(f"{task}/{d.max_length}/{len(d.split.texts)}".encode())
            h.update("\0".join(d.split.texts).encode())
            tensor(d.split.labels)
        fixed = {k: v for k, v in dataclasses.asdict(config).items() if k not in space.ranges}
        h.update(repr(sorted(fixed.items())).encode())
        return h.hexdigest()


def load_problem(
    *, base: str, tasks: Sequence[str], max_length: Mapping[str, int], batch_size: int,
    merged: str | os.PathLike = "models/merged", experts_dir: str | os.PathLike = "experts",
    features: str | os.PathLike = "features/experts", tasks_dir: str | os.PathLike = "data/tasks",
) -> TuneProblem:
    """Load a problem from a project's files: `merged` (multi-task folder), `experts_dir/<task>`,
    the expert-feature caches `features/{inputs,layer_XX}.zarr` and `tasks_dir/<task>/dev.parquet`."""
    features = Path(features)
    tokenizer = load_tokenizer(str(merged))
    inputs = read_group(features / "inputs.zarr")
    batches = batches_from_arrays(inputs, batch_size)
    missing = set(tasks) - set(batches)
    if missing:
        raise KeyError(f"{features / 'inputs.zarr'} has no calibration inputs for {sorted(missing)}")
    batches = {t: batches[t] for t in tasks}
    dev = {}
    for task in tasks:
        split, dropped = drop_calibration_overlap(read_split(tasks_dir, task, "dev"), tokenizer, max_length[task],
                                                  inputs[f"input_ids/{task}"], inputs[f"attention_mask/{task}"])
        if not split.texts:
            raise ValueError(f"task {task!r}: every dev example is also in the calibration sample")
        if dropped:
            log.warning("task %s: %d dev examples also in the calibration sample are not scored", task, dropped)
        dev[task] = DevSplit(split, max_length[task], dropped)

    def expert_states(layer: int) -> dict[str, Tensor]:
        states = read_group(features / f"layer_{layer:02d}.zarr")
        return {t: states[t] for t in tasks}

    return TuneProblem(load_backbone(str(merged)), load_backbone(base),
                       {t: load_classifier(str(Path(experts_dir) / t)) for t in tasks},
                       batches, expert_states, dev, tokenizer)


# --- the objective -------------------------------------------------------------------------------------


def make_objective(problem: TuneProblem, space: SearchSpace, base: FeatCalConfig,
                   prune_after: Sequence[int] = ()) -> Callable[[Trial], float]:
    """Objective: mean dev accuracy over tasks of the model calibrated with the trial's values.

    With `prune_after` (block indices), the partly calibrated model (blocks 0..k calibrated, the
    rest merged) is scored after each listed block and reported, so a pruner may stop the trial.
    """
    def objective(trial: Trial) -> float:
        values = space.suggest(trial)
        config = dataclasses.replace(base, **values)

        def after_block(k: int, backbone: nn.Module) -> None:
            if k in prune_after:
                partial = statistics.fmean(problem.score(backbone).values())
                trial.report(partial, k)
                if trial.should_prune():
                    raise optuna.TrialPruned(f"dev {partial:.4f} after block {k}")

        start = time.perf_counter()
        backbone = problem.calibrate(config, after_block if prune_after else None)
        trial.set_user_attr("calibrate_s", round(time.perf_counter() - start, 3))
        start = time.perf_counter()
        scores = problem.score(backbone)
        trial.set_user_attr("score_s", round(time.perf_counter() - start, 3))
        trial.set_user_attr("dev", {t: round(v, 6) for t, v in scores.items()})
        return statistics.fmean(scores.values())

    return objective


# --- studies: storage, claiming trials, resuming ------------------------------------------------------


class StudyMismatchError(RuntimeError):
    """The study's trials were scored on other inputs than the ones loaded now."""


class StudyStorageError(RuntimeError):
    """The study's storage (e.g. tune/study.db) is empty or damaged: its trials cannot be trusted."""


SQLITE_HEADER = b"SQLite format 3\x00"
# scheme://user:password@host: a password in params would be recorded in dvc.lock (and git)
_URL_PASSWORD = re.compile(r"^[A-Za-z][A-Za-z0-9+.-]*://[^/@:\s]*:[^/@\s]+@")


def refuse_password(url: str | None, where: str) -> None:
    """A storage URL from params must not carry a password; it belongs in ~/.pgpass (PostgreSQL),
    ~/.my.cnf (MySQL) or an environment variable."""
    if url and _URL_PASSWORD.match(url.strip()):
        raise ValueError(f"{where}: the URL holds a password, and params are recorded in dvc.lock (and git). "
                         "Leave it out: PostgreSQL reads it from ~/.pgpass or $PGPASSWORD, MySQL from ~/.my.cnf; "
                         "or pass the whole URL in $FEATCAL_TUNE_STORAGE or --storage")


def sqlite_path(url: str) -> Path | None:
    """The database file of a sqlite URL (None for other backends and in-memory databases)."""
    parsed = sqlalchemy.engine.make_url(url)
    if parsed.get_backend_name() == "sqlite" and parsed.database not in (None, "", ":memory:"):
        return Path(parsed.database)
    return None


def _storage_fix(path: Path) -> str:
    return (f"restore it (`dvc checkout {path}` or `dvc pull`), or delete it to start the study afresh "
            "(its trials are then lost)")


def check_sqlite_file(path: Path) -> None:
    """An existing study file must be a sqlite database: an empty or overwritten one would
    silently start a new study and redo the old trials."""
    if not path.exists():
        return
    with open(path, "rb") as handle:
        header = handle.read(len(SQLITE_HEADER))
    if not header:
        raise StudyStorageError(f"study file {path} is empty; {_storage_fix(path)}")
    if header != SQLITE_HEADER:
        raise StudyStorageError(f"study file {path} is not a sqlite database (damaged); {_storage_fix(path)}")


@contextlib.contextmanager
def _readable_storage(url: str | None) -> Iterator[None]:
    """Turn a database error while opening a study into one naming the file and the fix."""
    try:
        yield
    except sqlalchemy.exc.DatabaseError as err:
        path = sqlite_path(url) if url else None
        where = f"study file {path}" if path else f"study storage {redacted(url or '')}"
        fix = _storage_fix(path) if path else "repair or restore the database"
        raise StudyStorageError(f"{where} cannot be read ({type(err.orig or err).__name__}: "
                                f"{str(err.orig or err)[:200]}); {fix}") from None


def redacted(url: str) -> str:
    try:
        return sqlalchemy.engine.make_url(url).render_as_string(hide_password=True)
    except Exception:  # noqa: BLE001 - not a SQLAlchemy URL: say nothing more about it
        return "<storage>"


def make_storage(url: str, heartbeat_s: int = HEARTBEAT_S, grace_s: int = GRACE_S) -> optuna.storages.RDBStorage:
    """An RDB storage with heartbeats (dead workers' trials get failed); sqlite folders are created,
    an empty or damaged sqlite file is an error naming it and the fix."""
    path = sqlite_path(url)
    if path is not None:
        path.parent.mkdir(parents=True, exist_ok=True)
    # workers starting together on a fresh database would race creating Optuna's tables
    with ClaimLock(url, "<schema>")(), warnings.catch_warnings(), _readable_storage(url):
        if path is not None:
            check_sqlite_file(path)
        warnings.simplefilter("ignore", optuna.exceptions.ExperimentalWarning)
        return optuna.storages.RDBStorage(url, heartbeat_interval=heartbeat_s, grace_period=grace_s)


def trial_seed(seed: int, number: int) -> int:
    return int(np.random.SeedSequence([seed, number]).generate_state(1)[0])


def open_study(storage: str | optuna.storages.BaseStorage, study_name: str, *, fingerprint: str | None = None,
               pruner: optuna.pruners.BasePruner | None = None) -> optuna.Study:
    """Create or load a maximising study; refuse one whose trials were scored on other inputs."""
    if isinstance(storage, str):
        storage = make_storage(storage)
    with _readable_storage(getattr(storage, "url", None)):
        study = optuna.create_study(storage=storage, study_name=study_name, direction="maximize",
                                    pruner=pruner or optuna.pruners.NopPruner(), load_if_exists=True)
    if fingerprint is not None:
        known = study.user_attrs.get("fingerprint")
        if known is None:
            study.set_user_attr("fingerprint", fingerprint)
        elif known != fingerprint:
            raise StudyMismatchError(
                f"study {study_name!r} was scored on other inputs (models, cached features, dev data or fixed "
                f"featcal settings: fingerprint {known[:12]} here {fingerprint[:12]}); its trials are not "
                f"comparable. Use another study name (tune.study_name / --study-name) or delete it: "
                f"optuna delete-study --storage URL --study-name {study_name}"
            )
    return study


def counts_toward_total(trial: FrozenTrial) -> bool:
    """Trials that use up the total: finished, pruned, running or queued, and failures of the
    objective itself. A trial failed by an interrupt or a dead worker is run again."""
    if trial.state == TrialState.FAIL:
        return "error" in trial.user_attrs
    return True


def count_trials(study: optuna.Study) -> int:
    return sum(counts_toward_total(t) for t in study.get_trials(deepcopy=False))


@contextlib.contextmanager
def _flock(path: Path) -> Iterator[None]:
    with open(path, "a") as handle:
        fcntl.flock(handle, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)


class ClaimLock:
    """Serialises "count the study's trials, then create the next one" across workers, so that the
    total is met exactly: a PostgreSQL/MySQL advisory lock for server databases, a file lock next to
    the database for sqlite (in the project, not in a /tmp that another machine or container does
    not share), a process lock otherwise. One lock per (database, `study_name`); it also guards
    creating the tables (name "<schema>")."""

    def __init__(self, url: str | None, study_name: str):
        self.study_name = study_name
        self.backend = sqlalchemy.engine.make_url(url).get_backend_name() if url else None
        key = hashlib.blake2b(f"featcal-tune/{study_name}".encode(), digest_size=8).digest()
        self.key = int.from_bytes(key, "big", signed=True)
        self.engine = None
        self.path = None
        if self.backend in ("postgresql", "mysql", "mariadb"):
            self.engine = sqlalchemy.create_engine(url, poolclass=sqlalchemy.pool.NullPool)
        elif self.backend == "sqlite":
            database = sqlite_path(url)
            if database is not None:
                study = hashlib.blake2b(study_name.encode(), digest_size=6).hexdigest()
                self.path = database.resolve().with_name(f".{database.name}.claim-{study}.lock")
        elif url:
            log.warning("storage backend %r: no cross-process claim lock; several workers may overshoot "
                        "the total by a few trials", self.backend)
        self._local = threading.Lock()

    @contextlib.contextmanager
    def __call__(self) -> Iterator[None]:
        with self._local:
            if self.path is not None:
                with _flock(self.path):
                    yield
            elif self.engine is not None and self.backend == "postgresql":
                with self.engine.connect() as conn:
                    conn.execute(sqlalchemy.text("SELECT pg_advisory_lock(:k)"), {"k": self.key})
                    try:
                        yield
                    finally:
                        conn.execute(sqlalchemy.text("SELECT pg_advisory_unlock(:k)"), {"k": self.key})
            elif self.engine is not None:
                name = f"featcal-tune-{self.key & 0xFFFFFFFF:08x}"
                with self.engine.connect() as conn:
                    conn.execute(sqlalchemy.text("SELECT GET_LOCK(:n, -1)"), {"n": name})
                    try:
                        yield
                    finally:
                        conn.execute(sqlalchemy.text("SELECT RELEASE_LOCK(:n)"), {"n": name})
            else:
                yield


class _Heartbeat:
    """Touch a running trial's heartbeat until stopped (what `study.optimize` does for its trials)."""

    def __init__(self, storage, trial_id: int, interval: int | None):
        self.storage, self.trial_id, self.interval = storage, trial_id, interval
        self.stop_event = threading.Event()
        self.thread = None

    def __enter__(self) -> "_Heartbeat":
        if self.interval:
            self.storage.record_heartbeat(self.trial_id)
            self.thread = threading.Thread(target=self._beat, daemon=True)
            self.thread.start()
        return self

    def _beat(self) -> None:
        while not self.stop_event.wait(self.interval):
            try:
                self.storage.record_heartbeat(self.trial_id)
            except Exception as exc:  # noqa: BLE001 - a missed beat is retried; the trial goes on
                log.warning("heartbeat of trial %d failed: %s", self.trial_id, exc)

    def __exit__(self, *exc) -> None:
        self.stop_event.set()
        if self.thread is not None:
            self.thread.join()


def _machine() -> str | None:
    """This machine's kernel boot and pid namespace: a process id means the same process only
    where both match (containers sharing a hostname do not)."""
    try:
        boot = Path("/proc/sys/kernel/random/boot_id").read_text().strip()
        return f"{boot}/{os.stat('/proc/self/ns/pid').st_ino}"
    except OSError:
        return None


def _start_ticks(pid: int) -> int | None:
    """When process `pid` started (clock ticks since boot), so a reused pid is not taken for it."""
    try:
        return int(Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[19])
    except (OSError, IndexError, ValueError):
        return None


def process_identity() -> dict:
    """Recorded on each trial a worker runs (user attr `process`)."""
    return {"machine": _machine(), "pid": os.getpid(), "start": _start_ticks(os.getpid())}


def worker_is_dead(trial: FrozenTrial) -> bool:
    """Whether a running trial's worker ran on this machine and is gone (killed, crashed): then its
    trial can be failed at once instead of after the heartbeat's grace period."""
    process = trial.user_attrs.get("process")
    if not process or process.get("machine") is None or process.get("machine") != _machine():
        return False
    return _start_ticks(process["pid"]) != process["start"]


def fail_dead_workers(study: optuna.Study) -> list[int]:
    """Fail the running trials of this machine's dead workers; they no longer count (and are rerun)."""
    failed = []
    for trial in study.get_trials(deepcopy=False, states=(TrialState.RUNNING,)):
        if worker_is_dead(trial):
            study._storage.set_trial_user_attr(trial._trial_id, "dead_worker", True)  # noqa: SLF001
            study._storage.set_trial_state_values(trial._trial_id, TrialState.FAIL)  # noqa: SLF001
            failed.append(trial.number)
            log.warning("trial %d: its worker (pid %s) is gone; failed, it will be run again",
                        trial.number, trial.user_attrs["process"]["pid"])
    return failed


def _heartbeat_interval(study: optuna.Study) -> int | None:
    storage = study._storage  # noqa: SLF001 - Optuna exposes no public accessor
    get = getattr(storage, "get_heartbeat_interval", None)
    return get() if get is not None else None


def run_trials(
    study: optuna.Study,
    objective: Callable[[Trial], float],
    n_trials: int,
    *,
    seed: int = 0,
    startup_trials: int = 10,
    lock: Callable[[], contextlib.AbstractContextManager] | None = None,
    enqueue: Mapping[str, float] | None = None,
    worker: str | None = None,
    on_trial: Callable[[FrozenTrial], None] | None = None,
) -> list[int]:
    """Run trials until the study holds `n_trials` that count (see `counts_toward_total`).

    Returns the numbers of the trials this call ran. Trial k samples with TPE seeded by
    (seed, k), so one worker reproduces the same trials whether it ran them in one go or resumed.
    Running trials of dead workers are failed (and rerun): at once when the worker ran on this
    machine, else when its heartbeat stops. With heartbeats, the call returns only once no trial
    is running, so a trial whose worker was killed is never taken for a finished one.
    `enqueue`: parameters tried first when no trial has them yet (e.g. the defaults). Each trial
    records `wall_s` and `worker`; an exception in the objective fails the trial (recorded as
    `error`) and the run goes on; KeyboardInterrupt fails it as interrupted and stops.
    """
    if n_trials < 1:
        raise ValueError(f"n_trials must be >= 1, got {n_trials}")
    lock = lock or contextlib.nullcontext
    worker = worker or f"{socket.gethostname()}:{os.getpid()}"
    interval = _heartbeat_interval(study)
    ran: list[int] = []
    waited_for: list[int] = []
    while True:
        with lock():
            fail_dead_workers(study)
            if interval:
                with warnings.catch_warnings():
                    warnings.simplefilter("ignore", optuna.exceptions.ExperimentalWarning)
                    optuna.storages.fail_stale_trials(study)
            trials = study.get_trials(deepcopy=False)
            running = [t.number for t in trials if t.state == TrialState.RUNNING]
            if sum(counts_toward_total(t) for t in trials) >= n_trials:
                if not (interval and running):
                    break
                trial = None
            else:
                trial = _claim(study, trials, enqueue, interval)
        if trial is None:   # the total is claimed: wait until the other workers' trials end or die
            if running != waited_for:
                log.info("waiting for running trials %s of other workers", running)
                waited_for = running
            time.sleep(min(interval, 2))
            continue
        study.sampler = optuna.samplers.TPESampler(seed=trial_seed(seed, trial.number),
                                                   n_startup_trials=startup_trials)
        trial.set_user_attr("worker", worker)
        start = time.perf_counter()
        with _Heartbeat(study._storage, trial._trial_id, interval):  # noqa: SLF001
            state, value = TrialState.COMPLETE, None
            try:
                value = objective(trial)
                if not math.isfinite(value):
                    raise ValueError(f"objective returned {value}")
            except optuna.TrialPruned as exc:
                state = TrialState.PRUNED
                log.info("trial %d pruned: %s", trial.number, exc)
            except KeyboardInterrupt:
                trial.set_user_attr("interrupted", True)
                study.tell(trial, state=TrialState.FAIL)
                raise
            except Exception as exc:  # noqa: BLE001 - a failing trial is recorded, the study goes on
                state = TrialState.FAIL
                trial.set_user_attr("error", f"{type(exc).__name__}: {exc}"[:2000])
                log.exception("trial %d failed", trial.number)
            trial.set_user_attr("wall_s", round(time.perf_counter() - start, 3))
            if state == TrialState.COMPLETE:
                study.tell(trial, value)
            else:
                study.tell(trial, state=state)
        ran.append(trial.number)
        frozen = study._storage.get_trial(trial._trial_id)  # noqa: SLF001
        log.info("trial %d %s: %s -> %s (%.1f s)", frozen.number, frozen.state.name,
                 {k: round(v, 5) for k, v in frozen.params.items()}, frozen.value, frozen.user_attrs.get("wall_s", 0))
        if on_trial is not None:
            on_trial(frozen)
    return ran


def _claim(study: optuna.Study, trials: Sequence[FrozenTrial], enqueue: Mapping[str, float] | None,
           interval: int | None) -> Trial:
    """Create the next trial (under the claim lock), marked with the process that runs it."""
    if enqueue is not None and not any(t.user_attrs.get("enqueued") and counts_toward_total(t) for t in trials):
        study.enqueue_trial(dict(enqueue), user_attrs={"enqueued": True})
    with warnings.catch_warnings():  # run_trials beats the heartbeat itself (study.optimize's job)
        warnings.filterwarnings("ignore", "Heartbeat of storage", UserWarning)
        trial = study.ask()
    trial.set_user_attr("process", process_identity())
    if interval:
        study._storage.record_heartbeat(trial._trial_id)  # noqa: SLF001 - before the lock is released
    return trial


# --- results --------------------------------------------------------------------------------------------


def summarize(study: optuna.Study) -> dict:
    """Counts, the best trial, the enqueued (default) trial and the trials' wall seconds."""
    trials = study.get_trials(deepcopy=False)
    by_state = {s.name.lower(): sum(t.state == s for t in trials) for s in
                (TrialState.COMPLETE, TrialState.PRUNED, TrialState.FAIL, TrialState.RUNNING)}
    complete = [t for t in trials if t.state == TrialState.COMPLETE]
    walls = [t.user_attrs["wall_s"] for t in complete if "wall_s" in t.user_attrs]
    calibrating = [t.user_attrs["calibrate_s"] for t in complete if "calibrate_s" in t.user_attrs]
    out: dict = {"study": study.study_name, "trials": by_state}
    if complete:
        best = study.best_trial
        out["best"] = {"trial": best.number, "dev_avg": round(best.value, 6), "params": best.params,
                       "dev": best.user_attrs.get("dev", {})}
    default = next((t for t in complete if t.user_attrs.get("enqueued")), None)
    if default is not None:
        out["default"] = {"trial": default.number, "dev_avg": round(default.value, 6), "params": default.params}
    if walls:
        out["trial_wall_s"] = {"mean": round(statistics.fmean(walls), 3), "median": round(statistics.median(walls), 3),
                               "min": min(walls), "max": max(walls)}
    if calibrating:   # the calibration alone, comparable to one calibrate-layer@* chain
        out["trial_calibrate_s"] = {"mean": round(statistics.fmean(calibrating), 3),
                                    "median": round(statistics.median(calibrating), 3)}
    return out


def best_values(study: optuna.Study, base: FeatCalConfig) -> dict[str, float]:
    """α, ρ, λ of the best complete trial; a hyperparameter not searched keeps its `base` value."""
    if not any(t.state == TrialState.COMPLETE for t in study.get_trials(deepcopy=False)):
        raise RuntimeError(f"study {study.study_name!r} has no complete trial yet")
    params = study.best_trial.params
    return {k: float(params.get(k, getattr(base, k))) for k in HYPER_KEYS}


def write_best(path: str | os.PathLike, study: optuna.Study, base: FeatCalConfig) -> dict:
    """Write `featcal: {alpha, rho, ridge}` (the best trial's values) plus where they came from."""
    summary = summarize(study)
    doc = {"featcal": best_values(study, base),
           "study": {"name": study.study_name, "best_trial": summary["best"]["trial"],
                     "dev_avg": summary["best"]["dev_avg"], "trials": summary["trials"]}}
    header = ("# Written by featcal.tune.write_best: the best trial's values (highest mean dev accuracy).\n"
              "# With featcal.use_tuned: true, calibrate-layer@* read featcal.alpha/rho/ridge from here.\n")
    with atomic_file(path) as tmp:
        tmp.write_text(header + yaml.safe_dump(doc, sort_keys=False))
    return doc


def copy_to_sqlite(study: optuna.Study, path: str | os.PathLike) -> None:
    """Snapshot a study (e.g. a PostgreSQL one) into a fresh sqlite file."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.unlink(missing_ok=True)
    optuna.copy_study(from_study_name=study.study_name, from_storage=study._storage,  # noqa: SLF001
                      to_storage=f"sqlite:///{tmp}")
    os.replace(tmp, path)


# --- from a params mapping (params.yaml) -----------------------------------------------------------------


@dataclass
class TuneSettings:
    n_trials: int = 24
    seed: int = 0
    study_name: str = DEFAULT_STUDY
    storage: str | None = None
    startup_trials: int = 8
    enqueue_defaults: bool = True
    search: SearchSpace = field(default_factory=SearchSpace)
    prune_after_layers: tuple[int, ...] = ()
    prune_startup_trials: int = 5

    @classmethod
    def from_mapping(cls, values: Mapping | None) -> "TuneSettings":
        values = dict(values or {})
        known = {f.name for f in dataclasses.fields(cls)}
        bad = set(values) - known
        if bad:
            raise ValueError(f"tune params: unknown keys {sorted(bad)}; known keys {sorted(known)}")
        if "search" in values:
            values["search"] = SearchSpace.from_mapping(values["search"] or {})
        if "prune_after_layers" in values:
            values["prune_after_layers"] = tuple(int(k) for k in values["prune_after_layers"] or ())
        settings = cls(**values)
        if isinstance(settings.n_trials, bool) or not isinstance(settings.n_trials, int) or settings.n_trials < 1:
            raise ValueError(f"tune.n_trials must be an integer >= 1, got {settings.n_trials!r}")
        refuse_password(settings.storage, "tune.storage")
        return settings


def featcal_config(params: Mapping) -> FeatCalConfig:
    """The `featcal` section (its pipeline switch `use_tuned` is ignored)."""
    return FeatCalConfig.from_mapping(params.get("featcal") or {})


def _enabled_tasks(params: Mapping) -> list[str]:
    return [name for name, spec in params["tasks"].items() if (spec or {}).get("enabled", True)]


def _max_length(params: Mapping, task: str) -> int:
    tokens = params["tokens"]
    return int((tokens.get("per_task") or {}).get(task, tokens["max_length"]))


@dataclass
class TuneOutcome:
    study: optuna.Study
    ran: list[int]
    existing: int
    summary: dict
    best: dict | None = None


def tune_from_params(
    params: Mapping,
    *,
    storage: str | None = None,
    n_trials: int | None = None,
    study_name: str | None = None,
    best_path: str | os.PathLike | None = None,
    summary_path: str | os.PathLike | None = None,
    snapshot_path: str | os.PathLike | None = None,
    root: str | os.PathLike = ".",
) -> TuneOutcome:
    """Bring the study up to `n_trials` (default `tune.n_trials`) on the project at `root`.

    Storage: `storage`, else $FEATCAL_TUNE_STORAGE, else `tune.storage`, else sqlite under
    `tune/study.db`. Optionally writes the best values (`best_path`), a JSON summary and, for a
    non-sqlite storage, a sqlite snapshot of the study (`snapshot_path`).
    """
    root = Path(root)
    settings = TuneSettings.from_mapping(params.get("tune"))
    base_config = featcal_config(params)
    url = storage or os.environ.get("FEATCAL_TUNE_STORAGE") or settings.storage or DEFAULT_STORAGE
    name = study_name or settings.study_name
    total = n_trials if n_trials is not None else settings.n_trials
    if isinstance(total, bool) or not isinstance(total, int) or total < 1:
        raise ValueError(f"n_trials (--n-trials) must be an integer >= 1, got {total!r}")
    rdb = make_storage(url)   # an empty or damaged study file fails here, before any model loads
    tasks = _enabled_tasks(params)
    problem = load_problem(base=params["model"]["base"], tasks=tasks,
                           max_length={t: _max_length(params, t) for t in tasks},
                           batch_size=int(params["calibration"]["batch_size"]),
                           merged=root / "models/merged", experts_dir=root / "experts",
                           features=root / "features/experts", tasks_dir=root / params.get("tasks_dir", "data/tasks"))
    fingerprint = problem.fingerprint(base_config, settings.search)
    pruner = (optuna.pruners.MedianPruner(n_startup_trials=settings.prune_startup_trials)
              if settings.prune_after_layers else None)
    study = open_study(rdb, name, fingerprint=fingerprint, pruner=pruner)
    study.set_user_attr("dev_dropped", {t: d.dropped for t, d in problem.dev.items()})
    existing = count_trials(study)
    log.info("study %r in %s: %d trials counted, target %d", name, redacted(url), existing, total)
    defaults = {k: getattr(base_config, k) for k in settings.search.ranges}
    enqueue = defaults if settings.enqueue_defaults and settings.search.contains(defaults) else None
    if settings.enqueue_defaults and enqueue is None:
        log.warning("the featcal defaults %s lie outside tune.search: not enqueued", defaults)
    objective = make_objective(problem, settings.search, base_config, settings.prune_after_layers)
    ran = run_trials(study, objective, total, seed=settings.seed, startup_trials=settings.startup_trials,
                     lock=ClaimLock(url, name), enqueue=enqueue)
    summary = summarize(study)
    summary.update({"storage": redacted(url), "target": total, "ran_now": len(ran)})
    best = write_best(root / best_path, study, base_config) if best_path else None
    if summary_path:
        write_json(root / summary_path, summary)
    if snapshot_path:
        snapshot = root / snapshot_path
        parsed = sqlalchemy.engine.make_url(url)
        same = parsed.get_backend_name() == "sqlite" and parsed.database and \
            Path(parsed.database).resolve() == snapshot.resolve()
        if not same:
            copy_to_sqlite(study, snapshot)
    return TuneOutcome(study, ran, existing, summary, best)


def positive_int(text: str) -> int:
    """argparse type: an integer >= 1 (a total of trials)."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected an integer >= 1, got {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"expected an integer >= 1, got {value}")
    return value


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--params", default="params.yaml", help="params file (tasks, tokens, calibration, featcal, tune)")
    parser.add_argument("--storage", help=f"SQLAlchemy URL of the study (default: tune.storage, else {DEFAULT_STORAGE})")
    parser.add_argument("--n-trials", type=positive_int, help="total trials wanted in the study (default: tune.n_trials)")
    parser.add_argument("--study-name", help=f"study name (default: tune.study_name, else {DEFAULT_STUDY})")


def run_cli(args: argparse.Namespace, best_path=None, summary_path=None, snapshot_path=None) -> TuneOutcome:
    params = yaml.safe_load(Path(args.params).read_text(encoding="utf-8")) or {}
    outcome = tune_from_params(params, storage=args.storage, n_trials=args.n_trials, study_name=args.study_name,
                               best_path=best_path, summary_path=summary_path, snapshot_path=snapshot_path)
    best = outcome.summary.get("best", {})
    print(f"study {outcome.study.study_name}: ran {len(outcome.ran)} new trials {outcome.ran}, "
          f"{outcome.summary['trials']['complete']} complete; best trial {best.get('trial')} "
          f"dev {best.get('dev_avg')} {best.get('params')}")
    return outcome
