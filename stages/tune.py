"""DVC stage `tune@dev`: search FeatCal's α, ρ, λ with Optuna on the dev split (featcal.tune).

Brings the study (tune.storage, default sqlite tune/study.db) up to tune.n_trials, then writes the
best values to tune/best.yaml (read by calibrate-layer@* when featcal.use_tuned: true), a summary to
results/tune.json and, when the study lives in a server database, a sqlite snapshot in tune/study.db.
More workers, on this or other machines: `featcal tune --storage URL --study-name NAME`.
"""

from __future__ import annotations

import argparse

from common import load_params, setup_logging, timed

from featcal.tune import StudyMismatchError, StudyStorageError, add_arguments, run_cli


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_arguments(parser)
    parser.add_argument("--best", default="tune/best.yaml", help="where the best values are written")
    parser.add_argument("--summary", default="results/tune.json", help="where the study summary is written")
    parser.add_argument("--snapshot", default="tune/study.db", help="sqlite copy of a server-side study")
    args = parser.parse_args()
    setup_logging()
    load_params(args.params)   # the whole params file checked before any model loads
    with timed("tune"):
        try:
            run_cli(args, best_path=args.best, summary_path=args.summary, snapshot_path=args.snapshot)
        except (StudyMismatchError, StudyStorageError) as err:
            raise SystemExit(f"tune: {err}") from None


if __name__ == "__main__":
    main()
