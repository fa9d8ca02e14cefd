"""A stand-in for a DVC stage's command (bench/alpha_rerun_floor.py): puts the stage's outputs in place
and nothing else. Standard library only, so its own start costs next to nothing.

    python bench/stand_in_stage.py SPEC.json

SPEC lists [path, size] (that many random bytes: a new object for DVC to hash and cache, as a new α
makes it) or [path, source] (a copy: metrics and plots DVC reads); the writer's wall time is appended
to the spec's log as "<stage> <seconds>".
"""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path


def write_outputs(spec_path: str) -> None:
    start = time.perf_counter()
    spec = json.loads(Path(spec_path).read_text())
    for path, what in spec["files"]:
        Path(path).parent.mkdir(parents=True, exist_ok=True)
        Path(path).write_bytes(os.urandom(what) if isinstance(what, int) else Path(what).read_bytes())
    with open(spec["log"], "a") as log:
        log.write(f"{spec['stage']} {time.perf_counter() - start:.4f}\n")


if __name__ == "__main__":
    write_outputs(sys.argv[1])
