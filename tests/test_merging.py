"""Dense merge methods against hand-computed results on tiny tensors."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from featcal.merging import (
    MERGE_METHODS,
    DareOptions,
    TiesOptions,
    build_options,
    merge_state_dicts,
    register,
)
from featcal.merging.dense import keep_count, model_topk_masks, topk_mask


def t(*values: float, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    return torch.tensor(values, dtype=dtype)


def one_tensor(base: list[float], experts: list[list[float]]) -> tuple[dict, list[dict]]:
    """State dicts with a single tensor "w"."""
    return {"w": t(*base)}, [{"w": t(*e)} for e in experts]


@pytest.fixture
def probe_method():
    """Register a temporary method that records the dtypes it receives; remove it afterwards."""
    seen: list[torch.dtype] = []

    @dataclasses.dataclass(frozen=True)
    class ProbeOptions:
        pass

    @register("_probe", ProbeOptions)
    def _probe(base, experts, opts):
        seen.extend(x.dtype for x in base.values())
        seen.extend(x.dtype for e in experts for x in e.values())
        return {name: experts[0][name] for name in base}

    yield seen
    MERGE_METHODS.pop("_probe")


# --------------------------------------------------------------------------- average, TA


def test_average_is_mean_of_experts():
    base, experts = one_tensor([0.0, 0.0], [[1.0, 2.0], [3.0, -2.0], [2.0, 3.0]])
    out = merge_state_dicts("average", base, experts)
    assert torch.equal(out["w"], t(2.0, 1.0))


def test_task_arithmetic_adds_scaled_sum_of_task_vectors():
    # τ1 = [1, -1], τ2 = [0.5, 2]; Σ = [1.5, 1]; θ = [1, 1] + 0.5·Σ
    base, experts = one_tensor([1.0, 1.0], [[2.0, 0.0], [1.5, 3.0]])
    out = merge_state_dicts("task_arithmetic", base, experts, {"scale": 0.5})
    assert torch.equal(out["w"], t(1.75, 1.5))


def test_task_arithmetic_default_scale_is_0_3():
    base, experts = one_tensor([1.0, 1.0], [[2.0, 0.0], [1.5, 3.0]])
    out = merge_state_dicts("task_arithmetic", base, experts)
    torch.testing.assert_close(out["w"], t(1.45, 1.3))


# --------------------------------------------------------------------------- TIES


def test_ties_sign_election_tie_uses_majority_sign():
    # One coordinate, τ = [3, -1, -2]: Σ = 0, two negatives vs one positive -> γ = -1,
    # disjoint mean of {-1, -2} = -1.5.
    base, experts = one_tensor([0.0], [[3.0], [-1.0], [-2.0]])
    out = merge_state_dicts("ties", base, experts, {"density": 1.0, "scale": 1.0})
    assert torch.equal(out["w"], t(-1.5))


def test_ties_sign_election_count_tie_falls_back_to_plus():
    # τ = [2, -2]: Σ = 0 and one positive vs one negative -> γ = +1 -> mean of {2} = 2.
    base, experts = one_tensor([0.0], [[2.0], [-2.0]])
    out = merge_state_dicts("ties", base, experts, {"density": 1.0, "scale": 1.0})
    assert torch.equal(out["w"], t(2.0))


def test_ties_disjoint_mean_ignores_zero_entries():
    # Coordinate 0: τ = [4, 0, 2] -> γ = +, mean over nonzero = 3 (not 2).
    # Coordinate 1: τ = [1, -5, 0] -> γ = -, only task 2 agrees -> -5.
    # Coordinate 2: τ = [0, 0, 0] -> no task agrees -> 0.
    base, experts = one_tensor([10.0, 10.0, 10.0], [[14.0, 11.0, 10.0], [10.0, 5.0, 10.0], [12.0, 10.0, 10.0]])
    out = merge_state_dicts("ties", base, experts, {"density": 1.0, "scale": 1.0})
    assert torch.equal(out["w"], t(13.0, 5.0, 10.0))


def test_ties_trimmed_entries_count_as_zero_in_election_and_mean():
    # density 0.5 of n = 2 keeps 1 entry per task.
    # τ1 = [5, -1] -> [5, 0];  τ2 = [-2, -3] -> [0, -3];  τ3 = [-1, 4] -> [0, 4]
    # coord 0: Σ = 5 -> mean {5} = 5;  coord 1: Σ = 1 -> γ = + -> mean {4} = 4
    base, experts = one_tensor([0.0, 0.0], [[5.0, -1.0], [-2.0, -3.0], [-1.0, 4.0]])
    out = merge_state_dicts("ties", base, experts, {"density": 0.5, "scale": 1.0})
    assert torch.equal(out["w"], t(5.0, 4.0))


def test_ties_trimming_tie_at_threshold_keeps_lowest_indices():
    # |τ| = [1, 2, 2, 2, 0], keep round(0.4·5) = 2: the two 2's at indices 1 and 2.
    base, experts = one_tensor([0.0] * 5, [[1.0, 2.0, -2.0, 2.0, 0.0]])
    out = merge_state_dicts("ties", base, experts, {"density": 0.4, "scale": 1.0})
    assert torch.equal(out["w"], t(0.0, 2.0, -2.0, 0.0, 0.0))


def test_ties_keeps_exactly_round_k_n_entries_halves_up():
    assert keep_count(0.5, 5) == 3  # 2.5 -> 3
    assert keep_count(0.2, 4) == 1  # 0.8 -> 1
    assert keep_count(0.1, 4) == 0  # 0.4 -> 0
    assert keep_count(0.2, 15) == 3
    mask = topk_mask(torch.ones(10), 0.25)  # 2.5 -> 3, all tied -> first three
    assert mask.tolist() == [True] * 3 + [False] * 7


@pytest.mark.parametrize("scope", ["tensor", "model"])
def test_ties_density_zero_returns_base(scope):
    base = {"a": t(1.0, 2.0, 3.0), "b": t(-1.0, 0.5)}
    experts = [{"a": t(4.0, 0.0, 3.5), "b": t(2.0, 2.0)}, {"a": t(0.0, 9.0, 1.0), "b": t(-3.0, 0.0)}]
    out = merge_state_dicts("ties", base, experts, {"density": 0.0, "scope": scope, "scale": 1.0})
    for name in base:
        assert torch.equal(out[name], base[name])


def test_ties_model_scope_differs_from_tensor_scope():
    # One expert, τ_a = [10, 9], τ_b = [1, 0.5], density 0.5.
    # Per tensor: keep one of each -> a = [10, 0], b = [1, 0].
    # Whole model: keep round(0.5·4) = 2 largest overall -> a = [10, 9], b = [0, 0].
    base = {"a": t(0.0, 0.0), "b": t(0.0, 0.0)}
    experts = [{"a": t(10.0, 9.0), "b": t(1.0, 0.5)}]
    per_tensor = merge_state_dicts("ties", base, experts, {"density": 0.5, "scale": 1.0})
    whole = merge_state_dicts("ties", base, experts, {"density": 0.5, "scale": 1.0, "scope": "model"})
    assert torch.equal(per_tensor["a"], t(10.0, 0.0)) and torch.equal(per_tensor["b"], t(1.0, 0.0))
    assert torch.equal(whole["a"], t(10.0, 9.0)) and torch.equal(whole["b"], t(0.0, 0.0))


def test_ties_model_scope_threshold_ties_break_by_tensor_order_then_index():
    # |τ| = a:[2, 1], b:[2, 2]; keep 2 -> a[0] and b[0] (first positions among the tied 2's).
    base = {"a": t(0.0, 0.0), "b": t(0.0, 0.0)}
    experts = [{"a": t(2.0, 1.0), "b": t(-2.0, 2.0)}]
    out = merge_state_dicts("ties", base, experts, {"density": 0.5, "scale": 1.0, "scope": "model"})
    assert torch.equal(out["a"], t(2.0, 0.0))
    assert torch.equal(out["b"], t(-2.0, 0.0))


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("density", [0.0, 0.01, 0.2, 0.37, 0.5, 0.99, 1.0])
def test_model_topk_masks_match_sorting_the_concatenation(dtype, density):
    gen = torch.Generator().manual_seed(1)
    # bf16-derived magnitudes repeat a lot, which exercises the tie rule.
    taus = [
        torch.randn(shape, generator=gen).to(torch.bfloat16).to(dtype)
        for shape in [(7, 5), (1,), (40,), (3, 3, 3)]
    ]
    taus[2][::3] = 0.0
    masks = model_topk_masks(taus, density)
    flat = torch.cat([x.abs().flatten() for x in taus])
    k = keep_count(density, flat.numel())
    expected = torch.zeros_like(flat, dtype=torch.bool)
    expected[torch.sort(flat, descending=True, stable=True).indices[:k]] = True
    assert torch.equal(torch.cat([m.flatten() for m in masks]), expected)
    assert int(sum(m.sum() for m in masks)) == k


# --------------------------------------------------------------------------- DARE


def _random_pool(n_experts: int = 3, seed: int = 0) -> tuple[dict, list[dict]]:
    gen = torch.Generator().manual_seed(seed)
    base = {"x.w": torch.randn(8, 6, generator=gen), "x.b": torch.randn(6, generator=gen)}
    experts = [{k: v + 0.1 * torch.randn(v.shape, generator=gen) for k, v in base.items()} for _ in range(n_experts)]
    return base, experts


def test_dare_is_reproducible_for_a_seed_and_changes_with_the_seed():
    base, experts = _random_pool()
    a = merge_state_dicts("dare", base, experts, {"seed": 7})
    b = merge_state_dicts("dare", base, experts, {"seed": 7})
    c = merge_state_dicts("dare", base, experts, {"seed": 8})
    assert all(torch.equal(a[k], b[k]) for k in base)
    assert not torch.equal(a["x.w"], c["x.w"])


def test_dare_masks_do_not_depend_on_dict_order_or_tensor_batching():
    base, experts = _random_pool()
    full = merge_state_dicts("dare", base, experts, {"seed": 3})
    rev = merge_state_dicts(
        "dare",
        dict(reversed(list(base.items()))),
        [dict(reversed(list(e.items()))) for e in experts],
        {"seed": 3},
    )
    for name in base:
        alone = merge_state_dicts("dare", {name: base[name]}, [{name: e[name]} for e in experts], {"seed": 3})
        assert torch.equal(alone[name], full[name])
        assert torch.equal(rev[name], full[name])


def test_dare_expected_value_matches_task_arithmetic_on_large_tensor():
    # E[τ̃] = τ; with p = 0.5 about half the entries survive, doubled.
    n = 200_000
    base = {"w": torch.zeros(n)}
    experts = [{"w": torch.full((n,), 2.0)}, {"w": torch.linspace(-1.0, 3.0, n)}]
    ta = merge_state_dicts("task_arithmetic", base, experts, {"scale": 1.0})
    out = merge_state_dicts("dare", base, experts, {"drop_rate": 0.5, "scale": 1.0, "seed": 0})
    assert abs(out["w"].mean().item() - ta["w"].mean().item()) < 0.02
    kept = (merge_state_dicts("dare", base, experts[:1], {"scale": 1.0})["w"] != 0).float().mean().item()
    assert abs(kept - 0.5) < 0.01


def test_dare_with_zero_drop_rate_equals_task_arithmetic():
    base, experts = _random_pool()
    ta = merge_state_dicts("task_arithmetic", base, experts, {"scale": 0.4})
    out = merge_state_dicts("dare", base, experts, {"drop_rate": 0.0, "scale": 0.4, "seed": 5})
    assert all(torch.equal(out[k], ta[k]) for k in base)


def test_dare_then_ties_with_zero_drop_rate_equals_ties():
    base, experts = _random_pool()
    ties = merge_state_dicts("ties", base, experts, {"density": 0.3, "scale": 0.7, "scope": "model"})
    out = merge_state_dicts(
        "dare", base, experts,
        {"drop_rate": 0.0, "then": "ties", "density": 0.3, "scale": 0.7, "scope": "model"},
    )
    assert all(torch.equal(out[k], ties[k]) for k in base)


@pytest.mark.parametrize("p", [1.0, 1.5, -0.1])
def test_dare_rejects_drop_rate_outside_zero_one(p):
    base, experts = _random_pool()
    with pytest.raises(ValueError, match="drop_rate"):
        merge_state_dicts("dare", base, experts, {"drop_rate": p})


def test_dare_rejects_ties_options_with_task_arithmetic():
    with pytest.raises(ValueError, match="density"):
        build_options("dare", {"density": 0.5})
    assert build_options("dare", {"then": "ties"}).ties_options() == TiesOptions(scale=0.3)
    assert build_options("dare", {"then": "ties", "density": 0.5}) == DareOptions(then="ties", density=0.5)


# --------------------------------------------------------------------------- validation and dtypes


@pytest.mark.parametrize("method", ["average", "task_arithmetic", "ties", "dare"])
def test_non_float_buffers_are_copied_from_base(method):
    base = {"pos_ids": torch.arange(4), "mask": torch.tensor([True, False]), "w": t(0.0, 1.0)}
    experts = [
        {"pos_ids": torch.arange(4) + 10, "mask": torch.tensor([False, True]), "w": t(1.0, 2.0)},
        {"pos_ids": torch.arange(4) * 3, "mask": torch.tensor([False, False]), "w": t(3.0, 1.0)},
    ]
    out = merge_state_dicts(method, base, experts)
    assert list(out) == list(base)
    assert torch.equal(out["pos_ids"], base["pos_ids"]) and out["pos_ids"].dtype == torch.int64
    assert torch.equal(out["mask"], base["mask"]) and out["mask"].dtype == torch.bool


def test_shape_mismatch_error_names_first_tensor_expert_and_shapes():
    base = {"emb": torch.zeros(3), "enc.w": torch.zeros(2, 3), "enc.b": torch.zeros(3)}
    good = {k: v.clone() for k, v in base.items()}
    bad = {"emb": torch.zeros(3), "enc.w": torch.zeros(3, 2), "enc.b": torch.zeros(4)}
    with pytest.raises(ValueError, match=r"'enc\.w'.*expert 1.*\(3, 2\).*\(2, 3\)"):
        merge_state_dicts("average", base, [good, bad])


def test_missing_tensor_error_names_tensor_and_expert():
    base = {"a": torch.zeros(2), "b": torch.zeros(2)}
    with pytest.raises(ValueError, match=r"expert 0 has no tensor 'b'"):
        merge_state_dicts("average", base, [{"a": torch.zeros(2)}])


def test_extra_tensor_error_names_tensor_and_expert():
    base = {"a": torch.zeros(2)}
    experts = [{"a": torch.zeros(2)}, {"a": torch.zeros(2), "head.w": torch.zeros(2)}]
    with pytest.raises(ValueError, match=r"expert 1 has tensor 'head\.w'"):
        merge_state_dicts("average", base, experts)


def test_zero_experts_is_an_error():
    with pytest.raises(ValueError, match="at least one expert"):
        merge_state_dicts("average", {"a": torch.zeros(2)}, [])


def test_unknown_method_error_lists_registered_methods():
    with pytest.raises(ValueError, match=r"'slerp'.*average, dare, .*task_arithmetic, ties"):
        merge_state_dicts("slerp", {"a": torch.zeros(2)}, [{"a": torch.zeros(2)}])


def test_unknown_option_error_names_key_and_method():
    with pytest.raises(ValueError, match=r"'k'.*'ties'"):
        merge_state_dicts("ties", {"a": torch.zeros(2)}, [{"a": torch.zeros(2)}], {"k": 0.2})
    with pytest.raises(ValueError, match=r"'scale'.*'average'"):
        build_options("average", {"scale": 1.0})


def test_invalid_option_values_are_rejected():
    with pytest.raises(ValueError, match="density"):
        build_options("ties", {"density": 1.5})
    with pytest.raises(ValueError, match="scope"):
        build_options("ties", {"scope": "layer"})
    with pytest.raises(ValueError, match="then"):
        build_options("dare", {"then": "average"})


def test_registering_a_name_twice_is_an_error():
    with pytest.raises(ValueError, match="already registered"):
        register("ties", TiesOptions)(lambda base, experts, opts: base)


@pytest.mark.parametrize(
    ("dtype", "compute"),
    [(torch.bfloat16, torch.float32), (torch.float16, torch.float32), (torch.float64, torch.float64)],
)
def test_methods_compute_in_at_least_float32_and_return_base_dtype(probe_method, dtype, compute):
    base = {"w": t(1.0, 2.0, dtype=dtype)}
    experts = [{"w": t(1.5, 2.5, dtype=dtype)}]
    out = merge_state_dicts("_probe", base, experts)
    assert set(probe_method) == {compute}
    assert out["w"].dtype == dtype


@pytest.mark.parametrize("method", ["average", "task_arithmetic", "ties", "dare"])
def test_output_dtype_equals_base_dtype(method):
    base = {"w": t(1.0, 2.0, 3.0, dtype=torch.bfloat16)}
    experts = [{"w": t(1.5, 2.5, 3.5, dtype=torch.bfloat16)}, {"w": t(0.5, 2.0, 4.0, dtype=torch.bfloat16)}]
    assert merge_state_dicts(method, base, experts)["w"].dtype == torch.bfloat16


def test_bf16_base_with_float32_experts_keeps_small_deltas():
    # τ_t = 0.001 each (below bf16's resolution at 1.0); Σ over 10 experts = 0.01, so
    # θ = 1.01 -> bf16 1.0078125. Casting experts to bf16 first would give τ = 0 and θ = 1.0.
    base = {"w": t(1.0, dtype=torch.bfloat16)}
    experts = [{"w": t(1.001)} for _ in range(10)]
    out = merge_state_dicts("task_arithmetic", base, experts, {"scale": 1.0})
    assert out["w"].dtype == torch.bfloat16
    assert out["w"].item() == 1.0078125


def test_a_pretrained_base_with_a_pooler_merges_with_classifiers_that_drop_it(tmp_path):
    """all-mpnet-base-v2 holds pooler tensors; MPNet's sequence classifiers have no pooler. The base
    loaded like the experts, and the lazy merge, both leave the pooler out instead of refusing."""
    import warnings

    from transformers import MPNetModel

    from conftest import perturbed, save_models, tiny_mpnet
    from featcal import merge_models
    from featcal.io.models import load_backbone
    from featcal.merging.lazy import lazy_merge

    task_model = tiny_mpnet()
    base = MPNetModel(task_model.config)
    base.load_state_dict(task_model.mpnet.state_dict(), strict=False)
    experts = {t: perturbed(task_model, i + 2, scale=0.005) for i, t in enumerate("ab")}
    save_models(tmp_path, {"base": base, **experts})
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        assert load_backbone(str(tmp_path / "base")).pooler is not None
        like_experts = load_backbone(str(tmp_path / "base"), like=experts["a"])
        assert like_experts.pooler is None
        merged = merge_models(like_experts, experts, "task_arithmetic", {"scale": 0.3})
        lazy_merge(tmp_path / "base", [tmp_path / t for t in experts], "task_arithmetic", {"scale": 0.3},
                   tmp_path / "lazy", progress=False)
        lazy = load_backbone(str(tmp_path / "lazy"))
    assert lazy.pooler is None
    expected = merged.state_dict()
    for name, value in lazy.state_dict().items():
        assert torch.equal(value, expected[name]), name
