"""The README's runnable command blocks work as written, whether or not a virtualenv is active.

A fenced bash block right after a `<!-- runnable ... -->` line is run line by line (comments
dropped) in a copy of the session's tiny project that has the project's Makefile, pins and
virtualenv, with a PATH that holds no virtualenv (as a user who never activated one has it).
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from conftest import copy_project, stages_run
from tiny_project import ROOT

RUNNABLE = re.compile(r"<!-- runnable[^>]*-->\s*```bash\n(.*?)```", re.S)


def runnable_commands(text: str) -> list[str]:
    """Each command line of the blocks marked runnable, comments and blank lines dropped."""
    lines = [line.split("#", 1)[0].strip() for block in RUNNABLE.findall(text) for line in block.splitlines()]
    return [line for line in lines if line]


def test_the_readme_marks_the_next_steps_runnable():
    commands = runnable_commands((ROOT / "README.md").read_text())
    assert any(c.startswith("make exp ") for c in commands) and {"make exp-spec", "make metrics"} <= set(commands), commands


@pytest.mark.slow(20)
def test_runnable_readme_commands_work_as_written_without_an_active_virtualenv(tiny_project, tmp_path):
    project = copy_project(tiny_project.full, tmp_path / "project")
    for name in ("Makefile", "requirements.txt", "requirements.lock", "pyproject.toml"):
        shutil.copy2(ROOT / name, project / name)          # older than the venv's install stamp: no re-install
    (project / ".venv").symlink_to(ROOT / ".venv")
    venv_bin = str(Path(sys.executable).parent)
    path = os.pathsep.join(p for p in os.environ["PATH"].split(os.pathsep) if p != venv_bin and ".venv" not in p)
    env = {k: v for k, v in os.environ.items() if k not in ("VIRTUAL_ENV", "PYTHONHOME")}
    env.update(PATH=path, HF_HUB_OFFLINE="1")
    outputs = {}
    for command in runnable_commands((ROOT / "README.md").read_text()):
        done = subprocess.run(["bash", "-c", command], cwd=project, env=env, capture_output=True, text=True, timeout=600)
        outputs[command] = done.stdout + done.stderr
        assert done.returncode == 0, f"README command {command!r} failed:\n{outputs[command][-4000:]}"
    experiment = next(out for command, out in outputs.items() if command.startswith("make exp "))
    assert stages_run(experiment) == {"calibrate-layer@L00", "calibrate-layer@L01", "evaluate"}, experiment
    # the tiny project merges with TA at s 0.3 already: the spec's run re-calibrates, the merge stays
    assert stages_run(outputs["make exp-spec"]) == {"calibrate-layer@L00", "calibrate-layer@L01", "evaluate"}
    assert "featcal.alpha" in outputs["make metrics"] and "0.5" in outputs["make metrics"], outputs["make metrics"]
