"""Checkpoints read a tensor at a time: Hugging Face safetensors folders (one file, or an index and
shards) read by name on demand, backbones whose parameters stay on the meta device until a step
loads them, and a writer of sharded folders.

- `CheckpointReader`: a model folder whose tensors are read by name, each file opened only for
  the read; `LazyBackbone`: a skeleton of a backbone whose parameters live on the meta device
  until `loaded(...)` reads the ones a step needs, and go back to meta after.
- `ShardWriter`: writes tensors into shards of bounded size plus the index; `save_multitask_from`:
  the multi-task layout with its backbone copied from a checkpoint group by group.

Tensors from safetensors are memory-mapped (copy-on-write); dropping them gives the pages back.
The drivers that use these are `featcal.calibration.lazy` (FeatCal one block at a time),
`featcal.merging.lazy` (merging one block at a time) and `featcal.evaluation.streamed` (a causal
LM scored one block at a time).
"""

from __future__ import annotations

import contextlib
import copy
import json
import os
import re
import shutil
import struct
from collections import defaultdict
from pathlib import Path
from typing import Iterable, Iterator, Mapping, Sequence

import torch
from safetensors import safe_open
from safetensors.torch import save_file
from torch import Tensor, nn

from featcal.io.models import (atomic_dir, backbone_kwargs, backbone_of, check_finite, is_causal_lm, resolve_model_ref,
                               save_heads)
from featcal.profiling import phase


SINGLE_FILE = "model.safetensors"


INDEX_FILE = "model.safetensors.index.json"


_DTYPES = {
    "F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
    "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8, "U8": torch.uint8,
    "BOOL": torch.bool,
}


def _read_header(path: Path) -> dict:
    """The JSON header of a safetensors file (tensor names, dtypes, shapes), without mapping it."""
    with open(path, "rb") as f:
        raw = f.read(8)
        if len(raw) != 8:
            raise ValueError(f"{path}: not a safetensors file (shorter than 8 bytes)")
        (n,) = struct.unpack("<Q", raw)
        try:
            header = json.loads(f.read(n))
        except (json.JSONDecodeError, UnicodeDecodeError) as exc:
            raise ValueError(f"{path}: not a safetensors file (bad header: {exc})") from None
    header.pop("__metadata__", None)
    return header


class CheckpointReader:
    """Named tensors of a safetensors checkpoint, read on demand.

    `path`: a model folder holding `model.safetensors` or `model.safetensors.index.json` and its
    shards, a single `.safetensors` file, a `package:<module>` or `parts:<name>` reference, or a hub
    id already in the local cache (nothing is downloaded).
    """

    def __init__(self, path: str | os.PathLike):
        self.path = self._resolve(path)
        self.folder = self.path if self.path.is_dir() else self.path.parent
        self.weight_map: dict[str, Path] = {}  # tensor name -> file
        if self.path.is_file():
            files = [self.path]
            self._map_files(files)
        elif (self.path / INDEX_FILE).exists():
            index_path = self.path / INDEX_FILE
            try:
                weight_map = json.loads(index_path.read_text())["weight_map"]
            except (json.JSONDecodeError, KeyError) as exc:
                raise ValueError(f"{index_path}: not a safetensors index ({exc})") from None
            for name, file in weight_map.items():
                shard = self.path / file
                if not shard.exists():
                    raise FileNotFoundError(f"{index_path}: tensor {name!r} is in {file}, which does not exist")
                self.weight_map[name] = shard
        elif (self.path / SINGLE_FILE).exists():
            self._map_files([self.path / SINGLE_FILE])
        else:
            present = sorted(p.name for p in self.path.iterdir())
            raise FileNotFoundError(
                f"{self.path}: no {SINGLE_FILE} nor {INDEX_FILE} (lazy loading reads safetensors only); "
                f"files there: {present}"
            )
        self._headers: dict[Path, dict] = {}
        self.replaced: dict[str, torch.dtype] = {}   # names read from another file -> the dtype they replace

    def with_tensors_from(self, files: Iterable[str | os.PathLike]) -> "CheckpointReader":
        """This checkpoint with each safetensors file's tensors read in place of its own, cast to the
        dtype of the tensor each replaces: the calibrated layers over the merged backbone, read a
        block at a time, as `featcal.io.models.with_parameters_from` puts them into a model in memory
        (the same error for a name the checkpoint lacks; a shape it does not have is one too)."""
        out = copy.copy(self)
        out.weight_map, out.replaced = dict(self.weight_map), dict(self.replaced)
        for path in map(Path, files):
            for name, info in _read_header(path).items():
                if name not in self.weight_map:
                    raise ValueError(f"{path}: parameter {name!r} is not in the model")
                if tuple(info["shape"]) != self.shape(name):
                    raise ValueError(f"{path}: parameter {name!r} has shape {tuple(info['shape'])}, the model's "
                                     f"is {self.shape(name)}")
                out.replaced[name] = self.dtype(name)
                out.weight_map[name] = path
        return out

    @staticmethod
    def _resolve(path: str | os.PathLike) -> Path:
        ref = resolve_model_ref(path)
        if Path(ref).exists():
            return Path(ref)
        try:  # a hub id: only the local cache, never the network
            from huggingface_hub import snapshot_download

            return Path(snapshot_download(ref, local_files_only=True))
        except Exception as exc:  # noqa: BLE001 - any failure means "not available locally"
            raise FileNotFoundError(f"checkpoint {str(path)!r}: no such folder or file, nor a cached hub model ({exc})") from None

    def _map_files(self, files: Sequence[Path]) -> None:
        for file in files:
            for name in _read_header(file):
                self.weight_map[name] = file

    def __contains__(self, name: str) -> bool:
        return name in self.weight_map

    def keys(self) -> list[str]:
        return list(self.weight_map)

    @property
    def files(self) -> list[Path]:
        return sorted(set(self.weight_map.values()))

    def header(self, name: str) -> dict:
        """{"dtype": "F32", "shape": [...], ...} of one tensor, read from its file's header."""
        file = self._file(name)
        if file not in self._headers:
            self._headers[file] = _read_header(file)
        return self._headers[file][name]

    def shape(self, name: str) -> tuple[int, ...]:
        return tuple(self.header(name)["shape"])

    def dtype(self, name: str) -> torch.dtype:
        if name in self.replaced:
            return self.replaced[name]
        code = self.header(name)["dtype"]
        if code not in _DTYPES:
            raise ValueError(f"{self._file(name)}: tensor {name!r} has unsupported dtype {code}")
        return _DTYPES[code]

    def nbytes(self, name: str) -> int:
        start, end = self.header(name)["data_offsets"]
        return end - start

    def _file(self, name: str) -> Path:
        try:
            return self.weight_map[name]
        except KeyError:
            raise KeyError(f"{self.path}: no tensor {name!r} in the checkpoint") from None

    def read(self, names: Iterable[str], rows: slice | None = None) -> dict[str, Tensor]:
        """The named tensors. `rows`: only those rows (first dimension) of each, read without the rest
        of the tensor. Each tensor is read through its own opening of its file: the tensors one opening
        gives share one memory map of the file, which stays (and its touched pages in the RSS) while any
        of them lives, so a caller that lets go of some (`LazyBackbone.release`) would free nothing."""
        out: dict[str, Tensor] = {}
        for name in names:
            with safe_open(self._file(name), framework="pt") as f:
                out[name] = f.get_tensor(name) if rows is None else f.get_slice(name)[rows]
            if name in self.replaced:
                out[name] = out[name].to(self.replaced[name])
        return out

    def groups(self) -> list[list[str]]:
        """The tensor names in natural order, by tensor group (`block_group`: one block, or one other tensor)."""
        out: dict[str, list[str]] = {}
        for name in sorted(self.weight_map, key=_natural):
            out.setdefault(block_group(name), []).append(name)
        return list(out.values())

    def find_prefix(self, name: str) -> str:
        """The prefix under which this checkpoint stores a backbone tensor `name`.

        "" for a bare backbone checkpoint, e.g. "bert." for a task model's; the shortest wins.
        """
        if name in self.weight_map:
            return ""
        found = [k[: -len(name)] for k in self.weight_map if k.endswith("." + name)]
        if not found:
            sample = ", ".join(sorted(self.weight_map)[:5])
            raise KeyError(f"{self.path}: no tensor named {name!r} under any prefix (keys start: {sample}, …)")
        return min(found, key=len)


def stored_names(module: nn.Module) -> dict[str, str]:
    """Parameter name in memory -> the name a checkpoint stores it under. transformers >= 5 renames
    some architectures' tensors when it loads them (ViT: `layers.0.attention.q_proj` in memory,
    `encoder.layer.0.attention.attention.query` on disk) and back when it saves; a reader that
    reads tensor by tensor applies the saving direction's renamings itself."""
    names = [n for n, _ in module.named_parameters(remove_duplicate=False)]
    try:
        from transformers.conversion_mapping import get_model_conversion_mapping
        from transformers.core_model_loading import WeightRenaming, apply_renamings
    except ImportError:   # transformers without conversion mappings stores the names it uses
        return {n: n for n in names}
    if not hasattr(module, "config"):
        return {n: n for n in names}
    reverse = [c.reverse_transform() for c in get_model_conversion_mapping(module, add_legacy=False)[::-1]]
    renamings = [r for r in reverse if isinstance(r, WeightRenaming)]
    return {n: apply_renamings(n, renamings) for n in names}


def meta_skeleton(like: nn.Module) -> nn.Module:
    """A copy of `like` whose parameters are on the meta device (no memory); buffers are copied.

    Tied parameters stay tied. Buffers (position ids, rotary frequencies) are small and derived
    from the config, so the copy of the reference model's is used.
    """
    memo = {
        id(p): nn.Parameter(torch.empty_like(p, device="meta"), requires_grad=False)
        for p in like.parameters()
    }
    return copy.deepcopy(like, memo).eval()


def _set_parameter(root: nn.Module, name: str, param: nn.Parameter) -> None:
    owner, _, leaf = name.rpartition(".")
    module = root.get_submodule(owner) if owner else root
    module._parameters[leaf] = param


class LazyBackbone:
    """A backbone skeleton (shaped like `like`) that reads its parameters from `reader` on demand.

    `loaded(prefixes)` is a context manager: parameters whose names start with one of the
    prefixes are read from the checkpoint (cast to the skeleton's dtype) and are dropped back to
    the meta device on exit. `prefix` is the checkpoint's name prefix of the backbone ("bert." for
    a BertForSequenceClassification checkpoint); found from the tensor names when None.
    """

    def __init__(self, like: nn.Module, reader: CheckpointReader, prefix: str | None = None,
                 dtype: torch.dtype | None = None):
        self.reader = reader
        self.module = meta_skeleton(like)
        self.dtype = dtype
        self.aliases: dict[int, list[str]] = defaultdict(list)  # id(meta param) -> every name it has
        self.meta: dict[str, nn.Parameter] = {}
        for name, p in self.module.named_parameters(remove_duplicate=False):
            self.aliases[id(p)].append(name)
            self.meta[name] = p
        self.stored = stored_names(self.module)
        if not self.meta:
            raise ValueError("the reference backbone has no parameters")
        self.prefix = self._find_prefix() if prefix is None else prefix
        self.device = torch.device("cpu")

    def move_to(self, device: torch.device) -> None:
        """Parameters read from now on, and the buffers (position ids, rotary tables), go to `device`."""
        self.device = device
        for module in self.module.modules():
            for name, buffer in module._buffers.items():
                if buffer is not None:
                    module._buffers[name] = buffer.to(device)

    def _find_prefix(self) -> str:
        errors = []
        for name in self.meta:  # the first parameter may be tied and stored under another name
            try:
                return self.reader.find_prefix(self.stored[name])
            except KeyError as exc:
                errors.append(exc)
                if len(errors) >= 8:
                    break
        raise errors[0]

    def names_under(self, prefixes: Iterable[str]) -> list[str]:
        prefixes = tuple(prefixes)
        return [n for n in self.meta if n.startswith(prefixes)]

    def load(self, names: Iterable[str]) -> list[str]:
        """Read the named parameters (and their tied aliases); returns every name now loaded."""
        groups: dict[int, list[str]] = {}
        for name in names:
            groups[id(self.meta[name])] = self.aliases[id(self.meta[name])]
        keys: dict[int, str] = {}
        for pid, alias_names in groups.items():
            stored = [k for n in alias_names for k in dict.fromkeys((self.stored[n], n)) if self.prefix + k in self.reader]
            if not stored:
                raise KeyError(
                    f"{self.reader.path}: no tensor {self.prefix + self.stored[alias_names[0]]!r} "
                    f"(backbone parameter {alias_names[0]!r}, prefix {self.prefix!r})"
                )
            keys[pid] = self.prefix + stored[0]
        tensors = self.reader.read(keys.values())
        loaded: list[str] = []
        for pid, key in keys.items():
            ref = self.meta[groups[pid][0]]
            value = tensors[key]
            if tuple(value.shape) != tuple(ref.shape):
                raise ValueError(
                    f"{self.reader.path}: tensor {key!r} has shape {tuple(value.shape)}, the model expects "
                    f"{tuple(ref.shape)}"
                )
            param = nn.Parameter(value.to(device=self.device, dtype=self.dtype or ref.dtype), requires_grad=False)
            for alias in groups[pid]:
                _set_parameter(self.module, alias, param)
                loaded.append(alias)
        return loaded

    def release(self, names: Iterable[str]) -> None:
        """Put the named parameters back on the meta device (their memory is freed)."""
        for name in names:
            _set_parameter(self.module, name, self.meta[name])

    @contextlib.contextmanager
    def loaded(self, prefixes: Iterable[str]) -> Iterator[nn.Module]:
        with phase("weights I/O"):
            names = self.load(self.names_under(prefixes))
        try:
            yield self.module
        finally:
            self.release(names)


def module_prefix(backbone: nn.Module, target: nn.Module) -> str:
    for name, module in backbone.named_modules():
        if module is target:
            return name + "."
    raise KeyError(type(target).__name__)


@contextlib.contextmanager
def _parameters_on_meta() -> Iterator[None]:
    """Modules built inside get their parameters on the meta device (no memory, no init); buffers
    (position ids, rotary frequencies) stay real, since the config derives them."""
    from transformers.initialization import no_init_weights

    register = nn.Module.register_parameter

    def on_meta(module, name, param):
        if param is not None:
            param = nn.Parameter(param.to("meta"), requires_grad=False)
        register(module, name, param)

    nn.Module.register_parameter = on_meta
    try:
        with no_init_weights():
            yield
    finally:
        nn.Module.register_parameter = register


def empty_backbone(ref: str | os.PathLike) -> nn.Module:
    """The backbone a checkpoint's config describes, with every parameter on the meta device:
    the shape lazy loading reads into, without holding a model in memory."""
    from transformers import AutoConfig, AutoModel

    config = AutoConfig.from_pretrained(resolve_model_ref(ref))
    with _parameters_on_meta():
        model = AutoModel.from_config(config, **backbone_kwargs(CheckpointReader(ref).keys(), config))
    model.tie_weights()   # as from_pretrained does (T5's shared embeddings): one parameter under each name
    return model.eval()


def load_head(expert_dir: str | os.PathLike) -> nn.Module:
    """An expert's task model with only its head in memory (backbone on the meta device): enough to
    save the head or, with `with_backbone_assigned`, to score any backbone of the family."""
    from transformers import AutoConfig

    from featcal.io.models import task_model_class

    config = AutoConfig.from_pretrained(resolve_model_ref(expert_dir))
    with _parameters_on_meta():
        model = task_model_class(config).from_config(config)
    model.tie_weights()
    prefix = model.base_model_prefix + "."
    head = [n for n, _ in model.named_parameters() if not n.startswith(prefix)]
    model.load_state_dict(CheckpointReader(expert_dir).read(head), strict=False, assign=True)
    return model.eval()


HeadSource = nn.Module | str | os.PathLike   # a `load_head` model, or the expert folder to load it from


def head_model(head: HeadSource) -> nn.Module:
    """`head` itself, or `load_head` of a folder: where a head is large (a causal LM's own LM head,
    vocabulary x hidden floats), a caller given folders holds one task's head at a time."""
    return head if isinstance(head, nn.Module) else load_head(head)


def with_backbone_assigned(task_model: nn.Module, backbone: nn.Module) -> nn.Module:
    """`task_model` reading `backbone`'s parameters (shared, not copied; the head is kept). A causal
    LM's head tied to the embeddings is tied to the new ones (assigning replaced the tensor it shared)."""
    backbone_of(task_model).load_state_dict(backbone.state_dict(), assign=True)
    if is_causal_lm(task_model):
        task_model.tie_weights()
    return task_model


_BLOCK = re.compile(r"^(.*?\.(?:layer|layers|block|blocks|h)\.\d+)\.")


def block_group(name: str) -> str:
    """The tensors of one block share a group ("encoder.layer.3"); any other tensor is its own."""
    m = _BLOCK.match(name)
    return m.group(1) if m else name


def _natural(name: str) -> list:
    return [int(part) if part.isdigit() else part for part in re.split(r"(\d+)", name)]


def parse_size(size: int | str) -> int:
    """Bytes from an int or a string like "5GB", "500MB", "200KiB" (decimal units as in HF)."""
    if isinstance(size, int):
        return size
    m = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([KMGT]?I?B)?\s*", str(size).upper())
    if not m:
        raise ValueError(f"max_shard_size: cannot read {size!r} (e.g. 2GB, 500MB, 1048576)")
    units = {None: 1, "B": 1, "KB": 10**3, "MB": 10**6, "GB": 10**9, "TB": 10**12,
             "KIB": 2**10, "MIB": 2**20, "GIB": 2**30, "TIB": 2**40}
    return int(float(m.group(1)) * units[m.group(2)])


class ShardWriter:
    """Writes tensors into safetensors shards of at most `max_shard_size` bytes (a tensor larger
    than that gets a shard of its own), then the HF index; one shard is held in memory at a time."""

    def __init__(self, folder: Path, max_shard_size: int):
        self.folder, self.max = folder, max_shard_size
        self.current: dict[str, Tensor] = {}
        self.size = 0
        self.shards: list[tuple[Path, list[str]]] = []
        self.total = 0

    def add(self, name: str, tensor: Tensor) -> None:
        nbytes = tensor.numel() * tensor.element_size()
        if self.current and self.size + nbytes > self.max:
            self.flush()
        self.current[name] = tensor.contiguous()
        self.size += nbytes
        self.total += nbytes

    def flush(self) -> None:
        if not self.current:
            return
        path = self.folder / f".shard-{len(self.shards):05d}.safetensors"
        save_file(self.current, path, metadata={"format": "pt"})
        self.shards.append((path, list(self.current)))
        self.current, self.size = {}, 0

    def close(self) -> list[Path]:
        """Name the shards `model-0000k-of-0000N.safetensors` (or `model.safetensors` when there is
        one) and write `model.safetensors.index.json`; returns the files written."""
        self.flush()
        n = len(self.shards)
        if n == 1:
            target = self.folder / SINGLE_FILE
            os.replace(self.shards[0][0], target)
            return [target]
        weight_map, written = {}, []
        for k, (path, names) in enumerate(self.shards, start=1):
            target = self.folder / f"model-{k:05d}-of-{n:05d}.safetensors"
            os.replace(path, target)
            written.append(target)
            weight_map.update({name: target.name for name in names})
        index = {"metadata": {"total_size": self.total}, "weight_map": dict(sorted(weight_map.items()))}
        (self.folder / INDEX_FILE).write_text(json.dumps(index, indent=2) + "\n")
        return written + [self.folder / INDEX_FILE]


COPY_SHARD_BYTES = 10**9   # shards of a checkpoint copied group by group: at most this, or the source's largest file


def save_multitask_from(out_dir: str | os.PathLike, reader: CheckpointReader, heads: Mapping[str, HeadSource],
                        encoder=None) -> list[Path]:
    """`featcal.io.models.save_multitask`'s layout with the backbone copied from a checkpoint (e.g.
    the merged folder `with_tensors_from` the calibrated layers) one tensor group at a time, so no
    whole model is in memory: the source's tensors under their names, in shards no larger than its
    own largest file nor `COPY_SHARD_BYTES`, and its `config.json`; the heads (`save_heads`, a head
    given as a folder loaded only while it is written) and the encoder first, so a non-finite head
    stops it before gigabytes are copied. Written atomically; nothing is written when a tensor is
    NaN or infinite. Returns the weight files written."""
    config = reader.folder / "config.json"
    if not config.is_file():
        raise FileNotFoundError(f"{reader.folder}: no config.json to copy with its tensors")
    largest = max(file.stat().st_size for file in reader.files)
    with atomic_dir(out_dir) as tmp:
        for k, (task, head) in enumerate(heads.items()):
            save_heads(tmp, {task: head_model(head)}, encoder if k == 0 else None, target=out_dir)
        writer = ShardWriter(tmp, min(largest, COPY_SHARD_BYTES))
        for group in reader.groups():
            tensors = reader.read(group)
            check_finite(tensors, f"refusing to write {out_dir}: the backbone")
            for name, value in tensors.items():
                writer.add(name, value)
            del tensors
        written = writer.close()
        shutil.copy2(config, tmp / "config.json")
    return [Path(out_dir) / p.name for p in written]
