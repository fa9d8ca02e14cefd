"""DVC stage `collect-expert-features`: each expert's states entering every block, one zarr per layer.

Independent of α, ρ, λ and of the merge: changing those never re-runs it.
"""

from __future__ import annotations

from common import calibration_spec, enabled_tasks, get, load_params, setup_logging, timed
from tqdm.auto import tqdm

from featcal.data import batches_to_arrays, calibration_batches
from featcal.families import family_for
from featcal.layerwise import collect_expert_states
from featcal.modeling import load_classifier, load_tokenizer
from featcal.store import write_group

OUT = "features/experts"


def main() -> None:
    setup_logging()
    params = load_params()
    tasks = enabled_tasks(params)
    with timed("collect-expert-features"):
        tokenizer = load_tokenizer(get(params, "model.base"))
        batches = calibration_batches(calibration_spec(params, tasks), tokenizer)
        experts = {t: load_classifier(f"experts/{t}") for t in tasks}
        family = family_for(experts[tasks[0]])
        write_group(f"{OUT}/inputs.zarr", batches_to_arrays(batches), {"tasks": tasks})
        n_layers = len(family.blocks(family.backbone(experts[tasks[0]])))
        states = collect_expert_states(family, experts, batches)
        for k, hidden in enumerate(tqdm(states, total=n_layers + 1, desc="expert features", unit="layer")):
            write_group(f"{OUT}/layer_{k:02d}.zarr", hidden, {"layer": k, "tasks": tasks})
    print(f"{OUT}: {n_layers + 1} layers x {len(tasks)} tasks")


if __name__ == "__main__":
    main()
