"""A causal-LM expert from a base: a LoRA fine-tune (peft) on one domain's text, merged into full
weights, so the expert is an ordinary checkpoint whose task vector is the adapters' B·A.

Adapters can be restricted to the top layers (`LoraSettings.layers`): the backward pass then stops
at the lowest adapted layer, which on a 1.5B model on CPU is what makes a few hundred steps affordable.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import torch
from torch import nn
from tqdm.auto import tqdm

from featcal.data.encoders import TextEncoder


@dataclass
class LoraSettings:
    """LoRA of rank `rank` (scale `alpha / rank`) on the named linears of the listed decoder layers
    (None: all), AdamW at a constant learning rate, `steps` batches of `batch_size` texts."""

    rank: int = 8
    alpha: float = 16.0
    target_modules: tuple[str, ...] = ("q_proj", "v_proj")
    layers: tuple[int, ...] | None = None
    learning_rate: float = 2e-4
    steps: int = 100
    batch_size: int = 4
    max_length: int = 128
    seed: int = 0


def lm_batch(encoder: TextEncoder, texts: Sequence[str], max_length: int) -> dict[str, torch.Tensor]:
    """Right-padded inputs with `labels` = the ids, pad positions ignored (-100)."""
    batch = encoder.encode(list(texts), max_length)
    batch["labels"] = batch["input_ids"].masked_fill(batch["attention_mask"] == 0, -100)
    return batch


def finetune_lora(model: nn.Module, encoder: TextEncoder, texts: Sequence[str], settings: LoraSettings,
                  progress: bool = True, desc: str = "lora") -> tuple[nn.Module, list[float]]:
    """The model with trained adapters merged into its weights (the same object), and the losses.

    Deterministic for a seed: the batches are drawn with their own generator, adapters are
    initialised under `settings.seed`, and dropout is off."""
    from peft import LoraConfig, get_peft_model

    if not texts:
        raise ValueError(f"{desc}: no texts to fine-tune on")
    torch.manual_seed(settings.seed)
    config = LoraConfig(r=settings.rank, lora_alpha=settings.alpha, target_modules=list(settings.target_modules),
                        layers_to_transform=list(settings.layers) if settings.layers is not None else None,
                        lora_dropout=0.0, bias="none", task_type="CAUSAL_LM")
    peft_model = get_peft_model(model, config)
    trainable = [p for p in peft_model.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(trainable, lr=settings.learning_rate, weight_decay=0.0)
    g = torch.Generator().manual_seed(settings.seed)
    peft_model.train()
    losses = []
    with tqdm(total=settings.steps, desc=desc, unit="step", disable=not progress) as bar:
        for _ in range(settings.steps):
            rows = torch.randint(len(texts), (settings.batch_size,), generator=g).tolist()
            loss = peft_model(**lm_batch(encoder, [texts[i] for i in rows], settings.max_length)).loss
            opt.zero_grad()
            loss.backward()
            opt.step()
            losses.append(float(loss.detach()))
            bar.set_postfix(loss=f"{losses[-1]:.3f}")
            bar.update()
    merged = peft_model.merge_and_unload()
    return merged.eval(), losses


__all__ = ["LoraSettings", "finetune_lora", "lm_batch"]
