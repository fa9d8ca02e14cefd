"""DVC stage `calibrate-layer@Lkk`: calibrate one block from the cached states entering it.

Reads the student states entering block k (layer 0: the merged embeddings), the experts' states
entering block k and the layer-k weights; writes the calibrated block parameters, the block's
moment sums (zarr, keyed by module/task) and the student states entering block k+1.
"""

from __future__ import annotations

import argparse

from common import enabled_tasks, get, load_params, setup_logging, timed
from safetensors.torch import save_file

from featcal.calibrate import HYPER_KEYS, FeatCalConfig
from featcal.data import batches_from_arrays
from featcal.families import family_for
from featcal.layerwise import calibrate_cached_block, merged_entry_states, stack_hidden
from featcal.modeling import atomic_file, load_backbone, load_classifier
from featcal.moments import pack_moments
from featcal.store import read_group, write_group


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layer", type=int, required=True)
    parser.add_argument("--featcal-params", default="params.yaml",
                        help="file whose featcal.alpha/rho/ridge override params.yaml's (tune/best.yaml when tuned)")
    args = parser.parse_args()
    k = args.layer
    setup_logging()
    params = load_params()
    tasks = enabled_tasks(params)
    name = f"L{k:02d}"
    with timed(f"calibrate-layer@{name}"):
        featcal = dict(get(params, "featcal"))
        if args.featcal_params != "params.yaml":
            tuned = get(load_params(args.featcal_params), "featcal")
            featcal.update({key: tuned[key] for key in HYPER_KEYS})
        config = FeatCalConfig.from_mapping(featcal)
        merged = load_backbone("models/merged")
        base = load_backbone(get(params, "model.base"))
        experts = {t: load_classifier(f"experts/{t}") for t in tasks}
        family = family_for(merged)
        n_blocks = len(family.blocks(merged))
        batches = batches_from_arrays(read_group("features/experts/inputs.zarr"),
                                      int(get(params, "calibration.batch_size")))
        batches = {t: batches[t] for t in tasks}
        student = merged_entry_states(family, merged, batches) if k == 0 else read_group(f"calib/student/layer_{k:02d}.zarr")
        expert = read_group(f"features/experts/layer_{k:02d}.zarr")
        last = k == n_blocks - 1
        expert_out = read_group(f"features/experts/layer_{n_blocks:02d}.zarr") if last and config.calibrate_pooler else None
        result = calibrate_cached_block(family, k, merged, base, experts, batches, student, expert, config, expert_out)

        prefix = family.block_prefix(merged, k)
        params_out = {prefix + n: p for n, p in family.blocks(merged)[k].state_dict().items()}
        if last and config.calibrate_pooler and family.pooler(merged) is not None:
            pooler_prefix = next(n for n, m in merged.named_modules() if m is family.pooler(merged)) + "."
            params_out.update({pooler_prefix + n: p for n, p in family.pooler(merged).state_dict().items()})
        with atomic_file(f"calib/layers/{name}.safetensors") as tmp:
            save_file({n: p.contiguous() for n, p in params_out.items()}, tmp)
        packed, layout = pack_moments(result.moments)
        write_group(f"calib/moments/{name}.zarr", packed, {"layer": k, **layout})
        write_group(f"calib/student/layer_{k + 1:02d}.zarr", stack_hidden(result.student_next),
                    {"layer": k + 1, "drift_l2": result.drift.l2, "drift_cosine": result.drift.cosine})
    bad = [r.module for r in result.reports if r.condition is not None and r.condition > 1e12]
    print(f"{name}: calibration-set drift to experts l2 {result.drift.l2:.4f} cos {result.drift.cosine:.4f}"
          + (f"; ill-conditioned: {bad}" if bad else ""))


if __name__ == "__main__":
    main()
