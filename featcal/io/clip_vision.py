"""The CLIP towers' task model: `CLIPVisionClassifier`, a CLIP vision tower, its projection and a
linear head on the normalised image embedding, registered with `AutoModelForImageClassification`
for `CLIPVisionConfig` (transformers has no classification class for a vision tower alone).

It lives in `featcal.io` because the loaders (`featcal.io.models.task_model_class`) must find it
when they read a CLIP checkpoint; `featcal.families.clip_zero_shot` builds its zero-shot head
(`zero_shot_weight`) and re-exports these names.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from transformers import AutoModelForImageClassification, CLIPVisionConfig, CLIPVisionModel
from transformers.modeling_outputs import BaseModelOutputWithPooling, ImageClassifierOutput
from transformers.models.clip.modeling_clip import CLIPPreTrainedModel


class CLIPVisionTower(nn.Module):
    """A `CLIPVisionModel`'s modules under the same names, as a plain module: inside the classifier
    a nested `PreTrainedModel` would bring its own checkpoint renamings. `forward` is
    `CLIPVisionModel.forward`'s: the pooled output is post_layernorm of the CLS token."""

    def __init__(self, config: CLIPVisionConfig):
        super().__init__()
        model = CLIPVisionModel(config)
        self.config = model.config
        self.embeddings, self.pre_layrnorm = model.embeddings, model.pre_layrnorm
        self.encoder, self.post_layernorm = model.encoder, model.post_layernorm

    def forward(self, pixel_values: Tensor, **kwargs) -> BaseModelOutputWithPooling:
        hidden = self.encoder(inputs_embeds=self.pre_layrnorm(self.embeddings(pixel_values))).last_hidden_state
        return BaseModelOutputWithPooling(last_hidden_state=hidden, pooler_output=self.post_layernorm(hidden[:, 0, :]))


class CLIPVisionClassifier(CLIPPreTrainedModel):
    """logits = classifier(normalize(visual_projection(tower(pixels).pooler_output))).

    The tower holds what `AutoModel` (a `CLIPVisionModel`) holds for the config, under the same
    names, so the pipeline's backbone checkpoints load into it. On disk the classifier is a
    `CLIPVisionModelWithProjection` checkpoint (`vision_model.*`, `visual_projection.weight`) plus
    `classifier.weight`: the experts of the merging papers, towers without a head, load into it,
    and its own files load as a `CLIPVisionModel` or a `CLIPVisionModelWithProjection`. The
    projection and the classifier are the task's head: each expert keeps its own.
    """

    config_class = CLIPVisionConfig
    base_model_prefix = "tower"
    main_input_name = "pixel_values"
    input_modalities = ("image",)

    def __init__(self, config: CLIPVisionConfig):
        super().__init__(config)
        self.tower = CLIPVisionTower(config)
        self.visual_projection = nn.Linear(config.hidden_size, config.projection_dim, bias=False)
        self.classifier = nn.Linear(config.projection_dim, config.num_labels, bias=False)
        self.post_init()

    @torch.no_grad()
    def use_zero_shot_head(self, weight: Tensor) -> None:
        """The classifier becomes the zero-shot head `weight` (`zero_shot_weight`) and is frozen:
        fine-tuning then trains the tower under the fixed head, as the merging papers do."""
        if tuple(weight.shape) != tuple(self.classifier.weight.shape):
            raise ValueError(f"zero-shot head of shape {tuple(weight.shape)}; the classifier is "
                             f"{tuple(self.classifier.weight.shape)} (classes × projection_dim)")
        self.classifier.weight.copy_(weight)
        self.classifier.requires_grad_(False)

    def forward(self, pixel_values: Tensor | None = None, labels: Tensor | None = None, **kwargs) -> ImageClassifierOutput:
        image = self.visual_projection(self.tower(pixel_values).pooler_output)
        logits = self.classifier(image / image.norm(dim=-1, keepdim=True))
        loss = None if labels is None else F.cross_entropy(logits, labels)
        return ImageClassifierOutput(loss=loss, logits=logits)


AutoModelForImageClassification.register(CLIPVisionConfig, CLIPVisionClassifier, exist_ok=True)
try:   # transformers >= 5: the files name the tower `vision_model`, as a CLIPVisionModelWithProjection's do
    from transformers.conversion_mapping import register_checkpoint_conversion_mapping
    from transformers.core_model_loading import WeightRenaming

    register_checkpoint_conversion_mapping(
        CLIPVisionClassifier.__name__, [WeightRenaming(source_patterns=r"^vision_model\.", target_patterns="tower.")],
        overwrite=True)
except ImportError:
    pass


__all__ = ["CLIPVisionClassifier", "CLIPVisionTower"]
