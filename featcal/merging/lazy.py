"""Merging block by block from checkpoints, writing the merged backbone shard by shard.

`lazy_merge` merges tensor group by tensor group (one block at a time) with the merge registry and
writes the merged backbone in the Hugging Face sharded format. Given a `MergeContext` with train
batches it also runs RegMean and RegMean++ (the forward-order walk over `LazyWeights`) and
AdaMerging (blocks read again at every checkpointed call).
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path
from typing import AbstractSet as Set, Callable, Iterable, Mapping, Sequence

import torch
from torch import Tensor, nn
from tqdm.auto import tqdm

from featcal.calibration.calibrate import enter_streams
from featcal.calibration.lazy import LazyWeights
from featcal.families import family_for
from featcal.families.base import block_prefixes, outer_prefixes
from featcal.io.checkpoints import (
    _natural, block_group, CheckpointReader, empty_backbone, INDEX_FILE, LazyBackbone, load_head, module_prefix, parse_size, ShardWriter,
)
from featcal.io.models import (
    CAUSAL_LM_SUFFIX, atomic_dir, check_finite, ratio_of, resolve_model_ref, task_vector_sums, warn_if_implausible,
)
from featcal.merging.adamerging import combine, fit_lambda, tied_aliases
from featcal.merging.registry import (
    MergeContext, build_options, check_context, compute_dtype, fill_models, get_method, merge_state_dicts,
)
from featcal.merging.regmean import (
    check_batches, pre_block_names, regmean_plus_plus_record, regmean_record, walk_regmean, write_into,
)
from featcal.profiling import phase


Write = Callable[[str, Tensor], None]
ROW_CHUNK_BYTES = 64 * 2**20   # an elementwise merge reads a larger tensor this many bytes of rows at a time


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


class MergeFolders:
    """The base and expert checkpoints of a lazy merge, read by backbone tensor name (prefixes
    stripped): `names` in natural order, `copied` the non-floating ones (the base's, unmerged),
    `groups` the names by tensor group (one block, or one other tensor); `absent`: base tensors no
    expert holds, left out."""

    def __init__(self, base: CheckpointReader, prefix: str, experts: Sequence[CheckpointReader],
                 expert_prefixes: Sequence[str], paths: Sequence[str | os.PathLike], absent: Set[str] = frozenset()):
        self.base, self.prefix = base, prefix
        self.experts, self.expert_prefixes, self.paths = list(experts), list(expert_prefixes), list(paths)
        self.dtypes = {n: d for n, d in backbone_dtypes(base, prefix).items() if n not in absent}
        self.names = list(self.dtypes)
        self.copied = {n for n, dtype in self.dtypes.items() if not dtype.is_floating_point}
        self.groups: dict[str, list[str]] = {}
        for name in self.names:
            self.groups.setdefault(block_group(name), []).append(name)

    def dtype(self, name: str) -> torch.dtype:
        return self.dtypes[name]

    def read_base(self, names: Sequence[str], rows: slice | None = None) -> dict[str, Tensor]:
        return dict(zip(names, self.base.read((self.prefix + n for n in names), rows).values()))

    def read_experts(self, names: Sequence[str], rows: slice | None = None) -> list[dict[str, Tensor]]:
        return [dict(zip(names, reader.read((p + n for n in names), rows).values()))
                for reader, p in zip(self.experts, self.expert_prefixes)]

    def read_checked(self, group: Sequence[str], sums: list[list[float]],
                     rows: slice | None = None) -> tuple[dict[str, Tensor], list[str], list[dict[str, Tensor]]]:
        """A group's base tensors, its floating names and the experts' tensors of those, each expert's
        checked finite, its ‖τ‖² and ‖θ_base‖² added to `sums` (the implausible-expert check);
        `rows`: only those rows of each tensor."""
        base_sd = self.read_base(group, rows)
        short = [n for n in group if n not in self.copied]
        expert_sds = self.read_experts(short, rows)
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
    context = fill_models(context, list(expert_dirs), lambda: _backbone_skeleton(folders),
                          lambda: {t: _task_skeleton(p) for t, p in expert_dirs.items()})
    context = check_context(method, context)
    context.record.clear()
    return context


def _ordered(like: nn.Module, names: Iterable[str]) -> list[str]:
    """`names` in the backbone's state-dict order (as the in-memory merge sees them), others after."""
    order = {n: i for i, n in enumerate(like.state_dict())}
    return sorted(names, key=lambda n: (order.get(n, len(order)), _natural(n)))


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
    max_shard_size: int | str = "1GB",
    prefix: str | None = None,
    progress: bool = True,
    context: MergeContext | None = None,
    chunk_bytes: int = ROW_CHUNK_BYTES,
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
      written. Names handed to the method are the backbone's, so DARE's seeded masks agree. An
      elementwise method (averaging, Task Arithmetic) reads a tensor larger than `chunk_bytes` (an
      embedding table) `chunk_bytes` of rows at a time: the output tensor and one slice of each input.
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
    expert_prefixes = [reader.find_prefix(floats[0]) for reader in experts]  # with or without a head
    # a pooler no expert's task model has (MPNet's and RoBERTa's classifiers drop it) is no part of
    # the merged backbone either, as `load_backbone(like=expert)` leaves it out; any other tensor
    # an expert lacks stays an error below
    absent = {n for n in floats if n.startswith("pooler.")
              and all(p + n not in r for r, p in zip(experts, expert_prefixes))}
    floats = [n for n in floats if n not in absent]
    for path, reader, p in zip(paths, experts, expert_prefixes):
        for name in floats:
            key = p + name
            if key not in reader:
                raise ValueError(f"expert {path}: no tensor {key!r} (the base {base.path} has {prefix + name!r})")
            if reader.shape(key) != base.shape(prefix + name):
                raise ValueError(
                    f"expert {path}: tensor {key!r} has shape {reader.shape(key)}, the base has {base.shape(prefix + name)}"
                )
    folders = MergeFolders(base, prefix, experts, expert_prefixes, paths, absent)

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
                if spec.elementwise and _row_chunked(folders, group, chunk_bytes):
                    writer.add(group[0], _merge_by_rows(method, opts, folders, group[0], sums, chunk_bytes))
                    continue
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


def _row_chunked(folders: MergeFolders, group: Sequence[str], chunk_bytes: int) -> bool:
    """A group of one floating tensor larger than `chunk_bytes` (an embedding table) with rows to split."""
    if len(group) != 1 or group[0] in folders.copied:
        return False
    key = folders.prefix + group[0]
    return folders.base.nbytes(key) > chunk_bytes and len(folders.base.shape(key)) >= 1


def _merge_by_rows(method: str, opts, folders: MergeFolders, name: str, sums: list[list[float]],
                   chunk_bytes: int) -> Tensor:
    """An elementwise method's merge of one large tensor, read and merged `chunk_bytes` of rows at a
    time into the output: the same entries as the whole tensor's merge, with one output tensor and
    one slice of each input in memory (not the base, every expert and every task vector whole: a
    151,936 x 1536 embedding table is 0.9 GB a copy)."""
    key = folders.prefix + name
    shape = folders.base.shape(key)
    step = max(1, chunk_bytes // max(1, folders.base.nbytes(key) // shape[0]))
    out = None
    for start in range(0, shape[0], step):
        rows = slice(start, min(start + step, shape[0]))
        base_sd, _, expert_sds = folders.read_checked([name], sums, rows)
        part = merge_state_dicts(method, base_sd, expert_sds, opts)[name]
        if out is None:
            out = torch.empty(shape, dtype=part.dtype)
        out[rows] = part
        del base_sd, expert_sds, part
    return out


def _write_config(src: Path, dst: Path, stripped: bool) -> None:
    config_path = src / "config.json"
    if not config_path.exists():
        return
    config = json.loads(config_path.read_text())
    # the output holds only the backbone: name the backbone class; a causal LM's decoder keeps its
    # task model's name, which says every token is read by the LM head (featcal.io.models.is_causal_lm:
    # named as a bare Qwen2Model, the walk weighted all but the last token of the last block by 0.01)
    if stripped and not any(a.endswith(CAUSAL_LM_SUFFIX) for a in config.get("architectures") or ()):
        try:
            from transformers import AutoConfig, AutoModel

            cls = AutoModel._model_mapping[type(AutoConfig.from_pretrained(src))]
            config["architectures"] = [cls.__name__]
        except Exception:  # noqa: BLE001
            config.pop("architectures", None)
    (dst / "config.json").write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")


def backbone_dtypes(base: CheckpointReader, prefix: str) -> dict[str, torch.dtype]:
    """The base checkpoint's backbone tensors (names without `prefix`, natural order) and dtypes."""
    names = sorted((k for k in base.keys() if k.startswith(prefix)), key=_natural)
    if not names:
        raise ValueError(f"{base.path}: no tensor starts with the backbone prefix {prefix!r}")
    return {n[len(prefix):]: base.dtype(n) for n in names}


WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth", ".h5", ".msgpack", ".ckpt")


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
