"""The experts' captured block inputs past an `ExpertInputCache`'s memory bound, on disk (zarr).

A base-size model's experts' side of a study does not fit in memory (all-mpnet-base-v2's would take
~17 GiB): rather than run those blocks' expert forwards in every trial, the first trial writes them to
a temporary folder, one zarr group a block, and later trials read them back. The module inputs are
stored in the cache's dtype where it is narrower than theirs (bfloat16 or float16; the experts' inputs
are then rounded as `cache.dtype` rounds the collected states); the W x rows, the products a trial's
cross sums are formed from, are stored as they are (float64 in an exact walk). Nothing is compressed:
every later trial reads every block, and activations barely compress (zstd: 7.5 % smaller on the demo,
twice the read time: docs/tuning.md); each chunk still carries its checksum. Tensors a batch shares
(one input read by the query, key and value projections) are stored once and read back as one tensor,
so the moments' shared products are formed once, as from memory.

A spill's folder is named after its host and process (`featcal-expert-inputs-<host>-<pid>-…`), so a study
killed outright, whose folder nothing removed, is cleared by the next spill on that host to make a folder
in the same place, once that process is gone (`remove_stale`).
"""

from __future__ import annotations

import logging
import os
import re
import shutil
import socket
import tempfile
import weakref
from pathlib import Path

import torch
from torch import Tensor

from featcal.calibration.moments import PROJECTED_SUFFIX
from featcal.io.feature_store import STORAGE_DTYPES, StoreFormat, read_group, write_group
from featcal.profiling import phase

log = logging.getLogger(__name__)

Captured = dict[str, list[dict[str, Tensor]]]   # task -> batches -> module name -> its input (or W x rows)
Layout = list[tuple[str, list[dict[str, tuple[int, torch.dtype]]]]]   # per task, per batch: name -> (array, dtype)

PREFIX = "featcal-expert-inputs-"


def _host() -> str:
    return re.sub(r"[^A-Za-z0-9.]+", "_", socket.gethostname()) or "host"


def _running(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:   # another user's process: running
        return True
    return True


def remove_stale(root: str | Path) -> list[Path]:
    """Remove the spill folders under `root` whose process, on this host, no longer runs: a spill removes
    its own folder when it is closed or collected, or when its process exits, so only a process killed
    outright (SIGKILL, the OOM killer) leaves one. Folders of running processes, of other hosts (a shared
    `tune.expert_cache_dir`) or of older, unnamed spills are left alone. Returns the removed folders."""
    named = re.compile(rf"{re.escape(PREFIX + _host())}-(\d+)-")
    removed = []
    for path in Path(root).glob(f"{PREFIX}{_host()}-*"):
        owner = named.match(path.name)
        if owner and path.is_dir() and int(owner.group(1)) != os.getpid() and not _running(int(owner.group(1))):
            shutil.rmtree(path, ignore_errors=True)
            removed.append(path)
    if removed:
        log.info("removed %d expert-input folder(s) left by killed studies under %s", len(removed), root)
    return removed


class BlockSpill:
    """Blocks of captured expert inputs kept in a temporary folder (under `root`, or the system's; made
    at the first block), removed by `close()` or when the spill is collected. `max_bytes` bounds the disk they take (None:
    unbounded); a block that would pass it is not written. `dtype`: a storage dtype (`cache.dtype`) the
    inputs are narrowed to where it is narrower. `nbytes`: the bytes on disk."""

    def __init__(self, root: str | Path | None = None, max_bytes: int | None = None, dtype: str | None = None):
        StoreFormat(dtype)   # an unknown dtype is refused before any folder is made, naming the choices
        self._narrow = None if dtype is None else STORAGE_DTYPES[dtype]
        self._root, self._folder, self._remove = root, None, None
        self.max_bytes, self.nbytes = max_bytes, 0
        self._fmt = StoreFormat(None, "none")   # narrowing is chosen here, per tensor
        self._groups: dict[tuple, tuple[Path, Layout]] = {}

    @property
    def folder(self) -> Path:
        """The temporary folder, made when first needed (a study whose blocks all fit in memory makes none)."""
        if self._folder is None:
            root = Path(tempfile.gettempdir() if self._root is None else self._root)
            root.mkdir(parents=True, exist_ok=True)
            remove_stale(root)
            self._folder = Path(tempfile.mkdtemp(prefix=f"{PREFIX}{_host()}-{os.getpid()}-", dir=root))
            self._remove = weakref.finalize(self, shutil.rmtree, self._folder, True)
        return self._folder

    def _stored(self, name: str, tensor: Tensor) -> Tensor:
        narrower = (self._narrow is not None and not name.endswith(PROJECTED_SUFFIX) and tensor.is_floating_point()
                    and self._narrow.itemsize < tensor.element_size())
        return tensor.to(self._narrow) if narrower else tensor

    def write(self, key: tuple, captured: Captured) -> bool:
        """Write one block's captured inputs under `key`; False (nothing kept) past the disk bound."""
        arrays: dict[str, Tensor] = {}
        layout: Layout = []
        for t, (task, batches) in enumerate(captured.items()):
            layout.append((task, []))
            for b, batch in enumerate(batches):
                index_of: dict[tuple, int] = {}   # one array per distinct tensor of the batch
                entry = {}
                for name, tensor in batch.items():
                    identity = (tensor.data_ptr(), tuple(tensor.shape), tensor.stride(), tensor.dtype)
                    if identity not in index_of:
                        index_of[identity] = len(index_of)
                        arrays[f"t{t}/b{b}/a{index_of[identity]}"] = self._stored(name, tensor)
                    entry[name] = (index_of[identity], tensor.dtype)
                layout[-1][1].append(entry)
        if self._past(sum(a.nbytes for a in arrays.values())):   # uncompressed: the files hold at least this
            return False
        path = self.folder / f"block-{len(self._groups):03d}.zarr"
        with phase("cache I/O"):
            write_group(path, arrays, fmt=self._fmt)
        size = sum(f.stat().st_size for f in path.rglob("*") if f.is_file())
        if self._past(size):
            shutil.rmtree(path)
            return False
        self._groups[key] = path, layout
        self.nbytes += size
        return True

    def _past(self, size: int) -> bool:
        return self.max_bytes is not None and self.nbytes + size > self.max_bytes

    def holds(self, key: tuple) -> bool:
        return key in self._groups

    def read(self, key: tuple) -> Captured:
        """The block's captured inputs as written (in their own dtypes; shared tensors shared again)."""
        path, layout = self._groups[key]
        with phase("cache I/O"):
            arrays = read_group(path)
        out: Captured = {}
        for t, (task, batches) in enumerate(layout):
            out[task] = []
            for b, entry in enumerate(batches):
                restored: dict[int, Tensor] = {}
                batch = {}
                for name, (i, dtype) in entry.items():
                    if i not in restored:
                        restored[i] = arrays[f"t{t}/b{b}/a{i}"].to(dtype)
                    batch[name] = restored[i]
                out[task].append(batch)
        return out

    def close(self) -> None:
        """Remove the folder (and everything written to it)."""
        self._groups.clear()
        self.nbytes = 0
        if self._remove is not None:
            self._remove()
