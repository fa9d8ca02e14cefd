"""Folders and files written under a temporary name and renamed into place only on success, and
the clean-up of the temporaries a killed process left behind. Standard library only: the bottom of
`featcal.io`, imported by `featcal.io.models` (which re-exports these names), `featcal.io.split_packages`
and the data and stage writers.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import tempfile
from pathlib import Path


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def temp_prefix(target: Path) -> str:
    """The name prefix of a temporary sibling of `target`, tagged with this process's id."""
    return f".{target.name}.tmp{os.getpid()}-"


def remove_stale_temps(target: Path) -> None:
    """Remove temporary siblings of `target` left by killed processes (their pid is gone), so a
    killed stage leaves nothing behind once it runs again (inside a DVC output they would be cached)."""
    pattern = re.compile(re.escape(f".{target.name}.tmp") + r"(\d+)-")
    if not target.parent.is_dir():
        return
    for path in target.parent.iterdir():
        match = pattern.match(path.name)
        if match and not _alive(int(match.group(1))):
            shutil.rmtree(path, ignore_errors=True) if path.is_dir() else path.unlink(missing_ok=True)


class atomic_dir:
    """Write a folder under a temporary name and rename it into place only on success."""

    def __init__(self, target: str | os.PathLike):
        self.target = Path(target)

    def __enter__(self) -> Path:
        self.target.parent.mkdir(parents=True, exist_ok=True)
        remove_stale_temps(self.target)
        self.tmp = Path(tempfile.mkdtemp(prefix=temp_prefix(self.target), dir=self.target.parent))
        return self.tmp

    def __exit__(self, exc_type, exc, tb) -> None:
        if exc_type is not None:
            shutil.rmtree(self.tmp, ignore_errors=True)
            return
        if self.target.exists():
            shutil.rmtree(self.target) if self.target.is_dir() else self.target.unlink()
        os.replace(self.tmp, self.target)


class atomic_file:
    """A temporary path next to `target`, renamed onto it only when the block succeeds."""

    def __init__(self, target: str | os.PathLike):
        self.target = Path(target)

    def __enter__(self) -> Path:
        self.target.parent.mkdir(parents=True, exist_ok=True)
        self.tmp = self.target.with_name(f".{self.target.name}.tmp")
        return self.tmp

    def __exit__(self, exc_type, exc, tb) -> None:
        if exc_type is not None:
            self.tmp.unlink(missing_ok=True)
            return
        os.replace(self.tmp, self.target)


def write_json(path: str | os.PathLike, data) -> None:
    with atomic_file(path) as tmp:
        tmp.write_text(json.dumps(data, indent=2, sort_keys=False) + "\n")
