"""Data anchors behind the one registry (RegMean, RegMean++, layer-wise AdaMerging, SigMerge): each
against an independent implementation of its published formula (whole-model forwards with hooks,
NumPy, explicit loops; no stream machinery), the property its paper relies on, and the registry's
declared context (a data method without it fails naming what is missing)."""

from __future__ import annotations

import copy
import sys
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch
import yaml
from transformers import BertTokenizer

import featcal.data.splits
from featcal import MergeContext, merge_models
from featcal.data.encoders import TextEncoder
from featcal.evaluation import compare as cmp
from featcal.families import family_for
from featcal.merging.lazy import lazy_merge, streams
from featcal.merging import get_method, merge_state_dicts, split_options
from featcal.merging.adamerging import entropy, merged_tensors, task_logits
from featcal.merging.sigmerge import SigMergeOptions, anchor_merge, sigmerge
from featcal.merging.sigmerge_inputs import block_index_of, pooled_block_outputs
import test_families as tfm
from conftest import assert_same_state, batches_for, perturbed, tiny_bert
from tiny_project import WORDS, make_vocab

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "stages"))
from params_schema import ParamsError, check_merge_options, validate  # noqa: E402


def models(layers: int = 2, tasks: str = "abc", scale: float = 0.005):
    """A tiny BERT base and experts moved by `scale` (fine-tune sized by default), each with its head."""
    base = tiny_bert(layers=layers)
    experts = {t: perturbed(base, i + 1, scale=scale, num_labels=2 + i) for i, t in enumerate(tasks)}
    return base, experts


def linear_inputs(model, batches, layer=None):
    """Every nn.Linear input of the backbone (or of encoder layer `layer`) in whole-model forwards:
    name -> [rows, n] float64, real tokens only (the pooler reads one row per example)."""
    backbone = model.bert if hasattr(model, "bert") else model
    scope = backbone if layer is None else backbone.encoder.layer[layer]
    prefix = "" if layer is None else f"encoder.layer.{layer}."
    rows, handles, current = {}, [], {}
    for name, module in scope.named_modules():
        if isinstance(module, torch.nn.Linear):
            def hook(_m, args, _name=prefix + name):
                x = args[0]
                kept = x if x.dim() == 2 else x[current["mask"]]
                rows.setdefault(_name, []).append(kept.detach().double().numpy())
            handles.append(module.register_forward_pre_hook(hook))
    try:
        with torch.no_grad():
            for batch in batches:
                current["mask"] = batch["attention_mask"].bool()
                backbone(**batch)
    finally:
        for h in handles:
            h.remove()
    return {n: np.concatenate(r) for n, r in rows.items()}


def loop_regmean(inputs: list[np.ndarray], weights: list[np.ndarray], a: float) -> np.ndarray:
    """The published formula with explicit loops: G_i = (1/N_i) Σ_rows x xᵀ, off-diagonals × a,
    W = (Σ_i W_i G̃_i)(Σ_i G̃_i)⁻¹."""
    n = inputs[0].shape[1]
    lhs, rhs = np.zeros((n, n)), np.zeros_like(weights[0])
    for x, w in zip(inputs, weights):
        gram = np.zeros((n, n))
        for row in x:
            gram += np.outer(row, row)
        gram /= len(x)
        for j in range(n):
            for k in range(n):
                if j != k:
                    gram[j, k] *= a
        lhs += gram
        rhs += w @ gram
    return rhs @ np.linalg.inv(lhs)


def state(module):
    return {k: v.double().numpy() for k, v in module.state_dict().items()}


# --------------------------------------------------------------------------- RegMean


def test_regmean_with_a_1_is_the_least_squares_fit_on_the_stacked_inputs():
    base, experts = models()
    batches = batches_for(experts, n_batches=2)
    merged = merge_models(base, experts, "regmean", {"off_diagonal": 1.0}, MergeContext(batches=batches))
    inputs = {t: linear_inputs(experts[t], batches[t]) for t in experts}   # each expert on its own task
    got, thetas = state(merged), [state(e.bert) for e in experts.values()]
    assert len(inputs["a"]) == 2 * 6 + 1   # q, k, v, attention out, intermediate, output; pooler
    for name in inputs["a"]:
        # min_W Σ_i (1/N_i)‖X_i Wᵀ − X_i W_iᵀ‖²: lstsq on the rows X_i/√N_i with targets X_i W_iᵀ/√N_i
        xs = [inputs[t][name] / np.sqrt(len(inputs[t][name])) for t in experts]
        targets = [x @ theta[f"{name}.weight"].T for x, theta in zip(xs, thetas)]
        solution, *_ = np.linalg.lstsq(np.vstack(xs), np.vstack(targets), rcond=None)
        np.testing.assert_allclose(got[f"{name}.weight"], solution.T, rtol=1e-4, atol=1e-5, err_msg=name)
    for name in got:   # biases, norms, embeddings: the mean of the experts
        if name.removesuffix(".weight") not in inputs["a"] and thetas[0][name].dtype.kind == "f":
            np.testing.assert_allclose(got[name], np.mean([th[name] for th in thetas], axis=0), atol=1e-6, err_msg=name)


def test_regmean_below_a_1_equals_the_published_formula_in_explicit_loops():
    base, experts = models(layers=1)
    batches = batches_for(experts, seed=3, n_batches=1)
    context = MergeContext(batches=batches)
    merged = merge_models(base, experts, "regmean", None, context)   # default a = 0.95
    inputs = {t: linear_inputs(experts[t], batches[t]) for t in experts}
    got, thetas = state(merged), [state(e.bert) for e in experts.values()]
    for name in inputs["a"]:
        expected = loop_regmean([inputs[t][name] for t in experts], [th[f"{name}.weight"] for th in thetas], 0.95)
        np.testing.assert_allclose(got[f"{name}.weight"], expected, rtol=1e-4, atol=1e-5, err_msg=name)
    assert context.record["summary"]["linear_modules"] == 7 and not context.record["summary"]["pseudo_inverse"]


def test_regmean_of_identical_experts_is_the_expert():
    base, experts = models(tasks="a")
    experts["b"] = copy.deepcopy(experts["a"])
    merged = merge_models(base, experts, "regmean", None, MergeContext(batches=batches_for(experts)))
    for name, value in experts["a"].bert.state_dict().items():
        torch.testing.assert_close(merged.state_dict()[name], value, rtol=1e-4, atol=1e-5)


# --------------------------------------------------------------------------- RegMean++


def test_regmean_plus_plus_equals_hooked_forwards_through_the_merged_prefix():
    """Hand computation: M = base with averaged embeddings; for block l, each expert's block l is
    put after M's merged blocks 0..l−1 and the whole model runs with hooks on its linears; then M's
    block l becomes the mean of the experts' with the linears solved in NumPy. Pooler: θ₀."""
    base, experts = models(layers=2)
    batches = batches_for(experts, seed=5, n_batches=2)
    a = 0.8
    merged = merge_models(base, experts, "regmean_plus_plus", {"off_diagonal": a}, MergeContext(batches=batches))

    backbones = {t: e.bert for t, e in experts.items()}
    m = copy.deepcopy(base.bert)
    with torch.no_grad():
        for name, p in m.embeddings.named_parameters():
            p.copy_(torch.stack([dict(b.embeddings.named_parameters())[name] for b in backbones.values()]).mean(0))
        for layer in range(2):
            inputs = {}
            for t, b in backbones.items():
                hybrid = copy.deepcopy(m)
                hybrid.encoder.layer[layer] = copy.deepcopy(b.encoder.layer[layer])
                inputs[t] = linear_inputs(hybrid, batches[t], layer)
            block = m.encoder.layer[layer]
            for name, p in block.named_parameters():
                p.copy_(torch.stack([dict(b.encoder.layer[layer].named_parameters())[name]
                                     for b in backbones.values()]).mean(0))
            for name in inputs["a"]:
                local = name.removeprefix(f"encoder.layer.{layer}.")
                ws = [dict(b.encoder.layer[layer].named_parameters())[f"{local}.weight"].double().numpy()
                      for b in backbones.values()]
                grams = [inputs[t][name].T @ inputs[t][name] / len(inputs[t][name]) for t in experts]
                shrunk = [np.where(np.eye(len(g), dtype=bool), g, a * g) for g in grams]
                w = np.linalg.solve(sum(shrunk), sum(wi @ g for wi, g in zip(ws, shrunk)).T).T
                block.get_submodule(local).weight.copy_(torch.from_numpy(w))
    for name, value in m.state_dict().items():
        torch.testing.assert_close(merged.state_dict()[name], value, rtol=1e-4, atol=1e-5, msg=name)
    assert torch.equal(merged.pooler.dense.weight, base.bert.pooler.dense.weight)   # post-block: θ₀


def test_regmean_plus_plus_is_regmean_on_one_block_with_shared_embeddings():
    base, experts = models(layers=1)
    with torch.no_grad():
        for e in experts.values():
            e.bert.embeddings.load_state_dict(base.bert.embeddings.state_dict())
    batches = batches_for(experts, seed=7)
    plain = merge_models(base, experts, "regmean", None, MergeContext(batches=batches)).state_dict()
    context = MergeContext(batches=batches)
    plus = merge_models(base, experts, "regmean_plus_plus", None, context).state_dict()
    for name in plain:
        if name.startswith(("encoder.", "embeddings.")):
            torch.testing.assert_close(plus[name], plain[name], rtol=1e-5, atol=1e-6, msg=name)
    assert context.record["kept_at_base"] == ["pooler.dense.weight", "pooler.dense.bias"]
    assert "embeddings.word_embeddings.weight" in context.record["averaged_pre_block"]


@pytest.mark.parametrize("case", ["bert", "vit", "clip", "llama", "t5"])
def test_identical_experts_give_the_expert_in_every_family(case):
    """RegMean: every tensor is the expert's. RegMean++: the same, except the post-block tensors it
    reports kept at θ₀. AdaMerging keeps tied tensors (T5's shared embeddings) tied."""
    spec = tfm.CASES[case]
    base = spec.build()
    family = family_for(base)
    expert = copy.deepcopy(base)
    g = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for p in family.backbone(expert).parameters():
            p.add_(0.005 * torch.randn(p.shape, generator=g))
    experts = {"a": expert, "b": copy.deepcopy(expert)}
    batches = {t: [spec.batch(s, i) for s in range(2)] for i, t in enumerate(experts)}
    want, theta0 = family.backbone(expert).state_dict(), family.backbone(base).state_dict()
    got = merge_models(base, experts, "regmean", None, MergeContext(batches=batches)).state_dict()
    for name, value in want.items():
        torch.testing.assert_close(got[name], value, rtol=1e-4, atol=1e-5, msg=name)
    context = MergeContext(batches=batches)
    got = merge_models(base, experts, "regmean_plus_plus", None, context).state_dict()
    assert context.record["kept_at_base"]
    for name, value in want.items():
        expected = theta0[name] if name in context.record["kept_at_base"] else value
        torch.testing.assert_close(got[name], expected, rtol=1e-4, atol=1e-5, msg=name)
    if case == "t5":
        tied = ["shared.weight", "encoder.embed_tokens.weight", "decoder.embed_tokens.weight"]
        context = MergeContext(batches=batches)
        got = merge_models(base, experts, "adamerging", {"steps": 1, "batches_per_step": 1, "lr": 0.1}, context).state_dict()
        assert all(torch.equal(got[tied[0]], got[name]) for name in tied[1:])
        assert set(tied) - set(context.record["lambda"]) == set(tied[1:])   # one λ row for the tied tensor


# --------------------------------------------------------------------------- AdaMerging


def head_entropy(merged, experts, batches) -> float:
    """Σ_t mean entropy of task t's head on the merged backbone (held-out batches)."""
    total = 0.0
    with torch.no_grad():
        for t, expert in experts.items():
            model = copy.deepcopy(expert)
            model.bert.load_state_dict(merged.state_dict())
            total += sum(float(entropy(model(**b).logits)) for b in batches[t])
    return total


def test_adamerging_at_zero_steps_is_task_arithmetic_with_its_initial_lambda():
    base, experts = models()
    merged = merge_models(base, experts, "adamerging", {"steps": 0}, MergeContext(batches=batches_for(experts)))
    ta = merge_models(base, experts, "task_arithmetic", {"scale": 0.3})
    for name, value in ta.state_dict().items():
        torch.testing.assert_close(merged.state_dict()[name], value, rtol=0, atol=1e-6)


# large task vectors, so that λ visibly moves the predictions (and the plausibility check warns)
LARGE = pytest.mark.filterwarnings("ignore::featcal.io.models.ImplausibleExpertWarning")


@LARGE
def test_adamerging_lowers_the_entropy_keeps_lambda_in_the_unit_interval_and_is_seeded():
    base, experts = models(layers=1, scale=0.5)
    batches, held_out = batches_for(experts, seed=1, n_batches=3), batches_for(experts, seed=2, n_batches=1)
    options = {"steps": 15, "lr": 0.05, "batches_per_step": 1, "seed": 3}
    context = MergeContext(batches=batches)
    merged = merge_models(base, experts, "adamerging", options, context)
    curve = context.record["entropy_per_step"]
    assert np.mean(curve[-3:]) < np.mean(curve[:3])
    start = merge_models(base, experts, "adamerging", {**options, "steps": 0}, MergeContext(batches=batches))
    assert head_entropy(merged, experts, held_out) < head_entropy(start, experts, held_out)
    lam = np.array(list(context.record["lambda"].values()))
    floating = [k for k, v in base.bert.state_dict().items() if v.is_floating_point()]
    assert list(context.record["lambda"]) == floating and lam.shape == (len(floating), 3)   # every tensor × task
    assert lam.min() >= 0.0 and lam.max() <= 1.0 and not np.allclose(lam, 0.3)
    assert all(sum(c) == 15 for c in context.record["batch_draws"].values())
    again = merge_models(base, experts, "adamerging", options, MergeContext(batches=batches))
    other = merge_models(base, experts, "adamerging", {**options, "seed": 4}, MergeContext(batches=batches))
    assert all(torch.equal(v, again.state_dict()[k]) for k, v in merged.state_dict().items())
    assert any(not torch.equal(v, other.state_dict()[k]) for k, v in merged.state_dict().items())


@LARGE
def test_adamerging_clamp_holds_lambda_at_the_bounds_under_a_large_step():
    base, experts = models(layers=1, tasks="ab", scale=0.5)
    context = MergeContext(batches=batches_for(experts, n_batches=1))
    merged = merge_models(base, experts, "adamerging", {"steps": 4, "lr": 2.0, "batches_per_step": 1}, context)
    lam = context.record["lambda"]
    values = np.array(list(lam.values()))
    assert values.min() == 0.0 or values.max() == 1.0   # some λ went past a bound and was clamped
    assert values.min() >= 0.0 and values.max() <= 1.0
    name = "encoder.layer.0.attention.self.query.weight"
    theta0 = base.bert.state_dict()[name]
    expected = theta0 + sum(lam[name][i] * (e.bert.state_dict()[name] - theta0) for i, e in enumerate(experts.values()))
    torch.testing.assert_close(merged.state_dict()[name], expected, rtol=0, atol=1e-5)


@LARGE
def test_adamerging_gradient_in_lambda_is_the_parameter_gradient_dotted_with_the_task_vector():
    """∂L/∂λ_{p,t} = ⟨∂L/∂θ_p, τ_{t,p}⟩ inside (0, 1): the parametrisation, checked by a second
    autograd pass taken through θ directly."""
    base, experts = models(layers=1, tasks="ab", scale=0.5)
    family, batch = family_for(base), batches_for("a", n_batches=1)["a"][0]
    base_sd = {k: v for k, v in base.bert.state_dict().items() if v.is_floating_point()}
    names = list(base_sd)
    taus = {n: torch.stack([e.bert.state_dict()[n] - base_sd[n] for e in experts.values()]) for n in names}
    lam = torch.full((len(names), 2), 0.4, requires_grad=True)
    loss = entropy(task_logits(family, experts["a"], "bert.", merged_tensors(base_sd, taus, lam, names, True), batch))
    (grad_lam,) = torch.autograd.grad(loss, [lam])
    theta = {n: v.detach().requires_grad_(True) for n, v in merged_tensors(base_sd, taus, lam, names, True).items()}
    grads = torch.autograd.grad(entropy(task_logits(family, experts["a"], "bert.", theta, batch)), list(theta.values()))
    manual = torch.tensor([[float((g * taus[n][t]).sum()) for t in range(2)] for n, g in zip(names, grads)])
    torch.testing.assert_close(grad_lam, manual, rtol=1e-4, atol=1e-7)
    assert grad_lam.abs().sum() > 0


def write_tasks(root: Path, tasks, splits=("train", "dev")) -> None:
    """Parquet splits of a few word sentences per task; no test split unless asked."""
    g = torch.Generator().manual_seed(0)
    for task in tasks:
        (root / task).mkdir(parents=True)
        for split in splits:
            texts = [" ".join(WORDS[int(i)] for i in torch.randint(0, len(WORDS), (6,), generator=g)) for _ in range(12)]
            pq.write_table(pa.table({"text": texts, "label": [i % 2 for i in range(12)]}), root / task / f"{split}.parquet")


def test_the_supplied_context_reads_train_data_only_and_adamerging_runs_on_it(tmp_path, monkeypatch):
    base, experts = models(layers=1, tasks="ab")
    write_tasks(tmp_path, experts)   # no test split exists: reading it would fail
    vocab = make_vocab(WORDS)
    tokenizer = BertTokenizer(vocab={w: i for i, w in enumerate(vocab)})
    bench = cmp.Workbench(base.bert, experts, TextEncoder(tokenizer), str(tmp_path), {t: 12 for t in experts}, seed=0, batch_size=4)
    read = []
    real = featcal.data.splits.read_split
    monkeypatch.setattr(cmp, "read_split", lambda d, t, s: read.append(s) or real(d, t, s))
    context = cmp.merge_context(bench, "adamerging", {"examples_per_task": 8})
    assert {t: sum(len(b["input_ids"]) for b in bs) for t, bs in context.batches.items()} == {"a": 8, "b": 8}
    assert all("labels" not in b for bs in context.batches.values() for b in bs)
    merged = cmp.merge(bench, "adamerging", {"steps": 2, "batches_per_step": 1}, context)
    assert set(read) == {"train"} and merged is not None and len(context.record["entropy_per_step"]) == 2


def test_choose_on_dev_keeps_the_best_dev_candidate_and_reads_no_test_data(tmp_path, monkeypatch):
    base, experts = models(layers=1, tasks="ab", scale=0.5)
    write_tasks(tmp_path, experts)   # no test split exists: reading it would fail
    tokenizer = BertTokenizer(vocab={w: i for i, w in enumerate(make_vocab(WORDS))})
    bench = cmp.Workbench(base.bert, experts, TextEncoder(tokenizer), str(tmp_path), {t: 12 for t in experts}, seed=0, batch_size=4)
    read = []
    real = featcal.data.splits.read_split
    monkeypatch.setattr(cmp.Workbench, "split", lambda self, t, s="test": read.append(s) or real(self.tasks_dir, t, s))
    candidates = [{"scale": 0.0}, {"scale": 2.0}, {"scale": 1.0}, {"scale": -3.0}, {"scale": 2.0}]
    choice = cmp.choose_on_dev(bench, "task_arithmetic", candidates)
    expected = []
    for options in candidates:   # each candidate merged and scored on dev independently
        dev = cmp.score_backbone(bench, merge_models(base, experts, "task_arithmetic", options), split="dev")
        expected.append(sum(dev.values()) / len(dev))
    best = max(range(len(candidates)), key=lambda i: (expected[i], -i))   # the first of equal scores
    assert best != 0 and len(set(expected)) > 1, expected                # a choice that the first would miss
    assert set(read) == {"dev"}
    assert choice.options == candidates[best] and choice.dev_avg == expected[best]
    assert [g["dev_avg"] for g in choice.grid] == [round(v, 4) for v in expected]
    assert_same_state(choice.merged, merge_models(base, experts, "task_arithmetic", candidates[best]))


# --------------------------------------------------------------------------- SigMerge through the registry


def test_sigmerge_through_merge_models_gives_the_old_special_cased_result(tmp_path):
    base, experts = models(layers=2)
    shared = [b for bs in batches_for(experts, seed=11, n_batches=1).values() for b in bs]
    expert_dev = {"a": 0.9, "b": 0.8, "c": 0.7}
    scored = []

    def score_dev(backbone):   # a deterministic stand-in for dev accuracy, below every expert
        scored.append(backbone)
        return {"a": 0.5, "b": 0.6, "c": 0.65}

    options = {"anchor": "ties", "anchor_options": {"density": 0.2, "scale": 1.0}, "c_min": 0.02, "c_max": 0.2}
    context = MergeContext(score_dev=score_dev, expert_dev=expert_dev, shared_batches=shared)
    merged = merge_models(base, experts, "sigmerge", options, context)

    # the old path (featcal.merging.sigmerge_inputs.run_sigmerge before the registry): the same steps by hand
    family = family_for(base)
    opts = SigMergeOptions(**options)
    base_state = base.bert.state_dict()
    expert_states = {t: e.bert.state_dict() for t, e in experts.items()}
    anchor_state = anchor_merge(base_state, expert_states, opts)
    anchor = merge_models(base, experts, "ties", opts.anchor_options)
    assert all(torch.equal(anchor.state_dict()[k], v) for k, v in scored[0].state_dict().items())
    outputs = pooled_block_outputs(family, experts, shared)
    old, record = sigmerge(base_state, expert_states, anchor_state, block_index_of(family, base.bert), outputs,
                           expert_dev, score_dev(anchor), opts)
    assert record["total_admitted"] > 0 and context.record["total_admitted"] == record["total_admitted"]
    assert context.record["admitted"] == record["admitted"]
    for name, value in old.items():
        assert torch.equal(merged.state_dict()[name], value), name
    get_method("sigmerge").report(context.record, tmp_path)   # what the merge stage writes next to record.json
    assert (tmp_path / "admitted.png").read_bytes()[:4] == b"\x89PNG"


def test_sigmerge_repairs_a_data_anchor_with_the_data_its_context_holds(tmp_path):
    """SigMerge over RegMean: it needs RegMean's activations besides its own context, takes RegMean's
    examples_per_task as its own data option, and repairs exactly the RegMean merge of those batches."""
    base, experts = models(layers=2)
    batches = batches_for(experts, seed=5)
    shared = [b for bs in batches_for(experts, seed=11, n_batches=1).values() for b in bs]
    scored = []

    def score_dev(backbone):   # below every expert, as in the TIES case above
        scored.append(backbone)
        return {"a": 0.5, "b": 0.6, "c": 0.65}

    options = {"anchor": "regmean", "anchor_options": {"off_diagonal": 0.9}, "c_min": 0.02, "c_max": 0.2}
    assert split_options("sigmerge", {**options, "examples_per_task": 64}) == (
        options, {"examples_per_task": 64, "shared_examples_per_task": 16})
    assert split_options("sigmerge", {"anchor": "ties"}) == ({"anchor": "ties"}, {"shared_examples_per_task": 16})
    own = dict(score_dev=score_dev, expert_dev={"a": 0.9, "b": 0.8, "c": 0.7}, shared_batches=shared)
    with pytest.raises(ValueError, match=r"'sigmerge' needs context.*activations[^;]*: batches\)"):
        merge_models(base, experts, "sigmerge", options, MergeContext(**own))
    context = MergeContext(batches=batches, **own)
    merged = merge_models(base, experts, "sigmerge", options, context)

    regmean = merge_models(base, experts, "regmean", {"off_diagonal": 0.9}, MergeContext(batches=batches))
    assert_same_state(scored[0], regmean)   # the anchor SigMerge scored is RegMean on those batches
    assert set(context.record) >= {"total_admitted", "admitted"} and "gram" not in str(list(context.record))
    family = family_for(base)
    expert_states = {t: e.bert.state_dict() for t, e in experts.items()}
    by_hand, record = sigmerge(base.bert.state_dict(), expert_states, regmean.state_dict(),
                               block_index_of(family, base.bert), pooled_block_outputs(family, experts, shared),
                               own["expert_dev"], score_dev(regmean), SigMergeOptions(**options))
    assert record["total_admitted"] > 0 and context.record["admitted"] == record["admitted"]
    for name, value in by_hand.items():
        assert torch.equal(merged.state_dict()[name], value), name
    with pytest.raises(ValueError, match="examples_per_task in 'anchor_options' .*give it as sigmerge's own option"):
        SigMergeOptions(anchor="regmean", anchor_options={"examples_per_task": 8})
    with pytest.raises(ValueError, match="not sigmerge itself"):
        SigMergeOptions(anchor="sigmerge")


# --------------------------------------------------------------------------- the registry's declared context


def test_a_data_method_without_its_context_fails_naming_the_method_and_what_is_missing():
    base, experts = models(layers=1, tasks="ab")
    base_sd, expert_sds = base.bert.state_dict(), [e.bert.state_dict() for e in experts.values()]
    with pytest.raises(ValueError, match=r"'regmean' needs context.*activations.*experts.*batches"):
        merge_state_dicts("regmean", base_sd, expert_sds)
    with pytest.raises(ValueError, match=r"'adamerging' needs context.*activations[^;]*: batches\)"):
        merge_models(base, experts, "adamerging")   # the driver gave the models; the batches are missing
    with pytest.raises(ValueError, match=r"'sigmerge' needs context.*dev_scores.*score_dev, expert_dev.*shared_batches"):
        merge_models(base, experts, "sigmerge")
    with pytest.raises(ValueError, match="no train batches for tasks \\['b'\\]"):
        merge_models(base, experts, "regmean", None, MergeContext(batches={"a": batches_for("a")["a"]}))


def test_only_tensor_by_tensor_methods_stream_without_context_and_lazy_merge_names_what_a_data_method_lacks(tmp_path):
    assert streams("ties", {"scope": "tensor"}) and streams("wudi", None) and streams("dare", {"then": "ties"})
    assert not streams("ties", {"scope": "model"}) and not streams("dare", {"then": "ties", "scope": "model"})
    for method in ("regmean", "regmean_plus_plus", "adamerging", "sigmerge"):
        assert not streams(method, None)
    # lazy_merge fills the models (base, experts, family) itself: only the batches are missing, and
    # it says so before reading anything (tmp_path is no checkpoint)
    for method in ("regmean", "regmean_plus_plus", "adamerging"):
        with pytest.raises(ValueError, match=rf"'{method}' needs context that was not given: activations \([^;]*: batches\)"):
            lazy_merge(tmp_path, {"a": tmp_path}, method, None, tmp_path / "out")
    with pytest.raises(ValueError, match="'sigmerge' needs dev_scores, shared_examples .*which lazy_merge does not supply"):
        lazy_merge(tmp_path, {"a": tmp_path}, "sigmerge", None, tmp_path / "out")
    with pytest.raises(ValueError, match="expert_dirs must map each task to its folder"):
        lazy_merge(tmp_path, [tmp_path], "regmean", None, tmp_path / "out", context=MergeContext(batches={"a": []}))
    assert not (tmp_path / "out").exists()


def test_params_accept_data_options_for_data_methods_only():
    assert split_options("regmean", {"off_diagonal": 0.9, "examples_per_task": 64}) == (
        {"off_diagonal": 0.9}, {"examples_per_task": 64})
    assert split_options("sigmerge", {}) == ({}, {"shared_examples_per_task": 16})
    check_merge_options("regmean_plus_plus", {"examples_per_task": 32}, "merge")
    with pytest.raises(ParamsError, match="merge.options: unknown option 'examples_per_task' for merge method 'ties'"):
        check_merge_options("ties", {"examples_per_task": 32}, "merge")
    with pytest.raises(ParamsError, match="'examples_per_task' must be an integer >= 1"):
        check_merge_options("adamerging", {"examples_per_task": 0}, "merge")
    check_merge_options("sigmerge", {"anchor": "regmean", "examples_per_task": 32}, "merge")
    with pytest.raises(ParamsError, match="unknown option 'examples_per_task' for merge method 'sigmerge'"):
        check_merge_options("sigmerge", {"anchor": "ties", "examples_per_task": 32}, "merge")
    with pytest.raises(ParamsError, match="examples_per_task in 'anchor_options'"):
        check_merge_options("sigmerge", {"anchor": "regmean", "anchor_options": {"examples_per_task": 32}}, "merge")
    params = validate(yaml.safe_load((ROOT / "params.yaml").read_text()), models=False)
    assert {"regmean", "regmean_plus_plus", "adamerging", "tsv_m", "iso_c", "iso_cts", "wudi"} <= set(params.compare.anchors)
