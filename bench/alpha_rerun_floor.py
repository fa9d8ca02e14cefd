"""Benchmark (not a test): the least an α experiment through DVC can cost on the demo, whatever the stages do.

`bench/alpha_rerun.py` measures `dvc exp run -S featcal.alpha=<new>` against one in-process calibration
plus test scoring (issue 11's goal: <= 1.3). This measures, side by side in one run, the parts of that
experiment no stage code can remove:

(a) DVC's own time. In a clone of this repository (git clone; the demo's outputs checked out from this
    project's DVC cache) the six `calibrate-layer@*` commands and `evaluate` are replaced by a writer
    that puts random bytes of exactly the demo's output sizes and file counts in place (random, so
    every output is a new object to hash and cache, as a new α makes it; bench/stand_in_stage.py). `dvc exp run -S
    featcal.alpha=<new>` there re-runs the same seven stages; its wall time minus the writers' own
    time is what DVC spends starting, checking, hashing, caching and rewriting dvc.lock;
(b) what `evaluate` must do beyond scoring: the calibrated model's per-layer drift on test (issue 11,
    item 4), timed here on the merged model (same shapes, same cost);
(c) what a plain `dvc exp run` adds per stage: a fresh interpreter importing the calibrate stage
    (torch, transformers, featcal), median of three;
(d) the in-process reference, as `bench/alpha_rerun.py` measures it.

floor (make exp, stages forked warm) = (d + a + b) / d; floor (plain dvc exp run) adds 7 x (c).
The figures are merged into results/bench.json under `alpha_rerun_floor`. Needs `make repro` first
and a clean `git status` for the tracked files (the clone takes the last commit).
Run: python bench/alpha_rerun_floor.py
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import shlex
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import yaml

from alpha_rerun import (ROOT, RATIO_GOAL, dvc, in_process, merge_json, project_env, require_alpha_in_params,
                         require_demo, require_up_to_date, run_cache_set_aside)

STAND_IN = Path(__file__).resolve().parent / "stand_in_stage.py"
CALIBRATE, EVALUATE = "calibrate-layer", "evaluate"
TEXT_SUFFIXES = (".json", ".png")   # outputs copied as they are (DVC reads metrics and plots)


# --- (a) the experiment with stand-in stages ---------------------------------------------------------------


def output_files(out: str) -> list[tuple[str, int | str]]:
    """Every file under the demo's output `out` with its size (text outputs: the file to copy)."""
    root = ROOT / out
    paths = [root] if root.is_file() else sorted(p for p in root.rglob("*") if p.is_file())
    return [(str(p.relative_to(ROOT)), str(p) if p.suffix in TEXT_SUFFIXES else p.stat().st_size) for p in paths]


def stage_outputs(lock: dict, stage: str) -> list[str]:
    return [o["path"] for o in lock["stages"][stage]["outs"]]


def stand_in_pipeline(clone: Path, work: Path) -> list[str]:
    """Point the calibrate and evaluate commands of `clone`'s dvc.yaml at the writer, one spec per stage;
    returns the stages replaced."""
    lock = yaml.safe_load((ROOT / "dvc.lock").read_text())
    replaced = sorted(s for s in lock["stages"] if s.startswith(f"{CALIBRATE}@") or s == EVALUATE)
    log = work / "writers.log"
    for stage in replaced:
        files = [f for out in stage_outputs(lock, stage) for f in output_files(out)]
        (work / f"{stage}.json").write_text(json.dumps({"stage": stage, "log": str(log), "files": files}))
    pipeline = yaml.safe_load((clone / "dvc.yaml").read_text())
    # the stand-in's interpreter start (~0.05 s a stage) counts as DVC's
    writer = f"{shlex.quote(sys.executable)} {shlex.quote(str(STAND_IN))} {shlex.quote(str(work))}"
    pipeline["stages"][CALIBRATE]["do"]["cmd"] = f"{writer}/{CALIBRATE}@${{key}}.json"
    pipeline["stages"][EVALUATE]["cmd"] = f"{writer}/{EVALUATE}.json"
    (clone / "dvc.yaml").write_text(yaml.safe_dump(pipeline, sort_keys=False))
    return replaced


def clone_demo(clone: Path) -> None:
    """A git clone of the last commit sharing this project's DVC cache, the demo's outputs checked out
    (hard links for speed, then the demo's own link type for what the experiment saves). Only the root
    dvc.yaml's, which `dvc repro` and `dvc exp run` take by default: llm/ and mpnet/ have pipelines of
    their own, whose outputs need not be in this machine's cache."""
    subprocess.run(["git", "clone", "-q", str(ROOT), str(clone)], check=True)
    cache = dvc("cache", "dir").stdout.strip()
    for args in (["config", "--local", "cache.dir", cache], ["config", "--local", "cache.type", "hardlink"],
                 ["checkout", "--quiet", "dvc.yaml"], ["config", "--local", "--unset", "cache.type"]):
        dvc(*args, cwd=clone)


def dvc_own_time(alpha: float) -> dict:
    """(a): the experiment with stand-in stages in a clone; DVC's time = wall - the writers' time."""
    with tempfile.TemporaryDirectory(prefix="featcal-floor-") as tmp:
        clone, work = Path(tmp) / "clone", Path(tmp) / "work"
        work.mkdir()
        clone_demo(clone)
        replaced = stand_in_pipeline(clone, work)
        dvc("repro", "--quiet", cwd=clone)          # the stand-in commands recorded once (the demo's α)
        subprocess.run(["git", "commit", "-qam", "stand-in stages"], cwd=clone, check=True)
        (work / "writers.log").write_text("")
        with run_cache_set_aside(Path(tmp) / "runs"):
            start = time.perf_counter()
            dvc("exp", "run", "-S", f"featcal.alpha={alpha}", cwd=clone)
            wall = time.perf_counter() - start
        writers = dict(line.split() for line in (work / "writers.log").read_text().splitlines())
    if sorted(writers) != replaced:
        raise SystemExit(f"alpha_rerun_floor: the experiment ran {sorted(writers)}, expected {replaced}")
    written = sum(float(v) for v in writers.values())
    return {"stages": replaced, "exp_run_wall_s": round(wall, 2), "writers_s": round(written, 2),
            "dvc_own_s": round(wall - written, 2)}


# --- (b) drift, (c) imports -----------------------------------------------------------------------------------


def drift_cost(params: dict) -> float:
    """(b): `evaluate`'s drift measurement (stages/evaluate_merged.drift_on_test), on the merged model."""
    from common import enabled_tasks
    from evaluate_merged import drift_on_test

    from featcal.io.models import load_backbone

    backbone = load_backbone("models/merged")
    start = time.perf_counter()
    drift_on_test(backbone, enabled_tasks(params), "features/test")
    return time.perf_counter() - start


def import_cost(repeats: int = 3) -> float:
    """(c): a fresh interpreter importing the calibrate stage (what every cold stage start pays)."""
    code = f"import sys; sys.path.insert(0, {str(ROOT / 'stages')!r}); import calibrate_layer"
    walls = []
    for _ in range(repeats):
        start = time.perf_counter()
        subprocess.run([sys.executable, "-c", code], env=project_env(), check=True)
        walls.append(time.perf_counter() - start)
    return statistics.median(walls)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--alpha", type=float, default=0.5, help="the new featcal.alpha of the experiment")
    p.add_argument("--out", type=Path, default=Path("results/bench.json"), help="figures file, relative to the project")
    args = p.parse_args()
    os.chdir(ROOT)
    require_demo()
    from common import load_params

    params = load_params()
    require_alpha_in_params(params)
    require_up_to_date("before the benchmark", "run `make repro` first")
    if subprocess.run(["git", "diff", "--quiet", "HEAD", "--", "dvc.yaml", "dvc.lock", "params.yaml"]).returncode:
        raise SystemExit("alpha_rerun_floor: dvc.yaml, dvc.lock or params.yaml differ from the last commit, "
                         "which the clone takes; commit them first")

    print("(a) dvc exp run with stand-in stages, in a clone", flush=True)
    own = dvc_own_time(args.alpha)
    print("(b) evaluate's drift measurement", flush=True)
    drift_s = drift_cost(params)
    print("(c) a cold stage's imports", flush=True)
    import_s = import_cost()
    print("(d) in-process calibration + test scoring", flush=True)
    inproc = in_process(params, args.alpha)
    inproc_s = inproc["calibrate"]["wall_s"] + inproc["score"]["wall_s"]
    n_stages = len(own["stages"])
    warm = (inproc_s + own["dvc_own_s"] + drift_s) / inproc_s
    cold = (inproc_s + own["dvc_own_s"] + drift_s + n_stages * import_s) / inproc_s

    print()
    print(f"(a) dvc exp run with {n_stages} stand-in stages: {own['exp_run_wall_s']:.1f} s, of which the writers "
          f"{own['writers_s']:.1f} s -> DVC's own {own['dvc_own_s']:.1f} s")
    print(f"(b) evaluate's drift measurement: {drift_s:.1f} s")
    print(f"(c) a cold stage's imports: {import_s:.2f} s (x {n_stages} = {n_stages * import_s:.1f} s)")
    print(f"(d) in process: calibrate {inproc['calibrate']['wall_s']:.1f} s + score {inproc['score']['wall_s']:.1f} s "
          f"= {inproc_s:.1f} s; the goal {RATIO_GOAL} leaves {(RATIO_GOAL - 1) * inproc_s:.1f} s for everything else")
    print(f"floor, make exp (warm stages): {warm:.2f}; floor, plain dvc exp run: {cold:.2f} (goal <= {RATIO_GOAL})")
    merge_json(args.out, {"alpha_rerun_floor": {
        "command": "python bench/alpha_rerun_floor.py", "alpha": args.alpha,
        "date": datetime.datetime.now().astimezone().isoformat(timespec="seconds"),
        "dvc_with_stand_in_stages": own, "drift_s": round(drift_s, 2), "cold_stage_import_s": round(import_s, 2),
        "in_process": inproc, "in_process_s": round(inproc_s, 2),
        "floor_warm_over_inprocess": round(warm, 3), "floor_cold_over_inprocess": round(cold, 3),
        "goal": RATIO_GOAL,
    }})
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
