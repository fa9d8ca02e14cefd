"""Benchmark (not a test): what FeatCal costs on the demo, side by side in one process.

FeatCal calibration time vs the bare forward passes it needs (each expert's and the merged
model's forward over the calibration set), and FeatCal vs Surgery vs ProbSurgery in wall time and
memory. Needs the demo's experts (`make repro` first). Run: make bench
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "stages"))
from common import enabled_tasks, get, load_params, max_length  # noqa: E402

from featcal import compare as cmp  # noqa: E402
from featcal.baselines import ProbSurgeryConfig, SurgeryConfig  # noqa: E402
from featcal.calibrate import FeatCalConfig  # noqa: E402
from featcal.families import family_for  # noqa: E402
from featcal.profiling import measure  # noqa: E402


@torch.no_grad()
def forwards(bench, merged, batches) -> None:
    """The forward passes FeatCal cannot avoid: each expert on its task, the merged model on all."""
    for task, task_batches in batches.items():
        for batch in task_batches:
            cmp_inputs = {k: v for k, v in batch.items() if k != "labels"}
            family_for(merged).backbone(bench.experts[task])(**cmp_inputs)
            merged(**cmp_inputs)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--examples-per-task", type=int, default=None)
    args = parser.parse_args()
    params = load_params()
    tasks = enabled_tasks(params)
    n = args.examples_per_task or int(get(params, "calibration.examples_per_task"))
    bench = cmp.load_workbench(get(params, "model.base"), {t: f"experts/{t}" for t in tasks}, get(params, "tasks_dir"),
                               {t: max_length(params, t) for t in tasks}, int(get(params, "seed")),
                               int(get(params, "calibration.batch_size")))
    merged = cmp.merge(bench, get(params, "merge.method"), get(params, "merge.options"))
    batches = cmp.to_batches(bench, cmp.calibration_texts(bench, n))
    print(f"threads {torch.get_num_threads()}, {len(tasks)} tasks x {n} calibration examples, "
          f"merge {get(params, 'merge.method')}")

    with measure() as fwd:
        forwards(bench, merged, batches)
    _, featcal = cmp.run_featcal(bench, merged, batches, FeatCalConfig.from_mapping(get(params, "featcal")))
    _, surgery, surgery_train = cmp.run_surgery(bench, merged, batches, "surgery", SurgeryConfig(progress=False))
    _, prob, prob_train = cmp.run_surgery(bench, merged, batches, "probsurgery", ProbSurgeryConfig(progress=False))

    rows = [("bare forwards (experts + merged)", fwd), ("FeatCal calibration", featcal),
            ("Surgery (features + training)", surgery), ("  Surgery training only", surgery_train),
            ("ProbSurgery (features + training)", prob), ("  ProbSurgery training only", prob_train)]
    print(f"{'step':38s} {'wall s':>8s} {'peak RSS MiB':>13s} {'added MiB':>10s}")
    for label, m in rows:
        print(f"{label:38s} {m.wall_s:8.2f} {m.peak_rss_mib:13.0f} {m.added_rss_mib:10.0f}")
    print(f"FeatCal / bare forwards: {featcal.wall_s / fwd.wall_s:.2f}x time")
    print(f"Surgery / FeatCal: {surgery.wall_s / featcal.wall_s:.2f}x time, "
          f"{surgery.added_rss_mib / max(featcal.added_rss_mib, 1e-9):.2f}x added memory")
    print(f"ProbSurgery / FeatCal: {prob.wall_s / featcal.wall_s:.2f}x time, "
          f"{prob.added_rss_mib / max(featcal.added_rss_mib, 1e-9):.2f}x added memory")


if __name__ == "__main__":
    main()
