"""Lazy per-layer loading: read experts one block at a time from their safetensors files.

Peak memory then grows with one layer × number of experts instead of the whole model × number of
experts. Three pieces:

- `CheckpointReader`: a Hugging Face model folder (`model.safetensors`, or
  `model.safetensors.index.json` + shards) whose tensors are read by name on demand, each file
  opened only for the read.
- `LazyBackbone`: a skeleton of a backbone whose parameters live on the meta device (no memory)
  until `loaded(...)` reads the ones a step needs from a checkpoint; they go back to meta after.
  `LazyWeights` gives the walk (`featcal.walk`) one block of the base and of every expert at a
  time (plus, for the expert streams' entry, each expert's embeddings while its stream is built);
  `calibrate_lazy` is the whole-model walk with it.
- `lazy_merge`: merges tensor group by tensor group (one block at a time) with the merge registry
  and writes the merged backbone shard by shard, in the Hugging Face sharded format. Given a
  `MergeContext` with train batches it also runs RegMean and RegMean++ (the forward-order walk
  over `LazyWeights`) and AdaMerging (blocks read again at every checkpointed call).

Tensors from safetensors are memory-mapped (copy-on-write); dropping them gives the pages back.
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
from typing import Callable, Iterable, Iterator, Mapping, Sequence

import torch
from safetensors import safe_open
from safetensors.torch import save_file
from torch import Tensor, nn
from tqdm.auto import tqdm

from .calibrate import (
    CalibrationResult,
    FeatCalConfig,
    MomentReducer,
    SumReducer,
    check_tasks,
    enter_streams,
    student_backbone,
)
from .families import Family, family_for
from .merging import MergeContext, build_options, get_method, merge_state_dicts
from .merging.adamerging import combine, fit_lambda, tied_aliases
from .merging.registry import check_context, compute_dtype
from .merging.regmean import (
    check_batches,
    pre_block_names,
    regmean_plus_plus_record,
    regmean_record,
    walk_regmean,
    write_into,
)
from .modeling import atomic_dir, check_finite, ratio_of, resolve_model_ref, task_vector_sums, warn_if_implausible
from .profiling import phase
from .walk import walk_all

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
    shards, a single `.safetensors` file, a `package:<module>` reference, or a hub id already in the
    local cache (nothing is downloaded).
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

    def read(self, names: Iterable[str]) -> dict[str, Tensor]:
        """The named tensors; each file is opened once for this call and closed after."""
        by_file: dict[Path, list[str]] = defaultdict(list)
        names = list(names)
        for name in names:
            by_file[self._file(name)].append(name)
        out: dict[str, Tensor] = {}
        for file, file_names in by_file.items():
            with safe_open(file, framework="pt") as f:
                for name in file_names:
                    out[name] = f.get_tensor(name)
        return {name: out[name] for name in names}

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


# --- a backbone whose parameters are read on demand ----------------------------------------------


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
                return self.reader.find_prefix(name)
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
            stored = [n for n in alias_names if self.prefix + n in self.reader]
            if not stored:
                raise KeyError(
                    f"{self.reader.path}: no tensor {self.prefix + alias_names[0]!r} "
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


def block_prefixes(family: Family, backbone: nn.Module) -> list[str]:
    return [family.block_prefix(backbone, i) for i in range(len(family.blocks(backbone)))]


def outer_prefixes(family: Family, backbone: nn.Module) -> list[str]:
    """Parameter names outside every block (embeddings, final norms, pooler): each as a prefix."""
    inside = tuple(block_prefixes(family, backbone))
    return [n for n, _ in backbone.named_parameters(remove_duplicate=False) if not n.startswith(inside)]


def module_prefix(backbone: nn.Module, target: nn.Module) -> str:
    for name, module in backbone.named_modules():
        if module is target:
            return name + "."
    raise KeyError(type(target).__name__)


def leaves_stage(family: Family, backbone: nn.Module, index: int) -> bool:
    """Whether running block `index` also runs parameters outside the blocks (T5: the last encoder
    block hands over to the decoder through the encoder's final norm and the decoder's embeddings)."""
    n_encoder = getattr(family, "n_encoder_blocks", None)
    decoder = getattr(family, "decoder", None)
    return (
        n_encoder is not None and decoder is not None and decoder(backbone) is not None
        and index == n_encoder(backbone) - 1
    )


class LazyWeights:
    """`featcal.walk.BlockWeights` read from safetensors folders: a step holds one block (or the
    pooler) of the base and of each expert; each expert's embeddings only while its stream enters.

    `like` is the backbone whose shape the checkpoints have (the student, or `empty_backbone`).
    """

    def __init__(self, family: Family, like: nn.Module, base: str | os.PathLike | None,
                 experts: Mapping[str, str | os.PathLike]):
        self.family, self.like = family, like
        self.base = None if base is None else LazyBackbone(like, CheckpointReader(base))  # None: experts only
        self.experts = {t: LazyBackbone(like, CheckpointReader(path)) for t, path in experts.items()}
        self.outer = outer_prefixes(family, like)
        self.blocks = block_prefixes(family, like)

    @contextlib.contextmanager
    def _loaded(self, base_prefixes: list[str], expert_prefixes: list[str]):
        with contextlib.ExitStack() as stack:
            base = None if self.base is None else stack.enter_context(self.base.loaded(base_prefixes))
            experts = {t: stack.enter_context(e.loaded(expert_prefixes)) for t, e in self.experts.items()}
            yield base, experts

    @contextlib.contextmanager
    def on(self, device: torch.device):
        """Read every tensor onto `device` inside the block (the host again after it)."""
        lazy = ([] if self.base is None else [self.base]) + list(self.experts.values())
        for backbone in lazy:
            backbone.move_to(device)
        try:
            yield
        finally:
            for backbone in lazy:
                backbone.move_to(torch.device("cpu"))

    def block(self, index: int):
        leaves = leaves_stage(self.family, self.like, index)
        return self._loaded([self.blocks[index]], [self.blocks[index]] + (self.outer if leaves else []))

    def pooler(self):
        where = [module_prefix(self.like, self.family.pooler(self.like))]
        return self._loaded(where, where)

    def enter_experts(self, family: Family, batches) -> dict:
        streams = {}
        for task, task_batches in batches.items():
            if not task_batches:  # possible on one process of a data-parallel run
                streams[task] = []
                continue
            with self.experts[task].loaded(self.outer) as expert:
                streams[task] = [family.enter(expert, b) for b in task_batches]
        return streams

    @torch.no_grad()
    def expert_head_features(self, family: Family, streams) -> dict[str, list[Tensor]]:
        """Each expert's non-block tensors only while its own features are taken (one expert at a time)."""
        out = {}
        for task, task_streams in streams.items():
            if not task_streams:
                out[task] = []
                continue
            with self.experts[task].loaded(self.outer) as expert:
                out[task] = [family.head_features(expert, s) for s in task_streams]
        return out


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
        model = AutoModel.from_config(config)
    model.tie_weights()   # as from_pretrained does (T5's shared embeddings): one parameter under each name
    return model.eval()


def load_head(expert_dir: str | os.PathLike) -> nn.Module:
    """An expert's task model with only its head in memory (backbone on the meta device): enough to
    save the head or, with `with_backbone_assigned`, to score any backbone of the family."""
    from transformers import AutoConfig, AutoModelForSequenceClassification

    config = AutoConfig.from_pretrained(resolve_model_ref(expert_dir))
    with _parameters_on_meta():
        model = AutoModelForSequenceClassification.from_config(config)
    model.tie_weights()
    prefix = model.base_model_prefix + "."
    head = [n for n, _ in model.named_parameters() if not n.startswith(prefix)]
    model.load_state_dict(CheckpointReader(expert_dir).read(head), strict=False, assign=True)
    return model.eval()


def with_backbone_assigned(task_model: nn.Module, backbone: nn.Module) -> nn.Module:
    """`task_model` reading `backbone`'s parameters (shared, not copied; the head is kept)."""
    from .families.base import backbone_of

    backbone_of(task_model).load_state_dict(backbone.state_dict(), assign=True)
    return task_model


def calibrate_lazy(
    merged: nn.Module,
    base_dir: str | os.PathLike,
    expert_dirs: Mapping[str, str | os.PathLike],
    batches: Mapping[str, Sequence[Mapping[str, Tensor]]],
    config: FeatCalConfig | None = None,
    family: Family | None = None,
    inplace: bool = False,
    progress: bool = True,
    reduce_moments: MomentReducer | None = None,
    reduce_sums: SumReducer | None = None,
) -> CalibrationResult:
    """`featcal.calibrate.calibrate` with the base and the experts read from safetensors folders
    one block at a time (`LazyWeights`), instead of loaded whole.

    `merged` is in memory (it becomes the calibrated model). `base_dir` and `expert_dirs[task]` are
    Hugging Face model folders (task models or bare backbones, single-file or sharded). Parameters
    are cast to the merged model's dtypes. Gives the same result as `calibrate` with the same
    experts loaded whole.
    """
    family = family or family_for(merged)
    check_tasks(batches, expert_dirs)
    student = student_backbone(family, merged, inplace)
    weights = LazyWeights(family, student, base_dir, {t: expert_dirs[t] for t in batches})
    result = walk_all(family, student, weights, batches, config or FeatCalConfig(), progress=progress,
                      desc="featcal (lazy)", reduce_moments=reduce_moments, reduce_sums=reduce_sums)
    return CalibrationResult(student, result.drift, result.reports)


# --- merging tensor group by tensor group, writing shard by shard -----------------------------------

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


def streams(method: str, options: Mapping | None) -> bool:
    """Whether `lazy_merge` can run this method without a context: it declares none and, with these
    options, acts tensor group by tensor group (`featcal.merging.registry.MergeMethod.streams`).
    The data methods of `DATA_MERGES` run through `lazy_merge` too, given a context."""
    return get_method(method).streams(build_options(method, options))


# the context fields lazy_merge fills itself (skeletons read from the folders' configs)
DRIVER_FIELDS = ("base", "experts", "family")


def _refuse_unstreamable(method: str, opts, context: MergeContext | None = None) -> None:
    spec = get_method(method)
    if spec.needs:
        if method not in DATA_MERGES:
            raise ValueError(
                f"merge method {method!r} needs {', '.join(sorted(spec.needs))} (models and data), which lazy_merge "
                f"does not supply (of the data methods it runs {', '.join(DATA_MERGES)}, given a context); use "
                "featcal.merge_models in memory with a MergeContext"
            )
        check_context(method, context, filled=DRIVER_FIELDS)
        return
    if not spec.streams(opts):
        raise ValueError(
            f"merge method {method!r} with scope='model' needs one threshold over the whole model, "
            "which a per-block merge cannot compute; use scope='tensor' or featcal.merge_models in memory"
        )


def backbone_prefix(folder: Path, reader: CheckpointReader) -> str:
    """The task model's backbone prefix ("bert.") when the checkpoint has its keys, else ""."""
    try:
        from transformers import AutoConfig, AutoModel

        config = AutoConfig.from_pretrained(folder)
        prefix = AutoModel._model_mapping[type(config)].base_model_prefix
    except Exception:  # noqa: BLE001 - unknown config or class: treat the checkpoint as a backbone
        return ""
    if prefix and any(k.startswith(prefix + ".") for k in reader.keys()):
        return prefix + "."
    return ""


WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth", ".h5", ".msgpack", ".ckpt")


def backbone_dtypes(base: CheckpointReader, prefix: str) -> dict[str, torch.dtype]:
    """The base checkpoint's backbone tensors (names without `prefix`, natural order) and dtypes."""
    names = sorted((k for k in base.keys() if k.startswith(prefix)), key=_natural)
    if not names:
        raise ValueError(f"{base.path}: no tensor starts with the backbone prefix {prefix!r}")
    return {n[len(prefix):]: base.dtype(n) for n in names}


class MergeFolders:
    """The base and expert checkpoints of a lazy merge, read by backbone tensor name (prefixes
    stripped): `names` in natural order, `copied` the non-floating ones (the base's, unmerged),
    `groups` the names by tensor group (one block, or one other tensor)."""

    def __init__(self, base: CheckpointReader, prefix: str, experts: Sequence[CheckpointReader],
                 expert_prefixes: Sequence[str], paths: Sequence[str | os.PathLike]):
        self.base, self.prefix = base, prefix
        self.experts, self.expert_prefixes, self.paths = list(experts), list(expert_prefixes), list(paths)
        self.dtypes = backbone_dtypes(base, prefix)
        self.names = list(self.dtypes)
        self.copied = {n for n, dtype in self.dtypes.items() if not dtype.is_floating_point}
        self.groups: dict[str, list[str]] = {}
        for name in self.names:
            self.groups.setdefault(block_group(name), []).append(name)

    def dtype(self, name: str) -> torch.dtype:
        return self.dtypes[name]

    def read_base(self, names: Sequence[str]) -> dict[str, Tensor]:
        return dict(zip(names, self.base.read(self.prefix + n for n in names).values()))

    def read_experts(self, names: Sequence[str]) -> list[dict[str, Tensor]]:
        return [dict(zip(names, reader.read(p + n for n in names).values()))
                for reader, p in zip(self.experts, self.expert_prefixes)]

    def read_checked(self, group: Sequence[str], sums: list[list[float]]) -> tuple[dict[str, Tensor], list[str], list[dict[str, Tensor]]]:
        """A group's base tensors, its floating names and the experts' tensors of those, each expert's
        checked finite, its ‖τ‖² and ‖θ_base‖² added to `sums` (the implausible-expert check)."""
        base_sd = self.read_base(group)
        short = [n for n in group if n not in self.copied]
        expert_sds = self.read_experts(short)
        for k, (path, sd) in enumerate(zip(self.paths, expert_sds)):
            check_finite(sd, f"expert {path}")
            diff, norm = task_vector_sums({s: base_sd[s] for s in short}, sd)
            sums[k][0] += diff
            sums[k][1] += norm
        return base_sd, short, expert_sds

    def compute_dtype(self, name: str) -> torch.dtype:
        return compute_dtype(self.dtype(name), *(r.dtype(p + name) for r, p in zip(self.experts, self.expert_prefixes)))

    def mean(self, names: Sequence[str]) -> dict[str, Tensor]:
        """(1/T) Σ_i θ_i per tensor, in the compute dtype (as `merge_state_dicts` upcasts)."""
        experts = self.read_experts(names)
        out = {}
        for name in names:
            dtype = self.compute_dtype(name)
            out[name] = torch.stack([e[name].to(dtype) for e in experts]).mean(dim=0)
        return out


class CheckpointTaskVectors:
    """`featcal.merging.adamerging.TaskVectors` read from the checkpoints at every call: θ₀ and the
    stacked τ_t = θ_t − θ₀ of the names asked for, in the compute dtype."""

    def __init__(self, folders: MergeFolders):
        self.folders = folders

    def read(self, names: Sequence[str]) -> tuple[dict[str, Tensor], dict[str, Tensor]]:
        names = list(names)
        with phase("weights I/O"):
            base, experts = self.folders.read_base(names), self.folders.read_experts(names)
        base = {n: base[n].to(self.folders.compute_dtype(n)) for n in names}
        taus = {n: torch.stack([e[n].to(base[n].dtype) - base[n] for e in experts]) for n in names}
        return base, taus


def _backbone_skeleton(folders: MergeFolders) -> nn.Module:
    """The base checkpoint's backbone with every parameter on the meta device; a pooler the
    checkpoint does not hold (a classifier built without one) is dropped from it."""
    like = empty_backbone(folders.base.folder)
    pooler = family_for(like).pooler(like)
    if pooler is not None and hasattr(like, "pooler"):
        where = module_prefix(like, pooler)
        if not any(n.startswith(where) for n in folders.names):
            like.pooler = None
    return like


def _task_skeleton(path: str | os.PathLike) -> nn.Module:
    """An expert's task model with only its head in memory; its bare backbone (meta) if it has no head."""
    try:
        return load_head(path)
    except KeyError:
        return empty_backbone(path)


def _lazy_context(method: str, context: MergeContext | None, folders: MergeFolders,
                  expert_dirs: Mapping[str, str | os.PathLike]) -> MergeContext:
    """The context with the models lazy_merge fills when unset (skeletons: parameters on the meta
    device, the experts' heads loaded), checked; its record cleared."""
    context = MergeContext() if context is None else context
    if context.base is None:
        context.base = _backbone_skeleton(folders)
    if context.family is None:
        context.family = family_for(context.base)
    if context.experts is None:
        context.experts = {t: _task_skeleton(p) for t, p in expert_dirs.items()}
    elif list(context.experts) != list(expert_dirs):
        raise ValueError(f"the context's experts {list(context.experts)} are not the experts merged {list(expert_dirs)}")
    context = check_context(method, context)
    context.record.clear()
    return context


def _ordered(like: nn.Module, names: Iterable[str]) -> list[str]:
    """`names` in the backbone's state-dict order (as the in-memory merge sees them), others after."""
    order = {n: i for i, n in enumerate(like.state_dict())}
    return sorted(names, key=lambda n: (order.get(n, len(order)), _natural(n)))


Write = Callable[[str, Tensor], None]


def _regmean_lazy(method: str, opts, context: MergeContext, folders: MergeFolders,
                  expert_dirs: Mapping[str, str | os.PathLike], write: Write) -> None:
    """RegMean / RegMean++ through `walk_regmean` with `LazyWeights`: one block of every expert at a time.
    RegMean: each expert's stream through its own blocks; the tensors outside the blocks averaged
    group by group. RegMean++: the merged model M holds its non-block tensors (θ₀, pre-block ones
    averaged) and each merged block while it runs; post-block tensors stay θ₀."""
    family, like, tasks = context.family, context.base, list(context.experts)
    batches = check_batches(method, context)
    weights = LazyWeights(family, like, None, {t: expert_dirs[t] for t in tasks})
    floats = _ordered(like, (n for n in folders.names if n not in folders.copied))
    done: set[str] = set()

    def emit(tensors: Mapping[str, Tensor]) -> None:
        for name, value in tensors.items():
            write(name, value)
            done.add(name)

    blocks = tuple(block_prefixes(family, like))
    if method == "regmean":
        solves = walk_regmean(family, like, weights, weights.enter_experts(family, batches), tasks, opts.off_diagonal, emit)
        for group in _in_groups([n for n in floats if n not in done]):   # outside the blocks: the mean
            emit(folders.mean(group))
        context.record.update(regmean_record(solves))
        return
    merged = LazyBackbone(like, folders.base, prefix=folders.prefix)   # M: its non-block tensors for the whole walk
    stored = set(folders.names)
    merged.load([n for n in outer_prefixes(family, like) if n in stored])
    # the record names tensors as the in-memory merge does (every name of a tied tensor); the
    # checkpoint holds one name of each
    named = [n for n, v in like.state_dict().items() if v.is_floating_point()]
    pre_all = pre_block_names(family, merged.module, next(iter(batches.values()))[0])
    pre = sorted(pre_all & set(floats))
    pre_mean = folders.mean(pre)
    write_into(merged.module, pre_mean)
    emit(pre_mean)
    solves = walk_regmean(family, like, weights, enter_streams(family, merged.module, batches), tasks,
                          opts.off_diagonal, emit, merged=merged.module)
    for group in _in_groups([n for n in floats if n not in done]):   # post-block: θ₀ (in a block: averaged)
        averaged = [n for n in group if n.startswith(blocks)]
        kept = [n for n in group if n not in averaged]
        if averaged:
            emit(folders.mean(averaged))
        if kept:
            emit({n: v.to(folders.compute_dtype(n)) for n, v in folders.read_base(kept).items()})
    kept = [n for n in named if n not in pre_all and not n.startswith(blocks)]
    context.record.update(regmean_plus_plus_record(solves, sorted(pre_all & set(named)), kept))


def _adamerging_lazy(method: str, opts, context: MergeContext, folders: MergeFolders,
                     expert_dirs: Mapping[str, str | os.PathLike], write: Write) -> None:
    """AdaMerging's `fit_lambda` on `CheckpointTaskVectors` (blocks read per call, module docstring
    of `featcal.merging.adamerging`), then θ(λ*) written group by group."""
    like = context.base
    batches = check_batches(method, context)
    floats = _ordered(like, (n for n in folders.names if n not in folders.copied))
    aliases = tied_aliases(like, set(floats))
    names = [n for n in floats if n not in aliases]
    vectors = CheckpointTaskVectors(folders)
    lam, record = fit_lambda(context.family, like, context.experts, batches, names, aliases, vectors, opts)
    rows = {name: p for p, name in enumerate(names)}
    rows.update({alias: rows[name] for alias, name in aliases.items()})
    coef = lam.clamp(0.0, 1.0) if opts.clamp else lam
    with torch.no_grad():
        for group in folders.groups.values():
            group = [n for n in group if n not in folders.copied]
            if group:
                base, taus = vectors.read(group)
                for name, value in combine(base, taus, coef, rows, group).items():
                    write(name, value)
    context.record.update(record)


def _in_groups(names: Sequence[str]) -> list[list[str]]:
    groups: dict[str, list[str]] = {}
    for name in names:
        groups.setdefault(block_group(name), []).append(name)
    return list(groups.values())


# data methods lazy_merge runs (given a context), and how
DATA_MERGES = {"regmean": _regmean_lazy, "regmean_plus_plus": _regmean_lazy, "adamerging": _adamerging_lazy}


def lazy_merge(
    base_dir: str | os.PathLike,
    expert_dirs: Mapping[str, str | os.PathLike] | Sequence[str | os.PathLike],
    method: str = "task_arithmetic",
    options: Mapping | None = None,
    out_dir: str | os.PathLike = "merged",
    max_shard_size: int | str = "2GB",
    prefix: str | None = None,
    progress: bool = True,
    context: MergeContext | None = None,
) -> Path:
    """Merge the experts' backbones block by block, reading tensors lazily; write the merged
    backbone as a Hugging Face folder (`AutoModel.from_pretrained(out_dir)` loads it).

    Same tensors as `featcal.merge_models` with the models loaded whole. `prefix` selects the
    backbone's tensors in task-model checkpoints (found from the config when None; "" for all).
    Output: shards of at most `max_shard_size` + `model.safetensors.index.json` (one file when it
    fits), `config.json` and the base folder's other small files; written atomically. Names and
    shapes are checked from the headers before any tensor is read; every expert tensor is checked
    finite, and an expert whose task vector is implausible for a fine-tune of the base gets a warning.

    What streams, and the peak memory:
    - Methods without a context that act tensor group by tensor group (`streams`): one group (a
      block, or one other tensor) of the base and of every expert at a time, plus one shard being
      written. Names handed to the method are the backbone's, so DARE's seeded masks agree.
    - RegMean, RegMean++ and AdaMerging (`DATA_MERGES`) with `context` (`MergeContext`;
      `expert_dirs` then maps each task to its folder, and `context.batches` holds each task's
      unlabelled train batches). lazy_merge fills `context.base` (the base's backbone skeleton,
      parameters on the meta device), `context.experts` (each task model with only its head
      loaded) and `context.family` when unset; the weights are always read from the folders. A
      first pass reads each group once for the checks; then:
      RegMean / RegMean++ walk the blocks in forward order (`featcal.merging.regmean.walk_regmean`
      over `LazyWeights`): one block of every expert at a time (an expert's non-block tensors only
      while its own stream enters or its head features are taken), one block's float64 Grams,
      the streams of every task's batches at one block boundary; RegMean++ also holds the merged
      model's non-block tensors. RegMean's non-block tensors are averaged group by group.
      AdaMerging (`featcal.merging.adamerging.fit_lambda` over `CheckpointTaskVectors`): the
      non-block tensors of the base and of every task vector for the whole run, one block of
      the base and of every expert at a time (read again at every block call, forward and
      recompute), the heads, and the saved block inputs of one step.
      `context.record` gets what the method reports, as in the in-memory merge.
    Methods that need the whole model at once (TIES with `scope="model"`) or another context
    (SigMerge's dev scores) are refused.
    """
    opts = build_options(method, options)
    spec = get_method(method)
    _refuse_unstreamable(method, opts, context)
    if spec.needs and not isinstance(expert_dirs, Mapping):
        raise ValueError(f"lazy_merge with {method!r}: expert_dirs must map each task to its folder "
                         "(the context's batches are per task)")
    base_path = Path(resolve_model_ref(base_dir))
    base = CheckpointReader(base_path)
    paths = list(expert_dirs.values()) if isinstance(expert_dirs, Mapping) else list(expert_dirs)
    if not paths:
        raise ValueError("lazy_merge needs at least one expert folder, got 0")
    experts = [CheckpointReader(p) for p in paths]
    if prefix is None:
        prefix = backbone_prefix(base.folder, base)
    dtypes = backbone_dtypes(base, prefix)
    # integer buffers (e.g. position_ids, which older checkpoints store and newer ones do not) are
    # the base's, unmerged, as in merge_state_dicts: the experts need not hold them
    floats = [n for n, dtype in dtypes.items() if dtype.is_floating_point]
    # check names and shapes from the headers first: no tensor is read for a mismatch
    expert_prefixes = []
    for path, reader in zip(paths, experts):
        p = reader.find_prefix(floats[0])  # with or without a head
        expert_prefixes.append(p)
        for name in floats:
            key = p + name
            if key not in reader:
                raise ValueError(f"expert {path}: no tensor {key!r} (the base {base.path} has {prefix + name!r})")
            if reader.shape(key) != base.shape(prefix + name):
                raise ValueError(
                    f"expert {path}: tensor {key!r} has shape {reader.shape(key)}, the base has {base.shape(prefix + name)}"
                )
    folders = MergeFolders(base, prefix, experts, expert_prefixes, paths)

    out_dir = Path(out_dir)
    sums = [[0.0, 0.0] for _ in paths]   # per expert: ‖τ‖², ‖θ_base‖² (the implausible-expert check)
    with atomic_dir(out_dir) as tmp:
        writer = ShardWriter(tmp, parse_size(max_shard_size))
        if spec.needs:
            for group in tqdm(folders.groups.values(), desc="check (lazy)", unit="group", disable=not progress):
                folders.read_checked(group, sums)
            for path, (diff, norm) in zip(paths, sums):
                warn_if_implausible(str(path), ratio_of(diff, norm))
            context = _lazy_context(method, context, folders, expert_dirs)
            written: set[str] = set()

            def write(name: str, value: Tensor) -> None:
                if name not in folders.dtypes:   # a tied alias the checkpoint does not store
                    return
                if name in written:
                    raise RuntimeError(f"lazy_merge {method!r}: tensor {name!r} written twice")
                writer.add(name, value.detach().to(folders.dtypes[name]))
                written.add(name)

            with phase(f"merge {method} (lazy)"):
                DATA_MERGES[method](method, opts, context, folders, expert_dirs, write)
            for name in folders.names:
                if name in folders.copied:
                    write(name, folders.read_base([name])[name])
            missing = [n for n in folders.names if n not in written]
            if missing:
                raise RuntimeError(f"lazy_merge {method!r} did not write {missing[:5]} ({len(missing)} tensors)")
        else:
            for group in tqdm(folders.groups.values(), desc="merge (lazy)", unit="group", disable=not progress):
                base_sd, short, expert_sds = folders.read_checked(group, sums)
                merged = merge_state_dicts(method, {s: base_sd[s] for s in short}, expert_sds, opts) if short else {}
                for name in group:
                    writer.add(name, merged[name] if name in merged else base_sd[name])
                del base_sd, expert_sds
        writer.close()
        if not spec.needs:
            for path, (diff, norm) in zip(paths, sums):
                warn_if_implausible(str(path), ratio_of(diff, norm))
        _write_config(base.folder, tmp, stripped=bool(prefix))
        for extra in base.folder.iterdir():
            if (extra.is_file() and extra.name not in ("config.json", INDEX_FILE)
                    and not extra.name.endswith(WEIGHT_SUFFIXES)):
                shutil.copy2(extra, tmp / extra.name)
    return out_dir


def _write_config(src: Path, dst: Path, stripped: bool) -> None:
    config_path = src / "config.json"
    if not config_path.exists():
        return
    config = json.loads(config_path.read_text())
    if stripped:  # the output holds only the backbone: name the backbone class
        try:
            from transformers import AutoConfig, AutoModel

            cls = AutoModel._model_mapping[type(AutoConfig.from_pretrained(src))]
            config["architectures"] = [cls.__name__]
        except Exception:  # noqa: BLE001
            config.pop("architectures", None)
    (dst / "config.json").write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")


__all__ = [
    "DATA_MERGES", "CheckpointReader", "CheckpointTaskVectors", "LazyBackbone", "LazyWeights", "MergeFolders",
    "ShardWriter", "calibrate_lazy", "empty_backbone", "lazy_merge", "load_head", "meta_skeleton",
    "with_backbone_assigned", "parse_size",
]
