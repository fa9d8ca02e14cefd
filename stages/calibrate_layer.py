"""DVC stage `calibrate-layer@Lkk`: calibrate one block from the cached states entering it.

Reads the student states entering block k (layer 0: the merged embeddings), the experts' states
entering block k, and from each checkpoint (merged, base, experts) only block k's tensors (plus
the merged embeddings that rebuild the blocks' inputs); writes the calibrated block parameters,
the block's record (its solves' conditions; with `cache.moments: true` also its float64 moment sums,
keyed by module/task) and the student states entering block k+1.
Runs data-parallel under torchrun when `parallel.nproc_per_node` > 1.
"""

from __future__ import annotations

import argparse
from dataclasses import asdict

from common import enabled_tasks, get, load_params, setup_logging, timed
from parallel import relaunch_under_torchrun
from safetensors.torch import save_file

from featcal.calibration import distributed
from featcal.calibration.config import FeatCalConfig, HYPER_KEYS
from featcal.data.splits import batches_from_arrays
from featcal.calibration.layerwise import calibrate_cached_layer
from featcal.calibration.walk import states_of
from featcal.io.models import atomic_file, check_finite
from featcal.profiling import trim_heap
from featcal.calibration.moments import moments_layout, packed_row
from featcal.calibration.solve import ILL_CONDITIONED
from featcal.io.feature_store import StoreFormat, read_group, write_group, write_rows


def calibrate_from_caches(params: dict, k: int, config: FeatCalConfig, merged: str, experts: str, features: str,
                          student_in: str, keep_moments: bool = True):
    """Block k calibrated from the pipeline's caches: the calibration inputs and the experts' states
    under `features`, the student states entering it (`student_in`; unused for block 0) and the weights
    of `merged`, the base and `experts`/<task>; data-parallel under torchrun (this process's shard)."""
    tasks = enabled_tasks(params)
    batch_size = int(get(params, "calibration.batch_size"))
    batches = batches_from_arrays(read_group(f"{features}/inputs.zarr"), batch_size)
    batches = distributed.shard_batches({t: batches[t] for t in tasks})

    def states(path: str) -> dict:
        return distributed.shard_examples(states_of(read_group(path), tasks), batch_size)

    student = None if k == 0 else states(student_in)
    return calibrate_cached_layer(
        k, merged, get(params, "model.base"), {t: f"{experts}/{t}" for t in tasks}, batches, student,
        lambda layer: states(f"{features}/layer_{layer:02d}.zarr"), config,
        # one process: no reducer, so that a stage keeping no moments folds each task into the systems as
        # soon as its rows are in (calibrate_block's fold): one task's d x d sums held, not every task's
        reduce_moments=distributed.AllReduceMoments(tasks) if distributed.is_distributed() else None,
        reduce_sums=distributed.all_reduce_sums,
        keep_moments=keep_moments,
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layer", type=int, required=True)
    parser.add_argument("--featcal-params", default="params.yaml",
                        help="file whose featcal.alpha/rho/ridge override params.yaml's (tune/best.yaml when tuned)")
    parser.add_argument("--merged", required=True, help="the merged multi-task model folder")
    parser.add_argument("--experts", required=True, help="folder of the experts, one sub-folder per task")
    parser.add_argument("--features", required=True, help="the experts' cached states (inputs.zarr, layer_XX.zarr)")
    parser.add_argument("--student-in", required=True,
                        help="the student states entering the block (zarr; layer 0: the merged model, whose embeddings give them)")
    parser.add_argument("--layer-out", required=True, help="where the calibrated block parameters are written")
    parser.add_argument("--moments-out", required=True, help="where the block's record and, with cache.moments, its moment sums (zarr) are written")
    parser.add_argument("--student-out", required=True, help="where the student states entering block k+1 are written")
    args = parser.parse_args()
    k = args.layer
    setup_logging()
    params = load_params()
    relaunch_under_torchrun(int(get(params, "parallel.nproc_per_node", 1)))
    tasks = enabled_tasks(params)
    name = f"L{k:02d}"
    batch_size = int(get(params, "calibration.batch_size"))
    fmt = StoreFormat(get(params, "cache.dtype", "float32"), get(params, "cache.compressor", "zstd"))
    keep_moments = bool(get(params, "cache.moments", False))
    with timed(f"calibrate-layer@{name}"):
        featcal = dict(get(params, "featcal"))
        if args.featcal_params != "params.yaml":
            tuned = get(load_params(args.featcal_params), "featcal")
            featcal.update({key: tuned[key] for key in (*HYPER_KEYS, "layer_overrides") if key in tuned})
        config = FeatCalConfig.from_mapping(featcal)
        out = calibrate_from_caches(params, k, config, args.merged, args.experts, args.features, args.student_in,
                                    keep_moments=keep_moments)
        student_next = distributed.gather_examples(out.student_next, batch_size)
        out.student_next = {}
        if distributed.is_main():
            check_finite(out.parameters, f"refusing to write {args.layer_out}")
            check_finite(student_next, f"refusing to write {args.student_out}")
            with atomic_file(args.layer_out) as tmp:
                save_file(out.parameters, tmp)
            # each output written and dropped in turn, so the stage's peak is the walk's, not the writes'
            write_group(args.student_out, student_next,
                        {"layer": k + 1, "drift_l2": out.drift.l2, "drift_cosine": out.drift.cosine}, fmt=fmt)
            del student_next
            trim_heap()
            record = {"layer": k, "tasks": tasks, "solves": [asdict(r) for r in out.reports]}
            if keep_moments:   # each task's row built, written and released in turn
                meta = moments_layout(out.moments)
                write_rows(args.moments_out, "moments", (packed_row(out.moments, meta, t, release=True) for t in meta["tasks"]),
                           (len(meta["tasks"]), meta["total"]), {**record, **meta})
            else:
                out.moments = {}
                write_group(args.moments_out, {}, {**record, "moments": "not kept (cache.moments: false)"})
    main_process, world = distributed.is_main(), distributed.world_size()
    distributed.shutdown()
    bad = [r.module for r in out.reports if r.condition is not None and r.condition > ILL_CONDITIONED]
    if main_process:
        print(f"{name}: calibration-set drift to experts l2 {out.drift.l2:.4f} cos {out.drift.cosine:.4f} "
              f"({world} process{'es' if world > 1 else ''})" + (f"; ill-conditioned: {bad}" if bad else ""))


if __name__ == "__main__":
    main()
