"""DVC stage `collect-expert-features`: each expert's states entering every block, one zarr per layer.

Independent of α, ρ, λ and of the merge: changing those never re-runs it. Reads one block of one
expert at a time; runs data-parallel under torchrun when `parallel.nproc_per_node` > 1.
"""

from __future__ import annotations

from common import calibration_spec, enabled_tasks, get, load_params, setup_logging, timed
from parallel import relaunch_under_torchrun
from tqdm.auto import tqdm

from featcal import distributed
from featcal.data import batches_to_arrays, calibration_batches
from featcal.layerwise import collect_expert_layers
from featcal.modeling import load_tokenizer
from featcal.store import StoreFormat, write_group

OUT = "features/experts"


def main() -> None:
    setup_logging()
    params = load_params()
    relaunch_under_torchrun(int(get(params, "parallel.nproc_per_node", 1)))
    tasks = enabled_tasks(params)
    spec = calibration_spec(params, tasks)
    fmt = StoreFormat(get(params, "cache.dtype", "float32"), get(params, "cache.compressor", "zstd"))
    main_process = distributed.is_main()
    with timed("collect-expert-features"):
        batches = calibration_batches(spec, load_tokenizer(get(params, "model.base")))
        if main_process:
            write_group(f"{OUT}/inputs.zarr", batches_to_arrays(batches), {"tasks": tasks})
        layers = collect_expert_layers({t: f"experts/{t}" for t in tasks}, distributed.shard_batches(batches))
        for k, hidden in enumerate(tqdm(layers, desc="expert features", unit="layer", disable=not main_process)):
            hidden = distributed.gather_examples(hidden, spec.batch_size)
            if main_process:
                write_group(f"{OUT}/layer_{k:02d}.zarr", hidden, {"layer": k, "tasks": tasks}, fmt=fmt)
    distributed.shutdown()
    if main_process:
        print(f"{OUT}: {k + 1} layers x {len(tasks)} tasks")


if __name__ == "__main__":
    main()
