"""Per-layer zarr caches: one group per layer, one sharded array per task (or per moment).

Each array is written as a single shard (inner chunks of `chunk_rows` examples), so a layer is a
handful of files however many examples it holds: pushing and pulling through a DVC remote stays fast.
Groups are written under a temporary name and renamed into place only when complete.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Mapping

import numpy as np
import torch
import zarr

from .modeling import atomic_dir


def _numpy(value) -> np.ndarray:
    if isinstance(value, torch.Tensor):
        return value.detach().cpu().numpy()
    return np.asarray(value)


def write_group(
    path: str | os.PathLike, arrays: Mapping[str, object], attrs: Mapping | None = None, chunk_rows: int = 16
) -> None:
    """Write named arrays (slash-separated names make subgroups) as one zarr group, atomically."""
    with atomic_dir(path) as tmp:
        group = zarr.open_group(str(tmp), mode="w")
        group.attrs.update(dict(attrs or {}))
        for name, value in arrays.items():
            data = _numpy(value)
            layout = {}
            if data.ndim:
                rows = max(1, min(chunk_rows, data.shape[0]))
                chunks = (rows,) + tuple(max(1, s) for s in data.shape[1:])
                # one shard holds the whole array; its shape must be a multiple of the chunk shape
                layout = {"chunks": chunks, "shards": (-(-max(1, data.shape[0]) // rows) * rows,) + chunks[1:]}
            arr = group.create_array(name, shape=data.shape, dtype=data.dtype, **layout)
            arr[...] = data


def read_group(path: str | os.PathLike, names: list[str] | None = None) -> dict[str, torch.Tensor]:
    """All arrays of a group (recursively, slash-separated names), as tensors."""
    path = Path(path)
    if not (path / "zarr.json").exists():
        raise FileNotFoundError(f"{path}: not a zarr group (missing zarr.json); was the producing stage run?")
    group = zarr.open_group(str(path), mode="r")
    out: dict[str, torch.Tensor] = {}
    for name, arr in group.arrays() if names is None else ((n, group[n]) for n in names):
        out[name] = torch.from_numpy(np.asarray(arr[...]))
    if names is None:
        for sub_name, sub in group.groups():
            for name, value in read_group(path / sub_name).items():
                out[f"{sub_name}/{name}"] = value
    return out


def read_attrs(path: str | os.PathLike) -> dict:
    return dict(zarr.open_group(str(path), mode="r").attrs)
