"""Data-free anchor merges (TSV-M, Iso-C, Iso-CTS, WUDI): each against an independent NumPy float64
implementation of its published formula (eigen-decompositions and whitening instead of SVDs,
explicit loops over tasks, a hand-written Adam), the property its paper relies on, and the lazy
(block-by-block) merge giving the same tensors as the in-memory one."""

from __future__ import annotations

import logging

import numpy as np
import pytest
import torch
from transformers import AutoModel

from featcal import merge_models
from featcal.merging.lazy import lazy_merge
from featcal.merging import build_options, merge_state_dicts
from featcal.merging.isotropic import iso_cts_factors, iso_cts_sizes
from featcal.merging.spectral import polar
from featcal.merging.tsv import tsv_factors
from conftest import assert_same_state, perturbed, tiny_bert


# --------------------------------------------------------------------------- NumPy references


def random_taus(seed: int, tasks: int, m: int, n: int) -> list[np.ndarray]:
    rng = np.random.default_rng(seed)
    return [rng.standard_normal((m, n)) for _ in range(tasks)]


def as_state_dicts(taus: list[np.ndarray], seed: int = 99) -> tuple[dict, list[dict], np.ndarray, np.ndarray]:
    """float64 state dicts: a matrix "w" with the given task matrices and a vector "b" (random τ);
    also θ₀ of "w" and the mean task vector of "b"."""
    rng = np.random.default_rng(seed)
    w0 = rng.standard_normal(taus[0].shape)
    b0 = rng.standard_normal(5)
    b_taus = [rng.standard_normal(5) for _ in taus]
    base = {"w": torch.tensor(w0), "b": torch.tensor(b0)}
    experts = [{"w": torch.tensor(w0 + t), "b": torch.tensor(b0 + bt)} for t, bt in zip(taus, b_taus)]
    return base, experts, w0, np.mean(b_taus, axis=0)


def inv_sqrt(gram: np.ndarray) -> np.ndarray:
    vals, vecs = np.linalg.eigh(gram)
    return vecs @ np.diag(vals**-0.5) @ vecs.T


def whiten(a: np.ndarray) -> np.ndarray:
    """polar(A) of a full-rank A as A(AᵀA)^{-1/2} (tall) or (AAᵀ)^{-1/2}A (wide)."""
    return a @ inv_sqrt(a.T @ a) if a.shape[0] >= a.shape[1] else inv_sqrt(a @ a.T) @ a


def top_singular_triplets(a: np.ndarray, k: int) -> list[tuple[np.ndarray, float, np.ndarray]]:
    """(u_j, s_j, v_j) for the k largest singular values, from the eigen-decomposition of AAᵀ."""
    vals, vecs = np.linalg.eigh(a @ a.T)
    out = []
    for j in np.argsort(vals)[::-1][:k]:
        s = np.sqrt(vals[j])
        out.append((vecs[:, j], s, a.T @ vecs[:, j] / s))
    return out


def orthogonalised_product(triplets: list[tuple[np.ndarray, float, np.ndarray]], sigma: float | None = None) -> np.ndarray:
    """Ū⊥ diag(s̄) V̄ᵀ⊥ from the concatenated triplets (s̄ replaced by the constant ``sigma`` if given)."""
    u = np.column_stack([t[0] for t in triplets])
    vt = np.vstack([t[2] for t in triplets])
    s = np.array([t[1] if sigma is None else sigma for t in triplets])
    return whiten(u) @ np.diag(s) @ whiten(vt)


def np_tsv(taus: list[np.ndarray]) -> np.ndarray:
    r = min(taus[0].shape)
    k = r // len(taus)
    triplets = []
    for tau in taus:
        triplets += top_singular_triplets(tau, k)
    return orthogonalised_product(triplets)  # the zero slots past T·k add nothing


def np_iso_c(taus: list[np.ndarray]) -> np.ndarray:
    total = np.zeros_like(taus[0])
    for tau in taus:
        total += tau
    r = min(total.shape)
    small = total.T @ total if total.shape[0] >= total.shape[1] else total @ total.T
    sigma = np.sum(np.sqrt(np.clip(np.linalg.eigvalsh(small), 0, None))) / r  # nuclear norm / r
    return sigma * whiten(total)


def np_iso_cts(taus: list[np.ndarray], fraction: float) -> np.ndarray:
    total = sum(taus)
    m, n = total.shape
    r, tasks = min(m, n), len(taus)
    common0 = int(r * fraction)
    k_t = int(np.round((r - common0) / tasks))  # NumPy also rounds half to even
    k_c = r - tasks * k_t
    common = top_singular_triplets(total, k_c)
    projector = np.eye(m) - sum(np.outer(u, u) for u, _, _ in common)
    triplets = []
    for tau in taus:
        triplets += top_singular_triplets(projector @ tau, k_t)
    triplets += common
    return orthogonalised_product(triplets, sigma=np.mean([t[1] for t in triplets]))


def np_wudi_loss(tau_m: np.ndarray, taus: list[np.ndarray]) -> float:
    return float(sum(np.sum(((tau_m - t) @ t.T) ** 2) / np.sum(t**2) for t in taus))


def np_wudi(taus: list[np.ndarray], iterations: int, lr: float) -> np.ndarray:
    """Adam (β = 0.9, 0.999, ε = 1e-8) on the m×m product form of the loss, gradient by hand."""
    x = sum(taus).copy()
    m1, m2 = np.zeros_like(x), np.zeros_like(x)
    for step in range(1, iterations + 1):
        grad = np.zeros_like(x)
        for t in taus:
            grad += 2.0 * ((x - t) @ t.T) @ t / np.sum(t**2)
        m1 = 0.9 * m1 + 0.1 * grad
        m2 = 0.999 * m2 + 0.001 * grad**2
        x = x - lr * (m1 / (1 - 0.9**step)) / (np.sqrt(m2 / (1 - 0.999**step)) + 1e-8)
    return x


def merged_delta(method: str, taus: list[np.ndarray], **options) -> np.ndarray:
    """Δ of the matrix "w" (α = 1 for the α-scaled methods) through the registry, on float64 state dicts."""
    base, experts, w0, _ = as_state_dicts(taus)
    if method != "wudi":
        options = {"alpha": 1.0, **options}
    return merge_state_dicts(method, base, experts, options)["w"].numpy() - w0


def singular_values(a: np.ndarray) -> np.ndarray:
    return np.linalg.svd(a, compute_uv=False)


# --------------------------------------------------------------------------- TSV-M


@pytest.mark.parametrize("shape,tasks", [((12, 8), 4), ((8, 13), 4), ((12, 9), 4), ((10, 10), 3)])
def test_tsv_m_equals_whitened_concatenation_of_each_tasks_top_singular_vectors(shape, tasks):
    taus = random_taus(1, tasks, *shape)
    base, experts, w0, b_mean = as_state_dicts(taus)
    out = merge_state_dicts("tsv_m", base, experts, {"alpha": 0.7})
    np.testing.assert_allclose(out["w"].numpy(), w0 + 0.7 * np_tsv(taus), atol=1e-10)
    b0 = base["b"].numpy()
    np.testing.assert_allclose(out["b"].numpy(), b0 + 0.7 * b_mean, atol=1e-12)


def test_tsv_m_task_bases_are_orthogonal_after_decorrelation_and_keep_the_singular_values():
    taus = [torch.tensor(t) for t in random_taus(2, 3, 9, 14)]  # r = 9, k = 3, no empty slot
    u, s, vh = tsv_factors(taus)
    k = 3
    assert torch.allclose(u.T @ u, torch.eye(9, dtype=u.dtype), atol=1e-12)
    assert torch.allclose(vh @ vh.T, torch.eye(9, dtype=u.dtype), atol=1e-12)
    raw = [torch.linalg.svd(t, full_matrices=False)[0][:, :k] for t in taus]
    for i in range(3):
        for j in range(i + 1, 3):
            assert (raw[i].T @ raw[j]).abs().max() > 0.05  # the tasks' raw bases interfere ...
            block_i, block_j = slice(i * k, (i + 1) * k), slice(j * k, (j + 1) * k)
            assert (u[:, block_i].T @ u[:, block_j]).abs().max() < 1e-12  # ... their decorrelated ones do not
            assert (vh[block_i] @ vh[block_j].T).abs().max() < 1e-12
    delta = merged_delta("tsv_m", [t.numpy() for t in taus])
    np.testing.assert_allclose(delta, ((u * s) @ vh).numpy(), atol=1e-12)
    np.testing.assert_allclose(singular_values(delta), np.sort(s.numpy())[::-1], atol=1e-10)


def test_tsv_m_of_tasks_in_orthogonal_subspaces_is_their_sum_and_of_one_task_is_the_task():
    rng = np.random.default_rng(3)
    left = np.linalg.qr(rng.standard_normal((12, 12)))[0]
    right = np.linalg.qr(rng.standard_normal((10, 10)))[0]
    taus = [left[:, 2 * i:2 * i + 2] @ np.diag(rng.uniform(1, 3, 2)) @ right[:, 2 * i:2 * i + 2].T for i in range(4)]
    np.testing.assert_allclose(merged_delta("tsv_m", taus), sum(taus), atol=1e-12)  # k = 10 // 4 = 2
    np.testing.assert_allclose(merged_delta("tsv_m", taus[:1]), taus[0], atol=1e-12)


def test_tsv_m_leaves_a_matrix_of_rank_below_the_task_count_at_base(caplog):
    taus = random_taus(4, 5, 3, 6)  # r = 3 < T = 5: k = 0
    with caplog.at_level(logging.WARNING):
        assert np.all(merged_delta("tsv_m", taus) == 0)
    assert "'w'" in caplog.text and "k = 0" in caplog.text


# --------------------------------------------------------------------------- Iso-C


@pytest.mark.parametrize("shape", [(9, 6), (6, 11), (7, 7)])
def test_iso_c_equals_mean_singular_value_times_polar_factor_of_the_task_sum(shape):
    taus = random_taus(5, 4, *shape)
    base, experts, w0, b_mean = as_state_dicts(taus)
    out = merge_state_dicts("iso_c", base, experts)  # default α = 1.30
    np.testing.assert_allclose(out["w"].numpy(), w0 + 1.30 * np_iso_c(taus), atol=1e-10)
    np.testing.assert_allclose(out["b"].numpy(), base["b"].numpy() + 1.30 * b_mean, atol=1e-12)


def test_iso_c_spectrum_is_flat_and_keeps_the_nuclear_norm_of_the_task_sum():
    taus = random_taus(6, 3, 6, 10)
    delta = merged_delta("iso_c", taus)
    sigma = singular_values(sum(taus)).mean()
    np.testing.assert_allclose(singular_values(delta), np.full(6, sigma), rtol=1e-12)
    np.testing.assert_allclose(delta @ delta.T, sigma**2 * np.eye(6), atol=1e-10)
    assert singular_values(delta).sum() == pytest.approx(singular_values(sum(taus)).sum(), rel=1e-12)
    np.testing.assert_allclose(merged_delta("iso_c", [t.T for t in taus]), delta.T, atol=1e-12)


def test_iso_c_averages_all_r_singular_values_zeros_included_and_warns_on_rank_deficiency(caplog):
    rng = np.random.default_rng(16)
    taus = [np.outer(rng.standard_normal(6), rng.standard_normal(8)) for _ in range(2)]  # Σ τ has rank 2 of r = 6
    with caplog.at_level(logging.WARNING):
        delta = merged_delta("iso_c", taus)
    np.testing.assert_allclose(singular_values(delta), np.full(6, singular_values(sum(taus)).sum() / 6), rtol=1e-10)
    assert "'w'" in caplog.text and "rank deficient" in caplog.text


# --------------------------------------------------------------------------- Iso-CTS


@pytest.mark.parametrize("r,tasks,k_c,k_t", [
    (768, 8, 616, 19), (768, 14, 614, 11), (768, 20, 608, 8), (50, 8, 42, 1), (50, 20, 50, 0),
    (4096, 8, 3280, 102), (770, 4, 618, 38),  # the last: (770 − 616)/4 = 38.5 rounds half to even
])
def test_iso_cts_subspace_sizes_follow_the_official_half_to_even_rounding(r, tasks, k_c, k_t):
    assert iso_cts_sizes(r, tasks, 0.8) == (k_c, k_t)


@pytest.mark.parametrize("shape,fraction", [((12, 16), 0.5), ((16, 12), 0.8), ((14, 14), 0.6)])
def test_iso_cts_equals_isotropic_common_plus_task_specific_reference(shape, fraction):
    taus = random_taus(7, 3, *shape)
    base, experts, w0, b_mean = as_state_dicts(taus)
    out = merge_state_dicts("iso_cts", base, experts, {"common_space_fraction": fraction})  # α = 1.50
    np.testing.assert_allclose(out["w"].numpy(), w0 + 1.50 * np_iso_cts(taus, fraction), atol=1e-10)
    np.testing.assert_allclose(out["b"].numpy(), base["b"].numpy() + 1.50 * b_mean, atol=1e-12)


def test_iso_cts_task_subspaces_are_orthogonal_to_the_common_one_and_the_spectrum_is_flat():
    taus = [torch.tensor(t) for t in random_taus(8, 3, 12, 16)]
    k_c, k_t = iso_cts_sizes(12, 3, 0.5)
    assert (k_c, k_t) == (6, 2)
    u_bar, s_bar, vh_bar = iso_cts_factors(taus, 0.5)
    common = u_bar[:, 3 * k_t:]
    for i in range(3):
        specific = u_bar[:, i * k_t:(i + 1) * k_t]
        assert (common.T @ specific).abs().max() < 1e-12
    u_orth = polar(u_bar)
    assert torch.allclose(u_orth.T @ u_orth, torch.eye(12, dtype=u_orth.dtype), atol=1e-12)
    delta = merged_delta("iso_cts", [t.numpy() for t in taus], common_space_fraction=0.5)
    np.testing.assert_allclose(singular_values(delta), np.full(12, s_bar.mean().item()), rtol=1e-10)


def test_iso_cts_with_the_whole_common_space_is_iso_c_and_depends_on_the_layout():
    taus = random_taus(9, 3, 8, 11)
    np.testing.assert_allclose(merged_delta("iso_cts", taus, common_space_fraction=1.0),
                               merged_delta("iso_c", taus), atol=1e-12)
    flipped = merged_delta("iso_cts", [t.T for t in taus], common_space_fraction=0.5).T
    assert np.abs(flipped - merged_delta("iso_cts", taus, common_space_fraction=0.5)).max() > 1e-3


def test_iso_cts_names_the_tensor_when_the_task_slots_exceed_its_rank():
    base, experts, _, _ = as_state_dicts(random_taus(10, 2, 3, 3))  # r = 3, f = 0.1: k_c0 = 0, S = 4 > 3
    with pytest.raises(ValueError, match=r"tensor 'w'.*more than r"):
        merge_state_dicts("iso_cts", base, experts, {"common_space_fraction": 0.1})


# --------------------------------------------------------------------------- WUDI


@pytest.mark.parametrize("shape", [(6, 4), (4, 7)])
def test_wudi_equals_hand_written_adam_on_the_interference_loss(shape):
    taus = random_taus(11, 3, *shape)
    base, experts, w0, _ = as_state_dicts(taus)
    out = merge_state_dicts("wudi", base, experts, {"iterations": 40, "lr": 1e-2})
    np.testing.assert_allclose(out["w"].numpy(), w0 + np_wudi(taus, 40, 1e-2), atol=1e-9)
    assert torch.equal(out["b"], base["b"])  # not a matrix: stays θ₀ (official rule)


def test_wudi_interference_loss_falls_from_the_task_arithmetic_sum():
    taus = [0.01 * t for t in random_taus(12, 4, 16, 12)]  # fine-tuning-sized entries, float32 tensors
    base = {"w": torch.zeros(16, 12)}
    experts = [{"w": torch.tensor(t, dtype=torch.float32)} for t in taus]
    losses = []
    for iterations in (0, 50, 100, 200, 300):
        tau_m = merge_state_dicts("wudi", base, experts, {"iterations": iterations})["w"].double().numpy()
        losses.append(np_wudi_loss(tau_m, taus))
        assert np.abs(tau_m - sum(taus)).max() <= 3.2 * iterations * 1e-5 + 1e-7  # Adam's step bound
    assert losses[0] == pytest.approx(np_wudi_loss(sum(taus), taus), rel=1e-6)
    assert all(b <= a + 1e-6 * losses[0] for a, b in zip(losses, losses[1:]))
    assert losses[-1] < 0.9 * losses[0]


def test_wudi_keeps_the_sum_for_one_task_zero_iterations_and_skips_zero_task_vectors():
    taus = random_taus(13, 3, 5, 4)
    np.testing.assert_allclose(merged_delta("wudi", taus[:1], iterations=10, lr=1e-2), taus[0], atol=1e-14)
    np.testing.assert_allclose(merged_delta("wudi", taus, iterations=0), sum(taus), atol=1e-15)
    with_zero = merged_delta("wudi", [*taus[:2], np.zeros((5, 4))], iterations=20, lr=1e-2)
    np.testing.assert_allclose(with_zero, np_wudi(taus[:2], 20, 1e-2), atol=1e-9)
    again = merged_delta("wudi", [*taus[:2], np.zeros((5, 4))], iterations=20, lr=1e-2)
    np.testing.assert_array_equal(with_zero, again)  # deterministic: no randomness at all


def test_wudi_optimises_only_non_embedding_matrices_unless_told_otherwise():
    rng = np.random.default_rng(14)
    base = {"embeddings.word_embeddings.weight": torch.zeros(7, 4), "layer.0.dense.weight": torch.zeros(4, 4),
            "layer.0.dense.bias": torch.zeros(4)}
    experts = [{k: torch.tensor(rng.standard_normal(tuple(v.shape)), dtype=torch.float32) for k, v in base.items()}
               for _ in range(2)]
    out = merge_state_dicts("wudi", base, experts, {"iterations": 5, "lr": 1e-2})
    assert not out["embeddings.word_embeddings.weight"].any() and not out["layer.0.dense.bias"].any()
    assert not torch.allclose(out["layer.0.dense.weight"], experts[0]["layer.0.dense.weight"] + experts[1]["layer.0.dense.weight"])
    fusion = merge_state_dicts("wudi", base, experts, {"iterations": 5, "lr": 1e-2, "others": "average", "exclude": []})
    mean_bias = (experts[0]["layer.0.dense.bias"] + experts[1]["layer.0.dense.bias"]) / 2
    assert torch.allclose(fusion["layer.0.dense.bias"], mean_bias)
    assert fusion["embeddings.word_embeddings.weight"].any()


# --------------------------------------------------------------------------- options and lazy merge


@pytest.mark.parametrize("method,options,message", [
    ("tsv_m", {"alpha": "big"}, "'alpha' must be a finite number"),
    ("iso_c", {"exclude": "embed"}, "'exclude' must be a list"),
    ("iso_c", {"exclude": ["("]}, "pattern '\\(' is invalid"),
    ("iso_cts", {"common_space_fraction": 0.0}, "'common_space_fraction' must be in"),
    ("iso_cts", {"svd_dtype": "float16"}, "'svd_dtype' must be one of"),
    ("wudi", {"iterations": -1}, "'iterations' must be an integer"),
    ("wudi", {"lr": 0.0}, "'lr' must be > 0"),
    ("wudi", {"others": "zero"}, "'others' must be one of"),
])
def test_options_reject_bad_values_naming_the_option(method, options, message):
    with pytest.raises(ValueError, match=message):
        build_options(method, options)


def test_excluded_matrices_get_the_scaled_mean_task_vector():
    base, experts, w0, _ = as_state_dicts(random_taus(15, 3, 6, 5))
    out = merge_state_dicts("tsv_m", base, experts, {"alpha": 0.5, "exclude": ["^w$"]})
    mean_tau = sum(e["w"] for e in experts) / 3 - base["w"]
    assert torch.allclose(out["w"], base["w"] + 0.5 * mean_tau, atol=1e-12)


@pytest.fixture(scope="module")
def bert_checkpoints(tmp_path_factory):
    root = tmp_path_factory.mktemp("anchors")
    base = tiny_bert(layers=2)
    experts = {t: perturbed(base, i + 1, scale=0.005, num_labels=2 + i) for i, t in enumerate("abc")}  # fine-tune sized
    base.save_pretrained(root / "base")
    for t, model in experts.items():
        model.save_pretrained(root / t, max_shard_size="20KB")
    return root, base, experts


@pytest.mark.parametrize("method", ["tsv_m", "iso_c", "iso_cts", "wudi"])
def test_lazy_merge_gives_the_tensors_of_the_in_memory_merge(bert_checkpoints, tmp_path, method):
    root, base, experts = bert_checkpoints  # default options (WUDI: 300 Adam steps per matrix)
    out = lazy_merge(root / "base", {t: root / t for t in experts}, method, None, tmp_path / "merged",
                     max_shard_size="30KB", progress=False)
    expected = merge_models(base, experts, method)
    assert_same_state(AutoModel.from_pretrained(out).eval(), expected)
    assert not torch.equal(expected.encoder.layer[0].attention.self.query.weight,
                           base.bert.encoder.layer[0].attention.self.query.weight)
