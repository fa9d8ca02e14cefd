"""Post-merge calibration baselines FeatCal is compared against: Representation Surgery and ProbSurgery.

Both train one small module per task on the merged model's final representation f_M(x) (the
representation the task head reads) so that it matches the expert's f_t(x); the deployed model
then carries one extra module per task (docs/algorithms.md#post-merge-baselines).

- Surgery: f̂ = f_M − up(ReLU(down(f_M))), down = Linear(d, 16), up = Linear(16, d) zero-initialised.
- ProbSurgery: h = ReLU(up(f_M)), μ = mean(h), logvar = logvar(h) (heads zero-initialised);
  training f̂ = f_M − (μ + exp(½ logvar)·ε), inference f̂ = f_M − μ.

The backbone is frozen, so training runs on *cached* representations (`representations`). The
public versions adapt on (and pick checkpoints by) the test split; here the only accepted split is
the calibration (train) split that FeatCal reads — `split` must be "train", anything else raises.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Iterable, Mapping, Sequence

import torch
import torch.nn.functional as F
from safetensors.torch import load_file, save_file
from torch import Tensor, nn
from tqdm.auto import tqdm
from transformers.modeling_outputs import SequenceClassifierOutput

from featcal.io.models import atomic_dir

CALIBRATION_SPLIT = "train"
KINDS = ("surgery", "probsurgery")
MODEL_INPUT_KEYS = ("input_ids", "attention_mask", "token_type_ids", "position_ids", "pixel_values")
META_FILE = "surgery.json"
WEIGHTS_FILE = "surgery.safetensors"


# --- modules ---------------------------------------------------------------------------------------


class SurgeryModule(nn.Module):
    """Representation Surgery: f̂ = f_M − up(ReLU(down(f_M))); starts as the identity (up = 0)."""

    def __init__(self, d: int, rank: int = 16):
        super().__init__()
        self.d, self.rank = int(d), int(rank)
        self.down = nn.Linear(self.d, self.rank, bias=False)  # nn.Linear default: kaiming uniform, a = √5
        self.up = nn.Linear(self.rank, self.d, bias=False)
        nn.init.zeros_(self.up.weight)

    def bias_estimate(self, f_m: Tensor) -> Tensor:
        """The representation bias the module removes: up(ReLU(down(f_M)))."""
        return self.up(F.relu(self.down(f_m)))

    def forward(self, f_m: Tensor) -> Tensor:
        return f_m - self.bias_estimate(f_m)


class ProbSurgeryModule(nn.Module):
    """ProbSurgery: a Gaussian over the representation bias; samples it while training, removes
    its mean at inference (`eval()` mode, or `sample=False`)."""

    def __init__(self, d: int, hidden: int = 128):
        super().__init__()
        self.d, self.hidden = int(d), int(hidden)
        self.up = nn.Linear(self.d, self.hidden, bias=False)
        self.mean = nn.Linear(self.hidden, self.d)
        self.logvar = nn.Linear(self.hidden, self.d)
        for head in (self.mean, self.logvar):
            nn.init.zeros_(head.weight)
            nn.init.zeros_(head.bias)

    @property
    def rank(self) -> int:
        return self.hidden

    def encode(self, f_m: Tensor) -> tuple[Tensor, Tensor]:
        """(μ, logvar) of the representation bias, each [..., d]."""
        h = F.relu(self.up(f_m))
        return self.mean(h), self.logvar(h)

    def forward(self, f_m: Tensor, sample: bool | None = None, generator: torch.Generator | None = None) -> Tensor:
        """f_M − z with z = μ + exp(½ logvar)·ε when sampling (default: in training mode),
        else f_M − μ. ε is drawn on the CPU from `generator` (seeded runs are device independent)."""
        return self.forward_with_stats(f_m, sample, generator)[0]

    def forward_with_stats(
        self, f_m: Tensor, sample: bool | None = None, generator: torch.Generator | None = None
    ) -> tuple[Tensor, Tensor, Tensor]:
        """(f̂, μ, logvar)."""
        mu, logvar = self.encode(f_m)
        if self.training if sample is None else sample:
            eps = torch.randn(mu.shape, generator=generator, dtype=mu.dtype).to(mu.device)
            z = mu + torch.exp(0.5 * logvar) * eps
        else:
            z = mu
        return f_m - z, mu, logvar


def gaussian_kl(mu: Tensor, logvar: Tensor) -> Tensor:
    """KL(N(μ, e^logvar) ‖ N(0, 1)) = −½ Σ_d (1 + logvar − μ² − e^logvar), mean over the batch."""
    return (-0.5 * (1 + logvar - mu.pow(2) - logvar.exp()).sum(-1)).mean()


# --- training --------------------------------------------------------------------------------------


@dataclass
class SurgeryConfig:
    """Representation Surgery's training knobs; defaults: docs/algorithms.md#representation-surgery."""

    lr: float = 1e-3
    betas: tuple[float, float] = (0.9, 0.999)
    weight_decay: float = 0.0
    iterations: int = 500
    batches_per_iteration: int = 2  # per task, each iteration
    batch_size: int = 16
    rank: int = 16
    seed: int = 0
    progress: bool = True

    def __post_init__(self) -> None:
        _check_positive(self, ("lr", "iterations", "batches_per_iteration", "batch_size", "rank"))


@dataclass
class ProbSurgeryConfig:
    """ProbSurgery's training knobs; defaults: docs/algorithms.md#probsurgery (5 × 800 steps of batch 16)."""

    lr: float = 1e-3
    betas: tuple[float, float] = (0.9, 0.999)
    weight_decay: float = 0.0
    iterations: int = 5 * 800
    batch_size: int = 16
    hidden: int = 128
    kl_weight: float = 1e-4
    seed: int = 0
    progress: bool = True

    def __post_init__(self) -> None:
        _check_positive(self, ("lr", "iterations", "batch_size", "hidden"))
        if self.kl_weight < 0:
            raise ValueError(f"probsurgery.kl_weight must be >= 0, got {self.kl_weight}")


def _check_positive(config, names: Iterable[str]) -> None:
    for name in names:
        if not getattr(config, name) > 0:
            raise ValueError(f"{type(config).__name__}.{name} must be > 0, got {getattr(config, name)}")


def check_calibration_split(split: str) -> None:
    if split != CALIBRATION_SPLIT:
        raise ValueError(
            f"split={split!r}: the Surgery/ProbSurgery baselines only ever adapt on the calibration "
            f"({CALIBRATION_SPLIT}) split; dev is for choosing hyperparameters and test is read once, "
            "for the final report (see docs/algorithms.md#conventions)"
        )


def _check_features(merged: Mapping[str, Tensor], expert: Mapping[str, Tensor]) -> int:
    if not merged:
        raise ValueError("no tasks: merged_feats is empty")
    if set(merged) != set(expert):
        raise ValueError(f"merged and expert features cover different tasks: {sorted(merged)} vs {sorted(expert)}")
    dims = set()
    for task in merged:
        m, e = merged[task], expert[task]
        if m.ndim != 2 or m.shape != e.shape:
            raise ValueError(f"task {task!r}: features must be [n, d] and equal in shape, got {tuple(m.shape)} and {tuple(e.shape)}")
        if m.shape[0] == 0:
            raise ValueError(f"task {task!r}: no calibration examples")
        dims.add(m.shape[1])
    if len(dims) != 1:
        raise ValueError(f"tasks have different feature widths: {sorted(dims)}")
    return dims.pop()


class _Sampler:
    """Batches drawn through reshuffled permutations (every example once per pass), from one
    seeded CPU generator."""

    def __init__(self, n: int, batch_size: int, generator: torch.Generator):
        self.n, self.batch_size, self.generator = n, min(batch_size, n), generator
        self.order, self.pos = torch.empty(0, dtype=torch.long, device="cpu"), 0   # host indices

    def next(self) -> Tensor:
        if self.pos + self.batch_size > len(self.order):
            self.order, self.pos = torch.randperm(self.n, generator=self.generator, device="cpu"), 0
        batch = self.order[self.pos:self.pos + self.batch_size]
        self.pos += self.batch_size
        return batch


def _prepare(merged, expert, split):
    check_calibration_split(split)
    d = _check_features(merged, expert)
    tasks = list(merged)
    m = {t: merged[t].detach().float() for t in tasks}
    e = {t: expert[t].detach().float().to(m[t].device) for t in tasks}
    return d, tasks, m, e


def _build(tasks: Sequence[str], seed: int, make) -> dict[str, nn.Module]:
    """Modules initialised from `seed` without touching the global RNG state."""
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        return {t: make() for t in tasks}


def _train(name, merged_feats, expert_feats, config, split, make, task_loss) -> dict[str, nn.Module]:
    """The loop both baselines share: one module per task, one Adam step per iteration on the sum
    of the tasks' losses. `task_loss(module, f_m, f_t, generator)` returns (loss, l1)."""
    d, tasks, m, e = _prepare(merged_feats, expert_feats, split)
    modules = _build(tasks, config.seed, lambda: make(d))
    for t in tasks:
        modules[t].to(m[t].device).train()
    params = [p for mod in modules.values() for p in mod.parameters()]
    opt = torch.optim.Adam(params, lr=config.lr, betas=tuple(config.betas), weight_decay=config.weight_decay)
    g = torch.Generator().manual_seed(config.seed)
    samplers = {t: _Sampler(m[t].shape[0], config.batch_size, g) for t in tasks}
    bar = tqdm(range(config.iterations), desc=name, unit="step", disable=not config.progress)
    for step in bar:
        loss = m[tasks[0]].new_zeros(())
        l1_sum, n_terms = m[tasks[0]].new_zeros(()), 0
        for t in tasks:
            for _ in range(getattr(config, "batches_per_iteration", 1)):
                idx = samplers[t].next().to(m[t].device)
                term, l1 = task_loss(modules[t], m[t][idx], e[t][idx], g)
                loss, l1_sum, n_terms = loss + term, l1_sum + l1.detach(), n_terms + 1
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        if config.progress and (step % 25 == 0 or step == config.iterations - 1):
            bar.set_postfix(l1=f"{l1_sum.item() / n_terms:.4f}", refresh=False)
    bar.close()
    return {t: mod.eval() for t, mod in modules.items()}


def train_surgery(
    merged_feats: Mapping[str, Tensor],
    expert_feats: Mapping[str, Tensor],
    config: SurgeryConfig | None,
    split: str,
) -> dict[str, SurgeryModule]:
    """One Surgery module per task, trained on cached representations of calibration examples.

    `split` names where the features came from and must be "train" (the calibration split);
    `config=None` takes the documented defaults (docs/algorithms.md#post-merge-baselines).

    Each iteration takes `batches_per_iteration` batches of `batch_size` per task; the loss is the
    sum over tasks and batches of mean L1(f̂_t, f_t); one Adam step per iteration.
    """
    config = config or SurgeryConfig()

    def task_loss(module, f_m, f_t, _generator):
        l1 = F.l1_loss(module(f_m), f_t)
        return l1, l1

    return _train("surgery", merged_feats, expert_feats, config, split,
                  lambda d: SurgeryModule(d, config.rank), task_loss)


def train_probsurgery(
    merged_feats: Mapping[str, Tensor],
    expert_feats: Mapping[str, Tensor],
    config: ProbSurgeryConfig | None,
    split: str,
) -> dict[str, ProbSurgeryModule]:
    """One ProbSurgery module per task, trained on cached representations of calibration examples.

    `split` must be "train" (the calibration split); `config=None` takes the documented defaults (docs/algorithms.md#post-merge-baselines).

    Each step takes one batch per task; loss = Σ_t [mean L1(f̂_t, f_t) + kl_weight · KL_t], with
    f̂_t = f_M − (μ + exp(½ logvar)·ε); one Adam step per step. The modules come back in eval mode
    (inference removes μ only).
    """
    config = config or ProbSurgeryConfig()

    def task_loss(module, f_m, f_t, generator):
        f_hat, mu, logvar = module.forward_with_stats(f_m, sample=True, generator=generator)
        l1 = F.l1_loss(f_hat, f_t)
        return l1 + config.kl_weight * gaussian_kl(mu, logvar), l1

    return _train("probsurgery", merged_feats, expert_feats, config, split,
                  lambda d: ProbSurgeryModule(d, config.hidden), task_loss)


@torch.no_grad()
def feature_l1(
    modules: Mapping[str, nn.Module] | None, merged_feats: Mapping[str, Tensor], expert_feats: Mapping[str, Tensor]
) -> dict[str, float]:
    """Mean L1 between (corrected) merged and expert features per task; `modules=None` (or a task
    missing from it) measures the uncorrected merged features. Modules run in inference mode."""
    out = {}
    for t in merged_feats:
        f = merged_feats[t].float()
        mod = (modules or {}).get(t)
        if mod is not None:
            was_training = mod.training
            f = mod.eval()(f)
            mod.train(was_training)
        out[t] = float(F.l1_loss(f, expert_feats[t].float().to(f.device)))
    return out


# --- the deployed form --------------------------------------------------------------------------------


class UnitNormInput(nn.Module):
    """A classifier that reads the unit-norm representation (CLIP's heads read normalised image embeddings)."""

    def __init__(self, classifier: nn.Module):
        super().__init__()
        self.classifier = classifier

    def forward(self, x: Tensor) -> Tensor:
        return self.classifier(x / x.norm(dim=-1, keepdim=True))


@dataclass
class HeadParts:
    """How a task model's head reads its backbone: the representation f_M that the head's
    classifier reads (through `dropout`), and that classifier."""

    backbone: nn.Module
    kind: str   # "pooler" (BERT: the pooler output; CLIP: post_layernorm of CLS) or "cls" (ViT: the final layernorm's CLS token)
    dropout: nn.Module
    classifier: nn.Module
    projection: nn.Module = field(default_factory=nn.Identity)   # CLIP: visual_projection, into the image embedding

    def represent(self, batch: Mapping[str, Tensor]) -> Tensor:
        out = self.backbone(**_model_inputs(batch), return_dict=True)
        return self.projection(out.pooler_output if self.kind == "pooler" else out.last_hidden_state[:, 0])


class FirstTokenHead(nn.Module):
    """A head that reads the first token of [B, T, d] hidden states (MPNet's: dense, tanh, out_proj),
    applied to f_M, that token ([B, d])."""

    def __init__(self, head: nn.Module):
        super().__init__()
        self.head = head

    def forward(self, f_m: Tensor) -> Tensor:
        return self.head(f_m[:, None, :])


def head_parts(model: nn.Module) -> HeadParts:
    """The parts of a BERT-style sequence classifier (`bert` with a pooler, Linear `classifier`
    on the pooler output), an MPNet sequence classifier (`mpnet`, no pooler: its `classifier` reads
    the first token of the last hidden state, f_M), a ViT image classifier (`vit`, Linear
    `classifier` on the CLS token of the last, layer-normed hidden state) or a CLIP tower's
    classifier (`CLIPVisionClassifier`: f_M is the image embedding, the head normalises it); a bare
    BERT with a pooler or a bare ViT gives its f_M only."""
    classifier = getattr(model, "classifier", None)
    dropout = getattr(model, "dropout", None) or nn.Identity()
    bert, vit = getattr(model, "bert", None), getattr(model, "vit", None)
    tower, projection = getattr(model, "tower", None), getattr(model, "visual_projection", None)
    if tower is not None and isinstance(projection, nn.Linear) and isinstance(classifier, nn.Linear):
        return HeadParts(tower, "pooler", nn.Identity(), UnitNormInput(classifier), projection)
    if bert is not None and getattr(bert, "pooler", None) is not None and isinstance(classifier, nn.Linear):
        return HeadParts(bert, "pooler", dropout, classifier)
    if vit is not None and isinstance(classifier, nn.Linear):
        return HeadParts(vit, "cls", nn.Identity(), classifier)
    mpnet = getattr(model, "mpnet", None)
    if mpnet is not None and isinstance(getattr(classifier, "out_proj", None), nn.Linear):
        return HeadParts(mpnet, "cls", nn.Identity(), FirstTokenHead(classifier))
    model_type = getattr(getattr(model, "config", None), "model_type", None)
    if classifier is None and bert is None and vit is None and model_type in ("bert", "vit"):
        if model_type == "vit" or getattr(model, "pooler", None) is not None:
            return HeadParts(model, "pooler" if model_type == "bert" else "cls", nn.Identity(), nn.Identity())
    raise TypeError(
        f"{type(model).__name__}: Surgery/ProbSurgery deployment is implemented for BERT-style sequence "
        "classification (model.bert with a pooler, and a Linear model.classifier reading the pooler output), MPNet "
        "sequence classification (model.mpnet, model.classifier reading the first token), ViT "
        "image classification (model.vit, and a Linear model.classifier reading the CLS token) and CLIP towers "
        "(featcal's CLIPVisionClassifier); other heads read a "
        "different representation"
    )


def _model_inputs(batch: Mapping[str, Tensor]) -> dict[str, Tensor]:
    return {k: v for k, v in batch.items() if k in MODEL_INPUT_KEYS}


class SurgeryClassifier(nn.Module):
    """A task's classification model with a Surgery/ProbSurgery module between the representation
    its head reads (BERT: the pooler output; ViT: the CLS token; CLIP: the image embedding) and the head:
    logits = classifier(dropout(module(f_M)))."""

    def __init__(self, task_model: nn.Module, module: nn.Module):
        super().__init__()
        projection = head_parts(task_model).projection
        d = projection.out_features if isinstance(projection, nn.Linear) else task_model.config.hidden_size
        if getattr(module, "d", d) != d:
            raise ValueError(f"module width {module.d} does not match the width of the representation the head reads, {d}")
        self.model = task_model
        self.surgery = module
        self.config = task_model.config

    def representation(self, **batch: Tensor) -> Tensor:
        """f_M: the representation the head reads."""
        return head_parts(self.model).represent(batch)

    def forward(self, labels: Tensor | None = None, **batch: Tensor) -> SequenceClassifierOutput:
        parts = head_parts(self.model)
        f_m = parts.represent(batch)
        param = next(self.surgery.parameters(), None)
        f_hat = self.surgery(f_m.to(param.dtype) if param is not None else f_m).to(f_m.dtype)
        logits = parts.classifier(parts.dropout(f_hat))
        return SequenceClassifierOutput(loss=None if labels is None else _loss(self.config, logits, labels), logits=logits)


def _loss(config, logits: Tensor, labels: Tensor) -> Tensor:
    """The loss Hugging Face's sequence-classification models compute for these labels."""
    n = logits.shape[-1]
    problem = config.problem_type or (
        "regression" if n == 1
        else "single_label_classification" if labels.dtype in (torch.long, torch.int) else "multi_label_classification"
    )
    if problem == "regression":
        return F.mse_loss(logits.squeeze(), labels.squeeze().to(logits.dtype)) if n == 1 else F.mse_loss(logits, labels)
    if problem == "single_label_classification":
        return F.cross_entropy(logits.view(-1, n), labels.view(-1))
    return F.binary_cross_entropy_with_logits(logits, labels.to(logits.dtype))


@torch.no_grad()
def representations(model: nn.Module, batches: Iterable[Mapping[str, Tensor]]) -> Tensor:
    """f_M for every example of `batches` ([n, d]): the representation the head reads (`head_parts`).
    `model` is a task model, or its bare backbone."""
    parts = head_parts(model)
    backbone = parts.backbone
    was_training = backbone.training
    backbone.eval()
    try:
        device = next(backbone.parameters()).device
        feats = [parts.represent({k: v.to(device) for k, v in b.items()}) for b in batches]
    finally:
        backbone.train(was_training)
    if not feats:
        raise ValueError("no batches")
    return torch.cat(feats)


# --- saving and loading ------------------------------------------------------------------------------


def _kind_of(module: nn.Module) -> str:
    if isinstance(module, SurgeryModule):
        return "surgery"
    if isinstance(module, ProbSurgeryModule):
        return "probsurgery"
    raise TypeError(f"not a Surgery/ProbSurgery module: {type(module).__name__}")


def save_surgery(out_dir: str | os.PathLike, modules: Mapping[str, nn.Module], kind: str) -> None:
    """One safetensors file (`<task>/<param>` keys) + surgery.json (kind, d, rank, tasks), written
    atomically (temporary folder, then rename)."""
    if kind not in KINDS:
        raise ValueError(f"kind must be one of {KINDS}, got {kind!r}")
    if not modules:
        raise ValueError("no modules to save")
    kinds = {t: _kind_of(m) for t, m in modules.items()}
    wrong = {t: k for t, k in kinds.items() if k != kind}
    if wrong:
        raise ValueError(f"kind={kind!r} but these modules are not: {wrong}")
    dims = {(m.d, m.rank) for m in modules.values()}
    if len(dims) != 1:
        raise ValueError(f"modules differ in (d, rank): {sorted(dims)}")
    (d, rank), = dims
    tensors = {f"{t}/{k}": v.detach().cpu().contiguous() for t, m in modules.items() for k, v in m.state_dict().items()}
    meta = {"kind": kind, "d": d, "rank": rank, "tasks": list(modules)}
    with atomic_dir(out_dir) as tmp:
        save_file(tensors, tmp / WEIGHTS_FILE)
        (tmp / META_FILE).write_text(json.dumps(meta, indent=2) + "\n")


def load_surgery(in_dir: str | os.PathLike) -> dict[str, nn.Module]:
    """The modules `save_surgery` wrote, in eval (inference) mode."""
    in_dir = Path(in_dir)
    meta_path = in_dir / META_FILE
    if not meta_path.exists():
        raise FileNotFoundError(f"{in_dir}: no {META_FILE} (not a saved Surgery/ProbSurgery folder)")
    meta = json.loads(meta_path.read_text())
    kind = meta.get("kind")
    if kind not in KINDS:
        raise ValueError(f"{meta_path}: unknown kind {kind!r}; expected one of {KINDS}")
    cls = SurgeryModule if kind == "surgery" else ProbSurgeryModule
    tensors = load_file(in_dir / WEIGHTS_FILE)
    modules = {}
    for task in meta["tasks"]:
        module = cls(int(meta["d"]), int(meta["rank"]))
        module.load_state_dict({k: tensors[f"{task}/{k}"] for k in module.state_dict()})
        modules[task] = module.eval()
    return modules


__all__ = [
    "ProbSurgeryConfig", "ProbSurgeryModule", "SurgeryClassifier", "SurgeryConfig", "SurgeryModule",
    "check_calibration_split", "feature_l1", "gaussian_kl", "load_surgery", "representations",
    "save_surgery", "train_probsurgery", "train_surgery",
]
