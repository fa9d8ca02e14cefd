"""Where a study lives and how workers share it: Optuna RDB storage, claiming trials, resuming.

Studies live in any Optuna RDB storage (a SQLAlchemy URL: sqlite for one machine, PostgreSQL or
MySQL for several). `run_trials` brings a study up to a *total* number of trials, so running it
again with a larger total runs only the new trials, and several workers on one study stop at the
total exactly: each claims its next trial under a lock held in the database (PostgreSQL/MySQL
advisory lock) or on the machine (sqlite file lock). Trials of a worker that died are found by
their stopped heartbeat, failed and replaced. `tune` puts it together for one problem
(`featcal.tuning.objective`); what to tune and where the files are is the caller's to say.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import logging
import math
import os
import socket
import statistics
import threading
import time
import warnings
import dataclasses
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Callable, Iterator, Mapping, Sequence

import numpy as np
import optuna
import sqlalchemy
import yaml
from optuna.trial import FrozenTrial, Trial, TrialState

if TYPE_CHECKING:   # torch comes with these: a worker that only shares a study does without
    from featcal.calibration.config import FeatCalConfig
    from torch import nn
    from featcal.tuning.objective import AnchorSearch, SearchSpace, TuneProblem

log = logging.getLogger(__name__)

DEFAULT_STUDY = "featcal-dev"
HEARTBEAT_S = 20            # a live worker touches its running trial this often
GRACE_S = 60                # a running trial untouched this long belongs to a dead worker


class StudyMismatchError(RuntimeError):
    """The study's trials were scored on other inputs than the ones loaded now."""


class StudyStorageError(RuntimeError):
    """The study's storage (e.g. tune/study.db) is empty or damaged: its trials cannot be trusted."""


SQLITE_HEADER = b"SQLite format 3\x00"


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
    except (sqlalchemy.exc.DatabaseError, optuna.exceptions.StorageInternalError) as err:
        # optuna wraps a database error met inside a commit; the database's own words are its cause
        inner = err.__cause__ if isinstance(err, optuna.exceptions.StorageInternalError) and err.__cause__ else err
        inner = getattr(inner, "orig", None) or inner
        path = sqlite_path(url) if url else None
        where = f"study file {path}" if path else f"study storage {redacted(url or '')}"
        cause = f"{type(inner).__name__}: {str(inner)[:200]}"
        if "locked" in str(inner).lower():   # another worker holds it: nothing is damaged
            raise StudyStorageError(f"{where} is locked by another process ({cause}): a worker or a study still "
                                    "running? Wait for it to finish or stop it, then run again; the file is "
                                    "not damaged, do not delete it") from None
        fix = _storage_fix(path) if path else "repair or restore the database"
        raise StudyStorageError(f"{where} cannot be read ({cause}); {fix}") from None


def _url(study: optuna.Study) -> str | None:
    storage = getattr(study, "_storage", None)
    return getattr(getattr(storage, "_backend", storage), "url", None)   # optuna caches an RDBStorage


def complete_trials(study: optuna.Study, trials: Sequence[FrozenTrial] | None = None) -> list[FrozenTrial]:
    """The study's complete trials, each checked against what it recorded: a trial's value is the
    mean of its per-task dev scores (`dev`, 6 digits). A stored value that is not (a flipped bit, an
    edit) would make a wrong trial the best, so it is an error naming the trial and the file; a
    file damaged in another way is reported by name too."""
    url = _url(study)
    if trials is None:   # `trials`: the study's, already read by the caller
        with _readable_storage(url):
            trials = study.get_trials(deepcopy=False)
    trials = [t for t in trials if t.state == TrialState.COMPLETE]
    for trial in trials:
        dev = trial.user_attrs.get("dev")
        if isinstance(dev, dict) and dev and all(isinstance(v, (int, float)) for v in dev.values()):
            mean = statistics.fmean(dev.values())
            if trial.value is None or not abs(trial.value - mean) <= 1e-6:
                path = sqlite_path(url) if url else None
                where = f"study file {path}" if path else f"study storage {redacted(url or '')}"
                fix = _storage_fix(path) if path else "restore the database"
                raise StudyStorageError(
                    f"{where}: study {study.study_name!r}, trial {trial.number}: its value {trial.value} is not the "
                    f"mean of the dev scores it recorded ({mean:.6f}): the file was changed after the trial ran "
                    f"(damaged or edited), and its best trial cannot be trusted; {fix}")
    return trials


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
    with _readable_storage(_url(study)):
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


RERANK = "rerank"   # study attribute: {"top_k": k, "dev": {trial number: {task: exact dev}}, "chosen": number,
#                     "wall_s": {trial number: seconds its exact build and dev scoring took}}


def rerank(study: optuna.Study, top_k: int, build: Callable[[FrozenTrial], object],
           score: Callable[[object], Mapping[str, float]]) -> tuple[FrozenTrial, object | None]:
    """A reduced search's last rung: its `top_k` best trials by the score they were searched with (fewer
    examples, float32), each built again the way what leaves the study is (`build`: calibrated or
    trained on every example in the exact path) and scored on dev (`score`), and the best of those
    chosen (`chosen_trial`). The cheap trials rank; the rung decides among the few they rank highest, so
    a ranking that is right only roughly need not pick its own first. The exact scores are kept in the
    study: a resumed study scores no trial twice, and a larger study reranks its new top `top_k`.
    Returns the chosen trial and its model where this call built it (else None; one model is held)."""
    if isinstance(top_k, bool) or not isinstance(top_k, int) or top_k < 1:
        raise ValueError(f"tune.rerank_top_k must be an integer >= 1 to rerank, got {top_k!r}")
    ranked = sorted(complete_trials(study), key=lambda t: (-t.value, t.number))[:top_k]
    if not ranked:
        raise RuntimeError(f"study {study.study_name!r} has no complete trial to rerank")
    exact = reranked_dev(study)
    seconds = {int(n): s for n, s in study.user_attrs.get(RERANK, {}).get("wall_s", {}).items()}
    best: tuple[float, int, object] | None = None   # the best model built here: (mean dev, trial, model)
    for trial in ranked:
        if trial.number not in exact:
            start = time.perf_counter()
            model = build(trial)
            exact[trial.number] = {t: round(float(v), 6) for t, v in score(model).items()}
            seconds[trial.number] = round(time.perf_counter() - start, 3)
            mean = statistics.fmean(exact[trial.number].values())
            log.info("rerank: trial %d, dev %.4f searched, %.4f exact", trial.number, trial.value, mean)
            if best is None or mean > best[0]:
                best = (mean, trial.number, model)
            del model
            _record_rerank(study, top_k, exact, None, seconds)   # each score kept as it is made
    chosen = max(ranked, key=lambda t: (statistics.fmean(exact[t.number].values()), t.value, -t.number))
    _record_rerank(study, top_k, exact, chosen.number, seconds)
    return chosen, best[2] if best is not None and best[1] == chosen.number else None


def _record_rerank(study: optuna.Study, top_k: int, exact: Mapping[int, Mapping[str, float]],
                   chosen: int | None, seconds: Mapping[int, float] | None = None) -> None:
    """The rung's record; `seconds` None keeps the recorded ones."""
    if seconds is None:
        seconds = {int(n): s for n, s in study.user_attrs.get(RERANK, {}).get("wall_s", {}).items()}
    study.set_user_attr(RERANK, {"top_k": top_k, "dev": {str(n): dict(d) for n, d in sorted(exact.items())},
                                 "chosen": chosen, "wall_s": {str(n): s for n, s in sorted(seconds.items())}})


def reranked_dev(study: optuna.Study) -> dict[int, dict[str, float]]:
    """Trial number -> its exact dev scores per task, for the trials a rerank scored."""
    return {int(n): dict(d) for n, d in study.user_attrs.get(RERANK, {}).get("dev", {}).items()}


def chosen_trial(study: optuna.Study) -> FrozenTrial:
    """The trial whose values leave the study: a rerank's choice where the last run reranked
    (`rerank`), else the best trial by its dev score."""
    chosen = study.user_attrs.get(RERANK, {}).get("chosen")
    if chosen is None:
        return study.best_trial
    for trial in study.get_trials(deepcopy=False, states=(TrialState.COMPLETE,)):
        if trial.number == chosen:
            return trial
    raise RuntimeError(f"study {study.study_name!r}: the reranked trial {chosen} is not a complete trial")


def summarize(study: optuna.Study) -> dict:
    """Counts, the best trial, the enqueued (default) trial and the trials' wall seconds."""
    with _readable_storage(_url(study)):
        trials = study.get_trials(deepcopy=False)
    by_state = {s.name.lower(): sum(t.state == s for t in trials) for s in
                (TrialState.COMPLETE, TrialState.PRUNED, TrialState.FAIL, TrialState.RUNNING)}
    complete = complete_trials(study, trials)   # every recorded value checked before a best is named
    walls = [t.user_attrs["wall_s"] for t in complete if "wall_s" in t.user_attrs]
    calibrating = [t.user_attrs["calibrate_s"] for t in complete if "calibrate_s" in t.user_attrs]
    out: dict = {"study": study.study_name, "trials": by_state}
    if complete:
        best = chosen_trial(study)
        out["best"] = {"trial": best.number, "dev_avg": round(best.value, 6), "params": best.params,
                       "dev": best.user_attrs.get("dev", {})}
        ranked = study.user_attrs.get(RERANK, {})
        if ranked.get("chosen") is not None:   # the exact scores of the rung that chose it
            exact = reranked_dev(study)
            order = sorted((t for t in complete if t.number in exact), key=lambda t: (-t.value, t.number))
            # what the rung cost beside the trials (every exact build and scoring it made; a search's seconds)
            out["rerank"] = {"top_k": ranked["top_k"], "chosen": ranked["chosen"],
                             "wall_s": round(sum(ranked.get("wall_s", {}).values()), 3), "trials": [
                {"trial": t.number, "dev_avg": round(t.value, 6),
                 "exact_dev_avg": round(statistics.fmean(exact[t.number].values()), 6)}
                for t in order[:ranked["top_k"]]]}
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


def best_values(study: optuna.Study, base: FeatCalConfig) -> dict:
    """α, ρ, λ of the best complete trial (`chosen_trial`: a rerank's choice where one ran), and its
    `layer_overrides` when it searched blocks on their own (KEY@BLOCK) or `base` has some; a
    hyperparameter not searched keeps its `base` value."""
    if not complete_trials(study):
        raise RuntimeError(f"study {study.study_name!r} has no complete trial yet")
    from featcal.calibration.config import HYPER_KEYS
    from featcal.tuning.objective import AnchorSearch, config_with

    params = chosen_trial(study).params
    config = config_with(base, {k: float(v) for k, v in params.items() if not k.startswith(AnchorSearch.PREFIX)})
    out = {k: float(getattr(config, k)) for k in HYPER_KEYS}
    if config.layer_overrides:
        out["layer_overrides"] = {b: {k: float(v) for k, v in sorted(d.items())}
                                  for b, d in sorted(config.layer_overrides.items())}
    return out


def write_best(path: str | os.PathLike, study: optuna.Study, base: FeatCalConfig) -> dict:
    """Write `featcal: {alpha, rho, ridge[, layer_overrides]}` (the best trial's values to 12
    significant digits) plus where they came from.

    12 digits, not 17: DVC records the file's values in dvc.lock through ruamel, whose round trip of
    a 17-digit float in exponent form (a λ below 1e-4) moves its last digit; the lock would then
    never match the file and `dvc status` would call the calibration changed forever."""
    from featcal.io.models import atomic_file

    summary = summarize(study)
    values = best_values(study, base)
    overrides = values.pop("layer_overrides", {})
    featcal = {k: float(f"{v:.12g}") for k, v in values.items()}
    if overrides:   # per-block values (a KEY@BLOCK search), block -> {alpha, ...}
        featcal["layer_overrides"] = {b: {k: float(f"{v:.12g}") for k, v in d.items()} for b, d in overrides.items()}
    doc = {"featcal": featcal,
           "study": {"name": study.study_name, "best_trial": summary["best"]["trial"],
                     "dev_avg": summary["best"]["dev_avg"], "trials": summary["trials"]}}
    header = ("# Written by featcal.tuning.write_best: the best trial's values (highest mean dev accuracy;\n"
              "# after a rerank (tune.rerank_top_k), the highest recalibrated on every example).\n"
              "# With featcal.use_tuned: true, calibrate-layer@* read featcal.alpha/rho/ridge (and\n"
              "# layer_overrides, per block) from here.\n")
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


# --- one problem, one study ----------------------------------------------------------------------------


@dataclass(frozen=True)
class StudySettings:
    """How a study samples: seeds, TPE's random start, defaults first, pruning after given blocks."""

    seed: int = 0
    startup_trials: int = 8
    enqueue_defaults: bool = True
    prune_after_layers: tuple[int, ...] = ()
    prune_startup_trials: int = 5
    # a search mode: the trials' moment products in this dtype (e.g. "float32": the ranking is what
    # a search needs); None: the base config's. The best trial's values are calibrated again in the
    # base config's (exact) path for whatever is written or scored on test (docs/tuning.md).
    trial_product_dtype: str | None = None
    # a search mode: each trial calibrates on each task's first N calibration examples (cheaper trials,
    # a noisier ranking); None: all of them. Whatever leaves the study is calibrated on all of them.
    trial_examples_per_task: int | None = None
    # a reduced search's last rung (`rerank`): its K best trials calibrated again exactly (every
    # example, the base config's precision) and scored on dev, the best of those leaving the study;
    # 0: the best trial leaves as it is. No effect on a search in the exact path.
    rerank_top_k: int = 0


@dataclass
class TuneOutcome:
    study: optuna.Study
    ran: list[int]
    existing: int
    summary: dict
    # what leaves the study, where this run built it already: the rung's exact model (FeatCal's calibrated
    # backbone, a baseline's trained modules) of the chosen trial; None: build it from the chosen values
    deployed: object | None = None


def tune(problem: TuneProblem, base: FeatCalConfig, space: SearchSpace, storage: str, study_name: str,
         n_trials: int, settings: StudySettings = StudySettings(), anchor: AnchorSearch | None = None,
         check_fingerprint: bool = True) -> TuneOutcome:
    """Bring the study `study_name` in `storage` up to `n_trials` trials of `problem`, searching
    `space` around `base` (the values not searched, and the defaults tried first) and, with
    `anchor`, the anchor merge's knobs too. `check_fingerprint=False` only for a study that runs
    no trial (re-scoring its best, checked against its record instead)."""
    if isinstance(n_trials, bool) or not isinstance(n_trials, int) or n_trials < 1:
        raise ValueError(f"n_trials must be an integer >= 1, got {n_trials!r}")
    rdb = make_storage(storage)   # an empty or damaged study file fails here
    # what every trial calibrates with: the base, or its reduced-precision search mode
    trial_base = dataclasses.replace(base, product_dtype=settings.trial_product_dtype) \
        if settings.trial_product_dtype else base
    pruner = (optuna.pruners.MedianPruner(n_startup_trials=settings.prune_startup_trials)
              if settings.prune_after_layers else None)
    study = open_study(rdb, study_name, pruner=pruner,
                       fingerprint=problem.fingerprint(trial_base, space, anchor, settings.trial_examples_per_task)
                       if check_fingerprint else None)
    study.set_user_attr("dev_dropped", {t: d.dropped for t, d in problem.dev.items()})
    existing = count_trials(study)
    log.info("study %r in %s: %d trials counted, target %d", study_name, redacted(storage), existing, n_trials)
    beyond = sorted(b for b in space.blocks() if b >= problem.n_blocks)
    if beyond:
        raise ValueError(f"tune.search: no block {beyond[0]}; the model has {problem.n_blocks} blocks, "
                         f"0..{problem.n_blocks - 1} (the pooler follows the plain key)")
    defaults = space.defaults(base)
    anchor_defaults = anchor.defaults() if anchor is not None else {}
    inside = space.contains(defaults) and (anchor is None or bool(anchor_defaults))
    enqueue = {**defaults, **anchor_defaults} if settings.enqueue_defaults and inside else None
    if settings.enqueue_defaults and enqueue is None:
        log.warning("the defaults %s lie outside the search space: not enqueued", {**defaults, **anchor_defaults})
    from featcal.tuning.objective import AnchorSearch, config_with, make_objective

    if settings.trial_examples_per_task is not None:   # more than the sample holds: refused before any trial
        problem.calibration_batches(settings.trial_examples_per_task)
    objective = make_objective(problem, space, trial_base, settings.prune_after_layers, anchor,
                               settings.trial_examples_per_task)
    with _readable_storage(storage):   # a file locked or damaged mid-study: said in one line
        ran = run_trials(study, objective, n_trials, seed=settings.seed, startup_trials=settings.startup_trials,
                         lock=ClaimLock(storage, study_name), enqueue=enqueue)
        reduced = trial_base.product_dtype != base.product_dtype or settings.trial_examples_per_task is not None
        deployed = None
        if settings.rerank_top_k and reduced:
            def exactly(trial: FrozenTrial) -> nn.Module:
                config = config_with(base, {k: v for k, v in trial.params.items() if not k.startswith(AnchorSearch.PREFIX)})
                merged = problem.merged_with(anchor, anchor.options_of(trial.params)) if anchor is not None else None
                return problem.calibrate(config, merged=merged)

            _, deployed = rerank(study, settings.rerank_top_k, exactly, problem.score)
        elif study.user_attrs.get(RERANK, {}).get("chosen") is not None:   # no rung this time: the best leaves
            _record_rerank(study, study.user_attrs[RERANK]["top_k"], reranked_dev(study), None)
    summary = summarize(study)
    summary.update({"storage": redacted(storage), "target": n_trials, "ran_now": len(ran)})
    if settings.trial_examples_per_task is not None:
        summary["trial_examples_per_task"] = settings.trial_examples_per_task
    if settings.trial_product_dtype:
        summary["trial_product_dtype"] = settings.trial_product_dtype
    return TuneOutcome(study, ran, existing, summary, deployed)


def snapshot_to_sqlite(study: optuna.Study, storage: str, path: str | os.PathLike) -> None:
    """A sqlite copy of the study at `path`, unless the study already lives in that very file."""
    parsed = sqlalchemy.engine.make_url(storage)
    if parsed.get_backend_name() == "sqlite" and parsed.database and \
            Path(parsed.database).resolve() == Path(path).resolve():
        return
    copy_to_sqlite(study, path)
