"""Data-parallel collection and calibration with torch.distributed (torchrun; gloo on CPU, nccl on GPUs).

Each process (rank) reads its shard of every task's calibration batches and runs the student and
expert streams of those examples only: block outputs per example never cross processes. Before
each solve the per-block moment *sums* (float64) are all-reduced, so every rank solves the same
system and holds the same calibrated block; drift totals are all-reduced the same way. Only rank 0
writes outputs. Without torchrun (no WORLD_SIZE in the environment) everything runs in one
process and no reduction happens.

    torchrun --standalone --nproc_per_node 2 -m featcal.calibration.distributed \\
        --merged models/merged --base base/ --expert bbc=experts/bbc --expert imdb=experts/imdb \\
        --batches calib_batches.pt --out models/featcal [--lazy] [--alpha 0.25 ...]

`--batches` is a `torch.save`d {task: [batch dict of tensors, ...]} (tokenised, labels unused).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import sys
from dataclasses import asdict, fields
from typing import Mapping, Sequence, TypeVar

import torch
import torch.distributed as dist
from torch import Tensor, nn

from featcal.calibration.calibrate import projects_cross
from featcal.families import module_kind
from featcal.calibration.moments import LinearMoments, Moments, NormMoments, moments_to_arrays

T = TypeVar("T")


# --- ranks ------------------------------------------------------------------------------------------


def is_distributed() -> bool:
    return dist.is_available() and dist.is_initialized()


def rank() -> int:
    return dist.get_rank() if is_distributed() else 0


def world_size() -> int:
    return dist.get_world_size() if is_distributed() else 1


def is_main() -> bool:
    return rank() == 0


def launched_by_torchrun() -> bool:
    return "WORLD_SIZE" in os.environ and "RANK" in os.environ


def init(backend: str | None = None) -> bool:
    """Join the process group torchrun set up (env://); gloo on CPU, nccl when CUDA is available.

    Returns True when running distributed. A plain `python` run (no torchrun) returns False.
    """
    if is_distributed():
        return True
    if not launched_by_torchrun():
        return False
    if backend is None:
        backend = "nccl" if torch.cuda.is_available() else "gloo"
    if backend == "nccl":
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
    dist.init_process_group(backend=backend)
    return True


def shutdown() -> None:
    if is_distributed():
        dist.destroy_process_group()


def _comm_device() -> torch.device:
    if is_distributed() and dist.get_backend() == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


# --- sharding the calibration examples ---------------------------------------------------------------


def shard(items: Sequence[T], rank_: int | None = None, world: int | None = None) -> list[T]:
    """This rank's items: `items[rank::world]` (every item on exactly one rank)."""
    rank_ = rank() if rank_ is None else rank_
    world = world_size() if world is None else world
    if not 0 <= rank_ < world:
        raise ValueError(f"rank {rank_} is not in [0, {world})")
    return list(items[rank_::world])


def shard_batches(batches: Mapping[str, Sequence[T]], rank_: int | None = None,
                  world: int | None = None) -> dict[str, list[T]]:
    """Each task's batches `rank::world`. Every task stays as a key (possibly with no batch), so
    all ranks agree on the task list that the moment reduction walks."""
    return {task: shard(list(bs), rank_, world) for task, bs in batches.items()}


def shard_examples(states: Mapping[str, Tensor], batch_size: int) -> dict[str, Tensor]:
    """This rank's rows of stacked per-task states [N, ...]: the examples of the batches that
    `shard_batches` gives it, when the batches hold `batch_size` examples each."""
    out = {}
    for task, value in states.items():
        parts = shard(list(torch.split(value, batch_size)))
        out[task] = torch.cat(parts) if parts else value[:0]
    return out


def gather_examples(local: Mapping[str, Tensor], batch_size: int) -> dict[str, Tensor]:
    """The inverse of `shard_examples` on rank 0 (every rank's rows, in example order); other
    ranks get {}. In one process, `local` itself."""
    if world_size() == 1:
        return dict(local)
    gathered = [None] * world_size() if is_main() else None
    dist.gather_object(dict(local), gathered, dst=0)
    if not is_main():
        return {}
    world = world_size()
    out = {}
    for task in dict.fromkeys(t for part in gathered for t in part):
        per_rank = [list(torch.split(part[task], batch_size)) if task in part else [] for part in gathered]
        n = sum(len(p) for p in per_rank)
        out[task] = torch.cat([per_rank[i % world][i // world] for i in range(n)])
    return out


# --- reducing moment sums ------------------------------------------------------------------------------


def zero_moments(module: nn.Module) -> Moments:
    """Moments of no rows, shaped for `module` (what a rank without examples of a task contributes)."""
    kind = module_kind(module)
    zero = lambda *shape: torch.zeros(shape, dtype=torch.float64)  # noqa: E731
    if kind == "linear":
        d, m = module.in_features, module.out_features
        if projects_cross(module):
            return LinearMoments(zero(), zero(d, d), None, zero(d), zero(d), zero(m, d))
        return LinearMoments(zero(), zero(d, d), zero(d, d), zero(d), zero(d))
    if kind in ("layernorm", "rmsnorm"):
        d = module.weight.shape[-1]
        return NormMoments(zero(), zero(d), zero(d))
    raise TypeError(f"no moments for a module of type {type(module).__name__}")


def _filled(m: Moments | None, module: nn.Module) -> Moments:
    """`m` with every field present (zeros where a rank saw no rows). The zeros are made only where a
    field is missing: a wide module's are d × d (0.64 GB at d = 8,960), made and dropped per task."""
    if m is None:
        return zero_moments(module)
    kind = module_kind(module)
    if type(m) is not (LinearMoments if kind == "linear" else NormMoments):
        raise TypeError(f"moments of type {type(m).__name__} for a {type(module).__name__}")
    # a linear keeps its cross sum or its projected one (`projects_cross`), never both
    unused = {"cross" if projects_cross(module) else "projected_cross"} if kind == "linear" else set()
    missing = [f.name for f in fields(m) if getattr(m, f.name) is None and f.name not in unused]
    if missing:
        zero = zero_moments(module)
        for name in missing:
            setattr(m, name, getattr(zero, name))
    return m


def all_reduce_moments(
    moments: Mapping[str, Mapping[str, Moments]],
    modules: Mapping[str, nn.Module],
    tasks: Sequence[str] | None = None,
) -> dict[str, dict[str, Moments]]:
    """Sum `moments[module][task]` over all ranks (one all_reduce of one flat float64 tensor).

    Every (module, task) in `modules` × `tasks` is present in the result, zero-filled where this
    rank has no rows (`tasks` defaults to the tasks found locally, which then must agree across
    ranks). The flat order is fixed (sorted module names, sorted tasks, dataclass field order), so
    every rank packs and unpacks alike. Returns new objects; tasks keep the order of `tasks`.
    """
    if tasks is None:
        tasks = list(dict.fromkeys(t for per_task in moments.values() for t in per_task))
    filled = {
        name: {task: _filled(moments.get(name, {}).get(task), modules[name]) for task in tasks}
        for name in modules
    }
    if world_size() == 1:
        return filled
    order = [(name, task) for name in sorted(modules) for task in sorted(tasks)]
    parts, layout = [], []
    for name, task in order:
        for field_name, value in moments_to_arrays(filled[name][task]).items():
            parts.append(value.reshape(-1))
            layout.append((name, task, field_name, value.shape, value.device))
    device = _comm_device()
    flat = torch.cat([p.to(device=device, dtype=torch.float64) for p in parts])
    dist.all_reduce(flat, op=dist.ReduceOp.SUM)
    offset = 0
    for name, task, field_name, shape, dev in layout:
        n = int(torch.Size(shape).numel())
        setattr(filled[name][task], field_name, flat[offset:offset + n].reshape(shape).to(dev))
        offset += n
    return filled


def all_reduce_sums(values: Tensor) -> Tensor:
    """A tensor summed over all ranks (a copy; unchanged in one process)."""
    out = values.detach().clone()
    if world_size() > 1:
        buf = out.to(_comm_device())
        dist.all_reduce(buf, op=dist.ReduceOp.SUM)
        out = buf.to(values.device)
    return out


class AllReduceMoments:
    """`reduce_moments` for the calibration driver: all-reduce over ranks for a fixed task list."""

    def __init__(self, tasks: Sequence[str]):
        self.tasks = list(tasks)

    def __call__(self, moments, modules):
        return all_reduce_moments(moments, modules, self.tasks)


# --- data-parallel calibration ------------------------------------------------------------------------


def calibrate_distributed(
    merged: nn.Module,
    batches: Mapping[str, Sequence[Mapping[str, Tensor]]],
    config=None,
    *,
    base: nn.Module | None = None,
    experts: Mapping[str, nn.Module] | None = None,
    base_dir: str | os.PathLike | None = None,
    expert_dirs: Mapping[str, str | os.PathLike] | None = None,
    progress: bool = True,
):
    """This rank's part of a data-parallel FeatCal run; the same result on every rank.

    `batches` are *all* calibration batches (each rank keeps its `rank::world` share). Experts in
    memory (`base`, `experts`) or read lazily per block from folders (`base_dir`, `expert_dirs`).
    In one process this is exactly `calibrate` / `calibrate_lazy`.
    """
    from featcal.calibration.walk import calibrate
    from featcal.calibration.lazy import calibrate_lazy

    local = shard_batches(batches)
    reducer = AllReduceMoments(list(batches))
    kwargs = dict(config=config, progress=progress and is_main(), reduce_moments=reducer, reduce_sums=all_reduce_sums)
    if base_dir is not None:
        if expert_dirs is None:
            raise ValueError("base_dir given without expert_dirs")
        return calibrate_lazy(merged, base_dir, expert_dirs, local, **kwargs)
    if base is None or experts is None:
        raise ValueError("give base and experts (in memory) or base_dir and expert_dirs (lazy)")
    return calibrate(merged, base, experts, local, **kwargs)


def state_digest(module: nn.Module) -> str:
    """sha256 of a module's state dict (names, dtypes, bytes): equal digests = identical weights."""
    h = hashlib.sha256()
    for name, value in module.state_dict().items():
        t = value.detach().cpu().contiguous()
        h.update(name.encode())
        h.update(str(t.dtype).encode())
        h.update(t.reshape(-1).view(torch.uint8).numpy().tobytes())
    return h.hexdigest()


# --- command line ----------------------------------------------------------------------------------------


def _parse(argv: Sequence[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m featcal.calibration.distributed", description=__doc__.split("\n\n")[0])
    p.add_argument("--merged", required=True, help="merged model folder (AutoModel)")
    p.add_argument("--base", required=True, help="base model folder")
    p.add_argument("--expert", action="append", required=True, metavar="TASK=DIR", help="one per task")
    p.add_argument("--batches", required=True, help="torch.save'd {task: [batch dict, ...]}")
    p.add_argument("--out", required=True, help="output folder for the calibrated backbone (rank 0)")
    p.add_argument("--lazy", action="store_true", help="read base and experts one block at a time")
    p.add_argument("--dtype", default=None, choices=["float32", "float64"], help="run the models in this dtype")
    p.add_argument("--config", default=None, help="JSON of FeatCalConfig fields, e.g. '{\"alpha\": 0.3}'")
    p.add_argument("--backend", default=None, choices=["gloo", "nccl"])
    return p.parse_args(argv)


def main(argv: Sequence[str] | None = None) -> int:
    args = _parse(argv)
    from transformers import AutoModel

    from featcal.calibration.config import FeatCalConfig
    from featcal.io.models import atomic_dir, save_model, write_json

    experts = {}
    for item in args.expert:
        task, sep, path = item.partition("=")
        if not sep or not task or not path:
            raise SystemExit(f"--expert {item!r}: expected TASK=DIR")
        experts[task] = path
    batches = torch.load(args.batches, weights_only=True)
    unknown = set(batches) - set(experts)
    if unknown:
        raise SystemExit(f"{args.batches}: batches for tasks without --expert: {sorted(unknown)}")
    config = FeatCalConfig.from_mapping(json.loads(args.config)) if args.config else FeatCalConfig()
    dtype = getattr(torch, args.dtype) if args.dtype else None

    init(args.backend)
    try:
        def load(path):
            model = AutoModel.from_pretrained(path).eval()
            return model.to(dtype) if dtype is not None else model

        merged = load(args.merged)
        if args.lazy:
            result = calibrate_distributed(merged, batches, config, base_dir=args.base, expert_dirs=experts)
        else:
            result = calibrate_distributed(
                merged, batches, config, base=load(args.base), experts={t: load(p) for t, p in experts.items()}
            )
        digest = state_digest(result.backbone)
        print(f"featcal.calibration.distributed rank {rank()}/{world_size()} digest {digest}", flush=True)
        if is_main():
            with atomic_dir(args.out) as tmp:
                save_model(result.backbone, tmp)
                write_json(tmp / "featcal_run.json", {
                    "world_size": world_size(), "lazy": args.lazy, "digest": digest,
                    "drift": [asdict(d) for d in result.drift],
                    "reports": [asdict(r) for r in result.reports],
                })
        if is_distributed():
            dist.barrier()
    finally:
        shutdown()
    return 0


if __name__ == "__main__":
    sys.exit(main())
