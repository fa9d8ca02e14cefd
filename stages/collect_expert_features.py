"""DVC stages `collect-expert-features` and `collect-test-features`: each expert's states entering
every block, one zarr per layer, on its task's calibration sample (train split) or on the test
examples that drift is measured on.

Independent of α, ρ, λ and of the merge: changing those never re-runs it. Reads one block of one
expert at a time; runs data-parallel under torchrun when `parallel.nproc_per_node` > 1.
"""

from __future__ import annotations

import argparse
import dataclasses

from common import calibration_spec, enabled_tasks, get, load_params, setup_logging, timed
from parallel import relaunch_under_torchrun
from tqdm.auto import tqdm

from featcal.calibration import distributed
from featcal.data.splits import batches_to_arrays, calibration_batches
from featcal.evaluation.scoring import DRIFT_BATCH_SIZE
from featcal.calibration.layerwise import collect_expert_layers
from featcal.data.encoders import load_encoder
from featcal.io.feature_store import StoreFormat, write_group

def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--split", choices=["train", "test"], default="train",
                        help="train: the calibration sample; test: the drift examples (evaluate.drift_examples_per_task)")
    parser.add_argument("--experts", required=True, help="folder of the experts, one sub-folder per task")
    parser.add_argument("--out", required=True, help="where the per-layer zarr caches are written")
    args = parser.parse_args()
    setup_logging()
    params = load_params()
    relaunch_under_torchrun(int(get(params, "parallel.nproc_per_node", 1)))
    tasks = enabled_tasks(params)
    spec = calibration_spec(params, tasks)
    if args.split == "test":
        spec = dataclasses.replace(spec, split="test", batch_size=DRIFT_BATCH_SIZE,
                                   examples_per_task=int(get(params, "evaluate.drift_examples_per_task")))
    out_dir = args.out
    fmt = StoreFormat(get(params, "cache.dtype", "float32"), get(params, "cache.compressor", "zstd"))
    main_process = distributed.is_main()
    with timed("collect-expert-features" if args.split == "train" else "collect-test-features"):
        batches = calibration_batches(spec, load_encoder(get(params, "model.base")))
        if main_process:
            write_group(f"{out_dir}/inputs.zarr", batches_to_arrays(batches), {"tasks": tasks})
        layers = collect_expert_layers({t: f"{args.experts}/{t}" for t in tasks}, distributed.shard_batches(batches))
        for k, states in enumerate(tqdm(layers, desc="expert features", unit="layer", disable=not main_process)):
            states = distributed.gather_examples(states, spec.batch_size)
            if main_process:
                write_group(f"{out_dir}/layer_{k:02d}.zarr", states, {"layer": k, "tasks": tasks}, fmt=fmt)
    distributed.shutdown()
    if main_process:
        print(f"{out_dir}: {k + 1} layers x {len(tasks)} tasks")


if __name__ == "__main__":
    main()
