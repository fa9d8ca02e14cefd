"""The one walk: every entry point gives the same weights, and one block's statistics and solution
equal an independent weighted least squares on hooked activations."""

import copy
import json

import pytest
import torch

from featcal import merge_models
from featcal.calibration import calibrate as calibrate_step
from featcal.calibration.config import FeatCalConfig
from featcal.calibration.walk import calibrate
from featcal.families import family_for
from featcal.families.llama import LLAMA_CAUSAL_LM
from featcal.calibration.layerwise import calibrate_cached_layer, collect_expert_layers
from featcal.calibration.lazy import calibrate_lazy, LazyWeights
from featcal.merging.lazy import lazy_merge
from featcal.io.feature_store import StoreFormat, read_group, write_group
from featcal.calibration.spill import BlockSpill
from featcal.tuning import TuneProblem
from featcal.calibration.walk import ModuleWeights, walk_all
from conftest import batches_for, perturbed, save_models, tiny_bert, tiny_causal_lm, tiny_mpnet, tiny_t5, with_eos


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    root = tmp_path_factory.mktemp("walk")
    base = tiny_bert(layers=3)
    experts = {t: perturbed(base, i + 2, scale=0.1, encoder_only=True) for i, t in enumerate("ab")}
    merged = merge_models(base, experts, "task_arithmetic", {"scale": 0.3})
    save_models(root, {"base": base, "merged": merged, **experts})
    return dict(root=root, base=base, experts=experts, merged=merged, batches=batches_for(experts, n_batches=2))


@pytest.fixture(scope="module")
def saved_t5(tmp_path_factory):
    """Two encoder and two decoder blocks, every parameter perturbed (the experts' own position tables
    and embeddings too): what a stored decoder state needs besides its hidden states is exercised."""
    root = tmp_path_factory.mktemp("walk_t5")
    base = tiny_t5()
    experts = {t: perturbed(base, i + 2, scale=0.1) for i, t in enumerate("ab")}
    merged = merge_models(base, experts, "task_arithmetic", {"scale": 0.3})
    save_models(root, {"base": base, "merged": merged, **experts})
    return dict(root=root, base=base, experts=experts, merged=merged,
                batches=with_eos(batches_for(experts, n_batches=2)))


@pytest.fixture(scope="module")
def saved_mpnet(tmp_path_factory):
    """Three blocks, every backbone parameter perturbed: each expert has its own relative position
    table, which every block reads (a stored state must get its own model's bias back)."""
    root = tmp_path_factory.mktemp("walk_mpnet")
    base = tiny_mpnet(layers=3)
    experts = {t: perturbed(base, i + 2, scale=0.005) for i, t in enumerate("ab")}
    merged = merge_models(base, experts, "task_arithmetic", {"scale": 0.3})
    save_models(root, {"base": base, "merged": merged, **experts})
    return dict(root=root, base=base, experts=experts, merged=merged, batches=batches_for(experts, n_batches=2))


def saved_causal_lm(tmp_path_factory, model_type):
    """Three decoder blocks of a causal LM (tied embeddings, GQA; Qwen2's q/k/v biases, Mistral's
    sliding window): every real token is a feature, none pooled."""
    root = tmp_path_factory.mktemp(f"walk_{model_type}")
    base = tiny_causal_lm(model_type, layers=3)
    experts = {t: perturbed(base, i + 2, scale=0.005) for i, t in enumerate("ab")}
    merged = merge_models(base, experts, "task_arithmetic", {"scale": 0.3})
    save_models(root, {"base": base, "merged": merged, **experts})
    return dict(root=root, base=base, experts=experts, merged=merged, batches=batches_for(experts, n_batches=2))


@pytest.fixture(scope="module")
def saved_qwen2(tmp_path_factory):
    return saved_causal_lm(tmp_path_factory, "qwen2")


@pytest.fixture(scope="module")
def saved_mistral(tmp_path_factory):
    return saved_causal_lm(tmp_path_factory, "mistral")


def few_rows(saved: dict) -> dict:
    """The same models on 17 rows a task (one batch of 3, two rows padded): fewer than half the FFN's
    48-wide down projection input, so its W_e G comes from rows (`LinearMoments.projected_gram`)."""
    return {**saved, "batches": batches_for(saved["experts"], n_batches=1, bs=3)}


@pytest.fixture(scope="module")
def saved_few_rows(saved):
    return few_rows(saved)


@pytest.fixture(scope="module")
def saved_qwen2_few_rows(saved_qwen2):
    return few_rows(saved_qwen2)


ENTRY_POINT_CASES = ["saved", "saved_t5", "saved_mpnet", "saved_qwen2", "saved_mistral", "saved_qwen2_few_rows"]


def chain(saved, config, fmt=StoreFormat("float32"), merged_dir=None, work=None):
    """What the calibrate-layer chain does: each block a separate step, states through zarr stores
    (under `work`, default the fixture's folder), its moments not kept (cache.moments: false), so the
    solves use up their sums. `merged_dir`: the merged folder the blocks are read from."""
    root, batches = saved["root"], saved["batches"]
    work = root if work is None else work
    dirs = {t: root / t for t in saved["experts"]}
    for k, states in enumerate(collect_expert_layers(dirs, batches)):
        write_group(work / f"features/layer_{k:02d}.zarr", states, fmt=fmt)
    state, student = {}, None
    for k in range(len(family_for(saved["merged"]).blocks(saved["merged"]))):
        out = calibrate_cached_layer(k, merged_dir or root / "merged", root / "base", dirs, batches, student,
                                     lambda layer: read_group(work / f"features/layer_{layer:02d}.zarr"), config,
                                     keep_moments=False)
        assert out.moments == {}
        state.update(out.parameters)
        write_group(work / f"student/layer_{k + 1:02d}.zarr", out.student_next, fmt=fmt)
        student = read_group(work / f"student/layer_{k + 1:02d}.zarr")
    return state


@pytest.mark.parametrize("case", ENTRY_POINT_CASES)
def test_every_entry_point_gives_bit_identical_weights(request, case):
    saved = request.getfixturevalue(case)
    config = FeatCalConfig(calibrate_pooler=True)
    root, batches = saved["root"], saved["batches"]
    in_process = calibrate(saved["merged"], saved["base"], saved["experts"], batches, config, progress=False)
    reference = in_process.backbone.state_dict()

    lazy = calibrate_lazy(saved["merged"], root / "base", {t: root / t for t in saved["experts"]}, batches, config,
                          progress=False).backbone.state_dict()
    expert_layers = list(collect_expert_layers({t: root / t for t in saved["experts"]}, batches))
    problem = TuneProblem(saved["merged"], saved["base"], saved["experts"], batches, lambda k: expert_layers[k], {}, None)
    tuned = problem.calibrate(config).state_dict()
    per_layer = chain(saved, config)

    calibrated = [n for n in reference
                  if n.startswith(("encoder.layer.", "pooler.", "encoder.block.", "decoder.block.", "layers."))]
    assert len(per_layer) == len(calibrated)
    for name in reference:
        assert torch.equal(lazy[name], reference[name]), f"lazy: {name}"
        assert torch.equal(tuned[name], reference[name]), f"tune objective: {name}"
    for name in calibrated:
        assert torch.equal(per_layer[name], reference[name]), f"per-layer chain: {name}"
    # the walk really moved the weights (an identity would pass the comparisons above)
    merged_state = saved["merged"].state_dict()
    moved = {"saved": ["pooler.dense.weight", "encoder.layer.1.output.dense.weight"],
             "saved_t5": ["encoder.block.1.layer.1.DenseReluDense.wo.weight",
                          "decoder.block.1.layer.1.EncDecAttention.v.weight"],
             "saved_mpnet": ["encoder.layer.2.attention.attn.q.weight", "encoder.layer.1.output.dense.weight"],
             "saved_qwen2": ["layers.2.self_attn.q_proj.bias", "layers.1.mlp.down_proj.weight"],
             "saved_mistral": ["layers.2.self_attn.k_proj.weight", "layers.0.post_attention_layernorm.weight"],
             "saved_qwen2_few_rows": ["layers.1.mlp.down_proj.weight", "layers.2.self_attn.v_proj.weight"]}[case]
    for name in moved:
        assert not torch.equal(reference[name], merged_state[name]), name
    if case == "saved_t5":   # the decoder's stored states carry the encoder output they cross-attend to
        assert ".encoder_output/a" in expert_layers[2] and ".encoder_output/a" not in expert_layers[1]


@pytest.mark.parametrize("case", ["saved_qwen2", "saved_mistral"])
def test_a_lazily_merged_decoder_is_walked_as_the_causal_lm_it_was_merged_from(request, case, tmp_path):
    """The merge stage writes the decoder alone (lazy_merge strips the LM head): the chain over that
    folder must still match every token's features, as the walk over the task model does. Named as a
    bare `Qwen2Model` it was a classifier's walk, whose last block weighs all but the last token by
    pooled_token_weight."""
    saved = request.getfixturevalue(case)
    root = saved["root"]
    merged_dir = lazy_merge(root / "base", {t: root / t for t in saved["experts"]}, "task_arithmetic",
                            {"scale": 0.3}, tmp_path / "merged", progress=False)
    assert json.loads((merged_dir / "config.json").read_text())["architectures"][0].endswith("ForCausalLM")
    assert family_for(saved["merged"]) is LLAMA_CAUSAL_LM   # the in-process walk's too
    config = FeatCalConfig()
    reference = calibrate(saved["merged"], saved["base"], saved["experts"], saved["batches"], config,
                          progress=False).backbone.state_dict()
    per_layer = chain(saved, config, merged_dir=merged_dir, work=tmp_path)
    last = f"layers.{len(family_for(saved['merged']).blocks(saved['merged'])) - 1}."
    assert any(name.startswith(last) for name in per_layer)
    for name in per_layer:
        assert torch.equal(per_layer[name], reference[name]), name


def test_a_stage_lets_go_of_each_experts_and_the_bases_linear_weights_once_they_are_folded_in(saved_qwen2, monkeypatch):
    """A calibrate-layer step (no moments kept) folds each task into the normal equations once its rows
    are in; then it releases that expert's linear weights, and after the first task the base's too
    (each system holds λ W_anc by then; biases and norms stay for their anchors)."""
    released = []
    release_base, release_expert = LazyWeights.release_base, LazyWeights.release_expert

    def base(self, names):
        released.append(("base", tuple(names)))
        release_base(self, names)
        assert all(self.base.module.get_parameter(n).device.type == "meta" for n in names)

    def expert(self, task, names):
        released.append((task, tuple(names)))
        release_expert(self, task, names)

    monkeypatch.setattr(LazyWeights, "release_base", base)
    monkeypatch.setattr(LazyWeights, "release_expert", expert)
    chain(saved_qwen2, FeatCalConfig())
    assert [who for who, _ in released] == ["a", "base", "b"] * 3   # three blocks
    names = {n for _, ns in released for n in ns}
    assert all(n.endswith("_proj.weight") for n in names) and "layers.2.mlp.down_proj.weight" in names


@pytest.mark.parametrize("case", ["saved", "saved_t5", "saved_mpnet"])
def test_a_study_captures_the_experts_block_inputs_once_and_later_trials_read_them(request, case, monkeypatch):
    """The experts' side of every block is the same in every trial: the first trial captures it, the
    others run no expert forward and give the weights a problem without the cache gives, bit for bit;
    also when every block is past the memory bound and goes to disk (a `BlockSpill`)."""
    saved = request.getfixturevalue(case)
    batches = saved["batches"]
    expert_layers = list(collect_expert_layers({t: saved["root"] / t for t in saved["experts"]}, batches))

    def problem(**kwargs):
        return TuneProblem(saved["merged"], saved["base"], saved["experts"], batches, lambda k: expert_layers[k], {},
                           None, **kwargs)

    cached, uncached, bounded = problem(), problem(expert_cache_bytes=0), problem(expert_cache_bytes=1)
    spilled = problem(expert_cache_bytes=1, expert_spill=BlockSpill())
    assert uncached.expert_inputs is None
    calls = []
    real = calibrate_step.run_capturing
    monkeypatch.setattr(calibrate_step, "run_capturing", lambda *a, **k: calls.append(a[1]) or real(*a, **k))
    n_blocks = len(family_for(saved["merged"]).blocks(saved["merged"]))
    per_walk = n_blocks * sum(len(b) for b in batches.values())   # one capture per block, task and batch
    expert_runs, spilled_runs = [], []
    for alpha, products in [(0.5, "float64"), (0.8, "float64"), (0.2, "float64"), (0.8, "float32"), (0.3, "float32")]:
        config = FeatCalConfig(alpha=alpha, calibrate_pooler=True, product_dtype=products)
        calls.clear()
        got = cached.calibrate(config).state_dict()
        experts = list(cached.weights.experts.values())
        expert_runs.append(sum(any(b is e for e in experts) for b in calls))
        calls.clear()
        on_disk = spilled.calibrate(config).state_dict()
        spilled_runs.append(sum(any(b is e for e in spilled.weights.experts.values()) for b in calls))
        want, capped = uncached.calibrate(config).state_dict(), bounded.calibrate(config).state_dict()
        for name in want:
            assert torch.equal(got[name], want[name]), f"alpha {alpha} {products}: {name}"
            assert torch.equal(capped[name], want[name]), f"bounded cache, alpha {alpha} {products}: {name}"
            assert torch.equal(on_disk[name], want[name]), f"spilled cache, alpha {alpha} {products}: {name}"
    # each precision captures once (a float64 walk keeps its W x rows in float64), then reads
    assert expert_runs == spilled_runs == [per_walk, 0, 0, per_walk, 0]
    held = spilled.expert_inputs
    assert len(held) == 0 and not held.skipped and held.disk_nbytes > 0 and held.nbytes == 0
    assert all(held.holds(k, d) for k in range(n_blocks) for d in (torch.float64, torch.float32))
    folder = held.spill.folder
    assert len(list(folder.glob("block-*.zarr"))) == 2 * n_blocks
    held.spill.close()
    assert not folder.exists() and not held.holds(0, torch.float64)
    assert len(cached.expert_inputs) == 2 * n_blocks and cached.expert_inputs.nbytes > 0
    assert len(bounded.expert_inputs) == 0 and bounded.expert_inputs.skipped == set(range(n_blocks))


def test_bfloat16_cached_states_change_the_weights_only_slightly(saved):
    config = FeatCalConfig()
    exact = chain(saved, config)
    narrow = chain(saved, config, StoreFormat("bfloat16"))
    worst = max(float(((narrow[n] - exact[n]).abs().max() / exact[n].abs().max())) for n in exact)
    assert 0 < worst < 0.05, worst


def hooked_inputs(model, module_name, batches):
    """The rows entering `module_name` in a plain forward of the whole model (real tokens only)."""
    rows = []
    module = dict(model.named_modules())[module_name]
    handle = module.register_forward_pre_hook(lambda _m, args: rows.append(args[0]))
    try:
        with torch.no_grad():
            masks = []
            for b in batches:
                model(**b)
                masks.append(b["attention_mask"].bool())
    finally:
        handle.remove()
    return torch.cat([x[m] for x, m in zip(rows, masks)]).double()


@pytest.mark.parametrize("case", ["saved", "saved_few_rows"])
@pytest.mark.parametrize("name", ["attention.output.dense", "output.dense"])
def test_block_statistics_and_solution_equal_an_independent_weighted_least_squares(request, case, name):
    """Block 0 (not the last: every token weighs 1). `output.dense` narrows (out < in), so the walk
    keeps its cross projected through the expert weight, W_e K, instead of K; on few rows
    (`saved_few_rows`: 17 a task, its input 48 wide) its W_e G comes from rows as well."""
    saved = request.getfixturevalue(case)
    base, experts, merged, batches = saved["base"], saved["experts"], saved["merged"], saved["batches"]
    alpha, rho, ridge = 0.3, 1.8, 0.05
    config = FeatCalConfig(alpha=alpha, rho=rho, ridge=ridge, product_dtype="float64")
    seen = {}

    def keep(k, result):
        if k == 0:
            seen.update(moments=result.moments[name], weight=result.updates[f"{name}.weight"])

    student = copy.deepcopy(merged).eval()   # merge_models returns the backbone
    weights = ModuleWeights(base.bert.eval(), {t: m.bert.eval() for t, m in experts.items()})
    walk_all(family_for(merged), student, weights, batches, config, on_block=keep, progress=False)

    full = f"encoder.layer.0.{name}"
    rows, targets, omegas = [], [], {}
    for task, expert in experts.items():
        xs = hooked_inputs(merged, full, batches[task])
        xe = hooked_inputs(expert.bert, full, batches[task])
        n = xs.shape[0]
        w_i = dict(expert.bert.named_modules())[full].weight.double()
        gram, cross = xs.T @ xs / n, xe.T @ xs / n
        m = seen["moments"][task]
        assert torch.allclose(m.gram, gram, rtol=1e-10, atol=1e-12), task
        if w_i.shape[0] < w_i.shape[1]:
            assert m.cross is None
            assert torch.allclose(m.projected_cross / m.count, w_i @ cross, rtol=1e-10, atol=1e-12), task
            if case == "saved_few_rows":
                assert 2 * n < w_i.shape[1]
                assert torch.allclose(m.projected_gram / m.count, w_i @ gram, rtol=1e-10, atol=1e-12), task
            else:
                assert m.projected_gram is None
        else:
            assert m.projected_gram is None
            assert m.projected_cross is None
            assert torch.allclose(m.cross_mean, cross, rtol=1e-10, atol=1e-12), task
        omegas[task] = 1.0 / torch.linalg.matrix_norm(gram)
        xt = alpha * xe + (1 - alpha) * xs
        scale = (omegas[task] / n).sqrt()
        rows.append(scale * xs)
        targets.append(scale * xt @ w_i.T)
    w_mer = dict(merged.named_modules())[full].weight.double()
    w_base = dict(base.bert.named_modules())[full].weight.double()
    w_anc = rho * w_mer + (1 - rho) * w_base
    d = w_mer.shape[1]
    rows.append(ridge ** 0.5 * torch.eye(d, dtype=torch.float64))
    targets.append(ridge ** 0.5 * w_anc.T)
    solution = torch.linalg.lstsq(torch.cat(rows), torch.cat(targets)).solution.T
    assert torch.allclose(seen["weight"], solution, rtol=1e-8, atol=1e-10)


def test_the_default_is_the_exact_path_and_float32_products_an_opt_in_within_1e5(saved):
    """`FeatCalConfig()` forms each batch's products in float64, as params.yaml does; float32 products
    (summed in float64) are asked for by name and move the weights by at most 1e-5 relative."""
    args = saved["merged"], saved["base"], saved["experts"], saved["batches"]
    exact = calibrate(*args, FeatCalConfig(product_dtype="float64"), progress=False).backbone.state_dict()
    default = calibrate(*args, FeatCalConfig(), progress=False).backbone.state_dict()
    assert all(torch.equal(default[n], exact[n]) for n in exact)
    fast = calibrate(*args, FeatCalConfig(product_dtype="float32"), progress=False).backbone.state_dict()
    worst = max(float((fast[n] - exact[n]).abs().max() / exact[n].abs().max()) for n in exact
                if exact[n].is_floating_point())
    assert 0 < worst <= 1e-5, worst


def test_device_setting_is_checked_and_cpu_is_the_same_walk(saved):
    args = saved["merged"], saved["base"], saved["experts"], saved["batches"]
    on_cpu = calibrate(*args, FeatCalConfig(device="cpu"), progress=False).backbone.state_dict()
    default = calibrate(*args, FeatCalConfig(), progress=False).backbone.state_dict()
    if not torch.cuda.is_available():   # "auto" is the CPU here: the same walk, bit for bit
        assert all(torch.equal(on_cpu[n], default[n]) for n in on_cpu)
        with pytest.raises(ValueError, match="no CUDA device"):
            calibrate(*args, FeatCalConfig(device="cuda"), progress=False)
    with pytest.raises(ValueError, match="featcal.device"):
        FeatCalConfig(device="gpu")
    assert next(saved["base"].parameters()).device.type == "cpu"   # the caller's models stay put


def test_to_device_moves_every_tensor_in_nested_batches():
    from featcal.families.base import to_device
    batches = {"a": [{"input_ids": torch.zeros(2, 3, dtype=torch.long), "extra": (torch.zeros(1), None)}],
                "b": [{"attention_mask": torch.ones(2, 3), "flag": True}]}
    moved = to_device(batches, torch.device("meta"))
    tensors = [moved["a"][0]["input_ids"], moved["a"][0]["extra"][0], moved["b"][0]["attention_mask"]]
    assert all(t.device.type == "meta" for t in tensors)
    assert moved["a"][0]["extra"][1] is None and moved["b"][0]["flag"] is True
    assert isinstance(moved["a"][0]["extra"], tuple) and isinstance(moved["a"], list)
