"""Benchmark (not a test): what FeatCal costs on the demo, side by side in one process.

FeatCal calibration time vs the bare forward passes it needs (each expert's and the merged
model's forward over the calibration set), where its time goes (phases), how far the default
float32 moment products move the weights from the all-float64 path, and FeatCal vs Surgery vs
ProbSurgery in wall time and memory. Figures are merged into results/bench.json.
Needs the demo's experts (`make repro` first). Run: make bench
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import shlex
import statistics
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "stages"))
from common import enabled_tasks, get, load_params, max_length  # noqa: E402

from featcal.evaluation import compare as cmp  # noqa: E402
from featcal.baselines.surgery import ProbSurgeryConfig, SurgeryConfig  # noqa: E402
from featcal.calibration.config import FeatCalConfig
from featcal.families import family_for  # noqa: E402
from featcal.profiling import Measurement, measure, phase_times  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parent))
from alpha_rerun import merge_json, verdict  # noqa: E402

RATIO_GOAL = 2.6      # one exact calibration / the bare forwards over its data (issue 36)
DIFF_GOAL = 1e-5      # max relative weight difference of float32 products vs the all-float64 path


def relative_differences(a: dict, b: dict) -> list[tuple[float, str]]:
    """(max|a − b| / max|b|, name) per floating tensor, furthest first: how far `a` moved from the reference `b`."""
    return sorted(((float((a[n] - b[n]).abs().max() / b[n].abs().max().clamp_min(1e-30)), n)
                   for n in b if b[n].is_floating_point()), reverse=True)


def max_relative_difference(a: dict, b: dict) -> tuple[float, str]:
    """max over tensors of max|a − b| / max|b|, and that tensor's name."""
    return relative_differences(a, b)[0]


def demo_calibration(params: dict, examples_per_task: int | None = None):
    """The demo's calibration problem as params.yaml sets it: the workbench, the merged anchor, the calibration
    batches (`examples_per_task` a task, else `calibration.examples_per_task`) and the FeatCal config."""
    tasks = enabled_tasks(params)
    n = examples_per_task or int(get(params, "calibration.examples_per_task"))
    bench = cmp.load_workbench(get(params, "model.base"), {t: f"experts/{t}" for t in tasks}, get(params, "tasks_dir"),
                               {t: max_length(params, t) for t in tasks}, int(get(params, "seed")),
                               int(get(params, "calibration.batch_size")))
    # merge_anchor: a data method's block in params.yaml holds its data options too (RegMean's examples_per_task)
    merged, _ = cmp.merge_anchor(bench, get(params, "merge.method"), get(params, "merge.options") or {})
    batches = cmp.to_batches(bench, cmp.calibration_examples(bench, n))
    return bench, merged, batches, FeatCalConfig.from_mapping(get(params, "featcal"))


@torch.no_grad()
def forwards(bench, merged, batches) -> None:
    """The forward passes FeatCal cannot avoid: each expert on its task, the merged model on all."""
    for task, task_batches in batches.items():
        for batch in task_batches:
            cmp_inputs = {k: v for k, v in batch.items() if k != "labels"}
            family_for(merged).backbone(bench.experts[task])(**cmp_inputs)
            merged(**cmp_inputs)


def median_measurement(measurements: list[Measurement]) -> Measurement:
    """The median wall time of repeated measurements of one step, and the highest memory any of them saw."""
    return Measurement(statistics.median(m.wall_s for m in measurements), max(m.peak_rss_mib for m in measurements),
                       max(m.added_rss_mib for m in measurements))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--examples-per-task", type=int, default=None)
    parser.add_argument("--repeats", type=int, default=3, help="back-to-back repeats of the forwards and calibrations")
    parser.add_argument("--out", default="results/bench.json", help="figures file (merged with other benchmarks')")
    args = parser.parse_args()
    params = load_params()
    tasks = enabled_tasks(params)
    n = args.examples_per_task or int(get(params, "calibration.examples_per_task"))
    bench, merged, batches, config = demo_calibration(params, n)
    print(f"threads {torch.get_num_threads()}, {len(tasks)} tasks x {n} calibration examples, "
          f"merge {get(params, 'merge.method')}")

    # the other product dtype beside the configured one: float32's distance to the exact path is the figure
    other_dtype = "float64" if config.product_dtype == "float32" else "float32"
    other_config = dataclasses.replace(config, product_dtype=other_dtype)
    cmp.run_featcal(bench, merged, {t: b[:1] for t, b in batches.items()}, config)   # warm-up, not counted
    # the machine's speed drifts by up to ±15 % over minutes: each repeat measures the forwards and both
    # calibrations back to back, and the figures are the medians of the repeats' ratios
    runs, phases, phased_wall_s, worst, worst_name = [], None, None, None, None
    for repeat in range(args.repeats):
        with measure() as fwd:
            forwards(bench, merged, batches)
        with phase_times() as repeat_phases:
            calibrated, featcal = cmp.run_featcal(bench, merged, batches, config)
        other, featcal_other = cmp.run_featcal(bench, merged, batches, other_config)
        runs.append((fwd, featcal, featcal_other))
        if repeat == 0:
            phases, phased_wall_s = repeat_phases, featcal.wall_s
            fast, exact = (calibrated, other) if config.product_dtype == "float32" else (other, calibrated)
            worst, worst_name = max_relative_difference(fast.state_dict(), exact.state_dict())
        del calibrated, other
    fwd, featcal, featcal_other = (median_measurement([run[i] for run in runs]) for i in range(3))
    _, surgery, surgery_train = cmp.run_surgery(bench, merged, batches, "surgery", SurgeryConfig(progress=False))
    _, prob, prob_train = cmp.run_surgery(bench, merged, batches, "probsurgery", ProbSurgeryConfig(progress=False))

    rows = [("bare forwards (experts + merged)", fwd),
            (f"FeatCal calibration ({config.product_dtype} products, as configured)", featcal),
            (f"FeatCal, {other_dtype} products", featcal_other),
            ("Surgery (features + training)", surgery), ("  Surgery training only", surgery_train),
            ("ProbSurgery (features + training)", prob), ("  ProbSurgery training only", prob_train)]
    print(f"{'step':42s} {'wall s':>8s} {'peak RSS MiB':>13s} {'added MiB':>10s}")
    for label, m in rows:
        print(f"{label:42s} {m.wall_s:8.2f} {m.peak_rss_mib:13.0f} {m.added_rss_mib:10.0f}")
    print(f"where FeatCal's time goes (the first repeat, {phased_wall_s:.2f} s):")
    for name, seconds in sorted(phases.items(), key=lambda kv: -kv[1]):
        print(f"  {name:28s} {seconds:7.2f} s {100 * seconds / phased_wall_s:5.1f} %")
    other = phased_wall_s - sum(phases.values())
    print(f"  {'(between phases)':28s} {other:7.2f} s {100 * other / phased_wall_s:5.1f} %")
    ratios = [f.wall_s / b.wall_s for b, f, _ in runs]
    other_ratios = [o.wall_s / b.wall_s for b, _, o in runs]
    ratio, other_ratio = statistics.median(ratios), statistics.median(other_ratios)
    print(f"featcal_over_forwards {ratio:.2f} ({config.product_dtype} products, median of {len(runs)}: "
          f"{', '.join(f'{r:.2f}' for r in ratios)}; {verdict(ratio, RATIO_GOAL)}); "
          f"{other_dtype} products {other_ratio:.2f} ({', '.join(f'{r:.2f}' for r in other_ratios)})")
    print(f"max_rel_diff_vs_float64 {worst:.2e} (float32 products vs float64: {worst_name}; {verdict(worst, DIFF_GOAL)})")
    print(f"Surgery / FeatCal: {surgery.wall_s / featcal.wall_s:.2f}x time, "
          f"{surgery.added_rss_mib / max(featcal.added_rss_mib, 1e-9):.2f}x added memory")
    print(f"ProbSurgery / FeatCal: {prob.wall_s / featcal.wall_s:.2f}x time, "
          f"{prob.added_rss_mib / max(featcal.added_rss_mib, 1e-9):.2f}x added memory")
    merge_json(Path(args.out), {
        "featcal_over_forwards": round(ratio, 3),
        "max_rel_diff_vs_float64": worst,
        "calibration_cost": {
            "command": shlex.join(["python", *sys.argv]),
            "date": datetime.datetime.now().astimezone().isoformat(timespec="seconds"),
            "threads": torch.get_num_threads(), "tasks": len(tasks), "examples_per_task": n,
            "repeats": len(runs), "ratios": [round(r, 3) for r in ratios],
            f"{other_dtype}_products_over_forwards": round(other_ratio, 3),
            f"{other_dtype}_products_ratios": [round(r, 3) for r in other_ratios],
            "steps": {label.strip(): m.as_dict() for label, m in rows},
            "phases_s": {k: round(v, 2) for k, v in phases.items()},
            "max_rel_diff_tensor": worst_name,
            "goals": {"featcal_over_forwards": RATIO_GOAL, "max_rel_diff_vs_float64": DIFF_GOAL},
        },
    })
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
