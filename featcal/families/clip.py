"""CLIP vision towers (`CLIPVisionModel`, `CLIPVisionModelWithProjection`): CLS pooling.

Backbone = the whole vision tower, i.e. the `CLIPVisionModel` (for `CLIPVisionModelWithProjection`
that is `model.vision_model`): patch and position embeddings, `pre_layrnorm`, the encoder blocks
and `post_layernorm`. This is the part that the CLIP merging benchmarks (and the FeatCal release)
merge. The head lives outside it: `visual_projection` (when the model has one) followed by the
task's zero-shot or linear classifier (`featcal.families.clip_zero_shot.CLIPVisionClassifier`, the
pipeline's task model); it keeps its values.

`pre_layrnorm` runs before block 0, so the hook-captured stream entering block 0 already includes
it. The head reads `post_layernorm(h_L[:, 0])` (the tower's `pooler_output`); `head_features`
returns exactly that.

`CLIPModel` / `CLIPForImageClassification` (model_type "clip") are not registered: the latter
mean-pools the patch tokens, which a model_type alone cannot tell apart from CLS pooling.
"""

from __future__ import annotations

from torch import nn

from .vit import ImageTowerFamily


class CLIPVisionFamily(ImageTowerFamily):
    name = "clip"
    model_types = ("clip_vision_model",)

    def backbone(self, model: nn.Module) -> nn.Module:
        """The vision tower: a task model's base model (`CLIPVisionClassifier.tower`), then down
        through `vision_model` wrappers (with-projection, older layouts)."""
        model = super().backbone(model)
        while hasattr(model, "vision_model"):
            model = model.vision_model
        return model

    def blocks(self, backbone: nn.Module) -> list[nn.Module]:
        return list(backbone.encoder.layers)

    def final_norm(self, backbone: nn.Module) -> nn.Module:
        """post_layernorm(CLS of the last block) is the tower's pooled output."""
        return backbone.post_layernorm
