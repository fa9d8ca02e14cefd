"""`python -m dvc` for the tests' DVC commands (`DVC`), run by the session's warm-start server.

A DVC process spends ~0.5 s importing DVC before it works, and the suite runs DVC in most of its
pipeline tests (a tiny project's `dvc status`: 1.9 s cold, 1.2 s served, side by side). The
tests' server (conftest's `pytest_configure`) has imported DVC too (`DVC_PRELOAD`), so a command run
as `[*DVC, ...]` forks from it, as a stage does (stages/warm_start.py), and runs DVC's own `main`
with this argv, directory, environment and streams. Without a server, or when it cannot take the
command, DVC runs here. Either way DVC writes dvc.lock one stage at a time, as `make repro` runs it
(stages/dvc_main.py). Importing this file runs nothing.
"""

from __future__ import annotations

import sys
from pathlib import Path

DVC = [sys.executable, str(Path(__file__).resolve())]
# What `dvc repro`, `status`, `push`, `exp` ... import before they work (the rest comes in the command)
DVC_PRELOAD = (
    "dvc.cli", "dvc.cli.parser", "dvc.repo", "dvc.repo.reproduce", "dvc.repo.status", "dvc.repo.index",
    "dvc.repo.stage", "dvc.repo.graph", "dvc.repo.open_repo", "dvc.repo.plots", "dvc.repo.metrics",
    "dvc.repo.params", "dvc.repo.experiments", "dvc.repo.datasets", "dvc.repo.artifacts", "dvc.stage",
    "dvc.output", "dvc.dvcfile", "dvc.lock", "dvc.rwlock", "dvc.parsing", "dvc.data_cloud", "dvc.cachemgr",
    "dvc.scm", "dvc.utils.strictyaml", "scmrepo.git", "dulwich.worktree", "dvc_data.index",
    "dvc_data.hashfile.db.local", "dvc_render.vega", "dvc_render.html", "flufl.lock", "psutil", "platformdirs",
    "configobj", "pyparsing", "networkx", "ruamel.yaml")


def main() -> None:
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "stages"))
    import dvc_main
    import warm_start
    del sys.path[0]
    warm_start.hand_over(__file__)   # returns when there is no server or it cannot take this
    sys.exit(dvc_main.run(sys.argv[1:]))


if __name__ == "__main__":
    main()
