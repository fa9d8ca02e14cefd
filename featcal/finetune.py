"""Fine-tuning an expert and measuring accuracy: plain supervised training, nothing FeatCal-specific."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import nn
from tqdm.auto import tqdm

from featcal.data.encoders import InputEncoder, check_examples
from featcal.data.splits import TaskSplit
# the one accuracy lives with the predictions it records; re-exported here, where the stages import it
from featcal.evaluation.predictions import accuracy  # noqa: F401


@dataclass
class FinetuneConfig:
    """Full fine-tuning of base + new head with AdamW and linear warm-up/decay."""

    learning_rate: float = 5e-5
    epochs: float = 2.0
    batch_size: int = 32
    max_length: int = 64
    weight_decay: float = 0.01
    warmup_ratio: float = 0.1
    seed: int = 0


EpochLog = Callable[[int, dict[str, float]], None]


def finetune(model: nn.Module, encoder: InputEncoder, train: TaskSplit, config: FinetuneConfig, progress: bool = True,
             dev: TaskSplit | None = None, on_epoch: EpochLog | None = None) -> nn.Module:
    """Trains `model` in place. After each pass over the data (and after a last partial pass),
    `on_epoch(epoch, metrics)` gets the epoch (1, 2, ...), its mean `train_loss` and, given `dev`,
    its `dev_accuracy`. The dev forwards draw no random numbers: the weights are those of a run
    without logging, bit for bit."""
    check_examples(encoder, train.examples, train.task)
    torch.manual_seed(config.seed)
    g = torch.Generator().manual_seed(config.seed)
    n = len(train.examples)
    steps_per_epoch = (n + config.batch_size - 1) // config.batch_size
    total = max(1, int(round(config.epochs * steps_per_epoch)))
    opt = torch.optim.AdamW(model.parameters(), lr=config.learning_rate, weight_decay=config.weight_decay)
    warmup = int(config.warmup_ratio * total)
    sched = torch.optim.lr_scheduler.LambdaLR(
        opt, lambda s: (s + 1) / max(1, warmup) if s < warmup else max(0.0, (total - s) / max(1, total - warmup))
    )
    model.train()
    bar = tqdm(total=total, desc=f"finetune {train.task}", unit="step", disable=not progress)
    step = epoch = 0
    while step < total:
        order = torch.randperm(n, generator=g)
        losses = []
        for start in range(0, n, config.batch_size):
            if step >= total:
                break
            idx = order[start:start + config.batch_size]
            batch = encoder.encode([train.examples[i] for i in idx], config.max_length)
            loss = model(**batch, labels=train.labels[idx]).loss
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            opt.step()
            sched.step()
            opt.zero_grad(set_to_none=True)
            step += 1
            losses.append(loss.item())
            bar.update(1)
            bar.set_postfix(loss=f"{losses[-1]:.3f}", refresh=False)   # the bar refreshes at its own pace
        epoch += 1
        if on_epoch is not None:
            metrics = {"train_loss": sum(losses) / len(losses)}
            if dev is not None:
                metrics["dev_accuracy"] = accuracy(model, encoder, dev, config.max_length)
                model.train()
            on_epoch(epoch, metrics)
    bar.close()
    return model.eval()
