"""`featcal` command line: `featcal tune ...` runs (or joins) an Optuna study of FeatCal's α, ρ, λ."""

from __future__ import annotations

import argparse
import logging
import os
import sys


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="featcal", description=__doc__.splitlines()[0])
    commands = parser.add_subparsers(dest="command", required=True)
    tune = commands.add_parser(
        "tune", help="run trials of a study until it holds --n-trials (run it on several machines to share one study)",
        description="Run from a project root that holds models/merged, experts/, features/experts and data/tasks.")
    from .tune import add_arguments

    add_arguments(tune)
    tune.add_argument("--best", help="also write the best values to this YAML file")
    tune.add_argument("--summary", help="also write a JSON summary of the study to this file")
    args = parser.parse_args(argv)
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s", stream=sys.stderr)
    if args.command == "tune":
        from .tune import StudyMismatchError, StudyStorageError, run_cli

        try:
            run_cli(args, best_path=args.best, summary_path=args.summary)
        except (ValueError, KeyError, OSError, StudyMismatchError, StudyStorageError) as err:
            # a bad input, said in one line (what, where, the fix) instead of a traceback
            message = err.args[0] if isinstance(err, KeyError) and err.args else err
            print(f"featcal tune: error: {message}", file=sys.stderr)
            return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
