"""DVC stage `prepare`: task sources -> data/tasks/<task>/{train,dev,test}.parquet + labels.json.

Reads params `tasks` (task name -> spec, see featcal.data.tasks.TaskSpec; `enabled: false` skips one)
and `seed` (default 0), and prints one summary line per task.

    python stages/prepare.py [--params params.yaml] [--out data/tasks] [--only TASK ...]
"""

from __future__ import annotations

import argparse
import logging
import os
import sys
from pathlib import Path

from warm_start import start_stage

start_stage()   # the stage environment; returns unless a warm interpreter ran this stage (stages/warm_start.py)

import yaml  # noqa: E402
from tqdm import tqdm  # noqa: E402
from tqdm.contrib.logging import logging_redirect_tqdm  # noqa: E402

from featcal.data.tasks import TaskSpec, load_task_frame, split_task, summarize, write_task  # noqa: E402


def read_specs(params_path: Path) -> tuple[list[TaskSpec], int]:
    """All task specs (validated, enabled or not) and the seed from a params file."""
    if not params_path.is_file():
        raise SystemExit(f"params file {params_path} not found")
    params = yaml.safe_load(params_path.read_text(encoding="utf-8")) or {}
    tasks = params.get("tasks")
    if not isinstance(tasks, dict) or not tasks:
        raise SystemExit(f"{params_path}: key 'tasks' must be a non-empty mapping task name -> spec")
    seed = params.get("seed", 0)
    if isinstance(seed, bool) or not isinstance(seed, int):
        raise SystemExit(f"{params_path}: key 'seed' must be an integer, found {seed!r}")
    try:
        specs = [TaskSpec.from_mapping(str(name), spec) for name, spec in tasks.items()]
    except ValueError as err:
        raise SystemExit(f"{params_path}: {err}") from err
    return specs, seed


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--params", type=Path, default=Path("params.yaml"))
    parser.add_argument("--out", type=Path, default=Path("data/tasks"))
    parser.add_argument("--only", nargs="+", metavar="TASK", help="prepare only these tasks")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")

    if "DVC_STAGE" in os.environ:   # as a pipeline stage: the whole params file and the chain are checked
        from common import load_params

        load_params(args.params)
    specs, seed = read_specs(args.params)
    if args.only:
        unknown = sorted(set(args.only) - {s.name for s in specs})
        if unknown:
            raise SystemExit(f"--only: tasks {unknown} are not in {args.params}")
        specs = [s for s in specs if s.name in args.only]
    for spec in specs:
        if not spec.enabled:
            print(f"{spec.name}: skipped (enabled: false)")
    specs = [s for s in specs if s.enabled]

    with logging_redirect_tqdm():
        for spec in tqdm(specs, desc="prepare", unit="task", file=sys.stderr):
            try:
                frame = load_task_frame(spec)
                splits = split_task(frame, spec, seed=seed)
            except (ValueError, FileNotFoundError) as err:   # the task's data: one line naming task and file
                raise SystemExit(f"prepare: {err}") from None
            labels = frame.attrs["classes"]
            write_task(splits, args.out / spec.name, labels, frame.attrs["raw_labels"], frame.attrs["dropped"])
            tqdm.write(summarize(spec.name, splits, labels), file=sys.stdout)
    return 0


if __name__ == "__main__":
    sys.exit(main())
