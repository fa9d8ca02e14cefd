"""CLIP zero-shot heads on a tiny random CLIPModel with a tiny offline CLIPTokenizer.

The references are CLIP itself (`CLIPModel(...).logits_per_image`) and an explicit per-prompt
computation from `get_text_features`, never the code under test.
"""

from __future__ import annotations

import math
import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import pytest
import torch
import transformers as tf
from torch import Tensor

from featcal.families.clip import CLIPVisionFamily
from tiny_project import tiny_clip_tokenizer
from featcal.families.clip_zero_shot import (
    CLIP_LOGIT_SCALE_INIT, CLIPVisionClassifier, ZeroShotHead, class_text_embeddings, zero_shot_head, zero_shot_weight,
)

IMAGE, PATCH, HIDDEN, PROJ = 16, 4, 32, 16
CLASSES = ("cat", "zebra", "ox", "tree")
TWO_TEMPLATES = ("a photo of a {}.", "{}")   # different lengths: the batch is padded


@pytest.fixture(scope="module")
def tokenizer() -> tf.CLIPTokenizer:
    return tiny_clip_tokenizer()


@pytest.fixture(scope="module")
def clip(tokenizer) -> tf.CLIPModel:
    torch.manual_seed(0)
    special = dict(bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id,
                   pad_token_id=tokenizer.pad_token_id)
    config = tf.CLIPConfig(
        text_config=dict(vocab_size=len(tokenizer), hidden_size=HIDDEN, intermediate_size=64, num_hidden_layers=2,
                         num_attention_heads=4, max_position_embeddings=32, projection_dim=PROJ, **special),
        vision_config=dict(image_size=IMAGE, patch_size=PATCH, hidden_size=HIDDEN, intermediate_size=64,
                           num_hidden_layers=2, num_attention_heads=4, projection_dim=PROJ),
        projection_dim=PROJ,   # CLIPModel's own; the sub-configs keep theirs (default 512)
    )
    model = tf.CLIPModel(config).eval()
    with torch.no_grad():
        model.logit_scale.fill_(1.3)   # not CLIP's initial value: the head must read the model's own
    return model


def pixels(n: int = 3) -> Tensor:
    return torch.randn(n, 3, IMAGE, IMAGE, generator=torch.Generator().manual_seed(7))


def text_features(clip: tf.CLIPModel, tokens: dict) -> Tensor:
    out = clip.get_text_features(input_ids=tokens["input_ids"], attention_mask=tokens["attention_mask"])
    return out if isinstance(out, Tensor) else out.pooler_output


def test_family_head_features_are_the_pooled_output(clip):
    family, x = CLIPVisionFamily(), pixels()
    backbone = family.backbone(clip)
    with torch.no_grad():
        stream = family.enter(backbone, {"pixel_values": x})
        for index in range(len(family.blocks(backbone))):
            stream = family.run_block(backbone, index, stream)
        features = family.head_features(backbone, stream)
        pooled = clip.vision_model(pixel_values=x).pooler_output
    torch.testing.assert_close(features, pooled, atol=1e-6, rtol=0)


def test_head_logits_match_clip_logits_per_image(clip, tokenizer):
    family, x = CLIPVisionFamily(), pixels()
    head = zero_shot_head(clip, tokenizer, CLASSES)
    prompts = tokenizer([f"a photo of a {c}." for c in CLASSES], padding=True, return_tensors="pt")
    with torch.no_grad():
        backbone = family.backbone(clip)
        stream = family.enter(backbone, {"pixel_values": x})
        for index in range(len(family.blocks(backbone))):
            stream = family.run_block(backbone, index, stream)
        logits = head(family.head_features(backbone, stream))
        reference = clip(input_ids=prompts["input_ids"], attention_mask=prompts["attention_mask"],
                         pixel_values=x).logits_per_image
    assert logits.shape == (x.shape[0], len(CLASSES))
    torch.testing.assert_close(logits, reference, atol=1e-5, rtol=0)
    assert head.logit_scale.item() == pytest.approx(1.3)
    assert all(not p.requires_grad for p in head.buffers()) and not list(head.parameters())


def test_the_pipelines_clip_classifier_with_a_zero_shot_head_gives_clips_logits(clip, tokenizer, tmp_path):
    """The task model the pipeline fine-tunes and scores: loaded from a CLIPVisionModelWithProjection
    checkpoint (the merging papers' experts), its zero-shot head frozen, saved and loaded back."""
    clip.save_pretrained(tmp_path / "clip")
    tf.CLIPVisionModelWithProjection.from_pretrained(tmp_path / "clip").save_pretrained(tmp_path / "tower")
    model = tf.AutoModelForImageClassification.from_pretrained(tmp_path / "tower", num_labels=len(CLASSES)).eval()
    assert isinstance(model, CLIPVisionClassifier)
    model.use_zero_shot_head(zero_shot_weight(clip, tokenizer, CLASSES))
    assert not model.classifier.weight.requires_grad and model.tower.embeddings.class_embedding.requires_grad
    model.save_pretrained(tmp_path / "expert")
    again = tf.AutoModelForImageClassification.from_pretrained(tmp_path / "expert").eval()
    x = pixels()
    prompts = tokenizer([f"a photo of a {c}." for c in CLASSES], padding=True, return_tensors="pt")
    with torch.no_grad():
        reference = clip(input_ids=prompts["input_ids"], attention_mask=prompts["attention_mask"],
                         pixel_values=x).logits_per_image
        torch.testing.assert_close(model(pixel_values=x).logits, reference, atol=1e-5, rtol=0)
        torch.testing.assert_close(again(pixel_values=x).logits, reference, atol=1e-5, rtol=0)
    # on disk: a CLIPVisionModelWithProjection checkpoint plus the classifier, so the towers load alone
    tower = tf.CLIPVisionModelWithProjection.from_pretrained(tmp_path / "expert")
    assert torch.equal(tower.visual_projection.weight, clip.visual_projection.weight)
    assert CLIPVisionFamily().backbone(again) is again.tower


def test_two_templates_average_normalised_prompt_embeddings(clip, tokenizer):
    embeddings = class_text_embeddings(clip, tokenizer, CLASSES, TWO_TEMPLATES)
    expected = []
    with torch.no_grad():
        for name in CLASSES:
            per_template = []
            for template in TWO_TEMPLATES:   # one prompt at a time: no padding in the reference
                e = text_features(clip, tokenizer([template.format(name)], return_tensors="pt"))[0]
                per_template.append(e / e.norm())
            mean = torch.stack(per_template).mean(0)
            expected.append(mean / mean.norm())
    expected = torch.stack(expected)
    assert embeddings.dtype == torch.float32 and embeddings.device.type == "cpu"
    assert embeddings.shape == (len(CLASSES), PROJ)
    torch.testing.assert_close(embeddings, expected, atol=1e-6, rtol=0)
    # the two templates really differ, so the averaging is exercised
    single = class_text_embeddings(clip, tokenizer, CLASSES, TWO_TEMPLATES[:1])
    assert (single - embeddings).abs().max() > 1e-3


def test_text_model_with_projection_gives_the_same_embeddings(clip, tokenizer):
    text = tf.CLIPTextModelWithProjection(clip.config.text_config).eval()
    text.text_model.load_state_dict(clip.text_model.state_dict())
    text.text_projection.load_state_dict(clip.text_projection.state_dict())
    torch.testing.assert_close(class_text_embeddings(text, tokenizer, CLASSES, TWO_TEMPLATES),
                               class_text_embeddings(clip, tokenizer, CLASSES, TWO_TEMPLATES), atol=1e-6, rtol=0)


def test_vision_tower_alone_uses_clip_initial_logit_scale(clip):
    tower = tf.CLIPVisionModelWithProjection(clip.config.vision_config).eval()
    tower.vision_model.load_state_dict(clip.vision_model.state_dict())
    tower.visual_projection.load_state_dict(clip.visual_projection.state_dict())
    classes = torch.nn.functional.normalize(torch.randn(3, PROJ, generator=torch.Generator().manual_seed(1)), dim=-1)
    head = ZeroShotHead.from_model(tower, classes)
    assert head.logit_scale.item() == pytest.approx(math.log(1 / 0.07)) == CLIP_LOGIT_SCALE_INIT
    with torch.no_grad():
        out = tower(pixel_values=pixels())
        image = out.image_embeds / out.image_embeds.norm(dim=-1, keepdim=True)
        logits = head(tower.vision_model(pixel_values=pixels()).pooler_output)
    torch.testing.assert_close(logits, (1 / 0.07) * image @ classes.T, atol=1e-5, rtol=0)
    # the projection is a copy: later changes to the tower do not reach the head
    with torch.no_grad():
        tower.visual_projection.weight.zero_()
    assert head.projection.abs().sum() > 0


def test_empty_class_list_is_an_error(clip, tokenizer):
    with pytest.raises(ValueError, match="class_names is empty"):
        class_text_embeddings(clip, tokenizer, [])


def test_template_without_placeholder_is_an_error(clip, tokenizer):
    with pytest.raises(ValueError, match=r"templates\[1\] = 'a photo'"):
        class_text_embeddings(clip, tokenizer, CLASSES, ("a photo of a {}.", "a photo"))
