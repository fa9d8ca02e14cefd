"""Benchmark (not a test): how FeatCal's calibration cost grows with examples, tasks and width.

Wall time and peak resident memory of one `featcal.calibration.calibrate` call on synthetic BERT encoders,
along three sweeps, each point in its own fresh subprocess (so its peak RSS is that run's alone):

- examples per task: 8 … 512   (4 tasks, hidden 256)
- number of tasks:   2 … 8     (64 examples per task, hidden 256)
- hidden width:      256 … 1024 (4 tasks, 64 examples per task; intermediate 4 x hidden)

Models (built in the child, nothing downloaded): a seeded random `transformers.BertModel`
(--layers blocks, 64-wide heads, a --vocab-word embedding) as the base; each expert is the base plus
a small random task vector (seeded noise of 0.02 x each parameter's std); the merged model is their
average (`featcal.merging.merge_state_dicts("average", ...)`). Calibration data: random token ids,
--seq tokens per example, batches of --batch-size (the demo's 16). FeatCal runs at the spec's values
with float32 moment products (`FeatCalConfig(product_dtype="float32")`, the default when
results/scaling.json was measured; the exact float64 path is now every default).

Per point the child reports, from `featcal.profiling.measure` around the `calibrate` call alone:
the wall time, the peak RSS during the call, and the *added* RSS = that peak minus the RSS right
before the call (the interpreter, torch, the N + 2 models and the batches are already resident).
The exponent b of cost ≈ a·x^b is fitted per sweep by least squares on log-log, for the wall time
and for the added RSS (the process baseline is mostly the interpreter, so the absolute peak would
hide the growth). Each point also keeps the seconds per phase of the walk
(`featcal.profiling.phase_times`; the table names the largest). Results go to
results/scaling.json and results/plots/scaling.png.

    .venv/bin/python bench/scaling.py            # every point (make bench-scaling)
    .venv/bin/python bench/scaling.py --quick    # 3 points per sweep, 1 run each, to a temp folder
    .venv/bin/python bench/scaling.py --point 4,64,256   # one point (tasks,examples,hidden), printed only

Each point runs once, and again (up to --reps, default 3, median kept) while its runs add up to less
than --min-time seconds of calibration: the short points, where noise is largest, get repeats.
Torch uses the machine's default thread count (printed). Measure on an idle machine: the 1-minute
load average before and after the sweep is recorded beside the figures.
"""

from __future__ import annotations

import argparse
import datetime
import json
import math
import os
import statistics
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

# The fixed point every sweep passes through, and what each sweep varies.
FIXED = {"tasks": 4, "examples": 64, "hidden": 256}
SWEEPS = {
    "examples": [8, 16, 32, 64, 128, 256, 512],
    "tasks": [2, 3, 4, 6, 8],
    "hidden": [256, 384, 512, 768, 1024],
}
QUICK_SWEEPS = {"examples": [16, 32, 64], "tasks": [2, 4, 8], "hidden": [256, 384, 512]}  # 7 distinct points
SWEEP_LABELS = {"examples": "examples per task", "tasks": "number of tasks", "hidden": "hidden width"}
TASK_VECTOR_SCALE = 0.02  # an expert's noise, relative to each parameter's std
INIT_STD = 0.02           # BERT's initializer range: the noise scale of parameters whose std is 0
RESULT_TAG = "RESULT "


# --- one point (child process) --------------------------------------------------------------------------


def build_models(hidden: int, tasks: int, layers: int, vocab: int, seq: int, seed: int):
    """Base, `tasks` experts (base + small random task vectors) and their average, all `BertModel`s."""
    import torch
    from transformers import BertConfig, BertModel

    from featcal.merging import merge_state_dicts

    cfg = BertConfig(vocab_size=vocab, hidden_size=hidden, num_hidden_layers=layers,
                     num_attention_heads=max(hidden // 64, 1), intermediate_size=4 * hidden,
                     max_position_embeddings=max(seq, 64))
    torch.manual_seed(seed)
    base = BertModel(cfg).eval()
    base_state = base.state_dict()
    expert_states = []
    for i in range(tasks):
        g = torch.Generator().manual_seed(seed + 1 + i)
        state = {}
        for name, value in base_state.items():
            if value.is_floating_point():
                std = float(value.std()) if value.numel() > 1 else 0.0
                scale = TASK_VECTOR_SCALE * (std if std > 0 else INIT_STD)
                value = value + scale * torch.randn(value.shape, generator=g, dtype=value.dtype)
            state[name] = value.clone()
        expert_states.append(state)
    experts = {}
    for i, state in enumerate(expert_states):
        model = BertModel(cfg).eval()
        model.load_state_dict(state)
        experts[f"task{i}"] = model
    merged = BertModel(cfg).eval()
    merged.load_state_dict(merge_state_dicts("average", base_state, expert_states))
    return base, experts, merged


def make_batches(tasks: int, examples: int, seq: int, batch_size: int, vocab: int, seed: int) -> dict:
    """Random token ids per task (no padding), cut into batches of `batch_size`."""
    import torch

    g = torch.Generator().manual_seed(seed + 1000)
    batches = {}
    for i in range(tasks):
        ids = torch.randint(1, vocab, (examples, seq), generator=g)
        batches[f"task{i}"] = [
            {"input_ids": ids[s:s + batch_size], "attention_mask": torch.ones_like(ids[s:s + batch_size])}
            for s in range(0, examples, batch_size)
        ]
    return batches


def run_point(tasks: int, examples: int, hidden: int, args: argparse.Namespace) -> dict:
    """Build the models and data, warm torch up, then measure one `calibrate` call."""
    t_start = time.perf_counter()
    import torch

    from featcal.calibration.config import FeatCalConfig
    from featcal.calibration.walk import calibrate
    from featcal.profiling import measure, phase_times

    base, experts, merged = build_models(hidden, tasks, args.layers, args.vocab, args.seq, args.seed)
    batches = make_batches(tasks, examples, args.seq, args.batch_size, args.vocab, args.seed)
    # warm-up outside the measurement: thread pools and kernels on first use (one forward, one solve)
    with torch.no_grad():
        merged(**batches["task0"][0])
    torch.linalg.solve(torch.eye(8, dtype=torch.float64), torch.ones(8, 1, dtype=torch.float64))
    setup_s = time.perf_counter() - t_start

    with phase_times() as phases, measure() as m:
        calibrate(merged, base, experts, batches, FeatCalConfig(product_dtype="float32"), inplace=True, progress=False)
    return {
        "tasks": tasks, "examples": examples, "hidden": hidden, "intermediate": 4 * hidden,
        "wall_s": m.wall_s, "peak_rss_mib": m.peak_rss_mib, "added_rss_mib": m.added_rss_mib,
        "baseline_rss_mib": m.peak_rss_mib - m.added_rss_mib, "setup_s": setup_s, "phases_s": dict(phases),
        "torch_threads": torch.get_num_threads(),
    }


# --- the sweeps (parent) -------------------------------------------------------------------------------


def child_cmd(point: tuple[int, int, int], args: argparse.Namespace) -> list[str]:
    return [sys.executable, str(Path(__file__).resolve()), "--child", ",".join(map(str, point)),
            "--layers", str(args.layers), "--seq", str(args.seq), "--batch-size", str(args.batch_size),
            "--vocab", str(args.vocab), "--seed", str(args.seed)]


def run_child(point: tuple[int, int, int], args: argparse.Namespace) -> dict:
    env = {**os.environ, "PYTHONWARNINGS": "ignore"}
    proc = subprocess.run(child_cmd(point, args), capture_output=True, text=True, env=env, cwd=ROOT)
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith(RESULT_TAG)]
    if proc.returncode != 0 or not lines:
        raise SystemExit(f"point tasks,examples,hidden={point} failed (exit {proc.returncode}):\n"
                         f"{proc.stdout[-2000:]}\n{proc.stderr[-4000:]}")
    return json.loads(lines[-1][len(RESULT_TAG):])


def point_of(sweep: str, x: int) -> tuple[int, int, int]:
    p = {**FIXED, sweep: x}
    return p["tasks"], p["examples"], p["hidden"]


def fit_power(xs: list[float], ys: list[float]) -> dict:
    """Least squares of log y = log a + b log x; returns a, b and R² (on the logs)."""
    import numpy as np

    lx, ly = np.log(np.asarray(xs, float)), np.log(np.asarray(ys, float))
    b, log_a = np.polyfit(lx, ly, 1)
    resid = ly - (log_a + b * lx)
    ss_tot = float(((ly - ly.mean()) ** 2).sum())
    r2 = 1.0 - float((resid ** 2).sum()) / ss_tot if ss_tot > 0 else float("nan")
    return {"a": float(math.exp(log_a)), "b": float(b), "r2": r2}


def summarise(runs: list[dict]) -> dict:
    """One point from its repeated runs: medians, plus every run's wall time."""
    med = lambda key: statistics.median(r[key] for r in runs)  # noqa: E731
    first = runs[0]
    names = {name for r in runs for name in r["phases_s"]}
    phases = {name: round(statistics.median(r["phases_s"].get(name, 0.0) for r in runs), 3) for name in names}
    return {
        "tasks": first["tasks"], "examples": first["examples"], "hidden": first["hidden"],
        "intermediate": first["intermediate"],
        "wall_s": round(med("wall_s"), 3), "wall_s_runs": [round(r["wall_s"], 3) for r in runs],
        "added_rss_mib": round(med("added_rss_mib"), 1), "peak_rss_mib": round(med("peak_rss_mib"), 1),
        "baseline_rss_mib": round(med("baseline_rss_mib"), 1), "setup_s": round(med("setup_s"), 2),
        "phases_s": dict(sorted(phases.items(), key=lambda kv: -kv[1])),
    }


def top_phase(row: dict) -> str:
    """The phase with the most time, as `name share%` of the wall time."""
    if not row["phases_s"]:
        return "-"
    name, seconds = next(iter(row["phases_s"].items()))
    return f"{name} {100 * seconds / row['wall_s']:.0f}%"


def plot(points: dict[str, list[dict]], fits: dict[str, dict], path: Path) -> None:
    """One log-log panel per sweep: wall time (left axis) and added RSS (right axis), fitted lines."""
    import numpy as np
    from matplotlib.ticker import FuncFormatter

    from featcal.evaluation.plots import _save, plt

    plain = FuncFormatter(lambda v, _: f"{v:g}")

    fig, axes = plt.subplots(1, len(points), figsize=(4.6 * len(points), 3.8))
    for ax, (sweep, rows) in zip(np.atleast_1d(axes), points.items()):
        xs = np.asarray([r[sweep] for r in rows], float)
        grid = np.geomspace(xs.min(), xs.max(), 50)
        rss_ax = ax.twinx()
        for axis, key, fit_key, color, marker, label in (
            (ax, "wall_s", "time", "C0", "o", "wall time (s)"),
            (rss_ax, "added_rss_mib", "added_rss", "C1", "s", "added RSS (MiB)"),
        ):
            fit = fits[sweep][fit_key]
            axis.plot(xs, [r[key] for r in rows], marker, color=color, label=label)
            axis.plot(grid, fit["a"] * grid ** fit["b"], "--", color=color, label=f"fit: b = {fit['b']:.2f}")
            axis.set_xscale("log", base=2)
            axis.set_yscale("log")
            axis.tick_params(axis="y", which="both", colors=color, labelsize=8)
            axis.yaxis.set_major_formatter(plain)
            axis.yaxis.set_minor_formatter(plain)
        ax.set_ylabel("wall time (s)", color="C0")
        rss_ax.set_ylabel("added RSS (MiB)", color="C1")
        ax.set_xlabel(SWEEP_LABELS[sweep])
        fixed = ", ".join(f"{k} {v}" for k, v in FIXED.items() if k != sweep)
        ax.set_title(f"{SWEEP_LABELS[sweep]} ({fixed})", fontsize=9)
        ax.set_xticks(xs, [str(int(x)) for x in xs])
        ax.xaxis.set_minor_formatter(FuncFormatter(lambda v, _: ""))
        ax.grid(alpha=0.3, which="both")
        handles = [h for a in (ax, rss_ax) for h in a.get_legend_handles_labels()[0]]
        labels = [lb for a in (ax, rss_ax) for lb in a.get_legend_handles_labels()[1]]
        ax.legend(handles, labels, fontsize=8, loc="upper left")
    fig.tight_layout()
    _save(fig, path)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--quick", action="store_true", help="3 points per sweep, 1 run each (smoke run)")
    p.add_argument("--reps", type=int, default=None, help="most fresh-process runs per point, median kept "
                   "(default 3; 1 with --quick)")
    p.add_argument("--min-time", type=float, default=5.0, help="a point is run again (up to --reps runs) "
                   "while its runs' calibration seconds add up to less than this: short, noisy points get "
                   "repeats, long ones run once")
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--seq", type=int, default=32, help="tokens per example")
    p.add_argument("--batch-size", type=int, default=16)
    p.add_argument("--vocab", type=int, default=1000)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", type=Path, default=None, help="JSON (default results/scaling.json; "
                   "with --quick a temporary folder)")
    p.add_argument("--plot", type=Path, default=None, help="PNG (default results/plots/scaling.png, "
                   "beside --out with --quick)")
    p.add_argument("--point", default=None, help="measure one point tasks,examples,hidden and print it")
    p.add_argument("--child", default=None, help=argparse.SUPPRESS)
    args = p.parse_args()

    if args.child:
        tasks, examples, hidden = map(int, args.child.split(","))
        print(RESULT_TAG + json.dumps(run_point(tasks, examples, hidden, args)), flush=True)
        return
    if args.point:
        point = tuple(map(int, args.point.split(",")))
        print(json.dumps(run_child(point, args), indent=1))
        return

    sweeps = QUICK_SWEEPS if args.quick else SWEEPS
    reps = args.reps or (1 if args.quick else 3)
    if args.quick and args.out is None:
        args.out = Path(tempfile.mkdtemp(prefix="featcal-scaling-")) / "scaling.json"
    out = args.out or ROOT / "results" / "scaling.json"
    plot_path = args.plot or (out.parent / "scaling.png" if args.quick else ROOT / "results" / "plots" / "scaling.png")

    unique = sorted({point_of(s, x) for s, xs in sweeps.items() for x in xs}, key=lambda q: (q[2], q[0], q[1]))
    load_before = os.getloadavg()[0]
    print(f"scaling: {len(unique)} distinct points, up to {reps} run(s) each (repeated while under "
          f"{args.min_time:g} s in all), each in a fresh process; BERT {args.layers} "
          f"layers, {args.seq} tokens, batches of {args.batch_size}; 1-min load average {load_before:.2f} "
          f"on {os.cpu_count()} CPUs", flush=True)
    t0 = time.perf_counter()
    measured: dict[tuple[int, int, int], dict] = {}
    threads = None
    for i, point in enumerate(unique, 1):
        runs = [run_child(point, args)]
        while len(runs) < reps and sum(r["wall_s"] for r in runs) < args.min_time:
            runs.append(run_child(point, args))
        threads = runs[0]["torch_threads"]
        measured[point] = summarise(runs)
        m = measured[point]
        print(f"  [{i:2d}/{len(unique)}] tasks {point[0]}, examples {point[1]}, hidden {point[2]}: "
              f"{m['wall_s']:.2f} s, +{m['added_rss_mib']:.0f} MiB (runs {m['wall_s_runs']})", flush=True)
    total_s = time.perf_counter() - t0
    load_after = os.getloadavg()[0]

    points = {s: [{"sweep": s, "x": x, **measured[point_of(s, x)]} for x in xs] for s, xs in sweeps.items()}
    fits = {s: {"time": fit_power([r["x"] for r in rows], [r["wall_s"] for r in rows]),
                "added_rss": fit_power([r["x"] for r in rows], [max(r["added_rss_mib"], 1e-3) for r in rows])}
            for s, rows in points.items()}

    print(f"\ntorch threads {threads}; {total_s:.0f} s in all; load average {load_before:.2f} -> {load_after:.2f}")
    print(f"{'sweep':9s} {'x':>5s} {'tasks':>5s} {'ex/task':>7s} {'hidden':>6s} {'wall s':>8s} "
          f"{'added MiB':>9s} {'peak MiB':>8s}  largest phase")
    for s, rows in points.items():
        for r in rows:
            print(f"{s:9s} {r['x']:5d} {r['tasks']:5d} {r['examples']:7d} {r['hidden']:6d} {r['wall_s']:8.2f} "
                  f"{r['added_rss_mib']:9.0f} {r['peak_rss_mib']:8.0f}  {top_phase(r)}")
    print("fitted exponents b of cost ≈ a·x^b (log-log least squares; RSS = added above the pre-call RSS):")
    for s, f in fits.items():
        print(f"  {SWEEP_LABELS[s]:18s} time b = {f['time']['b']:.2f} (R² {f['time']['r2']:.3f})   "
              f"added RSS b = {f['added_rss']['b']:.2f} (R² {f['added_rss']['r2']:.3f})")

    import torch
    report = {
        "what": "featcal.calibration.calibrate wall time and peak RSS on synthetic BERT encoders, one fresh process per run; "
                "added_rss_mib = peak RSS during calibrate minus the RSS right before it (interpreter, torch, "
                "models and batches already resident); the RSS fit is on added_rss_mib; per point the median of "
                "the runs",
        "date": datetime.datetime.now().isoformat(timespec="seconds"),
        "quick": args.quick,
        "setup": {"layers": args.layers, "seq": args.seq, "batch_size": args.batch_size, "vocab": args.vocab,
                  "intermediate": "4 x hidden", "task_vector_scale": TASK_VECTOR_SCALE, "merge": "average",
                  "featcal_config": "defaults", "fixed": FIXED, "max_reps": reps, "min_time_s": args.min_time,
                  "seed": args.seed},
        "machine": {"cpus": os.cpu_count(), "torch_threads": threads, "torch": torch.__version__,
                    "load_avg_1min_before": round(load_before, 2), "load_avg_1min_after": round(load_after, 2),
                    "total_s": round(total_s, 1)},
        "points": points,
        "fits": fits,
    }
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_name(f".{out.name}.tmp")
    tmp.write_text(json.dumps(report, indent=1) + "\n")
    os.replace(tmp, out)
    plot(points, fits, plot_path)
    print(f"wrote {out} and {plot_path}")


if __name__ == "__main__":
    main()
