"""Benchmark (not a test): the language-model pipeline (llm/) on the real 1.5B decoder, end to end.

`dvc repro` of llm/ (Qwen2.5-Coder-1.5B, three text domains, LoRA experts merged into full weights,
Task Arithmetic + FeatCal over 28 blocks, scored by mean token NLL), under stages/with_warm_stages.py
as `make` runs DVC, then from what the stages recorded:

- every stage's wall time and peak RSS (results/timing/*.json) against one float32 copy of the model;
  the goal (<= 0.6) is for the stages that stream the five models involved (merge, collect-*-features,
  calibrate-layer@*, evaluate*); a fine-tune stage trains one whole model, its ratio is listed apart;
- each calibrate-layer stage's seconds in forwards, moment products and solve (its `phases_s`);
- one block recalibrated in this process with float32 moment products: its max relative weight
  difference to the stage's float64-product block, on the real activations the stage read;
- each task's NLL (nats per token) and perplexity for its expert, the merged and the calibrated model,
  and the gap closed in NLL, (merged - calibrated) / (merged - expert) (goal: > 0 on every task);
- the drift plot the evaluate stage drew (results/plots/drift.png).

Figures go to llm/results/bench_llm.json. Needs `make setup-llm`. Run: make bench-llm
(`--no-repro`: only read an existing run's records).
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import json
import math
import os
import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "stages"))
sys.path.insert(0, str(ROOT / "tests"))
sys.path.insert(0, str(ROOT / "bench"))
from alpha_rerun import merge_json, verdict  # noqa: E402
from calibration_cost import max_relative_difference  # noqa: E402
from tiny_project import run_dvc_logged  # noqa: E402

RSS_GOAL = 0.6            # largest streamed stage's peak RSS / one float32 copy of the model
FINETUNE_PREFIX = "finetune@"


def float32_model_mib(reader) -> float:
    """One float32 copy of the checkpoint (every stored tensor at 4 bytes an element; a tied head once)."""
    elements = sum(math.prod(reader.shape(name)) for name in reader.keys())
    return elements * 4 / 2**20


def stage_records(project: Path) -> dict[str, dict]:
    return {p.stem: json.loads(p.read_text()) for p in sorted((project / "results/timing").glob("*.json"))}


def memory_summary(stages: dict[str, dict], model_mib: float) -> dict:
    """Each stage's peak RSS / one float32 model; the largest streamed stage against the goal."""
    ratios = {s: round(r["peak_rss_mib"] / model_mib, 3) for s, r in stages.items()}
    streamed = [s for s in stages if not s.startswith(FINETUNE_PREFIX) and s != "prepare"]
    finetunes = [s for s in stages if s.startswith(FINETUNE_PREFIX)]
    largest = max(streamed, key=lambda s: stages[s]["peak_rss_mib"])
    return {
        "model_float32_mib": round(model_mib, 1),
        "largest_streamed_stage": largest,
        "largest_streamed_stage_peak_rss_mib": stages[largest]["peak_rss_mib"],
        "streamed_stage_peak_rss_ratio": ratios[largest],
        "finetune_peak_rss_ratio": max((ratios[s] for s in finetunes), default=None),
        "ratio_per_stage": ratios,
    }


def block_phases(stages: dict[str, dict]) -> dict[str, dict]:
    """calibrate-layer@Lkk: wall seconds and its phases (forwards, moment products, solve, ...)."""
    return {s: {"wall_s": r["wall_s"], **r.get("phases_s", {})} for s, r in stages.items()
            if s.startswith("calibrate-layer@")}


def float32_difference(project: Path, layer: int) -> dict:
    """Block `layer` again with float32 moment products, from the caches the stage read; its max
    relative difference to the stage's float64-product parameters."""
    from safetensors.torch import load_file

    from calibrate_layer import calibrate_from_caches
    from common import get, load_params

    from featcal.calibration.config import FeatCalConfig

    import yaml

    os.chdir(project)
    params = load_params()
    chain = yaml.safe_load(Path("stages/chain.yaml").read_text())   # the stage's own arguments
    if chain["featcal_params"] != "params.yaml":
        raise SystemExit(f"{project}/stages/chain.yaml: featcal_params is {chain['featcal_params']}; this check "
                         "recalibrates with params.yaml's featcal only")
    config = dataclasses.replace(FeatCalConfig.from_mapping(get(params, "featcal")), product_dtype="float32")
    name = f"L{layer:02d}"
    out = calibrate_from_caches(params, layer, config, "models/merged", "experts", "features/experts",
                                chain["layers"][name]["student_in"])
    reference = load_file(f"calib/layers/{name}.safetensors")
    diff, tensor = max_relative_difference(out.parameters, reference)
    return {"layer": name, "max_rel_diff_float32_vs_float64": diff, "tensor": tensor}


def nll_table(metrics: dict) -> dict[str, dict]:
    """Per task: NLL and perplexity of the expert, the merged and the calibrated model; gap closed."""
    rows = {}
    for task, gap in metrics["gap_closed_per_task"].items():
        nll = {who: metrics[key][task] for who, key in (("expert", "experts"), ("merged", "merged"),
                                                        ("featcal", "featcal"))}
        rows[task] = {"nll": nll, "perplexity": {w: round(math.exp(v), 3) for w, v in nll.items()},
                      "gap_closed": gap,
                      # the gap's sign reads only where the expert is better on its own task than the merge;
                      # and whether calibrating moved the merged model's NLL down (< 0) or up
                      "expert_below_merged": nll["expert"] < nll["merged"],
                      "featcal_minus_merged": round(nll["featcal"] - nll["merged"], 4)}
    return rows


def phase_totals(phases: dict[str, dict]) -> dict[str, float]:
    """Every block's seconds summed: forwards (capture + advance), moment products, solve, the rest."""
    totals = {"wall_s": 0.0, "forwards": 0.0, "moments": 0.0, "solve": 0.0}
    for row in phases.values():
        totals["wall_s"] += row["wall_s"]
        totals["forwards"] += row.get("capture forwards", 0.0) + row.get("advance forwards", 0.0)
        totals["moments"] += row.get("moments", 0.0)
        totals["solve"] += row.get("solve", 0.0)
    totals["other"] = totals["wall_s"] - totals["forwards"] - totals["moments"] - totals["solve"]
    return {k: round(v, 1) for k, v in totals.items()}


def print_report(figures: dict) -> None:
    mem = figures["memory"]
    print(f"\nstage peak RSS / one float32 model ({mem['model_float32_mib']:.0f} MiB):")
    for stage, ratio in mem["ratio_per_stage"].items():
        print(f"  {stage:28s} {ratio:6.3f}")
    print(f"largest streamed stage {mem['largest_streamed_stage']}: {mem['streamed_stage_peak_rss_ratio']:.3f} "
          f"({verdict(mem['streamed_stage_peak_rss_ratio'], RSS_GOAL)}); fine-tune stages "
          f"{mem['finetune_peak_rss_ratio']} (training holds one whole model)")
    print("\ncalibrate-layer phases (s):")
    for stage, row in figures["block_phases_s"].items():
        print(f"  {stage:24s} " + "  ".join(f"{k} {v:.1f}" for k, v in row.items()))
    print("  all blocks: " + "  ".join(f"{k} {v:.1f}" for k, v in figures["block_phase_totals_s"].items()))
    f32 = figures["float32_products"]
    print(f"\nfloat32 vs float64 products, block {f32['layer']}: max rel diff {f32['max_rel_diff_float32_vs_float64']:.3g} "
          f"({f32['tensor']})")
    print("\nNLL (nats/token) expert / merged / FeatCal, gap closed:")
    for task, row in figures["nll"].items():
        n = row["nll"]
        print(f"  {task:10s} {n['expert']:.4f} / {n['merged']:.4f} / {n['featcal']:.4f}   gap closed {row['gap_closed']}"
              f"   FeatCal - merged {row['featcal_minus_merged']:+.4f}"
              + ("" if row["expert_below_merged"] else "   (the expert is not below the merge on its own task)"))
    print(f"every task's gap closed > 0: {figures['gap_closed_positive_every_task']}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--project", type=Path, default=ROOT / "llm")
    parser.add_argument("--out", default="results/bench_llm.json", help="figures file, relative to --project")
    parser.add_argument("--no-repro", action="store_true", help="read an existing run's records only")
    parser.add_argument("--downstream", metavar="STAGE", help="dvc repro --downstream STAGE: from that stage on "
                        "(e.g. merge: the experts as they are, however their stages' code changed since)")
    parser.add_argument("--float32-layer", type=int, default=None, help="block recalibrated with float32 products "
                        "(default: the last)")
    args = parser.parse_args()
    project = args.project.resolve()
    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", os.cpu_count() or 1)))
    figures: dict = {"command": "make bench-llm", "date": datetime.datetime.now(datetime.timezone.utc).isoformat(
        timespec="seconds"), "threads": torch.get_num_threads()}
    if not args.no_repro:
        (project / "results").mkdir(exist_ok=True)   # a fresh clone has no results/ here yet
        repro = ["repro"] + (["--downstream", args.downstream] if args.downstream else [])
        order, wall = run_dvc_logged(repro, project / "results/bench_llm.log", cwd=project, warm=True)
        figures["repro"] = {"command": f"dvc {' '.join(repro)}", "wall_s": round(wall, 1), "stages_run": order}
    stages = stage_records(project)
    finetune_s = sum(r["wall_s"] for s, r in stages.items() if s.startswith(FINETUNE_PREFIX))
    figures["wall_s"] = {"finetune_stages": round(finetune_s, 1),
                         "other_stages": round(sum(r["wall_s"] for s, r in stages.items()) - finetune_s, 1)}

    from featcal.io.checkpoints import CheckpointReader
    from featcal.io.models import resolve_model_ref
    import yaml

    base = yaml.safe_load((project / "params.yaml").read_text())["model"]["base"]
    figures["memory"] = memory_summary(stages, float32_model_mib(CheckpointReader(resolve_model_ref(base))))
    figures["block_phases_s"] = block_phases(stages)
    figures["block_phase_totals_s"] = phase_totals(figures["block_phases_s"])
    layer = args.float32_layer if args.float32_layer is not None else len(figures["block_phases_s"]) - 1
    figures["float32_products"] = float32_difference(project, layer)
    figures["nll"] = nll_table(json.loads((project / "results/metrics.json").read_text()))
    figures["gap_closed_positive_every_task"] = all((r["gap_closed"] or 0) > 0 for r in figures["nll"].values())
    figures["drift_plot"] = "results/plots/drift.png"
    merge_json(project / args.out, figures)
    print_report(figures)
    print(f"\n{project / args.out}")


if __name__ == "__main__":
    main()
