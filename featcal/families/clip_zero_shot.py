"""CLIP zero-shot classification heads: class-name text embeddings from the CLIP text tower.

The CLIP-ViT experts of the model-merging benchmarks are fine-tuned vision towers without a trained
classifier: each task is scored with a zero-shot head built from its class names, and the FeatCal
authors' release builds its heads the same way. For every class, each prompt template filled with
the class name goes through the text tower with projection; the embeddings are L2-normalised,
averaged over templates and normalised again:

    c_k = normalize(mean_t normalize(text_proj(prompt_t(k))))

The head then scores the vision tower's pooled output h ([B, hidden]; what
`CLIPVisionFamily().head_features` returns):

    logits = exp(logit_scale) * normalize(h @ W_proj.T) @ C.T        [B, K]

which is `CLIPModel(...).logits_per_image` with one prompt per class. Nothing here is trained or
calibrated: the head keeps its tensors as buffers.

`CLIPVisionClassifier` (defined in `featcal.io.clip_vision`, re-exported here) is the task model
the pipeline fine-tunes, merges and scores for CLIP experts (transformers has no classification
class for a vision tower alone): the tower, its projection and a linear head on the normalised
image embedding, registered with `AutoModelForImageClassification` for `CLIPVisionConfig`. `zero_shot_weight` makes that head the
zero-shot head: rows exp(logit_scale) · c_k, so its logits are the ones above.
"""

from __future__ import annotations

import math
from typing import Any, Sequence

import torch
from torch import Tensor, nn

# the task model lives with the loaders, which must find it for CLIP checkpoints; importing it registers it
from featcal.io.clip_vision import CLIPVisionClassifier, CLIPVisionTower

# CLIP's initial logit scale, log(1 / 0.07) (`CLIPConfig.logit_scale_init_value` rounds it to 2.6592).
CLIP_LOGIT_SCALE_INIT = math.log(1 / 0.07)
DEFAULT_TEMPLATES: tuple[str, ...] = ("a photo of a {}.",)


def _check_names(class_names: Sequence[str], templates: Sequence[str]) -> None:
    """Errors naming the bad input: no classes, no templates, a template without "{}"."""
    if isinstance(class_names, str):
        raise TypeError(f"class_names must be a sequence of class names, got the string {class_names!r}")
    if len(class_names) == 0:
        raise ValueError("class_names is empty: a zero-shot head needs at least one class name")
    for index, name in enumerate(class_names):
        if not isinstance(name, str) or not name.strip():
            raise ValueError(f"class_names[{index}] must be a non-empty string, got {name!r}")
    if isinstance(templates, str):
        raise TypeError(f"templates must be a sequence of templates, got the string {templates!r}")
    if len(templates) == 0:
        raise ValueError('templates is empty: expected at least one template such as "a photo of a {}."')
    for index, template in enumerate(templates):
        if not isinstance(template, str) or "{}" not in template:
            raise ValueError(f'templates[{index}] = {template!r} has no "{{}}" where the class name goes')


def _max_text_length(text_model: nn.Module) -> int | None:
    """The text tower's number of positions (prompts longer than this are truncated)."""
    config = getattr(text_model, "config", None)
    config = getattr(config, "text_config", config)
    return getattr(config, "max_position_embeddings", None)


def _projected_text(text_model: nn.Module, input_ids: Tensor, attention_mask: Tensor) -> Tensor:
    """Projected text embeddings [N, proj_dim] from a `CLIPModel` or a `CLIPTextModelWithProjection`.

    transformers >= 5 returns a `BaseModelOutputWithPooling` from `CLIPModel.get_text_features`
    (the projected embeddings in its `pooler_output`); older releases return the tensor itself.
    """
    if hasattr(text_model, "get_text_features"):
        out: Any = text_model.get_text_features(input_ids=input_ids, attention_mask=attention_mask)
        if isinstance(out, Tensor):
            return out
        if getattr(out, "pooler_output", None) is not None:
            return out.pooler_output
        raise TypeError(f"{type(text_model).__name__}.get_text_features returned {type(out).__name__} "
                        "without a pooler_output")
    if hasattr(text_model, "text_projection"):
        return text_model(input_ids=input_ids, attention_mask=attention_mask).text_embeds
    raise TypeError(f"expected a CLIPModel or a CLIPTextModelWithProjection, got {type(text_model).__name__} "
                    "(no get_text_features and no text_projection)")


@torch.no_grad()
def class_text_embeddings(text_model: nn.Module, tokenizer: Any, class_names: Sequence[str],
                          templates: Sequence[str] = DEFAULT_TEMPLATES) -> Tensor:
    """The zero-shot classifier's class embeddings, [K, proj_dim] float32 on CPU, unit rows.

    c_k = normalize(mean_t normalize(text_proj(template_t.format(class_names[k])))), one class at a
    time (all its templates in one padded batch). `text_model` is a `CLIPModel` (its
    `get_text_features`) or a `CLIPTextModelWithProjection`; it runs in eval mode and is left in the
    mode it was in.
    """
    _check_names(class_names, templates)
    device = next(text_model.parameters()).device
    max_length = _max_text_length(text_model)
    was_training = text_model.training
    text_model.eval()
    try:
        rows = []
        for name in class_names:
            prompts = [template.format(name) for template in templates]
            tokens = tokenizer(prompts, padding=True, truncation=max_length is not None, max_length=max_length,
                               return_tensors="pt")
            embeds = _projected_text(text_model, tokens["input_ids"].to(device),
                                     tokens["attention_mask"].to(device)).float()
            embeds = embeds / embeds.norm(dim=-1, keepdim=True)
            mean = embeds.mean(dim=0)
            rows.append(mean / mean.norm())
    finally:
        text_model.train(was_training)
    return torch.stack(rows).cpu()


class ZeroShotHead(nn.Module):
    """logits = exp(logit_scale) * normalize(pooled @ W_proj.T) @ class_embeddings.T   ([B, K]).

    `projection` is the CLIP `visual_projection` weight [proj_dim, hidden]; `class_embeddings`
    [K, proj_dim] are used as given (`class_text_embeddings` returns unit rows); `logit_scale` is
    the log of the temperature's inverse, as CLIP stores it. All three are buffers: nothing here is
    trained or calibrated.
    """

    def __init__(self, projection: Tensor, class_embeddings: Tensor, logit_scale: float | Tensor = CLIP_LOGIT_SCALE_INIT):
        super().__init__()
        if projection.dim() != 2:
            raise ValueError(f"projection must be a [proj_dim, hidden] matrix, got shape {tuple(projection.shape)}")
        if class_embeddings.dim() != 2 or class_embeddings.shape[1] != projection.shape[0]:
            raise ValueError(f"class_embeddings must be [K, {projection.shape[0]}] (K classes × proj_dim), "
                             f"got shape {tuple(class_embeddings.shape)}")
        self.register_buffer("projection", projection.detach().clone().float())
        self.register_buffer("class_embeddings", class_embeddings.detach().clone().float())
        self.register_buffer("logit_scale", torch.as_tensor(logit_scale, dtype=torch.float32).detach().clone())

    @classmethod
    def from_model(cls, vision_model: nn.Module, class_embeddings: Tensor,
                   logit_scale: float | Tensor | None = None) -> "ZeroShotHead":
        """A head on `vision_model`'s `visual_projection` (a `CLIPModel` or a
        `CLIPVisionModelWithProjection`; the weight is copied).

        The logit scale is, in order: the `logit_scale` argument, the model's own `logit_scale`
        (a `CLIPModel`), else CLIP's initial value log(1 / 0.07) — a vision tower alone has none.
        """
        projection = getattr(vision_model, "visual_projection", None)
        if not isinstance(projection, nn.Linear):
            raise TypeError(f"{type(vision_model).__name__} has no visual_projection: expected a CLIPModel or a "
                            "CLIPVisionModelWithProjection")
        if logit_scale is None:
            logit_scale = getattr(vision_model, "logit_scale", None)
        if logit_scale is None:
            logit_scale = CLIP_LOGIT_SCALE_INIT
        return cls(projection.weight, class_embeddings, logit_scale)

    @property
    def num_classes(self) -> int:
        return self.class_embeddings.shape[0]

    def forward(self, pooled: Tensor) -> Tensor:
        """Class logits [B, K] from the vision tower's pooled output [B, hidden]."""
        if pooled.shape[-1] != self.projection.shape[1]:
            raise ValueError(f"pooled features have width {pooled.shape[-1]}, the projection expects "
                             f"{self.projection.shape[1]} (the vision tower's hidden size)")
        image = pooled.to(self.projection.dtype) @ self.projection.T
        image = image / image.norm(dim=-1, keepdim=True)
        return self.logit_scale.exp() * image @ self.class_embeddings.T


def zero_shot_head(clip_model: nn.Module, tokenizer: Any, class_names: Sequence[str],
                   templates: Sequence[str] = DEFAULT_TEMPLATES) -> ZeroShotHead:
    """The zero-shot head of a `CLIPModel`: its text tower embeds the class names, its
    `visual_projection` and `logit_scale` score the vision tower's pooled output."""
    return ZeroShotHead.from_model(clip_model, class_text_embeddings(clip_model, tokenizer, class_names, templates))


def logit_scale_of(text_model: nn.Module) -> Tensor:
    """The model's own `logit_scale` (a `CLIPModel`), else CLIP's initial value (a text tower alone)."""
    scale = getattr(text_model, "logit_scale", None)
    return torch.as_tensor(CLIP_LOGIT_SCALE_INIT if scale is None else scale.detach(), dtype=torch.float32)


def load_text_tower(ref: str) -> tuple[nn.Module, Any]:
    """A `CLIPModel` (or, for a text-tower checkpoint, a `CLIPTextModelWithProjection`) in eval
    mode and its tokenizer, from a folder, `package:` reference or hub id."""
    from transformers import AutoConfig, AutoTokenizer, CLIPModel, CLIPTextModelWithProjection

    from featcal.io.models import resolve_model_ref

    path = resolve_model_ref(ref)
    model_class = CLIPTextModelWithProjection if AutoConfig.from_pretrained(path).model_type == "clip_text_model" else CLIPModel
    return model_class.from_pretrained(path).eval(), AutoTokenizer.from_pretrained(path)


def zero_shot_weight(text_model: nn.Module, tokenizer: Any, class_names: Sequence[str],
                     templates: Sequence[str] = DEFAULT_TEMPLATES) -> Tensor:
    """The zero-shot head as a linear layer on normalised image embeddings: exp(logit_scale) · C, [K, proj_dim]."""
    return logit_scale_of(text_model).exp() * class_text_embeddings(text_model, tokenizer, class_names, templates)


__all__ = ["CLIP_LOGIT_SCALE_INIT", "CLIPVisionClassifier", "CLIPVisionTower", "DEFAULT_TEMPLATES", "ZeroShotHead", "class_text_embeddings",
           "load_text_tower", "logit_scale_of", "zero_shot_head", "zero_shot_weight"]
