"""Benchmark (not a test): what an α experiment costs through DVC vs in one process, on the demo.

Issue 11 asks that changing α re-runs only what α touches, so that `dvc exp run -S featcal.alpha=...`
costs little more than the calibration itself, and that a calibrate-layer stage streams one block
per checkpoint instead of loading every model. In one run this measures:

(a) `dvc exp run -S featcal.alpha=<new>` from an up-to-date pipeline: wall time and the stages it
    ran. The workspace is restored afterwards (params.yaml, dvc.lock and results/ as they were,
    uncommitted changes included; the DVC-tracked outputs by `dvc checkout --force`) and the
    experiment is removed from the experiment list unless --keep-exp; then the same through
    `make exp` (DVC under stages/with_warm_stages.py: stages forked from a warm interpreter), whose
    calibrated blocks must be byte-identical to the cold run's (`alpha_rerun_warm_over_inprocess`);
(b) one in-process calibration of the same merged model with the new α (`featcal.calibration.walk.calibrate`)
    plus scoring the calibrated model on test; `alpha_rerun_over_inprocess` = (a) ÷ (b), goal <= 1.3;
(c) the peak RSS of the largest calibrate-layer stage in that experiment ÷ the whole-model path's:
    on the demo the largest stage before the streaming rewrite (commit c1adb0f's results/timing);
    with `--rss-baseline in-process` (a project that never had that rewrite, e.g. mpnet/) the peak
    of (b)'s calibration, which holds every model whole; goal <= 0.5.

The figures are merged into results/bench.json. Needs `make repro` first. Run: make bench
(the base-size pipeline: make bench-mpnet, after make repro-mpnet)
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import hashlib
import json
import os
import re
import shlex
import shutil
import subprocess
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "stages"))
sys.path.insert(0, str(ROOT / "tests"))
from tiny_project import run_dvc_logged  # noqa: E402  (streams a dvc command into a log)

DEMO_OUTPUTS = ("models/merged", "experts", "features/experts")
RESTORED = ("params.yaml", "dvc.lock", "results")      # what `dvc exp run` rewrites in the workspace
BEFORE_COMMIT = "c1adb0f"   # the last commit whose calibrate-layer stages loaded every model whole
BEFORE_MIB = 2677.7         # its largest calibrate-layer peak RSS, if that commit cannot be read
RATIO_GOAL, RSS_GOAL = 1.3, 0.5


# --- running dvc and git -----------------------------------------------------------------------------


def project_env() -> dict[str, str]:
    """Stage commands say `python`: this interpreter's folder goes first on PATH; the hub stays offline."""
    return dict(os.environ, HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1", TOKENIZERS_PARALLELISM="false",
                PATH=f"{Path(sys.executable).parent}{os.pathsep}{os.environ.get('PATH', '')}")


def dvc(*args: str, check: bool = True, cwd: Path | None = None) -> subprocess.CompletedProcess:
    """`python -m dvc ...` with the project's interpreter (in `cwd`, default here), output captured."""
    proc = subprocess.run([sys.executable, "-m", "dvc", *args], cwd=cwd, env=project_env(), capture_output=True,
                          text=True)
    if check and proc.returncode != 0:
        where = f" in {cwd}" if cwd is not None else ""
        raise SystemExit(f"dvc {' '.join(args)}{where} failed ({proc.returncode}):\n{proc.stdout[-3000:]}\n"
                         f"{proc.stderr[-3000:]}")
    return proc


def git(*args: str, cwd: Path | None = None) -> subprocess.CompletedProcess:
    return subprocess.run(["git", *args], cwd=cwd, capture_output=True, text=True)


# --- preconditions -----------------------------------------------------------------------------------


def require_demo() -> None:
    """The demo's models and caches must exist: the benchmark calibrates them, it does not build them."""
    missing = [p for p in DEMO_OUTPUTS if not Path(p).exists()]
    if missing:
        raise SystemExit(f"alpha_rerun: the demo is not built ({', '.join(missing)} missing in {Path.cwd()}); "
                         "run `make repro` first")


def pipeline_changes() -> list[str]:
    """Stages of dvc.yaml that `dvc status` reports changed (empty: up to date)."""
    out = dvc("status", "--json", "dvc.yaml").stdout.strip()
    try:
        return sorted(json.loads(out or "{}"))
    except json.JSONDecodeError:
        raise SystemExit(f"dvc status --json: unexpected output:\n{out[-2000:]}") from None


def require_up_to_date(when: str, fix: str) -> None:
    changed = pipeline_changes()
    if changed:
        raise SystemExit(f"alpha_rerun: {when}, `dvc status` is not up to date (changed: {', '.join(changed)}); {fix}")


def require_alpha_in_params(params: dict) -> None:
    """With featcal.use_tuned, the chain reads α from tune/best.yaml: `-S featcal.alpha` would not reach it."""
    if params.get("featcal", {}).get("use_tuned"):
        raise SystemExit("alpha_rerun: featcal.use_tuned is true, so α comes from tune/best.yaml and "
                         "`-S featcal.alpha` changes nothing; set it to false (and `make repro`) to benchmark")


# --- (a) the experiment, and putting the workspace back ------------------------------------------------


def snapshot(dest: Path) -> None:
    """Copy what the experiment rewrites, so uncommitted changes (e.g. dvc.lock after `make repro`
    on a fresh clone) come back too, not only the committed versions `git checkout` gives."""
    for name in RESTORED:
        src = Path(name)
        if src.is_dir():
            shutil.copytree(src, dest / name, symlinks=True)
        elif src.exists():
            shutil.copy2(src, dest / name)


def mirror(src: Path, dst: Path) -> None:
    """Make `dst` hold exactly `src`'s files: copy them over, delete files `src` does not have."""
    for path in sorted(dst.rglob("*"), reverse=True):
        twin = src / path.relative_to(dst)
        if path.is_file() or path.is_symlink():
            if not (twin.is_file() or twin.is_symlink()):
                path.unlink()
        elif path.is_dir() and not twin.is_dir():
            shutil.rmtree(path)
    shutil.copytree(src, dst, symlinks=True, dirs_exist_ok=True)


def restore(saved: Path) -> None:
    """params.yaml, dvc.lock, results/ as before the experiment (index from git, files from the
    snapshot), then the outputs of this project's dvc.yaml as dvc.lock records them (only those: another
    pipeline's outputs, e.g. the demo's from mpnet/, may be absent from the cache on a fresh machine)."""
    proc = git("checkout", "--", *[n for n in RESTORED if Path(n).exists() or (saved / n).exists()])
    if proc.returncode != 0:
        print(f"warning: git checkout -- {' '.join(RESTORED)}: {proc.stderr.strip()}", file=sys.stderr)
    for name in RESTORED:
        src, dst = saved / name, Path(name)
        if src.is_dir():
            mirror(src, dst)
        elif src.exists():
            shutil.copy2(src, dst)
    dvc("checkout", "--force", "dvc.yaml")


@dataclass
class Experiment:
    """What one `dvc exp run` did and left in the workspace (read before the workspace is restored)."""
    stages: list[str]
    wall_s: float
    name: str | None
    peaks: dict[str, float]          # calibrate-layer stage: peak RSS (MiB), as the stages wrote it
    test_avg: float | None
    layers_sha256: dict[str, str]    # the calibrated blocks' files


@contextlib.contextmanager
def run_cache_set_aside(keep: Path) -> Iterator[None]:
    """DVC's run cache moved to `keep` for the block and put back after it (what the block added
    dropped): `dvc exp run` has no --no-run-cache, and stages whose inputs DVC has seen before (an
    earlier run of this benchmark, or the cold run for the warm one) would be restored, not run.
    The figure is what a new α costs."""
    runs = Path(dvc("cache", "dir").stdout.strip()) / "runs"
    if runs.exists():
        shutil.move(runs, keep)
    try:
        yield
    finally:
        shutil.rmtree(runs, ignore_errors=True)
        if keep.exists():
            shutil.move(keep, runs)


def exp_run(alpha: float, log: Path, saved: Path, warm: bool) -> Experiment:
    """`dvc exp run -S featcal.alpha=<alpha>` (`warm`: under stages/with_warm_stages.py, as
    `make exp` runs it), then the workspace put back as `saved` holds it."""
    try:
        with run_cache_set_aside(saved.parent / "runs"):
            stages, wall = run_dvc_logged(["exp", "run", "-S", f"featcal.alpha={alpha}"], log, env=project_env(),
                                          warm=warm)
        name = re.search(r"Ran experiment\(s\): (\S+)", log.read_text())
        layers = {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in sorted(Path("calib/layers").glob("*.safetensors"))}
        return Experiment(stages, wall, name.group(1) if name else None, calibrate_stage_peaks(),
                          read_metric("results/metrics.json", "featcal", "avg"), layers)
    finally:
        restore(saved)


def calibrate_stage_peaks() -> dict[str, float]:
    """{stage: peak_rss_mib} of the calibrate-layer stages, as their last run wrote them."""
    return {p.stem: json.loads(p.read_text())["peak_rss_mib"] for p in Path("results/timing").glob("calibrate-layer@*.json")}


def read_metric(path: str, *keys: str) -> float | None:
    try:
        node = json.loads(Path(path).read_text())
        for key in keys:
            node = node[key]
        return float(node)
    except (OSError, KeyError, TypeError, ValueError):
        return None


def remove_experiment(name: str | None) -> None:
    if name is None:
        print("note: the experiment's name was not in dvc's output; `dvc exp list` shows it", file=sys.stderr)
        return
    proc = dvc("exp", "remove", name, check=False)
    if proc.returncode != 0:
        print(f"note: dvc exp remove {name}: {proc.stderr.strip()[-500:]}", file=sys.stderr)


# --- (b) one in-process calibration and scoring ------------------------------------------------------------


def in_process(params: dict, alpha: float) -> dict:
    """Load the demo's models and data (not timed), then calibrate the merged model with the new α
    and score it on test, each step measured (wall time, peak RSS)."""
    import torch
    from common import enabled_tasks, get, max_length

    from featcal.calibration.config import FeatCalConfig
    from featcal.calibration.walk import calibrate
    from featcal.data.splits import batches_from_arrays, read_split
    from featcal.evaluation.scoring import score_backbone, summary
    from featcal.io.checkpoints import load_head
    from featcal.data.encoders import load_encoder
    from featcal.io.models import load_backbone, load_classifier
    from featcal.profiling import measure
    from featcal.io.feature_store import read_group
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()
    tasks = enabled_tasks(params)
    with measure() as load:
        merged = load_backbone("models/merged")
        experts = {t: load_classifier(f"experts/{t}") for t in tasks}
        base = load_backbone(get(params, "model.base"), like=experts[tasks[0]])
        batches = batches_from_arrays(read_group("features/experts/inputs.zarr"), int(get(params, "calibration.batch_size")))
        batches = {t: batches[t] for t in tasks}
        heads = {t: load_head(f"experts/{t}") for t in tasks}
        encoder = load_encoder("models/merged")
        splits = {t: read_split(get(params, "tasks_dir"), t, "test") for t in tasks}
    config = FeatCalConfig.from_mapping({**get(params, "featcal"), "alpha": alpha})
    with measure() as cal:
        result = calibrate(merged, base, experts, batches, config, inplace=True, progress=False)
    with measure() as score:
        scores = score_backbone(result.backbone, heads, encoder, splits, {t: max_length(params, t) for t in tasks})
    return {"load": load.as_dict(), "calibrate": cal.as_dict(), "score": score.as_dict(),
            "test_avg": summary(scores)["avg"], "threads": torch.get_num_threads()}


# --- (c) the figure before the rewrite -----------------------------------------------------------------------


def before_rewrite_peak() -> tuple[float, str]:
    """The largest calibrate-layer peak RSS recorded at BEFORE_COMMIT (read from this repository's
    history; the recorded figure when that commit is not available, e.g. in a shallow clone)."""
    listing = git("ls-tree", "--name-only", f"{BEFORE_COMMIT}:results/timing", cwd=ROOT)
    peaks = []
    for name in listing.stdout.split() if listing.returncode == 0 else []:
        if name.startswith("calibrate-layer@"):
            shown = git("show", f"{BEFORE_COMMIT}:results/timing/{name}", cwd=ROOT)
            if shown.returncode == 0:
                peaks.append(float(json.loads(shown.stdout)["peak_rss_mib"]))
    if peaks:
        return max(peaks), f"git show {BEFORE_COMMIT}:results/timing/calibrate-layer@*.json"
    return BEFORE_MIB, f"recorded figure of {BEFORE_COMMIT} (commit not available)"


# --- report ----------------------------------------------------------------------------------------------


def merge_json(path: Path, figures: dict) -> None:
    """Update `path` with `figures`, keeping keys other benchmarks wrote."""
    record = json.loads(path.read_text()) if path.exists() else {}
    record.update(figures)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(record, indent=2) + "\n")


def verdict(value: float, goal: float) -> str:
    return f"goal <= {goal}: {'meets' if value <= goal else 'misses'}"


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--alpha", type=float, default=0.5, help="the new featcal.alpha of the experiment")
    p.add_argument("--project", type=Path, default=ROOT, help="the demo project (after `make repro`)")
    p.add_argument("--out", type=Path, default=Path("results/bench.json"), help="figures file, relative to --project")
    p.add_argument("--keep-exp", action="store_true", help="keep the experiment in `dvc exp list`")
    p.add_argument("--runs", choices=["both", "warm"], default="both",
                   help="warm: only `make exp` (the README's experiment command), whose wall time is then the "
                        "headline (a base-size project: one experiment costs ~10 min)")
    p.add_argument("--rss-baseline", choices=["before-rewrite", "in-process"], default="before-rewrite",
                   help="the whole-model path's peak RSS: the demo's stages before the streaming rewrite, or "
                        "the in-process calibration's (every model whole)")
    return p.parse_args()


def main() -> None:
    args = parse_args()
    os.chdir(args.project)
    require_demo()
    from common import load_params

    params = load_params()
    require_alpha_in_params(params)
    if float(params["featcal"]["alpha"]) == args.alpha:
        raise SystemExit(f"alpha_rerun: featcal.alpha is already {args.alpha}; give another --alpha")
    require_up_to_date("before the experiment", "run `make repro` first")

    runs: dict[str, Experiment] = {}
    with tempfile.TemporaryDirectory(prefix="featcal-alpha-rerun-") as tmp:
        saved = Path(tmp) / "saved"
        saved.mkdir()
        snapshot(saved)
        kinds = (("cold", False, "dvc exp run"), ("warm", True, "make exp (stages/with_warm_stages.py)"))
        for key, warm, how in (kinds if args.runs == "both" else kinds[1:]):
            print(f"(a, {key}) {how} -S featcal.alpha={args.alpha} (params.yaml has {params['featcal']['alpha']})", flush=True)
            runs[key] = exp_run(args.alpha, Path(tmp) / f"exp-{key}.log", saved, warm)
            if not args.keep_exp:
                remove_experiment(runs[key].name)
            require_up_to_date("after restoring the workspace", "the workspace was not restored exactly: "
                               "run `git status` and `dvc checkout --force`")
            print("    workspace restored; dvc status: up to date", flush=True)
    warm = runs["warm"]
    cold = runs.get("cold", warm)   # --runs warm: the README's command is the headline
    same_layers = cold.layers_sha256 == warm.layers_sha256 and bool(cold.layers_sha256) if "cold" in runs else None
    stages, exp_s, peaks, exp_avg = cold.stages, cold.wall_s, cold.peaks, cold.test_avg

    print(f"(b) in-process calibration with alpha={args.alpha} + test scoring", flush=True)
    inproc = in_process(params, args.alpha)
    inproc_s = inproc["calibrate"]["wall_s"] + inproc["score"]["wall_s"]
    ratio = exp_s / inproc_s
    largest = max(peaks, key=peaks.get)
    if args.rss_baseline == "in-process":
        before_mib, before_source = inproc["calibrate"]["peak_rss_mib"], "in-process calibration, every model whole"
    else:
        before_mib, before_source = before_rewrite_peak()
    rss_ratio = peaks[largest] / before_mib

    print()
    print(f"threads {inproc['threads']}; new alpha {args.alpha}")
    print(f"{'dvc exp run' if 'cold' in runs else 'make exp'}: {exp_s:.1f} s; stages run: {', '.join(stages) or 'none'}")
    print(f"in process: load {inproc['load']['wall_s']:.1f} s (not counted), calibrate {inproc['calibrate']['wall_s']:.1f} s, "
          f"score {inproc['score']['wall_s']:.1f} s; peak RSS {inproc['score']['peak_rss_mib']:.0f} MiB")
    print(f"test avg: exp run {exp_avg}, in process {inproc['test_avg']}")
    print(f"alpha_rerun_over_inprocess {ratio:.2f} ({verdict(ratio, RATIO_GOAL)})")
    print(f"make exp (warm stage starts): {warm.wall_s:.1f} s -> {warm.wall_s / inproc_s:.2f} of in process; "
          f"calibrated blocks byte-identical to the cold run's: {same_layers}; test avg {warm.test_avg}")
    print(f"calibrate_stage_peak_rss_mib {peaks[largest]:.1f} ({largest}); whole-model path ({before_source}) {before_mib:.1f} "
          f"-> ratio {rss_ratio:.2f} ({verdict(rss_ratio, RSS_GOAL)})")

    merge_json(args.out, {
        "alpha_rerun_over_inprocess": round(ratio, 3),
        "alpha_rerun_warm_over_inprocess": round(warm.wall_s / inproc_s, 3),
        "calibrate_stage_peak_rss_mib": peaks[largest],
        "calibrate_stage_peak_rss_ratio": round(rss_ratio, 3),
        "alpha_rerun": {
            "command": shlex.join(["python", *sys.argv]), "date": datetime.datetime.now().astimezone().isoformat(timespec="seconds"),
            "threads": inproc["threads"], "alpha": args.alpha, "exp_run_wall_s": round(exp_s, 2), "stages_run": stages,
            "headline_run": "dvc exp run" if "cold" in runs else "make exp (warm stage starts)",
            "in_process": inproc, "exp_run_test_avg": exp_avg, "calibrate_stage_peaks_mib": peaks,
            "largest_calibrate_stage": largest, "before_rewrite_peak_rss_mib": before_mib,
            "before_rewrite_source": before_source,
            "warm": {"command": "make exp (stages/with_warm_stages.py dvc exp run)",
                     "exp_run_wall_s": round(warm.wall_s, 2), "stages_run": warm.stages, "test_avg": warm.test_avg,
                     "calibrated_blocks_identical_to_cold": same_layers},
            "goals": {"alpha_rerun_over_inprocess": RATIO_GOAL, "calibrate_stage_peak_rss_ratio": RSS_GOAL},
        },
    })
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
