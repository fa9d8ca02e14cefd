"""Shared plumbing for the thin DVC entry points: params, timing, logging. No algorithm here."""

from __future__ import annotations

import argparse
import json
import logging
import os
import resource
import sys
import time
from contextlib import contextmanager
from pathlib import Path

import yaml
from warm_start import start_stage

start_stage()   # the stage environment; returns unless a warm interpreter ran this stage (stages/warm_start.py)

from featcal.data.splits import CalibrationSpec  # noqa: E402
from featcal.io.models import write_json  # noqa: E402
from featcal.profiling import phase_times  # noqa: E402
from params_schema import ParamsError, validate, validate_tuned  # noqa: E402

TIMING_DIR = Path("results/timing")
TUNED_SECTIONS = {"featcal", "study"}   # tune/best.yaml, written by featcal.tuning.write_best


def load_params(path: str | os.PathLike = "params.yaml", *, check_chain: bool | None = None) -> dict:
    """The params file, checked against the schema (stages/params_schema.py) before any model loads.

    A bad value ends the stage with one line naming the key, the value and what is allowed.
    `check_chain` (default: when DVC runs the stage) also compares stages/chain.yaml with the
    params, since DVC expanded this stage from it. The tune stage's tune/best.yaml (top-level
    `featcal` and `study` only) is read through here too: only its α, ρ, λ are checked.
    """
    path = Path(path)
    if not path.is_file():
        raise SystemExit(f"params file {path} not found (run from the project root)")
    try:
        raw = yaml.safe_load(path.read_text(encoding="utf-8")) or {}
    except yaml.YAMLError as err:
        raise SystemExit(f"{path}: not valid YAML: {err}") from None
    if check_chain is None:
        check_chain = "DVC_STAGE" in os.environ
    try:
        if isinstance(raw, dict) and set(raw) <= TUNED_SECTIONS and "study" in raw:
            validate_tuned(raw)
        else:
            validate(raw, path.parent, chain=check_chain)
    except ParamsError as err:
        raise SystemExit(f"{path}: {err}") from None
    return raw


def positive_int(text: str) -> int:
    """argparse type: an integer >= 1 (a total of trials)."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected an integer >= 1, got {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"expected an integer >= 1, got {value}")
    return value


def get(params: dict, dotted: str, default=...):
    """params['a']['b'] for 'a.b'; a missing key without default is an error naming it."""
    node = params
    for part in dotted.split("."):
        if not isinstance(node, dict) or part not in node:
            if default is ...:
                raise SystemExit(f"params.yaml: missing key {dotted!r}")
            return default
        node = node[part]
    return node


def enabled_tasks(params: dict) -> list[str]:
    tasks = get(params, "tasks")
    return [name for name, spec in tasks.items() if (spec or {}).get("enabled", True)]


def max_length(params: dict, task: str) -> int:
    tokens = get(params, "tokens")
    return int(tokens.get("per_task", {}).get(task, tokens["max_length"]))


def calibration_spec(params: dict, tasks: list[str]) -> CalibrationSpec:
    calib = get(params, "calibration")
    return CalibrationSpec(
        tasks_dir=get(params, "tasks_dir"), tasks=tasks, seed=int(get(params, "seed")),
        examples_per_task=int(calib["examples_per_task"]), batch_size=int(calib["batch_size"]),
        max_length={t: max_length(params, t) for t in tasks},
    )


def setup_logging() -> None:
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s", stream=sys.stderr)


@contextmanager
def timed(stage: str):
    """Record the stage's wall seconds and peak resident memory in results/timing/<stage>.json
    (under torchrun: rank 0's, so the ranks never write one file at once), and where a calibration
    ran, its seconds per phase (forwards, moment products, solve: `featcal.profiling.phase`)."""
    start = time.perf_counter()
    with phase_times() as phases:
        yield
    peak_mib = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    if os.environ.get("RANK", "0") != "0":
        return
    record = {"stage": stage, "wall_s": round(time.perf_counter() - start, 2), "peak_rss_mib": round(peak_mib, 1)}
    if phases:
        record["phases_s"] = {name: round(seconds, 2) for name, seconds in phases.items()}
    write_json(TIMING_DIR / f"{stage}.json", record)


def read_json(path) -> dict:
    return json.loads(Path(path).read_text())


@contextmanager
def live_log(directory: str | os.PathLike):
    """A DVCLive logger writing `directory`/metrics.json and `directory`/plots/metrics/*.tsv, which
    dvc.yaml declares as the stage's metrics and plots: no experiment of its own and no edit of
    dvc.yaml (the pipeline owns both), so `dvc exp show` and `dvc plots` read it like any metric."""
    from dvclive import Live   # only the stages that log pay for the import

    with Live(dir=str(directory), save_dvc_exp=False, dvcyaml=False) as live:
        yield live


def log_step(live, step: int, metrics: dict[str, float]) -> None:
    """One row per metric at `step` (an epoch, a trial number) in a `live_log` logger."""
    live.step = step
    for name, value in metrics.items():
        live.log_metric(name, value)
    live.next_step()
