"""Per-layer zarr caches: one group per layer, one sharded array per task; a layer's moment sums one
array written a row at a time (`write_rows`).

`write_group` writes each array as a single shard (inner chunks of `chunk_rows` examples), so a layer
is a handful of files however many examples it holds: pushing and pulling through a DVC remote stays
fast. `write_rows` writes unsharded chunks of one row each, since zarr assembles a shard in memory.
Every chunk carries a crc32c checksum after its compressor, so a damaged byte fails the read with
an error naming the store and the array (DVC's own hashes only see a file whose mtime changed).
Floating arrays may be stored in a narrower dtype (`StoreFormat`); bfloat16, which numpy lacks, is
kept as its 16-bit pattern and reinterpreted on read. Groups are written under a temporary name and
renamed into place only when complete.
"""

from __future__ import annotations

import hashlib
import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Iterable, Mapping

import numpy as np
import torch
import zarr
from zarr.codecs import Crc32cCodec, GzipCodec, ZstdCodec

from featcal.io.models import atomic_dir


STORAGE_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16,
                  "float64": torch.float64}
COMPRESSORS = ("none", "zstd", "gzip")
ROW_CHUNK = 1 << 21   # values per chunk of `write_rows` (16 MiB of float64)
TORCH_DTYPE_ATTR = "torch_dtype"   # set on arrays whose numpy dtype is not the tensor's (bfloat16)


@dataclass(frozen=True)
class StoreFormat:
    """How floating arrays are stored: `dtype` (None keeps each array's own) and a compressor."""

    dtype: str | None = None
    compressor: str = "zstd"
    level: int = 3

    def __post_init__(self) -> None:
        if self.dtype is not None and self.dtype not in STORAGE_DTYPES:
            raise ValueError(f"storage dtype {self.dtype!r}: expected one of {sorted(STORAGE_DTYPES)}")
        if self.compressor not in COMPRESSORS:
            raise ValueError(f"compressor {self.compressor!r}: expected one of {COMPRESSORS}")

    def codecs(self) -> list:
        compressor = {"none": [], "zstd": [ZstdCodec(level=self.level)], "gzip": [GzipCodec(level=self.level)]}
        return compressor[self.compressor] + [Crc32cCodec()]

    def encode(self, value) -> tuple[np.ndarray, str | None]:
        """The numpy array to store, and the torch dtype to restore on read where numpy has none."""
        tensor = value.detach().cpu() if isinstance(value, torch.Tensor) else torch.from_numpy(np.asarray(value))
        if self.dtype is not None and tensor.is_floating_point():
            tensor = tensor.to(STORAGE_DTYPES[self.dtype])
        if tensor.dtype == torch.bfloat16:
            return tensor.view(torch.int16).numpy(), "bfloat16"
        return tensor.numpy(), None


SEAL_ATTR = "metadata_sha256"   # the group's attrs: SHA-256 of every array's and subgroup's zarr.json


def _seal(root: Path) -> None:
    """Record the digest of each zarr.json below the group's own: zarr's metadata carries no
    checksum (the chunks do), and a flipped bit in it reads as another shape or dtype, or as no JSON."""
    digests = {str(p.relative_to(root)): hashlib.sha256(p.read_bytes()).hexdigest()
               for p in sorted(root.rglob("zarr.json")) if p.parent != root}
    zarr.open_group(str(root), mode="r+").attrs[SEAL_ATTR] = digests


def _damaged(path: Path, what: str) -> OSError:
    return OSError(f"{path}: {what}; the cache is damaged: delete it and re-run the stage that wrote it "
                   "(or `dvc checkout --force` / `dvc pull`)")


def _open_checked(path: Path):
    """The group at `path`, its metadata checked: readable JSON, and every zarr.json as sealed."""
    meta = path / "zarr.json"
    try:
        attrs = json.loads(meta.read_bytes()).get("attributes", {}) or {}
    except (UnicodeDecodeError, ValueError, AttributeError) as err:
        raise _damaged(path, f"its metadata {meta.name} cannot be read ({type(err).__name__}: {err})") from None
    for relative, digest in (attrs.get(SEAL_ATTR) or {}).items():
        file = path / relative
        if not file.is_file() or hashlib.sha256(file.read_bytes()).hexdigest() != digest:
            raise _damaged(path, f"the metadata {relative} is missing or not as written (SHA-256 differs)")
    try:
        return zarr.open_group(str(path), mode="r")
    except Exception as exc:  # noqa: BLE001 - zarr reports bad metadata in several types
        raise _damaged(path, f"it cannot be opened ({type(exc).__name__}: {exc})") from None


def write_group(
    path: str | os.PathLike, arrays: Mapping[str, object], attrs: Mapping | None = None, chunk_rows: int = 16,
    fmt: StoreFormat = StoreFormat(),
) -> None:
    """Write named arrays (slash-separated names make subgroups) as one zarr group, atomically."""
    with atomic_dir(path) as tmp:
        group = zarr.open_group(str(tmp), mode="w")
        group.attrs.update(dict(attrs or {}))
        for name, value in arrays.items():
            data, torch_dtype = fmt.encode(value)
            layout = {}
            if data.ndim:
                rows = max(1, min(chunk_rows, data.shape[0]))
                chunks = (rows,) + tuple(max(1, s) for s in data.shape[1:])
                # one shard holds the whole array; its shape must be a multiple of the chunk shape
                layout = {"chunks": chunks, "shards": (-(-max(1, data.shape[0]) // rows) * rows,) + chunks[1:]}
            arr = group.create_array(name, shape=data.shape, dtype=data.dtype, compressors=fmt.codecs(), **layout)
            arr[...] = data
            if torch_dtype is not None:
                arr.attrs[TORCH_DTYPE_ATTR] = torch_dtype
        _seal(Path(tmp))


def write_rows(
    path: str | os.PathLike, name: str, rows: Iterable[object], shape: tuple[int, int], attrs: Mapping | None = None,
    fmt: StoreFormat = StoreFormat(),
) -> None:
    """One 2-D array written a row at a time, atomically, in unsharded chunks of up to `ROW_CHUNK`
    values of one row (a row's chunks are encoded side by side; the layout depends on the shape
    alone, so equal data gives equal files on any machine).

    For arrays too large to hold twice (a layer's moment sums): zarr assembles a shard whole in
    memory, so `write_group` costs about the array's size again while it writes; this holds one
    row's encoding. `rows` may be a generator that builds (and frees) each row as it is asked."""
    with atomic_dir(path) as tmp:
        group = zarr.open_group(str(tmp), mode="w")
        group.attrs.update(dict(attrs or {}))
        arr = None
        count = 0
        for i, row in enumerate(rows):
            data, torch_dtype = fmt.encode(row)
            if data.shape != tuple(shape[1:]):
                raise ValueError(f"{path}: row {i} of {name!r} has shape {data.shape}, expected {tuple(shape[1:])}")
            if arr is None:
                arr = group.create_array(name, shape=tuple(shape), dtype=data.dtype,
                                         chunks=(1, max(1, min(shape[1], ROW_CHUNK))), compressors=fmt.codecs())
                if torch_dtype is not None:
                    arr.attrs[TORCH_DTYPE_ATTR] = torch_dtype
            arr[i] = data
            count = i + 1
        if count != shape[0]:
            raise ValueError(f"{path}: {count} rows of {name!r} given, expected {shape[0]}")
        _seal(Path(tmp))


def _read_array(path: Path, name: str, arr) -> torch.Tensor:
    try:
        data = np.asarray(arr[...])
    except Exception as exc:  # noqa: BLE001 - zarr reports checksum and codec failures in several types
        raise OSError(f"{path}: array {name!r} cannot be read ({type(exc).__name__}: {exc}); the cache is damaged: "
                      "delete it and re-run the stage that wrote it (or `dvc checkout --force` / `dvc pull`)") from None
    tensor = torch.from_numpy(data)
    if arr.attrs.get(TORCH_DTYPE_ATTR) == "bfloat16":
        tensor = tensor.view(torch.bfloat16)
    return tensor


def read_group(path: str | os.PathLike, names: list[str] | None = None) -> dict[str, torch.Tensor]:
    """All arrays of a group (recursively, slash-separated names), as tensors in their stored dtype."""
    path = Path(path)
    if not (path / "zarr.json").exists():
        raise FileNotFoundError(f"{path}: not a zarr group (missing zarr.json); was the producing stage run?")
    group = _open_checked(path)
    out: dict[str, torch.Tensor] = {}
    try:
        arrays = list(group.arrays()) if names is None else [(n, group[n]) for n in names]
    except KeyError:   # an array the caller named that the group lacks: the caller's error, not damage
        raise
    except Exception as exc:  # noqa: BLE001 - an array's damaged metadata
        raise _damaged(path, f"its arrays cannot be opened ({type(exc).__name__}: {exc})") from None
    for name, arr in arrays:
        out[name] = _read_array(path, name, arr)
    if names is None:
        for sub_name, sub in group.groups():
            for name, value in read_group(path / sub_name).items():
                out[f"{sub_name}/{name}"] = value
    return out


def read_attrs(path: str | os.PathLike) -> dict:
    """The group's attributes (its metadata checked as `read_group` does; the seal left out)."""
    return {k: v for k, v in _open_checked(Path(path)).attrs.items() if k != SEAL_ATTR}
