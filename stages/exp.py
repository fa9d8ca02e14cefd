"""`make exp` and `make repro`: the params checked before DVC runs anything (not a stage).

`dvc exp run -S KEY=VALUE` writes the value into params.yaml and removes the first stage's outputs
before that stage reads (and refuses) it, and a setting that reaches no stage (`tune.storage`) is
never checked at all. Here the settings are applied to a copy of params.yaml with DVC's own Hydra
override parser, the copy is validated (stages/params_schema.py, including stages/chain.yaml against
the params), and only a valid experiment is handed to `dvc exp run`: a refused value leaves the
workspace as it was.

    SET='featcal.alpha=0.5 merge.options={scale: 0.5}' python stages/exp.py --dvc .venv/bin/dvc   # make exp
    python stages/exp.py --check                                                                  # make repro

`make exp` runs it under stages/with_warm_stages.py: the check and the experiment's stages fork from
one warm interpreter.

The settings come from the environment variable SET (what `make exp SET=...` passes, unsplit), one
override after another, separated by spaces outside braces, brackets and quotes.
"""

from __future__ import annotations

import argparse
import os
import re
import shutil
import sys
import tempfile
from pathlib import Path

import yaml

STAGES = Path(__file__).resolve().parent
PASSWORD = re.compile(r"(://[^/@:\s]*:)[^/@\s]+@")   # a URL's password, never echoed back


def shown(settings: list[str]) -> str:
    return PASSWORD.sub(r"\1***@", " ".join(settings))


def split_settings(text: str) -> list[str]:
    """Overrides separated by whitespace, except inside {...}, [...] or quotes (a Hydra value may hold spaces)."""
    out, current, depth, quote = [], [], 0, None
    for char in text:
        if quote:
            quote = None if char == quote else quote
        elif char in "'\"":
            quote = char
        elif char in "{[(":
            depth += 1
        elif char in "}])":
            depth = max(0, depth - 1)
        elif char.isspace() and depth == 0:
            if current:
                out.append("".join(current))
                current = []
            continue
        current.append(char)
    if quote or depth:
        raise SystemExit(f"exp: SET={text!r}: an unclosed {'quote' if quote else 'bracket'}")
    if current:
        out.append("".join(current))
    return out


def with_settings(params: Path, settings: list[str]) -> dict:
    """The params with `settings` applied (as `dvc exp run -S` would), computed on a copy."""
    from dvc.exceptions import InvalidArgumentError
    from dvc.utils.hydra import apply_overrides

    with tempfile.TemporaryDirectory(prefix="featcal-exp-") as tmp:
        copy = Path(tmp) / params.name
        shutil.copyfile(params, copy)
        if settings:
            try:
                apply_overrides(copy, settings)
            except InvalidArgumentError as err:
                cause = f": {err.__cause__}" if err.__cause__ else ""
                raise SystemExit(f"exp: refused, nothing changed: {shown(settings)}{cause}") from None
        return yaml.safe_load(copy.read_text(encoding="utf-8")) or {}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--params", default="params.yaml", help="the params file (in the project folder, the cwd)")
    parser.add_argument("--check", action="store_true", help="only check the params (with $SET applied, if any)")
    parser.add_argument("--dvc", default="dvc", help="the dvc executable that runs the experiment")
    args = parser.parse_args()
    sys.path.insert(0, str(STAGES))
    from warm_start import start_stage
    start_stage()   # under with_warm_stages (make exp), the check runs warm: its imports cost ~5 s cold
    from params_schema import ParamsError, validate

    params = Path(args.params)
    if not params.is_file():
        raise SystemExit(f"exp: params file {params} not found (run from the project folder)")
    settings = split_settings(os.environ.get("SET", ""))
    if not settings and not args.check:
        raise SystemExit("exp: no settings: make exp SET=featcal.alpha=0.5 (any params key; several separated by spaces)")
    raw = with_settings(params, settings)
    try:
        validate(raw, params.parent, chain=True)
    except ParamsError as err:
        what = f"SET={shown(settings)}" if settings else str(params)
        raise SystemExit(f"exp: refused, nothing changed ({what}): {err}") from None
    if args.check:
        return
    from with_warm_stages import run_served

    code = run_served([args.dvc, "exp", "run", *(arg for s in settings for arg in ("-S", s))])
    raise SystemExit(128 - code if code < 0 else code)


if __name__ == "__main__":
    main()
