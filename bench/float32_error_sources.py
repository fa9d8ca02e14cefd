"""Benchmark (not a test): where float32 moment products' distance to the float64 path comes from, and
what closing it would cost.

Issue 36 asks for one calibration at ≤ 2.6× the bare forwards with weights within 1e-5 of the float64
path. float32 products (`featcal.product_dtype: float32`) came close on both: ~2.6× and ~1.4e-5 (make bench);
since 581d376 only their student Gram is float32 (the crosses exact): ~2.97× and 7.3e-6 (the variants below now differ in
the Gram alone; the run before that change: `git show da1781f:results/float32_error_sources.json`).
This calibrates the demo (params.yaml's merge, values and calibration examples) in float64 and then in
float32 variants, each patched into `featcal.calibration.moments.LinearMoments` for this process only
(none is a product option; they are measured to know whether one should be):

- `float32`: the option as it is (each batch's student Gram of centred rows in float32, the rest float64);
- `narrowing64`: the narrowing modules' products (`add_projected`: an FFN's down projection) in float64;
- `others64`: every other module's products in float64;
- `chunkR`: others64, and the narrowing modules' rows centred and multiplied R rows at a time;
- `allchunkR`: every module's rows centred and multiplied R rows at a time, all in float32.

Per variant: wall seconds over the float64 calibration's (same run) and the largest max|ΔW|/max|W| over
tensors, with the tensors furthest off. Run alone (machine otherwise idle):
    python bench/float32_error_sources.py [VARIANT ...]
Figures: results/float32_error_sources.json.
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import json
import re
import shlex
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "stages"))
from common import load_params  # noqa: E402

from featcal.calibration import moments  # noqa: E402
from featcal.evaluation import compare as cmp  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parent))
from calibration_cost import demo_calibration, relative_differences  # noqa: E402

DEFAULT_VARIANTS = ["float32", "narrowing64", "others64", "chunk256", "chunk512", "allchunk256", "allchunk128"]
OF_ROWS, ADD_PROJECTED = moments.LinearMoments.of_rows, moments.LinearMoments.add_projected


def _part(x, i: int, rows: int):
    return None if x is None else x[i:i + rows]


def patch(variant: str) -> None:
    """Point LinearMoments' two batch entries at `variant`'s products (`float32`: back to the originals)."""
    chunked = re.fullmatch(r"(all)?chunk(\d+)", variant)
    if variant not in ("float32", "narrowing64", "others64") and not chunked:
        raise SystemExit(f"unknown variant {variant!r}: float32, narrowing64, others64, chunkR or allchunkR")
    rows = int(chunked.group(2)) if chunked else 0
    of_rows, add_projected = OF_ROWS, ADD_PROJECTED
    if variant == "others64" or (chunked and not chunked.group(1)):
        def of_rows(s, e, w=None, p=None, dtype=torch.float64):
            return OF_ROWS(s, e, w, p, torch.float64)
    if variant == "narrowing64":
        def add_projected(self, s, e, p, w=None, dtype=torch.float64, weight=None):
            ADD_PROJECTED(self, s, e, p, w, torch.float64, weight)
    if chunked:
        def add_projected(self, s, e, p, w=None, dtype=torch.float64, weight=None):
            for i in range(0, s.shape[0], rows):
                ADD_PROJECTED(self, s[i:i + rows], e[i:i + rows], p[i:i + rows], _part(w, i, rows), dtype, weight)
    if chunked and chunked.group(1):
        def of_rows(s, e, w=None, p=None, dtype=torch.float64):
            out = moments.LinearMoments()
            for i in range(0, s.shape[0], rows):
                out.merge(OF_ROWS(s[i:i + rows], e[i:i + rows], _part(w, i, rows), _part(p, i, rows), dtype))
            return out
    moments.LinearMoments.of_rows = staticmethod(of_rows)
    moments.LinearMoments.add_projected = add_projected


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("variants", nargs="*", default=DEFAULT_VARIANTS)
    parser.add_argument("--out", default="results/float32_error_sources.json")
    args = parser.parse_args()
    for variant in args.variants:   # every name checked before the models load
        patch(variant)
    patch("float32")
    params = load_params()
    bench, merged, batches, config = demo_calibration(params)
    exact, fast = (dataclasses.replace(config, product_dtype=d) for d in ("float64", "float32"))
    cmp.run_featcal(bench, merged, {t: b[:1] for t, b in batches.items()}, exact)   # warm-up, not counted
    start = time.perf_counter()
    reference = cmp.run_featcal(bench, merged, batches, exact)[0].state_dict()
    exact_s = time.perf_counter() - start
    print(f"threads {torch.get_num_threads()}; float64 products: {exact_s:.1f} s")
    rows = {}
    try:
        for variant in args.variants:
            patch(variant)
            start = time.perf_counter()
            state = cmp.run_featcal(bench, merged, batches, fast)[0].state_dict()
            seconds = time.perf_counter() - start
            worst = relative_differences(state, reference)[:3]
            rows[variant] = {"wall_s": round(seconds, 2), "over_float64": round(seconds / exact_s, 3),
                             "max_rel_diff": worst[0][0], "furthest": {n: d for d, n in worst}}
            print(f"{variant:12s} {seconds:6.1f} s  {seconds / exact_s:.3f} of float64  max rel diff {worst[0][0]:.2e} "
                  f"({', '.join(f'{n} {d:.1e}' for d, n in worst)})", flush=True)
    finally:
        patch("float32")
    Path(args.out).write_text(json.dumps({
        "command": shlex.join(["python", *sys.argv]), "date": datetime.datetime.now(datetime.timezone.utc).isoformat(
            timespec="seconds"), "threads": torch.get_num_threads(), "ridge": config.ridge,
        "float64_wall_s": round(exact_s, 2), "variants": rows}, indent=2) + "\n")


if __name__ == "__main__":
    main()
