"""Benchmark (not a test): where one block's moment accumulation spends its seconds, matrix products against
everything else.

Issue 36 asks for one calibration at <= 2.6x the bare forwards. The moments phase of a float32-products
calibration of the demo takes more than its products' arithmetic would at this machine's GEMM speed; this says
what the rest is. It calibrates the demo (params.yaml's merge, values and calibration examples, the products
in `--product-dtype`) until block `--block` has all its batches' module inputs, keeps that block's calls to
`accumulate_block_moments` (the student's and the experts' captured inputs, every task and batch), stops the
walk at the next block's first batch, and replays those calls: `--repeats` timed replays, then one under torch's profiler, whose
operators are summed by name (`aten::mm` are the products; copy_ the float64 row copies, sum the row sums,
add_ the float32 products added into the float64 sums, ...). Run alone (machine otherwise idle):

    python bench/moments_breakdown.py [--block 1] [--product-dtype float32] [--repeats 5]

Figures: results/bench.json, `moments_breakdown`.
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import statistics
import sys
import time
from collections import defaultdict
from pathlib import Path

import torch
from torch.profiler import ProfilerActivity, profile

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "stages"))
from common import load_params  # noqa: E402

from featcal.calibration import calibrate as cal  # noqa: E402
from featcal.evaluation import compare as cmp  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parent))
from alpha_rerun import merge_json  # noqa: E402
from calibration_cost import demo_calibration  # noqa: E402


class _Recorded(Exception):
    """Raised at the first call past the recorded block: the rest of the walk is not needed."""


def record_block(block: int, run) -> list[tuple]:
    """The arguments of every `accumulate_block_moments` call of block `block` (the n-th distinct set of
    modules the walk passes) while `run()` calibrates."""
    calls: list[tuple] = []
    seen: list[frozenset] = []
    accumulate = cal.accumulate_block_moments

    def recording(family, modules, student_inputs, expert_inputs, stream, moments, *rest):
        key = frozenset(id(m) for m in modules.values())
        if key not in seen:
            seen.append(key)
        if len(seen) - 1 > block:
            raise _Recorded
        if len(seen) - 1 == block:
            calls.append((family, modules, dict(student_inputs), dict(expert_inputs), stream, *rest))
        return accumulate(family, modules, student_inputs, expert_inputs, stream, moments, *rest)

    cal.accumulate_block_moments = recording
    try:
        run()
    except _Recorded:
        pass
    finally:
        cal.accumulate_block_moments = accumulate
    if not calls:
        raise SystemExit(f"the walk has no block {block}")
    return calls


def replay(calls: list[tuple]) -> float:
    """Seconds to accumulate the recorded calls' moments afresh (one running sum per module, as for one task)."""
    moments: dict = {}
    start = time.perf_counter()
    for family, modules, xs, xe, stream, *rest in calls:
        cal.accumulate_block_moments(family, modules, xs, xe, stream, moments, *rest)
    return time.perf_counter() - start


def operator_seconds(calls: list[tuple]) -> tuple[float, dict[str, float]]:
    """One replay under the profiler: its wall seconds and the self CPU seconds per torch operator, largest
    first (their sum is less than the wall by the Python between the operators)."""
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        wall = replay(calls)
    totals: dict[str, float] = defaultdict(float)
    for event in prof.key_averages():
        totals[event.key] += event.self_cpu_time_total / 1e6
    return wall, dict(sorted(totals.items(), key=lambda kv: -kv[1]))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--block", type=int, default=1)
    parser.add_argument("--product-dtype", default="float32", choices=("float32", "float64"))
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--out", type=Path, default=Path("results/bench.json"))
    args = parser.parse_args()
    bench, merged, batches, config = demo_calibration(load_params())
    config = dataclasses.replace(config, product_dtype=args.product_dtype)
    with torch.no_grad():
        calls = record_block(args.block, lambda: cmp.run_featcal(bench, merged, batches, config))
        rows = sum(int(family.row_mask(next(iter(xs)), stream).sum()) for family, _modules, xs, _xe, stream, *_ in calls)
        replay(calls)   # warm-up
        walls = [replay(calls) for _ in range(args.repeats)]
        profiled_wall, ops = operator_seconds(calls)
    profiled = sum(ops.values())
    products = ops.get("aten::mm", 0.0)
    print(f"block {args.block}, {args.product_dtype} products: {len(calls)} batches, {rows} rows")
    print(f"replay: median {statistics.median(walls):.3f} s of {', '.join(f'{w:.3f}' for w in walls)}")
    print(f"profiled replay {profiled_wall:.3f} s, its operators {profiled:.3f} s: aten::mm {products:.3f} s ({products / profiled:.1%}), "
          f"the rest {profiled - products:.3f} s")
    for name, seconds in list(ops.items())[:12]:
        print(f"  {name:28s} {seconds:7.3f} s")
    merge_json(args.out, {"moments_breakdown": {
        "command": " ".join(["python bench/moments_breakdown.py", *sys.argv[1:]]),
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "threads": torch.get_num_threads(), "block": args.block, "product_dtype": args.product_dtype,
        "batches": len(calls), "rows": rows, "replay_s": [round(w, 3) for w in walls],
        "replay_median_s": round(statistics.median(walls), 3), "profiled_wall_s": round(profiled_wall, 3),
        "profiled_s": round(profiled, 3),
        "mm_s": round(products, 3), "other_s": round(profiled - products, 3),
        "operators_s": {k: round(v, 3) for k, v in list(ops.items())[:12]},
    }})


if __name__ == "__main__":
    sys.exit(main())
