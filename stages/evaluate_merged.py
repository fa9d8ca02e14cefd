"""DVC stage `evaluate-merged`: the merged model's test accuracy and its per-layer drift to the experts.

Depends on the merge, never on FeatCal's values, so an α experiment does not re-run it. Drift is
measured against the experts' cached test states (`collect-test-features`).
"""

from __future__ import annotations

import argparse
from dataclasses import asdict
from pathlib import Path

from common import enabled_tasks, get, load_params, max_length, setup_logging, timed

from featcal.data.splits import batches_from_arrays, read_split
from featcal.evaluation.scoring import DRIFT_BATCH_SIZE, drift_to_states, score_backbone, summary
from featcal.families import family_for
from featcal.io.checkpoints import load_head
from featcal.data.encoders import load_encoder
from featcal.io.models import load_backbone, write_json
from featcal.io.feature_store import read_group


def evaluate_backbone(backbone, heads: dict, params: dict, features: str, encoder_dir: str) -> tuple[dict, list]:
    """Test accuracy per task (`heads`: `load_head` models) and per-layer drift to the experts'
    cached test states."""
    tasks_dir, tasks = get(params, "tasks_dir"), list(heads)
    encoder = load_encoder(encoder_dir)
    scores = score_backbone(backbone, heads, encoder, {t: read_split(tasks_dir, t, "test") for t in tasks},
                            {t: max_length(params, t) for t in tasks})
    return scores, drift_on_test(backbone, tasks, features)


def drift_on_test(backbone, tasks: list[str], features: str) -> list:
    """Per-layer drift of `backbone` to the experts' cached test states (`features`), on `tasks`."""
    inputs = read_group(f"{features}/inputs.zarr")
    batches = {t: b for t, b in batches_from_arrays(inputs, DRIFT_BATCH_SIZE).items() if t in tasks}
    return drift_to_states(family_for(backbone), backbone, batches, lambda k: read_group(f"{features}/layer_{k:02d}.zarr"))


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
        heads = {t: load_head(Path(args.experts) / t) for t in tasks}
        scores, drift = evaluate_backbone(load_backbone(args.merged), heads, params, args.features, args.merged)
        write_json(args.out, {"test": summary(scores), "drift": [asdict(d) for d in drift]})
    print(f"merged: test avg {summary(scores)['avg']:.4f}")


if __name__ == "__main__":
    main()
