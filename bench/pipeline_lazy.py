"""Benchmark (not a test): each stage's peak RSS in a real `dvc repro` of a large synthetic model,
against one calibrate-layer step done the pre-streaming way (every model loaded whole).

The pipeline is the project's own (dvc.yaml, stages/, featcal/ copied into a fresh git + DVC
repository by tests/tiny_project.py's helpers), run with this interpreter:

- base: a randomly initialised (seeded) BERT, --layers blocks of width --hidden (64-wide heads,
  intermediate 4x), a word-level tokenizer with --vocab entries (real words + `[unusedN]` fillers);
- --experts experts: BertForSequenceClassification copies of the base, every backbone parameter
  perturbed by seeded noise of 0.02x its std, each with its own random 2-class head, saved as HF
  folders and handed to the pipeline through `experts.paths` (finetune@<task> only loads and scores);
- one synthetic two-class text task per expert (CSV, 60 train / 20 dev / 30 test), --examples
  calibration examples per task, 32 tokens.

Every stage records its peak RSS in results/timing/<stage>.json (stages/common.py `timed`). The
reference runs in its own subprocess, so its peak RSS is its own: it loads the merged model, the
base and every expert whole and walks the middle block with in-memory weights from the same
caches the calibrate-layer stage read, which is what one calibrate-layer stage did before the
stages streamed one block per checkpoint. It also compares its block with the stage's output.

    .venv/bin/python bench/pipeline_lazy.py            # full size (make bench-lazy); see below
    .venv/bin/python bench/pipeline_lazy.py --layers 2 --hidden 64 --experts 2 --vocab 500 --out /tmp/b.json

At full size a checkpoint is ~0.8 GB: the work folder needs ~22 GB of disk (expert sources, the
pipeline's experts/ and their DVC cache copies, merged and calibrated models), and ~12 GB of RAM:
the reference holds 10 models whole plus a block's float64 moments (as does the merge stage while
it loads every expert whole). At small sizes every process is dominated by the interpreter and its
imports (~0.45 GB), so ratios are near 1 there.

`pipeline_stage_peak_rss_ratio` is the largest of all stages (the merge stage included) ÷ the
reference; `streaming_stage_peak_rss_ratio` the same over the stages that read one block per
checkpoint (collect-*-features, calibrate-layer@*).
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import resource
import shlex
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "tests"))

from tiny_project import make_base, make_project, make_tasks, make_vocab, project_env, run_dvc_logged, tiny_params  # noqa: E402

# Words that decide a task's label (four per task) and the words sentences are padded with.
CUE_WORDS = ("good bad great awful sport team vote party happy sad win lose hot cold fast slow rich poor old new "
             "love hate open closed early late light dark loud quiet safe risky clean dirty strong weak calm angry "
             "cheap costly north south summer winter city village up down").split()
FILLER = "the a and news of to in is on with for it this that was".split()
INIT_STD = 0.02          # BERT's initializer range: the noise scale of parameters whose std is 0
PERTURBATION = 0.02      # an expert's noise, relative to each parameter's std
STREAMING_STAGES = ("collect-expert-features", "collect-test-features", "calibrate-layer@")
GOAL = 1 / 3


def mib(kib: float) -> float:
    return kib / 1024


def peak_rss_mib() -> float:
    """This process's peak resident set size (getrusage reports KiB on Linux)."""
    return mib(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss)


def folder_mb(folder: Path) -> float:
    return sum(p.stat().st_size for p in folder.rglob("*") if p.is_file()) / 1e6


# --- building the project ----------------------------------------------------------------------------


def task_names(n: int) -> list[str]:
    return [f"task{i}" for i in range(n)]


def cue_words(n_tasks: int) -> list[str]:
    """Four distinct cue words per task: the real words first, numbered copies when they run out."""
    need = 4 * n_tasks
    words = list(CUE_WORDS)
    round_ = 1
    while len(words) < need:
        words += [f"{w}{round_}" for w in CUE_WORDS]
        round_ += 1
    return words[:need]


def task_rules(tasks: list[str]) -> dict[str, tuple[list[str], list[str]]]:
    """Per task: two words that mark label 0 and two that mark label 1."""
    words = cue_words(len(tasks))
    return {t: (words[4 * i:4 * i + 2], words[4 * i + 2:4 * i + 4]) for i, t in enumerate(tasks)}


def perturbed(value, generator):
    """The base tensor plus seeded noise of PERTURBATION x its std (norm scales and biases start
    constant, std 0: they get PERTURBATION x INIT_STD, so every backbone parameter differs)."""
    import torch

    std = float(value.float().std()) if value.numel() > 1 else 0.0
    scale = PERTURBATION * (std if std > 0 else INIT_STD)
    return value + scale * torch.randn(value.shape, generator=generator, dtype=value.dtype)


def make_experts(base: Path, out: Path, tasks: list[str], seed: int) -> dict[str, str]:
    """One classifier folder per task: the base's backbone perturbed, a random 2-class head.
    The model is loaded once and its backbone re-perturbed from a saved copy for each expert."""
    import torch
    from transformers import BertForSequenceClassification

    torch.manual_seed(seed)
    model = BertForSequenceClassification.from_pretrained(base, num_labels=2).eval()
    base_state = {k: v.clone() for k, v in model.bert.state_dict().items()}
    paths = {}
    for i, task in enumerate(tasks):
        g = torch.Generator().manual_seed(seed + 1 + i)
        with torch.no_grad():
            for name, param in model.bert.named_parameters():
                param.copy_(perturbed(base_state[name], g))
            model.classifier.weight.normal_(0, INIT_STD, generator=g)
            model.classifier.bias.zero_()
        paths[task] = str(out / task)
        model.save_pretrained(paths[task])
        print(f"  expert {i + 1}/{len(tasks)} saved", flush=True)
    return paths


def bench_params(base: Path, tasks: dict, experts: dict[str, str], examples: int) -> dict:
    """tests/tiny_project.py's params with the bench's sizes and the given experts."""
    params = tiny_params(base, tasks)
    params["tokens"] = {"max_length": 32, "per_task": {}}
    params["calibration"] = {"examples_per_task": examples, "batch_size": 16}   # the demo's batch size
    params["experts"] = {"paths": dict(experts)}
    return params


def build_project(work: Path, args: argparse.Namespace) -> Path:
    """Base, experts, task CSVs and a committed git + DVC project under `work`; returns the project."""
    from transformers.utils import logging as hf_logging

    hf_logging.set_verbosity_error()   # "newly initialized classifier" is what the experts' heads are
    hf_logging.disable_progress_bar()
    tasks = task_names(args.experts)
    rules = task_rules(tasks)
    words = FILLER + [w for pair in rules.values() for side in pair for w in side]
    make_base(work / "base", args.layers, hidden=args.hidden, heads=max(1, args.hidden // 64),
              intermediate=4 * args.hidden, vocab=make_vocab(words, args.vocab), max_positions=512, seed=args.seed)
    print(f"  base saved ({folder_mb(work / 'base'):.0f} MB)", flush=True)
    experts = make_experts(work / "base", work / "experts", tasks, args.seed)
    specs = make_tasks(work / "raw", rules=rules, filler=FILLER, seed=args.seed)
    return make_project(work, bench_params(work / "base", specs, experts, args.examples))


# --- running the pipeline ----------------------------------------------------------------------------


def repro(project: Path, log: Path) -> tuple[list[str], float]:
    """`dvc repro` in the project, its full output in `log`; returns the stages run, in order,
    and the wall seconds. The stage lines are echoed as they start."""
    env = dict(project_env(), TRANSFORMERS_OFFLINE="1", TOKENIZERS_PARALLELISM="false")
    return run_dvc_logged(["repro"], log, cwd=project, env=env)


def stage_timings(project: Path, order: list[str]) -> dict[str, dict]:
    """{stage: {wall_s, peak_rss_mib}} from results/timing/*.json, in the order the stages ran."""
    found = {}
    for path in (project / "results/timing").glob("*.json"):
        record = json.loads(path.read_text())
        found[record.get("stage", path.stem)] = {"wall_s": record["wall_s"], "peak_rss_mib": record["peak_rss_mib"]}
    rank = {name: i for i, name in enumerate(order)}
    return dict(sorted(found.items(), key=lambda kv: (rank.get(kv[0], len(rank)), kv[0])))


# --- the whole-model reference (its own process) ---------------------------------------------------------


def reference(project: Path, layer: int) -> dict:
    """One calibrate-layer step as before the streaming rewrite: merged, base and every expert
    loaded whole, block `layer` walked with in-memory weights from the stage's own caches."""
    started = time.perf_counter()
    import torch
    import yaml
    from safetensors.torch import load_file

    from featcal.calibration.config import FeatCalConfig
    from featcal.data.splits import batches_from_arrays
    from featcal.families import family_for
    from featcal.io.models import load_backbone, load_classifier
    from featcal.io.feature_store import read_group
    from featcal.calibration.walk import CachedExpertStates, ModuleWeights, split_like, walk

    params = yaml.safe_load((project / "params.yaml").read_text())
    tasks = [t for t, spec in params["tasks"].items() if (spec or {}).get("enabled", True)]
    imports_mib = peak_rss_mib()
    t_load = time.perf_counter()
    merged = load_backbone(str(project / "models/merged"))
    base = load_backbone(params["model"]["base"])
    experts = {t: load_classifier(str(project / "experts" / t)) for t in tasks}
    t_walk = time.perf_counter()
    family = family_for(merged)
    student = family.backbone(merged).eval()
    weights = ModuleWeights(family.backbone(base).eval(), {t: family.backbone(m).eval() for t, m in experts.items()})
    batches = batches_from_arrays(read_group(project / "features/experts/inputs.zarr"),
                                  int(params["calibration"]["batch_size"]))
    entry = {t: [family.enter(student, b) for b in batches[t]] for t in tasks}
    student_in = entry if layer == 0 else split_like(
        family, layer, read_group(project / f"calib/student/layer_{layer:02d}.zarr"), entry, {t: student for t in entry})
    del entry
    states = CachedExpertStates(family, lambda k: read_group(project / f"features/experts/layer_{k:02d}.zarr"))
    walk(family, student, weights, student_in, states, FeatCalConfig.from_mapping(params["featcal"]),
         start=layer, stop=layer + 1, progress=False)
    t_end = time.perf_counter()
    stage_out = load_file(project / f"calib/layers/L{layer:02d}.safetensors")
    mine = student.state_dict()
    diff = max(float((mine[n] - v).abs().max()) for n, v in stage_out.items())
    return {"layer": layer, "peak_rss_mib": round(peak_rss_mib(), 1), "imports_rss_mib": round(imports_mib, 1),
            "startup_s": round(t_load - started, 2),
            "load_s": round(t_walk - t_load, 2), "walk_s": round(t_end - t_walk, 2),
            "max_abs_diff_vs_stage": diff, "threads": torch.get_num_threads()}


def run_reference(project: Path, layer: int) -> dict:
    cmd = [sys.executable, __file__, "--reference", str(project), "--layer", str(layer)]
    start = time.perf_counter()
    proc = subprocess.run(cmd, capture_output=True, text=True, env=project_env())
    if proc.returncode != 0:
        raise SystemExit(f"whole-model reference failed:\n{proc.stdout[-2000:]}\n{proc.stderr[-4000:]}")
    line = [ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT ")][-1]
    return {**json.loads(line[len("RESULT "):]), "wall_s": round(time.perf_counter() - start, 2)}


# --- report ------------------------------------------------------------------------------------------


def is_streaming(stage: str) -> bool:
    return stage.startswith(STREAMING_STAGES)


def summarise(stages: dict[str, dict], whole: dict) -> dict:
    """Each stage's ratio to the reference; the largest stage overall and among the streaming ones."""
    ref = whole["peak_rss_mib"]
    for record in stages.values():
        record["ratio"] = round(record["peak_rss_mib"] / ref, 3)
    largest = max(stages, key=lambda s: stages[s]["peak_rss_mib"])
    streaming = [s for s in stages if is_streaming(s)]
    largest_streaming = max(streaming, key=lambda s: stages[s]["peak_rss_mib"]) if streaming else None
    return {
        "pipeline_stage_peak_rss_ratio": stages[largest]["ratio"],
        "largest_stage": largest,
        "streaming_stage_peak_rss_ratio": stages[largest_streaming]["ratio"] if largest_streaming else None,
        "largest_streaming_stage": largest_streaming,
    }


def print_report(stages: dict[str, dict], whole: dict, summary: dict, repro_s: float, header: str) -> None:
    print()
    print(header)
    print(f"{'stage':34s} {'wall s':>8s} {'peak RSS MiB':>13s} {'÷ whole-model':>14s}")
    for name, r in stages.items():
        print(f"{name:34s} {r['wall_s']:8.1f} {r['peak_rss_mib']:13.0f} {r['ratio']:14.3f}")
    print(f"{'whole-model calibrate-layer@L%02d' % whole['layer']:34s} {whole['wall_s']:8.1f} "
          f"{whole['peak_rss_mib']:13.0f} {1:14.3f}   (load {whole['load_s']:.1f} s, walk {whole['walk_s']:.1f} s)")
    print(f"dvc repro wall: {repro_s:.1f} s; the reference's interpreter and imports alone: "
          f"{whole['imports_rss_mib']:.0f} MiB")
    print(f"reference block vs the stage's calibrated block: max |diff| {whole['max_abs_diff_vs_stage']:.3g}")
    print(f"largest streaming stage: {summary['largest_streaming_stage']} "
          f"({summary['streaming_stage_peak_rss_ratio']} x whole-model)")
    verdict = "meets" if summary["pipeline_stage_peak_rss_ratio"] <= GOAL else "misses"
    print(f"pipeline_stage_peak_rss_ratio {summary['pipeline_stage_peak_rss_ratio']:.3f} "
          f"(largest stage: {summary['largest_stage']}; goal <= 1/3: {verdict})")


def write_report(path: Path, record: dict) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(record, indent=2) + "\n")
    print(f"wrote {path}")


# --- main --------------------------------------------------------------------------------------------


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--layers", type=int, default=24, help="BERT blocks")
    p.add_argument("--hidden", type=int, default=768, help="hidden width (heads: width / 64, intermediate: 4x)")
    p.add_argument("--vocab", type=int, default=30522, help="tokenizer vocabulary entries")
    p.add_argument("--experts", type=int, default=8, help="experts, one synthetic task each")
    p.add_argument("--examples", type=int, default=32, help="calibration examples per task")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--work", type=Path, default=None,
                   help="a new or empty folder to build in (default: a temporary folder)")
    p.add_argument("--keep", action="store_true", help="keep the work folder")
    p.add_argument("--out", type=Path, default=ROOT / "results/bench_lazy.json", help="where the figures go")
    p.add_argument("--reference", type=Path, default=None, help=argparse.SUPPRESS)
    p.add_argument("--layer", type=int, default=None, help=argparse.SUPPRESS)
    return p.parse_args()


def work_folder(arg: Path | None) -> Path:
    """The folder to build in; a given one must be new or empty, since it is removed at the end."""
    if arg is None:
        return Path(tempfile.mkdtemp(prefix="featcal-pipeline-lazy-"))
    if arg.exists() and any(arg.iterdir()):
        raise SystemExit(f"--work {arg}: not empty (it is removed at the end unless --keep); give a new folder")
    arg.mkdir(parents=True, exist_ok=True)
    return arg


def main() -> None:
    args = parse_args()
    if args.reference is not None:
        print("RESULT " + json.dumps(reference(args.reference, args.layer)), flush=True)
        return
    import torch

    work = work_folder(args.work)
    sizes = {"layers": args.layers, "hidden": args.hidden, "intermediate": 4 * args.hidden, "vocab": args.vocab,
             "experts": args.experts, "examples_per_task": args.examples, "max_length": 32}
    print(f"building in {work}: {sizes}", flush=True)
    try:
        t0 = time.perf_counter()
        project = build_project(work, args)
        print(f"  built in {time.perf_counter() - t0:.0f} s; running dvc repro", flush=True)
        order, repro_s = repro(project, work / "repro.log")
        stages = stage_timings(project, order)
        layer = args.layers // 2
        print(f"  whole-model reference (block {layer}) …", flush=True)
        whole = run_reference(project, layer)
        summary = summarise(stages, whole)
        model_mb = folder_mb(work / "base")
        header = (f"pipeline_lazy: BERT {args.layers} layers, hidden {args.hidden}, vocab {args.vocab}, "
                  f"{args.experts} experts, {args.examples} calibration examples/task; "
                  f"{model_mb:.0f} MB per checkpoint; {torch.get_num_threads()} torch threads")
        print_report(stages, whole, summary, repro_s, header)
        write_report(args.out, {
            **summary, "goal": "<= 1/3", "sizes": sizes, "checkpoint_mb": round(model_mb, 1),
            "stages": stages, "whole_model_reference": whole, "dvc_repro_wall_s": round(repro_s, 1),
            "threads": torch.get_num_threads(), "command": shlex.join([Path(sys.executable).name, *sys.argv]),
            "date": datetime.datetime.now().astimezone().isoformat(timespec="seconds"),
        })
    finally:
        if args.keep:
            print(f"kept {work}")
        else:
            shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
