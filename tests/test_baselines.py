import pytest
import torch

from featcal.baselines.surgery import (
    ProbSurgeryConfig,
    ProbSurgeryModule,
    SurgeryClassifier,
    SurgeryConfig,
    SurgeryModule,
    feature_l1,
    gaussian_kl,
    load_surgery,
    representations,
    save_surgery,
    train_probsurgery,
    train_surgery,
)
from conftest import tiny_bert, tiny_mpnet

D = 24


def shifted_problem(n=64, seed=0):
    """Experts' features = merged features + a fixed low-rank shift (per task), one a Surgery
    module can represent exactly."""
    g = torch.Generator().manual_seed(seed)
    merged, expert = {}, {}
    for t in ("a", "b"):
        f = torch.randn(n, D, generator=g)
        u, v = torch.randn(D, 2, generator=g), torch.randn(2, D, generator=g)
        merged[t] = f
        expert[t] = f + torch.relu(f @ u) @ v * 0.3
    return merged, expert


def tiny_batches(n_batches=2, seed=0):
    g = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(n_batches):
        ids = torch.randint(5, 50, (4, 7), generator=g)
        mask = torch.ones_like(ids)
        mask[0, 5:] = 0
        out.append({"input_ids": ids, "attention_mask": mask, "token_type_ids": torch.zeros_like(ids),
                    "labels": torch.tensor([0, 1, 2, 0])})
    return out


FAST_S = dict(iterations=150, lr=1e-2, progress=False)
FAST_P = dict(iterations=120, lr=1e-2, progress=False)


def test_surgery_starts_as_identity():
    mod = SurgeryModule(D)
    assert mod.down.weight.shape == (16, D) and mod.down.bias is None and mod.up.bias is None
    assert torch.count_nonzero(mod.up.weight) == 0
    assert torch.count_nonzero(mod.down.weight) > 0
    f = torch.randn(5, D)
    assert torch.equal(mod(f), f)


def test_surgery_loss_falls():
    merged, expert = shifted_problem()
    before = feature_l1(None, merged, expert)
    modules = train_surgery(merged, expert, SurgeryConfig(**FAST_S), split="train")
    after = feature_l1(modules, merged, expert)
    for t in merged:
        assert after[t] < 0.3 * before[t], (t, before[t], after[t])


def test_probsurgery_infers_with_the_mean_only():
    mod = ProbSurgeryModule(D)
    for head in (mod.mean, mod.logvar):
        assert torch.count_nonzero(head.weight) == 0 and torch.count_nonzero(head.bias) == 0
    with torch.no_grad():  # non-zero heads so that μ and the noise both matter
        for p in mod.parameters():
            p.normal_(0, 0.3)
    f = torch.randn(6, D)
    mu, logvar = mod.encode(f)
    mod.eval()
    out1, out2 = mod(f), mod(f)
    assert torch.equal(out1, out2)
    assert torch.allclose(out1, f - mu)
    mod.train()
    s1, s2 = mod(f), mod(f)
    assert not torch.allclose(s1, s2)
    assert torch.allclose(mod(f, sample=False), f - mu)
    g1, g2 = torch.Generator().manual_seed(3), torch.Generator().manual_seed(3)
    assert torch.equal(mod(f, generator=g1), mod(f, generator=g2))
    # KL at the prior is zero
    assert gaussian_kl(torch.zeros(4, D), torch.zeros(4, D)).item() == 0.0


def test_probsurgery_loss_falls():
    merged, expert = shifted_problem()
    before = feature_l1(None, merged, expert)
    modules = train_probsurgery(merged, expert, ProbSurgeryConfig(**FAST_P), split="train")
    assert all(not m.training for m in modules.values())
    after = feature_l1(modules, merged, expert)
    for t in merged:
        assert after[t] < 0.3 * before[t], (t, before[t], after[t])


@pytest.mark.parametrize("split", ["dev", "test", "validation"])
def test_training_refuses_other_splits(split):
    merged, expert = shifted_problem(n=8)
    with pytest.raises(ValueError, match="calibration"):
        train_surgery(merged, expert, SurgeryConfig(iterations=1, progress=False), split=split)
    with pytest.raises(ValueError, match="calibration"):
        train_probsurgery(merged, expert, ProbSurgeryConfig(iterations=1, progress=False), split=split)


def test_deterministic_for_a_seed():
    merged, expert = shifted_problem(n=40)
    for train, cfg in ((train_surgery, SurgeryConfig), (train_probsurgery, ProbSurgeryConfig)):
        a = train(merged, expert, cfg(iterations=20, progress=False, seed=1), split="train")
        torch.manual_seed(123)  # the global RNG state does not matter
        b = train(merged, expert, cfg(iterations=20, progress=False, seed=1), split="train")
        c = train(merged, expert, cfg(iterations=20, progress=False, seed=2), split="train")
        for t in merged:
            sa, sb, sc = a[t].state_dict(), b[t].state_dict(), c[t].state_dict()
            assert all(torch.equal(sa[k], sb[k]) for k in sa)
            assert any(not torch.equal(sa[k], sc[k]) for k in sa)


def test_surgery_classifier_identity_then_differs():
    model = tiny_bert(layers=1, vocab=50, hidden=D, intermediate=32, num_labels=3)
    batches = tiny_batches()
    wrapped = SurgeryClassifier(model, SurgeryModule(D)).eval()
    with torch.no_grad():
        for b in batches:
            out = wrapped(**b)
            assert torch.allclose(out.logits, model(**b).logits, atol=1e-6)
            assert out.loss is not None
    f_m = representations(model, batches)
    assert f_m.shape == (8, D)
    target = f_m + 0.5
    modules = train_surgery({"t": f_m}, {"t": target}, SurgeryConfig(iterations=60, progress=False), split="train")
    trained = SurgeryClassifier(model, modules["t"]).eval()
    with torch.no_grad():
        logits = torch.cat([trained(**b).logits for b in batches])
        plain = torch.cat([model(**b).logits for b in batches])
        expected = model.classifier(modules["t"](f_m))
    assert not torch.allclose(logits, plain, atol=1e-4)
    assert torch.allclose(logits, expected, atol=1e-5)


def vit_classifier():
    """A ViT image classifier: f_M is the CLS token of the last, layer-normed hidden state."""
    from transformers import ViTConfig, ViTForImageClassification

    model = ViTForImageClassification(ViTConfig(hidden_size=D, num_hidden_layers=1, num_attention_heads=4,
                                                intermediate_size=32, image_size=8, patch_size=4, num_labels=3)).eval()
    return model, D, lambda b: model.vit(**b).last_hidden_state[:, 0], model.classifier


def clip_classifier():
    """A CLIP tower's classifier (the Surgery paper's own setting): f_M is the projected image
    embedding, which the head normalises before its (zero-shot or linear) classifier."""
    from transformers import CLIPVisionConfig

    from featcal.families.clip_zero_shot import CLIPVisionClassifier

    model = CLIPVisionClassifier(CLIPVisionConfig(hidden_size=D, num_hidden_layers=1, num_attention_heads=4,
                                                  intermediate_size=32, image_size=8, patch_size=4,
                                                  projection_dim=12, num_labels=3)).eval()
    return (model, 12, lambda b: model.visual_projection(model.tower(**b).pooler_output),
            lambda z: model.classifier(z / z.norm(dim=-1, keepdim=True)))


def mpnet_classifier():
    """An MPNet sequence classifier: no pooler; f_M is the first token of the last hidden state,
    which its head (dense, tanh, out_proj) reads."""
    model = tiny_mpnet(layers=1, vocab=50, hidden=D, num_labels=3)
    return model, D, lambda b: model.mpnet(**b).last_hidden_state[:, 0], lambda f: model.classifier(f[:, None])


def image_batches():
    return [{"pixel_values": torch.randn(4, 3, 8, 8, generator=torch.Generator().manual_seed(i))} for i in range(2)]


def text_batches():
    return [{k: v for k, v in b.items() if k in ("input_ids", "attention_mask")} for b in tiny_batches()]


@pytest.mark.parametrize("build, inputs", [(vit_classifier, image_batches), (clip_classifier, image_batches),
                                           (mpnet_classifier, text_batches)], ids=["vit", "clip", "mpnet"])
def test_surgery_on_a_classifier_without_pooler_reads_the_representation_its_head_reads(build, inputs):
    torch.manual_seed(0)
    model, width, read, head = build()
    batches = inputs()
    f_m = representations(model, batches)
    with torch.no_grad():
        assert torch.equal(f_m, torch.cat([read(b) for b in batches]))
        if hasattr(model, "vit"):   # a bare ViT gives the same f_M
            assert torch.equal(representations(model.vit, batches), f_m)
        untouched = SurgeryClassifier(model, SurgeryModule(width)).eval()   # zero-initialised: the model itself
        assert all(torch.allclose(untouched(**b).logits, model(**b).logits, atol=1e-6) for b in batches)
    modules = train_surgery({"t": f_m}, {"t": f_m + 0.5}, SurgeryConfig(iterations=60, progress=False), split="train")
    trained = SurgeryClassifier(model, modules["t"]).eval()
    with torch.no_grad():
        logits = torch.cat([trained(**b).logits for b in batches])
        assert torch.allclose(logits, head(modules["t"](f_m)), atol=1e-5)
        assert not torch.allclose(logits, torch.cat([model(**b).logits for b in batches]), atol=1e-4)


def test_surgery_classifier_refuses_other_architectures():
    class NotBert(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.classifier = torch.nn.Linear(D, 2)

    with pytest.raises(TypeError, match="BERT-style sequence classification"):
        SurgeryClassifier(NotBert(), SurgeryModule(D))
    with pytest.raises(TypeError, match="BERT-style sequence classification"):
        representations(NotBert(), tiny_batches(1))


@pytest.mark.parametrize("kind", ["surgery", "probsurgery"])
def test_save_load_round_trip(tmp_path, kind):
    merged, expert = shifted_problem(n=16)
    if kind == "surgery":
        modules = train_surgery(merged, expert, SurgeryConfig(iterations=5, progress=False), split="train")
    else:
        modules = train_probsurgery(merged, expert, ProbSurgeryConfig(iterations=5, progress=False), split="train")
    out = tmp_path / "mods"
    save_surgery(out, modules, kind)
    save_surgery(out, modules, kind)  # overwriting an existing folder is fine
    assert sorted(p.name for p in tmp_path.iterdir()) == ["mods"]  # no temporary folders left behind
    loaded = load_surgery(out)
    assert list(loaded) == list(modules)
    f = torch.randn(3, D)
    for t in modules:
        assert type(loaded[t]) is type(modules[t]) and not loaded[t].training
        sa, sb = modules[t].state_dict(), loaded[t].state_dict()
        assert sa.keys() == sb.keys() and all(torch.equal(sa[k], sb[k]) for k in sa)
        with torch.no_grad():
            assert torch.equal(loaded[t](f), modules[t].eval()(f))
    other = "probsurgery" if kind == "surgery" else "surgery"
    with pytest.raises(ValueError, match="kind"):
        save_surgery(tmp_path / "bad", modules, other)
