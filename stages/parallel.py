"""Data-parallel stages: a stage run by `python` re-launches itself under torchrun when
`parallel.nproc_per_node` is above 1, so dvc.yaml keeps one command whatever the setting."""

from __future__ import annotations

import os
import shutil
import sys

from featcal.calibration import distributed


def relaunch_under_torchrun(nproc: int) -> None:
    """With nproc > 1 and not already launched by torchrun, replace this process by
    `torchrun --standalone --nproc_per_node <nproc> <this script> <args>`; then join the group."""
    if nproc < 1:
        raise SystemExit(f"params.yaml: parallel.nproc_per_node must be >= 1, got {nproc}")
    if nproc > 1 and not distributed.launched_by_torchrun():
        torchrun = shutil.which("torchrun", path=os.path.dirname(sys.executable)) or shutil.which("torchrun")
        if torchrun is None:
            raise SystemExit("parallel.nproc_per_node > 1 needs torchrun (part of torch) next to the Python running the stage")
        os.execv(torchrun, [torchrun, "--standalone", f"--nproc_per_node={nproc}", *sys.argv])
    distributed.init()
