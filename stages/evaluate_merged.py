"""DVC stage `evaluate-merged`: the merged model's test accuracy and its per-layer drift to the experts.

Depends on the merge, never on FeatCal's values, so an α experiment does not re-run it. Drift is
measured against the experts' cached test states (`collect-test-features`). A causal LM's folder
is read one decoder block at a time (`featcal.evaluation.streamed`), a classifier's whole.
"""

from __future__ import annotations

import argparse
from dataclasses import asdict
from pathlib import Path
from typing import Sequence

from common import enabled_tasks, get, load_params, max_length, setup_logging, timed

from featcal.data.splits import batches_from_arrays, read_split
from featcal.evaluation.scoring import DRIFT_BATCH_SIZE, drift_to_states, score_backbone, summary
from featcal.evaluation.streamed import DriftInputs, score_streamed
from featcal.families import family_for
from featcal.io.checkpoints import load_head
from featcal.data.encoders import load_encoder
from featcal.io.models import load_backbone, saved_as_causal_lm, write_json
from featcal.io.feature_store import read_group


def evaluate_backbone(backbone, heads: dict, params: dict, features: str, encoder_dir: str) -> tuple[dict, list]:
    """Test accuracy per task (`heads`: `load_head` models) and per-layer drift to the experts'
    cached test states."""
    scores = score_backbone(backbone, heads, load_encoder(encoder_dir), *test_splits(params, list(heads)))
    return scores, drift_on_test(backbone, list(heads), features)


def evaluate_streamed(model_dir: str, heads: dict, params: dict, features: str,
                      layer_files: Sequence[str] = ()) -> tuple[dict, list]:
    """`evaluate_backbone` of a causal LM's folder (with `layer_files` put in place), read one decoder
    block at a time (`heads`: each task's expert folder, or its `load_head` model): the same numbers
    without the whole model in memory."""
    result = score_streamed(model_dir, heads, load_encoder(model_dir), *test_splits(params, list(heads)),
                            layer_files, test_drift_inputs(list(heads), features))
    return result.scores, result.drift


def is_language_model(expert_dirs: dict) -> bool:
    """Whether the project's experts are causal LMs (the params check refuses a mix of objectives),
    from their configs: their evaluation streams the model a block at a time and loads each task's
    head (an untied LM head: vocabulary x hidden floats) only while it is used."""
    return any(saved_as_causal_lm(d) for d in expert_dirs.values())


def expert_folders(experts: str, tasks: list[str]) -> dict[str, str]:
    return {t: str(Path(experts) / t) for t in tasks}


def test_splits(params: dict, tasks: list[str]) -> tuple[dict, dict]:
    """Each task's test split and its max length in tokens."""
    tasks_dir = get(params, "tasks_dir")
    return {t: read_split(tasks_dir, t, "test") for t in tasks}, {t: max_length(params, t) for t in tasks}


def test_drift_inputs(tasks: list[str], features: str) -> DriftInputs:
    """The cached test inputs of `tasks` in drift batches, and the experts' states per layer (`features`)."""
    inputs = read_group(f"{features}/inputs.zarr")
    batches = {t: b for t, b in batches_from_arrays(inputs, DRIFT_BATCH_SIZE).items() if t in tasks}
    return DriftInputs(batches, lambda k: read_group(f"{features}/layer_{k:02d}.zarr"))


def drift_on_test(backbone, tasks: list[str], features: str) -> list:
    """Per-layer drift of `backbone` to the experts' cached test states (`features`), on `tasks`."""
    inputs = test_drift_inputs(tasks, features)
    return drift_to_states(family_for(backbone), backbone, inputs.batches, inputs.states)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--merged", required=True, help="the merged multi-task model folder")
    parser.add_argument("--experts", required=True, help="folder of the experts, one sub-folder per task")
    parser.add_argument("--features", required=True, help="the experts' cached test states")
    parser.add_argument("--out", required=True, help="where the scores and drift (JSON) are written")
    args = parser.parse_args()
    setup_logging()
    params = load_params()
    tasks = enabled_tasks(params)
    with timed("evaluate-merged"):
        expert_dirs = expert_folders(args.experts, tasks)
        if is_language_model(expert_dirs):   # one decoder block, and one task's head, in memory at a time
            scores, drift = evaluate_streamed(args.merged, expert_dirs, params, args.features)
        else:
            heads = {t: load_head(d) for t, d in expert_dirs.items()}
            scores, drift = evaluate_backbone(load_backbone(args.merged), heads, params, args.features, args.merged)
        write_json(args.out, {"test": summary(scores), "drift": [asdict(d) for d in drift]})
    print(f"merged: test avg {summary(scores)['avg']:.4f}")


if __name__ == "__main__":
    main()
